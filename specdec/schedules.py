"""How many tokens each row drafts next: schedules behind one base class and a registry.

Before each round a ``Schedule`` plans, per row, the most tokens to draft (``DraftPlan.limit``; the
loop then caps it by the room each row has left) and may hand the drafter a ``StopRule`` that stops
rows within the round (asked after each drafted position; the draft there is kept). After the round
it learns from the outcome (``update``). Rows join (``add``) and leave (``select``) with the batch.
Every decision is per row. Drafted lengths stay within ``ScheduleConfig.bound`` [MIN, MAX].

- ``constant``: gamma tokens every round (Leviathan et al. 2023).
- ``heuristic``: transformers' rule: a row's K starts at gamma, +2 after a round whose drafts were
  all accepted, -1 otherwise.
- ``confidence``: transformers 5's confidence stop: a row stops drafting where the drafter's
  probability of its draft falls below a threshold (0.4 to start), retuned after each round from
  that row's past drafts (the ROC threshold minimising fpr + 3 fnr, as ``AssistedCandidateGenerator``
  does, written here without scikit-learn).
- ``ada`` (SpecDec++, Huang et al. 2024): a trained acceptance head reads the drafter's hidden
  state at each drafted position and predicts P(accept); a row stops when
  1 - prod_j a_j > threshold, with a_1 := 1 (the first token is always drafted). The threshold and
  MAX default to the ones stored with the head (``specdec train head`` tunes them on held-out
  prompts); threshold 1 never stops a row (MAX every round, the head unused: the constant gamma MAX).
- ``Crossover`` wraps any of them for ``speculate="auto"``: the first rounds at each batch size
  (bucketed to powers of two) take turns among draft widths: as the inner schedule says, every draft
  capped at a few tokens (``DraftPlan.width``), and none at all (plain decoding through the same
  loop), each timed from its plan to the next round's (rows leaving included, prefill left out); from
  then on that batch size keeps the width that committed the most tokens per second, measured again
  now and then. Batched verification gets dearer as the batch grows (every row pays the longest
  draft), so speculation that pays in full at batch 1 pays only with short drafts, or not at all, at
  batch 16 on the same machine.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.acceptance import Verdict
from specdec.config import ScheduleConfig, SpecConfig
from specdec.drafters.base import Drafter, DraftStep, Proposal, StopRule
from specdec.events import DRAFT_PREFILL, PREFILL, Listener, RoundSummary
from specdec.stats import AutoChoice

CONFIDENCE_START = 0.4  # transformers 5's assistant_confidence_threshold default
ROC_FALSE_NEGATIVE_COST = 3.0  # transformers' cost: fpr + 3 * fnr


@dataclass(frozen=True)
class DraftPlan:
    """What a round drafts, per row."""

    limit: torch.Tensor  # [B] long, the most tokens each row drafts (before the room caps), on the host: the decoder
    # reads it there and moves the admitted limits to the device once (a device tensor works, at a wait for the device)
    stop: StopRule | None = None  # a within-round stop rule, or None
    width: int | None = None  # the most tokens any row's draft holds this round, lookup copies included; None = no cap


class Schedule(ABC):
    """How far each row drafts (see the module docstring)."""

    @property
    def most(self) -> int | None:
        """The most tokens a row is asked to draft in one round; None = unbounded."""
        return None

    @abstractmethod
    def plan(self, rows: int, device: torch.device | str) -> DraftPlan:
        """The plan of the coming round for ``rows`` rows (its limits on the host; a stop rule's state on
        ``device``)."""

    def update(self, proposal: Proposal, verdict: Verdict) -> None:
        """Learn from a round's drafts and their verdict."""

    def add(self, rows: int) -> None:
        """``rows`` rows join after the current ones."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the rows ``rows`` [B']."""

    def settled_plain(self, rows: int) -> bool:
        """Whether rounds of ``rows`` rows are settled as plain decoding for a while (the drafter may then sit out
        and drop its rows: ``Decoder``); a schedule that may draft in any round says no."""
        return False


class Constant(Schedule):
    """gamma drafts per row, every round."""

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma
        self._plan: DraftPlan | None = None  # the last plan (limits on the host), the same each round of as many rows

    @property
    def most(self) -> int:
        return self.gamma

    def plan(self, rows: int, device: torch.device | str) -> DraftPlan:
        if self._plan is None or len(self._plan.limit) != rows:
            self._plan = DraftPlan(torch.full((rows,), self.gamma, dtype=torch.long))
        return self._plan


class Bounded:
    """A schedule drafting within ``bound`` = (``low``, ``high``): at most ``high`` tokens a round."""

    high: int

    @property
    def most(self) -> int:
        return self.high


class PerRow(Schedule):
    """A schedule keeping one state value per row, which joins and leaves with its row."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.state: list[float] = []

    def add(self, rows: int) -> None:
        self.state += [self.start] * rows

    def select(self, rows: torch.Tensor) -> None:
        self.state = [self.state[i] for i in rows.tolist()]


class Heuristic(Bounded, PerRow):
    """transformers' heuristic: K += 2 after a fully accepted round, K -= 1 otherwise, within [MIN, MAX]."""

    def __init__(self, gamma: int, bound: tuple[int, int]) -> None:
        super().__init__(float(min(max(gamma, bound[0]), bound[1])))
        self.low, self.high = bound

    def plan(self, rows: int, device: torch.device | str) -> DraftPlan:
        return DraftPlan(torch.tensor([int(k) for k in self.state], dtype=torch.long))

    def update(self, proposal: Proposal, verdict: Verdict) -> None:
        for row, (drafted, accepted) in enumerate(zip(proposal.lengths.tolist(), verdict.accepted.tolist())):
            if drafted:  # a row that drafted nothing (no room) learns nothing
                k = self.state[row] + 2 if accepted == drafted else self.state[row] - 1
                self.state[row] = float(min(max(k, self.low), self.high))


def roc_threshold(probs: list[float], matches: list[int], cost_fn: float = ROC_FALSE_NEGATIVE_COST) -> float:
    """The probability threshold minimising fpr + cost_fn * fnr over the ROC curve of (probs, matches)
    (``sklearn.metrics.roc_curve``'s points, its leading infinite threshold included)."""
    p, y = np.asarray(probs, dtype=np.float64), np.asarray(matches, dtype=np.int64)
    order = np.argsort(-p, kind="stable")
    p, y = p[order], y[order]
    last = np.r_[np.nonzero(np.diff(p))[0], len(p) - 1]  # the last index of each distinct probability
    tps = np.cumsum(y)[last]
    fps = last + 1 - tps
    positives, negatives = int(y.sum()), len(y) - int(y.sum())
    fpr = np.r_[0.0, fps / negatives]
    tpr = np.r_[0.0, tps / positives]
    thresholds = np.r_[np.inf, p[last]]
    return float(thresholds[int(np.argmin(fpr + cost_fn * (1 - tpr)))])


class _ConfidenceStop:
    """Stops rows whose draft's probability is below their threshold; remembers each draft's probability."""

    needs_hidden = False

    def __init__(self, thresholds: torch.Tensor, low: int) -> None:
        self.thresholds = thresholds  # [B]
        self.low = low
        self.probs: list[torch.Tensor] = []  # per position: [B] probability of each row's draft

    def __call__(self, step: DraftStep) -> torch.Tensor:
        q = step.q if step.q is not None else torch.softmax(step.logits.float(), dim=-1)  # [B, V]
        p = q.gather(1, step.tokens[:, None]).squeeze(1)  # [B]
        self.probs.append(p)
        return (p < self.thresholds) & (step.position + 1 >= self.low)


class Confidence(Bounded, PerRow):
    """transformers 5's confidence stop, per row, with its ROC retuning after each round."""

    def __init__(self, threshold: float, bound: tuple[int, int]) -> None:
        super().__init__(threshold)
        self.low, self.high = bound
        self.history: list[tuple[list[float], list[int]]] = []  # per row: (draft probabilities, matched)
        self._stop: _ConfidenceStop | None = None

    def add(self, rows: int) -> None:
        super().add(rows)
        self.history += [([], []) for _ in range(rows)]

    def select(self, rows: torch.Tensor) -> None:
        super().select(rows)
        self.history = [self.history[i] for i in rows.tolist()]

    def plan(self, rows: int, device: torch.device | str) -> DraftPlan:
        self._stop = _ConfidenceStop(torch.tensor(self.state, device=device), self.low)
        return DraftPlan(torch.full((rows,), self.high, dtype=torch.long), self._stop)

    def update(self, proposal: Proposal, verdict: Verdict) -> None:
        if self._stop is None or not self._stop.probs:
            return
        probs = torch.stack(self._stop.probs, dim=1).tolist()  # [B, positions]
        for row, (drafted, accepted) in enumerate(zip(proposal.lengths.tolist(), verdict.accepted.tolist())):
            seen = min(drafted, accepted + 1)  # the accepted drafts and the first rejected one
            if proposal.ended and proposal.ended[row] == "lookup":
                continue  # a lookup copy was not drafted by the model: no probabilities to learn from
            history_p, history_m = self.history[row]
            history_p += probs[row][:seen]
            history_m += [1] * min(accepted, seen) + [0] * (seen - accepted)
            if len(history_p) > 5 and 0 in history_m and 1 in history_m:
                self.state[row] = roc_threshold(history_p, history_m)


class _AdaStop:
    """SpecDec++'s stop: 1 - prod_{j<=i} a_j > threshold, a_1 := 1, a_j the head's P(accept) of draft j."""

    needs_hidden = True

    def __init__(self, accept: Callable[[torch.Tensor], torch.Tensor], threshold: float, low: int, rows: int,
                 device: torch.device | str) -> None:
        self.accept = accept
        self.threshold = threshold
        self.low = low
        self.product = torch.ones(rows, device=device)  # [B] running product of predicted acceptances

    def __call__(self, step: DraftStep) -> torch.Tensor:
        if step.position > 0:  # the first draft's acceptance counts as 1
            assert step.hidden is not None
            self.product = self.product * self.accept(step.hidden).to(self.product.dtype)
        return (1 - self.product > self.threshold) & (step.position + 1 >= self.low)


class Ada(Bounded, Schedule):
    """SpecDec++: draft while the acceptance head predicts the drafts will all be accepted."""

    def __init__(self, accept: Callable[[torch.Tensor], torch.Tensor], threshold: float,
                 bound: tuple[int, int]) -> None:
        self.accept = accept  # hidden [B, H] -> P(accept) [B]
        self.threshold = threshold
        self.low, self.high = bound

    def plan(self, rows: int, device: torch.device | str) -> DraftPlan:
        limit = torch.full((rows,), self.high, dtype=torch.long)
        if self.threshold >= 1:  # 1 - prod a_j never exceeds 1: no row would stop, so the head need not run
            return DraftPlan(limit)
        return DraftPlan(limit, _AdaStop(self.accept, self.threshold, self.low, rows, device))


def batch_bucket(rows: int) -> int:
    """The power of two at or above ``rows``: batch sizes that share a crossover measurement."""
    return 1 << max(0, rows - 1).bit_length()


def crossover_widths(most: int | None, free: int = 0) -> tuple[int | None, ...]:
    """The draft widths ``Crossover`` tries for a schedule drafting up to ``most`` tokens a round and a drafter
    copying up to ``free`` tokens past it: uncapped (None) first, then each power of two below ``most`` (and
    ``most`` itself where copies go past it), then 0 (plain decoding)."""
    most = most or free or 1
    caps = [most] if free > most else []
    cap = 1 << (most - 1).bit_length() >> 1  # the largest power of two below most
    while cap >= 1:
        caps.append(cap)
        cap //= 2
    return (None, *caps, 0)


DROP = 0.75  # Crossover: a drafting width measured below this share of the fastest's speed stops being measured
# Crossover: a drafting width is kept over plain decoding only where it measured at least this many times plain's
# speed. A trial round counts the round and the rows leaving after it; drafting also costs what it leaves out: each
# joining row's prefill into the drafter (a batch settled plain skips it), the drafter's read-back after a plain
# stretch, and, for requests arriving together, the rounds of a shrinking batch as rows finish apart. On the AMD
# EPYC the server's 16 simultaneous requests kept drafting (width 4) for 9-16 rows on 387 against 366 tokens/s
# (1.06x) in its trials, and the whole runs made 0.80x the tokens/s of plain decoding (docs/benchmarks.md).
PLAIN_MARGIN = 1.10


class Crossover(Schedule, Listener):
    """``speculate="auto"``: per batch size, the draft width that commits the most tokens per second.

    Verifying B rows costs the longest draft of any row (the forward is [B, width + 1]): the wider the
    batch, the fewer drafted tokens pay, down to none (plain decoding, width 0). So per batch-size bucket
    it measures each width of ``widths`` (None: the inner schedule's own drafts, lookup copies included;
    k: no row's draft longer than k, ``DraftPlan.width``; 0: plain decoding) and keeps the fastest, plain decoding
    unless a drafting width beat it by ``margin`` (``PLAIN_MARGIN``: what the trial rounds leave out costs drafting).

    What it compares is the batch's committed tokens per second of wall time, as a server sees it. A
    measured round runs from its plan to the plan of the next round: the round itself, then the rows
    that finished leaving the caches and the bookkeeping before the next round (drafting makes rows
    finish in different rounds, so more separate compactions). Left out: the prefill of rows joining
    (``PREFILL``, ``DRAFT_PREFILL``: each request pays it once whichever the width, and a burst of
    arrivals would swamp a round), and the idle wait after the batch emptied. Per bucket,
    ``trial_rounds`` rounds of each width are measured, taking turns (the widest first) in blocks of
    ``block`` rounds, so all see the same rows, contexts and machine load. Blocks, not single rounds: a
    wide round leaves holes in the target's cache (rows that accepted fewer than the longest draft)
    that later rounds pay for until a compaction; alternating every round, the rounds of the other
    widths paid for them (16 rows, in the decoder: uncapped measured 536 tokens/s interleaved against
    346 run alone, and kept; in blocks of 4, 373-406, and width 2 kept, the fastest alone). Once every width has a
    block, a drafting width below ``drop`` of the fastest's speed is measured no more (its block's figures kept for
    the choices): a trial round of a width that loses by far costs what the trial is for, uncapped drafts at 4 rows
    about half their rounds' time (on the AMD EPYC the server's 4 clients measured a 5-9% longer median latency with
    ``auto`` than with ``off`` while every width ran its 12 rounds, and ``auto`` kept plain). Plain decoding, the
    margin's reference and the cheapest round, runs all its trial rounds: dropped on its first block, one block
    measured slow (4 rounds of 16-18 ms where its later blocks took 9-11, in the server at 4 clients) against a
    drafting block of looping prompts (16-20 tokens a round) made ``auto`` draft at 4 rows, 0.91x ``off``'s latency.
    A batch size larger than one settled on plain decoding starts plain, without a trial of its own (``_plain_below``).
    After ``recheck_rounds`` rounds in a bucket the choice is measured again against the widths next to it in
    ``widths`` (one wider, one narrower), so one noisy trial (a shared machine, a burst of prompts that lookup copies
    well) does not decide for good, at the cost of a few rounds of two near-equal widths rather than of all.
    In plain rounds the drafter only follows the committed tokens; a model drafter catches them up in its
    next forward, which a drafting round pays (as it would after a plain stretch). ``clock`` is injectable (tests)."""

    def __init__(self, inner: Schedule, trial_rounds: int = 12, recheck_rounds: int = 512,
                 clock: Callable[[], float] = time.perf_counter, widths: tuple[int | None, ...] | None = None,
                 block: int = 4, drop: float = DROP, margin: float = PLAIN_MARGIN) -> None:
        self.inner = inner
        self.block = block  # rounds a width runs in a row when measuring (its cache's holes are mostly its own)
        self.widths = widths if widths is not None else crossover_widths(inner.most)  # tried in this order
        if 0 not in self.widths or len(set(self.widths)) != len(self.widths):
            raise ValueError(f"Crossover's widths must be distinct and include 0 (plain decoding), got {self.widths}")
        self.trial_rounds = trial_rounds  # measured rounds of each width per batch-size bucket
        self.recheck_rounds = recheck_rounds  # rounds a choice is kept before it is measured again
        self.drop = drop  # a width below this share of the fastest, once each has a block, leaves the trial
        self.margin = margin  # drafting is kept over plain only at this many times plain's speed or more
        self.clock = clock
        self.forget()

    def forget(self) -> None:
        """Drop every measurement and choice (the rounds now run another way: a server switched to its compiled
        graphs); each batch size is measured afresh."""
        self.width: dict[int, int | None] = {}  # bucket -> the width kept (0: plain)
        self._trials: dict[int, dict[int | None, list[float]]] = {}  # bucket -> width -> [rounds, tokens, seconds]
        self._racing: dict[int, list[int | None]] = {}  # bucket -> the widths its trial still measures
        self._like: dict[int, int] = {}  # bucket -> the smaller bucket whose plain
                                         # decoding it follows (``_plain_below``)
        self._rechecking: dict[int, int | None] = {}  # bucket -> the width it kept before its recheck, while rechecked
        self._kept: dict[int, int] = {}  # bucket -> rounds run on its current choice
        self._turn: dict[int, int | None] = {}  # bucket -> the width measuring now
        self._open: tuple[int, int | None, float] | None = None  # (bucket, width, started) of the measured round
        self._tokens: int | None = None  # its committed tokens, once it ended
        self._left_out = 0.0  # seconds of prefill since it started
        self._prefill_at: float | None = None

    @property
    def most(self) -> int | None:
        return self.inner.most

    def plan(self, rows: int, device: torch.device | str) -> DraftPlan:
        self._close()
        bucket = batch_bucket(rows)
        if bucket in self.width:
            width = self.width[bucket]
            self._kept[bucket] = self._kept.get(bucket, 0) + 1
            if self._kept[bucket] >= self.recheck_rounds:  # measure this bucket again from its next round
                self._recheck(bucket)
        elif bucket not in self._trials and (smaller := self._plain_below(bucket)) is not None:
            width = self.width[bucket] = 0  # larger than a batch measured plain: plain, unmeasured until its recheck
            self._like[bucket], self._kept[bucket] = smaller, 1
        else:  # still measuring: the widths racing take turns, the widest first
            trials = self._trials.setdefault(bucket, {w: [0, 0, 0.0] for w in self.widths})
            racing = self._racing.setdefault(bucket, list(self.widths))
            width = self._turn.get(bucket, 0)
            if (width not in racing or bucket not in self._turn or trials[width][0] % self.block == 0
                    or trials[width][0] >= self.trial_rounds):
                width = self._turn[bucket] = min(racing, key=lambda w: trials[w][0])
            self._open, self._tokens, self._left_out = (bucket, width, self.clock()), None, 0.0
        plan = self.inner.plan(rows, device)
        if width is None:
            return plan
        return DraftPlan(plan.limit.clamp(max=width), plan.stop if width else None, width)

    def _plain_below(self, bucket: int) -> int | None:
        """The largest smaller batch-size bucket settled on plain decoding (measured, not itself following one), or
        None. Verifying B rows costs the longest draft in every row, so drafting pays less the more rows there are: a
        bucket larger than one where plain decoding won starts plain without a trial of its own. On the AMD EPYC the
        server's 16 clients, after its 4 clients had settled plain, spent their whole run (16 requests) in the 16-row
        trial (uncapped drafts alone 270 ms a round against plain's 40) and made 0.90-0.92x ``off``'s tokens/s."""
        settled = {**self._rechecking, **self.width}  # a bucket being rechecked counts with the choice it had
        return max((b for b, w in settled.items() if b < bucket and w == 0 and b not in self._like), default=None)

    def _recheck(self, bucket: int) -> None:
        """Measure ``bucket`` again from its next round: the width kept against its neighbours in ``widths`` (one
        wider, one narrower), each from fresh rounds; the other widths keep their last figures and stay out."""
        self._rechecking[bucket] = self.width.pop(bucket)
        at = self.widths.index(self._rechecking[bucket])
        self._like.pop(bucket, None)
        racing = list(self.widths[max(0, at - 1):at + 2])
        trials = self._trials.setdefault(bucket, {w: [0, 0, 0.0] for w in self.widths})
        for w in racing:
            trials[w] = [0, 0, 0.0]
        self._racing[bucket] = racing
        self._turn.pop(bucket, None)
        self._kept[bucket] = 0

    def _close(self) -> None:
        """Record the measured round in flight, if it ended (one that raised is dropped); drop the widths that
        lost by far once each has a block; decide once those left have their rounds."""
        if self._open is None:
            return
        (bucket, width, started), tokens = self._open, self._tokens
        self._open = None
        if tokens is None or bucket not in self._trials:
            return
        trials, racing = self._trials[bucket], self._racing[bucket]
        record = trials[width]
        record[0] += 1
        record[1] += tokens
        record[2] += max(0.0, self.clock() - started - self._left_out)
        speed = _speeds(trials)
        if len(racing) > 1 and all(trials[w][0] >= self.block for w in racing):
            fastest = max(speed[w] for w in racing)
            racing[:] = [w for w in racing if w == 0 or speed[w] >= self.drop * fastest]  # plain runs its rounds
        if all(trials[w][0] >= self.trial_rounds for w in racing):
            self.width[bucket] = self._pick(racing, speed)
            self._rechecking.pop(bucket, None)

    def _pick(self, racing: list[int | None], speed: dict[int | None, float]) -> int | None:
        """The fastest width of ``racing``, plain decoding (where it races) unless a drafting width measured at
        least ``margin`` times its speed; a tie between drafting widths goes to the first measured."""
        drafting = [w for w in racing if w != 0]
        best = max(drafting, key=lambda w: speed[w], default=0)
        return best if 0 not in racing or (best != 0 and speed[best] >= self.margin * speed[0]) else 0

    def phase_started(self, phase: str) -> None:
        if self._open is not None and phase in (PREFILL, DRAFT_PREFILL):
            self._prefill_at = self.clock()

    def phase_ended(self, phase: str) -> None:
        if self._prefill_at is not None and phase in (PREFILL, DRAFT_PREFILL):
            self._left_out += self.clock() - self._prefill_at
            self._prefill_at = None

    def round_ended(self, summary: RoundSummary) -> None:
        if self._open is not None:
            self._tokens = summary.tokens

    def update(self, proposal: Proposal, verdict: Verdict) -> None:
        self.inner.update(proposal, verdict)

    def add(self, rows: int) -> None:
        self.inner.add(rows)

    def select(self, rows: torch.Tensor) -> None:
        self.inner.select(rows)
        if len(rows) == 0:  # the batch emptied: what follows may be an idle wait, not this round's cost
            self._close()

    def settled_plain(self, rows: int) -> bool:
        """Plain decoding was measured fastest at this batch size and is kept until its recheck."""
        return self.width.get(batch_bucket(rows)) == 0

    @property
    def choice(self) -> dict[int, bool]:
        """Per batch-size bucket decided: whether it drafts (the width kept, ``width``, is not 0)."""
        return {bucket: width != 0 for bucket, width in self.width.items()}

    def choices(self) -> list[AutoChoice]:
        """Per batch-size bucket met so far, smallest first: the mode and width kept and the measured speeds
        (drafting's: of the width kept, else of the fastest drafting width of those ``_pick`` compared with plain:
        a recheck measures a few widths afresh, and the others' figures are an older trial's, of other contexts)."""
        out = []
        for bucket in sorted(self._trials.keys() | self.width.keys()):
            speed = _speeds(self._trials.get(bucket, {}))
            drafting = self.choice.get(bucket)
            kept = "measuring" if drafting is None else ("on" if drafting else "off")
            compared = [w for w in self._racing.get(bucket, ()) if w != 0] or [w for w in speed if w != 0]
            width = self.width.get(bucket) if drafting else max(compared, key=speed.get, default=None)
            like = self._like.get(bucket)
            out.append(AutoChoice(_rows(bucket), kept, speed.get(width, 0.0), speed.get(0, 0.0), width,
                                  None if like is None else _rows(like)))
        return out


def _rows(bucket: int) -> tuple[int, int]:
    """The batch sizes a bucket covers (``batch_bucket``: 1, 2, 3-4, 5-8, ...)."""
    return bucket // 2 + 1, bucket


def _speeds(trials: dict[int | None, list[float]]) -> dict[int | None, float]:
    """Committed tokens per second of each width's measured rounds (0 before any)."""
    return {w: r[1] / r[2] if r[2] > 0 else 0.0 for w, r in trials.items()}


def _ada(spec: SpecConfig, config: ScheduleConfig, drafter: Drafter) -> Schedule:
    """The ada schedule with the acceptance head of ``config.head`` (default: beside the drafter model)."""
    if not drafter.returns_hidden or drafter.hidden_size is None:
        raise ValueError(f"--schedule ada reads the drafter's hidden states, and this drafter "
                         f"({type(drafter).__name__}) has none: draft with a model (e.g. lookup+code-drafter)")
    path = config.head or drafter.head_path()
    if path is None:
        raise ValueError("--schedule ada needs an acceptance head: pass --head PATH (train one with "
                         "`specdec train head`)")
    from specdec.heads import load_head

    head = load_head(Path(path), drafter.hidden_size)
    threshold = config.stop_threshold if config.stop_threshold is not None else head.default_threshold
    return Ada(head.accept_probability, threshold, config.bound_or(head.config.max_draft))


# name -> (spec, config, drafter) -> Schedule
SCHEDULES: dict[str, Callable[[SpecConfig, ScheduleConfig, Drafter], Schedule]] = {
    "constant": lambda spec, config, drafter: Constant(spec.gamma),
    "heuristic": lambda spec, config, drafter: Heuristic(spec.gamma, config.bound_or()),
    "confidence": lambda spec, config, drafter: Confidence(
        CONFIDENCE_START if config.stop_threshold is None else config.stop_threshold, config.bound_or()),
    "ada": _ada,
}


def register_schedule(name: str, factory: Callable[[SpecConfig, ScheduleConfig, Drafter], Schedule]) -> None:
    """Make the schedule ``name`` available to ``make_schedule`` (and the CLI's --schedule)."""
    SCHEDULES[name] = factory


def make_schedule(spec: SpecConfig, config: ScheduleConfig | None = None, drafter: Drafter | None = None) -> Schedule:
    """The schedule ``config`` names for ``drafter``, wrapped in ``Crossover`` for ``speculate="auto"``."""
    config = config or ScheduleConfig()
    if config.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {config.schedule!r}: use one of {', '.join(SCHEDULES)}")
    if drafter is None and config.schedule == "ada":
        raise ValueError("the ada schedule needs the drafter whose hidden states it reads")
    schedule = SCHEDULES[config.schedule](spec, config, drafter)  # type: ignore[arg-type]
    most = None if drafter is None else drafter.max_draft
    if most is not None and schedule.most is not None and schedule.most > most:
        flag = "--gamma" if config.schedule == "constant" else "--bound MIN MAX with MAX"
        raise ValueError(f"the {config.schedule} schedule may ask for {schedule.most} drafted tokens per round, but "
                         f"this drafter drafts at most {most} (the largest block it was trained for): use {flag} "
                         f"{most} or less")
    if spec.speculate != "auto":
        return schedule
    return Crossover(schedule, widths=crossover_widths(schedule.most or spec.gamma, 0 if drafter is None else
                                                       drafter.free_tokens))
