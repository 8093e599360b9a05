"""The transformers and torch releases specdec runs on, checked when ``specdec`` is first imported (``specdec/__init__.py``),
from the installed distribution's version, before any module of specdec imports transformers (so that no torch is
imported for it, and an older release is named, not met as ``cannot import name 'DummyLayer'`` deep in an import).

- 5.23 is the first release with every cache class specdec reads (``DummyLayer``: 5.17-5.22 fail at import).
- 5.24 renames ``past_key_values`` / ``cache_params`` to ``cache`` in every forward's signature (and outputs), which
  ``specdec.architectures``' checks read: specdec is not ported to it yet. pyproject.toml pins the same range.
- torch 2.8 is the first specdec runs on whole: transformers 5.23 disables a torch older than 2.6 ("Disabling
  PyTorch": every model class fails later); torch 2.6's dynamo cannot trace transformers 5.23's forwards at all (its
  output wrapper reads ``func.__code__.co_varnames``) and 2.7.1's fails on some (``Unsupported: Data dependent
  operator``; Marian: a graph break), so ``--compile on`` fell back to eager and the compiled tests failed.
  Run here: 2.6.0 and 2.7.1 (as above), 2.8.0 (the core and compiled tests: 273 passed, the compile cache's 4
  skipped without aot_compile), 2.9.1 (those 2.7.1 failed), 2.11 (a GPU), 2.13 (all).
"""

from __future__ import annotations

import importlib.metadata

FIRST_SUPPORTED = (5, 23)
UNPORTED_TRANSFORMERS = (5, 24)
INSTALL = "pip install 'transformers>=5.23,<5.24'"
FIRST_TORCH = (2, 8)
INSTALL_TORCH = "pip install 'torch>=2.8,<2.14' (on a machine without a GPU: pip install torch==2.13.0)"


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "5.23.0", "2.6.0+cu124" or "5.25.0.dev0"."""
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())


def check_transformers(version: str) -> None:
    """Raise a clear ImportError for a transformers ``version`` specdec does not run on."""
    parts = _release(version)
    if parts >= UNPORTED_TRANSFORMERS:
        raise ImportError(f"transformers {version} is installed, but specdec supports transformers < "
                          f"{'.'.join(map(str, UNPORTED_TRANSFORMERS))} for now (that release renames past_key_values "
                          f"to cache in models' forwards). Install a supported one: {INSTALL}")
    if parts < FIRST_SUPPORTED:
        raise ImportError(f"transformers {version} is installed, but specdec needs transformers >= "
                          f"{'.'.join(map(str, FIRST_SUPPORTED))} (earlier releases lack cache classes it reads). "
                          f"Install a supported one: {INSTALL}")


def check_torch(version: str) -> None:
    """Raise a clear ImportError for a torch ``version`` that specdec's transformers does not run with."""
    if _release(version) < FIRST_TORCH:
        raise ImportError(f"torch {version} is installed, but specdec needs torch >= {'.'.join(map(str, FIRST_TORCH))} "
                          "(transformers 5.23 disables torch < 2.6, and torch 2.6-2.7 cannot compile its models). Install "
                          f"a supported one: {INSTALL_TORCH}")


def check_installed() -> None:
    """``check_transformers`` and ``check_torch`` on the installed releases, if any (none: its import fails later,
    by name)."""
    for name, check in (("transformers", check_transformers), ("torch", check_torch)):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        check(version)
