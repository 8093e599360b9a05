"""Stops, limits and round events (issue 2, semantics 4; the CLI's on_round / stop_strings).

- never more than max_new_tokens; 0 generates nothing;
- gamma shrinks near the context limit; the output ends there with stop_reason "context_limit";
- stop strings end the output at the token that completes them, also inside accepted drafts;
- concatenated RoundEvents == result tokens, with kinds accepted / recovered / bonus / target.
"""

from __future__ import annotations

import pytest
from conftest import build_tiny, char_tokenizer, hf_greedy, truncated_copy

import specdec


@pytest.fixture(scope="module")
def gpt2_small_context():
    return build_tiny("gpt2", seed=0, max_positions=24)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_never_more_than_max_new_tokens(llama_target, llama_drafter, max_new_tokens, gamma):
    for drafter in (llama_drafter, llama_target, "ngram"):
        res = specdec.speculative_generate(llama_target, drafter, [3, 4, 3, 4], max_new_tokens=max_new_tokens,
                                           gamma=gamma, stop_token_ids=[])
        assert len(res.tokens) == max_new_tokens == res.stats.new_tokens
        assert res.stop_reason == "max_new_tokens"
    plain = specdec.autoregressive_generate(llama_target, [3], max_new_tokens=max_new_tokens, stop_token_ids=[])
    assert plain.tokens == hf_greedy(llama_target, [3], max_new_tokens, [])


def test_max_new_tokens_zero_is_refused(llama_target):
    """Zero new tokens is a mistake, not a request: refused with the fix named (the CLI says it too)."""
    for generate in (lambda: specdec.speculative_generate(llama_target, "ngram", [3, 4], max_new_tokens=0),
                     lambda: specdec.autoregressive_generate(llama_target, [3, 4], max_new_tokens=0)):
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
            generate()


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_gamma_shrinks_at_the_context_limit(gpt2_small_context, gamma):
    target = gpt2_small_context
    prompt = list(range(3, 18))  # 15 of 24 positions
    plain = specdec.autoregressive_generate(target, prompt, max_new_tokens=50, stop_token_ids=[])
    assert len(plain.tokens) == 9 and plain.stop_reason == "context_limit"
    for drafter in (target, truncated_copy(target, 1), "ngram"):
        res = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=50, gamma=gamma, stop_token_ids=[])
        assert res.tokens == plain.tokens and res.stop_reason == "context_limit"
        assert all(r.drafted <= 24 - len(prompt) for r in res.stats.records)


def test_prompt_filling_the_context_generates_nothing(gpt2_small_context):
    res = specdec.speculative_generate(gpt2_small_context, "ngram", list(range(24)), max_new_tokens=5)
    assert res.tokens == [] and res.stop_reason == "context_limit"


def test_round_events_concatenate_to_the_output(llama_target, llama_drafter):
    for temperature in (0.0, 1.0):
        for drafter in (llama_drafter, llama_target, "ngram"):
            events = []
            res = specdec.speculative_generate(llama_target, drafter, [7, 8, 9, 7, 8], max_new_tokens=33, gamma=3,
                                               temperature=temperature, seed=1, stop_token_ids=[],
                                               on_round=events.append)
            assert [t for e in events for t in e.tokens] == res.tokens
            assert len(events) == res.stats.rounds
            for event, record in zip(events, res.stats.records):
                assert len(event.kinds) == len(event.tokens) == record.emitted
                assert event.kinds[: record.accepted] == ["accepted"] * record.accepted
                last = event.kinds[-1]
                if record.drafted == 0:
                    assert last == "target"
                elif record.accepted == record.drafted:
                    assert last == "bonus"
                else:
                    assert last == "recovered"
    events = []
    plain = specdec.autoregressive_generate(llama_target, [7, 8], max_new_tokens=5, on_round=events.append,
                                            stop_token_ids=[])
    assert [e.tokens for e in events] == [[t] for t in plain.tokens]
    assert all(e.kinds == ["target"] for e in events)


def char_model(seed: int, layers: int = 2):
    tokenizer = char_tokenizer()
    return build_tiny("llama", vocab_size=len(tokenizer), seed=seed, layers=layers), tokenizer


@pytest.mark.parametrize("drafter_kind", ["self", "agree", "ngram", "plain"])
def test_stop_string_keeps_tokens_up_to_the_completing_one(drafter_kind):
    target, tokenizer = char_model(0)
    prompt = tokenizer.encode("hello world")
    free = specdec.autoregressive_generate(target, prompt, max_new_tokens=30, stop_token_ids=[]).tokens
    text = tokenizer.decode(free, skip_special_tokens=True)
    stop = text[5:7]  # a two-character string the target writes (maybe earlier too)
    end = next(j for j in range(len(free)) if stop in tokenizer.decode(free[: j + 1], skip_special_tokens=True))
    expected = free[: end + 1]
    if drafter_kind == "plain":
        res = specdec.autoregressive_generate(target, prompt, max_new_tokens=30, stop_token_ids=[],
                                              stop_strings=[stop, "never here"], tokenizer=tokenizer)
    else:
        drafter = {"self": target, "agree": truncated_copy(target, 1), "ngram": "ngram"}[drafter_kind]
        res = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=30, gamma=8, stop_token_ids=[],
                                           stop_strings=stop, tokenizer=tokenizer)
    assert res.tokens == expected and res.stop_reason == "stop_string"
    assert tokenizer.decode(res.tokens, skip_special_tokens=True).endswith(stop)


def test_stop_strings_need_a_tokenizer(llama_target):
    with pytest.raises(ValueError, match="tokenizer"):
        specdec.speculative_generate(llama_target, "ngram", [1, 2], max_new_tokens=3, stop_strings=["x"])
    with pytest.raises(ValueError, match="tokenizer"):
        specdec.autoregressive_generate(llama_target, [1, 2], max_new_tokens=3, stop_strings="x")


RAGGED = [[3, 4], list(range(3, 20)), list(range(10, 18))]  # rows reaching a 24-position context at different rounds


@pytest.mark.parametrize("gamma", [4, 8])
def test_a_ragged_batch_decodes_exactly_up_to_the_context_limit(gpt2_small_context, gamma):
    """Rows near the end of the context draft less than the batch's longest: the drafter's steps for them past
    its last position go in as dead tokens (an index past a learned position table crashed here)."""
    target = gpt2_small_context
    plain = [specdec.autoregressive_generate(target, p, max_new_tokens=40, stop_token_ids=[]).tokens for p in RAGGED]
    for drafter in (target, truncated_copy(target, 1)):
        results = specdec.speculative_generate(target, drafter, RAGGED, max_new_tokens=40, gamma=gamma,
                                               stop_token_ids=[])
        assert [r.tokens for r in results] == plain
        assert [r.stop_reason for r in results] == ["context_limit"] * 3


@pytest.fixture(scope="module")
def long_target():
    return build_tiny("gpt2", seed=4, max_positions=256)


def test_a_drafter_with_a_shorter_context_drafts_within_it(long_target):
    """A drafter of 24 positions beside a target of 256: a prompt longer than the drafter's context is decoded by
    the target alone, and a row that outgrows it mid-batch stops being drafted for; the output stays the target's."""
    drafter = build_tiny("gpt2", seed=5, layers=1, hidden=16, max_positions=24)
    long_prompt = list(range(3, 63))
    res = specdec.speculative_generate(long_target, drafter, long_prompt, max_new_tokens=10, stop_token_ids=[])
    assert res.tokens == hf_greedy(long_target, long_prompt, 10, []) and res.stats.drafted == 0
    prompts = [*RAGGED, long_prompt]
    results = specdec.speculative_generate(long_target, drafter, prompts, max_new_tokens=40, gamma=4,
                                           stop_token_ids=[])
    for prompt, result in zip(prompts, results):
        assert result.tokens == hf_greedy(long_target, prompt, 40, [])
        within = sum(r.drafted for r in result.stats.records)
        assert 0 < within <= max(0, 24 - len(prompt) + 1) * 4 or len(prompt) > 24 and within == 0


def test_prompt_lookup_drafts_past_a_shorter_drafters_context(long_target, tmp_path):
    """Composed with prompt lookup, the short drafter still drafts only within its positions, and lookup copies past
    them: a 60-token prompt that repeats itself gets drafts, every output the target's."""
    build_tiny("gpt2", seed=5, layers=1, hidden=16, max_positions=24).save_pretrained(tmp_path / "short")
    looping = list(range(3, 23)) * 3
    prompts = [[3, 4], looping, [5, 6, 7, 5, 6, 7, 5, 6, 7]]
    results = specdec.speculative_generate(long_target, f"lookup+{tmp_path / 'short'}", prompts, max_new_tokens=40,
                                           stop_token_ids=[])
    for prompt, result in zip(prompts, results):
        assert result.tokens == hf_greedy(long_target, prompt, 40, [])
    assert results[1].stats.drafted > 0  # lookup's copies, past the drafter model's 24 positions
