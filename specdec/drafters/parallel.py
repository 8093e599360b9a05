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

Token trees (``--tree N``, ``specdec.tree``): ``draft_tree`` runs the same one forward and takes the best N paths
through each mask slot's top candidates by product of probabilities (``best_paths``), chosen, not sampled (the
tree's q None: lossless); ``commit_tree`` is ``follow`` of the accepted path and the next token.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace

import torch

from specdec.drafters.base import ENDED_LIMIT, ENDED_NONE, Proposal, StopRule
from specdec.drafters.feature import FeatureDrafter
from specdec.drafters.parallel_model import ParallelDrafterModel, is_parallel_drafter
from specdec.sampling import Sampler, check_finite
from specdec.tree import Tree, TreeConfig


class ParallelDrafter(FeatureDrafter):
    """Drafts a block with a ``ParallelDrafterModel`` from the target's features (module docstring). Shares the
    feature drafter's bookkeeping (pending pairs, ``align``, ``follow``, ``select``); only ``propose`` differs."""

    accepts = staticmethod(is_parallel_drafter)
    kind = "a parallel drafter model"

    def __init__(self, model: ParallelDrafterModel, kernels: bool = True) -> None:
        super().__init__(model, kernels)
        self.block_size = model.config.block_size
        self.context_limit = None
        if (why := self.cache.tree_refusal()) is not None:
            raise TypeError(f"a parallel drafter needs a cache that takes a block's 4D mask: {why}")

    def _limits(self, limit: list[int]) -> list[int]:
        """Per row, the block it drafts: ``limit[b]`` within the block size, 0 for a row with no pair yet."""
        live = self.cache.live.tolist()
        ready = [bool(t) or have > 0 for t, have in zip(self.tokens, live)]  # a row with no pair drafts nothing yet
        return [min(n, self.block_size) if ok else 0 for n, ok in zip(limit, ready)]

    def _block(self, limits: list[int]) -> torch.Tensor:
        """ONE forward of every row's pending pairs and a block of ``limits[b]`` mask slots (module docstring): the
        mask slots' logits [B, k, V], k = max(limits) > 0 (a row's slots past its limit are dead: ignore them)."""
        rows, k = len(self.tokens), max(limits)
        width = max(len(t) for t in self.tokens)
        n = width + k
        ids = torch.zeros(rows, n, dtype=torch.long, device=self.device)
        valid = torch.zeros(rows, n, dtype=torch.bool, device=self.device)
        limit_t = torch.tensor(limits, device=self.device)
        # row b's block is its first limits[b] mask slots, the others dead: a row drafts as it would alone, whatever
        # the rows beside it ask for
        valid[:, width:] = torch.arange(k, device=self.device)[None, :] < limit_t[:, None]
        hidden = torch.zeros(rows, n, self.model.config.hidden_size, dtype=self.model.compute_dtype,
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
        return out.logits

    def propose(self, limit: torch.Tensor, sampler: Sampler, stop: StopRule | None = None) -> Proposal:
        rows = len(self.tokens)
        limits = self._limits(limit.tolist())
        k = max(limits, default=0)
        if k <= 0:
            self._drafts = [[] for _ in range(rows)]
            return Proposal.empty(rows, self.device)
        logits = self._block(limits)
        limit_t = torch.tensor(limits, device=self.device)
        drafted, probs = [], []
        for j in range(k):
            active = None if min(limits) > j else limit_t > j
            token, q = sampler.draft(logits[:, j], active)  # q [B, V] | None (greedy rows)
            drafted.append(token)
            probs.append(q)
        tokens = torch.stack(drafted, dim=1)
        lengths = torch.tensor(limits, dtype=torch.long, device=self.device)
        ended = tuple(ENDED_NONE if m == 0 else ENDED_LIMIT for m in limits)
        q = None if probs[0] is None else torch.stack(probs, dim=1)  # [B, k, V]
        proposal = Proposal(tokens, lengths, q, None, calls=1, ended=ended)
        self._drafts = proposal.knowing([row[:m] for row, m in zip(tokens.tolist(), limits)]).drafts()
        return proposal

    # ------------------------------------------------------------------------------------ token trees

    def draft_tree(self, depth: list[int], config: TreeConfig) -> Tree:
        """Each row's token tree from ONE forward (``specdec.tree``'s drafter hook): the best ``config.nodes`` paths
        of at most ``depth[b]`` (and the block size) tokens by the product of the block's probabilities, the
        candidates at each position its ``config.topk`` most probable tokens (``best_paths``). The candidates are
        chosen by rule, not sampled: the tree's q is None (one-hot candidates), which keeps sampling lossless."""
        rows = len(self.tokens)
        limits = self._limits(depth)
        self._drafts = [[] for _ in range(rows)]
        if max(limits, default=0) <= 0:
            return Tree.from_lists([[] for _ in range(rows)], self.device)
        logprobs = torch.log_softmax(self._block(limits).float(), dim=-1)
        values, tokens = logprobs.topk(min(config.topk, logprobs.shape[-1]), dim=-1)  # [B, k, c]
        nodes = [best_paths(v[:m].tolist(), t[:m].tolist(), config.nodes)
                 for v, t, m in zip(values, tokens, limits)]
        return replace(Tree.from_lists(nodes, self.device), calls=1)

    def commit_tree(self, tree: Tree, paths: list[list[int]], next_tokens: list[int]) -> None:
        """Commit each row's accepted ``paths`` (node numbers of ``tree``) and next token: the block's mask slots
        go, and the round's new features (the target's along the path) pair with the committed tokens."""
        tokens = tree.tokens.tolist()
        self.follow([[tokens[b][i - 1] for i in path] + [t] for b, (path, t) in enumerate(zip(paths, next_tokens))])


def best_paths(values: list[list[float]], tokens: list[list[int]], nodes: int) -> list[tuple[int, int]]:
    """The best ``nodes`` paths through a block's candidates as a tree: ``values[j][i]`` the log-probability of
    candidate ``tokens[j][i]`` at block position j (drawn independently of the earlier positions, as one forward's
    mask slots are), a path's score the sum along it (the product of probabilities). Returns (token, parent) nodes
    (parent 0 = the root, i = node i - 1), best first, parents before children.

    Best-first search: a path never outscores its prefix (log-probabilities are <= 0), so the best path not yet
    taken is always a child of one taken (or of the root), and taking paths from a heap of those children gives
    exactly the best ``nodes``, closed under prefixes. Ties go to the path pushed first (a parent before its
    children, candidates in rank order)."""
    heap = [(-v, i, 0, 0, i) for i, v in enumerate(values[0]) if v > -math.inf] if values else []
    # entries (-score, push order, parent, position j, rank i); a candidate of probability 0 is never a node
    heapq.heapify(heap)
    out: list[tuple[int, int]] = []
    pushed = len(heap)
    while heap and len(out) < nodes:
        negative, _, parent, j, i = heapq.heappop(heap)
        out.append((tokens[j][i], parent))
        if j + 1 < len(values):
            for c, v in enumerate(values[j + 1]):
                if v == -math.inf:
                    continue
                heapq.heappush(heap, (negative - v, pushed, len(out), j + 1, c))
                pushed += 1
    return out
