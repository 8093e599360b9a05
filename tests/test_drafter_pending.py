"""A model drafter keeps each row's newest committed token pending, even when it already forwarded it.

Rows that draft nothing in a round (a lookup row of ``LookupDrafter``, or a row at its limit) still
have a token forwarded through the drafter beside the drafting rows. When that token happens to be
exactly what the row then commits, the drafter used to keep it cached and leave the row with nothing
pending: the row's next draft then started from the wrong position, and a batch of such rows alone
crashed on a forward of zero tokens (found by the server's load test, issue 20).
"""

from __future__ import annotations

import torch
from conftest import truncated_copy

from specdec.batch import PromptBatch
from specdec.config import SamplingConfig
from specdec.drafters import ModelDrafter
from specdec.sampling import Sampler
from specdec.target import make_target


def test_a_row_that_commits_its_forwarded_token_still_drafts_from_it(llama_target):
    drafter_model = truncated_copy(llama_target, 1)
    drafter = ModelDrafter(drafter_model).align(make_target(llama_target))
    drafter.prefill(PromptBatch.from_lists([[3, 4, 5], [6, 7, 8, 9]], "cpu"))
    sampler = Sampler.create(SamplingConfig(), "cpu", rows=2)
    proposal = drafter.propose(torch.tensor([3, 0]), sampler)  # row 1 drafts nothing, yet a token is forwarded
    assert proposal.lengths.tolist() == [3, 0] and proposal.k == 3
    forwarded = int(proposal.tokens[1, 0])  # what the drafter forwarded for row 1 first
    drafter.commit(torch.tensor([1, 0]), torch.tensor([11, forwarded]))  # row 1 commits exactly that token
    assert all(pending for pending in drafter.pending), drafter.pending  # the newest token waits in each row
    assert drafter.cache.live.tolist() == [4, 4]  # committed tokens minus the pending one, per row
    drafter.select(torch.tensor([1]))  # row 1 alone
    drafts = drafter.propose(torch.tensor([2]), Sampler.create(SamplingConfig(), "cpu")).drafts()

    fresh = ModelDrafter(drafter_model).align(make_target(llama_target))  # the same row, prefilled from scratch
    fresh.prefill(PromptBatch.from_lists([[6, 7, 8, 9, forwarded]], "cpu"))
    assert drafts == fresh.propose(torch.tensor([2]), Sampler.create(SamplingConfig(), "cpu")).drafts()
