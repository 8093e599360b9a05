"""How many tokens each row drafts next: schedules behind one base class and a registry.

A ``Schedule`` decides per row, before each round, how many tokens to draft (``limits``; the loop
then caps them by the room each row has left), may stop rows within a round (``stop``, a
``StopRule`` the drafter asks after each drafted position), and learns from each round's outcome
(``update``). Rows join (``add``) and leave (``select``) with the batch.

- ``constant``: gamma tokens every round (Leviathan et al. 2023).
- ``Crossover`` wraps another schedule for ``speculate="auto"``: the first rounds at each batch size
  (bucketed to powers of two) alternate between drafting as the inner schedule says and not drafting
  at all (plain decoding through the same loop), timed by the loop's events; from then on that batch
  size drafts only if its rounds produced more tokens per second. Batched verification gets dearer
  as the batch grows, so speculation that pays at batch 1 can lose at batch 16 on the same machine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from specdec.acceptance import Verdict
from specdec.drafters.base import Proposal, StopRule
from specdec.events import Listener, RoundSummary


class Schedule(ABC):
    """How far each row drafts (see the module docstring)."""

    stop: StopRule | None = None  # a within-round stop rule, or None

    @abstractmethod
    def limits(self, rows: int, device: torch.device | str) -> torch.Tensor:
        """[B] long: the tokens each row would draft this round (before the room caps)."""

    def update(self, proposal: Proposal, verdict: Verdict) -> None:
        """Learn from a round's drafts and their verdict."""

    def add(self, rows: int) -> None:
        """``rows`` rows join after the current ones."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the rows ``rows`` [B']."""


class Constant(Schedule):
    """gamma drafts per row, every round."""

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def limits(self, rows: int, device: torch.device | str) -> torch.Tensor:
        return torch.full((rows,), self.gamma, dtype=torch.long, device=device)


def batch_bucket(rows: int) -> int:
    """The power of two at or above ``rows``: batch sizes that share a crossover measurement."""
    return 1 << max(0, rows - 1).bit_length()


class Crossover(Schedule, Listener):
    """``speculate="auto"``: per batch size, draft only where drafting measured faster than not drafting."""

    def __init__(self, inner: Schedule, trial_rounds: int = 6) -> None:
        self.inner = inner
        self.trial_rounds = trial_rounds  # timed rounds of each mode per batch-size bucket
        self.choice: dict[int, bool] = {}  # bucket -> draft?
        self._trials: dict[int, dict[bool, list[float]]] = {}  # bucket -> mode -> [rounds, tokens, seconds]
        self._mode: tuple[int, bool] | None = None  # (bucket, drafting) of the round in flight

    @property
    def stop(self) -> StopRule | None:  # type: ignore[override]
        return self.inner.stop

    def limits(self, rows: int, device: torch.device | str) -> torch.Tensor:
        bucket = batch_bucket(rows)
        drafting = self.choice.get(bucket)
        if drafting is None:  # still measuring: alternate the two modes, drafting first
            trials = self._trials.setdefault(bucket, {True: [0, 0, 0.0], False: [0, 0, 0.0]})
            drafting = trials[True][0] <= trials[False][0]
            self._mode = (bucket, drafting)
        else:
            self._mode = None
        return self.inner.limits(rows, device) if drafting else torch.zeros(rows, dtype=torch.long, device=device)

    def round_ended(self, summary: RoundSummary) -> None:
        if self._mode is None:
            return
        bucket, drafting = self._mode
        trials = self._trials[bucket]
        record = trials[drafting]
        record[0] += 1
        record[1] += summary.tokens
        record[2] += summary.seconds
        if all(trials[m][0] >= self.trial_rounds for m in (True, False)):
            speed = {m: trials[m][1] / trials[m][2] if trials[m][2] > 0 else 0.0 for m in (True, False)}
            self.choice[bucket] = speed[True] >= speed[False]

    def update(self, proposal: Proposal, verdict: Verdict) -> None:
        self.inner.update(proposal, verdict)

    def add(self, rows: int) -> None:
        self.inner.add(rows)

    def select(self, rows: torch.Tensor) -> None:
        self.inner.select(rows)


SCHEDULES: dict[str, Callable[..., Schedule]] = {"constant": Constant}


def register_schedule(name: str, factory: Callable[..., Schedule]) -> None:
    """Make the schedule ``name`` available to ``make_schedule`` (and the CLI)."""
    SCHEDULES[name] = factory


def make_schedule(gamma: int, speculate: str = "on") -> Schedule:
    """The constant schedule of ``gamma``, wrapped in ``Crossover`` for ``speculate="auto"``."""
    schedule: Schedule = Constant(gamma)
    return Crossover(schedule) if speculate == "auto" else schedule
