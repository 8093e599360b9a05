"""Peak resident memory of a target decoding, beside its stored bytes and its KV cache (issue 71's memory goal).

Loads MODEL the way the CLI does (``specdec.load_model``), decodes ``--tokens`` new tokens after a ``--prompt-tokens``
prompt of random tokens with prompt lookup (no drafter model in memory; the engine's kernels packed at the first
product, as in any run), and prints, from
``/proc/self/status``: the peak (VmHWM), the resident memory at the end split into anonymous and file-backed pages
(safetensors are memory-mapped: pages of a weight the run never touches, such as most rows of a large embedding, are
not resident), beside the folder's stored bytes and the KV cache's bytes at the last position. Run it in a fresh
process per model: the peak is the process's.

    python benchmarks/real_shapes.py --shape qwen2-1.5b --out /tmp/qwen2-1.5b
    specdec quantize /tmp/qwen2-1.5b --to int4 --quantize-head --out /tmp/qwen2-1.5b-int4
    OMP_NUM_THREADS=1 python benchmarks/peak_memory.py /tmp/qwen2-1.5b-int4
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch


def status() -> dict[str, int]:
    """This process's VmHWM, VmRSS, RssAnon and RssFile in MiB."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    return out


def kv_bytes(config, positions: int, element: int) -> int:
    text = config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * positions * element


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import specdec

    before = status()
    model = specdec.load_model(args.model)
    prompt = torch.randint(3, 8000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    result = specdec.speculative_generate(model, "ngram", prompt, max_new_tokens=args.tokens, stop_token_ids=[])
    after = status()
    stored = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors")) / 2**20
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    kv = kv_bytes(model.config, args.prompt_tokens + len(result.tokens), dtype.itemsize) / 2**20
    print(f"{args.model}: stored {stored:.1f} MiB, KV cache {kv:.1f} MiB ({args.prompt_tokens} + {len(result.tokens)} "
          f"positions); peak RSS {after['VmHWM']:.1f} MiB = {after['VmHWM'] / (stored + kv):.2f}x (stored + KV); "
          f"at the end {after['VmRSS']:.1f} MiB ({after['RssAnon']:.1f} anonymous, {after['RssFile']:.1f} "
          f"file-backed); {before['VmRSS']:.1f} MiB before loading (the interpreter, torch and specdec)")


if __name__ == "__main__":
    main()
