"""A prefill's last decoder layer writes its keys and values and computes nothing else (``keys_only``).

A prefill feeds a prompt's first T-1 tokens into the cache and uses no logits: the first round feeds the last token
(``seq2seq._prefilled``). So the last decoder layer's queries, attention, output projection and MLP are work nobody
reads. On a thread inside ``keys_only(model)``, the last layer of a Llama model (exactly ``LlamaDecoderLayer`` with
``LlamaAttention``: another class may compute its keys otherwise) computes its input norm, ``k_proj``, ``v_proj`` and
the rotary embedding of the keys, writes them to the cache, and hands its input on unchanged: the cache holds the
same floats as after the whole layer (the same modules on the same rows), and the model's output is not to be read.
On the AMD EPYC (1 thread, the helper on), a 137-token prompt joining 3 rows: code-target's ``ModelTarget.prefill``
19.05 ms against 21.31, code-drafter's 1.59 against 2.21 (``benchmarks/prefill_tail.py``;
docs/journal/2026-12-06-http-front-process.md, "The
HTTP front in a process of its own").

How: ``LlamaDecoderLayer.forward`` is wrapped once, when this module is imported (before any compile traces it). The
wrapper hands every call to transformers' own forward, except the call of the layer this thread marked, outside a
compiled trace: other threads' forwards (a batch decoding beside a prefill), compiled steps and every other model
run as before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, apply_rotary_pos_emb

from specdec.compat import LAYER_KEYWORD

_local = threading.local()  # .layer: the layer whose forward writes keys and values only, on this thread
_FORWARD = LlamaDecoderLayer.forward


def last_layer(model: PreTrainedModel) -> LlamaDecoderLayer | None:
    """``model``'s last decoder layer where ``keys_only`` covers it: a decoder-only Llama, its classes exactly."""
    if getattr(model.config, "is_encoder_decoder", False):
        return None
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or len(layers) != model.config.num_hidden_layers:
        return None
    layer = layers[-1]
    return layer if type(layer) is LlamaDecoderLayer and type(layer.self_attn) is LlamaAttention else None


@contextlib.contextmanager
def keys_only(model: PreTrainedModel) -> Iterator[None]:
    """Forwards of ``model`` on this thread inside run its last layer as keys and values only (where ``last_layer``
    covers it); their output is not to be read."""
    was, _local.layer = getattr(_local, "layer", None), last_layer(model)
    try:
        yield
    finally:
        _local.layer = was


def _forward(self: LlamaDecoderLayer, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    if (not torch.compiler.is_compiling() and getattr(_local, "layer", None) is self and not args
            and kwargs.get(LAYER_KEYWORD) is not None and kwargs.get("position_embeddings") is not None):
        return _keys_and_values(self, hidden_states, kwargs["position_embeddings"], kwargs[LAYER_KEYWORD])
    return _FORWARD(self, hidden_states, *args, **kwargs)


def _keys_and_values(layer: LlamaDecoderLayer, hidden_states: torch.Tensor, position_embeddings: object,
                     cache: object) -> torch.Tensor:
    """What ``LlamaAttention.forward`` writes to the cache, by the same modules, and ``hidden_states`` unchanged."""
    attention = layer.self_attn
    x = layer.input_layernorm(hidden_states)
    shape = (*x.shape[:-1], -1, attention.head_dim)
    keys = attention.k_proj(x).view(shape).transpose(1, 2)
    values = attention.v_proj(x).view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    _, keys = apply_rotary_pos_emb(keys, keys, cos, sin)
    cache.update(keys, values, attention.layer_idx)
    return hidden_states


LlamaDecoderLayer.forward = _forward
