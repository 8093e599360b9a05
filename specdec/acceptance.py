"""Verification rules: which drafted tokens the target keeps, as pure tensor functions.

A rule maps (draft tokens [B, k], drafter probabilities q [B, k, V] or None, target logits
[B, k+1, V], sampler) to a ``Verdict``: how many drafts are accepted (a prefix) and the token
that follows them: the recovered token at the first rejection or the bonus token when all pass.
No model is called here.

- ``greedy_match`` (temperature 0): accept while the draft equals argmax p; the next token is
  argmax p at the first mismatch (or after the last draft). Equals greedy decoding of the target.
- ``speculative_sampling`` (Leviathan et al. 2023, Chen et al. 2023): accept x_i while
  r_i < p_i(x_i) / q_i(x_i), r_i ~ U(0, 1); at the first rejection sample from
  norm(max(0, p_i - q_i)); if all pass, sample the bonus token from p_{k+1}. A deterministic
  drafter (q None) is one-hot: x_i is accepted with probability p_i(x_i) and the residual is p_i
  with x_i removed. The output is distributed exactly as sampling from p.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.sampling import Sampler


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one round."""

    n_accepted: torch.Tensor  # [B] long, accepted drafts (a prefix of the draft)
    next_token: torch.Tensor  # [B] long, recovered (n_accepted < k) or bonus (n_accepted == k) token


Rule = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, Sampler], Verdict]


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in each row of ``accept`` [B, k] -> [B]."""
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def greedy_match(draft: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, sampler: Sampler) -> Verdict:
    """Greedy verification; ``q`` and ``sampler`` are unused (argmax needs no softmax)."""
    k = draft.shape[1]
    best = logits.argmax(dim=-1)  # [B, k+1]
    n = _accepted_prefix(draft == best[:, :k])  # [B]
    return Verdict(n, best.gather(1, n[:, None]).squeeze(1))


def speculative_sampling(
    draft: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, sampler: Sampler
) -> Verdict:
    """Lossless speculative sampling; ``q`` None means a one-hot (deterministic) drafter."""
    batch, k = draft.shape
    p = sampler.probs(logits)  # [B, k+1, V]
    vocab = p.shape[-1]
    if q is None:
        q = torch.nn.functional.one_hot(draft, vocab).to(p.dtype)  # [B, k, V]
    p_draft = p[:, :k].gather(-1, draft[..., None]).squeeze(-1)  # [B, k]
    q_draft = q.gather(-1, draft[..., None]).squeeze(-1)  # [B, k]
    r = torch.rand(batch, k, generator=sampler.generator, device=p.device)  # [B, k]
    n = _accepted_prefix(r * q_draft < p_draft)  # [B]; r < p/q without dividing
    # The distribution at position n: max(0, p_n - q_n), with q_{k+1} := 0 so the bonus is p_{k+1}.
    q_pad = torch.cat([q, q.new_zeros(batch, 1, vocab)], dim=1)  # [B, k+1, V]
    row = n[:, None, None].expand(batch, 1, vocab)  # [B, 1, V]
    p_n = p.gather(1, row).squeeze(1)  # [B, V]
    residual = (p_n - q_pad.gather(1, row).squeeze(1)).clamp_min(0.0)  # [B, V]
    # A rejection where p == q up to rounding leaves (almost) nothing: fall back to p there.
    empty = residual.sum(dim=-1, keepdim=True) <= 1e-12  # [B, 1]
    residual = torch.where(empty, p_n, residual)
    return Verdict(n, sampler.sample(residual))


# The rule used for each sampling mode; new rules (e.g. top-beta/tau) register here.
RULES: dict[str, Rule] = {"greedy": greedy_match, "sampling": speculative_sampling}


def rule_for(sampler: Sampler) -> Rule:
    """The verification rule matching ``sampler`` (greedy or sampling)."""
    return RULES["greedy" if sampler.greedy else "sampling"]
