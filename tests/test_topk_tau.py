"""SpecDec's top-beta/tau verification rule: against a plain-Python reference, beta = 1 against exact
verification, end to end against the target's own logits, and its refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec
from specdec.acceptance import exact_match, rule_for, top_beta_tau
from specdec.config import SamplingConfig, VerifyConfig
from specdec.drafters.base import Proposal
from specdec.sampling import Sampler


def reference_verdict(draft: list[int], logits: list[list[float]], beta: int, tau: float | None) -> tuple[int, int]:
    """One row by hand: ranks from a stable descending sort, the gap to the top-1 logit."""
    n = 0
    for i, token in enumerate(draft):
        order = sorted(range(len(logits[i])), key=lambda t: (-logits[i][t], t))
        gap = max(logits[i]) - logits[i][token]
        if order.index(token) >= beta or (tau is not None and gap > tau):
            break
        n += 1
    best = min(range(len(logits[n])), key=lambda t: (-logits[n][t], t))
    return n, best


@st.composite
def rounds(draw):
    batch, k, vocab = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(2, 9))
    # logits on a coarse grid so that ties occur often
    logits = draw(st.lists(st.integers(-3, 3), min_size=batch * (k + 1) * vocab, max_size=batch * (k + 1) * vocab))
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=batch * k, max_size=batch * k))
    lengths = draw(st.lists(st.integers(0, k), min_size=batch, max_size=batch))
    beta = draw(st.integers(1, vocab))
    tau = draw(st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0, 2.5])))
    return (torch.tensor(logits, dtype=torch.float).reshape(batch, k + 1, vocab) / 2,
            torch.tensor(tokens).reshape(batch, k), torch.tensor(lengths), beta, tau)


@settings(max_examples=150, deadline=None)
@given(rounds())
def test_rule_matches_a_plain_python_reference(case):
    logits, tokens, lengths, beta, tau = case
    proposal = Proposal(tokens=tokens, lengths=lengths)
    sampler = Sampler.create(SamplingConfig(), "cpu", rows=len(lengths))
    verdict = top_beta_tau(proposal, logits, sampler, VerifyConfig(rule="topk_tau", beta=beta, tau=tau))
    for b in range(len(lengths)):
        length = int(lengths[b])
        expected = reference_verdict(tokens[b, :length].tolist(), logits[b].tolist(), beta, tau)
        assert (int(verdict.accepted[b]), int(verdict.next_token[b])) == expected


@settings(max_examples=100, deadline=None)
@given(rounds())
def test_beta_one_is_exact_verification_ties_included(case):
    logits, tokens, lengths, _, tau = case
    proposal = Proposal(tokens=tokens, lengths=lengths)
    sampler = Sampler.create(SamplingConfig(), "cpu", rows=len(lengths))
    relaxed = top_beta_tau(proposal, logits, sampler, VerifyConfig(rule="topk_tau", beta=1, tau=tau))
    exact = exact_match(proposal, logits, sampler, VerifyConfig())
    assert torch.equal(relaxed.accepted, exact.accepted) and torch.equal(relaxed.next_token, exact.next_token)


def teacher_forced_logits(target, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: the target's logits before each generated token."""
    with torch.no_grad():
        out = target(torch.tensor([prompt + tokens])).logits[0]
    return out[len(prompt) - 1: len(prompt) - 1 + len(tokens)].float()


def test_every_kept_token_is_within_beta_and_tau_of_the_target(llama_target, llama_wild_drafter):
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5], [11, 12]]
    beta, tau = 5, 3.0
    results = specdec.speculative_generate(llama_target, llama_wild_drafter, prompts, max_new_tokens=24, gamma=4,
                                           stop_token_ids=[], verify=VerifyConfig(beta=beta, tau=tau))
    exact = specdec.speculative_generate(llama_target, llama_wild_drafter, prompts, max_new_tokens=24, gamma=4,
                                         stop_token_ids=[])
    relaxed_tokens = 0
    for prompt, res, ref in zip(prompts, results, exact):
        assert res.stats.lossless is False and ref.stats.lossless is True
        assert len(res.tokens) == 24
        logits = teacher_forced_logits(llama_target, prompt, res.tokens)
        for i, token in enumerate(res.tokens):
            rank = int((logits[i] > logits[i, token]).sum())
            assert rank < beta and float(logits[i].max() - logits[i, token]) <= tau
            relaxed_tokens += int(token != int(logits[i].argmax()))
        assert res.stats.acceptance_rate >= 0.0
    # the wild drafter is rarely the target's argmax, but often in its top 5 within 3 logits
    assert relaxed_tokens > 0
    assert sum(r.stats.mean_accepted_length for r in results) > sum(r.stats.mean_accepted_length for r in exact)


def test_beta_one_reproduces_greedy(llama_target, llama_drafter):
    prompt = [5, 6, 7, 8]
    res = specdec.speculative_generate(llama_target, llama_drafter, prompt, max_new_tokens=20, gamma=3,
                                       stop_token_ids=[], verify=VerifyConfig(rule="topk_tau", beta=1, tau=3.0))
    assert res.stats.lossless is True
    assert res.tokens == hf_greedy(llama_target, prompt, 20, [])


@pytest.mark.parametrize("kwargs, message", [
    ({"beta": 0}, "beta must be an int >= 1"),
    ({"tau": -1.0}, "tau must be a number >= 0"),
    ({"rule": "exact", "beta": 5}, "beta and tau belong to the topk_tau rule"),
])
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VerifyConfig(**kwargs)


def test_relaxed_rule_with_sampling_is_refused(llama_target, llama_drafter):
    with pytest.raises(ValueError, match="greedy decoding only"):
        rule_for(VerifyConfig(beta=5), greedy=False)
    with pytest.raises(ValueError, match="temperature 0"):
        specdec.speculative_generate(llama_target, llama_drafter, [3, 4], max_new_tokens=4, temperature=1.0,
                                     verify="topk_tau")
