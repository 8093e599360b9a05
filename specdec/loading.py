"""Loading models and tokenizers, and the few model facts the decoder needs.

Contract: ``load_model(path_or_name)`` takes a folder with a ``config.json`` and safetensors
weights (``from_pretrained`` with ``use_safetensors=True``, ``trust_remote_code=False``), or one of
the shipped names ("code-target", "code-drafter") that resolve to ``models/<name>`` at the repo
root; ``None`` means the shipped default target. A path that does not exist is a ``ValueError``
naming it, and so is a folder without safetensors weights. The model comes back in eval mode. Loading prints no progress
bar unless asked (``progress=True``); a folder without tokenizer files is refused by ``load_tokenizer`` by name.

Devices: None = "cuda" when available, else "cpu"; "cpu", "cuda", "cuda:N"; "auto" spreads a
model too large for one GPU over all of them (accelerate ``device_map="auto"``).
Dtypes: None = float32 on CPU (fast and exact there) and bfloat16 on CUDA; or "fp32", "bf16",
"fp16", or a ``torch.dtype``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specdec.compat import progress_bars

# The folder rules live where no torch is imported; their names stay importable from here.
from specdec.folders import (  # noqa: F401
    DEFAULT_TARGET,
    SHIPPED_MODELS,
    TOKENIZER_FILES,
    default_model_path,
    models_dir,
    require_weights,
    resolve_model_path,
)

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def resolve_device(device: str | torch.device | None) -> str:
    """None -> "cuda" if available else "cpu"; validates "cpu" / "cuda" / "cuda:N" / "auto"."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = str(device)
    if device == "auto":
        return device
    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"unknown device {device!r}: use cpu, cuda, cuda:N or auto") from err
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available: use device='cpu'")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """None -> float32 on CPU, bfloat16 elsewhere; strings from ``DTYPES``; a torch.dtype as is."""
    if dtype is None:
        return torch.float32 if device == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of bf16, fp16, fp32")
    return DTYPES[dtype]


def load_model(
    path_or_name: str | Path | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    progress: bool = False,
) -> PreTrainedModel:
    """Load a causal or encoder-decoder LM (as its config says) from a local folder or shipped name, on
    ``device`` in ``dtype``, in eval mode; ``progress`` shows transformers' "Loading weights" bar."""
    path = require_weights(resolve_model_path(path_or_name))
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    if getattr(config, "quantization_config", None) is not None:
        from specdec.quantized import missing_backend

        if (line := missing_backend(config)) is not None:
            raise ValueError(f"{path}: {line}")
    if dtype is None and getattr(config, "quantization_config", None) is not None:
        torch_dtype = "auto"  # a quantized checkpoint computes in its stored dtype (its scales': specdec.quantized)
    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    with progress_bars(progress):
        model = auto.from_pretrained(
            path,
            dtype=torch_dtype,
            device_map="auto" if device == "auto" else None,
            use_safetensors=True,
            trust_remote_code=False,
        )
    if device != "auto":
        model = model.to(device)
    return model.eval()


def load_tokenizer(path_or_name: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer stored with a model (same resolution as ``load_model``); a folder with none of
    ``TOKENIZER_FILES`` is a ``ValueError`` saying so."""
    path = resolve_model_path(path_or_name)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"model folder {str(path)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save "
                         "the tokenizer the model was trained with into it (tokenizer.save_pretrained(folder))")
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def vocab_size(model: PreTrainedModel) -> int:
    """Size of the model's logits (its output embedding rows, padding included)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if callable(weight):  # a dynamically quantised linear layer keeps its weight behind a method
        weight = weight()
    if weight is not None:
        return weight.shape[0]
    return model.config.get_text_config().vocab_size


def context_limit(model: PreTrainedModel) -> int | None:
    """The longest sequence the model accepts (positions), or None when its config sets none."""
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def input_device(model: PreTrainedModel) -> torch.device:
    """Where the model's input ids must live (its input embedding's device; a drafter whose embedding is the
    target's, not yet bound: its own weights' device)."""
    embeddings = model.get_input_embeddings()
    return embeddings.weight.device if embeddings is not None else next(model.parameters()).device
