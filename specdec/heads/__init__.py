"""The SpecDec++ acceptance head (Huang, Guo, Wang 2024): model, data, training, evaluation.

The decoding side needs only ``load_head`` / ``AcceptanceHead`` (``model.py``); the stop rule that
reads the head is ``specdec.schedules.Ada`` (one rule, used online and by the offline simulation in
``evaluate.py``). ``data.py``, ``train.py``, ``evaluate.py`` and ``report.py`` build, train and
measure a head (``specdec train head`` / ``specdec train head-eval``) and import models lazily.
"""

from __future__ import annotations

import typing

from specdec.lazy import lazy_names

if typing.TYPE_CHECKING:
    from specdec.heads.model import DEFAULT_HEAD, AcceptanceHead, HeadConfig, default_head_path, load_head

__all__ = ["DEFAULT_HEAD", "AcceptanceHead", "HeadConfig", "default_head_path", "load_head"]


__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(__all__, "specdec.heads.model"))  # no torch for heads.config
