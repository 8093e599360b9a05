"""Greedy speculative decoding equals the target's own greedy decoding (issue 2, semantics 1, 4, 6).

Compared against ``target.generate(do_sample=False)`` on tiny models of three architectures
(plus GPT-NeoX), many prompts (hypothesis), gammas 1..8, a drafter that agrees often (a truncated
copy), one that disagrees almost always (independent random weights), the target itself as
drafter (everything accepted), prompt lookup, and stop tokens that end the output early. A
divergence passes only at a near tie of the target's top-2 logits, recomputed without a cache.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_greedy, build_tiny, hf_greedy, top2_gap, truncated_copy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specdec
from specdec.batch import PromptBatch

PAIRS: dict[str, tuple] = {}


def pair(arch: str):
    """(target, agreeing drafter, disagreeing drafter) of ``arch``, built once."""
    if arch not in PAIRS:
        target = build_tiny(arch, seed=0)
        PAIRS[arch] = (target, truncated_copy(target, 1), build_tiny(arch, seed=7, layers=1, hidden=16))
    return PAIRS[arch]


prompts = st.lists(st.integers(3, 95), min_size=1, max_size=12)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "gpt_neox"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=prompts, gamma=st.integers(1, 8),
       which=st.sampled_from(["agree", "wild", "self", "ngram", "lookup+agree", "lookup+wild"]))
def test_greedy_equals_target_generate(arch, prompt, gamma, which):
    target, agree, wild = pair(arch)
    drafter = {"agree": agree, "wild": wild, "self": target, "ngram": "ngram",
               "lookup+agree": specdec.LookupDrafter(agree), "lookup+wild": specdec.LookupDrafter(wild)}[which]
    reference = hf_greedy(target, prompt, 24, [])
    res = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=24, gamma=gamma, stop_token_ids=[])
    assert_same_greedy(target, prompt, res.tokens, reference)
    assert res.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("gamma", range(1, 9))
def test_greedy_every_gamma_and_plain_loop(gamma):
    target, agree, _ = pair("llama")
    prompt = [5, 17, 33, 5, 17]
    reference = hf_greedy(target, prompt, 40, [])
    for drafter in (agree, target):
        res = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=40, gamma=gamma, stop_token_ids=[])
        assert_same_greedy(target, prompt, res.tokens, reference)
    assert_same_greedy(target, prompt, specdec.autoregressive_generate(
        target, prompt, max_new_tokens=40, stop_token_ids=[]).tokens, reference)


def test_full_acceptance_with_the_target_as_drafter():
    target, _, _ = pair("gpt2")
    res = specdec.speculative_generate(target, target, [3, 4, 5], max_new_tokens=30, gamma=4, stop_token_ids=[])
    assert res.stats.acceptance_rate == 1.0
    assert res.stats.mean_accepted_length == 5.0
    assert res.stats.accepted_per_position == [6, 6, 6, 6]


def test_wild_drafter_is_mostly_rejected_yet_exact():
    target, _, wild = pair("qwen2")
    prompt = [9, 8, 7]
    res = specdec.speculative_generate(target, wild, prompt, max_new_tokens=30, gamma=6, stop_token_ids=[])
    assert res.stats.acceptance_rate < 0.3
    assert_same_greedy(target, prompt, res.tokens, hf_greedy(target, prompt, 30, []))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("drafter_kind", ["self", "agree", "ngram"])
def test_stop_token_ends_output_early_even_inside_accepted_drafts(arch, drafter_kind):
    target, agree, _ = pair(arch)
    prompt = [11, 12, 13, 11, 12]
    free = hf_greedy(target, prompt, 30, [])
    stop = free[6]  # a token the target emits at step 6 (maybe earlier too)
    reference = hf_greedy(target, prompt, 30, [stop])
    assert reference[-1] == stop and len(reference) <= 7
    drafter = {"self": target, "agree": agree, "ngram": "ngram"}[drafter_kind]
    for gamma in (1, 3, 8):
        res = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=30, gamma=gamma,
                                           stop_token_ids=[stop])
        assert res.tokens == reference
        assert res.stop_reason == "stop_token"
    if drafter_kind == "self":  # with the target drafting, the stop token sits inside an accepted draft
        res = specdec.speculative_generate(target, target, prompt, max_new_tokens=30, gamma=8, stop_token_ids=[stop])
        assert res.stats.rounds == 1 and res.stats.accepted >= len(reference) - 1


def test_default_stop_token_is_the_targets_eos():
    target, agree, _ = pair("llama")
    prompt = [40, 41, 42]
    stop = hf_greedy(target, prompt, 12, [])[4]
    target.generation_config.eos_token_id = stop
    try:
        res = specdec.speculative_generate(target, agree, prompt, max_new_tokens=12)
        plain = specdec.autoregressive_generate(target, prompt, max_new_tokens=12)
        assert res.tokens[-1] == stop and res.tokens == plain.tokens and res.stop_reason == "stop_token"
        assert len(specdec.speculative_generate(target, agree, prompt, max_new_tokens=12,
                                                stop_token_ids=[]).tokens) == 12
    finally:
        target.generation_config.eos_token_id = 2


def test_tie_checker_tells_a_tie_from_a_mismatch():
    target, _, _ = pair("llama")
    prompt = [5, 6, 7]
    reference = hf_greedy(target, prompt, 5, [])
    assert top2_gap(target, prompt) > 1e-3  # a clear winner: a changed token must be reported
    wrong = [(reference[0] + 1) % 96, *reference[1:]]
    with pytest.raises(AssertionError, match="not a tie"):
        assert_same_greedy(target, prompt, wrong, reference)
    # Force an exact tie at the first step: copy the winner's head row onto the runner-up.
    tied = build_tiny("llama", seed=0)
    with torch.no_grad():
        logits = tied(torch.tensor([prompt])).logits[0, -1]
        first, second = logits.topk(2).indices.tolist()
        head = tied.get_output_embeddings().weight
        head[second] = head[first]
    assert top2_gap(tied, prompt) < 1e-6
    assert_same_greedy(tied, prompt, [second, 1, 2], [first, 3, 4])  # a divergence at a tie passes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_on_cuda():
    target = build_tiny("llama", seed=0).to("cuda")
    drafter = truncated_copy(target, 1)
    prompt = [5, 6, 7, 5, 6]
    reference = hf_greedy(target.cpu(), prompt, 30, [])
    target.to("cuda")
    for d in (drafter, "ngram"):
        res = specdec.speculative_generate(target, d, prompt, max_new_tokens=30, gamma=4, stop_token_ids=[])
        assert_same_greedy(target.cpu(), prompt, res.tokens, reference)
        target.to("cuda")
    sampled = [specdec.speculative_generate(target, drafter, prompt, max_new_tokens=20, temperature=1.0, seed=3,
                                            stop_token_ids=[]).tokens for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_lookup_then_model_uses_both_drafters_and_stays_exact():
    """Lookup proposes when the latest n-gram recurs (no model call), the model otherwise."""
    target, agree, _ = pair("llama")
    prompt = [5, 17, 33, 5, 17, 33, 5, 17, 40, 41, 42]
    reference = hf_greedy(target, prompt, 40, [])
    res = specdec.speculative_generate(target, specdec.LookupDrafter(agree), prompt, max_new_tokens=40,
                                       gamma=4, stop_token_ids=[])
    assert_same_greedy(target, prompt, res.tokens, reference)
    assert 0 < res.stats.drafter_calls < res.stats.drafted  # model rounds cost calls, lookup rounds none


def test_prompt_lookup_copies_the_latest_earlier_occurrence():
    """The continuation of the latest earlier match, num_tokens long whatever the limit is (None: the
    limit); rows of a batch look up in their own text."""
    tokens = [1, 2, 5, 6, 1, 2, 7, 8, 9, 1, 2]
    free = specdec.NgramDrafter(specdec.NgramConfig(min_ngram=2, num_tokens=3))
    free.prefill(PromptBatch.from_lists([tokens], "cpu"))
    assert free.free_tokens == 3
    assert free.propose(torch.tensor([1]), None).tokens.tolist() == [[7, 8, 9]]  # not [5, 6, 1] after the first "1 2"
    plain = specdec.NgramDrafter()
    plain.prefill(PromptBatch.from_lists([tokens, [4, 5, 4]], "cpu"))
    proposal = plain.propose(torch.tensor([2, 2]), None)
    assert plain.free_tokens == 0 and proposal.drafts() == [[7, 8], [5, 4]]
    plain.commit(torch.tensor([0, 2]), torch.tensor([4, 5]))  # ... 1 2 4: "2 4" and "4" never occurred before
    assert plain.propose(torch.tensor([2, 2]), None).drafts() == [[], [4, 5]]  # row 1: 4 5 4 5 4 5
    assert plain.propose(torch.tensor([2, 0]), None).drafts() == [[], []]  # a limit of 0 proposes nothing
    loop = specdec.NgramDrafter(specdec.NgramConfig(num_tokens=7))
    loop.prefill(PromptBatch.from_lists([[9, 3, 4, 3, 4]], "cpu"))  # "3 4" last seen 2 tokens back:
                                                                    # the copy runs into the end
    assert loop.propose(torch.tensor([1]), None).tokens.tolist() == [[3, 4, 3, 4, 3, 4, 3]]  # and goes on copying
                                                                                             # itself


def test_lookup_copies_beyond_gamma_and_ends_at_max_new_tokens():
    """With the target's own continuation in the prompt, lookup drafts more than gamma; the last
    round's drafts are cut to what fits, so exactly max_new_tokens come out, equal to greedy."""
    target, agree, _ = pair("llama")
    base = [5, 17, 33, 8]
    prompt = base + hf_greedy(target, base, 16, []) + base
    for max_new in (7, 30):
        reference = hf_greedy(target, prompt, max_new, [])
        res = specdec.speculative_generate(target, specdec.LookupDrafter(agree), prompt,
                                           max_new_tokens=max_new, gamma=2, stop_token_ids=[])
        assert_same_greedy(target, prompt, res.tokens, reference)
        assert len(res.tokens) == max_new
        assert max(r.drafted for r in res.stats.records) > 2  # lookup copied more than gamma
        assert sum(r.emitted for r in res.stats.records) == max_new
