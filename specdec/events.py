"""What the round loop tells the world: phases, rounds and finished rows, as events to listeners.

The loop never times, counts or prints anything itself. It marks its phases (``prefill`` and
``draft_prefill`` when rows join; ``propose``, ``verify``, ``accept``, ``commit`` in a round) with ``Events.phase(name)`` and announces each
committed round (``round_committed``, one ``RoundEvent`` per row) and each round's summary
(``round_ended``). Listeners do the rest: ``PhaseClock`` measures the phases (synchronising CUDA
before reading the clock, so asynchronous kernels are charged to the phase that queued them), the
decoder's statistics read it, the console prints tokens as they come, a server streams them, and the
``auto`` speculation policy times rounds with and without drafting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.stats import RoundEvent

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


class Listener:
    """Receives the loop's events; every method is optional (a no-op here)."""

    def phase_started(self, phase: str) -> None:
        """A phase begins."""

    def phase_ended(self, phase: str) -> None:
        """A phase ends."""

    def round_committed(self, event: RoundEvent) -> None:
        """A row committed tokens this round (``event.row`` says which)."""

    def round_ended(self, summary: RoundSummary) -> None:
        """A round of the batch is over."""


class PhaseClock(Listener):
    """Seconds per phase: of the current round (``round``) and in total (``total``)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.total: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.round: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._started = 0.0

    def now(self) -> float:
        """perf_counter, after the device's queued work."""
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def new_round(self) -> None:
        """Start counting a new round."""
        self.round = dict.fromkeys(PHASES, 0.0)

    def phase_started(self, phase: str) -> None:
        self._started = self.now()

    def phase_ended(self, phase: str) -> None:
        seconds = self.now() - self._started
        self.round[phase] += seconds
        self.total[phase] += seconds

    @property
    def round_seconds(self) -> float:
        return sum(self.round.values())


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

    def round_committed(self, event: RoundEvent) -> None:
        for listener in self.listeners:
            listener.round_committed(event)

    def round_ended(self, summary: RoundSummary) -> None:
        for listener in self.listeners:
            listener.round_ended(summary)
