"""From records to figures: one row per (method, setting), peers, goals and the gamma sweep.

Definitions (every ratio is against ``plain-hf`` at the same temperature, in the same run):
- per-prompt throughput = the median over repeats of tokens / wall time;
- ``tokens_per_s`` = the median over prompts of per-prompt throughput (the table's figure);
- ``speedup`` = mean per-prompt throughput / that of plain-hf (Spec-Bench's definition);
- ``speedup_non_loop`` = the same over the prompts whose plain-hf output (first repeat) does not
  end in a degenerate loop (``is_degenerate_loop``): a small target's greedy loops are easy to
  draft, so this shows how much of a speedup survives without them (``loop_prompts`` counts them);
- ``forward_speedup`` = tokens per target forward / that of plain-hf (LMFlow's "speedup in
  number of target forwards"; plain-hf makes one forward per token);
- ``tau`` = tokens / rounds, including the recovered or bonus token; ``alpha`` = accepted / drafted;
- ``greedy_equal`` = prompts whose every greedy output equals plain-hf's (first repeat) token for
  token, out of ``greedy_total``; sampled settings are not compared (None); ``greedy_near_ties``
  counts the differences at a near tie of the target (top-two logit gap < ``NEAR_TIE``), which
  batched verification may flip legitimately;
- ``cost_ratio`` c = drafter step / target step; ``theoretical_speedup`` = Leviathan et al.'s
  (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)); ``efficiency`` = speedup / theoretical;
- ``peak_mib`` = the highest memory during an untimed run of the method on the longest prompt,
  after every method's warm-up (CPU: resident set of the process, both models included; CUDA:
  allocated); ``extra_mib`` = what the method needs beyond plain-hf: its memory growth during that
  run, plus the drafter model's weights when it uses one, minus plain-hf's growth.
A group with several runners (``hf-assisted``) has a peer per (temperature, gamma): its member
with the highest mean throughput.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from dataclasses import dataclass

from specdec.bench.harness import BenchRun, Block
from specdec.bench.records import Record
from specdec.bench.runners import BASELINE, DrafterCost, drafter_label

NEAR_TIE = 1e-4  # top-two logit gap below which a greedy difference is a floating-point tie (issue 2)


def is_degenerate_loop(tokens: list[int], max_period: int = 16, min_repeats: int = 3) -> bool:
    """True when the output ends in one short pattern (period <= max_period) repeated at least
    ``min_repeats`` times over at least 24 tokens: the classic greedy loop of a small LM."""
    for period in range(1, max_period + 1):
        span = max(period * min_repeats, 24)
        if len(tokens) < span:
            continue
        tail = tokens[-span:]
        if all(tail[i] == tail[i - period] for i in range(period, span)):
            return True
    return False


@dataclass(frozen=True)
class Row:
    """The figures of one method at one setting."""

    method: str
    group: str
    gamma: int | None
    temperature: float
    prompts: int  # prompts with timed runs
    runs: int  # timed runs (prompts x repeats)
    tokens_per_s: float | None  # median over prompts of per-prompt throughput
    mean_tokens_per_s: float | None  # mean over prompts of per-prompt throughput
    speedup: float | None  # mean throughput / plain-hf's (Spec-Bench)
    speedup_non_loop: float | None  # the same over the prompts whose plain-hf output is not a loop
    loop_prompts: int | None  # prompts whose plain-hf output ends in a degenerate loop
    forward_speedup: float | None  # tokens per target forward / plain-hf's (LMFlow)
    tau: float | None  # mean accepted length, recovered/bonus token included
    alpha: float | None  # acceptance rate; None when the method does not report drafts
    greedy_equal: int | None  # prompts equal to plain-hf token for token (greedy only)
    greedy_total: int | None  # prompts compared (greedy only)
    greedy_near_ties: int | None  # of the unequal prompts, those that differ first at a near tie
    greedy_mismatches: list[str]  # "prompt_id@position (top-2 gap)" for each unequal prompt
    cost_ratio: float | None  # c = drafter step time / target step time
    theoretical_speedup: float | None  # Leviathan et al. from alpha, gamma, c
    efficiency: float | None  # speedup / theoretical_speedup
    peak_mib: float | None  # peak memory during the method's runs
    extra_mib: float | None  # memory beyond plain-hf (see module docstring)
    memory_source: str | None  # "rss_hwm", "rss_sampled" or "cuda_allocated"
    target_s: float | None  # mean seconds per run inside target forwards
    drafter_s: float | None  # mean seconds per run drafting
    overhead_s: float | None  # mean seconds per run outside both (loop, sampling, bookkeeping)
    acceptance_by_position: list[float] | None  # [i]: accepted / drafted at draft position i
    peer: bool  # the better member of its group at some (temperature, gamma)
    error: str | None  # why the method failed, if it did


def leviathan_speedup(alpha: float, gamma: int, c: float) -> float:
    """Expected walltime improvement (1 - a^(g+1)) / ((1 - a)(g c + 1)) of Leviathan et al. 2023."""
    tokens_per_round = gamma + 1 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens_per_round / (gamma * c + 1)


def _per_prompt(records: list[Record]) -> dict[str, list[Record]]:
    grouped: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        grouped[record.prompt_id].append(record)
    return grouped


def _throughputs(records: list[Record], skip: frozenset[str] = frozenset()) -> list[float]:
    """Per-prompt median tokens/s, in prompt order, leaving out the prompt ids in ``skip``."""
    return [statistics.median(r.tokens_per_s for r in rs) for p, rs in _per_prompt(records).items() if p not in skip]


def _mean_ratio(num: list[float], den: list[float]) -> float | None:
    """Ratio of the means of two throughput lists (None when either is empty)."""
    return statistics.fmean(num) / statistics.fmean(den) if num and den else None


def _loop_prompts(baseline: Block | None) -> frozenset[str]:
    """The prompts whose baseline output (first repeat) ends in a degenerate loop."""
    records = baseline.records if baseline is not None else []
    return frozenset(r.prompt_id for r in records if r.repeat == 0 and is_degenerate_loop(r.tokens))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


class _Summarizer:
    """Turns the blocks of one run into rows."""

    def __init__(self, run: BenchRun) -> None:
        self.run = run
        self.baselines = {b.setting.temperature: b for b in run.blocks if b.runner.name == BASELINE}

    def _cost_ratio(self, block: Block) -> float | None:
        run = self.run
        label = drafter_label(block.runner)
        step = run.drafter_step_s if label is None else run.compared_step_s.get(label)
        if block.runner.cost is DrafterCost.MODEL_STEP and step is not None:
            return step / run.target_step_s
        # drafting time per round / (gamma target steps); also a drafter model with no step of its own (one reading
        # the target's features: drafters.model.reads_features)
        if block.runner.cost is DrafterCost.MEASURED_DRAFT or block.runner.cost is DrafterCost.MODEL_STEP:
            rounds = sum(r.rounds for r in block.records)
            per_round = sum(r.drafter_time_s for r in block.records) / rounds if rounds else None
            return per_round / (block.setting.gamma or 1) / run.target_step_s if per_round is not None else None
        return None

    def row(self, block: Block) -> Row:
        records = block.records
        baseline = self.baselines.get(block.setting.temperature)
        base_records = baseline.records if baseline is not None else []
        thr = _throughputs(records)
        base_thr = _throughputs(base_records)
        mean_thr = statistics.fmean(thr) if thr else None
        speedup = _mean_ratio(thr, base_thr)
        loops = _loop_prompts(baseline)
        tokens = sum(r.generated_length for r in records)
        per_forward = _ratio(tokens, sum(r.num_LM_call for r in records))
        base_per_forward = _ratio(sum(r.generated_length for r in base_records),
                                  sum(r.num_LM_call for r in base_records))
        drafted = [r for r in records if r.drafted is not None]
        alpha = _ratio(sum(r.accepted or 0 for r in drafted), sum(r.drafted or 0 for r in drafted)) if drafted else None
        greedy = block.compared > 0
        mismatches = block.mismatches.values()
        c = self._cost_ratio(block) if records else None
        gamma = block.setting.gamma
        theory = leviathan_speedup(alpha, gamma, c) if None not in (alpha, gamma, c) else None
        n = len(records)
        target_s = sum(r.target_time_s for r in records) / n if n else None
        drafter_s = sum(r.drafter_time_s for r in records) / n if n else None
        wall_s = sum(r.wall_time_s for r in records) / n if n else None
        return Row(
            method=block.runner.name,
            group=block.runner.group,
            gamma=gamma,
            temperature=block.setting.temperature,
            prompts=len(thr),
            runs=n,
            tokens_per_s=statistics.median(thr) if thr else None,
            mean_tokens_per_s=mean_thr,
            speedup=speedup,
            speedup_non_loop=_mean_ratio(_throughputs(records, loops), _throughputs(base_records, loops)),
            loop_prompts=len(loops) if baseline is not None else None,
            forward_speedup=_ratio(per_forward, base_per_forward) if per_forward and base_per_forward else None,
            tau=_ratio(tokens, sum(r.rounds for r in records)) if n else None,
            alpha=alpha,
            greedy_equal=block.compared - len(mismatches) if greedy else None,
            greedy_total=block.compared if greedy else None,
            greedy_near_ties=sum(m.top2_gap < NEAR_TIE for m in mismatches) if greedy else None,
            greedy_mismatches=[f"{p}@{m.position} (top-2 gap {m.top2_gap:.2g})" for p, m in block.mismatches.items()],
            cost_ratio=c,
            theoretical_speedup=theory,
            efficiency=_ratio(speedup, theory) if speedup and theory else None,
            peak_mib=block.memory.peak_mib if block.memory else None,
            extra_mib=self._extra_memory(block, baseline),
            memory_source=block.memory.source if block.memory else None,
            target_s=target_s,
            drafter_s=drafter_s,
            overhead_s=wall_s - target_s - drafter_s if n else None,  # type: ignore[operator]
            acceptance_by_position=_by_position(records),
            peer=False,
            error=block.error,
        )

    def _extra_memory(self, block: Block, baseline: Block | None) -> float | None:
        if block.memory is None or baseline is None or baseline.memory is None:
            return None
        label, env = drafter_label(block.runner), self.run.environment
        drafter = env.drafter if label is None else env.compared.get(label)
        weights = drafter.weight_mib if block.runner.needs_drafter_model and drafter else 0.0
        return block.memory.growth_mib + weights - baseline.memory.growth_mib


def _by_position(records: list[Record]) -> list[float] | None:
    accepted: list[int] = []
    drafted: list[int] = []
    for r in records:
        if r.accepted_per_position is None or r.drafted_per_position is None:
            return None
        for totals, counts in ((accepted, r.accepted_per_position), (drafted, r.drafted_per_position)):
            totals.extend([0] * (len(counts) - len(totals)))
            for i, count in enumerate(counts):
                totals[i] += count
    return [a / d for a, d in zip(accepted, drafted) if d] or None


def _mark_peers(rows: list[Row], gammas: tuple[int, ...]) -> list[Row]:
    """Flag, per group of several runners and per (temperature, gamma), its fastest member."""
    members: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        members[row.group].add(row.method)
    peers: set[int] = set()
    for group, names in members.items():
        if len(names) < 2:
            continue
        for temperature in {r.temperature for r in rows}:
            for gamma in gammas:
                candidates = [
                    i
                    for i, r in enumerate(rows)
                    if r.group == group and r.temperature == temperature and r.gamma in (gamma, None)
                    and r.mean_tokens_per_s
                ]
                if candidates:
                    peers.add(max(candidates, key=lambda i: rows[i].mean_tokens_per_s or 0.0))
    return [dataclasses.replace(row, peer=i in peers) for i, row in enumerate(rows)]


def summarize(run: BenchRun) -> list[Row]:
    """One row per (method, setting), in run order, peers marked."""
    summarizer = _Summarizer(run)
    return _mark_peers([summarizer.row(b) for b in run.blocks], run.config.gamma)


def peer_row(rows: list[Row], name: str, temperature: float, gamma: int | None) -> Row | None:
    """The row standing for `name` at a setting: the method itself, or the fastest member of a group."""
    candidates = [
        r
        for r in rows
        if r.temperature == temperature and r.gamma in (gamma, None) and name in (r.method, r.group)
    ]
    return max(candidates, key=lambda r: r.mean_tokens_per_s or 0.0, default=None)


@dataclass(frozen=True)
class Goal:
    """A throughput ratio the project aims for (issue 5), checked at every greedy setting."""

    method: str  # a method or a group (its peer)
    over: str  # the method or group it is compared with
    at_least: float  # the ratio of mean throughputs aimed for


GOALS = (Goal("spec", BASELINE, 2.0), Goal("spec", "hf-assisted", 1.3), Goal("plain", BASELINE, 1.0))


@dataclass(frozen=True)
class GoalCheck:
    """One goal at one setting, measured."""

    goal: Goal
    temperature: float
    gamma: int | None  # None when neither side drafts with a gamma
    versus: str  # the row it was compared with (a group resolves to its peer)
    ratio: float
    met: bool
    ratio_non_loop: float | None  # the same ratio over the prompts whose plain-hf output is not a loop


def check_goals(rows: list[Row], gammas: tuple[int, ...]) -> list[GoalCheck]:
    """Each goal at each greedy (temperature 0) gamma where both sides ran (once if gamma plays no part)."""
    checks: dict[tuple[Goal, int, int], GoalCheck] = {}
    for gamma in gammas:
        for goal in GOALS:
            mine, other = peer_row(rows, goal.method, 0.0, gamma), peer_row(rows, goal.over, 0.0, gamma)
            if mine and other and mine.mean_tokens_per_s and other.mean_tokens_per_s:
                ratio = mine.mean_tokens_per_s / other.mean_tokens_per_s
                non_loop = (
                    _ratio(mine.speedup_non_loop, other.speedup_non_loop)
                    if mine.speedup_non_loop and other.speedup_non_loop else None
                )
                key = (goal, id(mine), id(other))
                checks.setdefault(
                    key, GoalCheck(goal, 0.0, mine.gamma, other.method, ratio, ratio >= goal.at_least, non_loop)
                )
    return list(checks.values())


@dataclass(frozen=True)
class SweepCell:
    """One method at one gamma of the sweep (LMFlow's table)."""

    method: str
    temperature: float
    gamma: int
    speedup: float | None  # wall-time speedup over plain-hf
    forward_speedup: float | None  # target-forward speedup over plain-hf


def gamma_sweep(rows: list[Row]) -> list[SweepCell]:
    """The rows that depend on gamma, as sweep cells."""
    return [
        SweepCell(r.method, r.temperature, r.gamma, r.speedup, r.forward_speedup) for r in rows if r.gamma is not None
    ]
