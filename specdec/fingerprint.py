"""A target's fingerprint: a short hash of what it computes with (its config, less how it was saved or loaded) and its
tokenizer. Data made for one target (``specdec data outputs``) and a feature drafter trained for it carry it, so
that another target refuses them. A leaf module: the drafters read it without importing the trainers."""

from __future__ import annotations

import hashlib
import json

from transformers import PretrainedConfig, PreTrainedTokenizerBase

# config keys that say how a model was saved or loaded, not what it computes
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "_commit_hash",
                        "_attn_implementation_autoset", "use_cache")


def fingerprint(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of what a model computes with (its config, less how it was saved or loaded) and its
    tokenizer (vocabulary, special tokens, chat template): data made for one target is refused by another."""
    cfg = {k: v for k, v in config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS}
    tok = {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(map(str, tokenizer.all_special_tokens)),
           "chat_template": getattr(tokenizer, "chat_template", None)}
    blob = json.dumps([cfg, tok], sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
