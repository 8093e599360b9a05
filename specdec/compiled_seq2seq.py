"""The compiled decode step of encoder-decoder models (``--compile on`` for translation targets and drafters).

``specdec.compiled``'s machinery, extended by what a decoder step also reads: each row's source.

- ``StaticSeq2SeqCache``: ``StaticRaggedCache`` (the same static self-attention layers, token buckets,
  slot widths, dead-token padding, rollback, ``compact``, ``select`` and ``merge`` rule) whose buffers also
  hold, per row, the encoder's output ``encoded`` [R, W, H], the cross-attention keys and values
  [R, heads, W, dim] of every decoder layer and the live source tokens ``source_live`` [R, W]. ``W``, the
  source width, is the longest source of the batch rounded up to ``SLOT_STEP`` (grown when a longer one
  joins, never shrunk); it is a dynamic dimension of the graph (``mark_dynamic``), so no source length
  recompiles, and the padding beyond a row's source is masked.
- The encoder and the prefill stay eager (``seq2seq.prefilled_cache``'s ``Seq2SeqCache``, merged in); the
  joining rows' cross-attention keys and values are computed then, once per row, by the decoder's own
  cross-attention modules (``cross_states``), as the eager cache computes them at its first forward.
- ``CompiledSeq2Seq``: ``CompiledModel`` whose step calls the model with the encoder's output, the source
  mask and the self-attention mask as 4D additive masks built inside the graph, and an
  ``EncoderDecoderCache`` whose cross-attention layers are marked computed (``is_updated``) so every
  layer reads its keys and values from the static buffers.
- Positions: the decoders of this family (BART, Marian, ...) add ``embed_positions`` computed from the cache
  length; ``positions.Positions`` replaces them with each row's own positions (live tokens before each
  token) by its forward hook on that table, which the graph traces as it runs eagerly.

Which models: encoder-decoder models whose decoder reads positions from a table (``Positions``' table
hook or a ``decoder_position_ids`` argument) and whose decoder layers have a BART-style cross-attention
(``encoder_attn``, reading ``EncoderDecoderCache.is_updated``); ``refusal`` names why another one (T5's
relative position bias, ...) decodes eagerly, said once.

Measured (docs/benchmarks.md, "The translation pair compiled"; 1 thread, a busy 2-core CPU): the decoder
step of ``translate-target`` 0.85-0.88 of eager (``benchmarks/compiled_buckets.py --model translate-target``),
``translate-drafter``'s 0.77-0.91; end to end (``specdec bench --task translate --compile off|on``,
``benchmarks/translate_breakdown.py --compile``) within the machine's noise: per source the encoder and the
row's set-up, per round the loop is most of a token's time at this model size.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel, StaticCache

from specdec.compiled import SLOT_STEP, CompiledModel, Shape, StaticRaggedCache, attended, step_inputs
from specdec.loading import input_device
from specdec.positions import positions_for
from specdec.seq2seq import Seq2SeqCache


def cross_attentions(model: PreTrainedModel) -> list[torch.nn.Module] | None:
    """The decoder layers' cross-attention modules (BART-style ``encoder_attn``), or None."""
    try:
        layers = getattr(model.get_decoder(), "layers", None)
    except (AttributeError, NotImplementedError, ValueError):
        return None
    modules = [getattr(layer, "encoder_attn", None) for layer in layers or ()]
    return modules if modules and all(hasattr(m, "layer_idx") for m in modules) else None


def refusal(model: PreTrainedModel) -> str | None:
    """Why the encoder-decoder ``model`` cannot take the static cache (``compiled.compile_refusal``), or None."""
    name = type(model).__name__
    positions = positions_for(model)
    if not positions.supported or positions.needs_keys:
        how = "a relative position bias" if positions.needs_keys else "positions of its own"
        return f"{name}'s decoder computes {how} (the compiled path gives positions from a table)"
    if cross_attentions(model) is None:
        return f"{name}'s decoder layers have no BART-style cross-attention (encoder_attn) reading a cache"
    return None


@torch.inference_mode()
def cross_states(model: PreTrainedModel, encoded: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per decoder layer, the cross-attention keys and values [B, heads, S, dim] of ``encoded`` [B, S, H],
    computed by the layer's own module (its key and value projections), as the eager cache's first forward does."""
    scratch = EncoderDecoderCache(DynamicCache(), DynamicCache())
    query = encoded[:, :1]  # [B, 1, H]: the query is not used, only what the module caches
    for module in cross_attentions(model):
        module(query, key_value_states=encoded, past_key_values=scratch)
    return [(layer.keys, layer.values) for layer in scratch.cross_attention_cache.layers]


class StaticEncoderDecoderCache(EncoderDecoderCache):
    """What the compiled step takes: the static self-attention cache (``layers`` are its layers, as
    ``StaticRaggedCache`` reads them), the cross-attention keys and values, marked computed, and each
    row's encoder output and live source tokens."""

    def __init__(self, self_attention: StaticCache, cross: DynamicCache, encoded: torch.Tensor,
                 source_live: torch.Tensor) -> None:
        super().__init__(self_attention, cross)
        self.is_updated = dict.fromkeys(range(len(cross.layers)), True)  # every layer reads the buffers
        self.encoded, self.source_live = encoded, source_live  # [R, W, H], [R, W]

    @property
    def layers(self) -> list:
        return self.self_attention_cache.layers


def _static_sources(rows: int, width: int, cross_layout: list, hidden: int, dtype: torch.dtype,
                    device: torch.device | str) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """Zeroed cross-attention buffers, encoder output [rows, width, hidden] and source mask [rows, width], their
    width dimension dynamic in the graph."""
    cross = DynamicCache()
    for index, (heads, key_dim, value_dim) in enumerate(cross_layout):
        keys = torch.zeros(rows, heads, width, key_dim, dtype=dtype, device=device)
        values = torch.zeros(rows, heads, width, value_dim, dtype=dtype, device=device)
        cross.update(keys, values, index)
    encoded = torch.zeros(rows, width, hidden, dtype=dtype, device=device)
    source_live = torch.zeros(rows, width, dtype=torch.bool, device=device)
    for layer in cross.layers:
        torch._dynamo.mark_dynamic(layer.keys, 2)
        torch._dynamo.mark_dynamic(layer.values, 2)
    torch._dynamo.mark_dynamic(encoded, 1)
    torch._dynamo.mark_dynamic(source_live, 1)
    return cross, encoded, source_live


class CompiledSeq2Seq(CompiledModel):
    """An encoder-decoder model's compiled decode step (see the module docstring)."""

    handle = None  # set below: the cache handle ``compiled.decoding_cache`` gives

    def _layout(self) -> list[tuple[int, int, int, torch.dtype]]:
        """Per decoder layer: (kv heads, key dim, value dim, dtype) of the self-attention, and ``cross_layout``,
        read from one eager forward of one token on a one-token source."""
        device = input_device(self.model)
        probe = Seq2SeqCache(self.model, 1, device)
        one = torch.zeros(1, 1, dtype=torch.long, device=device)
        with torch.no_grad():
            probe.encode(one, torch.ones_like(one, dtype=torch.bool))
            probe.forward(one)
        self.hidden_size = probe.encoded.shape[-1]
        self.cross_layout = [(k.shape[1], k.shape[-1], v.shape[-1]) for k, v in cross_states(self.model, probe.encoded)]
        return [(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1], layer.keys.dtype)
                for layer in probe.cache.layers]

    @torch.inference_mode()
    def new_cache(self, rows: int, device: torch.device | str, width: int = 0) -> StaticEncoderDecoderCache:
        """``CompiledModel.new_cache``'s self-attention buffers and source buffers of ``width`` (0: the warm-up's
        width, one ``SLOT_STEP`` more than any self-attention width it attends, so that the two dynamic
        dimensions never share a size there and keep their own symbols)."""
        width = width or attended(self.slots, self.slots) + SLOT_STEP
        cross, encoded, source_live = _static_sources(rows, width, self.cross_layout, self.hidden_size,
                                                      self.layout[0][3], device)
        return StaticEncoderDecoderCache(super().new_cache(rows, device), cross, encoded, source_live)

    def _step(self, ids: torch.Tensor, live: torch.Tensor, cache: StaticEncoderDecoderCache,
              hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``CompiledModel._step`` of the decoder: logits [R, n, V] (and the last hidden states [R, n, H]) of
        ``ids`` [R, n] written at the cache's write pointer, each row attending its live slots ``live`` [R, S]
        and its source (``cache.source_live`` [R, W])."""
        n, slots = ids.shape[1], live.shape[1]
        dtype = self.layout[0][3]
        positions, mask = step_inputs(ids, live, cache, dtype)
        source = cache.source_live[:, None, None, :].expand(-1, 1, n, -1)  # [R, 1, n, W]
        source_mask = torch.zeros(source.shape, dtype=dtype, device=ids.device).masked_fill(
            ~source, torch.finfo(dtype).min)  # [R, 1, n, W] (a dead row attends nothing: uniform, dropped)
        kwargs: dict = {}
        with positions_for(self.model).applied(kwargs, positions, None, slots):
            out = self.model(encoder_outputs=(cache.encoded,), attention_mask=source_mask, decoder_input_ids=ids,
                             decoder_attention_mask=mask, past_key_values=cache, use_cache=True,
                             output_hidden_states=hidden, **kwargs)
        return out.logits[:, -n:], out.decoder_hidden_states[-1] if hidden else None


class StaticSeq2SeqCache(StaticRaggedCache):
    """``StaticRaggedCache`` whose rows also hold their sources (see the module docstring)."""

    cache: StaticEncoderDecoderCache | None
    compiled: CompiledSeq2Seq

    @property
    def source_width(self) -> int:
        return self.cache.source_live.shape[1] if self.cache is not None else 0

    def _sources(self, rows: int, width: int) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """Source buffers of ``rows`` rows and ``width`` holding the current ones."""
        cross, encoded, source_live = _static_sources(rows, width, self.compiled.cross_layout,
                                                      self.compiled.hidden_size, self.compiled.layout[0][3],
                                                      self.device)
        if self.cache is not None:
            old = self.cache
            kept, used = min(rows, old.source_live.shape[0]), min(width, self.source_width)
            for mine, theirs in zip(cross.layers, old.cross_attention_cache.layers):
                mine.keys[:kept, :, :used] = theirs.keys[:kept, :, :used]
                mine.values[:kept, :, :used] = theirs.values[:kept, :, :used]
            encoded[:kept, :used] = old.encoded[:kept, :used]
            source_live[:kept, :used] = old.source_live[:kept, :used]
        return cross, encoded, source_live

    def _reserve(self, rows: int) -> None:
        old = self.cache
        super()._reserve(rows)  # the self-attention buffers, a new StaticEncoderDecoderCache when they grew
        if self.cache is not old:
            width = old.source_live.shape[1] if old is not None else SLOT_STEP
            self.cache, fresh = old, self.cache  # read the old sources into buffers of the new row bucket
            cross, encoded, source_live = self._sources(self.capacity, width)
            self.cache = StaticEncoderDecoderCache(fresh.self_attention_cache, cross, encoded, source_live)

    def _widen(self, width: int) -> None:
        """Source buffers at least ``width`` wide (rounded up to ``SLOT_STEP``), contents kept."""
        width = -(-width // SLOT_STEP) * SLOT_STEP
        if width > self.source_width:
            cross, encoded, source_live = self._sources(self.capacity, width)
            self.cache = StaticEncoderDecoderCache(self.cache.self_attention_cache, cross, encoded, source_live)

    @torch.inference_mode()
    def select(self, rows: torch.Tensor) -> None:
        if self.cache is not None:
            kept = len(rows)
            for layer in self.cache.cross_attention_cache.layers:
                for t in (layer.keys, layer.values):
                    t[:kept].copy_(t[rows])
            for t in (self.cache.encoded, self.cache.source_live):
                picked = t[rows].clone()
                t[kept:] = 0
                t[:kept] = picked
        super().select(rows)

    @torch.inference_mode()
    def merge(self, other: Seq2SeqCache) -> None:
        """Append the rows of ``other`` (the eager prefill of new rows): their self-attention as
        ``StaticRaggedCache.merge``, their sources and cross-attention keys and values into the source buffers."""
        if other.rows == 0:
            return
        if not isinstance(other, Seq2SeqCache) or other.encoded is None:
            raise TypeError("a static encoder-decoder cache merges the Seq2SeqCache of encoded rows")
        rows = self.rows
        super().merge(other)
        width = other.encoded.shape[1]
        self._widen(width)
        new = slice(rows, rows + other.rows)
        for layer, (keys, values) in zip(self.cache.cross_attention_cache.layers, cross_states(self.model, other.encoded)):
            layer.keys[new, :, :width] = keys
            layer.values[new, :, :width] = values
        self.cache.encoded[new, :width] = other.encoded
        self.cache.source_live[new] = False
        self.cache.source_live[new, :width] = other.source_mask.to(self.device)


CompiledSeq2Seq.handle = StaticSeq2SeqCache

__all__ = ["CompiledSeq2Seq", "Shape", "StaticEncoderDecoderCache", "StaticSeq2SeqCache", "cross_states", "refusal"]
