"""The round loop's host-side bookkeeping (issue 28): what it keeps on the host says what the tensors hold.

A proposal's drafts are read from its tensors once and kept (``Proposal.drafts``), or handed over by the
drafter that made them (prompt lookup, the drafter model, the lookup+model merge): every kept list must
equal a fresh read of the tensors, round after round, on a ragged batch where lookup copies for some rows
and the model drafts for others. A ``RaggedCache`` keeps no mask while every slot is live and makes it when
read: it must equal the mask the live counts imply, through forwards, ragged rollbacks and row selection.
"""

from __future__ import annotations

import pytest
import torch

from specdec.batch import PromptBatch
from specdec.cache import RaggedCache
from specdec.config import SamplingConfig
from specdec.drafters.base import Proposal
from specdec.drafters.hybrid import LookupDrafter
from specdec.drafters.model import ModelDrafter
from specdec.sampling import Sampler
from specdec.target import ModelTarget

pytestmark = pytest.mark.usefixtures("one_thread")


def fresh(proposal: Proposal) -> list[list[int]]:
    """The drafts as the tensors hold them, read now."""
    return [row[:n] for row, n in zip(proposal.tokens.tolist(), proposal.lengths.tolist())]


def test_kept_drafts_equal_the_tensors_on_a_ragged_lookup_and_model_batch(llama_target, llama_drafter):
    target = ModelTarget(llama_target)
    drafter = LookupDrafter(ModelDrafter(llama_drafter)).align(target)
    # row 0 repeats itself (lookup copies), rows 1 and 2 do not (the model drafts), row 2 has no room at first
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 40, 11, 77], [3, 21, 50]]
    batch = PromptBatch.from_lists(prompts, "cpu")
    target.prefill(batch)
    drafter.prefill(batch)
    sampler = Sampler.create(SamplingConfig(), "cpu", rows=3)
    committed = [list(p) for p in prompts]
    kinds = set()
    for round_ in range(6):
        limit = torch.tensor([4, 3, 0 if round_ == 0 else 2])
        proposal = drafter.propose(limit, sampler)
        kept = proposal.drafts()
        assert kept == fresh(proposal)
        assert drafter.last_drafts() == kept
        kinds.add(tuple(bool(d) and e == "lookup" for d, e in zip(kept, proposal.ended)))
        last = torch.tensor([c[-1] for c in committed])
        scores = target.verify(torch.cat([last[:, None], proposal.tokens], 1), proposal.lengths + 1)
        best = scores.logits.argmax(-1)  # [B, k+1]
        accepted = [next((i for i, t in enumerate(d) if t != int(best[b, i])), len(d)) for b, d in enumerate(kept)]
        next_token = torch.tensor([int(best[b, n]) for b, n in enumerate(accepted)])
        target.rollback(torch.tensor(accepted) + 1)
        drafter.commit(torch.tensor(accepted), next_token)
        for b in range(3):
            committed[b] += kept[b][: accepted[b]] + [int(next_token[b])]
        assert target.cached().tolist() == [len(c) - 1 for c in committed]
    assert any(any(k) and not all(k) for k in kinds), f"no round mixed lookup and model rows: {kinds}"


def test_a_cache_without_dead_slots_makes_its_mask_when_read(llama_target):
    cache = RaggedCache(llama_target, 2)
    ids = torch.tensor([[4, 5, 6], [7, 8, 9]])

    def consistent() -> None:
        mask = cache.mask
        assert tuple(mask.shape) == (cache.rows, cache.slots)
        assert mask.sum(1).tolist() == cache.live.tolist()
        assert cache.holes == (not bool(mask.all()))

    with torch.no_grad():
        cache.forward(ids)
        assert cache._mask is None and cache.slots == 3  # all live: no mask kept
        consistent()
        cache.forward(ids[:, :2])
        cache.keep(torch.tensor([5, 5]))  # the same for every row: an exact crop, still no dead slot
        assert cache.slots == 5 and not cache.holes
        consistent()
        cache.keep(torch.tensor([4, 2]))  # ragged: dead slots in row 1
        assert cache.holes and cache.mask.tolist() == [[True] * 4, [True, True, False, False]]
        consistent()
        cache.forward(ids[:, :1])
        consistent()
        cache.select(torch.tensor([0]))
        assert cache.rows == 1 and not cache.holes and cache.live.tolist() == [5]
        consistent()


def test_the_phase_clock_charges_each_phase_its_own_time_and_settles_when_read():
    """``PhaseClock`` (``Intervals`` on the CPU): each phase its own seconds, the round's reset by ``new_round``, the
    total kept across rounds; phases closed before a read are all counted by it."""
    import time

    from specdec.events import ACCEPT, PROPOSE, VERIFY, Events, PhaseClock

    clock = PhaseClock("cpu")
    events = Events([clock])
    with events.phase(PROPOSE):
        time.sleep(0.02)
    with events.phase(VERIFY):
        time.sleep(0.05)
    first = dict(clock.round)
    assert 0.02 <= first[PROPOSE] < 0.05 <= first[VERIFY] < 0.2 and first[ACCEPT] == 0.0
    clock.new_round()
    with events.phase(VERIFY):
        time.sleep(0.01)
    clock.new_round()  # the phase closed before this round began belongs to the last one
    assert clock.round_seconds == 0.0
    assert clock.total[VERIFY] == pytest.approx(first[VERIFY] + 0.01, abs=0.01)
    assert clock.total[PROPOSE] == first[PROPOSE]
