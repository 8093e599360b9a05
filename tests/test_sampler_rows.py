"""A sampled row draws the same random numbers whether it is verified alone or beside other rows.

The verifier applies each rule to its own rows (``Sampler.select``); the one sampled row of a batch
whose other rows are greedy is then a sampler of one row with one generator. That sampler used to
take the shared-generator path and draw the batch's full draft width instead of the row's own draft
count, so its random stream, and its seeded output, depended on how far the rows beside it drafted
(found by the server's load test with the heuristic schedule, issue 20).
"""

from __future__ import annotations

import torch
from conftest import truncated_copy

from specdec.config import SamplingConfig, VerifyConfig
from specdec.decode import Decoder, Request
from specdec.drafters import ModelDrafter
from specdec.sampling import Sampler, make_generator
from specdec.schedules import DraftPlan, Schedule
from specdec.target import make_target


def test_one_row_selected_from_a_batch_draws_only_its_own_count():
    greedy, sampled = SamplingConfig(), SamplingConfig(temperature=1.0, seed=5)
    generators = [make_generator(None, "cpu"), make_generator(5, "cpu")]
    one = Sampler.per_row([greedy, sampled], generators).select(torch.tensor([1]))
    u = one.uniform(torch.tensor([2]), 5, "cpu")  # [1, 5]: two draws, then padding
    fresh = make_generator(5, "cpu")
    assert torch.equal(u[0, :2], torch.rand(2, generator=fresh)) and u[0, 2:].tolist() == [1.0] * 3
    assert torch.equal(torch.rand(3, generator=generators[1]), torch.rand(3, generator=fresh))  # nothing more drawn
    shared = Sampler.create(sampled, "cpu")  # one generator drawing for a whole batch, vectorised
    assert torch.equal(shared.uniform(torch.tensor([1, 0, 2]), 4, "cpu"),
                       torch.rand((3, 4), generator=make_generator(5, "cpu")))


class ByJoin(Schedule):
    """The i-th row to join drafts ``limits[i]`` tokens every round."""

    def __init__(self, limits: list[int]) -> None:
        self.coming, self.state = list(limits), []

    def add(self, rows: int) -> None:
        self.state += self.coming[:rows]
        del self.coming[:rows]

    def select(self, rows: torch.Tensor) -> None:
        self.state = [self.state[i] for i in rows.tolist()]

    def plan(self, rows: int, device: torch.device | str) -> DraftPlan:
        return DraftPlan(torch.tensor(self.state, dtype=torch.long, device=device))


def test_a_seeded_row_beside_a_greedy_row_that_drafts_further_equals_itself_alone(llama_target):
    drafter_model = truncated_copy(llama_target, 1)
    target = make_target(llama_target)

    def decode(requests: list[Request], limits: list[int]) -> list[list[int]]:
        drafter = ModelDrafter(drafter_model).align(target)
        decoder = Decoder(target, drafter, ByJoin(limits), verify=VerifyConfig(), batch_size=len(requests))
        rows = [decoder.submit(r) for r in requests]
        with torch.inference_mode():
            decoder.run()
        return [row.tokens for row in rows]

    greedy = Request([3, 4, 5, 6], 16, SamplingConfig(), index=0)
    sampled = Request([7, 8, 9], 16, SamplingConfig(temperature=1.0, seed=11), index=1)
    alone = decode([sampled], [2])[0]
    assert decode([greedy, sampled], [5, 2])[1] == alone
