"""The batch sweep of ``specdec bench --batch-sizes 1,2,4,8,16``: throughput against batch size.

Every method decodes the same prompts at each batch size B, in one process, greedy unless
``--temperature`` says otherwise:

- ``hf``: the target's own batched ``generate`` (left padding, chunks of B prompts; a chunk runs
  until its longest row is done): what a user would otherwise run, since transformers' assisted
  generation refuses batches. Every speedup is divided by it, at the same B.
- ``plain``: our loop drafting nothing (``speculate="off"``), B rows at a time, rows joining as
  others finish.
- ``spec``: our speculative decoding with the drafter model alone.
- ``spec-lookup``: ours with the CLI's default drafter (prompt lookup, the drafter model when
  lookup finds nothing).
- ``auto``: ``spec-lookup`` with ``speculate="auto"``: at each batch size it measures rounds with
  and without drafting once (the same ``Crossover`` is kept over the repeats) and keeps the faster.

For each (B, method) the repeats run back to back, the methods' order rotating from one B to the
next; the median repeat is reported. Reported per cell: tokens/s over all prompts, the speedup over
``hf``, τ (tokens per row-round) and α, and **bookkeeping**: the share of wall time outside the two
models' forward passes (measured by forward hooks on both models, as the main benchmark's
``ForwardMeter``). Greedy outputs are compared with the target's own ``generate`` of each prompt
alone; a difference at a near tie of the target's two best logits (< 1e-4) is counted as such.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from matplotlib.figure import Figure
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from transformers import PreTrainedModel

import specdec
from specdec.bench.config import BenchConfig
from specdec.bench.environment import Environment, capture_environment, load_average
from specdec.bench.measure import Clock, ForwardMeter
from specdec.bench.prompts import Prompt, load_prompts
from specdec.config import LOOKUP, DrafterConfig, SpecConfig
from specdec.drafters import make_drafter
from specdec.drafters.model import drafter_in
from specdec.loading import load_model, load_tokenizer
from specdec.schedules import Crossover, Schedule, make_schedule
from specdec.target import make_target

BASELINE = "hf"
SPECULATE_METHODS = {"off": "plain", "on": "spec-lookup", "auto": "auto"}  # --speculate -> our method
TIE = 1e-4  # a greedy difference at a top-2 logit gap below this is a near tie


@dataclass
class Models:
    target: PreTrainedModel
    drafter: PreTrainedModel
    stop_token_ids: list[int]
    crossovers: dict[int, Schedule] = field(default_factory=dict)  # batch size -> auto's schedule


@dataclass(frozen=True)
class Output:
    """What one run of a method over all prompts produced."""

    tokens: list[list[int]]  # per prompt, new tokens
    rows_rounds: int  # rounds summed over rows (plain decoding: one per token)
    drafted: int
    accepted: int


def _decode_kwargs(models: Models, config: BenchConfig, temperature: float) -> dict:
    return {"max_new_tokens": config.max_new_tokens, "temperature": temperature, "top_k": config.top_k,
            "top_p": config.top_p, "stop_token_ids": models.stop_token_ids, "seed": config.seed}


def run_hf(models: Models, prompts: list[Prompt], batch: int, config: BenchConfig, temperature: float) -> Output:
    """transformers' batched ``generate``: chunks of ``batch`` prompts, left-padded."""
    out_tokens = []
    target = models.target
    pad = (models.stop_token_ids or [0])[0]
    for start in range(0, len(prompts), batch):
        chunk = [p.input_ids.tolist() for p in prompts[start : start + batch]]
        ids, lengths = specdec.batch.left_padded(chunk, target.device)
        mask = specdec.batch.left_mask(lengths, ids.shape[1]).long()
        kwargs = {"do_sample": temperature > 0, "max_new_tokens": config.max_new_tokens, "pad_token_id": pad,
                  "eos_token_id": models.stop_token_ids or None}
        if temperature > 0:
            torch.manual_seed(config.seed + start)
            kwargs.update(temperature=temperature, top_k=config.top_k, top_p=config.top_p)
        else:
            kwargs.update(temperature=None, top_k=None, top_p=None)
        with torch.inference_mode():
            generated = target.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, ids.shape[1]:].tolist()
        for row in generated:
            stop = next((i for i, t in enumerate(row) if t in models.stop_token_ids), None)
            out_tokens.append(row if stop is None else row[: stop + 1])
    tokens = sum(len(t) for t in out_tokens)
    return Output(out_tokens, tokens, 0, 0)


def _ours(drafter: str | None, speculate: str) -> Callable[..., Output]:
    """Our loop with ``drafter`` ("model", "lookup+model" or None for none) and ``speculate``."""

    def run(models: Models, prompts: list[Prompt], batch: int, config: BenchConfig, temperature: float) -> Output:
        ids = [p.input_ids.tolist() for p in prompts]
        kwargs = _decode_kwargs(models, config, temperature)
        if drafter is None:
            results = specdec.autoregressive_generate(models.target, ids, batch_size=batch, **kwargs)
        else:
            target = make_target(models.target)
            chosen = make_drafter(DrafterConfig(drafter, dtype=config.drafter_dtype[0]), target,
                                  loader=lambda _: models.drafter)
            schedule = None
            if speculate == "auto":  # measured once per batch size, kept over the repeats
                schedule = models.crossovers.setdefault(
                    batch, make_schedule(SpecConfig(gamma=config.gamma[0], speculate="auto")))
            results = specdec.speculative_generate(target, chosen, ids, batch_size=batch, gamma=config.gamma[0],
                                                   schedule=schedule, **kwargs)
        return Output([r.tokens for r in results], sum(r.stats.rounds for r in results),
                      sum(r.stats.drafted for r in results), sum(r.stats.accepted for r in results))

    return run


METHODS: dict[str, tuple[str, Callable[..., Output]]] = {
    BASELINE: ("the target's own batched generate (left padding, chunks of B)", run_hf),
    "plain": ("our loop drafting nothing (speculate off)", _ours(None, "off")),
    "spec": ("ours with the drafter model alone", _ours("model", "on")),
    "spec-lookup": ("ours with prompt lookup, then the drafter model (speculate on: the CLI's default)",
                    _ours(f"{LOOKUP}model", "on")),
    "auto": ("spec-lookup with speculate auto (drafting only at batch sizes where it measured faster)",
             _ours(f"{LOOKUP}model", "auto")),
}


@dataclass
class Cell:
    """One (method, batch size) of the sweep."""

    method: str
    batch: int
    wall_s: list[float] = field(default_factory=list)  # per repeat
    forward_s: list[float] = field(default_factory=list)  # per repeat: inside target + drafter forwards
    tokens: int = 0  # new tokens (first repeat)
    tau: float = 0.0  # tokens per row-round
    alpha: float | None = None  # accepted / drafted
    equal: int = 0  # greedy outputs equal to the target's generate of the prompt alone
    ties: int = 0  # of the others, differences at a near tie
    compared: int = 0

    @property
    def seconds(self) -> float:
        return statistics.median(self.wall_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.wall_s and self.seconds > 0 else 0.0

    @property
    def bookkeeping(self) -> float:
        """Median share of wall time outside both models' forward passes."""
        return statistics.median(1 - f / w for f, w in zip(self.forward_s, self.wall_s))


@dataclass
class SweepRun:
    config: BenchConfig
    environment: Environment
    prompts: list[Prompt]
    temperature: float
    cells: list[Cell]
    crossover: dict[int, int | None]  # auto's draft width per batch-size bucket (0: plain; None: uncapped)

    def cell(self, method: str, batch: int) -> Cell | None:
        return next((c for c in self.cells if c.method == method and c.batch == batch), None)


@torch.inference_mode()
def _top2_gap(target: PreTrainedModel, prompt: Prompt, reference: list[int], position: int) -> float:
    ids = torch.cat([prompt.input_ids, torch.tensor(reference[:position], dtype=torch.long)])[None]
    logits = target(input_ids=ids.to(target.device)).logits[0, -1].float()
    best = logits.topk(2).values
    return float(best[0] - best[1])


def _compare(cell: Cell, out: Output, references: list[list[int]], prompts: list[Prompt], target) -> None:
    for prompt, ours, ref in zip(prompts, out.tokens, references):
        cell.compared += 1
        if ours == ref:
            cell.equal += 1
            continue
        position = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
        cell.ties += int(_top2_gap(target, prompt, ref, position) < TIE)


def methods_of(config: BenchConfig) -> list[str]:
    """The sweep's methods: hf, spec (the model alone) and ours for each --speculate mode."""
    return [BASELINE, "spec", *(SPECULATE_METHODS[mode] for mode in config.speculate)]


def run_sweep(config: BenchConfig, console: Console | None = None) -> SweepRun:
    """Run every method at every batch size of ``config.batch_sizes``."""
    from specdec.bench.harness import _quiet_transformers

    with _quiet_transformers():
        load_start = load_average()
        target = load_model(config.target, device=config.device, dtype=config.dtype)
        drafter = load_model(config.drafter, device=target.device, dtype=target.dtype)
        # each kind of drafting's form before any run (auto: int8 alone, as loaded behind lookup; make_drafter
        # gives the same objects), so the meters count the model that drafts
        forms = {id(m): m for m in (drafter_in(drafter, config.drafter_dtype[0]),
                                    drafter_in(drafter, config.drafter_dtype[0], lookup=True))}
        tokenizer = load_tokenizer(config.tokenizer or config.target)
        prompts = load_prompts(config.prompts, config.num_prompts, config.seed, tokenizer)
        stop = make_target(target).stop_token_ids()
        models = Models(target, drafter, stop)
        temperature = config.temperature[0]
        clock = Clock(target.device)
        names = methods_of(config)
        references = [specdec.autoregressive_generate(target, p.input_ids, **_decode_kwargs(models, config, 0.0)).tokens
                      for p in prompts] if temperature == 0 else []
        cells = []
        progress = Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(),
                            console=console or Console(stderr=True), disable=not config.progress, transient=True)
        with progress:
            task = progress.add_task("batch sweep", total=len(config.batch_sizes) * len(names) * config.repeats)
            for turn, batch in enumerate(config.batch_sizes):
                shift = turn % len(names)
                for name in names[shift:] + names[:shift]:
                    progress.update(task, description=f"{name} B={batch}")
                    cell = Cell(name, batch)
                    run = METHODS[name][1]
                    for _ in range(config.warmup):
                        run(models, prompts[: max(batch, 1)], batch, config, temperature)
                    for repeat in range(config.repeats):
                        meters = [ForwardMeter(m, clock) for m in (target, *forms.values())]
                        with contextlib.ExitStack() as stack:
                            for meter in meters:
                                stack.enter_context(meter)
                            start = clock.now()
                            out = run(models, prompts, batch, config, temperature)
                            cell.wall_s.append(clock.now() - start)
                        cell.forward_s.append(sum(meter.seconds for meter in meters))
                        if repeat == 0:
                            cell.tokens = sum(len(t) for t in out.tokens)
                            cell.tau = cell.tokens / out.rows_rounds if out.rows_rounds else 0.0
                            cell.alpha = out.accepted / out.drafted if out.drafted else None
                            if references:
                                _compare(cell, out, references, prompts, target)
                        progress.advance(task)
                    cells.append(cell)
        environment = capture_environment((config.target, target), (config.drafter, drafter), load_start, {})
    crossover = {}
    for schedule in models.crossovers.values():
        assert isinstance(schedule, Crossover)
        crossover.update(schedule.width)
    return SweepRun(config, environment, prompts, temperature, cells, crossover)


@dataclass(frozen=True)
class Goal:
    name: str
    value: float | None
    target: str
    met: bool | None


def sweep_goals(run: SweepRun) -> list[Goal]:
    """Issue 16's goals, as ratios from this run."""
    goals = []

    def ratio(a: Cell | None, b: Cell | None) -> float | None:
        return a.tokens_per_s / b.tokens_per_s if a and b and b.tokens_per_s else None

    for batch in run.config.batch_sizes:
        if batch in (1, 2, 4):
            value = ratio(run.cell("spec-lookup", batch), run.cell(BASELINE, batch))
            goals.append(Goal(f"spec-lookup / hf at B={batch}", value, ">= 1.5",
                                   None if value is None else value >= 1.5))
        auto, plain, spec = run.cell("auto", batch), run.cell("plain", batch), run.cell("spec-lookup", batch)
        if auto and plain and spec:
            best = max(plain.tokens_per_s, spec.tokens_per_s)
            value = auto.tokens_per_s / best if best else None
            goals.append(Goal(f"auto / best of plain, spec-lookup at B={batch}", value, ">= 0.95",
                                   None if value is None else value >= 0.95))
        for name in ("spec-lookup", "auto"):
            cell = run.cell(name, batch)
            if cell and batch in (1, 16):
                limit = 0.10 if batch == 1 else 0.15
                goals.append(Goal(f"{name} bookkeeping at B={batch}", cell.bookkeeping, f"<= {limit:.0%}",
                                       cell.bookkeeping <= limit))
    return goals


def sweep_table(run: SweepRun) -> Table:
    table = Table(title=f"batch sweep, T={run.temperature:g}, γ={run.config.gamma[0]}, {len(run.prompts)} prompts, "
                        f"{run.config.max_new_tokens} new tokens, median of {run.config.repeats}")
    for column in ("B", "method", "tok/s", "× hf", "tau", "alpha", "bookkeeping", "greedy ="):
        table.add_column(column, justify="right" if column not in ("method",) else "left")
    for batch in run.config.batch_sizes:
        base = run.cell(BASELINE, batch)
        for cell in (c for c in run.cells if c.batch == batch):
            speedup = cell.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s else None
            equal = (f"{cell.equal}/{cell.compared}" + (f" ({cell.ties} tie)" if cell.ties else "")
                     if cell.compared else "–")
            table.add_row(str(batch), cell.method, f"{cell.tokens_per_s:.1f}",
                          "–" if speedup is None else f"{speedup:.2f}x", f"{cell.tau:.2f}",
                          "–" if cell.alpha is None else f"{cell.alpha:.2f}", f"{cell.bookkeeping:.1%}", equal)
    return table


def print_sweep(run: SweepRun, console: Console) -> None:
    console.print(sweep_table(run))
    env = run.environment
    console.print(f"{env.device} ({env.device_name}), {env.dtype}, {env.threads}; torch "
                  f"{env.torch_version}, transformers {env.transformers_version}", style="dim")
    print_choices_and_goals(console, run.crossover, sweep_goals(run))


def width_text(width: int | None) -> str:
    """``auto``'s choice at a batch size, from its draft width: plain, draft (uncapped) or draft <= k."""
    return "plain" if width == 0 else "draft" if width is None else f"draft <= {width}"


def print_choices_and_goals(console: Console, crossover: dict[int, int | None], goals: list[Goal]) -> None:
    """What ``auto`` chose per batch-size bucket (its draft width), then each goal with its value and whether it
    was met."""
    if crossover:
        console.print("auto chose: " + ", ".join(f"B<={b}: {width_text(w)}" for b, w in sorted(crossover.items())),
                      style="dim")
    for goal in goals:
        mark = "–" if goal.met is None else ("met" if goal.met else "NOT met")
        value = "–" if goal.value is None else f"{goal.value:.3g}"
        console.print(f"goal {goal.name}: {value} (target {goal.target}): {mark}")


def plot_sweep(run: SweepRun, path: Path) -> None:
    """tokens/s against batch size, one line per method (log2 axis)."""
    fig = Figure(figsize=(6.5, 4.5))
    ax = fig.subplots()
    for i, method in enumerate(dict.fromkeys(c.method for c in run.cells)):
        cells = [c for c in run.cells if c.method == method]
        ax.plot([c.batch for c in cells], [c.tokens_per_s for c in cells], marker="o", label=method,
                color=f"C{i}", linestyle="--" if method == BASELINE else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(run.config.batch_sizes), [str(b) for b in run.config.batch_sizes])
    ax.set_xlabel("batch size (prompts decoded together)")
    ax.set_ylabel("tokens/s (all prompts)")
    ax.set_title(f"{run.environment.device}, T={run.temperature:g}, γ={run.config.gamma[0]}, "
                 f"{len(run.prompts)} prompts × {run.config.max_new_tokens} tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_sweep(run: SweepRun, out_dir: Path, plots: bool = True) -> list[Path]:
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    summary = out_dir / "batch_sweep.json"
    summary.write_text(json.dumps({
        "config": asdict(run.config),
        "environment": asdict(run.environment),
        "temperature": run.temperature,
        "cells": [{**asdict(c), "tokens_per_s": c.tokens_per_s, "seconds": c.seconds, "bookkeeping": c.bookkeeping}
                  for c in run.cells],
        "crossover": {str(k): v for k, v in run.crossover.items()},
        "goals": [asdict(g) for g in sweep_goals(run)],
    }, indent=2))
    paths = [summary]
    if plots:
        paths.append(out_dir / "tokens_per_s_vs_batch.png")
        plot_sweep(run, paths[-1])
    return paths


def run_and_report(config: BenchConfig, console: Console) -> int:
    """``specdec bench --batch-sizes ...``: run, print, write; exit status 1 when a greedy output differs
    from the target's own beyond near ties."""
    run = run_sweep(config)
    paths = write_sweep(run, Path(config.output), plots=config.plots)
    print_sweep(run, console)
    console.print(f"wrote {', '.join(str(p) for p in paths)}", style="dim")
    exact = all(c.equal + c.ties == c.compared for c in run.cells)
    return 0 if exact else 1
