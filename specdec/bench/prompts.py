"""Prompt sets of the benchmark: the built-in code-completion prompts or a JSONL file.

The built-in set is :func:`specdec.data.prompts.code_completion_prompts`: prefixes of functions
from the held-out (test split) standard-library files, which no shipped model was trained on. A
file has one JSON object per line with an ``"id"`` and a ``"prompt"``; its first N are used, in
order. Every method of a run sees the same prompts, tokenized once here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt, tokenized."""

    id: str  # stable identifier, written into every record
    text: str  # the prompt as given
    input_ids: torch.Tensor  # [T] token ids of the prompt (no special tokens added)


def read_jsonl(path: str | Path) -> list[dict[str, str]]:
    """The {"id", "prompt"} items of a JSONL file; a clear ValueError for a malformed line."""
    items = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise TypeError(f'{path}:{number}: each line needs {{"id": ..., "prompt": "<text>"}}')
        items.append({"id": str(item.get("id", number)), "prompt": item["prompt"]})
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


def builtin_prompts(n: int, seed: int) -> list[dict[str, str]]:
    """n held-out code-completion prompts (function prefixes from the standard library's test split)."""
    from specdec.data.prompts import code_completion_prompts

    return code_completion_prompts(n, split="test", seed=seed)


def load_prompts(
    source: str | None, n: int, seed: int, tokenizer: PreTrainedTokenizerBase
) -> list[Prompt]:
    """The first n prompts of `source` (a JSONL path; None = the built-in set), tokenized."""
    items = read_jsonl(source)[:n] if source else builtin_prompts(n, seed)
    prompts = []
    for item in items:
        ids = tokenizer(item["prompt"], add_special_tokens=False, return_tensors="pt").input_ids[0]  # [T]
        if ids.numel() == 0:
            raise ValueError(f"prompt {item['id']!r} is empty after tokenization")
        prompts.append(Prompt(id=item["id"], text=item["prompt"], input_ids=ids))
    return prompts
