"""Rows into the batch: the queue, the target's prefill (in turn, or beside the batch on another thread), the
drafter's sit-out, and whether the models' rows can share a forward at all.

``Decoder`` holds one ``Admission`` and asks it at each round boundary for the rows that join (``join``) and, before
each round, whether the drafter drafts (``seat_drafter``). The decoder owns the batch (its rows, their newest tokens,
the sampler); admission owns what is not yet in it and tells the listeners what joining cost (``Events.prefilled``).

Contracts:
- Rows join in the order they were queued, up to ``batch_size`` (one at a time where ``rows_apart``); a row with no
  room left (or cancelled) never joins: ``join`` returns it finished.
- ``prefill_beside``: rows joining a batch that is decoding are prefilled by the target on another thread
  (``Target.prefill_beside``) while the batch goes on, and join at the first round boundary after (at once where the
  batch has emptied meanwhile); one such prefill at a time; its error is raised on the decoding thread.
  Measurements: docs/journal/2026-11-29-prefill-beside.md, "Prompts prefilled beside the batch, on the second core".
- The drafter sits out while the schedule has settled the batch's size as plain decoding
  (``Schedule.settled_plain``): it drops its rows and reads every row's committed sequence again (one prefill)
  before the next round that drafts. Measurements: docs/benchmarks.md (the drafter sitting out).
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from specdec import kernels
from specdec.batch import PromptBatch
from specdec.config import switch
from specdec.drafters import Drafter
from specdec.events import DRAFT_PREFILL, PREFILL, Events, PhaseClock, Prefilled
from specdec.schedules import DraftPlan, Schedule
from specdec.target import Target
from specdec.threads import room_beside

if TYPE_CHECKING:
    from specdec.decode import Row

BESIDE_ENV = "SPECDEC_PREFILL_BESIDE"  # auto (default) | on | off (``config.SWITCHES``)


def prefill_beside(target: Target) -> bool:
    """Whether a server's decoder prefills rows joining its batch on another thread while the batch decodes:
    ``SPECDEC_PREFILL_BESIDE`` ``on`` / ``off``, else (``auto``) on a CPU target where the machine has cores for a
    second forward (``threads.room_beside``) and the target's products are not shared with the blocked operator's
    helper thread already (``kernels.shares``; docs/journal/2026-12-04-helper-thread.md, "A helper thread on the idle
    core")."""
    mode = switch(BESIDE_ENV)
    if mode != "auto":
        return mode == "on"
    return torch.device(target.device).type == "cpu" and room_beside() and not shares(target)


def shares(target: Target) -> bool:
    """Whether ``target``'s products are shared with the blocked operator's helper thread (``kernels.shares``; a
    target without a model of its own: no)."""
    model = getattr(target, "model", None)
    return model is not None and kernels.shares(model)


def prompts_of(rows: list[Row], device: torch.device, committed: bool = False) -> PromptBatch:
    """``rows``' prompts as a batch (``committed``: each with its new tokens so far), with their sources
    (encoder-decoder targets)."""
    ids = [r.request.ids + r.tokens if committed else r.request.ids for r in rows]
    sources = None if rows[0].request.source is None else [r.request.source for r in rows]
    return PromptBatch.from_lists(ids, device, sources)


AddRows = Callable[[list["Row"], PromptBatch], None]  # the decoder's: rows both models hold join its batch


class Admission:
    """What is not yet in the batch (waiting rows, a prefill beside it) and whether the drafter holds the rows."""

    def __init__(self, target: Target, drafter: Drafter, schedule: Schedule, events: Events, clock: PhaseClock,
                 batch_size: int, prefill_beside: bool = False) -> None:
        self.target, self.drafter, self.schedule = target, drafter, schedule
        self.events, self.clock = events, clock
        self.batch_size = batch_size
        self.prefill_beside = prefill_beside  # rows joining a running batch are prefilled on another thread
        self.waiting: deque[Row] = deque()
        self.beside: tuple[list[Row], PromptBatch, Future] | None = None  # rows whose prefill runs beside the batch
        self.apart: str | None = None  # why rows cannot share a forward (each then decodes alone), once known
        self._apart_known = batch_size == 1  # batch size 1: rows never share a forward anyway
        self.drafter_out = False  # the drafter holds no rows: it sits out a stretch the schedule settled as plain

    @property
    def prefilling(self) -> list[Row]:
        """Rows being prefilled beside the batch: no longer waiting, not yet in it."""
        return self.beside[0] if self.beside else []

    def rows_apart(self, rows: list[Row], prompts: PromptBatch | None = None) -> str | None:
        """Why the models' rows cannot share a forward (the batch then holds one row at a time), or None. Learnt
        from ``prompts`` (a server's probe at start), else once two rows are in sight (``rows`` in the batch and the
        waiting ones; the first row serves the models' self-checks, which raise what refuses even one row); said
        once, by name."""
        if not self._apart_known and (prompts is not None or len(rows) + len(self.waiting) > 1):
            if prompts is None:
                prompts = prompts_of((rows or list(self.waiting))[:1], self.target.device)
            self.apart = self.target.rows_apart(prompts) or self.drafter.rows_apart(prompts)
            if self.apart is not None:
                warnings.warn(f"{self.apart}. Each prompt decodes alone, in turn (a batch of {self.batch_size} "
                              "holds one row)", stacklevel=3)
            self._apart_known = True
        return self.apart

    def join(self, rows: list[Row], add: AddRows) -> list[Row]:
        """Prefill waiting rows into the batch ``rows`` (up to ``batch_size``, or one row at a time where
        ``rows_apart``), each group handed to ``add`` once both models hold it (``add`` extends ``rows``); returns
        the waiting rows that finished without joining (cancelled, or no room left)."""
        if self.beside and (self.beside[2].done() or not rows):  # prefilled, or nothing left to decode
            joining, prompts, future = self.beside
            self.beside = None
            add_rows, seconds = future.result()  # raises the prefill's error here, on the decoding thread
            self.clock.new_round()
            self._admit(rows, joining, prompts, add_rows(), seconds, True, add)
        joining, finished = [], []
        capacity = 1 if self.rows_apart(rows) else self.batch_size
        while not self.beside and self.waiting and len(rows) + len(joining) < capacity:
            row = self.waiting.popleft()
            (finished if row.stop_if_full(self.target.context_limit) else joining).append(row)
        if joining:
            prompts = prompts_of(joining, self.target.device, committed=True)  # a resumed row joins with its tokens
            run = self.target.prefill_beside(prompts) if rows and self.prefill_beside else None
            if run is not None:
                self.beside = (joining, prompts, _pool().submit(_beside, run))
            else:
                self.clock.new_round()
                with self.events.phase(PREFILL):
                    calls = self.target.prefill(prompts)
                self._admit(rows, joining, prompts, calls, self.clock.round[PREFILL], False, add)
        return finished

    def _admit(self, rows: list[Row], joining: list[Row], prompts: PromptBatch, calls: int, seconds: float,
               beside: bool, add: AddRows) -> None:
        """Rows the target has just prefilled (``calls`` forwards, ``seconds``) join the batch: the drafter reads them
        (unless it sits out), the schedule and the listeners count them."""
        draft_calls = 0
        if not self.drafter_out and self.schedule.settled_plain(len(rows) + len(joining)):
            self._sit_out()  # the batch they make decodes plain: no prefill the drafter would drop at once
        if not self.drafter_out:  # else the drafter reads the rows when it drafts again (``seat_drafter``)
            with self.events.phase(DRAFT_PREFILL):
                draft_calls = self.drafter.prefill(prompts)
        self.schedule.add(len(joining))
        self.events.prefilled(Prefilled(tuple(r.stats for r in joining), calls, draft_calls, seconds, beside))
        add(joining, prompts)

    def seat_drafter(self, plan: DraftPlan, rows: list[Row]) -> None:
        """Before a round of ``plan``: the drafter sits out while the schedule has settled the batch's size as plain
        decoding (``speculate="auto"`` measured plain faster there), and reads every row's committed sequence as a
        prompt (one prefill, a ``DRAFT_PREFILL`` phase) before the next round that drafts."""
        drafting = plan.width != 0
        if drafting and self.drafter_out:
            with self.events.phase(DRAFT_PREFILL):
                calls = self.drafter.prefill(prompts_of(rows, self.target.device, committed=True))
            self.events.prefilled(Prefilled((), 0, calls, 0.0))
            self.drafter_out = False
        elif not drafting and not self.drafter_out and self.schedule.settled_plain(len(rows)):
            self._sit_out()

    def _sit_out(self) -> None:
        self.drafter.reset()
        self.drafter_out = True


_POOL: list[ThreadPoolExecutor] = []  # the thread that runs prefills beside decoding (``Admission.prefill_beside``)


def _pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-prefill"))
    return _POOL[0]


def _beside(run: Callable[[], Callable[[], int]]) -> tuple[Callable[[], int], float]:
    """A target's prefill beside decoding (on the pool's thread), as the decoding thread runs its models: without
    gradients, specdec's kernels active; what adds its rows to the batch, and its seconds."""
    started = time.perf_counter()
    with torch.no_grad(), kernels.active():
        add = run()
    return add, time.perf_counter() - started
