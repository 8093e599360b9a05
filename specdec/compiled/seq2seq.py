"""The compiled path for encoder-decoder models: the same static cache, buckets and rule, plus each row's source.

Contract: ``StaticSeq2SeqCache`` is ``StaticRaggedCache`` whose buffers also hold, per row, the encoder's output
[R, W, H], every decoder layer's cross-attention keys and values [R, heads, W, dim] and the live source tokens
[R, W]; W, the longest source rounded up to ``SLOT_STEP``, is a dynamic dimension of the graph (grown when a
longer source joins, narrowed when it leaves). ``CompiledSeq2Seq`` is ``CompiledModel`` whose step calls the
model with the encoder's output and 4D masks built in the graph; its encoder is compiled too (``warm_encoder``,
one source at its own length) and reached by the eager ``Seq2SeqCache`` through the cache factory that
``prepare`` registers (``encode``). The prefill stays eager (a ``Seq2SeqCache``, merged in); a joining row's
cross-attention keys and values are computed once by the decoder's own modules (``cross_states``).

Which models: BART-style cross-attention (``encoder_attn``) and positions from a table (``seq2seq_refusal``).
Measurements: docs/journal/compiled-path.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel, StaticCache

from specdec import kernels
from specdec.compat import cache_kwargs
from specdec.compiled.graphs import ENCODER, CompiledModel, attended, graph_file, step_inputs
from specdec.compiled.policy import SLOT_STEP, cross_attentions
from specdec.compiled.static_cache import StaticRaggedCache, moved_rows
from specdec.loading import input_device
from specdec.seq2seq import Seq2SeqCache


class _Cached(Exception):
    """Raised by ``_Capture`` with what a cross-attention module hands its cache."""


class _Capture(DynamicCache):
    """A cross-attention cache that stops the module at its update: the keys and values it would cache are all that
    ``cross_states`` wants, not the attention and output projection after them."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise _Cached(key_states, value_states)


@torch.inference_mode()
def cross_states(model: PreTrainedModel, encoded: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per decoder layer, the cross-attention keys and values [B, heads, S, dim] of ``encoded`` [B, S, H],
    computed by the layer's own module (its key and value projections), as the eager cache's first forward does;
    each module stopped where it caches them (``_Capture``: 0.4 of the time of running it whole, translate-target)."""
    states = []
    query = encoded[:, :1]  # [B, 1, H]: the query is not used, only what the module caches
    for module in cross_attentions(model):
        scratch = EncoderDecoderCache(DynamicCache(), _Capture())
        try:
            module(query, key_value_states=encoded, **cache_kwargs(module, scratch))
        except _Cached as cached:
            states.append(cached.args)
        else:
            raise TypeError(f"{type(module).__name__} cached no cross-attention keys and values")
    return states


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


class CompiledSeq2Seq(CompiledModel):
    """An encoder-decoder model's compiled decode step (see the module docstring)."""

    encoder: Callable[..., torch.Tensor] | None = None  # the encoder compiled (``warm_encoder``)

    def _encoder_step(self, ids: torch.Tensor) -> torch.Tensor:
        """The encoder's output [1, S, H] for one source ``ids`` [1, S] (no padding)."""
        return self.model.get_encoder()(input_ids=ids).last_hidden_state

    def warm_encoder(self) -> None:
        """Compile the encoder for one source of any length (the length dynamic; loaded from the compile cache where
        it was saved, ``graph_file`` of ``ENCODER``) and check it against the eager encoder (a ValueError if a fresh
        compile differs; a cached one is compiled again). Eagerly, transformers' Python around translate-target's
        three encoder layers took about half of the encoder's 5.4-5.8 ms a source (one thread)."""
        device = input_device(self.model)
        ids = torch.randint(0, self.model.config.get_text_config().vocab_size, (1, SLOT_STEP + 3), device=device)
        torch._dynamo.mark_dynamic(ids, 1)
        with torch.inference_mode(), kernels.active():
            expected = self._encoder_step(ids)

        def trace() -> Callable[..., object]:
            with torch.no_grad():  # traced for inference: no autograd graph around the operator
                return self._trace((ids,), self._encoder_step, attention="eager")  # a source's own length: all live

        def run(graph: Callable[..., object]) -> torch.Tensor:
            with torch.inference_mode():
                return graph(self, ids)

        self.encoder = self._checked(graph_file(self.model, self.slots, ENCODER), trace, run, expected,
                                     "encoder outputs")

    @torch.inference_mode()
    def encode(self, source: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
        """The encoder's output [B, S, H] of the rows' sources ``source`` [B, S] (``valid`` marks real tokens) by the
        compiled encoder, each row alone at its own length (as ``generate`` encodes a source; the padding's columns
        are zeros, masked everywhere they are read); None where it was not compiled or a source has one token (the
        length the graph was not traced for), and the eager encoder runs."""
        counts = valid.sum(dim=1).tolist()
        if self.encoder is None or min(counts) < 2:
            return None
        if len(counts) == 1 and counts[0] == source.shape[1]:
            return self.encoder(self, source.contiguous())
        encoded = torch.zeros(*source.shape, self.hidden_size, dtype=self.layout[0][3], device=source.device)
        for row, real in enumerate(valid):
            encoded[row, real] = self.encoder(self, source[row, real][None])[0]
        return encoded

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
        return self.with_sources(super().new_cache(rows, device), width, device)

    def with_sources(self, self_attention: StaticCache, width: int,
                     device: torch.device | str) -> StaticEncoderDecoderCache:
        """``self_attention``'s rows with zeroed source buffers of ``width``: the cross-attention keys and values,
        the encoder output [rows, width, hidden] and the source mask [rows, width], their width dimension dynamic
        in the graph."""
        rows, dtype = self_attention.layers[0].keys.shape[0], self.layout[0][3]
        cross = DynamicCache()
        for index, (heads, key_dim, value_dim) in enumerate(self.cross_layout):
            keys = torch.zeros(rows, heads, width, key_dim, dtype=dtype, device=device)
            values = torch.zeros(rows, heads, width, value_dim, dtype=dtype, device=device)
            cross.update(keys, values, index)
        encoded = torch.zeros(rows, width, self.hidden_size, dtype=dtype, device=device)
        source_live = torch.zeros(rows, width, dtype=torch.bool, device=device)
        for layer in cross.layers:
            torch._dynamo.mark_dynamic(layer.keys, 2)
            torch._dynamo.mark_dynamic(layer.values, 2)
        torch._dynamo.mark_dynamic(encoded, 1)
        torch._dynamo.mark_dynamic(source_live, 1)
        return StaticEncoderDecoderCache(self_attention, cross, encoded, source_live)

    def _step(self, ids: torch.Tensor, live: torch.Tensor, cache: StaticEncoderDecoderCache, hidden: bool,
              last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``CompiledModel._step`` of the decoder: logits [R, n, V] (and the last hidden states [R, n, H]) of
        ``ids`` [R, n] written at the cache's write pointer, each row attending its live slots ``live`` [R, S]
        and its source (``cache.source_live`` [R, W]); ``last`` [1]: that column's logits only (sliced: these
        models' forwards compute the head for every token)."""
        n, slots = ids.shape[1], live.shape[1]
        dtype = self.layout[0][3]
        positions, mask = step_inputs(ids, live, cache, dtype)
        source = cache.source_live[:, None, None, :].expand(-1, 1, n, -1)  # [R, 1, n, W]
        source_mask = torch.zeros(source.shape, dtype=dtype, device=ids.device).masked_fill(
            ~source, torch.finfo(dtype).min)  # [R, 1, n, W] (a dead row attends nothing: uniform, dropped)
        kwargs: dict = {}
        with self.positions.applied(kwargs, positions, None, slots):
            out = self.model(encoder_outputs=(cache.encoded,), attention_mask=source_mask, decoder_input_ids=ids,
                             decoder_attention_mask=mask, **{self.keyword: cache}, use_cache=True,
                             output_hidden_states=hidden, **kwargs)
        logits = out.logits[:, -n:]
        return logits if last is None else logits[:, last], out.decoder_hidden_states[-1] if hidden else None


class StaticSeq2SeqCache(StaticRaggedCache):
    """``StaticRaggedCache`` whose rows also hold their sources (see the module docstring)."""

    cache: StaticEncoderDecoderCache | None
    compiled: CompiledSeq2Seq

    @property
    def source_width(self) -> int:
        return self.cache.source_live.shape[1] if self.cache is not None else 0

    def _sources(self, cache: StaticEncoderDecoderCache) -> StaticEncoderDecoderCache:
        """``cache`` (new source buffers) holding the current sources: as many rows and columns as fit."""
        if self.cache is not None:
            old = self.cache
            kept = min(cache.source_live.shape[0], old.source_live.shape[0])
            used = min(cache.source_live.shape[1], self.source_width)
            for mine, theirs in zip(cache.cross_attention_cache.layers, old.cross_attention_cache.layers):
                mine.keys[:kept, :, :used] = theirs.keys[:kept, :, :used]
                mine.values[:kept, :, :used] = theirs.values[:kept, :, :used]
            cache.encoded[:kept, :used] = old.encoded[:kept, :used]
            cache.source_live[:kept, :used] = old.source_live[:kept, :used]
        return cache

    def _buffers(self, rows: int) -> StaticEncoderDecoderCache:
        """New self-attention buffers and source buffers of the current source width, holding the sources."""
        return self._sources(self.compiled.new_cache(rows, self.device, self.source_width or SLOT_STEP))

    def _widen(self, width: int) -> None:
        """Source buffers at least ``width`` wide (rounded up to ``SLOT_STEP``), contents kept."""
        width = -(-width // SLOT_STEP) * SLOT_STEP
        if width > self.source_width:
            self.cache = self._sources(self.compiled.with_sources(self.cache.self_attention_cache, width, self.device))

    @torch.inference_mode()
    def select(self, rows: torch.Tensor) -> None:
        if self.cache is not None:
            kept = len(rows)
            if (moved := moved_rows(rows)) is not None:  # the rows that move, as the self-attention's (``select``)
                places, sources = moved
                for layer in self.cache.cross_attention_cache.layers:
                    for t in (layer.keys, layer.values):
                        t[places] = t[sources]
            for t in (self.cache.encoded, self.cache.source_live):
                picked = t[rows].clone()
                t[kept:] = 0
                t[:kept] = picked
        super().select(rows)
        self._narrow()

    def _narrow(self) -> None:
        """Source buffers only as wide as the widest kept source (rounded up to ``SLOT_STEP``; contents kept): every
        step's cross-attention reads the whole width, so one long source that has left would otherwise cost each
        later row its width (a 335-token source among 40 of 4-25 kept the translation bench's steps at 352 columns
        for the 39 after it)."""
        if self.cache is None:
            return
        columns = self.cache.source_live.any(dim=0).nonzero()  # [k, 1]: the columns some kept row attends
        width = max(SLOT_STEP, -(-(int(columns.max()) + 1 if len(columns) else 0) // SLOT_STEP) * SLOT_STEP)
        if width < self.source_width:
            self.cache = self._sources(self.compiled.with_sources(self.cache.self_attention_cache, width, self.device))

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
        for layer, (keys, values) in zip(self.cache.cross_attention_cache.layers,
                                         cross_states(self.model, other.encoded)):
            layer.keys[new, :, :width] = keys
            layer.values[new, :, :width] = values
        self.cache.encoded[new, :width] = other.encoded
        self.cache.source_live[new] = False
        self.cache.source_live[new, :width] = other.source_mask.to(self.device)

