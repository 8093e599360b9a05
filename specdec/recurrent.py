"""Recurrent and hybrid models behind the same cache handle: their state checkpointed, never cropped.

Mamba, Mamba-2, Jamba, LFM2, Qwen3-Next, Inkling, MiniMax... keep, per layer, a convolution window and/or a
recurrent (SSM, linear-attention) state (``read_states`` / ``write_states`` read and write every kind alike).
A token fed into a state cannot be taken back, so a ``RecurrentCache`` (a ``RaggedCache`` whose attention
layers, in a hybrid, roll back as usual) checkpoints it instead:

- **Checkpoints**: the states are cloned before every forward; ``keep(n)`` gives a row the state of its latest
  exact checkpoint at or before ``n`` and replays the tokens between (in groups of equal counts). A drafter,
  forwarding one token at a time, never replays; a target replays its accepted tokens after a rejection.
- **Padding**: no state may run over a padded token (it would decay). Right padding marks the row dirty for
  ``keep`` to replay; other padding is fed one column at a time, each padded row's state put back after it.
- **Multi-token forwards**: where a model's cached forward of several tokens is not its single steps up to
  rounding (``multi_token_exact``, checked once per model), it is fed one token at a time with a checkpoint
  after each, so its output is ``generate``'s.
- **Rows**: ``select`` and ``merge`` carry the states along the batch; a new row gets the family's empty
  state.

State a model keeps on its modules (``specdec.module_state.MODULE_STATES``) or takes as a forward argument
(``ARGUMENT_STATES``) is moved into the cache around every forward, so each cache owns its state; any other
such model is refused by name. The rules per family, and why each: docs/journal/recurrent.md.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionCacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput

from specdec.architectures import INSTEAD, KV_KEYWORDS, new_cache
from specdec.cache import RaggedCache, joined
from specdec.compat import cache_keyword
from specdec.module_state import ARGUMENT_STATES, LISTED, module_state, zeros_state

KINDS = ("conv_states", "recurrent_states")  # the state dicts of a linear-attention cache layer
# LISTED: a cache's own list of per-layer states (MiniMax's: [B, heads, d, d] each, None: none yet; an argument-state
# family's flattened state, specdec.module_state.held_cache)
# multi-token vs single-step logits, relative to the logits' scale, by dtype: rounding (the gaps measured per family:
# docs/journal/architectures.md, "Every architecture against its own generate")
EXACT_TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
EXACT_TOL_HALF = 1e-3  # float16, bfloat16


# what is_recurrent found per model: (its config, the answer), keyed weakly by the model (nothing set on it)
_RECURRENT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_recurrent(model: PreTrainedModel) -> bool:
    """Whether ``model``'s cache (built from its config) has recurrent / linear-attention layers."""
    if getattr(model.config, "is_encoder_decoder", False):
        return False
    if getattr(model.config, "model_type", "") in ARGUMENT_STATES:  # its state a forward argument, carried by its cache
        return True
    known = _RECURRENT.get(model)  # (its config, the answer): asked at every cache made
    if known is None or known[0] is not model.config:
        cache = DynamicCache(config=model.config)
        known = (model.config, any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers))
        _RECURRENT[model] = known
    return known[1]


@torch.no_grad()
def cached_steps(model: PreTrainedModel, ids: torch.Tensor, first: int, step: int = 1) -> torch.Tensor:
    """The logits [1, L, V] of ``ids`` [1, L] as ``generate`` computes them for a recurrent model (``step`` 1): one
    forward of the first ``first`` tokens into a fresh cache, then cached forwards of ``step`` tokens (positions
    from 0; a module- or argument-held state moved as ``RecurrentCache`` moves it)."""
    name = cache_keyword(model)
    positioned = "position_ids" in inspect.signature(model.forward).parameters
    held = module_state(model)
    cache = new_cache(model)
    logits = []
    for start in [0, *range(first, ids.shape[1], step)]:
        stop = first if start == 0 else min(start + step, ids.shape[1])
        where = {"position_ids": torch.arange(start, stop, device=ids.device)[None]} if positioned else {}
        handed = held.install(read_states(cache), 1) if held is not None else {}
        out = model(input_ids=ids[:, start:stop], **(handed or {name: cache}), use_cache=True, **where)
        if held is not None:
            write_states(cache, held.collect(out))
        logits.append(out.logits[:, -(stop - start):])
    return torch.cat(logits, dim=1)


@torch.no_grad()
def multi_token_exact(model: PreTrainedModel, tokens: int = 3) -> bool:
    """Whether one forward of ``tokens`` tokens after a cached state gives the logits of single steps to rounding
    (checked once per model on a few seeded random tokens; cached)."""
    known = getattr(model, "_specdec_multi_token_exact", None)
    if known is not None:
        return known
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, max(4, vocab), (1, 5 + tokens), generator=generator).to(device)
    multi, single = (cached_steps(model, ids, 5, step)[:, 5:].float() for step in (tokens, 1))  # [1, tokens, V]
    scale = max(1.0, float(single.abs().max()))
    tolerance = EXACT_TOL.get(next(model.parameters()).dtype, EXACT_TOL_HALF)
    exact = float((multi - single).abs().max()) <= tolerance * scale
    model._specdec_multi_token_exact = exact  # on the model: a deep copy (a drafter twin) carries it
    return exact


def _state_layers(cache: Cache) -> list[LinearAttentionCacheLayerMixin]:
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def _initialized(layer: LinearAttentionCacheLayerMixin, kind: str, index: int) -> bool:
    flags = layer.is_conv_states_initialized if kind == "conv_states" else layer.is_recurrent_states_initialized
    return bool(flags[index]) and layer.has_previous_state[index]


# (layer number among the state layers, kind, state index) -> tensor [B, ...], or for a cache's own list
# (layer number, LISTED, 0) -> tensor [B, ...]; a missing entry is zeros
States = dict[tuple[int, str, int], torch.Tensor]


def read_states(cache: Cache, clone: bool = False) -> States:
    """The initialised states of ``cache``'s linear-attention layers and of its own state list (cloned: a
    checkpoint)."""
    states = {}
    for number, layer in enumerate(_state_layers(cache)):
        for kind in KINDS:
            for index, tensor in getattr(layer, kind).items():
                if tensor is not None and _initialized(layer, kind, index):
                    states[number, kind, index] = tensor.clone() if clone else tensor
    for number, tensor in enumerate(getattr(cache, LISTED, ())):
        if isinstance(tensor, torch.Tensor):
            states[number, LISTED, 0] = tensor.clone() if clone else tensor
    return states


def write_states(cache: Cache, states: States) -> None:
    """Put ``states`` into ``cache``'s layers (marking them initialised: a conv window is its kernel wide) and
    its own state list."""
    layers = _state_layers(cache)
    for (number, kind, index), tensor in states.items():
        if kind == LISTED:
            getattr(cache, LISTED)[number] = tensor
            continue
        layer = layers[number]
        getattr(layer, kind)[index] = tensor
        if kind == "conv_states":
            layer.is_conv_states_initialized[index] = True
            layer.conv_kernel_size[index] = tensor.shape[-1]
        else:
            layer.is_recurrent_states_initialized[index] = True
        layer.has_previous_state[index] = True
        layer.dtype, layer.device = tensor.dtype, tensor.device


def restore(cache: Cache, saved: States, rows: torch.Tensor, blank=zeros_state) -> None:
    """Give the rows ``rows`` [B] (bool) their state in ``saved`` (``blank``: the state of no tokens, where
    ``saved`` has none)."""
    current = read_states(cache)
    for key, tensor in current.items():
        old = saved.get(key)
        pick = rows.view(-1, *([1] * (tensor.dim() - 1)))
        current[key] = torch.where(pick, old if old is not None else blank(key, tensor), tensor)
    write_states(cache, current)


@dataclass
class Checkpoint:
    """The recurrent state at one point, and which rows it is exact for."""

    live: torch.Tensor  # [B] live tokens of each row at this point
    clean: torch.Tensor  # [B] bool: the row's state is that of its live tokens (no padding ran over it)
    states: States  # cloned tensors [B, ...]

    def select(self, rows: torch.Tensor) -> Checkpoint:
        return Checkpoint(self.live[rows], self.clean[rows], {k: t[rows] for k, t in self.states.items()})


class RecurrentCache(RaggedCache):
    """A ``RaggedCache`` for models with recurrent / linear-attention layers (see the module docstring)."""

    recurrent = True

    def __init__(self, model: PreTrainedModel, rows: int = 0, device: torch.device | str = "cpu",
                 cache: Cache | None = None) -> None:
        super().__init__(model, rows, device, cache)
        self.keyword = cache_keyword(model)
        self.attention = any(isinstance(layer, DynamicLayer) for layer in self.cache.layers)
        # state kept on the model's modules (RecurrentGemma) or passed as an argument (RWKV), moved around forwards
        self.held = module_state(model)
        self.blank = self.held.blank if self.held is not None else zeros_state  # a row's state of no tokens
        # feed one token at a time once there is state
        declared = self.held.multi_token if self.held is not None else None
        self.stepwise = bool(declared) if declared is not None else not multi_token_exact(model)
        self.clean = torch.ones(rows, dtype=torch.bool, device=device)  # [B] state exact for the live tokens
        self.points: list[Checkpoint] = []  # since the last keep, oldest first
        self.fed: list[list[int]] = [[] for _ in range(rows)]  # per row: real tokens fed since the first point
        self.base: torch.Tensor | None = None  # [B] live tokens at the first point
        self.replayed = 0  # tokens replayed so far (rows x tokens), for the cost report
        self.replay_rounds = 0  # keeps that replayed something

    # -- forward ------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None, logits_to_keep: int = 1,
                **kwargs: object) -> ModelOutput:
        fresh = not read_states(self.cache) and self.slots == 0
        left_padded = valid is not None and bool((valid == valid.long().cumsum(dim=1).gt(0)).all())
        self._record(input_ids, valid)
        if fresh and left_padded and not bool(valid.all()):
            self._checkpoint()  # every row at zero state, which a rollback may return to
            return self._grouped(input_ids, valid, logits_to_keep, kwargs)
        return self._feed(input_ids, valid, logits_to_keep, kwargs, checkpoints=True)

    def _feed(self, input_ids: torch.Tensor, valid: torch.Tensor | None, logits_to_keep: int, kwargs: dict,
              checkpoints: bool) -> ModelOutput:
        """Feed ``input_ids`` [B, n]: one forward where exact, else one column at a time."""
        n = input_ids.shape[1]
        has_state = bool(read_states(self.cache))
        right_padded = valid is None or bool((valid == (torch.arange(n, device=valid.device)[None, :]
                                                        < valid.sum(dim=1, keepdim=True))).all())
        if n == 1 or not has_state or (right_padded and not self.stepwise):
            if checkpoints:
                self._checkpoint()
            out = RaggedCache.forward(self, input_ids, valid, logits_to_keep, **kwargs)
            if valid is not None:
                self.clean &= valid.all(dim=1)
            return out
        outputs = []
        for j in range(n):
            column = None if valid is None else valid[:, j:j + 1]  # [B, 1]
            padded = None if column is None or bool(column.all()) else ~column[:, 0]  # [B]
            before = self._checkpoint() if checkpoints else (read_states(self.cache, clone=True)
                                                             if padded is not None else None)
            outputs.append(RaggedCache.forward(self, input_ids[:, j:j + 1], None if padded is None else column,
                                               1, **kwargs))
            if padded is not None:
                restore(self.cache, before.states if isinstance(before, Checkpoint) else before, padded, self.blank)
        return joined(outputs, logits_to_keep)

    def _call(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
              logits_to_keep: int, kwargs: dict) -> ModelOutput:
        self._count(self.slots)  # what the model reads as the tokens before these (5.24+: its masks' query offset)
        handed = {}  # this cache's state onto the modules (every attribute set: nothing stale is read), or as the
        if self.held is not None:  # forward argument that takes it
            handed = self.held.install(read_states(self.cache), self.rows)
        if self.attention and self.keyword in KV_KEYWORDS:  # positions by the one rule (Bamba needs them)
            out = super()._call(input_ids, attention_mask, position_ids, logits_to_keep, kwargs)
        elif self.held is not None and self.held.steps_apart and input_ids.shape[1] == 1 and self.rows > 1:
            return self._rows_apart(input_ids, logits_to_keep, kwargs)  # RWKV: one-token forwards of one row only
        else:  # no attention layer: no positions, and padding is handled here, not by the model's mask
            out = self._plain(input_ids, handed, logits_to_keep, kwargs)
        if self.held is not None:  # and back into the cache's layers (the modules cleared)
            write_states(self.cache, self.held.collect(out))
        if not read_states(self.cache):  # the forward wrote no state into the cache: it keeps it elsewhere
            state = ", ".join(sorted({type(layer).__name__ for layer in _state_layers(self.cache)}))
            raise TypeError(f"{type(self.model).__name__} keeps its recurrent state outside the transformers Cache "
                            f"(its {state} layers stay empty after a forward: the state lives on its modules), so "
                            "specdec "
                            "cannot checkpoint it or roll it back after a rejected draft (specdec.module_state "
                            f"carries it only for the families it names). {INSTEAD}")
        self._count(self.slots + input_ids.shape[1])
        return out

    def generate_logits(self, ids: torch.Tensor, first: int) -> torch.Tensor:
        """The logits [1, L, V] of ``ids`` [1, L] as ``generate`` computes them for this cache's model
        (``cached_steps``: a prefill of ``first`` tokens, then single cached steps): the self-check's reference."""
        return cached_steps(self.model, ids, first)

    def _count(self, tokens: int) -> None:
        """Set every state layer's token count (transformers >= 5.24: ``cumulative_length_linear``, one scalar for the
        batch) to ``tokens``, the slots of the attention layers. A pure state layer's count is what
        ``Cache.get_seq_length()`` and ``get_query_offset()`` return for it, and a hybrid model's masks take their
        query offset from the cache's first layer, a state layer in most (LFM2, RecurrentGemma): it must count the
        slots the queries follow, whatever rollbacks, replays, row selections and joins did (transformers only adds
        to it, and RecurrentGemma's, its state on its modules, never moves)."""
        for layer in _state_layers(self.cache):
            count = getattr(layer, "cumulative_length_linear", None)
            if count is not None:
                count.fill_(tokens)

    def _plain(self, input_ids: torch.Tensor, handed: dict, logits_to_keep: int, kwargs: dict) -> ModelOutput:
        """The forward of a model without attention layers: the cache, or the state as its argument (``handed``)."""
        out = self.model(input_ids=input_ids, **(handed or {self.keyword: self.cache}), use_cache=True,
                         logits_to_keep=logits_to_keep, **kwargs)
        if logits_to_keep and out.logits.shape[1] > logits_to_keep:  # a forward that ignores it (xLSTM)
            out.logits = out.logits[:, -logits_to_keep:]
        return out

    def _rows_apart(self, input_ids: torch.Tensor, logits_to_keep: int, kwargs: dict) -> ModelOutput:
        """A one-token forward [B, 1] run a row at a time (``steps_apart``), the rows' outputs and states joined."""
        states = read_states(self.cache)
        outputs, parts = [], []
        for b in range(input_ids.shape[0]):
            handed = self.held.install({key: tensor[b:b + 1] for key, tensor in states.items()}, 1)
            outputs.append(out := self._plain(input_ids[b:b + 1], handed, logits_to_keep, dict(kwargs)))
            parts.append(self.held.collect(out))
        write_states(self.cache, {key: torch.cat([part[key] for part in parts]) for key in parts[0]})
        hidden = outputs[0].get("hidden_states")
        if hidden is not None:
            hidden = tuple(torch.cat([out.hidden_states[i] for out in outputs]) for i in range(len(hidden)))
        return CausalLMOutputWithPast(logits=torch.cat([out.logits for out in outputs]), hidden_states=hidden)

    def _grouped(self, input_ids: torch.Tensor, valid: torch.Tensor, logits_to_keep: int,
                 kwargs: dict) -> ModelOutput:
        """A fresh cache's left-padded forward: one unpadded forward per distinct real length, merged."""
        n = input_ids.shape[1]
        counts = valid.sum(dim=1)  # [B]
        merged = type(self)(self.model, 0, self.mask.device)
        order, parts = [], []
        for count in sorted(set(counts.tolist())):
            rows = (counts == count).nonzero()[:, 0]  # [B_c]
            part = type(self)(self.model, len(rows), self.mask.device)
            if count:
                out = part.forward(input_ids[rows, n - count:], None, min(logits_to_keep, count), **kwargs)
                parts.append((rows, out))
            merged.merge(part)
            order.append(rows)
        merged.select(torch.argsort(torch.cat(order)))  # back to the callers' row order
        self.cache, self.mask, self.live, self.holes = merged.cache, merged.mask, merged.live, merged.holes
        self.clean = merged.clean
        return _scattered(parts, input_ids.shape[0], n, logits_to_keep)

    # -- checkpoints and rollback ---------------------------------------------------------------------

    def _record(self, input_ids: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Remember each row's real tokens fed since the first checkpoint (what a replay feeds again)."""
        if self.base is None:
            self.base = self.live.clone()
        ids = input_ids.tolist()
        real = [[True] * len(row) for row in ids] if valid is None else valid.tolist()
        for fed, row, keep in zip(self.fed, ids, real):
            fed.extend(t for t, k in zip(row, keep) if k)

    def _checkpoint(self) -> Checkpoint:
        point = Checkpoint(self.live.clone(), self.clean.clone(), read_states(self.cache, clone=True))
        self.points.append(point)
        return point

    def _forget(self) -> None:
        self.points, self.base = [], None
        self.fed = [[] for _ in range(self.rows)]
        self.clean = torch.ones(self.rows, dtype=torch.bool, device=self.mask.device)

    def keep(self, n: torch.Tensor) -> None:
        """Keep the first ``n[b]`` live tokens of each row: its state from a checkpoint, replayed up to ``n[b]``."""
        redo = ~(self.clean & (n == self.live))  # [B] rows whose current state is not that of n tokens
        if not bool(redo.any()) or not self.points:
            if bool(redo.any()):  # no checkpoint since the state changed (cannot happen through forward)
                raise RuntimeError("recurrent state cannot be rolled back: no checkpoint since the last keep")
            super().keep(n)
            self._forget()
            self._count(self.slots)
            return
        start = n.clone()  # [B] the live count each row restarts from
        chosen: dict[int, list[int]] = {}  # checkpoint number -> rows restored from it
        for b in redo.nonzero()[:, 0].tolist():
            number = next((i for i in reversed(range(len(self.points)))
                           if self.points[i].clean[b] and self.points[i].live[b] <= n[b]), None)
            if number is None:
                raise RuntimeError(f"row {b}: no exact checkpoint at or before {int(n[b])} tokens")
            chosen.setdefault(number, []).append(b)
            start[b] = self.points[number].live[b]
        for number, rows in chosen.items():
            pick = torch.zeros(self.rows, dtype=torch.bool, device=n.device)
            pick[rows] = True
            restore(self.cache, self.points[number].states, pick, self.blank)
        if bool((start < n).any()):
            self.replay_rounds += 1
        super().keep(start)
        tokens, base = self.fed, self.base
        self._forget()
        self._replay(tokens, base, start, n)
        self._count(self.slots)

    def _replay(self, fed: list[list[int]], base: torch.Tensor, start: torch.Tensor, n: torch.Tensor) -> None:
        """Feed again each row's tokens ``start[b]..n[b]``, rows grouped by count (one forward per count)."""
        counts = n - start  # [B]
        for count in sorted(set(counts.tolist()) - {0}):
            rows = counts == count  # [B]
            ids = torch.zeros(self.rows, count, dtype=torch.long, device=n.device)
            for b in rows.nonzero()[:, 0].tolist():
                first = int(start[b] - base[b])
                ids[b] = torch.tensor(fed[b][first:first + count], dtype=torch.long)
            before = read_states(self.cache, clone=True)
            valid = None if bool(rows.all()) else rows[:, None].expand(-1, count)  # [B, count]
            self._feed(ids, valid, 1, {}, checkpoints=False)
            if valid is not None:
                restore(self.cache, before, ~rows, self.blank)
            self.replayed += count * int(rows.sum())
        self.clean = torch.ones(self.rows, dtype=torch.bool, device=n.device)

    # -- rows -------------------------------------------------------------------------------------------

    def select(self, rows: torch.Tensor) -> None:
        states = {key: tensor[rows] for key, tensor in read_states(self.cache).items()}
        index = rows.tolist()
        super().select(rows)
        write_states(self.cache, states)
        self.clean = self.clean[rows]
        self.points = [point.select(rows) for point in self.points]
        self.fed = [self.fed[i] for i in index]
        self.base = None if self.base is None else self.base[rows]
        self._count(self.slots)

    def merge(self, other: RaggedCache) -> None:
        assert isinstance(other, RecurrentCache)
        if other.rows == 0:
            return
        if not bool(other.clean.all()):
            raise RuntimeError("rows join a recurrent cache with exact states only (after keep or prefill)")
        mine, theirs = read_states(self.cache), read_states(other.cache)
        states = _stacked(mine, self.rows, theirs, other.rows, self.blank)
        # a checkpoint of this cache's rows holds the joining rows as they are now (their state is exact)
        self.points = [Checkpoint(torch.cat([p.live, other.live]), torch.cat([p.clean, other.clean]),
                                  _stacked(p.states, self.rows, {k: t.clone() for k, t in theirs.items()}, other.rows,
                                           self.blank))
                       for p in self.points]
        if self.base is not None:
            self.base = torch.cat([self.base, other.live])
        self.fed += [[] for _ in range(other.rows)]
        self.clean = torch.cat([self.clean, other.clean])
        super().merge(other)
        write_states(self.cache, states)
        self._count(self.slots)


def _stacked(first: States, rows: int, second: States, other_rows: int, blank=zeros_state) -> States:
    """The states of two row sets, one after the other along the batch (``blank``, the state of no tokens, where
    a set has none)."""
    states = {}
    for key in first.keys() | second.keys():
        a, b = first.get(key), second.get(key)
        a = a if a is not None else blank(key, b.new_empty(rows, *b.shape[1:]))
        b = b if b is not None else blank(key, a.new_empty(other_rows, *a.shape[1:]))
        states[key] = torch.cat([a, b])
    return states


def _scattered(parts: list[tuple[torch.Tensor, ModelOutput]], rows: int, n: int, logits_to_keep: int) -> ModelOutput:
    """The outputs of row groups fed without their left padding, as one output for the padded batch
    (padded positions: zeros)."""
    keep = logits_to_keep or n
    like = parts[0][1]
    logits = like.logits.new_zeros(rows, keep, like.logits.shape[-1])  # [B, keep, V]
    for index, out in parts:
        logits[index, keep - out.logits.shape[1]:] = out.logits
    hidden = None
    if like.get("hidden_states") is not None:
        hidden = []
        for layer in range(len(like.hidden_states)):
            if like.hidden_states[layer] is None:  # a layer the forward's selection left out
                hidden.append(None)
                continue
            states = like.hidden_states[layer].new_zeros(rows, n, like.hidden_states[layer].shape[-1])
            for index, out in parts:
                states[index, n - out.hidden_states[layer].shape[1]:] = out.hidden_states[layer]
            hidden.append(states)
        hidden = tuple(hidden)
    return CausalLMOutputWithPast(logits=logits, hidden_states=hidden)
