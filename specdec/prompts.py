"""Prompts as a caller gives them (token ids, integer tensors, strings with a tokenizer, or lists of those) -> each
prompt's token ids, with one clear line for what does not fit."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase


def _ids(prompt: object, where: str) -> list[int]:
    """One prompt's token ids from a list of ints or an integer tensor [T] / [1, T]."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise TypeError(f"{where} must hold integer token ids, got a {prompt.dtype} tensor")
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1:
            raise ValueError(f"{where} must have shape [T] or [1, T], got {list(prompt.shape)}")
        return prompt.tolist()
    try:
        return [operator.index(t) for t in prompt]  # type: ignore[union-attr]
    except TypeError as err:
        raise TypeError(f"{where} must be a list of ints, a LongTensor or (with tokenizer=) a string") from err


def _scalar(value: object) -> bool:
    """Whether ``value`` is one token id (an int, or a 0-dim integer tensor) rather than a prompt."""
    return not isinstance(value, (str, bytes, Sequence)) and (
        not isinstance(value, torch.Tensor) or value.dim() == 0)


def prompt_list(prompts: object, tokenizer: PreTrainedTokenizerBase | None,
                noun: str = "prompt") -> tuple[list[list[int]], bool]:
    """``prompts`` -> (each prompt's ids, whether one prompt was given rather than a list).

    One prompt: a list of ints, an integer tensor [T] or [1, T], or a string (with ``tokenizer``).
    Several: a list of those (all strings or all ids), or an integer tensor [B, T] with B > 1.
    ``noun`` names them in errors ("prompt", or "source" for an encoder-decoder target)."""
    if isinstance(prompts, str):
        return [_one(prompts, tokenizer, f"the {noun}")], True
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() < 2 or prompts.shape[0] == 1:
            return [_one(prompts, tokenizer, f"the {noun}")], True
        if prompts.dim() != 2:
            raise ValueError(f"{noun}s must have shape [T], [1, T] or [B, T], got {list(prompts.shape)}")
        return [_one(p, tokenizer, f"{noun} {i}") for i, p in enumerate(prompts)], False
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise TypeError(f"{noun}s must be token ids, a string, or a list of those, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError(f"the {noun} is empty (no tokens, or an empty list of {noun}s): pass at least one {noun} "
                         "of at least one token" + (" (e.g. the tokenizer's bos token)" if noun == "prompt" else ""))
    if _scalar(prompts[0]):
        return [_one(prompts, tokenizer, f"the {noun}")], True
    if len({isinstance(p, str) for p in prompts}) > 1:
        raise TypeError(f"the {noun}s mix strings and token ids: pass all strings (with tokenizer=) or all ids")
    return [_one(p, tokenizer, f"{noun} {i}") for i, p in enumerate(prompts)], False


def _one(prompt: object, tokenizer: PreTrainedTokenizerBase | None, where: str) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise TypeError(f"{where} is a string: pass tokenizer= to encode it (or pass token ids)")
        return list(tokenizer(prompt)["input_ids"])
    return _ids(prompt, where)
