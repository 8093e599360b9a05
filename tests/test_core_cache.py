"""KV caches of a batch (issues 2 and 16): ragged rows rolled back per row, fed only uncached tokens.

After every round, for every row: the target caches the committed sequence minus its newest token
(committed - 1), the drafter's cache plus its pending tokens hold exactly the committed sequence.
A hypothesis property test drives the target and drafter handles with random per-row acceptance and
checks, after every round, both lengths and that the next logits of every row equal those of a
cache-free forward of that row alone (holes, merges, selections and compaction never change what a
row sees). Finished rows leave the batch: later forwards carry fewer rows.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny, truncated_copy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specdec
from specdec.batch import PromptBatch
from specdec.cache import RaggedCache
from specdec.config import SamplingConfig
from specdec.drafters.model import ModelDrafter
from specdec.sampling import Sampler
from specdec.schedules import Constant
from specdec.target import ModelTarget

MODELS: dict[str, tuple] = {}


def models(arch: str):
    if arch not in MODELS:
        target = build_tiny(arch, seed=0)
        MODELS[arch] = (target, truncated_copy(target, 1))
    return MODELS[arch]


def alone(model, sequence: list[int]) -> torch.Tensor:
    """Next-token logits [V] after ``sequence``, from a cache-free forward of that row alone."""
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0, -1]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_ragged_commit_keeps_every_row_exact(arch, data):
    target_model, drafter_model = models(arch)
    prompts = data.draw(st.lists(st.lists(st.integers(3, 95), min_size=1, max_size=9), min_size=1, max_size=4))
    committed = [list(p) for p in prompts]
    target, drafter = ModelTarget(target_model), ModelDrafter(drafter_model)
    sampler = Sampler.create(SamplingConfig(), "cpu", rows=len(prompts))
    with torch.inference_mode():
        target.prefill(PromptBatch.from_lists(prompts, "cpu"))
        drafter.prefill(PromptBatch.from_lists(prompts, "cpu"))
        for round_ in range(data.draw(st.integers(1, 6))):
            rows = len(committed)
            limit = torch.tensor(data.draw(st.lists(st.integers(0, 4), min_size=rows, max_size=rows)))
            proposal = drafter.propose(limit, sampler)
            lengths = proposal.lengths.tolist()
            assert lengths == limit.tolist()
            last = torch.tensor([c[-1] for c in committed])
            scores = target.verify(torch.cat([last[:, None], proposal.tokens], 1), proposal.lengths + 1)
            for b in range(rows):  # the verify forward saw each row exactly as alone
                torch.testing.assert_close(scores.logits[b, 0], alone(target_model, committed[b]), atol=1e-4, rtol=1e-4)
            accepted = torch.tensor([data.draw(st.integers(0, n)) for n in lengths])
            next_token = torch.tensor(data.draw(st.lists(st.integers(3, 95), min_size=rows, max_size=rows)))
            target.rollback(accepted + 1)
            drafter.commit(accepted, next_token)
            drafts = proposal.drafts()
            for b in range(rows):
                committed[b] += drafts[b][: int(accepted[b])] + [int(next_token[b])]
            assert target.cached().tolist() == [len(c) - 1 for c in committed]
            assert [int(n) + len(p) for n, p in zip(drafter.cache.live, drafter.pending)] == [len(c) for c in committed]
            assert target.cache.stored_length() == target.cache.slots
            if rows > 1 and data.draw(st.booleans()):  # a row finishes and leaves
                gone = data.draw(st.integers(0, rows - 1))
                keep = torch.tensor([b for b in range(rows) if b != gone])
                target.select(keep)
                drafter.select(keep)
                committed.pop(gone)
                sampler = sampler.select(keep)
            if data.draw(st.booleans()):  # a row joins
                joining = data.draw(st.lists(st.integers(3, 95), min_size=1, max_size=7))
                target.prefill(PromptBatch.from_lists([joining], "cpu"))
                drafter.prefill(PromptBatch.from_lists([joining], "cpu"))
                committed.append(joining)
                sampler = Sampler.create(SamplingConfig(), "cpu", rows=len(committed))
        # one last verification of the newest tokens: every row still sees exactly its own sequence
        last = torch.tensor([c[-1] for c in committed])
        scores = target.verify(last[:, None], torch.ones(len(committed), dtype=torch.long))
        for b, seq in enumerate(committed):
            torch.testing.assert_close(scores.logits[b, 0], alone(target_model, seq), atol=1e-4, rtol=1e-4)


def test_compaction_and_merge_keep_logits():
    model = build_tiny("qwen2", seed=0)
    seqs = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21], [30, 31, 32, 33]]
    with torch.inference_mode():
        cache = RaggedCache(model, 0)
        for seq in seqs:  # rows join one by one: merges with left padding
            part = RaggedCache(model, 1)
            part.forward(torch.tensor([seq[:-1]]))
            cache.merge(part)
        assert cache.holes and cache.live.tolist() == [7, 1, 3]
        cache.compact()
        assert cache.slots == 7 and cache.mask.sum(1).tolist() == [7, 1, 3]
        out = cache.forward(torch.tensor([[s[-1]] for s in seqs]), logits_to_keep=1).logits[:, -1]
        for b, seq in enumerate(seqs):
            torch.testing.assert_close(out[b], alone(model, seq), atol=1e-4, rtol=1e-4)
        cache.keep(torch.tensor([8, 1, 2]))  # roll rows 1 and 2 back
        cache.select(torch.tensor([2, 1]))  # row 0 leaves, the others swap
        assert cache.live.tolist() == [2, 1] and cache.slots == 3  # slots only row 0 used are gone
        out = cache.forward(torch.tensor([[32], [21]])).logits[:, -1]
        torch.testing.assert_close(out[0], alone(model, [30, 31, 32]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out[1], alone(model, [20, 21]), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="cannot keep"):
        cache.keep(torch.tensor([9, 9]))


class CountingForward:
    """A forward hook recording the batch size and new tokens of every call."""

    def __init__(self, model):
        self.calls: list[tuple[int, int]] = []
        self.handle = model.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls.append(tuple(ids.shape))


def test_rows_leave_and_forwards_shrink():
    """Different budgets: once the short row is done, every later forward carries fewer rows."""
    target, drafter = models("gpt2")
    counter = CountingForward(target)
    try:
        handle = specdec.make_target(target)
        decoder = specdec.Decoder(handle, specdec.make_drafter(drafter, handle), Constant(3), batch_size=3)
        sampling = SamplingConfig()
        rows = [decoder.submit(specdec.Request(p, n, sampling)) for p, n in (([5, 6], 4), ([7, 8, 9], 40), ([3], 40))]
        with torch.inference_mode():
            while decoder.busy:
                decoder.step()
    finally:
        counter.handle.remove()
    assert [len(r.tokens) for r in rows] == [4, 40, 40]
    sizes = [b for b, _ in counter.calls[1:]]  # rows in each forward after the prefill
    assert sizes[0] == 3 and 2 in sizes and sizes == sorted(sizes, reverse=True)  # rows leave, none comes back
    assert rows[0].stats.rounds < rows[1].stats.rounds


def test_plain_loop_feeds_one_token_per_step():
    target = build_tiny("gpt2", seed=0)
    counter = CountingForward(target)
    prompt = [4, 5, 6, 7]
    try:
        res = specdec.autoregressive_generate(target, prompt, max_new_tokens=25, stop_token_ids=[])
    finally:
        counter.handle.remove()
    assert counter.calls[0] == (1, len(prompt) - 1)  # the prefill: all but the newest token
    assert counter.calls[1:] == [(1, 1)] * len(res.tokens)
    assert res.stats.target_calls == len(res.tokens) + 1 and res.stats.rounds == len(res.tokens)
    assert res.stats.mean_accepted_length == 1.0 and res.stats.drafted == 0


def test_cost_is_linear_in_length():
    """Tokens fed to the target: the prompt once, then the round's k + 1 per round; never the prefix again."""
    target, drafter = models("llama")
    counter = CountingForward(target)
    try:
        res = specdec.speculative_generate(target, drafter, [5, 6, 7], max_new_tokens=80, gamma=3, stop_token_ids=[])
    finally:
        counter.handle.remove()
    assert sum(n for _, n in counter.calls) == 2 + res.stats.drafted + res.stats.rounds


def test_a_row_joins_a_cache_whose_rows_hold_no_slot():
    """A row with no cached token (a one-token prompt) joins rows that hold none either (all rolled back):
    the empty layers take the new row count, so the next forward sees every row (hypothesis found it)."""
    model = build_tiny("llama", seed=0)
    with torch.inference_mode():
        cache = RaggedCache(model, 0)
        part = RaggedCache(model, 1)
        part.forward(torch.tensor([[5, 6]]))
        cache.merge(part)
        cache.keep(torch.tensor([0]))  # every slot dropped; the layers stay initialised, 0 slots, 1 row
        cache.merge(RaggedCache(model, 1))  # a joining row with nothing cached
        out = cache.forward(torch.tensor([[7], [8]]))
        for row, token in enumerate((7, 8)):
            alone = model(torch.tensor([[token]])).logits[0, -1]
            torch.testing.assert_close(out.logits[row, -1], alone, atol=1e-4, rtol=1e-4)
