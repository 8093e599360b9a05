"""Recurrent state a model keeps outside its cache (on its own modules, or passed as a forward argument),
carried by its cache handle like any other.

RecurrentGemma (Griffin) builds a ``DynamicCache`` whose ``LinearAttentionLayer`` stays empty: each
recurrent block keeps its convolution window (``conv1d_state [B, W, K-1]``) and its RG-LRU state
(``rg_lru.recurrent_states [B, W]``, float32) as attributes of its modules, shared by every cache
of that model; its local-attention keys are in the ``DynamicCache`` as usual. A ``RecurrentCache``
checkpoints, restores, replays, selects and merges the state it finds in its cache layers, so a
``ModuleState`` moves it there and back around every forward (the hook in ``RecurrentCache._call``):

- ``install(states)`` before the forward: each block gets its cache's state (``None`` where the
  cache has none yet: the block then starts from zeros, as its own ``generate`` does);
- ``collect()`` after it: the blocks' new tensors, for the cache's layers; the blocks are then
  cleared, so no state is left on the modules for the next cache of the same model to run over.

Each cache thus owns its state (a target and a drafter, or the self-check's caches, may share one
model object), and everything ``RecurrentCache`` does to state layers applies unchanged.

Positions are given as ``generate`` gives them (0-based, every forward): the RG-LRU resets its state
at position 0. A multi-token forward after a cached state is not exact (``multi_token``): the block's
"prefill" branch restarts its convolution from zeros and overwrites its window, so such a model is
fed one token at a time once it has state, as ``generate`` feeds it.

A family is registered in ``MODULE_STATES`` by model type: where its blocks are, which attribute holds
each kind of state, and why a multi-token forward is not exact.

**State passed as a forward argument** is carried the same way. RWKV takes its state as ``state=`` (a list of
five ``[B, hidden, layers]`` tensors, changed in place and returned as ``outputs.state``); xLSTM takes an
``xLSTMCache`` as ``cache_params=`` (``rnn_state``: per layer a matrix memory ``[B, heads, dqk, dv]``, a
normaliser ``[B, heads, dqk]`` and a stabiliser ``[B, heads, 1]``). Neither has a transformers ``Cache``, so
their cache is an attention-free one (``held_cache``) whose state list (``linear_cache``, as MiniMax's) holds the
tensors, flattened; an ``ArgumentState`` hands them to the forward as the argument (``install``: None before the
first forward, so the model starts from its own initial state) and takes them back from its output
(``collect``). A row given no state gets the family's state of no tokens (``blank``: RWKV's running maximum is
-1e30, not zero). Registered in ``ARGUMENT_STATES`` by model type; whether such a family's multi-token forward
equals single steps is checked once (``specdec.recurrent.multi_token_exact``). RWKV's one-token forward is wrong
for more than one row (transformers mixes the token with every row's previous hidden state: ``[B, 1, H]`` against
``[B, H]``), so such a forward is run a row at a time (``steps_apart``); its multi-token forward takes rows together.
Both kinds of family are found by ``module_state``, and the batch is dimension 0 of every tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DummyLayer
from transformers.modeling_outputs import ModelOutput

from specdec.compat import cache_keyword, cache_of

# (state layer number, kind, index) -> tensor [B, ...], as specdec.recurrent.States
StateDict = dict[tuple[int, str, int], torch.Tensor]


@dataclass(frozen=True)
class ModuleStateFamily:
    """Where one model family keeps its recurrent state on its modules."""

    blocks: Callable[[PreTrainedModel], list[torch.nn.Module]]  # the stateful blocks, in cache state-layer order
    attributes: dict[str, str]  # state kind ("conv_states", "recurrent_states") -> dotted attribute on a block
    multi_token: str  # why a multi-token forward after a cached state is not single steps ("" if it is)


def _recurrent_gemma_blocks(model: PreTrainedModel) -> list[torch.nn.Module]:
    """RecurrentGemma's recurrent blocks: the temporal block of each ``linear_attention`` layer, in order."""
    kinds = model.config.layers_block_type
    return [layer.temporal_block for layer, kind in zip(model.base_model.layers, kinds) if kind == "linear_attention"]


# model_type -> where its state lives on its modules
MODULE_STATES: dict[str, ModuleStateFamily] = {
    "recurrent_gemma": ModuleStateFamily(
        blocks=_recurrent_gemma_blocks,
        attributes={"conv_states": "conv1d_state", "recurrent_states": "rg_lru.recurrent_states"},
        multi_token="its recurrent blocks' multi-token forward restarts the convolution from zeros (the prefill "
                    "branch ignores the cached window)",
    ),
}


def zeros_state(key: tuple[int, str, int], like: torch.Tensor) -> torch.Tensor:
    """The state of no tokens of most families (``key`` aside): zeros shaped like ``like``."""
    return torch.zeros_like(like)


class ModuleState:
    """Moves one model's module-held state between its modules and a cache's state layers (see the docstring)."""

    def __init__(self, model: PreTrainedModel, family: ModuleStateFamily) -> None:
        self.family = family
        self.multi_token: str | None = family.multi_token  # declared: why a multi-token forward is not exact
        self.steps_apart = ""  # its one-token forwards take rows together
        self.blocks = family.blocks(model)
        self.slots = [(kind, *self._owner(path)) for kind, path in family.attributes.items()]

    @staticmethod
    def _owner(path: str) -> tuple[Callable, str]:
        """(a getter of the module holding the attribute, the attribute's name) for a dotted ``path``."""
        owner, _, name = path.rpartition(".")
        return (operator.attrgetter(owner) if owner else (lambda block: block)), name

    def install(self, states: StateDict, rows: int = 0) -> dict[str, object]:
        """Give each block the state in ``states`` (None where there is none: the block starts from zeros); no
        forward argument (the cache is handed to the forward as usual)."""
        for number, block in enumerate(self.blocks):
            for kind, owner, name in self.slots:
                setattr(owner(block), name, states.get((number, kind, 0)))
        return {}

    blank = staticmethod(zeros_state)  # its state of no tokens: zeros

    def collect(self, output: ModelOutput | None = None) -> StateDict:
        """The blocks' state after a forward (for the cache's layers); the blocks are cleared."""
        states = {}
        for number, block in enumerate(self.blocks):
            for kind, owner, name in self.slots:
                tensor = getattr(owner(block), name)
                if tensor is not None:
                    states[number, kind, 0] = tensor
                setattr(owner(block), name, None)
        return states


LISTED = "linear_cache"  # the state list of a held cache (as MiniMax's own cache): one tensor [B, ...] per entry


@dataclass(frozen=True)
class ArgumentStateFamily:
    """How one model family takes its recurrent state as a forward argument and gives it back in its output."""

    keyword: str | None  # the forward argument taking the state (None: its cache's, specdec.compat.cache_keyword)
    count: Callable[[PretrainedConfig], int]  # how many state tensors (the flat list's length)
    hand: Callable[[PreTrainedModel, list[torch.Tensor], int], object]  # flat tensors [B, ...], rows -> the argument
    take: Callable[[ModelOutput], list[torch.Tensor]]  # a forward's output -> its state, flat, in the same order
    blank: Callable[[int, torch.Tensor], torch.Tensor] = lambda number, like: torch.zeros_like(like)  # no tokens
    steps_apart: str = ""  # why a one-token forward of several rows is wrong (then fed a row at a time; "" if not)


def _rwkv_blank(number: int, like: torch.Tensor) -> torch.Tensor:
    """RWKV's state of no tokens (as its forward makes it): zeros, its running maximum (the fifth tensor) -1e30."""
    return torch.full_like(like, -1e30) if number == 4 else torch.zeros_like(like)


def _xlstm_cache(model: PreTrainedModel, flat: list[torch.Tensor], rows: int) -> object:
    """An ``xLSTMCache`` holding ``flat`` (per layer: memory, normaliser, stabiliser) as its ``rnn_state``."""
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache

    cache = xLSTMCache(model.config, rows, dtype=flat[0].dtype, device=flat[0].device)
    cache.rnn_state = {layer: tuple(flat[3 * layer:3 * layer + 3]) for layer in range(len(flat) // 3)}
    return cache


# model_type -> how its state is handed to its forward and taken back from its output
ARGUMENT_STATES: dict[str, ArgumentStateFamily] = {
    "rwkv": ArgumentStateFamily(keyword="state", count=lambda config: 5, hand=lambda model, flat, rows: list(flat),
                                take=lambda output: list(output.state), blank=_rwkv_blank,
                                steps_apart="its one-token branch mixes each token with the previous one's hidden "
                                            "state as [B, 1, H] against [B, H], which broadcasts to [B, B, H] (rows "
                                            "mixed) for more than one row"),
    "xlstm": ArgumentStateFamily(keyword=None, count=lambda config: 3 * config.num_hidden_layers,
                                 hand=_xlstm_cache,
                                 take=lambda output: [t for layer in sorted(cache_of(output).rnn_state)
                                                      for t in cache_of(output).rnn_state[layer]]),
}


class ArgumentState:
    """Moves one model's argument-held state between a cache's state list and its forward (see the docstring)."""

    multi_token: str | None = None  # not declared: checked once (specdec.recurrent.multi_token_exact)

    def __init__(self, model: PreTrainedModel, family: ArgumentStateFamily) -> None:
        self.model, self.family = model, family
        self.keyword = family.keyword or cache_keyword(model)
        self.steps_apart = family.steps_apart

    def install(self, states: StateDict, rows: int) -> dict[str, object]:
        """The forward argument holding ``states`` (None before the first forward: the model's own initial state)."""
        if not states:
            return {self.keyword: None}
        flat = [states[number, LISTED, 0] for number in range(self.family.count(self.model.config))]
        return {self.keyword: self.family.hand(self.model, flat, rows)}

    def blank(self, key: tuple[int, str, int], like: torch.Tensor) -> torch.Tensor:
        """The state of no tokens for ``key``, shaped like ``like``."""
        return self.family.blank(key[0], like)

    def collect(self, output: ModelOutput | None = None) -> StateDict:
        """The state ``output`` returned, for the cache's state list (nothing without an output)."""
        if output is None:
            return {}
        return {(number, LISTED, 0): tensor for number, tensor in enumerate(self.family.take(output))}


def held_cache(config: PretrainedConfig) -> Cache:
    """The cache of a family in ``ARGUMENT_STATES``: no attention (one ``DummyLayer``), its state list empty."""
    cache = DynamicCache()
    cache.layers = [DummyLayer()]
    cache.linear_cache = [None] * ARGUMENT_STATES[config.model_type].count(config)
    return cache


def module_state(model: PreTrainedModel) -> ModuleState | ArgumentState | None:
    """The mover of ``model``'s state kept outside its cache (on its modules, or passed as a forward argument),
    or None when its family keeps its state in the cache."""
    kind = getattr(model.config, "model_type", "")
    if kind in MODULE_STATES:
        return ModuleState(model, MODULE_STATES[kind])
    return ArgumentState(model, ARGUMENT_STATES[kind]) if kind in ARGUMENT_STATES else None
