"""``StaticRaggedCache``: the cache handle of a compiled model (``specdec.cache.CacheHandle``).

Contract: ``RaggedCache``'s interface and rule (each row's live slots ``mask``, a token's position = the live
tokens before it, ``keep`` per row, ``select``, ``merge`` of an eager prefill, ``compact``) over transformers'
``StaticCache`` layers ``[R, heads, C + 1, dim]``: ``R`` rows (the smallest row bucket >= the batch's rows, grown
as rows join and shrunk as they leave; spare rows are dead), ``C`` slots. The layers share one write pointer,
the first unused slot; a rollback moves it back (rejected slots are overwritten later, never attended
meanwhile), and the rows are re-packed when the next forward would not fit. A forward of fewer tokens than its
bucket is padded on the right with dead tokens (masked, their slots freed at once, their logits dropped); a
forward attends only the first S slots (``attended``), so short contexts pay short attention.

Why static buffers: a compiled graph needs fixed shapes and addresses, and a growing ``DynamicCache`` pays
``torch.cat`` every step. Figures: docs/journal/compiled-path.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from specdec.cache import RaggedCache, gather_slots, repack_pays
from specdec.compiled.graphs import CompiledModel, Shape, _bucket, attended, hidden_key
from specdec.compiled.ops import refresh_blocked


def moved_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a ``select`` keeping ``rows`` [B'] in that order: (the places whose row changes, the rows that go there),
    or None when every kept row stays where it is."""
    order = rows.tolist()
    places = [i for i, row in enumerate(order) if row != i]
    if not places:
        return None
    return torch.tensor(places, dtype=torch.long, device=rows.device), rows[places]


def _states(hidden: torch.Tensor | None, kind: bool | tuple[int, ...]) -> tuple[torch.Tensor | None, ...] | None:
    """``StepOutput.hidden_states`` of a step's ``hidden`` output: (the last hidden states,), or, for layers by
    index (``kind``), each layer's part of the concatenation at its index."""
    if hidden is None:
        return None
    if kind is True:
        return (hidden,)
    states: list[torch.Tensor | None] = [None] * (max(kind) + 1)
    for index, part in zip(kind, hidden.chunk(len(kind), dim=-1)):
        states[index] = part
    return tuple(states)


class StepOutput(NamedTuple):
    """A static cache forward's output: what callers read of ``RaggedCache.forward``'s ``CausalLMOutputWithPast``,
    without its construction (about 10-40 us a step, measured: as much as the rest of the bookkeeping)."""

    logits: torch.Tensor  # [B, k, V]
    # (the last hidden states [B, k, H],) when asked for; asked for layers by index, the tuple's entries at those
    # indices are theirs (the others None), as transformers returns a selection
    hidden_states: tuple[torch.Tensor | None, ...] | None


class _Lease:
    """A static cache's buffers held by one handle: released to their ``CompiledModel`` when it is dropped."""

    __slots__ = ("cache", "compiled")

    def __init__(self, compiled: CompiledModel, cache: StaticCache) -> None:
        self.compiled, self.cache = compiled, cache

    def __del__(self) -> None:
        self.compiled.release(self.cache)


class StaticRaggedCache:
    """``RaggedCache``'s interface and rule over a preallocated static cache (the module docstring)."""

    recurrent = False
    merges_rows = True  # ``merge`` copies only the new rows into the buffers (``seq2seq.prefill_into``)

    @torch.inference_mode()
    def __init__(self, model: PreTrainedModel, compiled: CompiledModel, device: torch.device | str = "cpu") -> None:
        self.model, self.compiled, self.device = model, compiled, torch.device(device)
        refresh_blocked(compiled.blocked)  # the blocked copies of weights changed since the last call
        self.capacity = 0  # R: rows of the buffers
        self.cache: StaticCache | None = None
        self._lease: _Lease | None = None  # the buffers' lease (``_reserve``)
        self.slots_live = torch.zeros(0, compiled.slots + 1, dtype=torch.bool, device=self.device)  # [R, C + 1]
        self.live = torch.zeros(0, dtype=torch.long, device=self.device)  # [B]
        self.used = 0  # slots in use: the write pointer (every row writes at the same slots)
        self._buckets, self._widths = compiled.tokens, {}  # tokens per row -> its token bucket (or itself)
        self._lasts: dict[int, torch.Tensor] = {}  # tokens per row -> [1] its last column (``Shape.last``)

    # ------------------------------------------------------------------ RaggedCache's read-only view

    @property
    def rows(self) -> int:
        return self.live.shape[0]

    @property
    def slots(self) -> int:
        return self.used

    @property
    def mask(self) -> torch.Tensor:
        """[B, S] the live slots of the real rows."""
        return self.slots_live[: self.rows, : self.used]

    @property
    def holes(self) -> bool:
        return not bool(self.mask.all())

    # ------------------------------------------------------------------------------ storage

    def _layers(self) -> list[StaticLayer]:
        return list(self.cache.layers) if self.cache is not None else []

    def _point(self, used: int) -> None:
        """Move the write pointer (shared by every layer: ``WindowLayer``) to ``used``."""
        self.used = used
        if self.cache is not None:
            self.cache.layers[0].cumulative_length.fill_(used)

    def _reserve(self, rows: int) -> None:
        """Buffers of at least ``rows`` rows (the next row bucket; spare rows dead), contents kept."""
        if rows <= self.capacity and self.cache is not None:
            return
        self._resize(_bucket(rows, self.compiled.rows) or rows)

    def _resize(self, bucket: int) -> None:
        """Buffers of ``bucket`` rows holding the first ``min(bucket, capacity)`` rows' contents (the slots in use:
        the others are zero in new buffers, as dead slots may be), the old buffers given back to the model."""
        fresh = self._buffers(bucket)
        kept, used = min(bucket, self.capacity), self.used
        for old, new in zip(self._layers(), fresh.layers):
            new.keys[:kept, :, :used].copy_(old.keys[:kept, :, :used])
            new.values[:kept, :, :used].copy_(old.values[:kept, :, :used])
        live = torch.zeros(bucket, self.compiled.slots + 1, dtype=torch.bool, device=self.device)
        live[:kept] = self.slots_live[:kept]
        self.cache, self.slots_live, self.capacity = fresh, live, bucket
        # the buffers go back to the model's spares when this handle lets them go (resized, or dropped)
        self._lease = _Lease(self.compiled, getattr(fresh, "self_attention_cache", fresh))
        self._point(self.used)

    def _buffers(self, rows: int) -> StaticCache:
        """New buffers of ``rows`` rows for ``_reserve`` (which copies the self-attention contents into them)."""
        return self.compiled.new_cache(rows, self.device)

    def _room(self, needed: int) -> None:
        """Make ``needed`` free slots after the pointer (re-packing the rows), or refuse."""
        if self.used + needed > self.compiled.slots:
            self.compact()
        if self.used + needed > self.compiled.slots:
            raise ValueError(f"{type(self.model).__name__}'s static cache holds {self.compiled.slots} slots per row; "
                             f"{self.used} are live and {needed} more were asked for: use --compile off for longer "
                             "sequences")

    # ------------------------------------------------------------------------------- forward

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None, logits_to_keep: int = 1,
                output_hidden_states: bool | list[int] = False, **kwargs: object) -> StepOutput:
        """Run the model on ``input_ids`` [B, n] (``valid`` [B, n] marks the real ones), as ``RaggedCache.forward``
        (``output_hidden_states``: a flag, or the indices of the hidden states wanted, ``graphs.hidden_key``)."""
        if kwargs:
            raise TypeError(f"the compiled path takes no {', '.join(kwargs)}")
        rows, n = input_ids.shape
        if rows > self.capacity or self.cache is None:
            self._reserve(rows)
        if self._buckets is not self.compiled.tokens:  # prepare added buckets since
            self._buckets, self._widths = self.compiled.tokens, {}
        width = self._widths.get(n) or self._widths.setdefault(n, _bucket(n, self._buckets) or n)
        if self.used + width > self.compiled.slots:  # tokens per row: n real columns, then dead padding
            self._room(width)
        span = attended(self.used + width, self.compiled.slots)  # S: the slots this forward attends
        keep = min(logits_to_keep, n) if logits_to_keep else n
        shape, last = Shape(self.capacity, width, hidden_key(output_hidden_states)), None
        if keep == 1 and width > 1 and (tail := Shape(shape.rows, width, shape.hidden, True)) in self.compiled.shapes:
            shape, last = tail, self._lasts.get(n)  # the head's product for the last real token only
            if last is None:
                last = self._lasts[n] = torch.tensor([n - 1], device=self.device)
        ids = input_ids
        if rows != self.capacity or n != width or input_ids.stride() != (n, 1):  # the strides the graph was traced for
            ids = input_ids.new_zeros(self.capacity, width)  # [R, w]: dead rows and columns of token 0
            ids[:rows, :n] = input_ids
        # the new real tokens' slots go live (slots from the pointer on are all dead: the padding stays so)
        self.slots_live[:rows, self.used: self.used + n] = True if valid is None else valid
        logits, hidden = self.compiled.run(shape, ids, self.slots_live[:, :span], self.cache, last)
        self._point(self.used + n)  # the dead columns' slots are free again, as a rejected draft's
        self.live = self.live + (n if valid is None else valid.sum(dim=1))
        if rows == self.capacity and keep == n == width:  # the whole output: no slicing (a torch call each)
            return StepOutput(logits, _states(hidden, shape.hidden))
        states = _states(hidden[:rows, n - keep: n], shape.hidden) if hidden is not None else None
        if last is not None:  # [R, 1, V] already
            return StepOutput(logits if rows == self.capacity else logits[:rows], states)
        return StepOutput(logits[:rows, n - keep: n], states)

    # ----------------------------------------------------------------------- rows and rollback

    @torch.inference_mode()
    def keep(self, n: torch.Tensor) -> None:
        """Keep the first ``n[b]`` live tokens of each row ``b`` (``n <= live``); drop the rest. Keeping every
        token (plain decoding, a fully accepted draft) changes nothing, the pointer included."""
        if torch.equal(n, self.live):
            return
        if bool((n > self.live).any()):
            raise ValueError(f"cannot keep {n.tolist()} tokens of rows holding {self.live.tolist()}")
        mask = self.mask
        self.slots_live[: self.rows, : self.used] = mask & (mask.long().cumsum(dim=1) <= n[:, None])
        self.live = n.clone()
        self._trim()

    def _trim(self) -> None:
        """Pull the pointer back to after the last slot a row still uses (later slots are free again), and re-pack
        the rows when the slots in use past the longest row's live ones call for it (``cache.repack_pays``). Checked
        here, after a rollback or rows leaving (which read the host already), as the eager cache does: not before
        each forward, where it cost a host sync every drafter step."""
        used = self.slots_live[:, : self.used].any(dim=0).nonzero()  # [S', 1]
        self._point(int(used[-1]) + 1 if len(used) else 0)
        if self.rows and repack_pays(self.used, int(self.live.max())):
            self.compact()

    @torch.inference_mode()
    def compact(self) -> None:
        """Gather each row's live slots to the left, order kept; the pointer follows the longest row."""
        if self.rows == 0 or self.cache is None:
            self._point(0)
            return
        order = torch.argsort((~self.mask).to(torch.int8), dim=1, stable=True)  # [B, S] live slots first
        width = int(self.live.max())
        index = order[:, :width]  # [B, W]
        for layer in self._layers():
            for t in (layer.keys, layer.values):
                t[: self.rows, :, :width].copy_(gather_slots(t[: self.rows], index))
        packed = self.mask.gather(1, index)  # [B, W]
        self.slots_live[:, :] = False
        self.slots_live[: self.rows, :width] = packed
        self._point(width)

    @torch.inference_mode()
    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` [B'] (in that order). When they fit a smaller row bucket, the buffers shrink to it:
        every later forward then runs that bucket's step, not one of the batch's former size with dead rows (a
        server that once held 16 requests decoded a lone one in the 16-row step, 2.8x slower: 1.43 s against 0.50 s
        for 64 tokens of code-target).
        Only the rows that move are copied, and only their slots in use (``moved_rows``): a row left in place keeps its
        buffers, and the slots past the pointer are dead. Copying every row's every slot took 75 ms at 16 rows of
        code-target (528 slots), paid each time a row finished apart from the others."""
        kept = len(rows)
        if (moved := moved_rows(rows)) is not None:
            places, sources = moved
            for layer in self._layers():
                for t in (layer.keys, layer.values):
                    t[places, :, : self.used] = t[sources, :, : self.used]
        live = self.slots_live[rows].clone()
        self.slots_live[:] = False
        self.slots_live[:kept] = live
        self.live = self.live[rows]
        self._trim()
        bucket = _bucket(max(kept, 1), self.compiled.rows)
        if self.cache is not None and bucket is not None and bucket < self.capacity:
            self._resize(bucket)

    @torch.inference_mode()
    def merge(self, other: RaggedCache) -> None:
        """Append the rows of ``other`` (an eager ``RaggedCache`` of the same model, e.g. a prefill)."""
        if other.rows == 0:
            return
        if other.window is not None or other.recurrent:
            raise TypeError("a static cache merges attention-only caches")
        rows = self.rows
        self._reserve(rows + other.rows)
        theirs = other.slots
        if theirs > self.used:  # shift the current rows right so both end at the same slot
            if theirs + 1 > self.compiled.slots:
                raise ValueError(f"a prompt of {theirs} cached tokens does not fit {type(self.model).__name__}'s "
                                 f"static cache of {self.compiled.slots} slots: use --compile off")
            self._room(theirs - self.used)
            shift, end = theirs - self.used, theirs
            for layer in self._layers():
                for t in (layer.keys, layer.values):
                    t[:rows, :, shift:end] = t[:rows, :, : self.used].clone()
            moved = self.slots_live[:rows, : self.used].clone()
            self.slots_live[:rows, : end] = False
            self.slots_live[:rows, shift:end] = moved
            self._point(end)
        start = self.used - theirs
        for mine, layer in zip(self._layers(), other.cache.layers):
            if theirs and layer.is_initialized and layer.keys is not None:
                mine.keys[rows: rows + other.rows, :, start: self.used] = layer.keys
                mine.values[rows: rows + other.rows, :, start: self.used] = layer.values
        self.slots_live[rows: rows + other.rows] = False
        self.slots_live[rows: rows + other.rows, start: self.used] = other.mask
        self.live = torch.cat([self.live, other.live.to(self.device)])

