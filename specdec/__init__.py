"""specdec: lossless speculative decoding for Hugging Face transformers causal LMs.

The public API, re-exported; nothing is defined here.
"""

from specdec.config import ModelConfig, NgramConfig, SamplingConfig, SpecConfig
from specdec.decode import autoregressive_generate, speculative_generate
from specdec.drafters import DRAFTERS, make_drafter, register_drafter
from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.hybrid import LookupModelDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.loading import default_model_path, load_model, load_tokenizer
from specdec.stats import GenerationResult, GenerationStats, RoundEvent, RoundRecord

__all__ = [
    "DRAFTERS",
    "Drafter",
    "GenerationResult",
    "GenerationStats",
    "LookupModelDrafter",
    "ModelConfig",
    "ModelDrafter",
    "NgramConfig",
    "NgramDrafter",
    "Proposal",
    "RoundEvent",
    "RoundRecord",
    "SamplingConfig",
    "SpecConfig",
    "autoregressive_generate",
    "default_model_path",
    "load_model",
    "load_tokenizer",
    "make_drafter",
    "register_drafter",
    "speculative_generate",
]
