"""The Python standard library as a code corpus.

Contract: the corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (never
``site-packages``) that decodes as UTF-8. Each file goes to exactly one split, chosen by a hash of
its path relative to the stdlib root, so the split is deterministic, disjoint and stable when files
are added or removed elsewhere. The test split is never trained on.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SPLITS = ("train", "validation", "test")
# Share of files in each split, in percent (hash buckets 0..99).
_BUCKETS = {"train": range(90), "validation": range(90, 95), "test": range(95, 100)}


@dataclass(frozen=True)
class SourceFile:
    """One file of the corpus."""

    relpath: str  # path relative to the stdlib root, with "/" separators
    text: str  # the file's source, exactly as on disk


def stdlib_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """The split a file belongs to, from a hash of its relative path."""
    bucket = int(hashlib.sha256(relpath.encode("utf-8")).hexdigest(), 16) % 100
    return next(name for name, r in _BUCKETS.items() if bucket in r)


def _corpus_paths(root: Path) -> list[Path]:
    return sorted(
        p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts and p.is_file()
    )


@lru_cache(maxsize=8)
def load_split(split: str, root: str | None = None) -> tuple[SourceFile, ...]:
    """All files of one split, sorted by path. Files that are not valid UTF-8 are left out."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    base = Path(root) if root is not None else stdlib_root()
    files = []
    for path in _corpus_paths(base):
        rel = path.relative_to(base).as_posix()
        if split_of(rel) != split:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(SourceFile(rel, text))
    return tuple(files)


def corpus_stats(root: str | None = None) -> dict[str, dict[str, int]]:
    """Files and characters per split (what the model cards report)."""
    return {
        s: {"files": len(fs), "chars": sum(len(f.text) for f in fs)}
        for s in SPLITS
        for fs in [load_split(s, root)]
    }
