"""specdec: speculative decoding for Hugging Face transformers causal and encoder-decoder LMs, batched.

The public API, re-exported; nothing is defined here.
"""

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
from specdec.decode import Decoder, Request, autoregressive_generate, speculative_generate
from specdec.drafters import (
    DRAFTERS,
    Drafter,
    LookupDrafter,
    ModelDrafter,
    NgramDrafter,
    NoDrafter,
    Proposal,
    make_drafter,
    register_drafter,
    register_model_drafter,
)
from specdec.events import Listener
from specdec.loading import default_model_path, load_model, load_tokenizer
from specdec.processors import GenerationSettings
from specdec.schedules import SCHEDULES, Schedule, register_schedule
from specdec.stats import BatchStats, GenerationResult, GenerationStats, RoundEvent, RoundRecord
from specdec.target import Target, make_target, register_target

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
    "Verdict",
    "VerifyConfig",
    "autoregressive_generate",
    "default_model_path",
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
]
