"""The parallel drafter (``specdec.drafters.parallel_model``) behind the ``Drafter`` contract: k drafts in one forward.

Contract: ``ParallelDrafter(model)`` drafts for the target it is aligned to: ``align`` binds the model to the target's
embedding and LM head (refusing another target in one line) and asks the target for the features of the model's
layers (``Target.want_features``). Per row the drafter holds a ``RaggedCache`` of context slots (f_p, x_{p+1}) and
``pending`` pairs not yet forwarded, as ``specdec.drafters.feature.FeatureDrafter`` does:

- ``prefill``: each new row's features f_0 .. f_{T-2} (``Target.take_features``) pair with x_1 .. x_{T-1}, pending;
- ``propose``: ONE forward (``RaggedCache.tree_forward``) of every row's pending pairs (left-padded, causal) and
  a block of min(limit[b], block_size) mask slots that see the row's whole context and each other (a row's block
  does not depend on the rows beside it: their longer blocks' slots are dead to it); mask slot j's logits give
  draft j (greedy: the argmax; sampling: the sampler's warped q, as every drafter's);
- ``commit`` / ``follow``: the cache keeps the context slots and drops the mask slots; the round's new features pair
  with the committed tokens, pending.

Invariant after every commit, per row: context slots + pending pairs == committed tokens - 1 (a one-token prompt has
no pair and drafts nothing until its first round has committed). Rows leaving (``select``) and joining (``prefill``)
follow the feature drafter's rules.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import ENDED_LIMIT, ENDED_NONE, Proposal, StopRule
from specdec.drafters.feature import FeatureDrafter
from specdec.drafters.parallel_model import ParallelDrafterModel, is_parallel_drafter
from specdec.sampling import Sampler, check_finite


class ParallelDrafter(FeatureDrafter):
    """Drafts a block with a ``ParallelDrafterModel`` from the target's features (module docstring). Shares the
    feature drafter's bookkeeping (pending pairs, ``align``, ``follow``, ``select``); only ``propose`` differs."""

    def __init__(self, model: ParallelDrafterModel, kernels: bool = True) -> None:
        if not is_parallel_drafter(model):
            raise TypeError(f"ParallelDrafter drafts with a parallel drafter model, not {type(model).__name__}")
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.block_size = model.config.block_size
        self.context_limit = None
        self.target = None
        self.vocab_size: int | None = None
        self.reset()
        if (why := self.cache.tree_refusal()) is not None:
            raise TypeError(f"a parallel drafter needs a cache that takes a block's 4D mask: {why}")

    def propose(self, limit: torch.Tensor, sampler: Sampler, stop: StopRule | None = None) -> Proposal:
        rows = len(self.tokens)
        live = self.cache.live.tolist()
        ready = [bool(t) or have > 0 for t, have in zip(self.tokens, live)]  # a row with no pair drafts nothing yet
        limits = [min(n, self.block_size) if ok else 0 for n, ok in zip(limit.tolist(), ready)]
        k = max(limits, default=0)
        if k <= 0:
            self._drafts = [[] for _ in range(rows)]
            return Proposal.empty(rows, self.device)
        width = max(len(t) for t in self.tokens)
        n = width + k
        ids = torch.zeros(rows, n, dtype=torch.long, device=self.device)
        valid = torch.zeros(rows, n, dtype=torch.bool, device=self.device)
        limit_t = torch.tensor(limits, device=self.device)
        # row b's block is its first limits[b] mask slots, the others dead: a row drafts as it would alone, whatever
        # the rows beside it ask for
        valid[:, width:] = torch.arange(k, device=self.device)[None, :] < limit_t[:, None]
        hidden = torch.zeros(rows, n, self.model.config.hidden_size, dtype=self.model.proj.weight.dtype,
                             device=self.device)
        for b, (toks, feats) in enumerate(zip(self.tokens, self.features)):
            m = len(toks)
            if m:
                ids[b, width - m:width] = torch.tensor(toks, device=self.device)
                valid[b, width - m:width] = True
                hidden[b, width - m:width] = self.model.fuse_features(torch.cat(feats)[None])[0]
        before = self.cache.live.clone()
        positions = before[:, None] + valid.long().cumsum(dim=1) - 1  # [B, n] live tokens before each
        positions = positions.clamp_min(0)
        index = torch.arange(n, device=self.device)
        sees = index[None, :] <= index[:, None]  # [n, n] causal among the new context slots
        sees[width:, width:] = True  # mask slots see each other (and every context slot before them)
        out = self.cache.tree_forward(ids, valid, positions, sees[None].expand(rows, n, n).contiguous(),
                                      hidden=hidden, mask_tokens=k)
        self.tokens, self.features = [[] for _ in range(rows)], [[] for _ in range(rows)]
        self._mark = before + valid[:, :width].sum(dim=1)  # the context slots; the mask slots go in ``follow``
        check_finite(out.logits, "drafter")
        drafted, probs = [], []
        for j in range(k):
            active = None if min(limits) > j else limit_t > j
            token, q = sampler.draft(out.logits[:, j], active)  # q [B, V] | None (greedy rows)
            drafted.append(token)
            probs.append(q)
        tokens = torch.stack(drafted, dim=1)
        lengths = torch.tensor(limits, dtype=torch.long, device=self.device)
        ended = tuple(ENDED_NONE if m == 0 else ENDED_LIMIT for m in limits)
        q = None if probs[0] is None else torch.stack(probs, dim=1)  # [B, k, V]
        proposal = Proposal(tokens, lengths, q, None, calls=1, ended=ended)
        self._drafts = proposal.knowing([row[:m] for row, m in zip(tokens.tolist(), limits)]).drafts()
        return proposal
