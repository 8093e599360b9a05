"""The serving engine: one ``Decoder`` driven by one worker thread, fed from a queue.

Continuous batching (Yu et al. 2022, "Orca: A Distributed Serving System for Transformer-Based
Generative Models": iteration-level scheduling; vLLM's scheduler): requests do not wait for a batch
to finish. The HTTP handlers (on the event loop) hand each request to the worker through a
thread-safe queue; at the next round boundary the worker ``Decoder.submit``s it and the decoder
lets it join the running batch (prefill, then rounds beside the others). Each row's committed tokens
come back as ``RoundEvent``s: the engine is a ``Listener`` of its decoder and forwards each one, as a
``Round`` with the round's draft counts, to its request's asyncio queue
(``loop.call_soon_threadsafe``), then a ``Finished`` item with the row's ``GenerationResult``. A finished row leaves the
batch at once (the decoder does this); a request whose client went away is cancelled (``Decoder.cancel``) and leaves
before its next round.

Contracts:
- Only the worker thread touches the decoder, its models and caches; handlers only enqueue. Where a core is spare
  (``prefill_beside``), the decoder's prefill thread runs the target on rows joining the batch, into caches of
  their own, which the worker merges between rounds.
- Every request gets a unique ``Request.index`` (its ``RoundEvent.row``), so events never mix.
- A row's tokens do not depend on the rows beside it: greedy rows equal the target's own greedy
  decoding (up to near ties of its two best logits), seeded sampled rows draw from their own generator.
- A request that asks for its prompt's log-probabilities (``Request.prompt_logprobs``: serving's ``echo``) is scored
  by the worker before it joins, with the others that arrived in the same step, in one forward of the target
  (``decode.prompt_logprobs``); one that asks for no new tokens (``max_new_tokens`` 0) finishes there.
- If a step raises, the caches are dropped and each row in flight is tried alone for one step, in a fresh decoder
  with its committed sequence prefilled anew: a row that raises again gets a ``Failed`` item, the others go on
  together in a fresh decoder (``_isolate``). A failure that only rows together raise fails nobody.
The engine knows nothing about HTTP or text: ``specdec.serve.app`` does the protocol and detokenizing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedTokenizerBase

from specdec.admission import BESIDE_ENV, prefill_beside, shares  # noqa: F401 (BESIDE_ENV: the switch, named here too)
from specdec.config import VerifyConfig
from specdec.decode import Decoder, Request, Row
from specdec.drafters import Drafter
from specdec.events import Listener, RoundSummary
from specdec.logprobs import TokenLogprob, prompt_logprobs
from specdec.schedules import Schedule
from specdec.serve import memory
from specdec.serve.background import Beside
from specdec.serve.metrics import ModelMetrics
from specdec.stats import MAX_NEW_TOKENS, GenerationResult, GenerationStats, RoundEvent
from specdec.target import Target

log = logging.getLogger("specdec.serve")

LOAD_INTERVAL_S = 0.5  # seconds between two samples of the load history
LOAD_SAMPLES = 240  # samples kept (two minutes)
IDLE_WAIT_S = 0.5  # the idle worker wakes this often (to sample the load and to see a stop)
STOPPING = "the server is shutting down: send the request again once it is back"  # what a request cut short gets (503)


@dataclass(frozen=True)
class Round:
    """What one round committed for a request, with the round's drafts."""

    tokens: list[int]  # the committed token ids (after stop truncation)
    kinds: list[str]  # one label per token: accepted / recovered / bonus / target
    drafted: int  # draft tokens verified for this request this round
    accepted: int  # of those, accepted
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asks (``Request.logprobs``)


@dataclass(frozen=True)
class Finished:
    """The last item of a request's stream: its result (tokens, figures, why it stopped)."""

    result: GenerationResult
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asks
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first None), when asked


@dataclass(frozen=True)
class Failed:
    """The last item of a request's stream when the engine could not decode it."""

    message: str
    status: int = 500  # the HTTP status it is answered with: 503 where the server is stopping (try again later)


Item = Round | Finished | Failed


class Job:
    """One request in flight: its ``Request``, the asyncio queue its items go to (or the ``sink`` that takes them:
    the pipe to an app in another process, ``specdec.serve.front``), its timings."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop | None,
                 sink: Callable[[Item], None] | None = None) -> None:
        self.request = request
        self.loop = loop
        self.sink = sink
        self.items: asyncio.Queue[Item] = asyncio.Queue()
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None  # perf_counter of its first committed token
        self.last_round_at: float | None = None  # perf_counter of its latest committed round
        self.row: Row | None = None  # its row in the decoder, once the worker took it
        self.drafted = 0  # drafts verified so far (each round's count is the difference)
        self.accepted = 0  # drafts accepted so far
        self.cancelled = False  # the client went away
        self.finished = False  # a Finished or Failed item was sent
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # scored before it joins, when it asks

    def push(self, item: Item) -> None:
        """Hand ``item`` to the request's handler (from the worker thread)."""
        if isinstance(item, (Finished, Failed)):
            self.finished = True
        if self.sink is not None:
            self.sink(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def next(self) -> Item:
        """The next item (rounds in commit order, then ``Finished`` or ``Failed``)."""
        return await self.items.get()


@dataclass(frozen=True)
class LoadSample:
    """The server's load over one sampling interval."""

    time: float  # seconds since the engine started
    running: int  # rows in the batch at the end of the interval
    waiting: int  # requests waiting to join
    batch: float  # rows per round, averaged over the interval's rounds (0 when idle)
    tokens_per_s: float  # tokens committed per second, all rows
    peak_batch: int = 0  # most rows in one round during the interval
    peak_waiting: int = 0  # most requests waiting at once during the interval


@dataclass
class Totals:
    """Counters since the engine started (all requests)."""

    requests: int = 0  # requests finished (cancelled ones included)
    cancelled: int = 0  # of those, cancelled (client gone)
    new_tokens: int = 0  # tokens committed
    rounds: int = 0  # row-rounds (one per row per round)
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted


@dataclass
class _Interval:
    """What the worker counts between two load samples."""

    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    rounds: int = 0
    rows: int = 0
    peak_rows: int = 0
    peak_waiting: int = 0


class Engine(Listener):
    """Decodes the requests handed to it, continuously batched, on its own worker thread."""

    def __init__(self, target: Target, drafter: Drafter, schedule: Schedule, *, batch_size: int,
                 tokenizer: PreTrainedTokenizerBase | None = None, verify: VerifyConfig | None = None,
                 metrics: ModelMetrics | None = None, speculate: str = "on", beside: Beside | None = None) -> None:
        self.target, self.drafter, self.schedule = target, drafter, schedule
        self.beside = beside  # the models' compile beside serving, until the switch to its graphs (``_switch``)
        self._held: list[Job] = []  # requests held while the rows in flight finish before the switch
        self.batch_size = batch_size
        self.tokenizer = tokenizer
        self.verify = verify or VerifyConfig()
        self.metrics = metrics
        self.speculate = speculate  # on / off / auto: shown by the page
        self.prefill_beside = prefill_beside(target)
        self.helper = shares(target)  # its products shared with the helper thread
        self.decoder = self._new_decoder()
        self._inbox: queue.SimpleQueue[tuple[str, Job | None]] = queue.SimpleQueue()
        self._jobs: dict[int, Job] = {}  # Request.index -> job, for the worker only
        self._indexes = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._started = time.perf_counter()
        self._interval = _Interval()
        self._load_lock = threading.Lock()
        self._load: deque[LoadSample] = deque(maxlen=LOAD_SAMPLES)
        self.totals = Totals()
        self.running = 0  # rows in the batch (read by other threads; written by the worker)
        self.waiting = 0  # requests not yet in the batch
        self.batch = 0  # rows in the latest round

    def _new_decoder(self) -> Decoder:
        return Decoder(self.target, self.drafter, self.schedule, verify=self.verify, batch_size=self.batch_size,
                       tokenizer=self.tokenizer, listeners=[self], prefill_beside=self.prefill_beside)

    # ------------------------------------------------------------------ the event loop's side

    def start(self) -> None:
        """Start the worker thread."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._work, name="specdec-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker after its current round; requests in flight get ``Failed``; a compile beside serving
        ends."""
        self._stopping = True
        beside, self.beside = self.beside, None
        if beside is not None:
            beside.stop()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None,
               sink: Callable[[Item], None] | None = None) -> Job:
        """Queue ``request`` (its ``index`` is replaced by a unique one); its items arrive on the job (on ``loop``),
        or go to ``sink``, called on the worker thread."""
        job = Job(replace(request, index=next(self._indexes)), loop, sink)
        self._inbox.put(("submit", job))
        return job

    def cancel(self, job: Job) -> None:
        """The client of ``job`` went away: its row leaves the batch before its next round."""
        if not job.finished:
            job.cancelled = True
            self._inbox.put(("cancel", job))

    def load_history(self) -> list[LoadSample]:
        """The load samples kept, oldest first."""
        with self._load_lock:
            return list(self._load)

    # ------------------------------------------------------------------------ the worker's side

    def _work(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                self._take_inbox(block=not self.decoder.busy and not self._switching())
                if self.decoder.busy and not self._stopping:
                    self._step()
                elif self._switching():
                    self._switch()
                self._sample_load()
                memory.trim()  # at most every TRIM_EVERY_S: the freed pages of past batches go back (issue 67)
            self._fail_all(STOPPING, status=503)

    def _take_inbox(self, block: bool) -> None:
        """Submit new requests and apply cancellations (at a round boundary)."""
        try:
            command, job = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        submitted = []
        while True:
            if command == "submit" and job is not None:
                submitted.append(job)
            elif command == "cancel" and job is not None and job.row is not None and not job.row.done:
                self.decoder.cancel(job.row)
            try:
                command, job = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._score_prompts([j for j in submitted if j.request.prompt_logprobs is not None and not j.cancelled])
        for job in submitted:
            if job.finished:  # scored, and nothing to generate
                continue
            self._submit(job)
        self._update_gauges()

    def _score_prompts(self, jobs: list[Job]) -> None:
        """The prompt log-probabilities of ``jobs`` (taken together), in one forward of the target; a job that asks
        for no new tokens (``max_new_tokens`` 0: log-likelihood scoring) finishes here."""
        if not jobs:
            return
        try:
            scored = prompt_logprobs(self.target, [j.request.ids for j in jobs],
                                     [j.request.prompt_logprobs or 0 for j in jobs])
        except Exception as err:  # the prompts could not be scored: these requests fail, serving goes on
            log.exception("scoring prompts failed")
            for job in jobs:
                job.push(Failed(f"scoring the prompt failed: {type(err).__name__}: {err}"))
                self._count_finished(job, "abort")
            return
        for job, logprobs in zip(jobs, scored):
            job.prompt_logprobs = logprobs
            if job.request.max_new_tokens == 0:
                stats = GenerationStats(prompt_tokens=job.request.prompt_tokens, lossless=True)
                job.push(Finished(GenerationResult([], stats, MAX_NEW_TOKENS, index=job.request.index),
                                  [], logprobs))
                self._count_finished(job, MAX_NEW_TOKENS)

    def _switching(self) -> bool:
        """Whether the compile beside serving has ended: new requests are held until the rows in flight finish and
        the engine switches to its graphs."""
        beside = self.beside  # read once: ``stop`` drops it from another thread
        return beside is not None and beside.ended()

    def _switch(self) -> None:
        """With no row in flight: load the compiled graphs (``Beside.apply``), start both models' caches afresh (static
        now) and the schedule's measurements (``forget``: they timed the eager step), then let the held requests in.
        Each request decodes eagerly or compiled from its start to its end."""
        beside, self.beside = self.beside, None
        if beside is not None and not self._stopping and beside.apply():
            self.target.reset()
            self.drafter.reset()
            if (forget := getattr(self.schedule, "forget", None)) is not None:
                forget()
            self.prefill_beside = prefill_beside(self.target)
            self.helper = shares(self.target)
            self.decoder = self._new_decoder()
        held, self._held = self._held, []
        for job in held:
            self._submit(job)
        self._update_gauges()

    def _submit(self, job: Job) -> None:
        if self._switching():
            self._held.append(job)
            return
        if job.cancelled:
            self._count_finished(job, "abort")
            return
        try:
            job.row = self.decoder.submit(job.request)
        except ValueError as err:
            job.push(Failed(str(err)))
            return
        self._jobs[job.request.index] = job
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(job.request.prompt_tokens)

    def _step(self) -> None:
        try:
            finished = self.decoder.step()
        except Exception:  # a step failed: fail only the rows that fail alone, keep serving
            log.exception("a decoding round failed")
            self._isolate()
            return
        for row in finished:
            self._finish(row)
        self._update_gauges()

    def _isolate(self) -> None:
        """After a failed step: drop the caches, then try each row in flight alone for one step (a decoder of one row,
        its committed sequence prefilled anew, ``Decoder.resume``); a row whose step raises again fails (``Failed``
        to its request), the others resume together in a fresh decoder, with their tokens, generators and figures.
        One row's failure (its logits processors, its stop strings, a prompt its model cannot take) then fails only
        its request, and a failure that only the rows together raise fails none. A seeded sampled row stays a sample
        of the target's distribution but may no longer equal its seeded output (the failed round drew from its
        generator). Costs a prefill per row and a round of one row per row, once per failure."""
        rows = self.decoder.in_flight()
        self._drop_rows()
        survivors = []
        for row in rows:
            if row.request.index not in self._jobs:
                continue
            if row.done:  # cancelled before the failed step
                self._finish(row)
                continue
            alone = Decoder(self.target, self.drafter, self.schedule, verify=self.verify, batch_size=1,
                            tokenizer=self.tokenizer, listeners=[self])
            alone.resume(row)
            try:
                finished = alone.step()
            except Exception as err:
                log.exception("a row failed alone: its request fails")
                job = self._jobs.pop(row.request.index)
                job.push(Failed(f"decoding failed: {type(err).__name__}: {err}"))
                self._count_finished(job, "abort")
            else:
                for done in finished:
                    self._finish(done)
                if not row.done:
                    survivors.append(row)
            self._drop_rows()
        self.decoder = self._new_decoder()
        for row in survivors:
            self.decoder.resume(row)
        self._update_gauges()

    def _drop_rows(self) -> None:
        """Drop every row from both models and the schedule (their caches start afresh)."""
        self.target.reset()
        self.drafter.reset()
        self.schedule.select(torch.zeros(0, dtype=torch.long, device=self.target.device))

    def _finish(self, row: Row) -> None:
        job = self._jobs.pop(row.request.index, None)
        if job is None:
            return
        if job.cancelled:
            self._count_finished(job, "abort")
            return
        result = row.result(None)
        job.push(Finished(result, row.logprobs if row.request.logprobs is not None else None, job.prompt_logprobs))
        self._count_finished(job, result.stop_reason)

    def _count_finished(self, job: Job, reason: str) -> None:
        self.totals.requests += 1
        self.totals.cancelled += reason == "abort"
        if self.metrics is not None:
            self.metrics.finished(reason, time.perf_counter() - job.submitted)

    def _fail_all(self, message: str, status: int = 500) -> None:
        """Every request in flight fails; the caches are dropped and a fresh decoder takes over."""
        for job in self._jobs.values():
            job.push(Failed(message, status))
            self._count_finished(job, "abort")
        self._jobs.clear()
        for job in self._held:
            job.push(Failed(message, status))
            self._count_finished(job, "abort")
        self._held.clear()
        while True:
            try:
                command, job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if command == "submit" and job is not None:
                job.push(Failed(message, status))
        self._drop_rows()
        self.decoder = self._new_decoder()
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.running = len(self.decoder.rows)
        self.waiting = len(self.decoder.waiting) + self.decoder.prefilling + self._inbox.qsize() + len(self._held)
        self._interval.peak_waiting = max(self._interval.peak_waiting, self.waiting)
        if self.metrics is not None:
            self.metrics.running.set(self.running)
            self.metrics.waiting.set(self.waiting)

    def _sample_load(self) -> None:
        now = time.perf_counter()
        span = now - self._interval.started
        if span < LOAD_INTERVAL_S:
            return
        i = self._interval
        sample = LoadSample(time=now - self._started, running=self.running, waiting=self.waiting,
                            batch=i.rows / i.rounds if i.rounds else 0.0, tokens_per_s=i.tokens / span,
                            peak_batch=i.peak_rows, peak_waiting=i.peak_waiting)
        with self._load_lock:
            self._load.append(sample)
        self._interval = _Interval(started=now)

    # ------------------------------------------------------------------- the decoder's events

    def round_committed(self, event: RoundEvent) -> None:
        job = self._jobs.get(event.row)
        if job is None or job.row is None:
            return
        now = time.perf_counter()
        stats = job.row.stats
        drafted, accepted = stats.drafted - job.drafted, stats.accepted - job.accepted
        job.drafted, job.accepted = stats.drafted, stats.accepted
        t = self.totals
        t.new_tokens += len(event.tokens)
        t.rounds += 1
        t.drafted += drafted
        t.accepted += accepted
        if self.metrics is not None:
            self.metrics.round(drafted, accepted, len(event.tokens), self.totals)
            if job.first_token_at is None:
                self.metrics.ttft.observe(now - job.submitted)
            else:
                self.metrics.itl.observe(now - (job.last_round_at or now))
        if job.first_token_at is None:
            job.first_token_at = now
        job.last_round_at = now
        if not job.cancelled:
            row = job.row
            logprobs = (row.logprobs[len(row.logprobs) - len(event.tokens):] if row.request.logprobs is not None
                        else None)
            job.push(Round(event.tokens, event.kinds, drafted, accepted, logprobs))

    def round_ended(self, summary: RoundSummary) -> None:
        self._interval.tokens += summary.tokens
        self._interval.rounds += 1
        self._interval.rows += summary.rows
        self._interval.peak_rows = max(self._interval.peak_rows, summary.rows)
        self.batch = summary.rows

