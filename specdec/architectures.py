"""What specdec knows about a model family before it decodes: what it refuses (by name, with the reason),
where a local attention window limits batches, and which families are known to decode exactly.

specdec feeds a model only its uncached tokens and rolls its KV cache back after a rejected draft,
so it needs the model's whole state in a transformers ``Cache`` whose layers can be cropped:

- ``state_refusal``: a model that keeps state outside the cache (XLNet's ``mems``, XLM's ``cache``
  dict, Reformer's ``past_buckets_states``; a ``state`` or ``cache_params`` argument of a family
  ``specdec.module_state.ARGUMENT_STATES`` does not carry: any forward that takes no transformers ``Cache``,
  whatever this release calls it, ``specdec.compat.cache_keyword``)
  would decode wrong tokens, so it is refused, naming its class and where its state lives (or that it
  has no KV cache at all). RWKV and xLSTM, registered there, get a ``RecurrentCache`` instead.
- ``family_refusal``: a family whose own ``generate`` output depends on how tokens are fed (Moshi:
  a declared window its attention ignores, which only ``generate``'s self-trimming cache applies):
  refused by name with that reason (``FEED_DEPENDENT``).
- ``new_cache``: the cache a model's forward takes: a ``DynamicCache`` of the config's layer types, or a
  family's own class where its forward takes no other (``OWN_CACHES``: MiniMax's ``MiniMaxCache``, whose
  linear-attention state ``specdec.recurrent`` checkpoints), or for a family whose state is a forward
  argument (RWKV, xLSTM) an attention-free cache holding that state (``module_state.held_cache``).
- ``layer_refusal``: cache layers that hold recurrent or linear-attention state (Mamba-style,
  and hybrid layers such as Zaya's and Falcon-H1's, which subclass ``DynamicLayer`` but carry
  a recurrent state beside their keys) cannot be cropped: refused, naming the layer type.
- ``local_window``: a local / sliding attention window read from the config (``layer_types`` or
  ``attention_layers`` naming local or sliding layers, then ``sliding_window``, ``window_size``, a
  decoder-only ``attention_window``). The window is a mask over cache slots, so ``RaggedCache``
  keeps such a model's rows right-aligned (no dead slot inside a row's window): batches are exact.
- ``attention_chunk``: chunked attention (``attention_chunk_size``) cuts at positions that transformers'
  chunked mask counts from a row's left padding: a dead slot inside a row would shift them, so
  ``RaggedCache`` keeps such rows right-aligned as it does for a window: batches are exact.
- ``MASKLESS_SINGLE_STEPS`` (LED: its decoder builds no mask for a one-token forward) and
  ``MISREAD_2D_MASKS`` (GIT: its cached text-only forward widens a 2D mask by image tokens it does not
  hold): the cache feeds such a step beside dead slots as two tokens, a dead copy first, or gives the
  mask as 4D: batches are exact.
- ``ROWS_APART``: families whose rows of different lengths cannot share a forward (RoFormer: rotary
  positions from the cache's slot count, baked into the cached keys): the round loop decodes their
  rows one at a time (``specdec.decode.Decoder``), each as it decodes alone. ``ROWS_APART_IF_SET``: the same
  where the config turns such a feature on (Inkling's query scaling by slot count, ``log_scaling_n_floor``).
- ``KNOWN_GOOD``: families whose cached multi-token forward is known to equal their one-pass
  forward (the shipped Llama and Marian pairs among them); every other model is self-checked once
  at its first prefill (``seq2seq.check_cached_path``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DummyLayer, DynamicLayer, LinearAttentionCacheLayerMixin

from specdec.compat import cache_keyword
from specdec.module_state import ARGUMENT_STATES, held_cache

# forward argument -> the state a model keeps there, outside a transformers Cache that specdec can roll back
STATE_ARGUMENTS: dict[str, str] = {
    "state": "its recurrent state (the `state` argument)",  # RWKV's, where not in module_state.ARGUMENT_STATES
    "mems": "its memory (`mems`)",  # XLNet
    "cache": "its own `cache` dictionary",  # XLM
    "past_buckets_states": "its LSH buckets and states (`past_buckets_states`)",  # Reformer
    "cache_params": "its recurrent state (`cache_params`)",  # xLSTM's, where not in module_state.ARGUMENT_STATES
}

KV_KEYWORDS = ("cache", "past_key_values")  # compat.cache_keyword's answers for a KV cache (not 5.23's cache_params)

# model_type -> why a family's own generate cannot be reproduced by any verification (refused by name)
FEED_DEPENDENT: dict[str, str] = {
    "moshi": "declares a sliding_window that its attention never applies (its mask is fully causal); generate's "
             "cache trims itself to that window, so generate's output depends on how many tokens each forward "
             "takes (a long prompt's one prefill sees it all, each later step only the window) and no multi-token "
             "verification can reproduce it",
}

INSTEAD = "Decode it with generate() instead"  # the fix every refusal of a model ends with


# model_type -> why rows of different lengths cannot share its forwards (each row is then decoded alone)
ROWS_APART: dict[str, str] = {
    "roformer": "its rotary positions are the cache's slot count, baked into each key as it is cached, so a row whose "
                "slots move (left padding as rows join, re-packing) or hold dead slots between live ones (another "
                "row's rejected drafts) sees its keys at the wrong distances",
}


# model_type -> (a config field, why): as ROWS_APART, where the decoder's config sets that field (not None)
ROWS_APART_IF_SET: dict[str, tuple[str, str]] = {
    "inkling_text": ("log_scaling_n_floor", ("its full-attention layers scale each query by its cache slot count "
                                             "(log scaling past log_scaling_n_floor), which a row behind dead slots "
                                             "(a shorter row's left padding) counts from the wrong start")),
}


def family_rows_apart(model: PreTrainedModel) -> str | None:
    """Why rows of ``model`` cannot share a forward (``ROWS_APART``, ``ROWS_APART_IF_SET``), or None."""
    kind = getattr(model.config, "model_type", "")
    field, reason = ROWS_APART_IF_SET.get(kind, ("", None))
    if reason is not None and getattr(model.config.get_text_config(decoder=True), field, None) is not None:
        return reason
    return ROWS_APART.get(kind)


# model_type -> why a one-token forward would attend to dead slots: such a forward with dead slots in the cache is
# fed as two tokens, a dead copy first (its mask is then built; the dead slot is re-packed away like any other)
MASKLESS_SINGLE_STEPS: dict[str, str] = {
    "led": "its decoder builds no attention mask for a one-token forward",
}


# model_type -> why a 2D attention mask would be misread: such a model gets the 4D mask itself (causal, dead slots
# masked), which transformers passes through unchanged
MISREAD_2D_MASKS: dict[str, str] = {
    "git": "its cached text-only forward widens a 2D mask by image tokens it does not hold, shifting it",
}


def _minimax_cache(config: PretrainedConfig) -> Cache:
    """MiniMax's own ``MiniMaxCache`` (its forward takes no other), one layer per model layer from the config: its
    attention layers as usual, its linear-attention layers stateless (``DummyLayer``), their state in the cache's
    ``linear_cache`` list, one entry per layer (None: no state yet), where ``specdec.recurrent`` checkpoints it."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    cache = MiniMaxCache()
    cache.layers = [DummyLayer() if isinstance(layer, LinearAttentionCacheLayerMixin) else layer
                    for layer in DynamicCache(config=config).layers]
    cache.linear_cache = [None] * len(cache.layers)  # get_linear_cache indexes it by layer
    return cache


# model_type -> the cache its forward demands (a class of its own, which a DynamicCache is not), built from the config
OWN_CACHES: dict[str, Callable[[PretrainedConfig], Cache]] = {
    "minimax": _minimax_cache,
}


def new_cache(model: PreTrainedModel) -> Cache:
    """An empty cache of the kind ``model``'s forward takes: its family's own (``OWN_CACHES``), else a
    ``DynamicCache`` with the config's layer types."""
    kind = getattr(model.config, "model_type", "")
    if kind in ARGUMENT_STATES:  # its state a forward argument: a cache holding it in its state list
        return held_cache(model.config)
    build = OWN_CACHES.get(kind)
    return build(model.config) if build is not None else DynamicCache(config=model.config)


# model_type of families whose cached path specdec's tests check against generate (no self-check needed)
KNOWN_GOOD: frozenset[str] = frozenset({"llama", "marian", "gpt2", "qwen2", "gpt_neox", "bart", "t5"})

LOCAL_LAYER_WORDS = ("sliding", "local")  # layer types whose attention sees a window of the latest tokens


def state_refusal(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot be decoded (state outside the cache, or no cache), or None."""
    if cache_keyword(model) in KV_KEYWORDS:
        return None
    arguments = inspect.signature(model.forward).parameters
    name = type(model).__name__
    fix = "Use a model with a KV cache (its forward takes a transformers Cache)"
    where = next((STATE_ARGUMENTS[a] for a in arguments if a in STATE_ARGUMENTS), None)
    if where is None:
        return (f"{name} has no KV cache (its forward takes no transformers Cache): specdec feeds a model only its "
                f"new tokens and rolls its cache back after a rejected draft. {fix}")
    return (f"{name} keeps {where} outside a transformers Cache: specdec feeds only the new tokens and rolls the "
            f"cache back after a rejected draft, so it would decode wrong tokens. {fix}")


def family_refusal(model: PreTrainedModel) -> str | None:
    """Why ``model``'s family cannot be decoded exactly (``FEED_DEPENDENT``), or None."""
    reason = FEED_DEPENDENT.get(getattr(model.config, "model_type", ""))
    if reason is None:
        return None
    return f"{type(model).__name__} {reason}. {INSTEAD}"


def layer_refusal(model: PreTrainedModel, layers: list) -> str | None:
    """Why ``model``'s cache ``layers`` cannot be rolled back (recurrent state), or None."""
    for layer in layers:
        if isinstance(layer, DummyLayer):
            continue  # stores nothing (a layer reading an earlier layer's keys, Gemma-3n's KV sharing; no attention)
        if isinstance(layer, LinearAttentionCacheLayerMixin) or not isinstance(layer, DynamicLayer):
            return (f"{type(model).__name__} uses cache layers of type {type(layer).__name__}, which hold recurrent "
                    "(or linear-attention) state that an attention cache cannot roll back after a rejected draft; "
                    "specdec.recurrent.RecurrentCache (what specdec.seq2seq.cache_for builds for such a model) "
                    "checkpoints it instead")
    return None


_DECODER_CONFIGS = ("decoder", "generator", "text_config")  # where get_text_config(decoder=True) looks first
_UNSET = object()


def decoder_setting(config: PretrainedConfig, name: str) -> object:
    """``getattr(config.get_text_config(decoder=True), name, None)``, without the deep copy transformers makes of
    a flat encoder-decoder config (Marian, BART, T5: no decoder sub-config) at every call (0.7 ms, and a cache
    reads two settings for every row that joins): the copy is that config with each ``decoder_X`` renamed to
    ``X``, so ``decoder_{name}`` is read where the config has it, else ``name``."""
    flat = getattr(config, "is_encoder_decoder", False) and all(
        getattr(config, sub, None) is None for sub in _DECODER_CONFIGS)
    if not flat:
        return getattr(config.get_text_config(decoder=True), name, None)
    value = getattr(config, f"decoder_{name}", _UNSET)
    return getattr(config, name, None) if value is _UNSET else value


def local_window(config: PretrainedConfig) -> int | None:
    """The decoder's local attention window in tokens, or None when every layer attends to the whole sequence."""
    types = decoder_setting(config, "layer_types") or decoder_setting(config, "attention_layers")
    if types is not None and not any(word in str(kind) for kind in types for word in LOCAL_LAYER_WORDS):
        return None
    names = ["sliding_window", "window_size"]
    if not decoder_setting(config, "is_encoder_decoder"):
        names.append("attention_window")
    for name in names:
        window = decoder_setting(config, name)
        if isinstance(window, list):  # per-layer windows (Longformer style): the smallest binds
            window = min(window) if window else None
        if isinstance(window, int) and window > 0:
            return window
    return None


def attention_chunk(config: PretrainedConfig) -> int | None:
    """The decoder's attention chunk size (Llama 4: tokens attend within fixed chunks of positions), or None."""
    chunk = decoder_setting(config, "attention_chunk_size")
    types = decoder_setting(config, "layer_types")
    if types is not None and not any("chunked" in str(kind) for kind in types):
        return None
    return chunk if isinstance(chunk, int) and chunk > 0 else None
