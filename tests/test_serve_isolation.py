"""A failed step of the serving engine fails only the requests whose rows fail alone (issue 67).

The engine (``specdec.serve.engine``, in this process, over a ToyLM pair) decodes three greedy requests at once.
One request's logits processor raises once its sequence is long enough: that request alone gets ``Failed``, naming
the error; the two beside it finish, each equal to the target's own greedy decoding of its prompt (full forwards
without a cache). A failure that no row raises alone (a drafter that fails one step, as issue 67's race did) fails
nobody: every request finishes equal to its reference. Before, a failed step failed every request in flight.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import build_toy
from transformers import LogitsProcessor, LogitsProcessorList

from specdec.config import SamplingConfig
from specdec.decode import Request
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.schedules import Constant
from specdec.serve.engine import Engine, Failed, Finished
from specdec.target import make_target

pytestmark = pytest.mark.usefixtures("one_thread")

V = 12
NEW = 16
PROMPTS = [[1, 2, 3, 1, 2], [4, 5, 6], [7, 8, 7, 8, 7, 9]]
TARGET = build_toy(vocab_size=V, seed=0, scale=2.0)


def greedy(prompt: list[int], new: int = NEW) -> list[int]:
    """The target's greedy continuation of ``prompt``, by full forwards without a cache."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(new):
            ids.append(int(TARGET(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


class Boom(LogitsProcessor):
    """Raises once the sequence it processes reaches ``length`` tokens (a caller's processor that breaks)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] >= self.length:
            raise RuntimeError("the processor broke")
        return scores


class FailsOnce(NgramDrafter):
    """Prompt lookup whose ``propose`` raises on its ``at``-th call only (a failure of the batch, not of a row)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.calls, self.at = 0, at

    def propose(self, limit, sampler, stop=None):
        self.calls += 1
        if self.calls == self.at:
            raise IndexError("list index out of range")
        return super().propose(limit, sampler, stop)


def serve(drafter, requests: list[Request]) -> list[Finished | Failed]:
    """Each request's last item from an engine of batch size 3 running ``drafter``."""
    target = make_target(TARGET)
    engine = Engine(target, drafter.align(target), Constant(3), batch_size=3)

    async def run() -> list[Finished | Failed]:
        loop = asyncio.get_running_loop()
        jobs = [engine.submit(r, loop) for r in requests]
        last = []
        for job in jobs:
            while not isinstance(item := await asyncio.wait_for(job.next(), 60), (Finished, Failed)):
                pass
            last.append(item)
        return last

    engine.start()
    try:
        return asyncio.run(run())
    finally:
        engine.stop()


@pytest.mark.parametrize("kind", ["ngram", "model"])
def test_a_row_that_fails_alone_fails_only_its_request(kind):
    broken = len(PROMPTS[1]) + 5  # row 1 breaks after a few rounds, beside the others
    requests = [Request(p, NEW, SamplingConfig(), index=i,
                        processors=LogitsProcessorList([Boom(broken)]) if i == 1 else None)
                for i, p in enumerate(PROMPTS)]
    drafter = NgramDrafter() if kind == "ngram" else ModelDrafter(build_toy(vocab_size=V, seed=1))
    first, failed, third = serve(drafter, requests)
    assert isinstance(failed, Failed) and "RuntimeError: the processor broke" in failed.message
    for item, prompt in ((first, PROMPTS[0]), (third, PROMPTS[2])):
        assert isinstance(item, Finished), item
        assert item.result.tokens == greedy(prompt)


def test_a_failure_no_row_raises_alone_fails_nobody():
    requests = [Request(p, NEW, SamplingConfig(), index=i) for i, p in enumerate(PROMPTS)]
    items = serve(FailsOnce(at=3), requests)
    for item, prompt in zip(items, PROMPTS):
        assert isinstance(item, Finished), item
        assert item.result.tokens == greedy(prompt)
        assert len(item.result.tokens) == NEW and item.result.stats.new_tokens == NEW
