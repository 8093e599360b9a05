"""``specdec data``: build the corpora the shipped models train on, from text on the machine.

    specdec data gettext --out data/gettext-de      # English→German pairs from the .mo catalogues
    specdec data outputs --target MODEL --prompts prompts.txt --out runs/outputs.jsonl
                                                    # MODEL's continuations of your prompts (drafter data)

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


def _cmd_outputs(args: argparse.Namespace) -> int:
    from specdec.train.outputs import user_outputs

    counts = user_outputs(args.target, args.prompts, args.out, num_prompts=args.num_prompts,
                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                          sampled_share=args.sampled_share, valid_share=args.valid_share, dtype=args.dtype,
                          device=args.device, seed=args.seed)
    print(", ".join(f"{path}: {n} records" for path, n in counts.items()))
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

    out = sub.add_parser("outputs", help="the target's continuations of your prompts: drafter data (resumable)",
                         description="Continue every prompt of --prompts with the target (our batched decoder; "
                         "greedy, a --sampled-share at temperature 1) and write one JSON line per prompt to --out, "
                         "the --valid-share held out (by a hash of the prompt) to OUT.valid.jsonl beside it. "
                         "Run it again to resume: only the missing prompts are generated.")
    out.add_argument("--target", required=True, help="the target model's folder (or a shipped name)")
    out.add_argument("--prompts", required=True, metavar="FILE",
                     help='one prompt per line; or .jsonl with "prompt", "messages" (rendered by the target\'s '
                     'chat template) or, for an encoder-decoder target, "source" per line')
    out.add_argument("--out", required=True, help="JSONL file to append to (run again to resume)")
    out.add_argument("--num-prompts", type=int, default=None, help="only the file's first N prompts (default: all)")
    out.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    out.add_argument("--batch-size", type=int, default=16, help="prompts decoded together (default: %(default)s)")
    out.add_argument("--sampled-share", type=float, default=0.25,
                     help="share of prompts continued by sampling at temperature 1 (default: %(default)s)")
    out.add_argument("--valid-share", type=float, default=0.05,
                     help="share of prompts held out to OUT.valid.jsonl (default: %(default)s)")
    out.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: fp32 on CPU, bf16 on CUDA)")
    out.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when there is one)")
    out.add_argument("--seed", type=int, default=0, help="seed of the sampled continuations (default: %(default)s)")
    out.set_defaults(func=_cmd_outputs)
