"""Verification rules: which drafted tokens the target keeps, as pure tensor functions.

A rule maps (a ``Proposal``: draft tokens [B, k] with per-row ``lengths`` [B] and drafter
probabilities q [B, k, V] or None; target logits [B, k+1, V]; the ``Sampler``) to a ``Verdict``: how
many drafts each row accepts (a prefix of its own ``lengths``) and the token that follows them: the
recovered token at the first rejection, or the bonus token when all of the row's drafts pass. Rows
are ragged: positions at or past a row's length are padding and never accepted. No model is called.

Rules are registered by name in ``RULES``, each declaring when it is lossless and which sampling it
fits; ``VerifyConfig.rule`` picks one (None: the one that fits each row's temperature):

- ``exact`` (temperature 0): accept while the draft equals argmax p; the next token is argmax p at
  the first mismatch (or after the last draft). Equals greedy decoding of the target.
- ``sampling`` (Leviathan et al. 2023, Chen et al. 2023; temperature > 0): accept x_i while
  r_i < p_i(x_i) / q_i(x_i), r_i ~ U(0, 1); at the first rejection sample from
  norm(max(0, p_i - q_i)); if all pass, sample the bonus token from p_{k+1}. A deterministic drafter
  (q None) is one-hot: x_i is accepted with probability p_i(x_i) and the residual is p_i with x_i
  removed. The output is distributed exactly as sampling from p.
- ``topk_tau`` (SpecDec, Xia et al. 2023; temperature 0 only): accept x_i while it is among the
  target's top-beta tokens and (top-1 logit - its logit) <= tau, on raw logits; the next token is
  argmax p at the first failure (or after the last draft). beta = 1 is ``exact`` (ties go to the
  lowest token id, as argmax breaks them); beta > 1 is an approximation of greedy decoding, reported
  ``lossless: false``. SpecDec's released setting is beta = 5, tau = 3.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.config import SamplingConfig, VerifyConfig
from specdec.drafters.base import Proposal
from specdec.sampling import Sampler


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one round, per row."""

    accepted: torch.Tensor  # [B] long, accepted drafts (a prefix of the row's draft)
    next_token: torch.Tensor  # [B] long, recovered (accepted < length) or bonus (accepted == length) token


RuleFn = Callable[[Proposal, torch.Tensor, Sampler, VerifyConfig], Verdict]


@dataclass(frozen=True)
class Rule:
    """A registered verification rule."""

    name: str
    fn: RuleFn  # (proposal, target logits [B, k+1, V], sampler, config) -> Verdict
    greedy: bool  # True: for temperature 0 rows only; False: for temperature > 0 rows only
    lossless: Callable[[VerifyConfig], bool]  # whether the output is exactly the target's (given the config)
    description: str  # one line for help texts


def _positions(proposal: Proposal) -> torch.Tensor:
    """[B, k] bool: the real (non-padding) draft positions of each row."""
    k = proposal.tokens.shape[1]
    return torch.arange(k, device=proposal.tokens.device)[None, :] < proposal.lengths[:, None]


def accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in each row of ``accept`` [B, k] -> [B]."""
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def exact_match(proposal: Proposal, logits: torch.Tensor, sampler: Sampler, config: VerifyConfig) -> Verdict:
    """Greedy verification; q and the sampler are unused (argmax needs no softmax)."""
    k = proposal.tokens.shape[1]
    if k == 0:  # nothing drafted (plain decoding): the target's argmax
        return Verdict(proposal.lengths, logits[:, 0].argmax(dim=-1))
    best = logits.argmax(dim=-1)  # [B, k+1]
    # the run of matches, cut at the row's length (a padding position may match by chance)
    n = torch.minimum(accepted_prefix(proposal.tokens == best[:, :k]), proposal.lengths)  # [B]
    return Verdict(n, best.gather(1, n[:, None]).squeeze(1))


def speculative_sampling(proposal: Proposal, logits: torch.Tensor, sampler: Sampler,
                         config: VerifyConfig) -> Verdict:
    """Lossless speculative sampling; ``proposal.q`` None means a one-hot (deterministic) drafter."""
    draft = proposal.tokens  # [B, k]
    batch, k = draft.shape
    p = sampler.probs(logits)  # [B, k+1, V]
    vocab = p.shape[-1]
    real = _positions(proposal)  # [B, k]
    q = proposal.q if proposal.q is not None else torch.nn.functional.one_hot(draft, vocab).to(p.dtype)
    q = q * real[..., None]  # [B, k, V]; padding positions have q = 0
    p_draft = p[:, :k].gather(-1, draft[..., None]).squeeze(-1)  # [B, k]
    q_draft = q.gather(-1, draft[..., None]).squeeze(-1)  # [B, k]
    r = sampler.uniform(proposal.lengths, k, p.device)  # [B, k]; a row draws one per draft it has
    n = accepted_prefix((r * q_draft < p_draft) & real)  # [B]; r < p/q without dividing
    # The distribution at position n: max(0, p_n - q_n), with q := 0 past the row's drafts (the bonus is p).
    q_pad = torch.cat([q, q.new_zeros(batch, 1, vocab)], dim=1)  # [B, k+1, V]
    row = n[:, None, None].expand(batch, 1, vocab)  # [B, 1, V]
    p_n = p.gather(1, row).squeeze(1)  # [B, V]
    residual = (p_n - q_pad.gather(1, row).squeeze(1)).clamp_min(0.0)  # [B, V]
    # A rejection where p == q up to rounding leaves (almost) nothing: fall back to p there.
    empty = residual.sum(dim=-1, keepdim=True) <= 1e-12  # [B, 1]
    residual = torch.where(empty, p_n, residual)
    return Verdict(n, sampler.sample(residual))


def top_beta_tau(proposal: Proposal, logits: torch.Tensor, sampler: Sampler, config: VerifyConfig) -> Verdict:
    """SpecDec's relaxed greedy verification; q and the sampler are unused."""
    draft = proposal.tokens  # [B, k]
    k = draft.shape[1]
    scores = logits[:, :k].float()  # [B, k, V]
    best = logits.argmax(dim=-1)  # [B, k+1]
    mine = scores.gather(-1, draft[..., None])  # [B, k, 1]
    ids = torch.arange(scores.shape[-1], device=scores.device)
    # the draft's rank in a stable descending sort: strictly higher logits, and equal ones with a lower id
    rank = ((scores > mine) | ((scores == mine) & (ids < draft[..., None]))).sum(dim=-1)  # [B, k]
    passes = rank < config.beta
    if config.tau is not None:
        passes &= (scores.max(dim=-1).values - mine.squeeze(-1)) <= config.tau
    n = accepted_prefix(passes & _positions(proposal))  # [B]
    return Verdict(n, best.gather(1, n[:, None]).squeeze(1))


RULES: dict[str, Rule] = {}


def register_rule(rule: Rule) -> None:
    """Make ``VerifyConfig(rule=rule.name)`` (and the CLI's ``--verify``) use ``rule``."""
    RULES[rule.name] = rule


register_rule(Rule("exact", exact_match, greedy=True, lossless=lambda c: True,
                   description="accept drafts equal to the target's argmax (greedy; token-identical)"))
register_rule(Rule("sampling", speculative_sampling, greedy=False, lossless=lambda c: True,
                   description="speculative sampling: accept with min(1, p/q), resample from max(0, p - q)"))


register_rule(Rule("topk_tau", top_beta_tau, greedy=True, lossless=lambda c: c.beta == 1,
                   description="SpecDec's top-beta/tau: accept drafts among the target's top-beta tokens within "
                               "tau of its top-1 logit (greedy; beta = 1 is exact)"))


def named_rule(name: str) -> Rule:
    """The registered rule ``name``; a clear error for an unknown one."""
    if name not in RULES:
        raise ValueError(f"unknown verification rule {name!r}: use one of {', '.join(sorted(RULES))}")
    return RULES[name]


def rule_for(config: VerifyConfig, greedy: bool) -> Rule:
    """The rule that verifies rows of this kind (greedy or sampled) under ``config``; clear errors."""
    if config.rule is None and config.relaxed:
        if not greedy:
            raise ValueError("beta/tau (SpecDec's top-beta/tau rule) is defined for greedy decoding only: use "
                             "temperature 0, or drop --beta/--tau to sample losslessly")
        return RULES["topk_tau"]
    if config.rule is None:
        return RULES["exact" if greedy else "sampling"]
    rule = named_rule(config.rule)
    if rule.greedy != greedy:
        fits = "temperature 0 (greedy)" if rule.greedy else "temperature > 0 (sampling)"
        raise ValueError(f"verification rule {rule.name!r} is defined for {fits} only: change the temperature "
                         f"or the rule (rules: {', '.join(sorted(RULES))})")
    return rule


class Verifier:
    """Applies the rule of each row (rows of a batch may differ in temperature) and merges the verdicts."""

    def __init__(self, config: VerifyConfig) -> None:
        if config.rule is not None:
            named_rule(config.rule)
        self.config = config
        self._known: tuple[list[SamplingConfig], list[Rule]] | None = None  # the last rows' configs and rules

    def rules(self, sampler: Sampler) -> list[Rule]:
        """The rule of each row (raises if a row's temperature does not fit the configured rule); the last
        answer again while the rows' configs are the same list (a batch's sampler, round after round)."""
        if self._known is None or self._known[0] is not sampler.configs:
            self._known = (sampler.configs, [rule_for(self.config, c.greedy) for c in sampler.configs])
        return self._known[1]

    def lossless(self, sampling: SamplingConfig) -> bool:
        """Whether a row sampled with ``sampling`` gets exactly the target's output (raises if the rule
        does not fit its temperature)."""
        return rule_for(self.config, sampling.greedy).lossless(self.config)

    def __call__(self, proposal: Proposal, logits: torch.Tensor, sampler: Sampler) -> Verdict:
        """Verify a round: logits [B, k+1, V] -> Verdict ([B], [B])."""
        rules = self.rules(sampler)
        if len(set(rules)) == 1:
            return rules[0].fn(proposal, logits, sampler, self.config)
        accepted = proposal.lengths.new_zeros(proposal.lengths.shape)
        next_token = proposal.lengths.new_zeros(proposal.lengths.shape)
        for rule in dict.fromkeys(rules):
            rows = torch.tensor([i for i, r in enumerate(rules) if r is rule], device=logits.device)
            verdict = rule.fn(proposal.select(rows), logits[rows], sampler.select(rows), self.config)
            accepted[rows], next_token[rows] = verdict.accepted, verdict.next_token
        return Verdict(accepted, next_token)
