"""SpecDec's block drafter as a transformers model: k draft tokens from one forward pass.

Follows SpecDec (Xia et al., EMNLP 2023 Findings): the drafter reads the committed prefix followed
by a block of k mask positions and predicts every masked position at once; block position j
(0-based) predicts the token j + 1 places after the last prefix token, so the argmax of each
position is a k-token draft that costs one forward pass whatever k is.

Departure, for decoder-only targets: SpecDec's drafter attends bidirectionally over prefix and
block and recomputes the whole prefix every round. Here the prefix is attended causally and kept
in a ``DynamicCache`` that is rolled back like any drafter's, so a round feeds only the tokens
committed since the last one plus the k mask positions. The block still attends to every live
prefix slot and bidirectionally to itself. Recomputing a prefix of a few hundred tokens every
round would cost more than the drafting the block saves; with a causal prefix, a training sequence
also carries many blocks at once (each sees the same cached-prefix states it will see at run time).
``BlockDrafterConfig.prefix_attention = "bidirectional"`` keeps SpecDec's own prefix rule (no cache:
the caller feeds the whole prefix every call); an encoder-decoder variant for translation targets
(SpecDec's setting) is meant to share the block fields of ``BlockDrafterConfig`` (``max_block_size``,
``mask_token_id``, ``target_hidden_size``) under its own model type.

The forward contract (what a ``Drafter`` wrapper calls each round)::

    out = model(input_ids [B, n], attention_mask [B, past_slots + n], position_ids [B, n],
                past_key_values=cache, use_cache=True, block_size=k, logits_to_keep=k,
                target_hidden=None | [B, H_target], output_hidden_states=False)
    out.logits  # [B, k, V]: out.logits[b, j] predicts the token j + 1 places after row b's last prefix token

- the last ``k`` input positions are the block; their input ids are ignored (pass
  ``config.mask_token_id``): the model reads a learned mask vector plus a learned block-offset
  vector there. The first ``n - k`` inputs are ordinary tokens (the newly committed ones, possibly
  with dead padding slots marked 0 in ``attention_mask``); ``n == k`` is allowed;
- ``attention_mask`` is 2D, 1 = live slot, dead slots anywhere (left padding, holes in the middle);
  None means every slot is live. ``position_ids`` None means ``past_slots + arange(n)``;
- the block's key/value slots are appended to the cache like any input: the caller removes them
  afterwards (``cache.crop(-k)``, or marks them dead) so that the next call sees only prefix slots;
- ``target_hidden`` (when ``config.target_hidden_size > 0``): the target's last-layer hidden state
  whose logits produced row b's newest committed token; it is added, through a learned
  projection, to every block position. None means "not available" (the model is trained with it
  dropped sometimes, e.g. for a first round).
- ``k`` must lie in ``1..config.max_block_size``; ``block_size=0`` runs the prefix only (caching it).

Training feeds several blocks per sequence at once through a ``BlockLayout`` (see
``BlockLayout.packed``) and reveals gold tokens at some block positions (glancing, GLAT) through
``revealed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaModel,
    PreTrainedModel,
)
from transformers.modeling_outputs import ModelOutput

from specdec.compat import cache_kwargs, cache_of

MODEL_TYPE = "specdec-block-drafter"
PREFIX_ATTENTION = ("causal", "bidirectional")


@strict
class BlockDrafterConfig(LlamaConfig):
    """A Llama-style decoder plus the block drafter's own fields (the Llama fields shape its layers)."""

    model_type = MODEL_TYPE

    max_block_size: int = 25  # longest block k the drafter is built and trained for; larger k is refused
    mask_token_id: int | None = None  # id a caller puts at block positions (ignored by the model; None = pad id)
    draft_vocab_size: int = 0  # rows of the drafting head (ids in the `draft_vocab` buffer); 0 = the whole vocabulary
    target_hidden_size: int = 0  # width of the target hidden state the block may be conditioned on; 0 = none
    prefix_attention: str = "causal"  # "causal" (cached prefix) or "bidirectional" (SpecDec; no cache)

    def __post_init__(self, **kwargs) -> None:
        if self.mask_token_id is None:
            self.mask_token_id = self.pad_token_id if self.pad_token_id is not None else 0
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        super().validate_architecture()
        if self.max_block_size < 1:
            raise ValueError(f"max_block_size must be >= 1, got {self.max_block_size}")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must lie in 0..vocab_size ({self.vocab_size}), got "
                             f"{self.draft_vocab_size}")
        if self.draft_vocab_size and self.tie_word_embeddings:
            raise ValueError("a drafting head over part of the vocabulary (draft_vocab_size > 0) cannot be tied to "
                             "the input embeddings: set tie_word_embeddings=False")
        if self.target_hidden_size < 0:
            raise ValueError(f"target_hidden_size must be >= 0 (0 = no conditioning), got {self.target_hidden_size}")
        if self.prefix_attention not in PREFIX_ATTENTION:
            raise ValueError(f"prefix_attention must be one of {', '.join(PREFIX_ATTENTION)}, "
                             f"got {self.prefix_attention!r}")


@dataclass(frozen=True)
class BlockLayout:
    """Which input positions are block positions, and what each position may attend to.

    Every input slot ``i`` (counted after the ``past_slots`` cached ones) has a ``block`` id (-1 =
    an ordinary prefix token, b >= 0 = block b) and an ``anchor``: the last prefix slot (absolute,
    past included) it may see. Query q attends to key slot s iff s is live and either s is a prefix
    slot with s <= anchor[q] (prefix rule "causal"; with "bidirectional" every live prefix slot of the
    call) or s belongs to q's own block. Cached slots are all prefix slots.
    """

    block: torch.Tensor  # [B, n] long: -1 for prefix tokens, else the block's index
    offset: torch.Tensor  # [B, n] long: position inside its block (0-based; 0 for prefix tokens)
    anchor: torch.Tensor  # [B, n] long: last prefix slot (absolute) visible to this position

    @classmethod
    def trailing(cls, batch: int, n: int, block_size: int, past_slots: int,
                 device: torch.device | str = "cpu") -> BlockLayout:
        """One block of ``block_size`` positions at the end of the ``n`` inputs (the decoding call)."""
        slots = torch.arange(n, device=device)  # [n]
        in_block = slots >= n - block_size  # [n]
        block = torch.where(in_block, 0, -1)
        offset = torch.where(in_block, slots - (n - block_size), 0)
        anchor = past_slots + torch.where(in_block, n - block_size - 1, slots)
        return cls(*(t.expand(batch, n) for t in (block, offset, anchor)))

    @classmethod
    def packed(cls, prefix_len: int, cuts: torch.Tensor, block_size: int) -> BlockLayout:
        """``prefix_len`` ordinary tokens, then one block of ``block_size`` per cut (training).

        ``cuts`` [B, m]: block c follows prefix token ``cuts[b, c]`` (0-based index into the prefix),
        i.e. it predicts prefix tokens ``cuts + 1 ..``; the inputs are ``prefix_len + m * block_size`` long.
        """
        batch, m = cuts.shape
        device = cuts.device
        prefix = torch.arange(prefix_len, device=device)  # [T]
        j = torch.arange(block_size, device=device)  # [k]
        block = torch.cat([torch.full((prefix_len,), -1, device=device),
                           torch.arange(m, device=device).repeat_interleave(block_size)])  # [T + m k]
        offset = torch.cat([torch.zeros(prefix_len, dtype=torch.long, device=device), j.repeat(m)])
        anchor_prefix = prefix.expand(batch, prefix_len)  # [B, T]
        anchor_block = cuts.repeat_interleave(block_size, dim=1)  # [B, m k]
        return cls(block.expand(batch, -1), offset.expand(batch, -1), torch.cat([anchor_prefix, anchor_block], 1))

    def packed_positions(self) -> torch.Tensor:
        """Position ids of a ``packed`` layout whose prefix starts at position 0: prefix token i at i,
        block position j of the block after prefix token a at a + 1 + j. [B, n]"""
        slots = torch.arange(self.block.shape[1], device=self.block.device)  # [n]
        return torch.where(self.block >= 0, self.anchor + 1 + self.offset, slots)

    def allowed(self, live: torch.Tensor, prefix_attention: str = "causal") -> torch.Tensor:
        """Boolean attention pattern ``[B, 1, n, past + n]`` from the live-slot mask ``live`` [B, past + n].

        Every query also sees itself, so that a dead query slot (padding) never has an empty row."""
        batch, n = self.block.shape
        total = live.shape[1]
        past = total - n
        device = live.device
        key_block = torch.cat([torch.full((batch, past), -1, device=device, dtype=torch.long), self.block], 1)  # [B, S]
        key_slot = torch.arange(total, device=device)  # [S]
        q_block = self.block[:, :, None]  # [B, n, 1]
        k_block = key_block[:, None, :]  # [B, 1, S]
        if prefix_attention == "causal":
            prefix_ok = key_slot[None, None, :] <= self.anchor[:, :, None]  # [B, n, S]
        else:  # SpecDec's rule: every live prefix slot, whatever the query
            prefix_ok = torch.ones(batch, n, total, dtype=torch.bool, device=device)
        see = ((k_block < 0) & prefix_ok) | ((k_block >= 0) & (k_block == q_block))
        see &= live[:, None, :].bool()
        own = key_slot[None, None, :] == (past + torch.arange(n, device=device))[None, :, None]  # [1, n, S]
        return (see | own)[:, None]  # [B, 1, n, S]


@dataclass
class BlockDrafterOutput(ModelOutput):
    """What the block drafter returns."""

    logits: torch.Tensor | None = None  # [B, keep, V] (keep = logits_to_keep, 0 = all); finfo.min where no head row
    past_key_values: DynamicCache | None = None  # the cache, block slots included (crop them)
    hidden_states: tuple[torch.Tensor, ...] | None = None  # per layer [B, n, H]; [-1] is the last (normed) one


class BlockDrafterPreTrainedModel(PreTrainedModel):
    """Weights init and loading rules shared by block drafter models."""

    config: BlockDrafterConfig
    config_class = BlockDrafterConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["LlamaDecoderLayer"]
    _supports_sdpa = True
    _supports_attention_backend = False

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, BlockDrafterModel):
            nn.init.normal_(module.mask_embedding, std=self.config.initializer_range)


class BlockDrafterModel(BlockDrafterPreTrainedModel):
    """A Llama decoder that drafts a block of k tokens per forward pass (see the module docstring)."""

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: BlockDrafterConfig) -> None:
        super().__init__(config)
        self.model = LlamaModel(config)
        self.mask_embedding = nn.Parameter(torch.zeros(config.hidden_size))  # input of a masked block position
        self.block_position = nn.Embedding(config.max_block_size, config.hidden_size)  # added at block offset j
        self.hidden_proj = (nn.Linear(config.target_hidden_size, config.hidden_size, bias=False)
                            if config.target_hidden_size else None)
        rows = config.draft_vocab_size or config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        # token id of each head row (the identity when the head covers the whole vocabulary)
        self.register_buffer("draft_vocab", torch.arange(rows), persistent=bool(config.draft_vocab_size))
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def _check_block_size(self, block_size: int, n: int) -> None:
        if not 0 <= block_size <= self.config.max_block_size:
            raise ValueError(f"block_size {block_size} is outside 0..{self.config.max_block_size}, the block "
                             "sizes this drafter was built for: draft fewer tokens per round")
        if block_size > n:
            raise ValueError(f"block_size {block_size} is larger than the {n} input positions: append "
                             f"{block_size} mask tokens (config.mask_token_id) to the input ids")

    def embed(self, input_ids: torch.Tensor, layout: BlockLayout, revealed: torch.Tensor | None = None,
              target_hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Input vectors: token embeddings at prefix (and revealed block) positions, the mask vector
        at the other block positions, plus the block-offset vector (and projected target hidden
        state) at every block position. [B, n, H]"""
        tokens = self.model.embed_tokens(input_ids)  # [B, n, H]
        in_block = layout.block >= 0  # [B, n]
        masked = in_block if revealed is None else in_block & ~revealed
        x = torch.where(masked[..., None], self.mask_embedding.to(tokens.dtype), tokens)
        extra = self.block_position(layout.offset.clamp(max=self.config.max_block_size - 1))  # [B, n, H]
        if target_hidden is not None:
            if self.hidden_proj is None:
                raise ValueError("this block drafter was not built with target_hidden_size > 0: "
                                 "call it without target_hidden")
            if target_hidden.dim() == 2:  # [B, H_t]: one vector per row, for its block
                target_hidden = target_hidden[:, None, :]
            extra = extra + self.hidden_proj(target_hidden.to(tokens.dtype))  # [B, n or 1, H]
        return x + torch.where(in_block[..., None], extra.to(tokens.dtype), 0.0)

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: DynamicCache | None = None,
        use_cache: bool | None = None,
        block_size: int = 0,
        logits_to_keep: int = 0,
        target_hidden: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        layout: BlockLayout | None = None,
        revealed: torch.Tensor | None = None,
        head_logits: bool = False,
        **kwargs: object,
    ) -> BlockDrafterOutput:
        """Draft logits for the block positions (module docstring: the contract).

        ``layout`` (training) replaces ``block_size``: several blocks per row; ``revealed`` [B, n]
        marks block positions whose input id is a gold token to read (glancing). ``head_logits``
        returns the head's rows only ([B, keep, draft_vocab_size]; row r is token ``draft_vocab[r]``)
        instead of the whole vocabulary."""
        batch, n = input_ids.shape
        if self.config.prefix_attention == "bidirectional" and (past_key_values is not None or use_cache):
            raise ValueError("a block drafter with a bidirectional prefix cannot use a cache: "
                             "feed the whole prefix every call with use_cache=False")
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if layout is None:
            self._check_block_size(block_size, n)
            layout = BlockLayout.trailing(batch, n, block_size, past, device=input_ids.device)
        if attention_mask is None:
            attention_mask = torch.ones(batch, past + n, dtype=torch.long, device=input_ids.device)
        elif attention_mask.shape != (batch, past + n):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but the cache holds {past} "
                             f"slots and {n} inputs: pass a 2D mask [{batch}, {past + n}] (1 = live slot)")
        if position_ids is None:
            position_ids = (past + torch.arange(n, device=input_ids.device)).expand(batch, n)
        embeds = self.embed(input_ids, layout, revealed, target_hidden)  # [B, n, H]
        allowed = layout.allowed(attention_mask, self.config.prefix_attention)  # [B, 1, n, S]
        mask = torch.zeros(allowed.shape, dtype=embeds.dtype, device=embeds.device)
        mask = mask.masked_fill(~allowed, torch.finfo(embeds.dtype).min)  # additive: eager and sdpa alike
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        out = self.model(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids,
                         **cache_kwargs(self.model, past_key_values), use_cache=use_cache,
                         output_hidden_states=output_hidden_states)
        hidden = out.last_hidden_state  # [B, n, H]
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)  # [B, keep, R] head rows
        if self.config.draft_vocab_size and not head_logits:  # tokens without a row: never drafted
            full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), torch.finfo(logits.dtype).min)
            logits = full.index_copy(-1, self.draft_vocab, logits)  # [B, keep, V]
        return BlockDrafterOutput(logits=logits, past_key_values=cache_of(out) if use_cache else None,
                                  hidden_states=out.hidden_states)


AutoConfig.register(MODEL_TYPE, BlockDrafterConfig)
AutoModel.register(BlockDrafterConfig, BlockDrafterModel)
# so that `load_model` (AutoModelForCausalLM) loads a block drafter folder too: with block_size=0 its
# prefix positions give next-token logits (trained by the prefix loss), like a causal LM's
AutoModelForCausalLM.register(BlockDrafterConfig, BlockDrafterModel)
