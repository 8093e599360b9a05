"""Reading a benchmark: figures, the rich tables printed at the end, and the files written.

``build_report`` turns a run into rows, goal checks and the gamma sweep; ``print_report`` shows
the main table (one row per method and setting), the environment, the goals of issue 5, the
sweep (LMFlow's "speedup in time / in target forwards"), the floor (each method's time per token
beside one pass over the target's weights) and any failure or greedy mismatch;
``write_outputs`` writes records.jsonl, summary.json (the same content as plain JSON) and the plots.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specdec.bench.floor import floor_rows
from specdec.bench.harness import BenchRun
from specdec.bench.plots import write_plots
from specdec.bench.records import write_records
from specdec.bench.runners import BASELINE
from specdec.bench.summary import GoalCheck, Row, SweepCell, check_goals, gamma_sweep, summarize


@dataclass(frozen=True)
class BenchReport:
    """A run and the figures derived from it."""

    run: BenchRun
    rows: list[Row]  # one per (method, setting)
    goals: list[GoalCheck]  # issue 5's throughput goals at each greedy gamma
    sweep: list[SweepCell]  # the gamma-dependent rows, for the sweep table

    @property
    def ok(self) -> bool:
        """No method failed and every greedy output equals plain-hf's (but a lossy peer's: reported, not failed)."""
        lossy = {b.runner.name for b in self.run.blocks if getattr(b.runner, "lossy", False)}
        return all(r.error is None and (r.greedy_equal == r.greedy_total or r.method in lossy) for r in self.rows)


def build_report(run: BenchRun) -> BenchReport:
    """Summarize a run."""
    rows = summarize(run)
    return BenchReport(run=run, rows=rows, goals=check_goals(rows, run.config.gamma), sweep=gamma_sweep(rows))


def _f(value: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{suffix}"


def _gamma(value: int | None) -> str:
    return "–" if value is None else str(value)


def describe_environment(run: BenchRun) -> str:
    """One paragraph: where and on what the figures were taken."""
    env, cfg = run.environment, run.config
    drafter = (
        f"drafter {env.drafter.parameters / 1e6:.2f}M params ({env.drafter.weight_mib:.0f} MiB)"
        if env.drafter
        else "no drafter model"
    )
    load = f", load avg {env.load_average_start[0]:.2f}→{env.load_average_end[0]:.2f}" if (
        env.load_average_start and env.load_average_end
    ) else ""
    return (
        f"{env.device} ({env.device_name}), {env.dtype}, {env.threads}{load}; "
        + (f"linear kernels {env.linear}; " if env.linear else "")
        + (f"compile {env.compile}; " if env.compile else "")
        + f"torch {env.torch_version}, transformers {env.transformers_version}; "
        f"target {env.target.parameters / 1e6:.2f}M params ({env.target.weight_mib:.0f} MiB), {drafter}; "
        f"{len(run.prompts)} prompts, max {cfg.max_new_tokens} new tokens, top-k {cfg.top_k}, top-p {cfg.top_p:g}, "
        f"{cfg.repeats} repeats (median), {cfg.warmup} warm-up runs; "
        f"step time target {run.target_step_s * 1e3:.2f} ms ({_path(run, 'target')})"
        + (f", drafter {run.drafter_step_s * 1e3:.2f} ms ({_path(run, 'drafter')})" if run.drafter_step_s is not None
           else "")
        + "".join(
            f"; compared drafter {label}: {info.parameters / 1e6:.2f}M params, "
            + (f"step {run.compared_step_s[label] * 1e3:.2f} ms" if label in run.compared_step_s
               else "drafts from the target's features (its cost: the measured drafting time)")
            for label, info in env.compared.items()
        )
    )


def main_table(rows: list[Row]) -> Table:
    """One row per method and setting."""
    table = Table(title="specdec bench", title_justify="left")
    for name, justify in (
        ("method", "left"), ("γ", "right"), ("T", "right"), ("tok/s", "right"), ("speedup", "right"),
        ("no loop", "right"), ("fwd×", "right"), ("tau", "right"), ("alpha", "right"), ("greedy =", "right"),
        ("c", "right"), ("theory", "right"), ("eff.", "right"), ("peak MiB", "right"), ("extra MiB", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        ties = f" ({r.greedy_near_ties} tie)" if r.greedy_near_ties else ""
        greedy = "–" if r.greedy_total is None else f"{r.greedy_equal}/{r.greedy_total}{ties}"
        style = "red" if r.error or (r.greedy_total and r.greedy_equal != r.greedy_total) else None
        table.add_row(
            r.method + (" ★" if r.peer else ""), _gamma(r.gamma), f"{r.temperature:g}", _f(r.tokens_per_s, ".1f"),
            _f(r.speedup, ".2f", "×"), _f(r.speedup_non_loop, ".2f", "×"), _f(r.forward_speedup, ".2f", "×"),
            _f(r.tau), _f(r.alpha), greedy,
            _f(r.cost_ratio, ".3f"), _f(r.theoretical_speedup, ".2f", "×"), _f(r.efficiency),
            _f(r.peak_mib, ".0f"), _f(r.extra_mib, "+.0f"),
            style=style,
        )
    return table


def goals_table(checks: list[GoalCheck]) -> Table:
    """The throughput goals of issue 5, measured."""
    table = Table(title="goals (greedy, ratio of mean tokens/s)", title_justify="left")
    for name in ("method", "γ", "over", "ratio", "no loop", "goal", "met"):
        table.add_column(name)
    for c in checks:
        table.add_row(
            c.goal.method, _gamma(c.gamma), c.versus, f"{c.ratio:.2f}×", _f(c.ratio_non_loop, ".2f", "×"),
            f"≥ {c.goal.at_least:g}×",
            "yes" if c.met else "no", style=None if c.met else "red",
        )
    return table


def sweep_table(cells: list[SweepCell]) -> Table:
    """Speedup in wall time / in target forwards, per gamma (rows) and method (columns)."""
    methods = list(dict.fromkeys((c.method, c.temperature) for c in cells))
    table = Table(title="gamma sweep: speedup in time / in target forwards", title_justify="left")
    table.add_column("γ", justify="right")
    for method, temperature in methods:
        table.add_column(f"{method} T={temperature:g}", justify="right")
    for gamma in sorted({c.gamma for c in cells}):
        by_method = {(c.method, c.temperature): c for c in cells if c.gamma == gamma}
        cells_text = []
        for key in methods:
            cell = by_method.get(key)
            cells_text.append("–" if cell is None else f"{_f(cell.speedup)} / {_f(cell.forward_speedup)}")
        table.add_row(str(gamma), *cells_text)
    return table


def _path(run: BenchRun, model: str) -> str:
    """How a model's step was timed, as the run decodes with it: "compiled" or "eager" (``measure.step_path``)."""
    return run.step_paths.get(model, "eager")


def floor_table(run: BenchRun) -> Table | None:
    """Greedy time per token of each method beside one pass over the target's weights (and the fastest exact
    plain engine); None when the run has no weight pass."""
    if run.target_pass is None:
        return None
    floor = run.target_pass
    table = Table(title=f"the floor: one pass over the target's weights {floor.seconds * 1e3:.2f} ms "
                        f"({floor.bytes / 2**20:.0f} MiB, {floor.gb_per_s:.1f} GB/s)", title_justify="left")
    for name in ("method", "ms/token", "× weight pass", "× fastest exact plain", "greedy exact", "MiB read",
                 "× its own bytes"):
        table.add_column(name, justify="left" if name == "method" else "right")
    table.add_row(f"target: one cached forward (step, {_path(run, 'target')})", f"{run.target_step_s * 1e3:.2f}",
                  f"{run.target_step_s / floor.seconds:.2f}×", "–", "–", f"{floor.bytes / 2**20:.0f}",
                  f"{run.target_step_s / floor.seconds:.2f}×", style="dim")
    for row in floor_rows(run.blocks, floor):
        table.add_row(row.method + (" (speculative)" if row.speculative else "")
                      + (f", started in {row.startup_s:.0f} s" if row.startup_s is not None else ""),
                      f"{row.ms_per_token:.2f}",
                      f"{row.over_weight_pass:.2f}×", _f(row.over_fastest, ".2f", "×"), "yes" if row.exact else "no",
                      "–" if row.bytes_per_token is None else f"{row.bytes_per_token / 2**20:.0f}",
                      _f(row.over_own_bytes, ".2f", "×"), style=None if row.exact else "red")
    if run.drafter_pass is not None and run.drafter_step_s is not None:
        table.add_row(f"drafter: one pass over its weights ({run.drafter_pass.bytes / 2**20:.1f} MiB)",
                      f"{run.drafter_pass.seconds * 1e3:.2f}", "–", "–", "–", "–", "–", style="dim")
        if run.drafter_round_pass_s is not None:
            table.add_row("drafter: the same pass after the target's steps, as its step is timed",
                          f"{run.drafter_round_pass_s * 1e3:.2f}", "–", "–", "–", "–", "–", style="dim")
        in_round = (f" ({run.drafter_step_s / run.drafter_round_pass_s:.2f}× after the target's)"
                    if run.drafter_round_pass_s else "")
        table.add_row(f"drafter: one cached forward (step, {_path(run, 'drafter')})", f"{run.drafter_step_s * 1e3:.2f}",
                      f"{run.drafter_step_s / run.drafter_pass.seconds:.2f}× its own{in_round}", "–", "–", "–", "–",
                      style="dim")
    return table


def floor_dict(run: BenchRun) -> dict | None:
    """summary.json's "floor": the weight passes, the steps over them, and the rows of ``floor_table``."""
    if run.target_pass is None:
        return None
    drafter = run.drafter_pass
    return {
        "target_pass": asdict(run.target_pass),
        "target_step_over_pass": run.target_step_s / run.target_pass.seconds,
        "drafter_pass": asdict(drafter) if drafter else None,
        "drafter_step_over_pass": run.drafter_step_s / drafter.seconds if drafter and run.drafter_step_s else None,
        "drafter_round_pass_s": run.drafter_round_pass_s,
        "drafter_step_over_round_pass": (run.drafter_step_s / run.drafter_round_pass_s
                                         if run.drafter_round_pass_s and run.drafter_step_s else None),
        "rows": [asdict(r) for r in floor_rows(run.blocks, run.target_pass)],
        "step_paths": run.step_paths,
    }


def print_report(report: BenchReport, console: Console) -> None:
    """Print everything a reader needs, tables first."""
    run, rows, checks, cells = report.run, report.rows, report.goals, report.sweep
    console.print(main_table(rows))
    console.print(describe_environment(run), style="dim")
    console.print(
        "tok/s: median over prompts; speedup: mean tokens/s over plain-hf's (Spec-Bench); no loop: the same "
        "over the prompts whose plain-hf output does not end in a degenerate loop; fwd×: tokens per "
        "target forward over plain-hf's; tau: tokens per round incl. recovered/bonus; alpha: accepted/drafted; "
        "greedy =: outputs equal to plain-hf's (tie: differs first at a near tie of the target); "
        "c: drafter/target step time; theory: Leviathan et al.; eff.: speedup/theory; ★: the peer of its group",
        style="dim",
    )
    for r in rows:
        if r.method == BASELINE and r.loop_prompts is not None:
            console.print(f"plain-hf's output at T={r.temperature:g} ends in a degenerate loop on "
                          f"{r.loop_prompts} of {r.prompts} prompts", style="dim")
    if checks:
        console.print(goals_table(checks))
    if len({c.gamma for c in cells}) > 1:
        console.print(sweep_table(cells))
    floor = floor_table(run)
    if floor is not None:
        console.print(floor)
    for r in rows:
        if r.error:
            gamma = f" γ={r.gamma}" if r.gamma is not None else ""
            console.print(f"[red]{r.method}{gamma} T={r.temperature:g} failed:[/red] {r.error}")
        if r.greedy_mismatches:
            console.print(f"[red]{r.method}: greedy output differs from plain-hf on[/red] "
                          f"{', '.join(r.greedy_mismatches)}")


def summary_dict(report: BenchReport) -> dict:
    """summary.json: configuration, environment, rows, goals, sweep, failures."""
    run, rows, checks, cells = report.run, report.rows, report.goals, report.sweep
    return {
        "config": asdict(run.config),
        "environment": asdict(run.environment),
        "prompts": [p.id for p in run.prompts],
        "target_step_s": run.target_step_s,
        "drafter_step_s": run.drafter_step_s,
        "compared_step_s": run.compared_step_s,
        "floor": floor_dict(run),
        "rows": [asdict(r) for r in rows],
        "goals": [asdict(c) for c in checks],
        "gamma_sweep": [asdict(c) for c in cells],
        "failures": [
            {"method": r.method, "gamma": r.gamma, "temperature": r.temperature, "error": r.error}
            for r in rows
            if r.error
        ],
    }


def write_outputs(report: BenchReport, out_dir: Path, plots: bool = True) -> list[Path]:
    """Write records.jsonl, summary.json and (optionally) the plots into out_dir; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = out_dir / "records.jsonl"
    write_records([r for b in report.run.blocks for r in b.records], records)
    summary = out_dir / "summary.json"
    summary.write_text(json.dumps(summary_dict(report), indent=2) + "\n", encoding="utf-8")
    return [records, summary, *(write_plots(report.rows, out_dir) if plots else [])]
