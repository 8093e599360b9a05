"""What the round loop tells the world: phases, rounds and finished rows, as events to listeners.

The loop never times, counts or prints anything itself. It marks its phases (``prefill`` and
``draft_prefill`` when rows join; ``propose``, ``verify``, ``accept``, ``commit`` in a round) with
``Events.phase(name)`` and announces each committed round (``round_committed``, one ``RoundEvent`` per row) and each
round's summary (``round_ended``); for the figures it also tells of rows queued (``submitted``), rows prefilled as they
join (``prefilled``) and each row's part of a round (``row_round``). Listeners do the rest: ``PhaseClock`` measures the
phases (``Intervals``: on CUDA by events the device times, so asynchronous kernels are charged to the phase that queued
them, without a wait per phase), the decoder's figures are a listener (``Tally``), the console prints tokens as they
come, a server streams them, and the
``auto`` speculation policy times rounds with and without drafting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.stats import BatchStats, GenerationStats, RoundEvent

PREFILL, DRAFT_PREFILL = "prefill", "draft_prefill"  # rows joining: the target's prefill, the drafter's
PROPOSE, VERIFY, ACCEPT, COMMIT = "propose", "verify", "accept", "commit"  # the phases of a round
PHASES = (PREFILL, DRAFT_PREFILL, PROPOSE, VERIFY, ACCEPT, COMMIT)


@dataclass(frozen=True)
class RoundSummary:
    """One round of the whole batch."""

    rows: int  # rows in the batch during the round
    drafted: int  # draft tokens verified, all rows
    tokens: int  # tokens committed, all rows
    seconds: float  # wall time of the round's phases
    accepted: int = 0  # draft tokens accepted, all rows
    drafter_calls: int = 0  # the drafter's forwards this round


@dataclass(frozen=True)
class Prefilled:
    """Rows prefilled into the batch as they join, or the drafter reading the batch's rows again after sitting out
    (``rows`` empty)."""

    rows: tuple[GenerationStats, ...]  # the joining rows' figures
    target_calls: int  # the target's forwards
    drafter_calls: int  # the drafter's forwards
    target_s: float  # seconds of the target's prefill
    beside: bool = False  # run beside the batch, on another thread: its seconds are no phase of the clock


@dataclass(frozen=True)
class RowRound:
    """One row's part of a round, told before its ``round_committed``."""

    stats: GenerationStats  # the row's figures
    drafted: int  # draft tokens verified
    accepted: int  # of those, accepted
    emitted: int  # tokens committed (after its stops)
    ended: str  # why its draft ended ("" when the drafter does not say)
    drafter_calls: int  # the drafter's forwards this round (shared by the batch)


class Listener:
    """Receives the loop's events; every method is optional (a no-op here)."""

    def phase_started(self, phase: str) -> None:
        """A phase begins."""

    def phase_ended(self, phase: str) -> None:
        """A phase ends."""

    def submitted(self, stats: GenerationStats) -> None:
        """A row was queued (a new request, or a row resumed from another decoder), with its figures."""

    def prefilled(self, prefilled: Prefilled) -> None:
        """Rows were prefilled into the batch, or the drafter read the batch's rows again."""

    def row_round(self, part: RowRound) -> None:
        """A row's part of the round, before its ``round_committed``."""

    def round_committed(self, event: RoundEvent) -> None:
        """A row committed tokens this round (``event.row`` says which)."""

    def round_ended(self, summary: RoundSummary) -> None:
        """A round of the batch is over."""


class Intervals:
    """Seconds between a ``start(key)`` and the next ``stop(key)``, handed out by ``settle()``.

    On a CPU each mark reads ``perf_counter``. On a CUDA device each mark records an event on the current stream, and
    the device times it when it reaches it: the kernels an interval queued are charged to it, and no mark waits for
    the device (a wait at each mark kept the host from queuing the next work while the device ran: 8 waits a round
    of the decoder). ``settle`` waits once, for the last mark, when the seconds are read."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._open: dict[str, object] = {}
        self._closed: list[tuple[str, object, object]] = []

    def _mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, key: str) -> None:
        self._open[key] = self._mark()

    def stop(self, key: str) -> None:
        self._closed.append((key, self._open.pop(key), self._mark()))

    def settle(self) -> list[tuple[str, float]]:
        """(key, seconds) of every interval stopped since the last call, in order."""
        if not self._closed:
            return []
        closed, self._closed = self._closed, []
        if self.cuda:
            closed[-1][2].synchronize()  # type: ignore[union-attr]
            return [(key, start.elapsed_time(end) / 1e3) for key, start, end in closed]  # type: ignore[union-attr]
        return [(key, end - start) for key, start, end in closed]  # type: ignore[operator]


class PhaseClock(Listener):
    """Seconds per phase: of the current round (``round``) and in total (``total``), read from ``Intervals``."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.intervals = Intervals(device)
        self._total: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._round: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    def _settle(self) -> None:
        for phase, seconds in self.intervals.settle():
            self._round[phase] += seconds
            self._total[phase] += seconds

    @property
    def round(self) -> dict[str, float]:
        self._settle()
        return self._round

    @property
    def total(self) -> dict[str, float]:
        self._settle()
        return self._total

    def new_round(self) -> None:
        """Start counting a new round (the last round's phases settled first)."""
        self._settle()
        self._round = dict.fromkeys(PHASES, 0.0)

    def phase_started(self, phase: str) -> None:
        self.intervals.start(phase)

    def phase_ended(self, phase: str) -> None:
        self.intervals.stop(phase)

    @property
    def round_seconds(self) -> float:
        return sum(self.round.values())


class Tally(Listener):
    """The figures of a run, from the loop's events: each row's ``GenerationStats`` (the row's own object, carried by
    the events) and the run's ``BatchStats`` (``stats``; ``figures()`` adds the times from the ``clock``)."""

    def __init__(self, clock: PhaseClock) -> None:
        self.clock = clock
        self.stats = BatchStats()
        self.started = time.perf_counter()
        self.beside_s = 0.0  # seconds of the target's prefills run beside the batch

    def submitted(self, stats: GenerationStats) -> None:
        self.stats.rows += 1
        self.stats.lossless = self.stats.lossless and stats.lossless

    def prefilled(self, prefilled: Prefilled) -> None:
        p = prefilled
        if p.beside:
            self.beside_s += p.target_s
        for row in p.rows:  # added: a resumed row keeps its counts
            row.target_calls += p.target_calls
            row.drafter_calls += p.drafter_calls
            row.target_time_s += p.target_s
            row.drafter_time_s += self.clock.round[DRAFT_PREFILL]
        self.stats.target_calls += p.target_calls
        self.stats.drafter_calls += p.drafter_calls

    def row_round(self, part: RowRound) -> None:
        row = part.stats
        row.record_round(part.drafted, part.accepted, part.emitted, part.ended)
        row.target_calls += 1
        row.drafter_calls += part.drafter_calls
        row.target_time_s += self.clock.round[VERIFY]
        row.drafter_time_s += self.clock.round[PROPOSE]

    def round_ended(self, summary: RoundSummary) -> None:
        s = self.stats
        s.rounds += 1
        s.row_rounds += summary.rows
        s.max_rows = max(s.max_rows, summary.rows)
        s.drafted += summary.drafted
        s.accepted += summary.accepted
        s.new_tokens += summary.tokens
        s.target_calls += 1
        s.drafter_calls += summary.drafter_calls

    def figures(self) -> BatchStats:
        """The run's figures so far, times included."""
        s, total = self.stats, self.clock.total
        s.wall_time_s = time.perf_counter() - self.started
        s.prefill_time_s = total[PREFILL] + total[DRAFT_PREFILL] + self.beside_s
        s.propose_time_s, s.verify_time_s = total[PROPOSE], total[VERIFY]
        s.accept_time_s, s.commit_time_s = total[ACCEPT], total[COMMIT]
        return s


class OnRound(Listener):
    """Calls a user's ``on_round(RoundEvent)`` for every row's committed round."""

    def __init__(self, callback: Callable[[RoundEvent], None]) -> None:
        self.callback = callback

    def round_committed(self, event: RoundEvent) -> None:
        self.callback(event)


class _Phase:
    """The context of one phase (a plain class: cheaper per round than a generator-based context manager)."""

    __slots__ = ("listeners", "name")

    def __init__(self, listeners: list[Listener], name: str) -> None:
        self.listeners, self.name = listeners, name

    def __enter__(self) -> None:
        for listener in self.listeners:
            listener.phase_started(self.name)

    def __exit__(self, *exc: object) -> None:
        for listener in reversed(self.listeners):
            listener.phase_ended(self.name)


class Events:
    """Fans the loop's events out to its listeners, in order (phase ends in reverse order)."""

    def __init__(self, listeners: Sequence[Listener] = ()) -> None:
        self.listeners = list(listeners)

    def add(self, listener: Listener) -> None:
        self.listeners.append(listener)

    def phase(self, name: str) -> _Phase:
        """``with events.phase(name):`` tells the listeners that the phase starts, then that it ended (even on
        an error)."""
        return _Phase(self.listeners, name)

    def submitted(self, stats: GenerationStats) -> None:
        for listener in self.listeners:
            listener.submitted(stats)

    def prefilled(self, prefilled: Prefilled) -> None:
        for listener in self.listeners:
            listener.prefilled(prefilled)

    def row_round(self, part: RowRound) -> None:
        for listener in self.listeners:
            listener.row_round(part)

    def round_committed(self, event: RoundEvent) -> None:
        for listener in self.listeners:
            listener.round_committed(event)

    def round_ended(self, summary: RoundSummary) -> None:
        for listener in self.listeners:
            listener.round_ended(summary)
