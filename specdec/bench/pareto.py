"""`specdec bench --pareto`: SpecDec++'s sweep of draft-length schedules (issue 18's figures).

Every schedule of :mod:`specdec.schedules` with the drafter model alone (no prompt lookup, as
SpecDec++ measures it), at each ``temperature`` (0 = greedy, 1 = sampling):

- ``constant K`` for K in ``pareto_gamma`` (1..8);
- ``heuristic`` (transformers' +2 / -1 from 20 tokens, within ``pareto_bound``);
- ``confidence t`` for t in ``pareto_confidence`` (stop when the drafter's top probability < t,
  with transformers' ROC retuning);
- ``ada t`` for t in ``pareto_ada`` (SpecDec++: stop when 1 - prod P(accept) > t, within
  ``pareto_bound``), with the acceptance head ``head`` (default: the one shipped beside the drafter).

All from one process on the same prompts: a method's time on a prompt is the median of ``repeats``
runs, methods interleaved prompt by prompt (the order reversed every other repeat); its speed is
(sum over prompts of plain decoding's time) / (the same for the method). Per method: speed, tokens
per second, mean drafted length per round, acceptance rate alpha and tokens per round tau; greedy
methods must reproduce plain decoding token for token (checked, a failure is reported).

Calibration of the head, online: at every round of every ``ada`` run (first repeat), the head's
value behind each drafted position is paired with whether the draft it estimates was accepted
(``specdec.heads.model``: a "response" head's value at position i estimates draft i, a "mixed"
head's draft i - 1), over drafts whose earlier drafts were all accepted (the only ones verified
on their own); binned predicted vs observed, with the Brier score, per temperature.

Goals (SpecDec++): ada's best threshold >= 5% faster than the best constant K; ada >= heuristic and
>= confidence's best; the head's default threshold within 2% of the best threshold swept.
Outputs in ``output``: ``pareto-summary.json``, ``pareto-summary.md``, ``pareto.png`` (speed
against mean drafted length) and ``pareto-calibration.png``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import specdec
from specdec.acceptance import Verdict
from specdec.bench.config import BenchConfig
from specdec.bench.prompts import load_prompts
from specdec.bench.records import write_summary
from specdec.config import ScheduleConfig, SpecConfig
from specdec.drafters import ModelDrafter, drafter_in
from specdec.drafters.base import Proposal
from specdec.heads.evaluate import Calibration, calibration, plot_calibration
from specdec.heads.model import draft_estimates, load_head
from specdec.loading import load_model, load_tokenizer
from specdec.schedules import Ada, DraftPlan, Schedule, make_schedule
from specdec.stats import GenerationResult
from specdec.target import make_target

HEURISTIC_START = 20  # transformers' num_assistant_tokens default: where the heuristic starts
FAMILIES = ("constant", "heuristic", "confidence", "ada")


@dataclass(frozen=True)
class Method:
    """One schedule setting of the sweep (plain decoding: family "plain")."""

    name: str  # label in the tables, e.g. "ada 0.5"
    family: str  # plain, constant, heuristic, confidence, ada
    value: float | None  # K for constant, the threshold for confidence and ada, None otherwise


class Recorded(Schedule):
    """A schedule that keeps, for the calibration, each round's head values and verdicts."""

    def __init__(self, inner: Ada) -> None:
        self.inner = inner
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # ([B, k] head values, [B, k] 1 accepted
                                                                  # / 0 rejected / -1 unverified)

    @property
    def most(self) -> int | None:
        return self.inner.most

    def plan(self, rows: int, device: torch.device | str) -> DraftPlan:
        return self.inner.plan(rows, device)

    def update(self, proposal: Proposal, verdict: Verdict) -> None:
        if proposal.hidden is not None and proposal.k:
            values = self.inner.accept(proposal.hidden.flatten(0, 1)).view(proposal.hidden.shape[:2]).float().cpu()
            position = torch.arange(proposal.k)[None]  # [1, k]
            accepted = verdict.accepted.cpu()[:, None]  # [B, 1]
            drafted = position < proposal.lengths.cpu()[:, None]  # [B, k]
            outcome = torch.where(position < accepted, 1, torch.where(position == accepted, 0, -1))
            self.pairs.append((values, torch.where(drafted, outcome, -1)))
        self.inner.update(proposal, verdict)

    def add(self, rows: int) -> None:
        self.inner.add(rows)

    def select(self, rows: torch.Tensor) -> None:
        self.inner.select(rows)


def calibration_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]], inputs: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(predicted [N], observed [N]) from ``Recorded.pairs``: a "response" head's value at position i
    estimates draft i, a "mixed" head's (SpecDec++'s data) draft i - 1; unverified drafts are left out."""
    predicted, observed = [], []
    for values, outcome in pairs:
        values = draft_estimates(values, inputs)  # [B, k'] column j: the estimate for draft j
        outcome = outcome[:, : values.shape[1]]
        verified = outcome >= 0
        predicted.append(values[verified])
        observed.append(outcome[verified].float())
    if not predicted:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat(predicted), torch.cat(observed)


@dataclass
class MethodFigures:
    """What one method measured over the prompts at one temperature."""

    name: str
    family: str
    value: float | None
    temperature: float
    seconds: float = 0.0  # sum over prompts of the median time
    speed_vs_plain: float = 0.0
    tokens_per_s: float = 0.0
    mean_drafted: float = 0.0  # draft tokens per round
    acceptance_rate: float = 0.0  # alpha = accepted / drafted
    tokens_per_round: float = 0.0  # tau
    identical_share: float = 1.0  # outputs identical to plain decoding's (greedy: must be 1)


def build_methods(config: BenchConfig) -> list[Method]:
    """Plain decoding, then every schedule setting of the sweep."""
    methods = [Method("plain", "plain", None)]
    methods += [Method(f"constant {k}", "constant", k) for k in config.pareto_gamma]
    methods.append(Method("heuristic", "heuristic", None))
    methods += [Method(f"confidence {t:g}", "confidence", t) for t in config.pareto_confidence]
    methods += [Method(f"ada {t:g}", "ada", t) for t in config.pareto_ada]
    return methods


def make_method_schedule(method: Method, config: BenchConfig, drafter) -> Schedule | None:
    """The schedule ``method`` decodes with (``Recorded`` around ada's), None for plain decoding."""
    if method.family == "plain":
        return None
    gamma = int(method.value) if method.family == "constant" else HEURISTIC_START
    schedule_config = ScheduleConfig(method.family,
                                     stop_threshold=method.value if method.family in ("confidence", "ada") else None,
                                     bound=tuple(config.pareto_bound), head=config.head)
    schedule = make_schedule(SpecConfig(gamma=gamma), schedule_config, drafter)
    return Recorded(schedule) if isinstance(schedule, Ada) else schedule


def _run(method: Method, schedule: Schedule | None, drafter, target, ids: list[int], config: BenchConfig,
         temperature: float, stop: list[int]) -> tuple[float, GenerationResult]:
    start = time.perf_counter()
    result = specdec.speculative_generate(
        target, drafter if schedule is not None else "ngram", ids, max_new_tokens=config.max_new_tokens,
        temperature=temperature, top_k=config.top_k, top_p=config.top_p, seed=config.seed, stop_token_ids=stop,
        schedule=schedule, speculate="off" if schedule is None else "on")
    return time.perf_counter() - start, result


def run_pareto_bench(config: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run the sweep; return the figures (see the module docstring)."""
    target = load_model(config.target, device=config.device, dtype=config.dtype)
    tokenizer = load_tokenizer(config.tokenizer or config.target)
    drafter = ModelDrafter(drafter_in(load_model(config.drafter, device=target.device, dtype=target.dtype),
                                      config.drafter_dtype[0]))
    handle = make_target(target)
    drafter.align(handle)
    eos = target.generation_config.eos_token_id
    stop = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    prompts = [p.input_ids.tolist() for p in load_prompts(config.prompts, config.num_prompts, config.seed, tokenizer)]
    methods = build_methods(config)
    head = None
    if any(m.family == "ada" for m in methods):  # the head the ada schedules load, for its kind and threshold
        head = load_head(config.head or drafter.head_path(), drafter.hidden_size)
    figures: list[MethodFigures] = []
    curves: dict[str, Calibration] = {}
    with torch.inference_mode():
        for temperature in config.temperature:
            schedules = {m.name: make_method_schedule(m, config, drafter) for m in methods}
            ada = [s for s in schedules.values() if isinstance(s, Recorded)]
            times: dict[str, list[float]] = {m.name: [] for m in methods}
            results: dict[str, list[GenerationResult]] = {m.name: [] for m in methods}
            for m in methods:  # warm-up, untimed
                for ids in prompts[: config.warmup]:
                    _run(m, schedules[m.name], drafter, handle, ids, config, temperature, stop)
            for s in ada:
                s.pairs.clear()
            for index, ids in enumerate(prompts):
                runs: dict[str, list[float]] = {m.name: [] for m in methods}
                for repeat in range(config.repeats):
                    for m in methods if repeat % 2 == 0 else methods[::-1]:  # no method always first or last
                        schedule = schedules[m.name]
                        if repeat > 0 and isinstance(schedule, Recorded):
                            schedule = schedule.inner  # the calibration counts each round once
                        seconds, result = _run(m, schedule, drafter, handle, ids, config, temperature, stop)
                        runs[m.name].append(seconds)
                        if repeat == 0:
                            results[m.name].append(result)
                for name, values in runs.items():
                    times[name].append(statistics.median(values))
                log(f"T={temperature:g} prompt {index + 1}/{len(prompts)}: plain {times['plain'][-1]:.3f}s, "
                    + ", ".join(f"{m.name} {times[m.name][-1]:.3f}s" for m in methods[1:] if m.family != "constant"))
            figures += _figures(methods, times, results, temperature)
            if ada and head is not None:
                predicted, observed = calibration_pairs([p for s in ada for p in s.pairs], head.config.inputs)
                if len(predicted):
                    curves[_kind(temperature)] = calibration(predicted, observed)
    summary = {"config": asdict(config), "prompts": len(prompts), "methods": [asdict(f) for f in figures],
               "head": None if head is None else {"inputs": head.config.inputs, "labels": head.config.labels,
                                                  "default_threshold": head.default_threshold},
               "calibration": {k: asdict(c) for k, c in curves.items()}}
    summary["goals"] = goals(summary)
    return summary


def _kind(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"sampling T={temperature:g}"


def _figures(methods: list[Method], times: dict[str, list[float]], results: dict[str, list[GenerationResult]],
             temperature: float) -> list[MethodFigures]:
    plain_total = sum(times["plain"])
    reference = [r.tokens for r in results["plain"]]
    out = []
    for m in methods:
        rs = results[m.name]
        total = sum(times[m.name])
        tokens, rounds = sum(r.stats.new_tokens for r in rs), sum(r.stats.rounds for r in rs)
        drafted, accepted = sum(r.stats.drafted for r in rs), sum(r.stats.accepted for r in rs)
        out.append(MethodFigures(
            m.name, m.family, m.value, temperature, round(total, 4), round(plain_total / total, 3),
            round(tokens / total, 2), round(drafted / rounds, 3) if rounds else 0.0,
            round(accepted / drafted, 4) if drafted else 0.0, round(tokens / rounds, 3) if rounds else 0.0,
            round(sum(r.tokens == ref for r, ref in zip(rs, reference)) / len(rs), 4)))
    return out


@dataclass(frozen=True)
class Goal:
    """One of the issue's goals, at one temperature."""

    temperature: float
    text: str  # what is compared, with the figures
    met: bool


def goals(summary: dict) -> list[dict]:
    """SpecDec++'s goals per temperature (see the module docstring)."""
    out: list[Goal] = []
    default = summary["head"]["default_threshold"] if summary["head"] else None
    for temperature in sorted({m["temperature"] for m in summary["methods"]}):
        ms = [m for m in summary["methods"] if m["temperature"] == temperature]
        best = {f: max((m for m in ms if m["family"] == f), key=lambda m: m["speed_vs_plain"], default=None)
                for f in FAMILIES}
        ada = best["ada"]
        if ada is None:
            continue
        for family, need in (("constant", 1.05), ("heuristic", 1.0), ("confidence", 1.0)):
            other = best[family]
            if other is not None:
                ratio = ada["speed_vs_plain"] / other["speed_vs_plain"]
                out.append(Goal(temperature, f"{ada['name']} ({ada['speed_vs_plain']:.2f}x plain) vs {other['name']} "
                                f"({other['speed_vs_plain']:.2f}x): {ratio:.3f} (goal >= {need:g})", ratio >= need))
        shipped = next((m for m in ms if m["family"] == "ada" and default is not None
                        and math.isclose(m["value"], default)), None)
        if shipped is not None:
            ratio = shipped["speed_vs_plain"] / ada["speed_vs_plain"]
            out.append(Goal(temperature, f"default threshold {default:g} ({shipped['speed_vs_plain']:.2f}x) vs the "
                                         f"best, {ada['name']}: {ratio:.3f} (goal >= 0.98)", ratio >= 0.98))
    return [asdict(g) for g in out]


def summary_markdown(summary: dict) -> str:
    """The figures as a Markdown table per temperature, then the goals and the head's calibration."""
    lines = []
    for temperature in sorted({m["temperature"] for m in summary["methods"]}):
        lines += [f"{_kind(temperature)} ({summary['prompts']} prompts):", "",
                  "| schedule | speed vs plain | tokens/s | mean drafted | alpha | tau | identical to plain |",
                  "|---|---|---|---|---|---|---|"]
        for m in summary["methods"]:
            if m["temperature"] == temperature:
                lines.append(f"| {m['name']} | {m['speed_vs_plain']:.3f}x | {m['tokens_per_s']:.1f} | "
                             f"{m['mean_drafted']:.2f} | {m['acceptance_rate']:.2f} | {m['tokens_per_round']:.2f} | "
                             f"{m['identical_share']:.0%} |")
        lines.append("")
    lines += ["Goals:", ""]
    lines += [f"- {_kind(g['temperature'])}: {g['text']}: {'met' if g['met'] else 'MISSED'}" for g in summary["goals"]]
    if summary["calibration"]:
        lines += ["",
                  "Acceptance head calibration, online (drafts of the ada runs whose earlier drafts were accepted):",
                  ""]
        for kind, c in summary["calibration"].items():
            lines.append(f"- {kind}: {sum(c['counts'])} drafts, Brier {c['brier']:.3f} (predicting the mean "
                         f"{c['mean_label']:.2f} everywhere: {c['brier_base']:.3f})")
    return "\n".join(lines) + "\n"


def plot_pareto(summary: dict, path: Path) -> None:
    """Speed against mean drafted length per round, one panel per temperature, one line per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({m["temperature"] for m in summary["methods"]})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(6.5 * len(temperatures), 4.5), squeeze=False)
    styles = {"constant": ("o", "-"), "heuristic": ("*", ""), "confidence": ("s", "--"), "ada": ("D", "-")}
    for ax, temperature in zip(axes[0], temperatures):
        ms = [m for m in summary["methods"] if m["temperature"] == temperature]
        for family, (marker, line) in styles.items():
            points = sorted((m["mean_drafted"], m["speed_vs_plain"], m["value"]) for m in ms if m["family"] == family)
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, linestyle=line or "none",
                    label=family)
            for x, y, value in points:
                if value is not None:
                    ax.annotate(f"{value:g}", (x, y), textcoords="offset points", xytext=(3, 4), fontsize=7)
        ax.axhline(1.0, color="grey", lw=1, ls=":")
        ax.set_xlabel("mean drafted tokens per round")
        ax.set_ylabel("speed vs plain decoding")
        ax.set_title(f"{_kind(temperature)}, {summary['prompts']} prompts")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_and_report(config: BenchConfig, console) -> int:
    """`specdec bench --pareto`: run, print the tables, write the outputs."""
    summary = run_pareto_bench(config, log=lambda line: console.print(line, style="dim"))
    out = Path(config.output)
    table = summary_markdown(summary)
    paths = write_summary(out, "pareto", summary, table)
    if config.plots:
        plot_pareto(summary, out / "pareto.png")
        paths.append(out / "pareto.png")
        if summary["calibration"]:
            curves = {k: Calibration(**c) for k, c in summary["calibration"].items()}
            plot_calibration(curves, str(out / "pareto-calibration.png"),
                             title="acceptance head calibration while decoding (ada runs)")
            paths.append(out / "pareto-calibration.png")
    console.print(table)
    console.print(f"wrote {', '.join(str(p) for p in paths)}", style="dim")
    differ = [f"{m['name']} (T=0)" for m in summary["methods"] if m["temperature"] == 0 and m["identical_share"] < 1]
    if differ:  # every schedule keeps greedy output exact
        console.print(f"outputs differ from plain decoding's: {', '.join(differ)}", style="red")
    return 1 if differ else 0
