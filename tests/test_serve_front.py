"""The pipe between `specdec serve`'s HTTP front and its engines (`specdec.serve.front`), in one process.

The front's `Link` and the engines' `Bridge` are joined by a real `multiprocessing` pipe, the engine a stand-in that
answers on a thread of its own as the worker does: a request's rounds and its result reach the front's job in order,
the metrics are asked across, a cancellation reaches the engine, a request the engine cannot take fails alone (the
bridge goes on), and when the engines' end closes every request in flight fails with the reason and the front is
told to stop. The whole server across two processes: tests/test_serve.py.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading

import pytest

from specdec.config import SamplingConfig, VerifyConfig
from specdec.decode import Request
from specdec.serve.app import ServedModel
from specdec.serve.engine import Failed, Finished, Job, Round
from specdec.serve.front import GONE, Bridge, Link
from specdec.serve.metrics import ServerMetrics
from specdec.stats import GenerationResult, GenerationStats


class StandIn:
    """An engine that commits two rounds and finishes each request on a thread, as the worker would."""

    def __init__(self) -> None:
        self.cancelled: list[Job] = []
        self.refuse = False

    def submit(self, request: Request, loop: object, sink=None) -> Job:
        if self.refuse:
            raise ValueError("no room for this one")
        job = Job(request, None, sink)

        def work() -> None:
            job.push(Round(request.ids[:2], ["accepted", "bonus"], 2, 1))
            job.push(Round([7], ["recovered"], 1, 0))
            job.push(Finished(GenerationResult(request.ids[:2] + [7], GenerationStats(), "max_new_tokens")))

        threading.Thread(target=work, daemon=True).start()
        return job

    def cancel(self, job: Job) -> None:
        self.cancelled.append(job)


def served(engine: StandIn) -> ServedModel:
    return ServedModel("m", engine, None, 100, None, frozenset(), SamplingConfig(), 8, VerifyConfig())  # type: ignore[arg-type]


@pytest.fixture
def joined():
    """(the front's link, the stand-in engine, the engines' end of the pipe, whether the front was told to stop)."""
    front, engines = multiprocessing.get_context("spawn").Pipe()
    engine = StandIn()
    threading.Thread(target=Bridge([served(engine)], ServerMetrics(), engines).serve, daemon=True).start()
    stopped = threading.Event()
    link = Link(front, on_close=stopped.set)
    yield link, engine, engines, stopped
    engines.close()


async def drain(job: Job) -> list:
    items = [await asyncio.wait_for(job.next(), 10)]
    while not isinstance(items[-1], (Finished, Failed)):
        items.append(await asyncio.wait_for(job.next(), 10))
    return items


def request() -> Request:
    return Request([5, 6, 9], 8, SamplingConfig())


def test_rounds_and_result_reach_the_job_in_order_and_questions_are_answered(joined):
    link, _, _, _ = joined

    async def run() -> tuple[list, bytes]:
        job = link.submit("m", request(), asyncio.get_running_loop())
        return await drain(job), await link.ask(None, "metrics")

    items, metrics = asyncio.run(run())
    assert [type(i).__name__ for i in items] == ["Round", "Round", "Finished"]
    assert [i.tokens for i in items[:2]] == [[5, 6], [7]] and items[2].result.tokens == [5, 6, 7]
    assert b"vllm:num_requests_running" in metrics  # the engines' ServerMetrics, asked across the pipe


def test_a_cancellation_reaches_the_engine(joined):
    link, engine, _, _ = joined
    engine.submit = lambda request, loop, sink=None: Job(request, None, sink)  # decodes until cancelled

    async def run() -> Job:
        job = link.submit("m", request(), asyncio.get_running_loop())
        link.cancel(job)
        for _ in range(100):  # the bridge's thread takes it a moment later
            if engine.cancelled:
                break
            await asyncio.sleep(0.05)
        return job

    job = asyncio.run(run())
    assert job.cancelled
    assert [j.request.ids for j in engine.cancelled] == [[5, 6, 9]]  # the engines' own job of that request


def test_a_request_the_engine_refuses_fails_alone(joined):
    link, engine, _, _ = joined

    async def run() -> tuple[list, list]:
        engine.refuse = True
        refused = await drain(link.submit("m", request(), asyncio.get_running_loop()))
        engine.refuse = False
        return refused, await drain(link.submit("m", request(), asyncio.get_running_loop()))

    refused, served_after = asyncio.run(run())
    assert len(refused) == 1 and isinstance(refused[0], Failed) and "no room for this one" in refused[0].message
    assert isinstance(served_after[-1], Finished)  # the bridge went on serving


def test_requests_in_flight_fail_when_the_engines_end():
    front, engines = multiprocessing.get_context("spawn").Pipe()  # nothing answers at the engines' end
    stopped = threading.Event()
    link = Link(front, on_close=stopped.set)

    async def run() -> list:
        job = link.submit("m", request(), asyncio.get_running_loop())
        await asyncio.sleep(0.2)
        engines.close()  # as the engines' process ending closes it
        return await drain(job)

    items = asyncio.run(run())
    assert len(items) == 1 and isinstance(items[0], Failed) and items[0].message == GONE
    assert stopped.wait(10), "the front was not told to stop"
    assert link.closed
    with pytest.raises(ConnectionError, match=GONE):
        link.send(("cancel", 0))
