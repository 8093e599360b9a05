"""The names transformers gives a model's cache, read from the installed release and the model itself.

transformers 5.24 renamed ``past_key_values`` (and Mamba-style ``cache_params``) to ``cache``: in every model's
forward signature, in the keyword a model hands its decoder layers, and in its outputs' fields. The old keywords
still work until 5.40 but warn at every call, and ``model(cache=...)`` on 5.23 is silently ignored. So no call site
in specdec names a cache keyword: each asks this module, which reads the forward it is about to call.

- ``cache_keyword(model)``: the keyword under which ``model.forward`` takes its ``Cache`` (``cache``,
  ``past_key_values`` or, before 5.24, a recurrent family's ``cache_params``), or None when it takes none. XLM's
  ``cache`` is a dict of its own, not a ``Cache``: not a cache keyword (``specdec.architectures.state_refusal``
  refuses such a model by name).
- ``cache_of(output)``: the cache a forward returned, under whichever field its output class declares.
- ``LAYER_KEYWORD``: the keyword under which a transformers model of this release hands its decoder layers the cache.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging as hf_logging

RENAMED = "cache" in CausalLMOutputWithPast.__dataclass_fields__  # transformers >= 5.24
LAYER_KEYWORD = "cache" if RENAMED else "past_key_values"
NAMES = ("cache", "past_key_values", "cache_params")  # every name a Cache has had, the current one first

_keywords: dict[Any, str | None] = {}  # a forward's function -> its cache keyword (a signature costs ~30 us)


def _takes_cache(parameter: inspect.Parameter) -> bool:
    """Whether a ``cache`` parameter is a transformers ``Cache``: XLM's and Flaubert's are annotated as a ``dict`` of
    their own (the annotation is read for that alone: RoBERTa's ``Cache`` is annotated as a tuple of tuples)."""
    return "dict" not in str(parameter.annotation)


def cache_keyword(model: Any) -> str | None:
    """The keyword under which ``model``'s forward takes its cache, or None when it takes none."""
    forward = getattr(model.forward, "__func__", model.forward)
    if forward not in _keywords:
        parameters = inspect.signature(model.forward).parameters
        found = None
        for name in NAMES:
            if name in parameters and (name != "cache" or _takes_cache(parameters[name])):
                found = name
                break
        _keywords[forward] = found
    return _keywords[forward]


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for a call of ``model``, under the keyword its forward takes."""
    return {cache_keyword(model) or "past_key_values": cache}


def cache_of(output: Any) -> Any:
    """The cache a forward returned (its output's ``cache``, ``past_key_values`` or ``cache_params`` field)."""
    fields = getattr(output, "__dataclass_fields__", None) or {}
    for name in NAMES:
        if name in fields:
            return getattr(output, name)
    return None


@contextmanager
def progress_bars(shown: bool) -> Iterator[None]:
    """transformers' (and the Hub's) progress bars on or off inside the block, as they were after it."""
    before = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()
