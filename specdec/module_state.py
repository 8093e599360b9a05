"""Recurrent state a model keeps on its own modules, carried by its cache handle like any other.

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
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

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


class ModuleState:
    """Moves one model's module-held state between its modules and a cache's state layers (see the docstring)."""

    def __init__(self, model: PreTrainedModel, family: ModuleStateFamily) -> None:
        self.family = family
        self.blocks = family.blocks(model)
        self.slots = [(kind, *self._owner(path)) for kind, path in family.attributes.items()]

    @staticmethod
    def _owner(path: str) -> tuple[Callable, str]:
        """(a getter of the module holding the attribute, the attribute's name) for a dotted ``path``."""
        owner, _, name = path.rpartition(".")
        return (operator.attrgetter(owner) if owner else (lambda block: block)), name

    def install(self, states: StateDict) -> None:
        """Give each block the state in ``states`` (None where there is none: the block starts from zeros)."""
        for number, block in enumerate(self.blocks):
            for kind, owner, name in self.slots:
                setattr(owner(block), name, states.get((number, kind, 0)))

    def collect(self) -> StateDict:
        """The blocks' state after a forward (for the cache's layers); the blocks are cleared."""
        states = {}
        for number, block in enumerate(self.blocks):
            for kind, owner, name in self.slots:
                tensor = getattr(owner(block), name)
                if tensor is not None:
                    states[number, kind, 0] = tensor
                setattr(owner(block), name, None)
        return states


def module_state(model: PreTrainedModel) -> ModuleState | None:
    """The mover of ``model``'s module-held state, or None when its family keeps its state in the cache."""
    family = MODULE_STATES.get(getattr(model.config, "model_type", ""))
    return None if family is None else ModuleState(model, family)
