"""Encoder-decoder models behind the same cache handle: each row's encoder output, per-row positions.

A ``Seq2SeqCache`` is a ``RaggedCache`` of the decoder's self-attention (rows of different lengths,
dead slots masked) that also holds, per row, the encoder's output for its source: the encoder runs
once per source, when the row joins (``encode``), and the cross-attention keys and values computed
from it are kept in the ``EncoderDecoderCache`` beside the self-attention cache, so a round feeds
the decoder only its new tokens. Rows leaving select the cross-attention cache too; rows joining
pad the sources (right, masked) and have the cross-attention recomputed once for the batch.

Positions. transformers' encoder-decoder decoders compute positions from cache slots (Marian, BART
and Pegasus add ``embed_positions`` of ``past_key_values_length + arange``; T5 biases attention
by slot distances), which is wrong once rows of a batch hold different numbers of live tokens: the
cache gives them the rows' own positions by the one rule of ``positions.Positions``, as it gives
decoder-only models theirs.

Blocks (SpecDec's block drafter as an encoder-decoder, ``drafters/block.py``): a forward given
``block_size=k`` treats its last k inputs as one block that attends to itself both ways (and to
every live slot before it); the tokens before the block stay causal. The decoder gets this as a 4D
additive mask (``cache.causal_mask`` with the block), which transformers' decoders take as it is.

The decoder's start token begins every row's committed sequence and is never part of the output.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import torch
from torch import nn
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, ModelOutput

from specdec.attention import prefilling
from specdec.batch import PromptBatch, prefill_groups
from specdec.cache import CacheFactory, CacheHandle, RaggedCache, causal_mask, registered_cache
from specdec.compat import cache_kwargs
from specdec.features import Capture
from specdec.recurrent import RecurrentCache, is_recurrent
from specdec.selfcheck import check_cached_path
from specdec.tail import keys_only


def is_encoder_decoder(model: PreTrainedModel) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def decoder_start_id(model: PreTrainedModel) -> int:
    """The token every decoder sequence starts with, as ``generate`` picks it: ``decoder_start_token_id``, else
    ``bos_token_id`` (generation config first, then the model's config)."""
    for name in ("decoder_start_token_id", "bos_token_id"):
        for config in (getattr(model, "generation_config", None), model.config):
            start = getattr(config, name, None)
            if start is not None:
                return int(start)
    raise ValueError(f"{type(model).__name__} declares no decoder_start_token_id (nor bos_token_id): "
                     "set it in its config")


def source_limit(model: PreTrainedModel) -> int | None:
    """The longest source the encoder takes (its positions), or None when unbounded (relative positions)."""
    encoder = model.get_encoder()
    table = getattr(encoder, "embed_positions", None)
    if isinstance(table, nn.Embedding):
        return table.num_embeddings - int(getattr(table, "offset", 0))
    return None


class Seq2SeqCache(RaggedCache):
    """The decoder cache of an encoder-decoder model for ragged rows, with each row's encoder output."""

    def __init__(self, model: PreTrainedModel, rows: int = 0, device: torch.device | str = "cpu") -> None:
        super().__init__(model, rows, device, cache=DynamicCache())
        self.encoded: torch.Tensor | None = None  # [B, S, H] encoder outputs
        self._encoder_output = BaseModelOutput  # the encoder's output class (MoE encoders add router_logits)
        self.source_mask = torch.zeros(rows, 0, dtype=torch.bool, device=device)  # [B, S] real source tokens
        self._sources: tuple[ModelOutput | None, torch.Tensor | None] = (None, None)  # what every forward passes
        self.cross = DynamicCache()  # cross-attention keys and values, computed at the first decoder forward
        self.past = EncoderDecoderCache(self.cache, self.cross)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def encode(self, source: torch.Tensor, valid: torch.Tensor) -> int:
        """Run the encoder once on the rows' sources [B, S] (``valid`` [B, S] marks real tokens)."""
        full = bool(valid.all())  # no padding: no mask (what transformers' sdpa masks make of all ones too)
        factory = registered_cache(self.model)  # a compiled model's encoder (specdec.compiled.StaticCaches.encode)
        encoded = factory.encode(source, valid) if hasattr(factory, "encode") else None
        if encoded is not None:
            self.encoded, self._encoder_output = encoded, BaseModelOutput
        else:
            out = self.model.get_encoder()(input_ids=source, attention_mask=None if full else valid.long())
            self.encoded, self._encoder_output = out.last_hidden_state, type(out)
        self.source_mask = valid
        self._sources_changed(full)
        return 1

    def _sources_changed(self, full: bool | None = None) -> None:
        """Build once what every decoder forward passes for the rows' sources: the encoder's output object and
        the source mask, None where no source is padded (``full``; found from the mask when not given), which
        spares every step transformers' mask building (its check of an all-ones mask reads it on the host)."""
        if self.encoded is None:
            self._sources = (None, None)
            return
        full = bool(self.source_mask.all()) if full is None else full
        self._sources = (self._encoder_output(last_hidden_state=self.encoded),
                         None if full else self.source_mask.long())

    def _call(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor,
              logits_to_keep: int, kwargs: dict) -> ModelOutput:
        block_size = int(kwargs.pop("block_size", 0))
        decoder_mask = attention_mask.long() if attention_mask is not None else None  # [B, S + n]
        if block_size:  # the last block_size inputs attend to each other both ways
            n = input_ids.shape[1]
            valid = (attention_mask if attention_mask is not None
                     else torch.ones(input_ids.shape[0], self.slots + n, dtype=torch.bool, device=input_ids.device))
            block = torch.zeros_like(valid)
            block[:, -block_size:] = True
            decoder_mask = causal_mask(valid, n, self.encoded.dtype, block)
        if self._keeps_logits:
            kwargs["logits_to_keep"] = logits_to_keep
        encoded, source_mask = self._sources
        with self.positions.applied(kwargs, positions, attention_mask, self.slots + input_ids.shape[1]):
            out = self.model(encoder_outputs=encoded, attention_mask=source_mask,
                             decoder_input_ids=input_ids, decoder_attention_mask=decoder_mask,
                             **cache_kwargs(self.model, self.past), use_cache=True, **kwargs)
        if not self._keeps_logits:
            out.logits = out.logits[:, -logits_to_keep:]
        return out

    def _reset_cross(self) -> None:
        """Forget the cross-attention keys and values: the next forward recomputes them for every row."""
        self.cross = DynamicCache()
        self.past = EncoderDecoderCache(self.cache, self.cross)

    def select(self, rows: torch.Tensor) -> None:
        super().select(rows)
        if self.encoded is not None:
            self.encoded, self.source_mask = self.encoded[rows], self.source_mask[rows]
            self._sources_changed()
        self.cross.batch_select_indices(rows)
        self.past = EncoderDecoderCache(self.cache, self.cross)
        self.past.is_updated = {i: self.cross.get_seq_length(i) > 0 for i in range(len(self.cross))}

    def merge(self, other: RaggedCache) -> None:
        assert isinstance(other, Seq2SeqCache)
        rows = self.rows
        super().merge(other)
        self._encoder_output = other._encoder_output
        if rows == 0 or self.encoded is None:
            self.encoded, self.source_mask = other.encoded, other.source_mask
        elif other.encoded is not None:
            width = max(self.encoded.shape[1], other.encoded.shape[1])
            pad = (lambda t: nn.functional.pad(t, (0, 0, 0, width - t.shape[1])))
            self.encoded = torch.cat([pad(self.encoded), pad(other.encoded)])
            masks = [nn.functional.pad(m, (0, width - m.shape[1])) for m in (self.source_mask, other.source_mask)]
            self.source_mask = torch.cat(masks)
        self._sources_changed()
        self._reset_cross()


def cache_for(model: PreTrainedModel, rows: int, device: torch.device | str) -> RaggedCache:
    """The cache handle of ``model``: a ``Seq2SeqCache`` for an encoder-decoder model, a ``RecurrentCache`` for
    a model with recurrent layers, else a ``RaggedCache``."""
    if is_encoder_decoder(model):
        return Seq2SeqCache(model, rows, device)
    return RecurrentCache(model, rows, device) if is_recurrent(model) else RaggedCache(model, rows, device)


def decoding_cache(model: PreTrainedModel, device: torch.device | str,
                   caches: CacheFactory | None = None) -> CacheHandle:
    """The cache handle a target or drafter decodes with: ``caches(device)`` when a factory is given, else the one
    registered for ``model`` (``cache.register_cache``: a model compiled by ``specdec.compiled.prepare``), else
    ``cache_for``'s eager handle."""
    factory = caches if caches is not None else registered_cache(model)
    return cache_for(model, 0, device) if factory is None else factory(device)


def rows_apart(model: PreTrainedModel, prompts: PromptBatch, device: torch.device | str,
               ids: Callable[[torch.Tensor], torch.Tensor] = lambda ids: ids) -> str | None:
    """"MODEL decodes rows one at a time: why" when rows of different lengths cannot share ``model``'s forwards
    (``RaggedCache.apart``), else None; the self-check runs first (once per model, on ``prompts``' first row),
    raising what refuses even one row."""
    check_cached_path(model, prompts, device, cache_for, ids)
    reason = cache_for(model, 0, device).apart()
    return None if reason is None else f"{type(model).__name__} decodes rows one at a time: {reason}"


def prefilled_cache(model: PreTrainedModel, prompts: PromptBatch, device: torch.device | str,
                    ids: Callable[[torch.Tensor], torch.Tensor] = lambda ids: ids,
                    capture: Capture | None = None) -> tuple[RaggedCache, int]:
    """A cache of ``model`` for the new rows ``prompts``: each row's source encoded once (an encoder-decoder
    model), then every prompt token but the last fed (as ``ids(...)`` maps them); the last stays for the
    next forward. Rows of unlike lengths are fed in separate forwards (``prefilled_caches``), their caches
    merged in order, pairs of neighbours level by level: each row is copied about log2(groups) times (merging each
    group into the first had cost 0.23 of 1.38 s for 16 code prompts in 7 groups, every merge copying every row so
    far; docs/benchmarks.md, "Attention over the live slots"). Returns the cache (to merge into the running batch's)
    and the model calls made. ``capture``: each forward's features go to it (``features.Capture``: a target asked
    for them)."""
    parts, calls = prefilled_caches(model, prompts, device, ids, capture)
    while len(parts) > 1:
        parts = [parts[i] if i + 1 == len(parts) else _merged(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    return parts[0], calls


def prefilled_caches(model: PreTrainedModel, prompts: PromptBatch, device: torch.device | str,
                     ids: Callable[[torch.Tensor], torch.Tensor] = lambda ids: ids,
                     capture: Capture | None = None) -> tuple[list[RaggedCache], int]:
    """``prefilled_cache``'s caches before they are merged: one per group of rows fed in one forward
    (``batch.prefill_groups``: rows of like lengths share a forward), in the rows' order; and the model calls made."""
    check_cached_path(model, prompts, device, cache_for, ids)
    groups = prefill_groups(prompts.widths()) if prompts.size > 1 else [(0, prompts.size)]
    parts, calls = [], 0
    for start, end in groups:
        part, more = _prefilled(model, prompts if len(groups) == 1 else prompts.part(start, end), device, ids,
                                capture)
        parts.append(part)
        calls += more
    return parts, calls


def prefill_into(cache: object, model: PreTrainedModel, prompts: PromptBatch, device: torch.device | str,
                 ids: Callable[[torch.Tensor], torch.Tensor] = lambda ids: ids, capture: Capture | None = None) -> int:
    """Prefill the new rows ``prompts`` and append them to ``cache``, a running batch's cache handle; the model calls
    made (``prefilled_parts``, then each part merged in order)."""
    parts, calls = prefilled_parts(cache, model, prompts, device, ids, capture)
    for part in parts:
        cache.merge(part)
    return calls


def prefilled_parts(cache: object, model: PreTrainedModel, prompts: PromptBatch, device: torch.device | str,
                    ids: Callable[[torch.Tensor], torch.Tensor] = lambda ids: ids,
                    capture: Capture | None = None) -> tuple[list[RaggedCache], int]:
    """The caches of the new rows ``prompts`` that ``cache`` (a running batch's cache handle) merges, in order, to
    append them, and the model calls made; ``cache`` itself is only read (whether it ``merges_rows``), so they may be
    computed while the batch decodes on another thread. A handle whose merge copies only the new rows (``merges_rows``:
    a compiled model's static cache) takes each group's cache in turn (``prefilled_caches``); another takes them
    merged first (``prefilled_cache``), so its running rows are copied once."""
    if not getattr(cache, "merges_rows", False):
        new, calls = prefilled_cache(model, prompts, device, ids, capture)
        return [new], calls
    return prefilled_caches(model, prompts, device, ids, capture)


def _merged(first: RaggedCache, second: RaggedCache) -> RaggedCache:
    first.merge(second)
    return first


def _prefilled(model: PreTrainedModel, prompts: PromptBatch, device: torch.device | str,
               ids: Callable[[torch.Tensor], torch.Tensor], capture: Capture | None = None) -> tuple[RaggedCache, int]:
    """``prefilled_cache`` of rows fed in one forward (and one encoder pass)."""
    new = cache_for(model, prompts.size, device)
    calls = 0
    if is_encoder_decoder(model):
        assert prompts.source is not None, f"an encoder-decoder {type(model).__name__} needs each row's source"
        calls += new.encode(prompts.source, prompts.source_valid())
    if prompts.ids.shape[1] > 1:
        valid = prompts.valid()[:, :-1]  # [B, T-1]
        valid = None if bool(valid.all()) else valid
        asked = {} if capture is None else {"output_hidden_states": capture.asks}
        # its attention on both cores where the helper shares the products; its last layer's keys and values only
        # (unless a capture reads that layer's output)
        tail = keys_only(model) if capture is None or not capture.whole_last else contextlib.nullcontext()
        with prefilling(model), tail:
            out = new.forward(ids(prompts.ids[:, :-1]), valid, **asked)
        calls += 1
        if capture is not None:
            capture.took(out.hidden_states, valid)
    elif capture is not None:
        capture.nothing(prompts.size)
    return new, calls

