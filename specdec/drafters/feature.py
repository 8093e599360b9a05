"""The feature drafter (EAGLE-3 style, ``specdec.drafters.feature_model``) behind the ``Drafter`` contract.

Contract: ``FeatureDrafter(model)`` drafts for the target it is aligned to: ``align`` binds the model to the
target's embedding and LM head (refusing another target in one line) and asks the target for the features of
the model's layers (``Target.want_features``: the verify and prefill forwards log them, no second pass).
Per row the drafter holds a ``RaggedCache`` of slots (f_p, x_{p+1}) and ``pending`` pairs not yet forwarded:

- ``prefill``: each new row's features f_0 .. f_{T-2} (``Target.take_features``) pair with x_1 .. x_{T-1}; they
  wait, pending, for the first ``propose``;
- ``propose``: one forward of every row's pending pairs (left-padded; the catch-up costs no extra call), whose
  last slot (f_{N-2}, x_{N-1}) predicts x_N: the first draft; each later draft is one forward of (the previous
  step's output hidden state, the previous draft) at the next position;
- ``commit`` / ``follow``: the cache drops every drafted slot (they read the drafter's own hidden states, not
  the target's) and the round's new features (one per committed token) pair with the committed tokens, pending.

Invariant after every commit, per row: cached slots + pending pairs == committed tokens - 1 (a one-token prompt
has no pair: that row drafts nothing until its first round has committed). The target drops the features of
rejected positions with their cache entries, so ragged rows, rows leaving (``select``) and rows joining
(``prefill``) follow the target's own rules.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from specdec.batch import PromptBatch
from specdec.cache import RaggedCache
from specdec.drafters.base import ENDED_LIMIT, ENDED_NONE, FollowingDrafter, Proposal, StopRule
from specdec.drafters.feature_model import FeatureDrafterModel, is_feature_drafter
from specdec.features import drafter_layers
from specdec.fingerprint import fingerprint
from specdec.kernels import install
from specdec.sampling import Sampler, check_finite


class FeatureDrafter(FollowingDrafter):
    """Drafts with a ``FeatureDrafterModel`` from the target's features (module docstring)."""

    accepts = staticmethod(is_feature_drafter)  # the models it drafts with
    kind = "a feature drafter model"

    def __init__(self, model: FeatureDrafterModel, kernels: bool = True) -> None:
        if not self.accepts(model):
            raise TypeError(f"{type(self).__name__} drafts with {self.kind}, not {type(model).__name__}")
        self.model = model.eval()
        self.device = next(model.parameters()).device
        if kernels:
            install(model)  # its own linear layers' fast kernels while specdec decodes, as a draft model's (kernels)
        self.context_limit = (model.config.target_config or {}).get("max_position_embeddings")
        self.target = None
        self.vocab_size: int | None = None
        self.reset()

    def _cache(self) -> RaggedCache:
        from transformers import DynamicCache

        return RaggedCache(self.model, 0, self.device, cache=DynamicCache())

    def reset(self) -> None:
        self.cache = self._cache()
        self.tokens: list[list[int]] = []  # per row: pending tokens x_{p+1}
        self.features: list[list[torch.Tensor]] = []  # per row: their features f_p, [n, F] pieces
        self._drafts: list[list[int]] = []
        self._mark: torch.Tensor | None = None  # [B] live slots before this round's drafted ones

    def align(self, target, tokenizer: PreTrainedTokenizerBase | None = None) -> FeatureDrafter:
        """Bind the model to ``target`` (refused in one line when made for another) and ask it for the features."""
        print_ = fingerprint(target.model.config, tokenizer) if tokenizer is not None else None
        self.model.bind(target.model, print_, name=getattr(target.model, "name_or_path", "") or "this target")
        target.want_features(drafter_layers(self.model.config))  # hidden_states indices
        self.target = target
        self.vocab_size = target.vocab_size
        return self

    def last_drafts(self) -> list[list[int]]:
        return self._drafts

    def _take(self, tokens: list[list[int]]) -> None:
        """Pair the features the target logged since the last take with the rows' newest ``tokens``."""
        features, lengths = self.target.take_features()  # [B, n, F], [B]
        for b, (row, n) in enumerate(zip(tokens, lengths.tolist())):
            if n:
                self.tokens[b] += row[len(row) - n:]
                self.features[b].append(features[b, :n].to(self.device))

    def prefill(self, prompts: PromptBatch) -> int:
        rows = prompts.rows()
        self.cache.merge(self._fresh(len(rows)))
        self.tokens += [[] for _ in rows]
        self.features += [[] for _ in rows]
        self._drafts = self._drafts + [[] for _ in rows]
        self._take([[] for _ in range(len(self.tokens) - len(rows))] + rows)
        return 0

    def _fresh(self, rows: int) -> RaggedCache:
        cache = self._cache()
        cache.mask = torch.zeros(rows, 0, dtype=torch.bool, device=self.device)
        cache.live = torch.zeros(rows, dtype=torch.long, device=self.device)
        return cache

    def propose(self, limit: torch.Tensor, sampler: Sampler, stop: StopRule | None = None) -> Proposal:
        rows = len(self.tokens)
        ready = [bool(t) for t in self.tokens]  # a row with no pair (a one-token prompt) drafts nothing yet
        limits = [n if ok else 0 for n, ok in zip(limit.tolist(), ready)]
        steps = max(limits, default=0)
        if steps <= 0:
            self._drafts = [[] for _ in range(rows)]
            return Proposal.empty(rows, self.device)
        logits, state = self.catch_up()
        state = state[:, None]
        limit_t = torch.tensor(limits, device=self.device)
        drafted, probs = [], []
        for i in range(steps):
            check_finite(logits, "drafter")
            active = None if min(limits) > i else limit_t > i
            token, q = sampler.draft(logits, active)  # q [B, V] | None (greedy rows)
            drafted.append(token)
            probs.append(q)
            if i == steps - 1:
                break
            fits = self._fits(i)
            out = self.cache.forward(token[:, None], fits, hidden=state)
            logits, state = out.logits[:, -1], out.hidden[:, -1:]
        tokens = torch.stack(drafted, dim=1)
        lengths = torch.tensor(limits, dtype=torch.long, device=self.device)
        ended = tuple(ENDED_NONE if n == 0 else ENDED_LIMIT for n in limits)
        q = None if probs[0] is None else torch.stack(probs, dim=1)  # [B, k, V]
        proposal = Proposal(tokens, lengths, q, None, calls=len(drafted), ended=ended)
        self._drafts = proposal.knowing([row[:n] for row, n in zip(tokens.tolist(), limits)]).drafts()
        return proposal

    def catch_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of every row's pending pairs (left-padded; a row with none has only dead slots), which empties
        them and marks the live slots (``_mark``: what ``follow`` keeps): the last slot's (logits [B, V], output hidden
        state [B, H]), the first draft's distribution and the state its next step reads. At least one row has a
        pending pair (``propose`` and ``specdec.tree.draft_tree`` call it only then)."""
        rows = len(self.tokens)
        width = max(len(t) for t in self.tokens)
        ids = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        hidden = None
        valid = torch.zeros(rows, width, dtype=torch.bool, device=self.device)
        fused = []
        for b, (toks, feats) in enumerate(zip(self.tokens, self.features)):
            n = len(toks)
            if n:
                ids[b, width - n:] = torch.tensor(toks, device=self.device)
                valid[b, width - n:] = True
                fused.append((b, n, self.model.fuse_features(torch.cat(feats)[None])[0]))
        for b, n, f in fused:
            if hidden is None:
                hidden = f.new_zeros(rows, width, f.shape[-1])
            hidden[b, width - n:] = f
        out = self.cache.forward(ids, None if bool(valid.all()) else valid, hidden=hidden)
        self.tokens, self.features = [[] for _ in range(rows)], [[] for _ in range(rows)]
        self._mark = self.cache.live.clone()
        return out.logits[:, -1], out.hidden[:, -1]

    def _fits(self, offset: int) -> torch.Tensor | None:
        """[B, 1] bool: whether the draft step ``offset`` still has a position in the drafter's context (None: all)."""
        if self.context_limit is None:
            return None
        live = self.cache.live
        if int(live.max()) + 1 < self.context_limit:
            return None
        return (live < self.context_limit)[:, None]

    def follow(self, tokens: list[list[int]]) -> None:
        """Drop the drafted slots; the round's new features pair with the committed ``tokens``."""
        if self._mark is not None:
            self.cache.keep(self._mark)
            self._mark = None
        self._take(tokens)

    def select(self, rows: torch.Tensor) -> None:
        index = rows.tolist()
        self.cache.select(rows.to(self.device))
        self.tokens = [self.tokens[i] for i in index]
        self.features = [self.features[i] for i in index]
        self._drafts = [self._drafts[i] for i in index]
        if self._mark is not None:
            self._mark = self._mark[rows.to(self._mark.device)]
