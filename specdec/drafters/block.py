"""SpecDec's block drafter as a ``Drafter``: k draft tokens per row from one forward pass, for a batch.

Follows SpecDec (Xia et al., EMNLP 2023 Findings): each round the drafter reads the committed
prefix followed by k mask positions and drafts all k tokens at once (``block_model.py``: block
position j predicts the token j + 1 places after the last committed token), so drafting costs one
forward whatever k is. Departure (documented in ``block_model.py``): the prefix is attended causally
and kept in a KV cache, so a round feeds only the tokens committed since the last one.

Contract (``drafters.base``): the drafter keeps a ``RaggedCache`` of each row's committed tokens
(rows of different lengths share it) and, per row, ``pending`` tokens committed but not yet
cached (at least the newest one). ``propose(limit)`` makes one call
``model(pending (left-padded) + k masks, block_size=k)`` with k = max(limit), reads the k block
logits ``[B, k, V]``, draws every position with the round's ``Sampler`` (argmax when greedy; q is
the warped distribution of each position, so verification stays exact when sampling), and then
rolls the cache back per row to its committed tokens: the pending tokens stay cached, the k block
slots (mask inputs, never real tokens) are dropped. Nothing drafted ever enters the cache, so
``follow`` (which ``commit`` calls) only appends the committed tokens to ``pending``: a row that
accepted a drafts feeds a + 1 tokens next round. Invariant after every call, per row: cache live
tokens + pending == committed tokens.

Two kinds of block drafter models draft through it, with one round: SpecDec's setting, an
encoder-decoder (a standard transformers seq2seq model, e.g. ``MarianMTModel``, whose config holds
``block_drafter = {"mask_token_id", "max_block_size"}``: ``specdec train seq2seq-block-drafter``)
drafting for an encoder-decoder target, where the drafter encodes each row's source once with its
own encoder and ``Seq2SeqCache`` gives the decoder the block mask; and the decoder-only
``BlockDrafterModel`` (``block_model.py``) for causal LM targets, which builds that mask itself.

A row's proposal ends at its own ``limit`` or where the schedule's stop rule stops it (the stop
rule sees each position's logits and q; the block's hidden states are not offered, since the
acceptance head was trained on an autoregressive drafter's). A ``limit`` above the model's
``max_block_size`` (the largest block it was built and trained for) is refused with a clear error.
A model trained to read the target's hidden state (``target_hidden_size`` > 0) is refused: the round
loop does not hand drafters the target's states, and running it without them would draft worse than
it was measured to, without a word.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.batch import left_mask, left_padded
from specdec.drafters.base import (
    ENDED_LIMIT,
    ENDED_NONE,
    ENDED_THRESHOLD,
    DraftStep,
    Proposal,
    StopRule,
)
from specdec.drafters.block_model import BlockDrafterModel
from specdec.drafters.model import (
    CachedDrafter,
    check_device,
    check_kind,
    check_vocabularies,
    in_target_vocabulary,
)
from specdec.kernels import install
from specdec.loading import context_limit, input_device
from specdec.sampling import Sampler, check_finite
from specdec.seq2seq import cache_for, is_encoder_decoder

BLOCK_FIX = ("use a block drafter distilled from this target (specdec train block-drafter, or specdec train "
             "seq2seq-block-drafter for an encoder-decoder target)")
SEQ2SEQ_BLOCK = "block_drafter"  # the config entry that makes an encoder-decoder model a block drafter


def is_block_drafter(model: PreTrainedModel) -> bool:
    """Whether ``model`` is a block drafter (``BlockDrafter`` drafts with it): a ``BlockDrafterModel``,
    or an encoder-decoder whose config declares ``block_drafter`` settings."""
    if isinstance(model, BlockDrafterModel):
        return True
    return is_encoder_decoder(model) and isinstance(getattr(model.config, SEQ2SEQ_BLOCK, None), dict)


def block_settings(model: PreTrainedModel) -> tuple[int, int]:
    """A block drafter's (mask token id, largest block it was trained for)."""
    if isinstance(model, BlockDrafterModel):
        return int(model.config.mask_token_id), int(model.config.max_block_size)
    settings = getattr(model.config, SEQ2SEQ_BLOCK)
    missing = {"mask_token_id", "max_block_size"} - settings.keys()
    if missing:
        raise ValueError(f"{type(model).__name__}'s config.{SEQ2SEQ_BLOCK} lacks {', '.join(sorted(missing))}: "
                         f"{BLOCK_FIX}")
    return int(settings["mask_token_id"]), int(settings["max_block_size"])


class BlockDrafter(CachedDrafter):
    """Drafts k tokens per row in one forward of a block drafter model with a cached causal prefix."""

    returns_hidden = False

    def __init__(self, model: PreTrainedModel, kernels: bool = True) -> None:
        if not is_block_drafter(model):
            raise TypeError(f"BlockDrafter drafts with a block drafter model (BlockDrafterModel, or an encoder-decoder "
                            f"with config.{SEQ2SEQ_BLOCK}), got {type(model).__name__}: {BLOCK_FIX}")
        if not is_encoder_decoder(model):
            self._check_decoder_only(model)
        self.model = model.eval()
        if kernels:  # the caller's choice (``ModelTarget``'s ``kernels``)
            install(model)  # its linear layers' fast kernels, used while specdec decodes (specdec.kernels)
        self.mask_token_id, self.max_block_size = block_settings(model)  # max_block_size: largest k per round
        self.max_draft = self.max_block_size
        self.vocab_size: int | None = None  # the target's logits size once aligned; None = the model's own
        self.context_limit = context_limit(model)
        self.device = input_device(model)
        self.cache = cache_for(model, 0, self.device)
        self.pending: list[list[int]] = []  # per row: committed tokens not yet in the cache
        self.lengths: list[int] = []  # per row: its sequence's tokens so far
        self._drafts: list[list[int]] = []  # per row: the last proposal's drafts

    @staticmethod
    def _check_decoder_only(model: PreTrainedModel) -> None:
        """Refuse a ``BlockDrafterModel`` whose prefix cannot be cached or that needs the target's states."""
        if model.config.prefix_attention != "causal":
            raise ValueError("this block drafter attends bidirectionally over its prefix (SpecDec's rule), which "
                             "cannot be cached across rounds: use one trained with prefix_attention='causal'")
        if model.config.target_hidden_size:
            raise ValueError("this block drafter was trained to read the target's last hidden state "
                             f"(target_hidden_size {model.config.target_hidden_size}), which the round loop does not "
                             "pass to drafters: draft with one trained without --condition-on-target")

    def align(self, target, tokenizer: PreTrainedTokenizerBase | None = None) -> BlockDrafter:
        """Check the block drafter against the target (kind, vocabulary, device); adopt its vocabulary size."""
        check_kind(target, self.model)
        # its head covers a subset of the vocabulary (FR-Spec): the embedding says its vocabulary
        check_vocabularies(target.model, self.model, tokenizer, drafter_size=int(self.model.config.vocab_size),
                           who="block drafter", fix=BLOCK_FIX)
        check_device(target.device, self.device)
        self.vocab_size = target.vocab_size
        return self

    def _ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids the model has embeddings for (a padded target's extra ids read as its last)."""
        return ids.clamp(max=int(self.model.config.vocab_size) - 1)

    def propose(self, limit: torch.Tensor, sampler: Sampler, stop: StopRule | None = None) -> Proposal:
        """One forward: every row's pending tokens, then k = max(limit) mask positions; row b keeps
        ``limit[b]`` drafts (fewer where ``stop`` stops it)."""
        rows = len(self.pending)
        limit, limits = self._within_room(limit)
        k = max(limits, default=0)
        if k == 0:
            self._drafts = [[] for _ in range(rows)]
            return Proposal.empty(rows, self.device)
        if k > self.max_block_size:
            raise ValueError(f"the block drafter drafts at most {self.max_block_size} tokens per round (the largest "
                             f"block it was trained for), asked for {k}: use --gamma {self.max_block_size} or less "
                             f"(and --bound MIN {self.max_block_size} or less)")
        ids, counts = left_padded(self.pending, self.device)  # [B, P], [B]
        width = ids.shape[1]
        block = torch.full((rows, k), self.mask_token_id, dtype=torch.long, device=self.device)  # [B, k]
        valid = None
        # [B, k] | None: the mask positions each row drafts at, live; those past its limit (a row drafting fewer than
        # k: the block attends within itself, so they would change its drafts, and a seeded row's output would
        # depend on the rows beside it) or past its context, dead
        fits = self._fits(0, k)
        short = None if min(limits) == k else torch.arange(k, device=self.device)[None, :] < limit[:, None]
        live = short if fits is None else fits if short is None else fits & short
        if len(set(counts.tolist())) > 1 or live is not None:
            live = torch.ones(rows, k, dtype=torch.bool, device=self.device) if live is None else live  # [B, k]
            valid = torch.cat([left_mask(counts, width), live], dim=1)
        before = self.cache.live.clone()  # [B]
        with torch.no_grad():
            out = self.cache.forward(self._ids(torch.cat([ids, block], dim=1)), valid, logits_to_keep=k, block_size=k)
        self.cache.keep(before + counts)  # the pending tokens stay cached; the block's mask slots go
        self.pending = [[] for _ in range(rows)]
        logits = in_target_vocabulary(out.logits[:, -k:], self.vocab_size)  # [B, k, V]
        check_finite(logits, "block drafter")
        active = limit > 0  # [B] rows still drafting
        stopped = torch.zeros_like(active)  # [B] rows the stop rule stopped
        lengths = torch.zeros_like(limit)
        tokens, probs = [], []
        for i in range(k):
            token, q = sampler.draft(logits[:, i], active)  # [B], [B, V] | None; only drafting rows draw
            tokens.append(token)
            probs.append(q)
            lengths = lengths + active.long()
            if stop is not None:
                halt = active & stop(DraftStep(i, token, logits[:, i], q, None, active))
                stopped, active = stopped | halt, active & ~halt
            active = active & (limit > i + 1)
            if not bool(active.any()):
                break
        drafted = torch.stack(tokens, dim=1)  # [B, k']
        ended = tuple(ENDED_NONE if n == 0 else ENDED_THRESHOLD if s else ENDED_LIMIT
                      for n, s in zip(lengths.tolist(), stopped.tolist()))
        proposal = Proposal(drafted, lengths, None if probs[0] is None else torch.stack(probs, dim=1), None,
                            calls=1, ended=ended)
        self._drafts = proposal.drafts()
        return proposal

    def follow(self, tokens: list[list[int]]) -> None:
        """Row b committed ``tokens[b]``: they wait to be fed with the next block (drafts never enter the cache)."""
        reach = self._grown(tokens)  # a row past the drafter's context is no longer followed
        self.pending = [p + t if ok else [] for p, t, ok in zip(self.pending, tokens, reach)]

    def reset(self) -> None:
        self.cache = cache_for(self.model, 0, self.device)
        self.pending, self.lengths, self._drafts = [], [], []
