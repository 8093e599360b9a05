"""``specdec data``: build the corpora the shipped models train on, from text on the machine.

    specdec data gettext --out data/gettext-de      # English→German pairs from the .mo catalogues

Bad input (no German catalogue, an unreadable folder) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse


def _cmd_gettext(args: argparse.Namespace) -> int:
    from specdec.data.gettext import SPLITS, build_corpus, split_stats, write_corpus

    corpus = build_corpus(args.locale_dir, args.language)
    out = write_corpus(corpus, args.out, source=args.locale_dir)
    for split in SPLITS:
        s = split_stats(corpus.splits[split])
        print(f"{split}: {s['pairs']} pairs from {s['catalogues']} catalogues, "
              f"{s['src_chars']} English / {s['tgt_chars']} German characters")
    print(f"wrote {', '.join(f'{s}.jsonl' for s in SPLITS)} and CARD.md to {out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``specdec data`` and its subcommands."""
    from specdec.data.gettext import LOCALE_DIR

    data = subparsers.add_parser("data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = data.add_subparsers(dest="data_command", required=True, metavar="CORPUS")
    gt = sub.add_parser("gettext", help="English→German pairs from the installed gettext catalogues",
                        description="Read the German .mo catalogues under the locale folder and write "
                        "train/validation/test JSONL ({src, tgt, catalogue} per line) and a data card, "
                        "split by catalogue and deduplicated.")
    gt.add_argument("--out", required=True, help="folder for train.jsonl, validation.jsonl, test.jsonl, CARD.md")
    gt.add_argument("--locale-dir", default=LOCALE_DIR, help="the system locale folder (default: %(default)s)")
    gt.add_argument("--language", default="de", help="the catalogues' language code (default: %(default)s)")
    gt.set_defaults(func=_cmd_gettext)
