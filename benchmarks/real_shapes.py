"""Targets of real models' shapes with random weights, written as folders every engine loads (issue 71, item 5).

Users bring models of 0.4-8B parameters; at those sizes a decode step's time is set by the bytes of weights it reads,
which random weights of the same shape read as well as trained ones. No hub is reachable here, so each shape is built
from its config, its weights drawn at random (``initializer_range`` 0.02) and stored in bfloat16, with the shipped
``code-target``'s tokenizer (8,192 tokens; a larger vocabulary's extra rows are never prompted, as a model's padding
rows): a folder ``specdec bench --target`` and llama.cpp's converter (``--peers llamacpp``) both read.

- ``llama-409m``: issue 71's table: Llama, hidden 1536, 16 layers, 12 heads of 128, intermediate 3328, an 8,192-token
  vocabulary, tied embeddings (409.0M parameters, 780 MiB stored);
- ``qwen2-1.5b``: Qwen2-1.5B's shape: hidden 1536, 28 layers, 12 query heads and 2 key-value heads of 128,
  intermediate 8960, a 151,936-token vocabulary, tied embeddings, biases on q/k/v (1.54B parameters, 2.9 GiB).

    python benchmarks/real_shapes.py --shape qwen2-1.5b --out /tmp/qwen2-1.5b
    specdec bench --target /tmp/qwen2-1.5b --methods plain-hf plain --peers llamacpp-q8_0 llamacpp-q4_0 \\
        --threads 2 --max-new-tokens 32 --output bench-out/qwen2-1.5b

The figures go in docs/journal/ with the load average and the thread count.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "code-target"
COMMON = {"initializer_range": 0.02, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
          "tie_word_embeddings": True, "max_position_embeddings": 4096}
SHAPES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict]] = {
    "llama-409m": (LlamaConfig, LlamaForCausalLM, {
        "hidden_size": 1536, "num_hidden_layers": 16, "num_attention_heads": 12, "num_key_value_heads": 12,
        "head_dim": 128, "intermediate_size": 3328, "vocab_size": 8192}),
    "qwen2-1.5b": (Qwen2Config, Qwen2ForCausalLM, {
        "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "intermediate_size": 8960, "vocab_size": 151936, "rope_theta": 1000000.0}),
}


def build(shape: str, seed: int = 0) -> PreTrainedModel:
    """The shape's model with random weights, in bfloat16 (its values bf16 numbers, as a stored checkpoint's)."""
    config_class, model_class, fields = SHAPES[shape]
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = model_class(config_class(**fields, **COMMON, dtype="bfloat16"))
    return model.to(torch.bfloat16).eval()


def write(shape: str, out: Path, seed: int = 0) -> int:
    """Write ``out``: the shape (safetensors, bf16), its generation config (greedy) and the shipped tokenizer.
    Returns its parameter count."""
    model = build(shape, seed)
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_TOKENIZER / name, out / name)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    parameters = write(args.shape, args.out, args.seed)
    stored = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(f"{args.shape}: {parameters / 1e6:.1f}M parameters, {stored / 2**20:.0f} MiB of safetensors in {args.out}")


if __name__ == "__main__":
    main()
