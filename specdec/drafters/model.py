"""A small causal LM as drafter (Leviathan et al. 2023; Chen et al. 2023).

Contract: the drafter keeps its own KV cache across rounds and feeds the model only tokens it
has not seen. Between rounds it holds ``pending`` tokens, committed but not yet in its cache: the
newest committed token, plus, after a round whose drafts were all accepted, the last draft token
(never forwarded, since its successor came from the target). ``propose`` forwards the pending
tokens in the same call that yields the first draft, so the catch-up costs no extra forward and
never re-reads the prefix. Invariant after every commit: cache length + pending == committed.

Logits are aligned to the target's vocabulary (sliced if the drafter's embedding is padded larger,
padded with -inf if smaller) before the sampler's warpers, so q and p share one index space. A
drafter with fewer rows than the target reads a committed token it has no row for (the target's
padding) as its last row: its drafts may suffer, verification keeps the output exact.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.cache import KVCache
from specdec.drafters.base import Proposal
from specdec.loading import context_limit, input_device
from specdec.loading import vocab_size as logits_size
from specdec.sampling import Sampler, check_finite

# Vocabularies of different sizes are taken as one vocabulary with padding when they differ by at
# most this many rows (padding to a multiple of 64 or 128 adds fewer), unless a tokenizer shows more.
PADDING_TOLERANCE = 256


def _bos_id(model: PreTrainedModel) -> object:
    """The beginning-of-sequence id(s) a model's config declares, or None."""
    return getattr(model.config.get_text_config(), "bos_token_id", None)


def check_vocabularies(
    target: PreTrainedModel, drafter: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None
) -> None:
    """Refuse a drafter whose vocabulary is not the target's (padding aside), with a clear ValueError.

    Compared: the tokens both can emit. With a tokenizer, both models must cover all of its tokens;
    without one, the sizes may differ only by padding (``PADDING_TOLERANCE``). Declared bos ids must
    agree (eos ids may differ legitimately, e.g. a base model and its chat variant).
    """
    v_target, v_drafter = logits_size(target), logits_size(drafter)
    fix = "use a drafter trained with the target's tokenizer"
    if tokenizer is not None:
        n = len(tokenizer)
        for who, v in (("target", v_target), ("drafter", v_drafter)):
            if v < n:
                raise ValueError(f"the tokenizer has {n} tokens but the {who} emits only {v}: {fix}")
    elif abs(v_target - v_drafter) > PADDING_TOLERANCE:
        raise ValueError(
            f"drafter vocabulary ({v_drafter} tokens) differs from the target's ({v_target}) by more than "
            f"padding: {fix} (or pass tokenizer= to check the shared tokens)"
        )
    t_bos, d_bos = _bos_id(target), _bos_id(drafter)
    if t_bos is not None and d_bos is not None and t_bos != d_bos:
        raise ValueError(f"drafter and target disagree on bos_token_id ({d_bos} vs {t_bos}): {fix}")


class ModelDrafter:
    """Drafts with a causal LM and its KV cache; q is the warped drafter distribution."""

    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None) -> None:
        self.model = model.eval()
        self.vocab_size = vocab_size  # the target's logits size; None = the drafter's own
        self.own_vocab_size = logits_size(model)  # rows of the drafter's own embedding
        self.context_limit = context_limit(model)
        self.device = input_device(model)
        self.cache: KVCache | None = None
        self.pending: torch.Tensor | None = None  # [1, m] committed tokens not yet in the cache
        self._draft: torch.Tensor | None = None  # [1, k] the last proposal

    def align(self, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None) -> ModelDrafter:
        """Check the drafter against ``target`` (vocabulary, device) and adopt its vocabulary size."""
        check_vocabularies(target, self.model, tokenizer)
        target_device = input_device(target)
        if self.device != target_device:
            raise ValueError(
                f"drafter is on {self.device} but the target is on {target_device}: "
                f"move it with drafter.to({str(target_device)!r})"
            )
        self.vocab_size = logits_size(target)
        return self

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter logits [1, V_d] -> [1, V] in the target's vocabulary."""
        if self.vocab_size is None or logits.shape[-1] == self.vocab_size:
            return logits
        if logits.shape[-1] > self.vocab_size:
            return logits[..., : self.vocab_size]
        pad = logits.new_full((*logits.shape[:-1], self.vocab_size - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def _step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Forward ``input_ids`` [1, n] -> aligned logits of the last position [1, V]; checks finiteness."""
        if self.vocab_size is not None and self.own_vocab_size < self.vocab_size:
            input_ids = input_ids.clamp(max=self.own_vocab_size - 1)  # tokens it has no row for
        logits = self.cache.forward(input_ids)[:, -1]  # [1, V_d]
        check_finite(logits, "drafter")
        return self._aligned(logits)

    def prefill(self, input_ids: torch.Tensor) -> int:
        """Cache the prompt [1, T] except its last token, which stays pending."""
        self.cache = KVCache(self.model)
        self.pending = input_ids[:, -1:]
        if input_ids.shape[1] > 1:
            self.cache.forward(input_ids[:, :-1])
            return 1
        return 0

    def propose(self, k: int, sampler: Sampler) -> Proposal:
        """Draft ``k`` tokens autoregressively: k forwards, the first also catching up on pending."""
        if k == 0:
            self._draft = self.pending[:, :0]
            return Proposal(self._draft, None, 0)
        tokens, probs = [], []
        logits = self._step(self.pending)  # [1, V]
        for i in range(k):
            if sampler.greedy:
                token = logits.argmax(dim=-1, keepdim=True)  # [1, 1]
            else:
                q = sampler.probs(logits)  # [1, V]
                token = sampler.sample(q)[:, None]  # [1, 1]
                probs.append(q)
            tokens.append(token)
            if i < k - 1:
                logits = self._step(token)
        self._draft = torch.cat(tokens, dim=1)  # [1, k]
        q_all = torch.stack(probs, dim=1) if probs else None  # [1, k, V]
        return Proposal(self._draft, q_all, k)

    def follow(self, tokens: list[int]) -> None:
        """Take ``tokens`` committed without this drafter's proposal (another drafter's round)."""
        new = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, m]
        self.pending = torch.cat([self.pending, new], dim=1)

    def commit(self, n_accepted: int, next_token: int) -> None:
        """Roll the cache back to the accepted drafts; pending becomes what the cache lacks."""
        k = self._draft.shape[1]
        nxt = torch.tensor([[next_token]], dtype=torch.long, device=self.device)  # [1, 1]
        if k == 0:
            self.pending = torch.cat([self.pending, nxt], dim=1)
        elif n_accepted < k:
            # The cache holds the round's start (committed - pending), pending, then drafts 1..k-1.
            self.cache.crop_to(self.cache.length - (k - 1) + n_accepted)
            self.pending = nxt
        else:
            self.pending = torch.cat([self._draft[:, -1:], nxt], dim=1)
