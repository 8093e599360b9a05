"""A prefill's attention shared over both cores (``prefilling``).

An eager prefill's products are shared with the blocked operator's helper thread (``specdec.kernels``: the second
core), but its attention was SDPA's flash kernel on one thread, the second core idle meanwhile: 6 layers of
code-target over a 173-token prompt took 5.8-6.4 ms of the prefill's 26-29. On a thread inside
``prefilling(model)``, a prefill's attention is computed by ``specdec::decode_attention`` (``csrc/attention.c``, the
compiled step's attention, its rows shared with the helper) on chunks of ``CHUNK`` queries, each chunk a row of the
operator: a chunk reads only the keys its queries see (causal: the slots up to its last query), and the chunks are
shared between the two cores. On the AMD EPYC (AVX-512, 2 cores, 1 thread): the attention of that prefill 2.9 ms,
the prefill 23.5 ms against 26.2 (docs/journal/2026-12-06-prefill-attention.md, "A prefill's attention on both cores").

How: transformers' attention function "sdpa" is ``prefill_attention``, which hands every call to transformers' own
sdpa attention (the function registered before it) except on a thread inside ``prefilling``, so the model's
configuration, its masks and every other forward (another thread's, a compiled trace's) are sdpa's as before. What
it computes is sdpa's rule, ``softmax(q k^T * scale + mask) v`` under the mask transformers made for sdpa (None:
causal, from an empty cache); the floats differ from SDPA's in their last bits, as the compiled step's do. A call it
does not cover runs sdpa's: not float32 on the CPU, a head dimension the operator lacks, keys and values of unlike
shapes, dropout, a relative bias, soft-capping, sinks, a mask that is not one per row, fewer than ``MIN_TOKENS``
queries.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdec import kernels

CHUNK = 16  # queries a row of the operator: 16 balanced the two cores better than 32 or 64 (3.5 ms, 4.6, 5.1)
MIN_TOKENS = 32  # fewer queries: sdpa's (a short prompt's attention is not worth the chunks' set-up)
# keyword inputs of transformers' attention functions that change what attention computes: a call with any of them
# set is not the operator's to compute (here, and in a compiled step:
# ``compiled.specdec_attention``); sdpa's computes it
OTHER = ("position_bias", "cache", "softcap", "s_aux", "sinks", "head_mask", "alibi")
DIMS = (32, 64, 80, 96, 128, 256)  # head dimensions csrc/attention.c computes (its HEAD_DIMS)
ACC = 8192  # its MAX_ACC: query heads per key-value head x queries a row x head dimension at most

_local = threading.local()  # .on: this thread is inside ``prefilling``


def wanted(model: PreTrainedModel) -> bool:
    """Whether ``model``'s prefill attention is shared here: a decoder-only float32 CPU model with sdpa attention,
    specdec's operators loaded and their helper on (without it, one core computes it either way)."""
    config = model.config
    return (not getattr(config, "is_encoder_decoder", False) and getattr(config, "_attn_implementation", None) == "sdpa"
            and model.dtype == torch.float32 and model.device.type == "cpu" and kernels.helper_on())


@contextlib.contextmanager
def prefilling(model: PreTrainedModel) -> Iterator[None]:
    """Forwards of ``model`` on this thread inside compute a prefill's attention with ``prefill_attention`` (where
    ``wanted``)."""
    if not wanted(model):
        yield
        return
    was, _local.on, _local.masks = getattr(_local, "on", False), True, None
    try:
        yield
    finally:
        _local.on, _local.masks = was, None


def prefill_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' attention function "sdpa": on a thread inside ``prefilling``, a call it covers by
    ``specdec::decode_attention`` in chunks of queries; else transformers' own sdpa attention on the same inputs."""
    if (not torch.compiler.is_compiling() and getattr(_local, "on", False) and not dropout
            and all(kwargs.get(name) is None for name in OTHER)):
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        covered = query.shape[2] >= MIN_TOKENS and covers(query, key, value, CHUNK)
        masks = _chunk_masks(query, key, attention_mask, causal) if covered else None
        if masks is not None:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            out = [_chunked(query[b], key[b], value[b], masks[b if len(masks) > 1 else 0], scale)
                   for b in range(query.shape[0])]
            return (out[0] if len(out) == 1 else torch.cat(out)), None
    return _SDPA(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _chunk_masks(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
                 causal: bool) -> list[torch.Tensor] | None:
    """The additive float32 mask sdpa would apply, per row (or one for all) as the operator's rows [chunks, CHUNK, S]
    (padding queries see nothing); None where this call is not covered. Made once per forward: every layer of it
    gets the same mask (kept on the thread until it leaves ``prefilling``)."""
    rows, _, tokens, _ = query.shape
    slots = key.shape[2]
    made, shape = _local.masks, (tokens, slots, causal)
    if made is not None and made[0] is mask and made[1] == shape:
        return made[2]
    if mask is None:  # sdpa: causal (top-left) where the module is causal; here only a prefill from an empty cache
        if not causal or slots != tokens:
            return None
        allowed = torch.ones(tokens, tokens, dtype=torch.bool, device=query.device).tril()[None]
    elif (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[0] in (1, rows) and mask.shape[2] == tokens
          and mask.shape[3] >= slots and mask.dtype in (torch.bool, torch.float32)):
        allowed = mask[:, 0, :, :slots]
    else:
        return None
    chunks = -(-tokens // CHUNK)
    lowest = torch.finfo(torch.float32).min
    out = torch.full((len(allowed), chunks * CHUNK, slots), lowest, dtype=torch.float32, device=query.device)
    if allowed.dtype == torch.bool:
        out[:, :tokens].masked_fill_(allowed, 0.0)
    else:
        out[:, :tokens] = allowed
    masks = list(out.view(len(allowed), chunks, CHUNK, slots))
    _local.masks = (mask, shape, masks)
    return masks


def covers(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, queries: int) -> bool:
    """Whether ``specdec::decode_attention`` takes these inputs with ``queries`` queries a row of it: float32 CPU
    tensors, a head dimension it has, key-value heads dividing the query heads, its accumulators enough, keys and
    values alike with each slot's contiguous (here, and in a compiled step: ``compiled.specdec_attention``)."""
    heads, dim = query.shape[1], query.shape[-1]
    kv_heads = key.shape[1]
    return (all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (query, key, value))
            and dim in DIMS and heads % kv_heads == 0 and heads // kv_heads * queries * dim <= ACC
            and tuple(value.shape) == tuple(key.shape) and key.shape[-1] == dim
            and key.stride(-1) == value.stride(-1) == 1 and key.stride(-2) == value.stride(-2) == dim)


def _chunked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
             scale: float) -> torch.Tensor:
    """One row's attention: ``query`` [H, q, D] against ``key``, ``value`` [Hkv, S, D] under ``mask`` [chunks, CHUNK,
    S], as the operator's rows of ``CHUNK`` queries each (the last padded with zero queries, dropped) -> [1, q, H,
    D]."""
    heads, tokens, dim = query.shape
    chunks, full = len(mask), tokens // CHUNK
    q = query.new_empty(chunks, heads, CHUNK, dim)  # [chunks, H, CHUNK, D]
    q[:full].copy_(query[:, :full * CHUNK].view(heads, full, CHUNK, dim).transpose(0, 1))
    if full < chunks:
        q[full, :, :tokens - full * CHUNK] = query[:, full * CHUNK:]
        q[full, :, tokens - full * CHUNK:] = 0.0
    k = key[None].expand(chunks, *key.shape)  # every chunk reads the same keys (a row stride of 0)
    v = value[None].expand(chunks, *value.shape)
    out = torch.ops.specdec.decode_attention(q, k, v, mask, scale)  # [chunks, CHUNK, H, D]
    return out.view(chunks * CHUNK, heads, dim)[:tokens][None]


_SDPA = ALL_ATTENTION_FUNCTIONS["sdpa"]  # transformers' sdpa attention (``sdpa_attention_forward``), or what was there
if getattr(_SDPA, "__name__", "") != "prefill_attention":  # a reloaded module does not wrap itself
    AttentionInterface.register("sdpa", prefill_attention)
