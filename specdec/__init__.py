"""specdec: speculative decoding for Hugging Face transformers causal and encoder-decoder LMs, batched.

The public API, re-exported; nothing is defined here. The API loads on first use (PEP 562), so
``import specdec`` and the command line's ``--help`` and argument errors do not import torch or
transformers; ``specdec.speculative_generate`` and ``from specdec import load_model`` work as usual.
"""

from __future__ import annotations

import typing

from specdec.lazy import lazy_names
from specdec.supported import check_installed, installed, quiet_backends

check_installed()  # the transformers release, named before any module imports it (specdec.supported)
quiet_backends()  # torchao's import chatter (specdec.supported)
__version__ = installed("specdec") or "unknown"  # from the package metadata (pyproject.toml's version)

if typing.TYPE_CHECKING:
    from specdec.acceptance import RULES, Rule, Verdict, register_rule
    from specdec.batch import PromptBatch
    from specdec.config import (
        DrafterConfig,
        ModelConfig,
        NgramConfig,
        SamplingConfig,
        ScheduleConfig,
        SpecConfig,
        VerifyConfig,
    )
    from specdec.decode import Decoder, Request
    from specdec.drafters import (
        DRAFTERS,
        Drafter,
        LookupDrafter,
        ModelDrafter,
        NgramDrafter,
        NoDrafter,
        Proposal,
        drafter_in,
        make_drafter,
        register_drafter,
        register_model_drafter,
    )
    from specdec.events import Listener
    from specdec.loading import default_model_path, load_model, load_tokenizer
    from specdec.processors import GenerationSettings
    from specdec.schedules import SCHEDULES, Schedule, register_schedule
    from specdec.session import autoregressive_generate, speculative_generate
    from specdec.stats import BatchStats, GenerationResult, GenerationStats, RoundEvent, RoundRecord
    from specdec.target import Target, make_target, register_target
    from specdec.threads import ThreadChoice, use_threads

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "RULES": "specdec.acceptance",
    "Rule": "specdec.acceptance",
    "Verdict": "specdec.acceptance",
    "register_rule": "specdec.acceptance",
    "PromptBatch": "specdec.batch",
    "DrafterConfig": "specdec.config",
    "ModelConfig": "specdec.config",
    "NgramConfig": "specdec.config",
    "SamplingConfig": "specdec.config",
    "ScheduleConfig": "specdec.config",
    "SpecConfig": "specdec.config",
    "VerifyConfig": "specdec.config",
    "Decoder": "specdec.decode",
    "Request": "specdec.decode",
    "autoregressive_generate": "specdec.session",
    "speculative_generate": "specdec.session",
    "DRAFTERS": "specdec.drafters",
    "Drafter": "specdec.drafters",
    "LookupDrafter": "specdec.drafters",
    "ModelDrafter": "specdec.drafters",
    "NgramDrafter": "specdec.drafters",
    "NoDrafter": "specdec.drafters",
    "Proposal": "specdec.drafters",
    "drafter_in": "specdec.drafters",
    "make_drafter": "specdec.drafters",
    "register_drafter": "specdec.drafters",
    "register_model_drafter": "specdec.drafters",
    "Listener": "specdec.events",
    "default_model_path": "specdec.loading",
    "load_model": "specdec.loading",
    "load_tokenizer": "specdec.loading",
    "GenerationSettings": "specdec.processors",
    "SCHEDULES": "specdec.schedules",
    "Schedule": "specdec.schedules",
    "register_schedule": "specdec.schedules",
    "BatchStats": "specdec.stats",
    "GenerationResult": "specdec.stats",
    "GenerationStats": "specdec.stats",
    "RoundEvent": "specdec.stats",
    "RoundRecord": "specdec.stats",
    "Target": "specdec.target",
    "make_target": "specdec.target",
    "register_target": "specdec.target",
    "ThreadChoice": "specdec.threads",
    "use_threads": "specdec.threads",
}

__all__ = [
    "DRAFTERS",
    "RULES",
    "SCHEDULES",
    "BatchStats",
    "Decoder",
    "Drafter",
    "DrafterConfig",
    "GenerationResult",
    "GenerationSettings",
    "GenerationStats",
    "Listener",
    "LookupDrafter",
    "ModelConfig",
    "ModelDrafter",
    "NgramConfig",
    "NgramDrafter",
    "NoDrafter",
    "PromptBatch",
    "Proposal",
    "Request",
    "RoundEvent",
    "RoundRecord",
    "Rule",
    "SamplingConfig",
    "Schedule",
    "ScheduleConfig",
    "SpecConfig",
    "Target",
    "ThreadChoice",
    "Verdict",
    "VerifyConfig",
    "autoregressive_generate",
    "default_model_path",
    "drafter_in",
    "load_model",
    "load_tokenizer",
    "make_drafter",
    "make_target",
    "register_drafter",
    "register_model_drafter",
    "register_rule",
    "register_schedule",
    "register_target",
    "speculative_generate",
    "use_threads",
]


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, together=True)  # the whole API at the first name
