"""Speculative sampling is lossless (issue 2, semantics 2, 5, 6).

1. The rule alone, batched: the first emitted token of a round is distributed as p_1, for a model
   drafter (q given) and a deterministic one (q None); a rule with the wrong residual is caught.
2. End to end: ``speculative_generate`` on a tiny vocabulary (8 tokens), 6,000 generations of 3
   tokens per case (24,000 in all), against the exact distribution of sampling from the target computed by enumeration
   (chi-square), for two (temperature, top-k, top-p) settings, with a model drafter and with
   prompt lookup; the plain loop too.
3. The same seed gives the same tokens.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import build_tiny, build_toy
from scipy.stats import chisquare

import specdec
from specdec.acceptance import Verdict, speculative_sampling
from specdec.config import SamplingConfig, VerifyConfig
from specdec.drafters import Proposal
from specdec.sampling import Sampler


def verify(draft: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, sampler: Sampler) -> Verdict:
    """The sampling rule on full-length drafts [B, k]."""
    lengths = torch.full((draft.shape[0],), draft.shape[1], dtype=torch.long)
    return speculative_sampling(Proposal(draft, lengths, q), logits, sampler, VerifyConfig())

SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 0.85)]  # (temperature, top_k, top_p)
P_MIN = 1e-3  # fixed seeds make these deterministic; a lossy rule lands far below


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, top-k, top-p written out independently of transformers: [V] -> [V]."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[: top_k or len(probs)]] = True
    probs = torch.where(keep, probs, 0.0)
    probs /= probs.sum()
    if top_p < 1.0:
        sorted_p = probs[order]
        before = sorted_p.cumsum(0) - sorted_p  # mass of strictly more probable tokens
        keep_sorted = before < top_p
        probs = torch.where(keep.clone().index_put_((order,), keep_sorted), probs, 0.0)
        probs /= probs.sum()
    return probs


def chi2_pvalue(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square p-value, cells with expected count < 5 merged; observed mass outside support fails."""
    n = counts.sum()
    expected = expected_probs * n
    assert counts[expected_probs == 0].sum() == 0, "a token outside the target's support was emitted"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # fold a tiny remainder into the smallest kept cell
        obs, exp = obs[:-1], exp[:-1]
        obs[-1] += counts[~big].sum()
        exp[-1] += expected[~big].sum()
    if len(obs) < 2:  # all mass on one cell: nothing to compare beyond the support check
        return 1.0
    exp *= obs.sum() / exp.sum()
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_rule_first_token_is_distributed_as_p(setting, deterministic):
    temperature, top_k, top_p = setting
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab = 200_000, 3, 8
    sampler = Sampler.create(SamplingConfig(temperature, top_k, top_p, seed=1), "cpu")
    target_logits = torch.randn(k + 1, vocab, generator=gen) * 2  # [k+1, V]
    q_one = sampler.probs(torch.randn(k, vocab, generator=gen) * 2)  # [k, V]
    if deterministic:
        ranked = sampler.probs(target_logits[:k]).argsort(-1, descending=True)  # [k, V]
        draft = torch.cat([ranked[:1, 0], ranked[1:, 1]]).expand(batch, k)  # [B, k] always the same draft
        q = None
    else:
        q = q_one.expand(batch, k, vocab)
        draft = torch.multinomial(q_one, batch, replacement=True, generator=gen).T  # [B, k]
    verdict = verify(draft, q, target_logits.expand(batch, k + 1, vocab), sampler)
    first = torch.where(verdict.accepted > 0, draft[:, 0], verdict.next_token)  # [B]
    counts = torch.bincount(first, minlength=vocab).numpy()
    exact = reference_probs(target_logits[0], temperature, top_k, top_p).numpy()
    assert chi2_pvalue(counts, exact) > P_MIN
    assert 0 < verdict.accepted.float().mean() < k  # both acceptances and rejections happen


def test_rule_with_a_wrong_residual_is_caught():
    """Power check: sampling the recovered token from p instead of max(0, p - q) is detected."""
    gen = torch.Generator().manual_seed(0)
    batch, vocab = 200_000, 8
    sampler = Sampler.create(SamplingConfig(1.0, seed=1), "cpu")
    logits = torch.randn(2, vocab, generator=gen) * 2
    q_one = torch.softmax(torch.randn(1, vocab, generator=gen) * 2, -1)
    draft = torch.multinomial(q_one, batch, replacement=True, generator=gen).T  # [B, 1]
    good = verify(draft, q_one.expand(batch, 1, vocab), logits.expand(batch, 2, vocab), sampler)
    p = sampler.probs(logits[0])
    wrong_next = torch.multinomial(p.expand(batch, vocab), 1, generator=gen).squeeze(-1)
    bad = Verdict(good.accepted, wrong_next)
    exact = reference_probs(logits[0], 1.0, 0, 1.0).numpy()
    for verdict, ok in ((good, True), (bad, False)):
        first = torch.where(verdict.accepted > 0, draft[:, 0], verdict.next_token)
        assert (chi2_pvalue(torch.bincount(first, minlength=vocab).numpy(), exact) > P_MIN) == ok


def exact_sequence_probs(target, prompt: list[int], n_new: int, setting) -> dict[tuple[int, ...], float]:
    """P(x_1..x_n) of sampling ``n_new`` tokens from ``target`` after ``prompt``, by enumeration."""
    vocab = target.config.vocab_size
    out: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(n_new):
            nxt = {}
            for seq, mass in out.items():
                if mass == 0:
                    continue
                logits = target(torch.tensor([prompt + list(seq)]), use_cache=False).logits[0, -1]
                probs = reference_probs(logits, *setting)
                for t in range(vocab):
                    nxt[seq + (t,)] = mass * float(probs[t])
            out = nxt
    return out


N_SAMPLES = 6_000  # per (drafter, setting): 24k end-to-end generations in all, plus 200k-row rule tests
TOY_PROMPT = [3, 4, 3, 5, 3]  # repeats give prompt lookup something to propose


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafter_kind", ["model", "ngram", "lookup+model"])
def test_end_to_end_distribution_matches_target_sampling(setting, drafter_kind):
    temperature, top_k, top_p = setting
    target = build_toy(vocab_size=8, seed=0, scale=0.8)
    toy = build_toy(vocab_size=8, seed=1, scale=0.8)
    # lookup+model: 1-token matches, so that lookup fires in this tiny vocabulary, and drafts of up to 3
    # copied tokens, more than gamma and more than the room left (cut by the round)
    lookup = specdec.LookupDrafter(toy, specdec.NgramConfig(min_ngram=1, num_tokens=3))
    drafter = {"model": toy, "ngram": "ngram", "lookup+model": lookup}[drafter_kind]
    # lookup+model: the prompt's last token is new, so round 1 is the model's and later rounds mix
    prompt = [3, 4, 3, 6] if drafter_kind == "lookup+model" else TOY_PROMPT
    n_new = 3
    exact = exact_sequence_probs(target, prompt, n_new, setting)
    index = {seq: i for i, seq in enumerate(itertools.product(range(8), repeat=n_new))}
    counts = np.zeros(len(index), dtype=np.int64)
    torch.manual_seed(1234)  # seed=None draws each call's generator seed from torch's global RNG
    rounds = accepted = drafted = calls = 0
    for _ in range(N_SAMPLES):
        res = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=n_new, gamma=2,
                                           temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=[])
        counts[index[tuple(res.tokens)]] += 1
        rounds += res.stats.rounds
        accepted += res.stats.accepted
        drafted += res.stats.drafted
        calls += res.stats.drafter_calls - 1  # minus the prefill
    assert 0 < drafted and accepted < drafted  # drafts were verified, and some rejected
    if drafter_kind != "ngram":
        assert accepted > 0
    if drafter_kind == "lookup+model":
        assert 0 < calls < drafted  # both the model and lookup proposed
    assert chi2_pvalue(counts, np.array([exact.get(s, 0.0) for s in index])) > P_MIN


def test_plain_loop_distribution_matches_target_sampling():
    setting = SETTINGS[1]
    target = build_toy(vocab_size=8, seed=0, scale=0.8)
    exact = exact_sequence_probs(target, TOY_PROMPT, 2, setting)
    index = {seq: i for i, seq in enumerate(itertools.product(range(8), repeat=2))}
    counts = np.zeros(len(index), dtype=np.int64)
    for seed in range(6_000):
        res = specdec.autoregressive_generate(target, TOY_PROMPT, max_new_tokens=2, temperature=setting[0],
                                              top_k=setting[1], top_p=setting[2], seed=seed, stop_token_ids=[])
        counts[index[tuple(res.tokens)]] += 1
    assert chi2_pvalue(counts, np.array([exact.get(s, 0.0) for s in index])) > P_MIN


@pytest.mark.parametrize("drafter_kind", ["model", "ngram", "lookup+model"])
def test_same_seed_same_tokens(drafter_kind):
    target = build_tiny("llama", seed=0)
    small = build_tiny("llama", seed=3, layers=1)
    drafter = {"model": small, "ngram": "ngram", "lookup+model": specdec.LookupDrafter(small)}[drafter_kind]
    kwargs = {"max_new_tokens": 30, "gamma": 3, "temperature": 0.9, "top_k": 20, "top_p": 0.95, "stop_token_ids": []}
    runs = [specdec.speculative_generate(target, drafter, [1, 5, 6, 1, 5], seed=s, **kwargs).tokens
            for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    plain_kwargs = {k: v for k, v in kwargs.items() if k != "gamma"}
    plain = [specdec.autoregressive_generate(target, [1, 5, 6], seed=7, **plain_kwargs).tokens for _ in range(2)]
    assert plain[0] == plain[1]
