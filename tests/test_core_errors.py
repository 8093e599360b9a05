"""Bad input gets a clear ValueError / TypeError naming the problem (issue 2, "Bad input")."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_tiny, char_tokenizer, truncated_copy

import specdec
from specdec.schedules import DraftPlan


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
        ({"max_new_tokens": -1}, ValueError, "max_new_tokens must be an int >= 1"),
        ({"max_new_tokens": 0}, ValueError, r"max_new_tokens must be an int >= 1 \(new tokens at most\), got 0"),
        ({"temperature": -0.1}, ValueError, "temperature must be >= 0"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_k": -1}, ValueError, "top_k must be an int >= 0"),
        ({"batch_size": 0}, ValueError, "batch_size must be an int >= 1"),
        ({"batch_size": -3}, ValueError, "batch_size must be an int >= 1"),
        ({"speculate": "sometimes"}, ValueError, "speculate must be one of on, off, auto"),
        ({"verify": "nope"}, ValueError, "unknown verification rule 'nope': use one of exact, sampling"),
        ({"verify": "exact", "temperature": 0.7}, ValueError, r"'exact' is defined for temperature 0 \(greedy\) only"),
        ({"verify": "sampling"}, ValueError, r"'sampling' is defined for temperature > 0 \(sampling\) only"),
        ({"prompt": []}, ValueError, "prompt is empty"),
        ({"prompt": [[1, 2], []]}, ValueError, "prompt 1 is empty"),
        ({"prompt": [[1, 2], "hi"]}, TypeError, "mix strings and token ids"),
        ({"prompt": torch.zeros(2, 3, 4, dtype=torch.long)}, ValueError, r"shape \[T\], \[1, T\] or \[B, T\]"),
        ({"prompt": torch.zeros(3)}, TypeError, "integer token ids"),
        ({"prompt": "hello"}, TypeError, "the prompt is a string: pass tokenizer="),
        ({"prompt": [1, 2, 96]}, ValueError, r"must lie in \[0, 96\)"),
        ({"prompt": list(range(3, 90)) * 3}, ValueError,
         "the prompt has 261 tokens but the target's context holds 256"),
        ({"prompt": [[1, 2], [3, 4], list(range(3, 90)) * 3]}, ValueError,
         "prompt 2 has 261 tokens but the target's context holds 256: shorten it"),
        ({"drafter": "nope"}, ValueError, "unknown drafter 'nope'"),
        ({"drafter": "lookup+"}, ValueError, "lookup\\+NAME needs a drafter model NAME"),
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
    half = build_tiny("llama", vocab_size=48, seed=2, layers=1)  # 48 of the target's 96: not padding
    with pytest.raises(ValueError, match=r"drafter vocabulary \(48 tokens\) differs from the target's \(96\)"):
        spec(pair, drafter=half)
    other = build_tiny("llama", vocab_size=1000, seed=2, layers=1)
    with pytest.raises(ValueError, match=r"drafter vocabulary \(1000 tokens\) differs from the target's \(96\)"):
        spec(pair, drafter=other)
    small = build_tiny("llama", vocab_size=42, seed=2, layers=1)
    big_tok = char_tokenizer("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN")  # 43 tokens
    with pytest.raises(ValueError, match="tokenizer has 43 tokens but the drafter emits only 42"):
        specdec.speculative_generate(build_tiny("llama", vocab_size=43, seed=0), small, [1, 2], max_new_tokens=2,
                                     tokenizer=big_tok)


def test_a_different_bos_is_only_a_warning():
    """bos does not matter to decoding a given prompt: a GPT-2 target with a Llama drafter of the same
    vocabulary and other special ids decodes exactly."""
    target = build_tiny("gpt2", seed=0, bos_token_id=50, eos_token_id=50)
    drafter = build_tiny("llama", seed=4, layers=1, bos_token_id=1)
    with pytest.warns(UserWarning, match=r"different bos_token_id \(1 vs 50\)"):
        res = specdec.speculative_generate(target, drafter, [3, 4, 5], max_new_tokens=12, stop_token_ids=[])
    assert res.tokens == specdec.autoregressive_generate(target, [3, 4, 5], max_new_tokens=12, stop_token_ids=[]).tokens


def test_tokenizers_must_agree_on_shared_ids(tmp_path):
    """Models saved with their tokenizers: the same tokenizer passes, another one of the same size is refused."""
    target = build_tiny("llama", vocab_size=35, seed=0)
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    for name, chars in (("same", "abcdefghijklmnopqrstuvwxyz .,!?\n"), ("other", "zyxwvutsrqponmlkjihgfedcba .,!?\n")):
        drafter = build_tiny("llama", vocab_size=35, seed=1, layers=1)
        drafter.save_pretrained(tmp_path / name)
        char_tokenizer(chars).save_pretrained(tmp_path / name)
    loaded = specdec.load_model(tmp_path / "target")
    assert len(specdec.speculative_generate(loaded, str(tmp_path / "same"), [3, 4], max_new_tokens=3,
                                            stop_token_ids=[]).tokens) == 3
    with pytest.raises(ValueError, match=r"the drafter's tokenizer differs from the target's: id 3 is 'z'"):
        specdec.speculative_generate(loaded, str(tmp_path / "other"), [3, 4], max_new_tokens=3)


def test_models_no_target_handles_are_refused_by_class():
    from transformers import LlamaModel

    target = build_tiny("llama", seed=0)
    bare = LlamaModel(target.config)  # no language-model head: nothing to score tokens with
    with pytest.raises(TypeError, match="target LlamaModel has no language-model head"):
        specdec.speculative_generate(bare, "ngram", [3, 4], max_new_tokens=3)
    with pytest.raises(TypeError, match="target LlamaModel has no language-model head"):
        specdec.autoregressive_generate(bare, [3, 4], max_new_tokens=3)
    with pytest.raises(TypeError, match="drafter LlamaModel is a model that no drafter handles"):
        specdec.speculative_generate(target, bare, [3, 4], max_new_tokens=3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padded_drafter_vocabulary_is_fine_and_exact(temperature):
    """A drafter whose embedding is padded larger (or is a little smaller) drafts in the target's vocabulary."""
    target = build_tiny("llama", vocab_size=1000, seed=0)
    for size in (1024, 990):
        padded = build_tiny("llama", vocab_size=size, seed=0, layers=1)
        res = specdec.speculative_generate(target, padded, [1, 2, 3], max_new_tokens=12, temperature=temperature,
                                           seed=3, stop_token_ids=[])
        plain = specdec.speculative_generate(target, "ngram", [1, 2, 3], max_new_tokens=12, stop_token_ids=[])
        assert all(t < 1000 for t in res.tokens)
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


def test_finite_check_reads_each_logit_not_only_its_sum():
    """``check_finite`` raises for a NaN or inf logit at a real position only: not for padding positions, and not
    for finite logits whose sum overflows (its first check is on the sums)."""
    from specdec.sampling import check_finite

    big = torch.full((2, 3, 8), 3e38)  # finite; each position's sum overflows to inf
    check_finite(big, "target")
    for bad in (float("nan"), float("inf"), float("-inf")):
        logits = torch.zeros(2, 3, 8)
        logits[1, 2, 5] = bad
        with pytest.raises(ValueError, match="target produced NaN/inf logits"):
            check_finite(logits, "target")
        with pytest.raises(ValueError, match="target produced NaN/inf logits"):
            check_finite(logits, "target", torch.ones(2, 3, dtype=torch.bool))
        check_finite(logits, "target", torch.tensor([[True, True, True], [True, True, False]]))  # padding there
        with pytest.raises(ValueError, match="target produced NaN/inf logits"):
            check_finite(big + logits, "target", torch.tensor([[True, True, True], [True, True, True]]))


def test_drafter_on_another_device_is_refused(pair):
    _target, drafter = pair
    elsewhere = copy.deepcopy(drafter).to("meta")
    with pytest.raises(ValueError, match=r"drafter is on meta but the target is on cpu: move it with drafter.to"):
        spec(pair, drafter=elsewhere)


class Fixed(specdec.Drafter):
    """A custom drafter: proposes ``width`` ones per row, declaring ``free`` free tokens and ``calls`` forwards."""

    def __init__(self, width: int, free: int = 0, calls: int = 0) -> None:
        self.width, self.free_tokens, self.calls, self.rows = width, free, calls, 0

    def prefill(self, prompts):
        self.rows += prompts.size
        return 0

    def propose(self, limit, sampler, stop=None):
        tokens = torch.ones(self.rows, self.width, dtype=torch.long)
        return specdec.Proposal(tokens, torch.full((self.rows,), self.width), None, calls=self.calls)

    def commit(self, accepted, next_token):
        pass

    def select(self, rows):
        self.rows = len(rows)

    def reset(self):
        self.rows = 0


def test_custom_drafter_proposing_too_much_is_refused(pair):
    with pytest.raises(ValueError, match="proposed 3 tokens for prompt 0 when asked for at most 2"):
        spec(pair, drafter=Fixed(3), gamma=2)
    with pytest.raises(ValueError, match="proposed 2 tokens for prompt 1 when asked for at most 0"):
        spec(pair, drafter=Fixed(2), prompt=[[1, 2, 3], [4, 5]], schedule=_PerRow([2, 0]))


class _PerRow(specdec.Schedule):
    """A schedule with a fixed limit per row."""

    def __init__(self, limits):
        self.fixed = limits

    def plan(self, rows, device):
        return DraftPlan(torch.tensor(self.fixed[:rows]))


def test_free_tokens_allow_longer_model_free_drafts(pair):
    """A drafter declaring free_tokens may copy more than gamma, cut to the room left; beyond its free
    tokens it is refused."""
    target, _ = pair
    reference = specdec.autoregressive_generate(target, [1, 2, 3], max_new_tokens=4, stop_token_ids=[]).tokens
    res = spec(pair, drafter=Fixed(5, free=5), gamma=2, stop_token_ids=[])
    assert res.tokens == reference  # exactly 4 tokens: the 5 drafts were cut to the 3 that fit
    assert res.stats.records[0].drafted == 3
    with pytest.raises(ValueError, match="proposed 5 tokens for prompt 0 when asked for at most 4"):
        spec(pair, drafter=Fixed(5, free=4), gamma=2)
