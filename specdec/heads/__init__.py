"""The SpecDec++ acceptance head (Huang, Guo, Wang 2024): model, data, training, evaluation.

The decoding side needs only ``load_head`` / ``AcceptanceHead`` (``model.py``); the stop rule that
reads the head is ``specdec.schedules.Ada`` (one rule, used online and by the offline simulation in
``evaluate.py``). ``data.py``, ``train.py``, ``evaluate.py`` and ``report.py`` build, train and
measure a head (``specdec train head`` / ``specdec train head-eval``) and import models lazily.
"""

from __future__ import annotations

import importlib
import typing

if typing.TYPE_CHECKING:
    from specdec.heads.model import DEFAULT_HEAD, AcceptanceHead, HeadConfig, default_head_path, load_head

__all__ = ["DEFAULT_HEAD", "AcceptanceHead", "HeadConfig", "default_head_path", "load_head"]


def __getattr__(name: str) -> object:
    """A name of ``__all__``, imported from ``model.py`` on first use (PEP 562: ``specdec.heads.config``, which
    ``specdec train``'s flags read, imports no torch); or a submodule."""
    if name in __all__:
        value = getattr(importlib.import_module("specdec.heads.model"), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
