"""A prefill's last decoder layer writes its keys and values only (``specdec.tail``): inside ``keys_only``, a Llama's
last layer fills the cache with the same floats as the whole layer (one prompt, and a left-padded batch), only on
the thread inside and only for that model; other classes run whole; decoding stays the target's own greedy."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import assert_same_greedy, build_tiny, count_calls, hf_greedy, ragged_forward, truncated_copy

import specdec
from specdec import tail
from specdec.cache import RaggedCache
from specdec.seq2seq import prefilled_cache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def counted(monkeypatch):
    """How many calls of a Llama layer wrote keys and values only."""
    counts = {"keys only": 0}
    count_calls(monkeypatch, tail, "_keys_and_values", counts, "keys only")
    return counts


def _cache(model, ids, valid, tail_only):
    cache = ragged_forward(model, ids, valid, tail.keys_only if tail_only else None)[1]
    return [(layer.keys, layer.values) for layer in cache.cache.layers]


@pytest.mark.parametrize("rows", [1, 3])
def test_the_cache_holds_the_whole_layers_floats(rows, counted):
    model = build_tiny("llama", hidden=64, layers=3, vocab_size=128, seed=5)
    generator = torch.Generator().manual_seed(rows)
    ids = torch.randint(3, 128, (rows, 21), generator=generator)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1:, :7] = False  # rows after the first left-padded
    whole, keys_only = _cache(model, ids, valid, False), _cache(model, ids, valid, True)
    assert counted["keys only"] == 1  # the last layer, once
    for (k, v), (k2, v2) in zip(whole, keys_only):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_only_the_thread_inside_and_its_model(counted):
    model = build_tiny("llama", hidden=64, layers=2, vocab_size=128, seed=6)
    other = build_tiny("llama", hidden=64, layers=2, vocab_size=128, seed=7)
    ids = torch.randint(3, 128, (1, 12))
    with torch.inference_mode(), tail.keys_only(model):
        RaggedCache(other, 1).forward(ids)  # another model on this thread: whole
        seen = {}
        thread = threading.Thread(target=lambda: seen.update(out=RaggedCache(model, 1).forward(ids, logits_to_keep=12)))
        thread.start()
        thread.join()
    assert counted["keys only"] == 0
    with torch.inference_mode():
        assert torch.equal(seen["out"].logits, RaggedCache(model, 1).forward(ids, logits_to_keep=12).logits)


def test_other_classes_run_whole(counted):
    model = build_tiny("qwen2", hidden=64, layers=2, vocab_size=128, seed=8)
    assert tail.last_layer(model) is None
    with torch.inference_mode(), tail.keys_only(model):
        RaggedCache(model, 1).forward(torch.randint(3, 128, (1, 12)))
    assert counted["keys only"] == 0


def test_prompts_decode_as_generate_does(counted):
    """Speculative decoding of a ragged batch, every row prefilled with its last layer's keys and values only."""
    target = build_tiny("llama", hidden=64, layers=3, vocab_size=256, seed=12)
    drafter = truncated_copy(target, 1)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (9, 40, 23)]
    results = specdec.speculative_generate(target, drafter, prompts, max_new_tokens=12, gamma=3, stop_token_ids=[],
                                           batch_size=2)
    assert counted["keys only"] >= 3  # the target's prefills and the drafter's
    for prompt, result in zip(prompts, results):
        assert_same_greedy(target, prompt, result.tokens, hf_greedy(target, prompt, 12, []))
    with torch.inference_mode():
        cache = prefilled_cache(target, specdec.batch.PromptBatch.from_lists(prompts, "cpu"), "cpu")[0]
    assert cache.rows == 3
