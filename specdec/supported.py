"""The transformers and torch releases specdec runs on, checked when ``specdec`` is first imported
(``specdec/__init__.py``), from the installed distribution's version, before any module of specdec imports transformers
(so that no torch is imported for it, and an older release is named, not met as ``cannot import name 'DummyLayer'`` deep
in an import).

Only releases known not to work are refused, each by name with the install command that fixes it:
- transformers before 5.23 lacks cache classes specdec reads (``DummyLayer``: 5.17-5.22 fail at import). 5.24 renamed
  ``past_key_values`` / ``cache_params`` to ``cache``; ``specdec.compat`` reads whichever the installed release uses.
- torch before 2.8: transformers 5.23 disables a torch older than 2.6 ("Disabling PyTorch": every model class fails
  later); torch 2.6's dynamo cannot trace transformers' forwards at all and 2.7.1's fails on some, so ``--compile on``
  falls back to eager and the compiled path fails.
pyproject.toml states the tested range (the README says which releases CI runs).
"""

from __future__ import annotations

import importlib.metadata
import platform

FIRST_SUPPORTED = (5, 23)
INSTALL = "pip install -U 'transformers>=5.23,<5.40'"
FIRST_TORCH = (2, 8)
INSTALL_TORCH = "pip install -U 'torch>=2.8' (on a machine without a GPU: pip install torch==2.13.0)"


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "5.23.0", "2.6.0+cu124" or "5.25.0.dev0"."""
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())


def check_transformers(version: str) -> None:
    """Raise a clear ImportError for a transformers ``version`` specdec does not run on."""
    if _release(version) < FIRST_SUPPORTED:
        raise ImportError(f"transformers {version} is installed, but specdec needs transformers >= "
                          f"{'.'.join(map(str, FIRST_SUPPORTED))} (earlier releases lack cache classes it reads). "
                          f"Install a supported one: {INSTALL}")


def check_torch(version: str) -> None:
    """Raise a clear ImportError for a torch ``version`` that specdec's transformers does not run with."""
    if _release(version) < FIRST_TORCH:
        raise ImportError(f"torch {version} is installed, but specdec needs torch >= {'.'.join(map(str, FIRST_TORCH))} "
                          "(transformers 5.23 disables torch < 2.6, and torch 2.6-2.7 cannot compile its models). "
                          f"Install a supported one: {INSTALL_TORCH}")


def installed(name: str) -> str | None:
    """The installed version of distribution ``name`` (read from its metadata: nothing is imported), or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_line() -> str:
    """What ``specdec --version`` prints: specdec's version and the transformers and torch it runs on."""
    return f"specdec {installed('specdec') or 'unknown'} (transformers {installed('transformers')}, " \
           f"torch {installed('torch')}, Python {platform.python_version()})"


def check_installed() -> None:
    """``check_transformers`` and ``check_torch`` on the installed releases, if any (none: its import fails later,
    by name)."""
    for name, check in (("transformers", check_transformers), ("torch", check_torch)):
        if (version := installed(name)) is not None:
            check(version)


def quiet_backends() -> None:
    """Keep the optional quantization backend's import-time chatter off a user's output: with torchao installed
    (the ``quant`` extra), transformers imports it with every model, and on a CPU build of torch torchao logs each
    CUDA library it cannot load and registers enums torch's pytree warns about. Its errors still show; a process
    that imported torchao before specdec keeps what it printed."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
