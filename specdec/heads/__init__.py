"""The SpecDec++ acceptance head (Huang, Guo, Wang 2024): model, stop rule, data, training, evaluation.

The decoding side needs only ``AcceptanceHead`` (``model.py``) and the stop rule (``stopping.py``);
``data.py``, ``train.py``, ``evaluate.py`` and ``report.py`` build, train and measure a head
(``specdec train head`` / ``specdec train head-eval``) and import models lazily.
"""

from specdec.heads.model import DEFAULT_HEAD, AcceptanceHead, HeadConfig, default_head_path
from specdec.heads.stopping import HeadStop, check_rule, draft_lengths, running_acceptance, should_stop

__all__ = [
    "DEFAULT_HEAD",
    "AcceptanceHead",
    "HeadConfig",
    "HeadStop",
    "check_rule",
    "default_head_path",
    "draft_lengths",
    "running_acceptance",
    "should_stop",
]
