"""The KV-cache handle of a batch: one model's ``DynamicCache`` whose rows hold ragged sequences.

The rows of a batch commit different numbers of tokens each round (ragged acceptance), but a ``DynamicCache``
stores one tensor ``[B, heads, slots, dim]`` per layer. ``RaggedCache`` keeps every row in the same slots and
marks each slot live or dead: ``mask [B, S]`` (the model's 2D attention mask, so dead slots are never attended
to) and ``live [B]``. A token's position is its number of live tokens before it (``positions.Positions``), so
holes never shift positions: every row sees exactly what it would see decoded alone. The mask is passed only
once a slot is dead, so a batch whose rows never differ (one prompt) runs as ``generate`` runs it.

Operations: ``forward(ids [B, n], valid [B, n] | None)`` feeds only uncached tokens; ``keep(n [B])`` rolls
each row back to its first ``n`` live tokens; ``select(rows [B'])`` keeps some rows; ``merge(other)`` appends
another cache's rows; ``compact()`` re-packs the rows once dead slots outnumber live ones, so holes cost at
most a constant factor of attention work and memory.

Where a dead slot would change what a row attends to, the cache avoids it: local windows and chunks re-pack
(``compact``) before a forward, sparse attention is fed one token at a time after the prefill, a maskless
one-token forward gets a dead copy first, and rows that cannot share a forward (``apart``) are given one at a
time. State kept outside the cache is refused up front, naming the model; recurrent layers are
``specdec.recurrent.RecurrentCache``'s, which checkpoints and replays their state. The rules per family, and
why each: docs/journal/cache.md.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
)
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput

from specdec.architectures import (
    MASKLESS_SINGLE_STEPS,
    MISREAD_2D_MASKS,
    attention_chunk,
    family_refusal,
    family_rows_apart,
    layer_refusal,
    local_window,
    new_cache,
    state_refusal,
)
from specdec.compat import cache_kwargs
from specdec.positions import positions_for
from specdec.selfcheck import verdict_of

COMPACT_MIN_SLOTS = 32  # below this many slots, holes cost too little to be worth re-packing
# A cache re-packs its rows (``compact``) once the slots in use past its longest row's live tokens reach this share of
# them (``repack_pays``): holes from ragged acceptance and rows gone widen every row's attention (and, eagerly, the
# copy of every slot that each forward's ``torch.cat`` makes) until then. 16 rows of code-target holding 230 live
# tokens each, compiled: a verification of 5 tokens took 61.5 ms over 360 slots and 53.5 ms re-packed to 229, the
# re-pack 31 ms (``benchmarks/batch_rows.py --steps``).
REPACK_WASTE = 0.5

# a self-trimming sliding-window layer -> the plain layer that keeps every slot (the window then the model's mask)
PLAIN_LAYERS: dict[type, type] = {
    DynamicSlidingWindowLayer: DynamicLayer,
    LinearAttentionAndSlidingWindowAttentionLayer: LinearAttentionAndFullAttentionLayer,  # Inkling: state beside keys
}


def plain(layer: object) -> object:
    """``layer`` if it keeps every slot, else an empty plain layer in its place (``PLAIN_LAYERS``; a hybrid layer
    with as many recurrent states)."""
    kind = PLAIN_LAYERS.get(type(layer))
    if kind is None:
        return layer
    states = getattr(layer, "number_of_states", None)
    return kind() if states is None else kind(number_of_states=states)


def repack_pays(slots: int, longest: int) -> bool:
    """Whether re-packing rows pays when ``slots`` are in use and the longest row holds ``longest`` live tokens: the
    slots it frees for every row (``slots - longest``) reach ``REPACK_WASTE`` of ``longest`` and
    ``COMPACT_MIN_SLOTS``."""
    return slots - longest >= max(COMPACT_MIN_SLOTS, REPACK_WASTE * longest)


def gather_slots(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The slots ``index`` [B, S'] of each row of keys or values ``t`` [B, H, S, D] -> [B, H, S', D] (values
    may be narrower than keys, latent attention: each gathered with its own shape). Row by row, whole slots at
    a time: ``gather`` over an expanded index reads an index per number, several times slower
    (docs/journal/cache.md)."""
    if t.requires_grad and t.shape[0]:  # ``out=`` does not differentiate
        return torch.stack([t[row].index_select(1, index[row]) for row in range(t.shape[0])])
    out = t.new_empty(t.shape[0], t.shape[1], index.shape[1], t.shape[3])
    for row in range(t.shape[0]):
        torch.index_select(t[row], 1, index[row], out=out[row])
    return out


def causal_mask(valid: torch.Tensor, queries: int, dtype: torch.dtype,
                block: torch.Tensor | None = None) -> torch.Tensor:
    """The 4D additive self-attention mask [B, 1, q, S] of a forward over the last ``queries`` of S slots.

    ``valid`` [B, S]: the slots that may be attended to (live cache slots and real new tokens); ``block``
    [B, S] (optional): the slots of each row's block. A query sees the valid slots up to its own (causal)
    and, when it is in a block, every valid slot of its block too (bidirectional). 0 where attended, the
    dtype's most negative value elsewhere (what eager and SDPA attention both add)."""
    slots = valid.shape[1]
    index = torch.arange(slots, device=valid.device)
    allowed = (index[None, :] <= index[slots - queries:, None])[None]  # [1, q, S] causal
    if block is not None:
        allowed = allowed | (block[:, slots - queries:, None] & block[:, None, :])  # [B, q, S]
    allowed = valid[:, None, :] & allowed  # [B, q, S]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=valid.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


class CacheHandle(Protocol):
    """What a target or drafter handle uses of its cache (``RaggedCache``, ``Seq2SeqCache``, ``RecurrentCache``,
    ``specdec.compiled``'s ``StaticRaggedCache``): rows of one model's cache, each with its own live tokens.

    - ``forward(input_ids [B, n], valid [B, n] | None, logits_to_keep, output_hidden_states)``: run the model on
      each row's new tokens (``valid`` marks the real ones; the others are dead and never attended), append them,
      and return an output with ``logits`` [B, k, V] (the last ``logits_to_keep``, 0: all) and, when asked,
      ``hidden_states`` (its last entry [B, k, H]). A token's position is the number of live tokens before it.
    - ``keep(n [B])``: keep each row's first ``n[b]`` live tokens (a rollback; ``n <= live``).
    - ``select(rows [B'])``: keep those rows, in that order. ``merge(other)``: append the rows of ``other``, an
      eager cache of the same model (a prefill: ``seq2seq.prefill_into``).
    - ``live`` [B]: each row's live tokens; ``rows``: B; ``slots`` and ``mask`` [B, slots]: the slots in use and
      which of them each row attends (read by a ``merge`` of this cache into another).
    - optional ``merges_rows``: a ``merge`` copies only the new rows (``seq2seq.prefilled_parts`` then merges each
      prefill group in turn instead of merging them first)."""

    live: torch.Tensor

    @property
    def rows(self) -> int: ...

    @property
    def slots(self) -> int: ...

    @property
    def mask(self) -> torch.Tensor: ...

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None, logits_to_keep: int = 1,
                output_hidden_states: bool = False) -> ModelOutput: ...

    def keep(self, n: torch.Tensor) -> None: ...

    def select(self, rows: torch.Tensor) -> None: ...

    def merge(self, other: RaggedCache) -> None: ...


class CacheFactory(Protocol):
    """Makes the cache handles of one model: ``factory(device)`` is a new, empty ``CacheHandle`` on ``device``
    (``specdec.compiled.StaticCaches`` for a compiled model). A factory may also have ``encode(source, valid)``:
    an encoder-decoder model's encoder output for the rows' sources, or None to encode eagerly
    (``seq2seq.Seq2SeqCache.encode``)."""

    def __call__(self, device: torch.device | str) -> CacheHandle: ...


# model -> the cache factory its handles decode with (``register_cache``); keyed weakly: nothing set on the model
_FACTORIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_cache(model: PreTrainedModel, factory: CacheFactory | None) -> None:
    """Make ``factory`` the cache factory of ``model``'s handles (None: the eager default again). The compiled path
    (``specdec.compiled.prepare``) registers its static caches here, so the eager core finds them without importing
    it. The factory must not hold ``model`` strongly (the table is keyed weakly by the model)."""
    if factory is None:
        _FACTORIES.pop(model, None)
    else:
        _FACTORIES[model] = factory


def registered_cache(model: PreTrainedModel) -> CacheFactory | None:
    """The cache factory registered for ``model`` (``register_cache``), or None: its handles decode eagerly."""
    return _FACTORIES.get(model)


class RaggedCache:
    """One model's KV cache for a batch of rows of different lengths."""

    recurrent = False  # whether this class handles recurrent / linear-attention layers (a subclass's job)

    def __init__(self, model: torch.nn.Module, rows: int = 0, device: torch.device | str = "cpu",
                 cache: Cache | None = None) -> None:
        self.model = model
        if not self.recurrent and (reason := state_refusal(model)) is not None:
            raise TypeError(reason)
        if (reason := family_refusal(model)) is not None:
            raise TypeError(reason)
        self.cache = cache if cache is not None else new_cache(model)
        if not self.recurrent and (reason := layer_refusal(model, self.cache.layers)) is not None:
            raise TypeError(reason)
        sliding = [layer.sliding_window for layer in self.cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]
        self.chunk = attention_chunk(model.config)  # chunked attention's chunk size; None = not chunked
        # the span a dead slot must not enter: a local window, or an attention chunk (cut at live-token positions
        # counted from the left padding, as transformers' chunked mask counts them: only holes inside a row shift it)
        self.window = local_window(model.config) or self.chunk or min(sliding, default=None)
        if self.window is not None and cache is None:
            # plain layers: the window is the model's mask over every slot, none trimmed (layers of other kinds kept:
            # sparse attention's indexed layers, a hybrid's (LFM3's) recurrent ones)
            self.cache.layers = [plain(layer) for layer in self.cache.layers]
        for layer in self.cache.layers:
            if isinstance(layer, DummyLayer):
                continue  # a layer without attention: nothing stored
            if isinstance(layer, LinearAttentionCacheLayerMixin):  # only a RecurrentCache gets here (layer_refusal)
                if isinstance(layer, DynamicSlidingWindowLayer):  # in a cache given to it (its own are made plain)
                    raise TypeError(f"{type(model).__name__} uses cache layers of type {type(layer).__name__}, whose "
                                    "recurrent state cannot be cropped after a rejected draft; give no cache (the "
                                    "cache handle then builds one that keeps such keys in plain layers)")
                continue  # state the subclass checkpoints (a hybrid layer's keys: the attention code below)
            if not isinstance(layer, DynamicLayer):
                raise TypeError(
                    f"{type(model).__name__} uses cache layers of type {type(layer).__name__}, which cannot "
                    "be rolled back after a rejected draft; use an attention-only model"
                )
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.activate_past_recording()
        self._sliding = any(isinstance(layer, DynamicSlidingWindowLayer) for layer in self.cache.layers)
        # sparse attention's indexer picks its top-k keys among scores full of exact ties (ReLU zeros), broken by
        # place: a multi-token cached forward can pick other keys than generate's single steps, so it is fed as
        # generate feeds it (one token at a time after the prefill), and its rows are kept apart (`apart`)
        self.one_at_a_time = any(isinstance(layer, DynamicIndexedLayer) for layer in self.cache.layers)
        self.mask_4d = getattr(model.config, "model_type", "") in MISREAD_2D_MASKS  # GIT: the mask given as 4D
        # a decoder that builds no mask for one token (LED): such a step beside dead slots goes in as two tokens
        self.two_token_steps = getattr(model.config, "model_type", "") in MASKLESS_SINGLE_STEPS
        self.positions = positions_for(model)
        self.refuse_rows = True  # refuse rows the model cannot decode exactly (the self-check turns it off)
        self.mask = torch.zeros(rows, 0, dtype=torch.bool, device=device)  # [B, S] live slots (see ``mask``)
        self.live = torch.zeros(rows, dtype=torch.long, device=device)  # [B] live tokens per row
        self.holes = False  # whether any slot is dead (then the model needs the mask and positions)

    @property
    def mask(self) -> torch.Tensor:
        """[B, S] bool, the live slots. While no slot is dead it is not kept (every forward would rebuild a
        tensor of ones) but made when read."""
        if self._mask is None:
            self._mask = torch.ones(self._shape, dtype=torch.bool, device=self._device)
        return self._mask

    @mask.setter
    def mask(self, value: torch.Tensor) -> None:
        self._mask, self._shape, self._device = value, tuple(value.shape), value.device

    def _all_live(self, rows: int, slots: int) -> None:
        """Every one of ``slots`` slots of the ``rows`` rows is live (the mask made only when read)."""
        self._mask, self._shape = None, (rows, slots)

    @property
    def rows(self) -> int:
        return self._shape[0]

    @property
    def slots(self) -> int:
        return self._shape[1]

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None, logits_to_keep: int = 1,
                **kwargs: object) -> ModelOutput:
        """Run the model on ``input_ids`` [B, n] (uncached tokens; ``valid`` [B, n] marks the real ones).

        Returns the model's output: logits of the last ``logits_to_keep`` positions [B, keep, V]
        (plus whatever ``kwargs`` ask for, e.g. hidden states)."""
        if self.one_at_a_time and input_ids.shape[1] > 1 and self.slots:  # as generate feeds it, after the prefill
            return joined([self.forward(input_ids[:, j:j + 1], None if valid is None else valid[:, j:j + 1], 1,
                                        **kwargs) for j in range(input_ids.shape[1])], logits_to_keep)
        holes = self.holes or valid is not None
        if self.two_token_steps and holes and input_ids.shape[1] == 1:  # a dead copy first: the mask is then built
            real = valid if valid is not None else torch.ones_like(input_ids, dtype=torch.bool)
            out = self.forward(input_ids.repeat(1, 2), torch.cat([torch.zeros_like(real), real], dim=1),
                               logits_to_keep, **kwargs)
            for name in ("hidden_states", "decoder_hidden_states"):  # the real token's only, as asked
                if out.get(name) is not None:
                    out[name] = tuple(h if h is None else h[:, -1:] for h in out[name])  # None: not selected
            return out
        if holes:
            self._check_rows()
        own_positions = not self.positions.supported and not self.recurrent  # attention over slots, positions its own
        if (self.window is not None or own_positions) and self.holes and self._inner_holes():
            self.compact()  # a window, or positions of the model's own (MPT's ALiBi), count slots: no dead slot inside
        rows, n = input_ids.shape
        if holes:
            real = valid if valid is not None else torch.ones_like(input_ids, dtype=torch.bool)  # [B, n]
            positions = self.live[:, None] + real.long().cumsum(1) - 1  # [B, n] live tokens before each
            if valid is not None:
                positions = positions.clamp_min(0)
            mask = torch.cat([self.mask, real], dim=1)  # [B, S + n]
            out = self._call(input_ids, mask, positions, logits_to_keep, kwargs)
            self.mask = mask
            self.live = self.live + real.sum(dim=1)
        else:  # no dead slot, before or among the new tokens: every row has all S slots live, and keeps them
            positions = torch.arange(self.slots, self.slots + n, device=input_ids.device).expand(rows, n)  # [B, n]
            if rows > 1:
                positions = positions.contiguous()  # a model may reshape them
            out = self._call(input_ids, None, positions, logits_to_keep, kwargs)
            self._all_live(rows, self.slots + n)
            self.live = self.live + n
        self.holes = holes
        return out

    def _check_rows(self) -> None:
        """Refuse a second row, or rows of different lengths, for a model whose rows cannot share a forward (the
        round loop decodes such a model's rows one at a time: ``specdec.decode.Decoder``, so only a caller driving
        this cache itself gets here)."""
        if self.refuse_rows and (reason := self.apart()) is not None:
            raise ValueError(f"{type(self.model).__name__} decodes rows one at a time: {reason}. Give this cache one "
                             "row (specdec's decoder does so itself)")

    def apart(self) -> str | None:
        """Why rows of different lengths cannot share this model's forwards (a row behind dead slots would not
        decode as it does alone), or None. The self-check's verdict counts once it has run (first prefill)."""
        verdict = verdict_of(self.model)
        if self.one_at_a_time:
            return ("its sparse attention picks its top-k keys among exactly tied scores by their place in the cache, "
                    "so a row behind a dead slot (a shorter row's left padding) attends to other keys than the row "
                    "alone (transformers' own batched forward differs from it too)")
        if self._sliding:
            return "its cache has sliding-window layers that trim themselves, which specdec cannot re-pack per row"
        if (reason := family_rows_apart(self.model)) is not None:
            return reason
        if verdict is not None and verdict.batched:
            return verdict.batched
        if verdict is None and not self.positions.supported:
            return "it computes positions from cache slots in a way specdec cannot correct per row"
        return None

    def _inner_holes(self) -> bool:
        """Whether some row has a dead slot after its first live one (not only left padding)."""
        return bool((~self.mask & (self.mask.long().cumsum(dim=1) > 0)).any())

    def _call(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor,
              logits_to_keep: int, kwargs: dict) -> ModelOutput:
        """The model's forward on new tokens at ``positions`` [B, n] (``attention_mask`` None: no holes)."""
        if attention_mask is not None:
            kwargs["attention_mask"] = (causal_mask(attention_mask, input_ids.shape[1], self.model.dtype)
                                        if self.mask_4d
                                        else attention_mask.long())
        with self.positions.applied(kwargs, positions, attention_mask, self.slots + input_ids.shape[1]):
            return self.model(input_ids=input_ids, **cache_kwargs(self.model, self.cache), use_cache=True,
                              logits_to_keep=logits_to_keep, **kwargs)

    def keep(self, n: torch.Tensor) -> None:
        """Keep the first ``n[b]`` live tokens of each row ``b`` (``n <= live``); drop the rest."""
        counts = n.tolist()
        if any(c > have for c, have in zip(counts, self.live.tolist())):
            raise ValueError(f"cannot keep {counts} tokens of rows holding {self.live.tolist()}")
        if not self.holes and len(set(counts)) <= 1:  # every row the same: an exact crop, no holes
            self._crop(self.slots - (counts[0] if counts else 0))
            self.live = n.clone()
            return
        self.mask &= self.mask.long().cumsum(dim=1) <= n[:, None]
        self.live = n.clone()
        used = self.mask.any(dim=0).nonzero()  # [S', 1] slots some row still uses
        self._crop(self.slots - (int(used[-1]) + 1 if len(used) else 0))
        self.holes = sum(counts) < self.rows * self.slots
        if self.holes and repack_pays(self.slots, max(counts)):
            self.compact()

    def _crop(self, drop: int) -> None:
        """Remove the last ``drop`` slots of every row."""
        if drop or self._sliding:  # sliding layers also shrink back to their window on crop(0)
            for layer in self._layers():  # a hybrid layer's keys only: its recurrent state is not cropped here
                (DynamicLayer.crop if isinstance(layer, LinearAttentionCacheLayerMixin)
                 else type(layer).crop)(layer, -drop)
        if self._mask is None:
            self._all_live(self.rows, self.slots - drop)
        else:
            self.mask = self._mask[:, : self.slots - drop]

    def _layers(self) -> list[DynamicLayer]:
        """The initialised attention layers (a layer is uninitialised until its first token)."""
        return [layer for layer in self.cache.layers
                if isinstance(layer, DynamicLayer) and layer.is_initialized and layer.keys is not None]

    def _gather(self, index: torch.Tensor) -> None:
        """Rebuild every row's slots from ``index`` [B, S'] (slot numbers of the old layout)."""
        for layer in self._layers():
            layer.keys, layer.values = gather_slots(layer.keys, index), gather_slots(layer.values, index)
        self.mask = self.mask.gather(1, index)

    def compact(self) -> None:
        """Gather each row's live slots to the right end of ``max(live)`` slots (order kept)."""
        width = int(self.live.max()) if self.rows else 0
        order = torch.argsort(self.mask.to(torch.int8), dim=1, stable=True)  # dead slots first, then live
        self._gather(order[:, self.slots - width:])
        self.holes = not bool(self.mask.all())

    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` [B'] (in that order); drop slots that no kept row uses."""
        for layer in self._layers():
            layer.batch_select_indices(rows)
        self.mask, self.live = self.mask[rows], self.live[rows]
        used = self.mask.any(dim=0).nonzero()  # [S', 1]
        if len(used) == 0:
            self._crop(self.slots)
        else:
            first, last = int(used[0]), int(used[-1]) + 1
            self._crop(self.slots - last)
            if first:
                for layer in self._layers():
                    layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
                self.mask = self.mask[:, first:]
        self.holes = not bool(self.mask.all())

    def merge(self, other: RaggedCache) -> None:
        """Append the rows of ``other`` (a cache of the same model) after this cache's rows."""
        if other.rows == 0:
            return
        if self.rows + other.rows > 1:
            self._check_rows()
        if self.rows == 0:
            self.cache, self.mask, self.live, self.holes = other.cache, other.mask, other.live, other.holes
            return
        width = max(self.slots, other.slots)
        layers = max(len(self.cache.layers), len(other.cache.layers))  # caches made without a config grow lazily
        while len(self.cache.layers) < layers:
            self.cache.layers.append(DynamicLayer())
        for index, mine in enumerate(self.cache.layers):
            if not isinstance(mine, DynamicLayer):
                continue  # no keys: a layer without attention, or recurrent state (merged by a subclass)
            theirs = other.cache.layers[index] if index < len(other.cache.layers) else None
            stored = [layer for layer in (mine, theirs) if layer is not None and layer.is_initialized
                      and layer.keys is not None and layer.keys.shape[2] > 0]
            if not stored:  # neither cache has a token in this layer: an empty one keeps the new row count
                if mine.is_initialized and mine.keys is not None:
                    rows = self.rows + other.rows
                    mine.keys = mine.keys.new_zeros(rows, *mine.keys.shape[1:])
                    mine.values = mine.values.new_zeros(rows, *mine.values.shape[1:])
                continue
            like = stored[0]
            merged = []
            for name in ("keys", "values"):  # each its own width: values may be narrower (latent attention)
                shape = getattr(like, name).shape  # [B, H, S, D]
                parts = []
                for layer, cache in ((mine, self), (theirs, other)):
                    if layer in stored:
                        held = getattr(layer, name)
                    else:  # this cache has no token in the layer yet
                        held = getattr(like, name).new_zeros(cache.rows, shape[1], 0, shape[3])
                    pad = held.new_zeros(cache.rows, shape[1], width - held.shape[2], shape[3])
                    parts.append(torch.cat([pad, held], dim=2))  # [B_part, H, width, D]
                merged.append(torch.cat(parts, dim=0))
            if not mine.is_initialized:
                mine.lazy_initialization(like.keys, like.values)
            mine.keys, mine.values = merged
        masks = [torch.cat([m.new_zeros(m.shape[0], width - m.shape[1]), m], dim=1) for m in (self.mask, other.mask)]
        self.mask = torch.cat(masks, dim=0)
        self.live = torch.cat([self.live, other.live])
        self.holes = not bool(self.mask.all())

    def stored_length(self) -> int:
        """Slots read from the cache tensors themselves (for tests of the invariant)."""
        return self.cache.get_seq_length()


def joined(outputs: list[ModelOutput], logits_to_keep: int) -> ModelOutput:
    """The outputs of single-column forwards as one output: the last ``logits_to_keep`` logits [B, keep, V]."""
    keep = outputs[-logits_to_keep:] if logits_to_keep else outputs
    hidden = None
    if outputs[0].get("hidden_states") is not None:
        hidden = tuple(None if layer[0] is None else torch.cat(layer, dim=1)  # None: a layer not selected
                       for layer in zip(*(out.hidden_states for out in outputs)))
    return CausalLMOutputWithPast(logits=torch.cat([out.logits for out in keep], dim=1), hidden_states=hidden)
