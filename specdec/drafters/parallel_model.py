"""A target-conditioned parallel drafter (PARD / DFlash style) as a transformers model: k draft tokens in one forward.

Follows SpecDec's block drafter (k mask positions drafted in one non-autoregressive forward) and DFlash (the block
conditioned on the target's hidden features). For one round of a row whose committed tokens are x_0 .. x_{N-1}:

- context slots: as the feature drafter's (``specdec.drafters.feature_model``), slot t holds the pair (f_t, x_{t+1})
  at position id t, f_t the target's fused features (``fuse``: Linear(3H -> H) of the three chosen layers) at
  position t; the last one is (f_{N-2}, x_{N-1}). They are cached: a round forwards only its new pairs;
- k mask slots after them, at position ids N - 1 .. N + k - 2; mask slot j's input is a learned ``mask_embed``
  plus a learned block-position embedding ``block_embed[j]``; its output, through the target's LM head, is the
  draft distribution of x_{N+j}.

Attention: context slots causally among themselves (they never see a mask slot); mask slots see every live context
slot and every mask slot of their block (bidirectional). The mask slots' keys and values are dropped after the round
(``specdec.drafters.parallel``).

Parameters (the drafter's own, all saved): ``fuse``; ``embed_norm``, ``hidden_norm`` and ``proj`` Linear(2H -> H) on
concat(norm(embedding of x_{t+1}), norm(f_t)); ``mask_embed`` [H] and ``block_embed`` [block_size, H];
``config.draft_layers`` decoder layers of the target's class; a final ``norm`` (with ``bind``:
``specdec.drafters.context_model``, as the feature drafter's). The token embedding and LM head are the target's,
frozen, shared, bound at load, not saved, and another target refused in one line (``target_mismatch``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import ModelOutput

from specdec.compat import LAYER_KEYWORD
from specdec.drafters.context_model import ContextSlotsModel
from specdec.drafters.feature_model import FeatureDrafterConfig

MODEL_TYPE = "specdec-parallel-drafter"


class ParallelDrafterConfig(FeatureDrafterConfig):
    """The parallel drafter's config: the feature drafter's (the target's config, its fingerprint, the three layers
    read) plus the block size and the number of decoder layers."""

    model_type = MODEL_TYPE

    block_size: int = 8  # mask slots per round at most (k)
    draft_layers: int = 1  # decoder layers of the target's class

    def layer_config(self) -> PretrainedConfig:
        config = super().layer_config()
        config.num_hidden_layers = self.draft_layers
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = (config.layer_types * self.draft_layers)[:self.draft_layers]
        return config


def target_mismatch(config: ParallelDrafterConfig, target_config: PretrainedConfig, fingerprint: str | None = None,
                    drafter: str = "the parallel drafter", target: str = "this target") -> str | None:
    """Why a drafter of ``config`` cannot draft for a target of ``target_config`` (one line naming both), or None."""
    return ParallelDrafterModel.mismatch(config, target_config, fingerprint, drafter, target)


@dataclass
class ParallelDrafterOutput(ModelOutput):
    """What the parallel drafter returns."""

    logits: torch.Tensor | None = None  # [B, k, V] the mask slots' (k = 0: as ``logits_to_keep`` says)
    hidden: torch.Tensor | None = None  # [B, n, H] the last layer's output (before the final norm)
    past_key_values: DynamicCache | None = None


class ParallelDrafterModel(ContextSlotsModel):
    """Decoder layers of the target's class over cached context slots and a block of mask slots (module docstring);
    the context slots, the target's embedding and head are ``ContextSlotsModel``'s."""

    config: ParallelDrafterConfig
    config_class = ParallelDrafterConfig
    noun = "parallel drafter"
    command = "parallel-drafter"

    def build(self, layer_class: type, layer_config: PretrainedConfig) -> None:
        width = layer_config.hidden_size
        self.mask_embed = nn.Parameter(torch.zeros(width))
        self.block_embed = nn.Embedding(self.config.block_size, width)
        self.layers = nn.ModuleList(layer_class(layer_config, layer_idx=i) for i in range(self.config.draft_layers))

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.target_config.get("initializer_range", 0.02)
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        if module is self:
            nn.init.normal_(self.mask_embed, std=std)

    @staticmethod
    def pattern(live: torch.Tensor, n: int, mask_tokens: int) -> torch.Tensor:
        """Boolean [B, 1, n, S] over S = ``live.shape[1]`` slots whose last ``n`` are new, the last ``mask_tokens``
        of them mask slots: causal over live slots (each query sees itself), and each mask slot also sees every
        live mask slot of its block."""
        allowed = ContextSlotsModel.causal(live, n).clone()
        if mask_tokens:
            total = live.shape[1]
            block = live[:, None, total - mask_tokens:].bool()  # [B, 1, k]
            allowed[:, 0, n - mask_tokens:, total - mask_tokens:] |= block
        return allowed

    def inputs(self, input_ids: torch.Tensor, hidden: torch.Tensor | None, mask_tokens: int,
               block_positions: torch.Tensor | None = None, revealed: torch.Tensor | None = None) -> torch.Tensor:
        """The layers' input [B, n, H]: context pairs, then ``mask_tokens`` mask slots, slot i at block position
        ``block_positions[i]`` (default: 0 .. mask_tokens - 1, one block; the trainer packs several blocks).
        ``revealed`` [B, mask_tokens] bool (training's glancing only): such a slot reads its input id, the gold token,
        as a context pair with no feature (``pairs(id, 0)``) plus its block-position embedding."""
        batch, n = input_ids.shape
        context = n - mask_tokens
        dtype = self.compute_dtype
        if block_positions is None:
            block_positions = torch.arange(mask_tokens, device=input_ids.device)
        if mask_tokens and int(block_positions.max()) >= self.config.block_size:
            raise ValueError(f"block position {int(block_positions.max())}, but this drafter has "
                             f"{self.config.block_size} block positions: draft at most block_size tokens a round")
        parts = []
        if context:
            if hidden is None:
                raise ValueError("context slots need the target's fused features: pass hidden [B, n, H]")
            parts.append(self.pairs(input_ids[:, :context], hidden[:, :context]))
        if mask_tokens:
            slots = (self.mask_embed + self.block_embed(block_positions)).to(dtype)[None]  # [1, k, H]
            slots = slots.expand(batch, mask_tokens, -1)
            if revealed is not None:
                ids = input_ids[:, context:]
                gold = self.pairs(ids, slots.new_zeros(slots.shape)) + self.block_embed(block_positions).to(dtype)
                slots = torch.where(revealed[..., None], gold, slots)
            parts.append(slots)
        return torch.cat(parts, dim=1)

    def forward(self, input_ids: torch.LongTensor, hidden: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: DynamicCache | None = None, use_cache: bool = False, mask_tokens: int = 0,
                block_positions: torch.Tensor | None = None, logits: bool = True, logits_to_keep: int = 0,
                revealed: torch.Tensor | None = None, **kwargs: object) -> ParallelDrafterOutput:
        """One forward over ``n`` slots, the last ``mask_tokens`` of them mask slots (``revealed``: ``inputs``).

        The forward contract::

            out = model(input_ids [B, n], hidden [B, n, H] | None, position_ids [B, n] | None, mask_tokens=k,
                        attention_mask=None | [B, past + n] (1 = live slot)
                                       | [B, 1, n, past + n] (bool: True = may attend; float: additive),
                        past_key_values=None | Cache, use_cache=False)
            out.logits  # [B, k, V] the mask slots' draft logits (k = 0: every slot's, or the last logits_to_keep)

        ``block_positions`` [k] (optional): each mask slot's block position (default 0 .. k - 1); a trainer packs
        several blocks after one context with a 4D mask. The last ``mask_tokens`` of the n inputs are mask slots
        (their ids and ``hidden`` are ignored); a 2D mask gives the pattern of the module docstring (``pattern``); a
        4D mask is taken as given.
        """
        batch, n = input_ids.shape
        x = self.inputs(input_ids, hidden, mask_tokens, block_positions, revealed)
        past_key_values, position_ids, mask = self.step_inputs(
            batch, n, x.dtype, x.device, position_ids, attention_mask, past_key_values, use_cache,
            lambda live: self.pattern(live, n, mask_tokens))
        rotary = self.rotary_emb(x, position_ids=position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary,
                      use_cache=use_cache, **{LAYER_KEYWORD: past_key_values})
            x = x[0] if isinstance(x, tuple) else x
        keep = mask_tokens or logits_to_keep
        kept = x[:, -keep:] if keep else x
        return ParallelDrafterOutput(logits=self.head(kept) if logits else None, hidden=x,
                                     past_key_values=past_key_values if use_cache else None)


def is_parallel_drafter(model: object) -> bool:
    """Whether ``model`` is a parallel drafter (by its config's model type)."""
    return getattr(getattr(model, "config", None), "model_type", None) == MODEL_TYPE


def new_parallel_drafter(target: PreTrainedModel, block_size: int = 8, draft_layers: int = 1,
                         feature_layers: list[int] | None = None, fingerprint: str = "", name: str = "",
                         seed: int = 0) -> ParallelDrafterModel:
    """A fresh parallel drafter for ``target`` (float32, bound to it), its weights drawn from ``seed``."""
    config = ParallelDrafterConfig.for_target(target.config, feature_layers, fingerprint, name,
                                              block_size=block_size, draft_layers=draft_layers)
    torch.manual_seed(seed)
    drafter = ParallelDrafterModel(copy.deepcopy(config)).float()
    return drafter.bind(target, fingerprint or None, name or "the target")


def load_parallel_drafter(path: str, target: PreTrainedModel, fingerprint: str | None = None,
                          name: str = "this target", dtype: torch.dtype | None = None) -> ParallelDrafterModel:
    """The parallel drafter saved in ``path``, bound to ``target`` (refused, one line, when made for another)."""
    return ParallelDrafterModel.load(path, target, fingerprint, name, dtype)


AutoConfig.register(MODEL_TYPE, ParallelDrafterConfig)
AutoModel.register(ParallelDrafterConfig, ParallelDrafterModel)
# so that `load_model` (AutoModelForCausalLM) loads a parallel drafter folder too (`--drafter PATH`); it drafts only
# once bound to its target (``ParallelDrafter.align``)
AutoModelForCausalLM.register(ParallelDrafterConfig, ParallelDrafterModel)
