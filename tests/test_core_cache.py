"""KV caches (issue 2, semantics 3): rolled back after rejections, fed only uncached tokens.

After every round: the target's cache holds the committed sequence minus its newest token
(committed - 1), the drafter's cache plus its pending tokens hold exactly the committed sequence,
and the lengths read from the cache tensors agree. Every model forward receives only tokens that
are not yet cached, so the tokens fed in total are bounded by committed + drafted (no O(n^2)).
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from conftest import build_tiny, truncated_copy

import specdec
from specdec import decode
from specdec.cache import KVCache
from specdec.drafters.model import ModelDrafter


class RecordingKVCache(KVCache):
    """A KVCache that remembers its instances and counts the tokens fed to the model."""

    instances: ClassVar[list[RecordingKVCache]] = []

    def __init__(self, model):
        super().__init__(model)
        self.fed = 0
        RecordingKVCache.instances.append(self)

    def forward(self, input_ids, logits_to_keep=1):
        assert input_ids.shape[1] >= 1
        self.fed += input_ids.shape[1]
        return super().forward(input_ids, logits_to_keep)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("which", ["agree", "self"])
def test_cache_lengths_track_committed_tokens_every_round(monkeypatch, arch, temperature, which):
    target = build_tiny(arch, seed=0)
    model = truncated_copy(target, 1) if which == "agree" else target
    monkeypatch.setattr(decode, "KVCache", RecordingKVCache)
    RecordingKVCache.instances = []
    drafter = ModelDrafter(model)
    prompt = [3, 9, 27, 81, 3, 9]
    committed = list(prompt)
    checks = []

    def on_round(event):
        committed.extend(event.tokens)
        target_cache = RecordingKVCache.instances[0]
        assert target_cache.length == target_cache.stored_length() == len(committed) - 1
        assert drafter.cache.length == drafter.cache.stored_length()
        assert drafter.cache.length + drafter.pending.shape[1] == len(committed)
        assert drafter.pending[0].tolist() == committed[len(committed) - drafter.pending.shape[1]:]
        checks.append(drafter.pending.shape[1])

    res = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=40, gamma=4, temperature=temperature,
                                       seed=0, stop_token_ids=[], on_round=on_round)
    assert len(checks) == res.stats.rounds and committed == prompt + res.tokens
    if which == "self" and temperature == 0.0:
        assert 2 in checks  # full acceptance: the last draft waits as pending, caught up in the next propose
    fed_target = RecordingKVCache.instances[0].fed
    # Prefill (T-1) plus k+1 per round: never the prefix again.
    assert fed_target == len(prompt) - 1 + res.stats.drafted + res.stats.rounds
    assert drafter.cache.length <= len(committed)


def test_plain_loop_feeds_one_token_per_step(monkeypatch):
    target = build_tiny("gpt2", seed=0)
    monkeypatch.setattr(decode, "KVCache", RecordingKVCache)
    RecordingKVCache.instances = []
    prompt = [4, 5, 6, 7]
    res = specdec.autoregressive_generate(target, prompt, max_new_tokens=25, stop_token_ids=[])
    cache = RecordingKVCache.instances[0]
    assert cache.fed == len(prompt) + len(res.tokens) - 1 == cache.stored_length()
    assert res.stats.target_calls == len(res.tokens) == res.stats.rounds
    assert res.stats.mean_accepted_length == 1.0 and res.stats.drafted == 0


def test_cost_is_linear_in_length():
    """Doubling the output roughly doubles target forwards' tokens; no quadratic re-reading."""
    target = build_tiny("llama", seed=0)
    drafter = truncated_copy(target, 1)
    fed = []
    for n in (40, 80):
        res = specdec.speculative_generate(target, drafter, [5, 6, 7], max_new_tokens=n, gamma=3, stop_token_ids=[])
        fed.append(res.stats.drafted + res.stats.rounds)
    assert fed[1] <= 2.2 * fed[0]


def test_kvcache_crop_roundtrip():
    model = build_tiny("qwen2", seed=0)
    cache = KVCache(model)
    with torch.inference_mode():
        cache.forward(torch.tensor([[1, 2, 3, 4, 5]]))
        cache.crop_to(3)
        assert cache.length == cache.stored_length() == 3
        logits = cache.forward(torch.tensor([[4, 5]]), logits_to_keep=2)
        full = model(torch.tensor([[1, 2, 3, 4, 5]])).logits[:, -2:]
    torch.testing.assert_close(logits, full, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop_to(9)
