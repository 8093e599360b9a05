"""Bad input gets a clear ValueError / TypeError naming the problem (issue 2, "Bad input")."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_tiny, char_tokenizer, truncated_copy

import specdec


@pytest.fixture(scope="module")
def pair():
    target = build_tiny("llama", seed=0)
    return target, truncated_copy(target, 1)


def spec(pair, **overrides):
    target, drafter = pair
    kwargs = {"max_new_tokens": 4, **overrides}
    prompt = kwargs.pop("prompt", [1, 2, 3])
    return specdec.speculative_generate(target, kwargs.pop("drafter", drafter), prompt, **kwargs)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"gamma": 0}, ValueError, "gamma must be an int >= 1"),
        ({"gamma": 2.5}, ValueError, "gamma"),
        ({"max_new_tokens": -1}, ValueError, "max_new_tokens must be an int >= 0"),
        ({"temperature": -0.1}, ValueError, "temperature must be >= 0"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_k": -1}, ValueError, "top_k must be an int >= 0"),
        ({"prompt": []}, ValueError, "prompt is empty"),
        ({"prompt": torch.zeros(2, 3, dtype=torch.long)}, ValueError, "batch size 1"),
        ({"prompt": torch.zeros(3)}, TypeError, "integer token ids"),
        ({"prompt": "hello"}, TypeError, "list of ints or a LongTensor"),
        ({"prompt": [1, 2, 96]}, ValueError, r"must lie in \[0, 96\)"),
        ({"prompt": list(range(3, 90)) * 3}, ValueError, "context holds 256: shorten it"),
        ({"drafter": "nope"}, ValueError, "unknown drafter 'nope'"),
        ({"drafter": 42}, TypeError, "drafter must be"),
        ({"stop_strings": [""], "tokenizer": object()}, ValueError, "non-empty strings"),
    ],
)
def test_bad_arguments(pair, overrides, error, match):
    with pytest.raises(error, match=match):
        spec(pair, **overrides)


def test_plain_loop_validates_too(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="top_p"):
        specdec.autoregressive_generate(target, [1], max_new_tokens=3, top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        specdec.autoregressive_generate(target, [1], max_new_tokens=-2)
    with pytest.raises(ValueError, match="empty"):
        specdec.autoregressive_generate(target, torch.tensor([], dtype=torch.long), max_new_tokens=3)
    with pytest.raises(TypeError, match="target must be a transformers causal LM"):
        specdec.autoregressive_generate("gpt2", [1], max_new_tokens=3)


def test_input_shapes_are_equivalent(pair):
    target, drafter = pair
    outs = [specdec.speculative_generate(target, drafter, ids, max_new_tokens=6, stop_token_ids=[]).tokens
            for ids in ([4, 5, 6], torch.tensor([4, 5, 6]), torch.tensor([[4, 5, 6]]), (4, 5, 6))]
    assert all(o == outs[0] for o in outs)


def test_vocabulary_mismatch_is_refused(pair):
    target, _ = pair
    other = build_tiny("llama", vocab_size=1000, seed=2, layers=1)
    with pytest.raises(ValueError, match=r"drafter vocabulary \(1000 tokens\) differs from the target's \(96\)"):
        spec(pair, drafter=other)
    other_bos = build_tiny("llama", seed=2, layers=1, bos_token_id=50)
    with pytest.raises(ValueError, match="bos_token_id"):
        spec(pair, drafter=other_bos)
    small = build_tiny("llama", vocab_size=40, seed=2, layers=1)
    tokenizer = char_tokenizer()  # 35 tokens
    big_tok = char_tokenizer("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN")  # 43 tokens
    with pytest.raises(ValueError, match="tokenizer has 43 tokens but the drafter emits only 40"):
        specdec.speculative_generate(target, small, [1, 2], max_new_tokens=2, tokenizer=big_tok)
    assert len(specdec.speculative_generate(target, small, [1, 2], max_new_tokens=2, tokenizer=tokenizer,
                                            stop_token_ids=[]).tokens) == 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padded_drafter_vocabulary_is_fine_and_exact(pair, temperature):
    """A drafter whose embedding is padded larger (or smaller) drafts in the target's vocabulary."""
    target, _ = pair
    for size in (128, 90):
        padded = build_tiny("llama", vocab_size=size, seed=0, layers=1)
        res = specdec.speculative_generate(target, padded, [1, 2, 3], max_new_tokens=12, temperature=temperature,
                                           seed=3, stop_token_ids=[])
        plain = specdec.speculative_generate(target, "ngram", [1, 2, 3], max_new_tokens=12, stop_token_ids=[])
        assert all(t < 96 for t in res.tokens)
        if temperature == 0.0:
            assert res.tokens == plain.tokens


def test_nan_logits_are_reported(pair):
    _target, drafter = pair
    broken = copy.deepcopy(drafter)
    with torch.no_grad():
        broken.get_output_embeddings().weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="drafter produced NaN/inf logits"):
        spec(pair, drafter=broken)
    with pytest.raises(ValueError, match="target produced NaN/inf logits"):
        specdec.speculative_generate(broken, "ngram", [1, 2, 1], max_new_tokens=3)
    with pytest.raises(ValueError, match="target produced NaN/inf logits"):
        specdec.autoregressive_generate(broken, [1, 2], max_new_tokens=3, temperature=1.0)


def test_drafter_on_another_device_is_refused(pair):
    _target, drafter = pair
    elsewhere = copy.deepcopy(drafter).to("meta")
    with pytest.raises(ValueError, match=r"drafter is on meta but the target is on cpu: move it with drafter.to"):
        spec(pair, drafter=elsewhere)


def test_custom_drafter_proposing_too_much_is_refused(pair):
    class Greedy:
        def prefill(self, input_ids):
            return 0

        def propose(self, k, sampler):
            return specdec.Proposal(torch.ones(1, k + 1, dtype=torch.long), None)

        def commit(self, n_accepted, next_token):
            pass

    with pytest.raises(ValueError, match="proposed 3 tokens when asked for at most 2"):
        spec(pair, drafter=Greedy(), gamma=2)


def test_free_tokens_allow_longer_model_free_drafts_only(pair):
    """A drafter declaring free_tokens may copy more than gamma (q None, no forward), cut to the room
    left; a proposal that cost a forward stays within gamma."""

    class Copier:
        free_tokens = 5
        calls = 0

        def prefill(self, input_ids):
            return 0

        def propose(self, k, sampler):
            return specdec.Proposal(torch.ones(1, 5, dtype=torch.long), None, self.calls)

        def commit(self, n_accepted, next_token):
            pass

    target, _ = pair
    reference = specdec.autoregressive_generate(target, [1, 2, 3], max_new_tokens=4, stop_token_ids=[]).tokens
    res = spec(pair, drafter=Copier(), gamma=2, stop_token_ids=[])
    assert res.tokens == reference  # exactly 4 tokens: the 5 drafts were cut to the 3 that fit
    assert res.stats.records[0].drafted == 3
    costly = Copier()
    costly.calls = 1
    with pytest.raises(ValueError, match="proposed 5 tokens when asked for at most 2"):
        spec(pair, drafter=costly, gamma=2)
