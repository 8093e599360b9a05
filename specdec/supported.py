"""The transformers releases specdec runs on, checked when ``specdec`` is first imported (``specdec/__init__.py``),
from the installed distribution's version, before any module of specdec imports transformers (so that no torch is
imported for it, and an older release is named, not met as ``cannot import name 'DummyLayer'`` deep in an import).

- 5.23 is the first release with every cache class specdec reads (``DummyLayer``: 5.17-5.22 fail at import).
- 5.24 renames ``past_key_values`` / ``cache_params`` to ``cache`` in every forward's signature (and outputs), which
  ``specdec.architectures``' checks read: specdec is not ported to it yet. pyproject.toml pins the same range.
"""

from __future__ import annotations

import importlib.metadata

FIRST_SUPPORTED = (5, 23)
UNPORTED_TRANSFORMERS = (5, 24)
INSTALL = "pip install 'transformers>=5.23,<5.24'"


def check_transformers(version: str) -> None:
    """Raise a clear ImportError for a transformers ``version`` specdec does not run on."""
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts >= UNPORTED_TRANSFORMERS:
        raise ImportError(f"transformers {version} is installed, but specdec supports transformers < "
                          f"{'.'.join(map(str, UNPORTED_TRANSFORMERS))} for now (that release renames past_key_values "
                          f"to cache in models' forwards). Install a supported one: {INSTALL}")
    if parts < FIRST_SUPPORTED:
        raise ImportError(f"transformers {version} is installed, but specdec needs transformers >= "
                          f"{'.'.join(map(str, FIRST_SUPPORTED))} (earlier releases lack cache classes it reads). "
                          f"Install a supported one: {INSTALL}")


def check_installed() -> None:
    """``check_transformers`` on the installed transformers, if any (none: its import fails later, by name)."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return
    check_transformers(version)
