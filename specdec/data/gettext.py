"""An English→German parallel corpus from the gettext catalogues installed on the machine.

Contract: ``build_corpus(locale_dir)`` reads every German message catalogue
(``<locale_dir>/de*/LC_MESSAGES/*.mo``; one catalogue per domain: the plain ``de`` one where it
exists, else the first regional variant by name, ``de_AT`` before ``de_CH``) and returns
English→German pairs in three splits that never share a catalogue:

- each catalogue's charset (the ``charset=`` of its header entry) decodes its strings; the .mo
  file is parsed here, not by ``gettext.GNUTranslations``, which decodes the header as UTF-8
  before it knows the charset and so fails on real ISO-8859-1 catalogues (net-tools);
- a plural entry gives two kinds of pair: ``msgid`` with ``msgstr[0]``, ``msgid_plural`` with
  each later ``msgstr[i]``; a context (``msgctxt``, stored as ``"ctxt\\x04msgid"``) is stripped;
- texts are kept exactly as the catalogue has them: format markers (``%s``, ``%1$s``, ``{0}``,
  ``{name}``), accelerators (``&``, ``_``), newlines and edge spaces are never touched;
- the header entry (empty msgid) and empty translations are skipped;
- the split is by catalogue: domains in the order of a SHA-256 hash of their name fill the test
  and then the validation split up to ``shares`` of all pairs each (a catalogue that would
  overfill both goes to train), so it is deterministic and by pair count;
- deduplication: a pair appears once per split; a validation or test pair whose English source
  also occurs in train is dropped (so is a test pair whose source occurs in validation), so no
  held-out source is ever trained on.

``write_corpus`` writes ``{split}.jsonl`` (``{"src", "tgt", "catalogue"}`` per line, in catalogue
then catalogue order) and ``CARD.md``, the data card; ``load_pairs`` reads a split back. Where no
German catalogue exists, ``NoCatalogueError`` (a ``ValueError``: the CLI's one line, exit 2).

Why this corpus: SpecDec (Xia et al., EMNLP 2023 Findings) is a translation method; the machine
has no WMT data and no downloads, but every Linux install carries translated UI messages.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

SPLITS = ("train", "validation", "test")
LOCALE_DIR = "/usr/share/locale"  # where packages install their catalogues (Debian, Fedora, Arch)
HELD_OUT_SHARES = {"test": 0.05, "validation": 0.05}  # share of all pairs per held-out split, filled in this order
_MAGIC = 0x950412DE  # a .mo file's first word, in the byte order it was written with
_CONTEXT = "\x04"  # between msgctxt and msgid in an original string
_CHARSET = re.compile(rb"charset=\s*([A-Za-z0-9_.:-]+)", re.IGNORECASE)


class NoCatalogueError(ValueError):
    """The locale folder holds no catalogue of the language asked for."""


class MoFormatError(ValueError):
    """A file is not a valid gettext .mo catalogue."""


@dataclass(frozen=True)
class MoEntry:
    """One message of a .mo catalogue, decoded."""

    context: str | None  # msgctxt, None when the message has none
    msgid: str
    msgid_plural: str | None  # None for a singular message
    msgstr: tuple[str, ...]  # one translation, or one per plural form


@dataclass(frozen=True)
class Pair:
    """One English→German pair of the corpus."""

    src: str  # English (a msgid or msgid_plural)
    tgt: str  # German (the msgstr form that translates it)
    catalogue: str  # the gettext domain it came from (e.g. "coreutils")


@dataclass(frozen=True)
class Catalogue:
    """One domain's pairs, deduplicated within the catalogue."""

    name: str  # the domain: the .mo file's name without extension
    locale: str  # the locale folder it was read from ("de", "de_CH")
    charset: str  # the charset its header declares
    pairs: tuple[Pair, ...]
    skipped_empty: int = 0  # entries or plural forms with an empty translation


@dataclass
class Corpus:
    """The three splits and what was dropped on the way."""

    splits: dict[str, list[Pair]]  # split -> pairs
    catalogues: dict[str, list[str]]  # split -> catalogue names
    catalogue_pairs: dict[str, int]  # catalogue -> pairs it contributed (after every filter)
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> pairs dropped


@dataclass(frozen=True)
class MoFile:
    """A parsed .mo file."""

    charset: str  # what its header declares (utf-8 when it declares none)
    entries: tuple[MoEntry, ...]  # every message, the header entry (empty msgid) included


def _declared_charset(header: bytes) -> str:
    match = _CHARSET.search(header)
    if match is None or match.group(1).upper() == b"CHARSET":  # "CHARSET" is the .pot placeholder
        return "utf-8"
    return match.group(1).decode("ascii")


def parse_mo(data: bytes) -> MoFile:
    """Decode a .mo file (either byte order) with the charset its header declares."""
    if len(data) < 20:
        raise MoFormatError("too short for a .mo header")
    for order in "<>":
        if struct.unpack(order + "I", data[:4])[0] == _MAGIC:
            break
    else:
        raise MoFormatError("bad magic number: not a gettext .mo file")
    revision, count, originals, translations = struct.unpack(order + "4I", data[4:20])
    if revision >> 16 > 1:
        raise MoFormatError(f"unknown .mo major revision {revision >> 16}")

    def string(table: int, i: int) -> bytes:
        length, offset = struct.unpack(order + "2I", data[table + 8 * i : table + 8 * i + 8])
        if offset + length > len(data):
            raise MoFormatError("a string runs past the end of the file")
        return data[offset : offset + length]

    raw = [(string(originals, i), string(translations, i)) for i in range(count)]
    charset = next((_declared_charset(t) for o, t in raw if o == b""), "utf-8")
    entries = []
    for original, translation in raw:
        text, forms = original.decode(charset), translation.decode(charset)
        context = None
        if _CONTEXT in text:
            context, _, text = text.partition(_CONTEXT)
        msgid, plural_sep, plural = text.partition("\x00")
        entries.append(MoEntry(context, msgid, plural if plural_sep else None, tuple(forms.split("\x00"))))
    return MoFile(charset, tuple(entries))


def entry_pairs(entry: MoEntry) -> list[tuple[str, str]]:
    """The (English, German) pairs of one message: (msgid, msgstr) for a singular one,
    (msgid, msgstr[0]) and (msgid_plural, msgstr[i]) for i >= 1 for a plural one. Empty
    translations and the header entry (empty msgid) give none."""
    if entry.msgid == "":
        return []
    if entry.msgid_plural is None:
        sources = [entry.msgid]
    else:
        sources = [entry.msgid] + [entry.msgid_plural] * (len(entry.msgstr) - 1)
    return [(src, tgt) for src, tgt in zip(sources, entry.msgstr) if src and tgt]


def read_catalogue(path: str | Path) -> Catalogue:
    """One .mo file as a catalogue of unique pairs (in file order)."""
    path = Path(path)
    data = path.read_bytes()
    try:
        mo = parse_mo(data)
    except (UnicodeDecodeError, LookupError) as err:
        raise MoFormatError(f"{path}: cannot decode with its declared charset ({err})") from err
    name = path.stem
    seen: dict[tuple[str, str], None] = {}
    empty = 0
    for entry in mo.entries:
        if entry.msgid == "":
            continue
        empty += sum(1 for t in entry.msgstr if not t)
        for pair in entry_pairs(entry):
            seen.setdefault(pair, None)
    return Catalogue(name, path.parent.parent.name, mo.charset,
                     tuple(Pair(s, t, name) for s, t in seen), skipped_empty=empty)


def _is_language(locale: str, language: str) -> bool:
    return locale == language or locale.startswith((language + "_", language + "@"))


def find_catalogues(locale_dir: str | Path = LOCALE_DIR, language: str = "de") -> list[Path]:
    """One .mo path per domain: ``<language>`` where it has the domain, else the first variant by name."""
    base = Path(locale_dir)
    locales = sorted((p.name for p in base.iterdir() if p.is_dir() and _is_language(p.name, language)),
                     key=lambda loc: (loc != language, loc)) if base.is_dir() else []
    chosen: dict[str, Path] = {}
    for locale in locales:
        for path in sorted((base / locale / "LC_MESSAGES").glob("*.mo")):
            chosen.setdefault(path.stem, path)
    if not chosen:
        raise NoCatalogueError(
            f"no {language!r} gettext catalogue under {base} (looked for {base}/{language}*/LC_MESSAGES/*.mo): "
            f"install translated packages (e.g. `apt-get install language-pack-{language}` or any package "
            "with translations) or pass --locale-dir with a folder that has them"
        )
    return [chosen[name] for name in sorted(chosen)]


def catalogue_hash(name: str) -> int:
    """The order in which catalogues fill the held-out splits: a hash of the domain name."""
    return int(hashlib.sha256(name.encode("utf-8")).hexdigest(), 16)


def assign_splits(sizes: dict[str, int], shares: dict[str, float] = HELD_OUT_SHARES) -> dict[str, str]:
    """Catalogue -> split. In hash order, a catalogue goes to the first held-out split it fits in
    (its pairs plus those already there at most ``share`` of all pairs), else to train."""
    total = sum(sizes.values())
    filled = dict.fromkeys(shares, 0)
    where: dict[str, str] = {}
    for name in sorted(sizes, key=catalogue_hash):
        split = next((s for s in shares if filled[s] + sizes[name] <= shares[s] * total), "train")
        if split != "train":
            filled[split] += sizes[name]
        where[name] = split
    return where


def build_corpus(locale_dir: str | Path = LOCALE_DIR, language: str = "de",
                 shares: dict[str, float] = HELD_OUT_SHARES) -> Corpus:
    """Read, split and deduplicate the catalogues of ``language`` (see the module's contract)."""
    catalogues = []
    dropped = {"empty translation": 0, "undecodable catalogue": 0}
    for path in find_catalogues(locale_dir, language):
        try:
            catalogues.append(read_catalogue(path))
        except MoFormatError:
            dropped["undecodable catalogue"] += 1
            continue
        dropped["empty translation"] += catalogues[-1].skipped_empty
    if not catalogues:
        raise NoCatalogueError(f"no readable {language!r} catalogue under {locale_dir}")
    where = assign_splits({c.name: len(c.pairs) for c in catalogues}, shares)
    splits: dict[str, list[Pair]] = {s: [] for s in SPLITS}
    dropped.update({"duplicate in split": 0, "source seen in train": 0, "source seen in validation": 0})
    seen_pairs: dict[str, set[tuple[str, str]]] = {s: set() for s in SPLITS}
    sources: dict[str, set[str]] = {s: set() for s in SPLITS}
    for split in SPLITS:  # train first: held-out splits are filtered against it
        earlier = [sources[s] for s in SPLITS[: SPLITS.index(split)]]
        for cat in (c for c in catalogues if where[c.name] == split):
            for pair in cat.pairs:
                key = (pair.src, pair.tgt)
                if key in seen_pairs[split]:
                    dropped["duplicate in split"] += 1
                elif any(pair.src in e for e in earlier):
                    dropped["source seen in train" if pair.src in sources["train"]
                            else "source seen in validation"] += 1
                else:
                    seen_pairs[split].add(key)
                    splits[split].append(pair)
        sources[split] = {p.src for p in splits[split]}
    counts: dict[str, int] = {c.name: 0 for c in catalogues}
    for pairs in splits.values():
        for p in pairs:
            counts[p.catalogue] += 1
    names = {s: sorted(c.name for c in catalogues if where[c.name] == s) for s in SPLITS}
    return Corpus(splits, names, counts, dropped)


def write_corpus(corpus: Corpus, out_dir: str | Path, source: str = LOCALE_DIR) -> Path:
    """Write ``{split}.jsonl`` and the data card ``CARD.md`` into ``out_dir``; return the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for split, pairs in corpus.splits.items():
        with (out / f"{split}.jsonl").open("w", encoding="utf-8") as f:
            for p in pairs:
                f.write(json.dumps(asdict(p), ensure_ascii=False) + "\n")
    (out / "CARD.md").write_text(data_card(corpus, source), encoding="utf-8")
    return out


def load_pairs(data_dir: str | Path, split: str) -> list[Pair]:
    """One split written by ``write_corpus``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    path = Path(data_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no {path}: build the corpus with `specdec data gettext --out {data_dir}`")
    with path.open(encoding="utf-8") as f:
        return [Pair(**json.loads(line)) for line in f if line.strip()]


def split_stats(pairs: Sequence[Pair]) -> dict[str, int]:
    """Pairs, catalogues and characters of one split (what the data card reports)."""
    return {"pairs": len(pairs), "catalogues": len({p.catalogue for p in pairs}),
            "src_chars": sum(len(p.src) for p in pairs), "tgt_chars": sum(len(p.tgt) for p in pairs)}


def _table(rows: Iterable[Sequence[object]], header: Sequence[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def data_card(corpus: Corpus, source: str = LOCALE_DIR) -> str:
    """The data card: where the pairs come from, how they were filtered, counts per split."""
    stats = {s: split_stats(corpus.splits[s]) for s in SPLITS}
    rows = [(s, stats[s]["catalogues"], stats[s]["pairs"], stats[s]["src_chars"], stats[s]["tgt_chars"])
            for s in SPLITS]
    total = [sum(r[i] for r in rows) for i in range(1, 5)]
    per_split = "\n".join(
        f"- **{s}** ({len(corpus.catalogues[s])}): "
        + ", ".join(f"{n} ({corpus.catalogue_pairs[n]})" for n in corpus.catalogues[s])
        for s in SPLITS
    )
    return f"""# Data card: gettext English→German

English→German message pairs from the German gettext catalogues (`.mo`) installed under
`{source}`, built by `specdec data gettext` (`specdec/data/gettext.py`).

## Counts

{_table(rows + [("all", *total)], ("split", "catalogues", "pairs", "English chars", "German chars"))}

Dropped: {", ".join(f"{k}: {v}" for k, v in corpus.dropped.items())}.

## How it was built

- One catalogue per gettext domain (plain `de`, else a regional variant); each is decoded with the
  charset its header declares.
- Plural messages give `msgid`→`msgstr[0]` and `msgid_plural`→`msgstr[1..]`; `msgctxt` is
  stripped; the header entry and empty translations are skipped.
- Texts are exactly as in the catalogues: format markers (`%s`, `%1$s`, `{{0}}`), accelerators
  (`&`, `_`), newlines and edge spaces are kept.
- Split by catalogue, never within one: catalogues in SHA-256 order of their name fill test and
  then validation up to {", ".join(f"{v:.0%} ({k})" for k, v in HELD_OUT_SHARES.items())} of the
  pairs; the rest is train.
- Deduplicated within each split; a validation or test pair whose English source also occurs in
  train (a test pair: or in validation) is dropped, so no held-out source is trained on.

## Catalogues (pairs kept)

{per_split}

## Caveats

Software messages: short (menu items, errors, option help), many names (the ISO 639/3166/4217
catalogues: languages, countries, currencies), technical vocabulary. The test split is a handful
of whole catalogues, so its domain mix differs from train. The catalogues' licences are those of
their packages (mostly GPL/LGPL); the corpus is built on each machine, never shipped.
"""
