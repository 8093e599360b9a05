"""Quantized targets and drafters (issue 71, the eager path): what a model's quantization is, and ``quantize``.

A model quantized the way transformers loads it (one of its quantizers: torchao, compressed-tensors, ...) is a
target like any other: speculation is exact with respect to the model *as the user runs it*, so specdec's greedy
output is that quantized model's own ``generate`` and its sampling keeps that model's distribution. specdec's float32
kernels (``specdec.kernels``) skip every linear whose weight is a quantized tensor subclass; torchao's weight-only
int8 / int4 linears get specdec's own kernel instead (``specdec.qlinear``: the same dequantised weights, read at the
memory floor), and every other form runs transformers' forward.

- ``describe(model)`` names a model's quantization format (None for a plain model), for messages (the compiled
  path's refusal of a form it does not trace: ``specdec.compiled.policy.quantized_refusal``);
- ``note(model)`` says once per process, in one line, where a format has no fast kernel on the model's device (it
  then runs as transformers runs it);
- ``quantize(...)`` (``specdec quantize``) writes weight-only int8 (per output channel) or int4 (group-wise) copies
  of a model in torchao's format, which ``from_pretrained`` loads back with torchao installed (``pip install
  'specdec[quant]'``), with a model card giving the size on disk and the greedy agreement with the unquantized model.

Why torchao's format (docs/journal/2026-12-07-quantized.md has the measurement): transformers quantizes a float
model into it on load (``TorchAoConfig``) and saves it as safetensors, so writing one is ``from_pretrained`` +
``save_pretrained``, and the loaded model keeps its weights quantized (tensor subclasses) at run time.
compressed-tensors' transformers quantizer only loads checkpoints that were calibrated elsewhere (writing one took
our own scale computation and its ``ModelCompressor``), and on the CPU its loaded model decompresses every weight
back to a dense float tensor on the first forward. Its int4 is packed (two values a byte) where torchao 0.18's only
CPU-serialisable int4 (``IntxWeightOnlyConfig``) keeps one value a byte; torchao's packed int4 layouts need CUDA or
its ``mslk`` kernels, and its CPU layout (``Int4OpaqueTensor``) is not in its safetensors allow-list.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.compat import progress_bars

GROUP_SIZES = (32, 64, 128)  # int4's input columns per scale (the CLI's choices: specdec.quantize_cli's own)
PACKAGES = {"torchao": "torchao", "compressed-tensors": "compressed-tensors"}  # format -> package to install
_NOTED: set[str] = set()


def _weights(model: torch.nn.Module):
    for module in model.modules():
        for tensor in module._parameters.values():
            if tensor is not None and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
                yield tensor


def _method(model: torch.nn.Module) -> str | None:
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return str(getattr(method, "value", method)) if method is not None else "unknown"


def describe(model: torch.nn.Module) -> str | None:
    """The quantization format of ``model``'s weights, named for a message ("torchao (Int8Tensor)",
    "compressed-tensors"), or None for a model without quantized weights or a quantization config."""
    kinds = sorted({type(t).__name__ for t in _weights(model)})
    method = _method(model)
    if method is None and not kinds:
        return None
    if method is None:
        method = type(next(_weights(model))).__module__.split(".")[0]
    return f"{method} ({', '.join(kinds)})" if kinds else method


def _installed(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package.replace("-", "_")) is not None


def missing_backend(config) -> str | None:
    """The one line naming the package to install where ``config`` (a model's) is quantized in a format whose
    backend is not installed (transformers' own error is a traceback's); None otherwise."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    method = _method_of(config)
    package = PACKAGES.get(method)
    if package is None or _installed(package):
        return None
    return f"this model is quantized with {method}, which is not installed: pip install {package}"


def slow_line(model: torch.nn.Module) -> str | None:
    """The one line saying that ``model``'s format has no fast kernel on its device (None where the model is not
    quantized). torchao's weight-only tensors have none of torchao's in eager mode on any device: an int8
    (``Int8Tensor``) product converts the whole weight to the activations' dtype first, an int4
    (``IntxUnpackedToInt8Tensor``) product dequantises it. ``specdec.qlinear`` says it (``note``) only where its own
    kernel does not serve the model (``SPECDEC_LINEAR=off``, a form it does not take, no C compiler)."""
    kinds = sorted({type(t).__name__ for t in _weights(model)})
    if not kinds:
        return None
    device = next(_weights(model)).device.type
    return (f"{describe(model)} has no fast {device} kernel in eager mode: each product dequantises its weights, "
            "as transformers runs it")


def note(model: torch.nn.Module) -> None:
    """Warn once per process and format (one line) where ``model``'s format has no fast kernel on its device."""
    line = slow_line(model)
    if line is not None and line not in _NOTED:
        _NOTED.add(line)
        warnings.warn(line, stacklevel=2)


# ------------------------------------------------------------------------------------------------ quantize

@dataclass(frozen=True)
class Agreement:
    """Greedy agreement of a quantized model with its source on ``prompts`` prompts of ``tokens`` new tokens."""

    prompts: int
    tokens: int
    equal_prompts: int  # prompts whose every new token equals the unquantized model's
    equal_tokens: int  # new tokens equal before each prompt's first difference, summed
    source: str  # where the prompts came from


def _require_torchao():
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise ValueError("quantizing needs torchao: pip install 'specdec[quant]' (or pip install torchao)") from None


def torchao_config(to: str, group_size: int | None):
    """torchao's config for weight-only ``to`` ("int8": per output channel; "int4": groups of ``group_size``
    input columns, symmetric, one int4 value a byte in the serialised form)."""
    _require_torchao()
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup

    if to == "int8":
        return Int8WeightOnlyConfig()
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))


def check(model_path: str | Path, to: str, out: str | Path, group_size: int | None, embeddings: bool = False,
          head: bool = False) -> int | None:
    """Refuse bad input before anything is loaded or written (a ValueError of one line); the group size to use."""
    from transformers import AutoConfig

    if to not in ("int8", "int4"):
        raise ValueError(f"unknown --to {to!r}: use int8 or int4")
    if to == "int8" and group_size is not None:
        raise ValueError("--group-size applies to --to int4 (int8 is per output channel)")
    if group_size is not None and group_size not in GROUP_SIZES:
        raise ValueError(f"--group-size {group_size}: use one of {', '.join(map(str, GROUP_SIZES))}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder: nothing written")
    _require_torchao()
    config = AutoConfig.from_pretrained(model_path)
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError(f"{model_path} is already quantized ({_method_of(config)}): quantize its unquantized source")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if embeddings and not head and not getattr(text, "tie_word_embeddings", True):
        raise ValueError("--quantize-embeddings needs --quantize-head (transformers' torchao quantizer quantizes "
                         "the input and output embeddings together)")
    if to == "int8":
        return None
    group_size = group_size or 128
    widths = {getattr(text, name) for name in ("hidden_size", "intermediate_size", "n_embd", "n_inner")
              if isinstance(getattr(text, name, None), int)}
    bad = sorted(w for w in widths if w % group_size)
    if bad:
        raise ValueError(f"--group-size {group_size} does not divide the model's width {bad[0]}: choose one that does")
    return group_size


def _method_of(config) -> str:
    q = config.quantization_config
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(method, "value", method))


def _load(path, dtype, quantization_config=None):
    from transformers import AutoModelForCausalLM

    kwargs = {"quantization_config": quantization_config} if quantization_config is not None else {}
    with progress_bars(False):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, **kwargs).eval()


def _prompts(model_path: Path, vocab_size: int, n: int, seed: int) -> tuple[list[list[int]], str]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        tokenizer = None
    if tokenizer is not None:
        from specdec.bench.prompts import builtin_prompts

        items = builtin_prompts(n, seed)
        return ([tokenizer(i["prompt"], add_special_tokens=False).input_ids for i in items],
                "held-out code-completion prompts (function prefixes of the standard library's test split)")
    generator = torch.Generator().manual_seed(seed)
    return ([torch.randint(3, vocab_size, (8,), generator=generator).tolist() for _ in range(n)],
            f"random token prompts of 8 tokens (seed {seed}; the folder has no tokenizer)")


def _greedy(model, prompt: list[int], tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, num_beams=1, pad_token_id=model.config.pad_token_id or 0)
    return out[0, len(prompt):].tolist()


def agreement(source, quantized, prompts: list[list[int]], tokens: int, where: str) -> Agreement:
    """Greedy ``generate`` of both models on each prompt, ``tokens`` new tokens each (stop tokens ignored)."""
    equal_prompts = equal_tokens = 0
    for prompt in prompts:
        a, b = _greedy(source, prompt, tokens), _greedy(quantized, prompt, tokens)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        equal_tokens += same
        equal_prompts += same == len(a)
    return Agreement(len(prompts), tokens, equal_prompts, equal_tokens, where)


def _untie(model_path: Path, out: str) -> str:
    """Write ``model_path``'s weights to ``out`` in their stored dtype with the LM head its own copy of the tied
    input embeddings and ``tie_word_embeddings`` off: the same function, two matrices."""
    model = _load(model_path, "auto")
    model.get_output_embeddings().weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    with progress_bars(False):
        model.save_pretrained(out, safe_serialization=True)
    return out


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file() and f.suffix == ".safetensors")


def quantize(model_path: str | Path, to: str, out: str | Path, group_size: int | None = None,
             embeddings: bool = False, head: bool = False, dtype: torch.dtype = torch.float32,
             prompts: int = 8, tokens: int = 32, seed: int = 0) -> dict:
    """Write a weight-only ``to`` copy of the causal LM at ``model_path`` to ``out`` (safetensors, torchao's format,
    its tokenizer files copied, a README.md model card); ``embeddings`` / ``head`` quantize the input embeddings /
    the LM head too (kept in ``dtype`` otherwise). Returns the card's figures. Bad input is a one-line ValueError
    raised before anything is written."""
    from transformers import TorchAoConfig

    model_path, out = Path(model_path), Path(out)
    group_size = check(model_path, to, out, group_size, embeddings, head)
    from transformers import AutoConfig

    stored = str(getattr(AutoConfig.from_pretrained(model_path), "dtype", None) or "unknown").removeprefix("torch.")
    source = _load(model_path, dtype)
    tied = source.get_output_embeddings() is not None and (
        source.get_output_embeddings().weight is source.get_input_embeddings().weight)
    head = head or embeddings  # transformers' quantizer takes the input embeddings with the head or not at all
    config = TorchAoConfig(torchao_config(to, group_size), include_input_output_embeddings=embeddings,
                           modules_to_not_convert=None if not head else [])
    with tempfile.TemporaryDirectory(prefix="specdec-untied-") as untied:
        # A tied head is the input embeddings' matrix, which transformers' quantizer leaves float: the head gets its
        # own copy (tie_word_embeddings off), so that it is quantized and read as integers at every step.
        model = _load(_untie(model_path, untied) if tied and head else model_path, dtype, config)
    if not any(True for _ in _weights(model)):
        raise ValueError(f"{model_path}: no linear layer could be quantized to {to}")
    if head and type(model.get_output_embeddings().weight) in (torch.Tensor, torch.nn.Parameter):
        raise ValueError(f"transformers' torchao quantizer left {model_path}'s LM head unquantized"
                         + (" (it is tied to the input embeddings)" if tied else "") + ": drop --quantize-head")
    out.mkdir(parents=True, exist_ok=True)
    try:
        with progress_bars(False):
            model.save_pretrained(out, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                     "merges.txt", "tokenizer.model"):
            if (model_path / name).is_file():
                shutil.copy2(model_path / name, out / name)
        loaded = _load(out, dtype)  # as a user loads it
        ids, where = _prompts(model_path, source.config.get_text_config().vocab_size, prompts, seed)
        agree = agreement(source, loaded, ids, tokens, where)
        figures = {"source": str(model_path), "to": to, "group_size": group_size, "embeddings": embeddings,
                   "head": head, "untied": tied and head, "dtype": str(dtype).removeprefix("torch."),
                   "format": describe(loaded),
                   "bytes": folder_bytes(out), "source_bytes": folder_bytes(model_path),
                   "source_dtype": stored,
                   "agreement": agree.__dict__}
        (out / "README.md").write_text(card(figures), encoding="utf-8")
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return figures


def card(figures: dict) -> str:
    a = figures["agreement"]
    size, src = figures["bytes"], figures["source_bytes"]
    ratio = size / max(src, 1)
    untied = "; the source's head was tied to its input embeddings: here it is a copy of its own" if figures.get(
        "untied") else ""
    scheme = ("int8 weight-only, one scale per output channel" if figures["to"] == "int8"
              else f"int4 weight-only, symmetric, one scale per {figures['group_size']} input columns")
    return f"""# {Path(figures['source']).name}, {figures['to']}

Written by `specdec quantize` from `{figures['source']}`: {scheme}, in torchao's format ({figures['format']}),
saved as safetensors. Input embeddings {'quantized' if figures['embeddings'] else 'kept'}; LM head
{'quantized' if figures['head'] else 'kept'} ({figures['dtype']} otherwise){untied}. Load it with
`AutoModelForCausalLM.from_pretrained(folder)` with torchao installed (`pip install 'specdec[quant]'`).

| | bytes of weights on disk |
|---|---|
| this folder | {size:,} ({size / 2**20:.1f} MiB) |
| the source (stored {figures['source_dtype']}) | {src:,} ({src / 2**20:.1f} MiB); this folder is {ratio:.2f}x |

Greedy agreement with the unquantized model (`generate`, {figures['dtype']}), on {a['prompts']} {a['source']}
× {a['tokens']} new tokens each: **{a['equal_prompts']} of {a['prompts']} prompts** equal in all {a['tokens']}
tokens; {a['equal_tokens']} of {a['prompts'] * a['tokens']} tokens equal before each prompt's first difference.

```json
{json.dumps(figures, indent=2)}
```
"""
