"""A prefill's attention on both cores (``specdec.attention``): inside ``prefilling``, a decoder-only float32 CPU
model's prefill computes its attention with ``specdec::decode_attention`` in chunks of queries, shared with the
helper thread. The same attention as sdpa's (causal from an empty cache, left padding, grouped key-value heads, a
length that is not a multiple of the chunk), only on the thread inside (the model's configuration untouched); a
ragged batch with long prompts decodes as ``generate`` does."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from conftest import assert_same_greedy, build_tiny, count_calls, hf_greedy, ragged_forward, truncated_copy

import specdec
from specdec import attention, kernels

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not kernels.blocked_op(), reason="specdec's operators need a C and a C++ compiler")]


@pytest.fixture
def helper():
    was = kernels.helper_on()
    kernels._set_helper(True)
    yield
    kernels._set_helper(was)


@pytest.fixture
def calls(monkeypatch):
    """How many attention calls the operator computed (``_chunked``) and how many went to sdpa's."""
    counts = {"operator": 0, "sdpa": 0}
    count_calls(monkeypatch, attention, "_chunked", counts, "operator")
    count_calls(monkeypatch, attention, "_SDPA", counts, "sdpa")
    return counts


def _prefill(model, ids, valid, shared):
    out, cache = ragged_forward(model, ids, valid, attention.prefilling if shared else None,
                                logits_to_keep=ids.shape[1])
    return out.logits, [layer.keys for layer in cache.cache.layers]


@pytest.mark.parametrize(("hidden", "lengths"), [(256, [45]), (128, [77]), (256, [33, 70, 52])])
def test_the_prefill_attention_is_sdpas(hidden, lengths, helper, calls):
    """Grouped heads (4 query heads on 2 key-value heads) of 64 or 32; one prompt (no mask: causal) or a left-padded
    batch (a 4D mask); the operator's logits and cached keys as close to a float64 prefill as sdpa's (within twice
    sdpa's float32 error, or 1e-5)."""
    model = build_tiny("llama", hidden=hidden, vocab_size=128, seed=3)
    generator = torch.Generator().manual_seed(0)
    width = max(lengths)
    ids = torch.randint(3, 128, (len(lengths), width), generator=generator)
    valid = torch.arange(width)[None, :] >= torch.tensor([width - n for n in lengths])[:, None]
    valid = None if bool(valid.all()) else valid
    logits, keys = _prefill(model, ids, valid, shared=False)
    assert calls == {"operator": 0, "sdpa": model.config.num_hidden_layers}  # outside: transformers' sdpa
    shared_logits, shared_keys = _prefill(model, ids, valid, shared=True)
    assert calls == {"operator": model.config.num_hidden_layers * len(lengths), "sdpa": model.config.num_hidden_layers}
    exact_logits, exact_keys = _prefill(copy.deepcopy(model).double(), ids, valid, shared=False)
    real = valid if valid is not None else torch.ones_like(ids, dtype=torch.bool)

    def error(ours, exact):
        return float((ours[real].double() - exact[real]).abs().max())
    assert error(shared_logits, exact_logits) <= max(2 * error(logits, exact_logits), 1e-5)
    for ours, sdpa, exact in zip(shared_keys, keys, exact_keys):
        ours, sdpa, exact = (k.transpose(1, 2) for k in (ours, sdpa, exact))
        assert error(ours, exact) <= max(2 * error(sdpa, exact), 1e-5)
    assert model.config._attn_implementation == "sdpa"


def test_only_the_thread_inside_takes_it(helper, calls):
    """Another thread's forward of the same model while one thread is inside gets sdpa's attention; a short prompt
    (under ``MIN_TOKENS``) too; the thread is outside again after an error inside."""
    model = build_tiny("llama", hidden=256, vocab_size=128, seed=4)
    ids = torch.randint(3, 128, (1, 40))
    inside, go_on = threading.Event(), threading.Event()

    def prefill():
        with attention.prefilling(model):
            inside.set()
            go_on.wait(30)
    thread = threading.Thread(target=prefill)
    thread.start()
    assert inside.wait(30) and model.config._attn_implementation == "sdpa"
    _prefill(model, ids, None, shared=False)  # this thread is not inside: sdpa's, through the module's name
    assert calls == {"operator": 0, "sdpa": model.config.num_hidden_layers}
    go_on.set()
    thread.join(30)
    assert model.config._attn_implementation == "sdpa"
    _prefill(model, ids[:, :attention.MIN_TOKENS - 1], None, shared=True)
    assert calls == {"operator": 0, "sdpa": 2 * model.config.num_hidden_layers}
    with pytest.raises(RuntimeError, match="inside"), attention.prefilling(model):
        assert attention._local.on
        raise RuntimeError("inside")
    assert not attention._local.on


def test_not_wanted_without_the_helper_or_off_the_float32_cpu(calls):
    model = build_tiny("llama", hidden=256, vocab_size=128, seed=5)
    was = kernels.helper_on()
    kernels._set_helper(False)
    try:
        assert not attention.wanted(model)
        _prefill(model, torch.randint(3, 128, (1, 40)), None, shared=True)
        assert calls == {"operator": 0, "sdpa": model.config.num_hidden_layers}
    finally:
        kernels._set_helper(was)
    assert not attention.wanted(model.to(torch.bfloat16))


def test_long_prompts_decode_as_generate_does(helper, calls):
    """Speculative decoding of a ragged batch of prompts of 33-90 tokens, prefilled through the operator."""
    target = build_tiny("llama", hidden=256, vocab_size=512, seed=11)
    drafter = truncated_copy(target, 1)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (33, 90, 61)]
    results = specdec.speculative_generate(target, drafter, prompts, max_new_tokens=12, gamma=3, stop_token_ids=[],
                                           batch_size=2)
    assert calls["operator"] > 0
    for prompt, result in zip(prompts, results):
        assert_same_greedy(target, prompt, result.tokens, hf_greedy(target, prompt, 12, []))
