"""`specdec bench --block NAME`: SpecDec's block drafter against plain decoding and the model drafter.

Issue 17's figures, all from one process on the same prompts (ratios within the run, times the
median of ``repeats`` runs per prompt and method, methods interleaved prompt by prompt):

- a k sweep (``block_k``, SpecDec's k = 25 included): the block drafter alone and ``lookup+block``,
  against plain decoding (``speculative_generate(speculate="off")``), the autoregressive model
  drafter at each ``gamma`` and today's default ``lookup+<drafter>``; all exact (greedy);
- tokens per round, and acceptance by position in the block (share of the rounds that drafted
  position i whose draft i was accepted, i.e. whose first i + 1 drafts all were; a plot);
- SpecDec's top-β/τ rule (``beta`` × ``tau``; β = 1 is exact) with the block drafter at
  ``relaxed_k``: speed, and the quality cost against greedy decoding: the share of outputs
  identical to plain decoding's and the mean token edit distance (Levenshtein over token ids) to it.

Speed of a method = (sum over prompts of plain decoding's median time) / (the same for the method).
Outputs: ``block-summary.json``, ``block-summary.md`` and ``block-acceptance.png`` in ``output``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import specdec
from specdec.bench.config import BenchConfig
from specdec.bench.prompts import load_prompts
from specdec.bench.records import write_summary
from specdec.config import VerifyConfig
from specdec.drafters import BlockDrafter, LookupDrafter, ModelDrafter, drafter_in
from specdec.drafters.base import Drafter
from specdec.loading import load_model, load_tokenizer
from specdec.stats import GenerationResult
from specdec.target import make_target


@dataclass(frozen=True)
class Method:
    """One benchmarked way of decoding."""

    name: str  # label in the tables
    kind: str  # plain, model, lookup+model, block, lookup+block, block-relaxed
    gamma: int  # tokens drafted per round (k for the block drafter); 1 for plain
    drafter: Drafter | None  # None = plain decoding
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    beta: int = 1  # top-beta/tau rule (1 = exact)
    tau: float | None = None


@dataclass
class MethodFigures:
    """What a method measured over the prompts."""

    name: str
    kind: str
    gamma: int
    beta: int
    tau: float | None
    seconds: float = 0.0  # sum over prompts of the median time
    speed_vs_plain: float = 0.0
    speed_vs_model: float = 0.0  # over the model drafter at the first gamma
    tokens: int = 0
    rounds: int = 0
    tokens_per_round: float = 0.0
    acceptance_by_position: list[float] = field(default_factory=list)  # [i] share of the rounds drafting
                                                                       # position i whose draft i was accepted
    identical_share: float = 1.0  # outputs identical to plain decoding's
    mean_edit_distance: float = 0.0  # token edit distance to plain decoding's output, mean over prompts


def edit_distance(a: list[int], b: list[int]) -> int:
    """Levenshtein distance between two token lists."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def build_methods(config: BenchConfig, target, drafter_model, block_model) -> list[Method]:
    """Plain, the model drafter at each gamma, lookup+model, the block drafter at each k (alone and
    behind lookup), and the top-beta/tau grid at ``relaxed_k``."""
    model = ModelDrafter(drafter_model)
    block = BlockDrafter(block_model)
    methods = [Method("plain", "plain", 1, None)]
    methods += [Method(f"model g={g}", "model", g, model) for g in config.gamma]
    methods.append(Method(f"lookup+model g={config.gamma[0]}", "lookup+model", config.gamma[0], LookupDrafter(model)))
    for k in config.block_k:
        methods.append(Method(f"block k={k}", "block", k, block))
    for k in config.lookup_block_k or config.block_k:
        methods.append(Method(f"lookup+block k={k}", "lookup+block", k, LookupDrafter(BlockDrafter(block_model))))
    for beta in config.beta:
        for tau in config.tau:
            if beta == 1:
                continue  # beta = 1 is exact whatever tau: the block k row above
            verify = VerifyConfig(rule="topk_tau", beta=beta, tau=tau)
            methods.append(Method(f"block k={config.relaxed_k} b={beta} t={tau:g}", "block-relaxed",
                                  config.relaxed_k, block, verify, beta, tau))
    return methods


def _run(method: Method, target, ids: list[int], config: BenchConfig,
         stop: list[int]) -> tuple[float, GenerationResult]:
    start = time.perf_counter()
    result = specdec.speculative_generate(
        target, method.drafter if method.drafter is not None else "ngram", ids, max_new_tokens=config.max_new_tokens,
        gamma=method.gamma, stop_token_ids=stop, verify=method.verify,
        speculate="off" if method.drafter is None else "on")
    return time.perf_counter() - start, result


def run_block_bench(config: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run the sweep; return the figures (see the module docstring)."""
    if not config.block_k or any(k < 1 for k in config.block_k):
        raise ValueError(f"block_k must be one or more ints >= 1, got {config.block_k}")
    target = load_model(config.target, device=config.device, dtype=config.dtype)
    tokenizer = load_tokenizer(config.tokenizer or config.target)
    drafter_model = drafter_in(load_model(config.drafter, device=target.device, dtype=target.dtype),
                               config.drafter_dtype[0])
    block_name = "code-block-drafter" if config.block == "block" else config.block.removeprefix("block:")
    block_model = load_model(block_name, device=target.device, dtype=target.dtype)
    if max(config.block_k) > block_model.config.max_block_size:
        raise ValueError(f"block_k {max(config.block_k)} is larger than the block drafter's trained maximum "
                         f"{block_model.config.max_block_size}: drop it from --block-k")
    eos = target.generation_config.eos_token_id
    stop = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    prompts = [p.input_ids.tolist() for p in load_prompts(config.prompts, config.num_prompts, config.seed, tokenizer)]
    methods = build_methods(config, target, drafter_model, block_model)
    handle = make_target(target)
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    results: dict[str, list[GenerationResult]] = {m.name: [] for m in methods}
    with torch.inference_mode():
        for method in methods:  # warm-up, untimed
            for ids in prompts[: config.warmup]:
                _run(method, handle, ids, config, stop)
        for index, ids in enumerate(prompts):
            runs: dict[str, list[float]] = {m.name: [] for m in methods}
            for repeat in range(config.repeats):
                order = methods if repeat % 2 == 0 else methods[::-1]  # no method always first or last
                for method in order:
                    seconds, result = _run(method, handle, ids, config, stop)
                    runs[method.name].append(seconds)
                    if repeat == 0:
                        results[method.name].append(result)
            for name, values in runs.items():
                times[name].append(statistics.median(values))
            log(f"prompt {index + 1}/{len(prompts)}: plain {times['plain'][-1]:.3f}s, "
                + ", ".join(f"{m.name} {times[m.name][-1]:.3f}s" for m in methods[1:4]))
    plain_total = sum(times["plain"])
    model_name = f"model g={config.gamma[0]}"
    model_total = sum(times[model_name])
    reference = [r.tokens for r in results["plain"]]
    figures = []
    for method in methods:
        out = results[method.name]
        total = sum(times[method.name])
        drafted: list[int] = []
        accepted: list[int] = []
        for r in out:
            for per, src in ((drafted, r.stats.drafted_per_position), (accepted, r.stats.accepted_per_position)):
                per.extend([0] * (len(src) - len(per)))
                for i, n in enumerate(src):
                    per[i] += n
        tokens, rounds = sum(r.stats.new_tokens for r in out), sum(r.stats.rounds for r in out)
        distances = [edit_distance(r.tokens, ref) for r, ref in zip(out, reference)]
        figures.append(MethodFigures(
            method.name, method.kind, method.gamma, method.beta, method.tau, round(total, 4),
            round(plain_total / total, 3), round(model_total / total, 3), tokens, rounds,
            round(tokens / rounds, 3) if rounds else 0.0,
            [round(a / d, 4) if d else 0.0 for a, d in zip(accepted + [0] * (len(drafted) - len(accepted)), drafted)],
            round(sum(d == 0 for d in distances) / len(distances), 4), round(statistics.mean(distances), 3)))
    return {"config": {k: v for k, v in asdict(config).items()}, "block": block_name,
            "prompts": len(prompts), "methods": [asdict(f) for f in figures]}


def summary_markdown(summary: dict) -> str:
    """The figures as a Markdown table."""
    lines = [("| method | speed vs plain | speed vs model drafter | tokens per round | identical to greedy | "
             "mean token edit distance |"), "|---|---|---|---|---|---|"]
    for m in summary["methods"]:
        lines.append(f"| {m['name']} | {m['speed_vs_plain']:.2f}x | {m['speed_vs_model']:.2f}x | "
                     f"{m['tokens_per_round']:.2f} | {m['identical_share']:.0%} | {m['mean_edit_distance']:.2f} |")
    lines += ["", "Acceptance by position (share of rounds whose draft at position i was accepted; exact):", ""]
    for m in summary["methods"]:
        if m["kind"] in ("block", "model"):
            shown = " ".join(f"{a:.2f}" for a in m["acceptance_by_position"])
            lines.append(f"- {m['name']}: {shown}")
    return "\n".join(lines) + "\n"


def plot_acceptance(summary: dict, path: Path) -> None:
    """Acceptance by position in the block, one line per k (and the model drafter for reference)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for m in summary["methods"]:
        if m["kind"] in ("block", "model") and m["acceptance_by_position"]:
            values = m["acceptance_by_position"]
            ax.plot(range(1, len(values) + 1), values, marker="o" if m["kind"] == "model" else ".",
                    linestyle="--" if m["kind"] == "model" else "-", label=m["name"])
    ax.set_xlabel("position in the draft (1 = first drafted token)")
    ax.set_ylabel("share of rounds with the draft accepted there")
    ax.set_title(f"Block drafter acceptance by position ({summary['prompts']} prompts, greedy)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_and_report(config: BenchConfig, console) -> int:
    """`specdec bench --block`: run, print the table, write the outputs."""
    summary = run_block_bench(config, log=lambda line: console.print(line, style="dim"))
    out = Path(config.output)
    table = summary_markdown(summary)
    paths = write_summary(out, "block", summary, table)
    if config.plots:
        plot_acceptance(summary, out / "block-acceptance.png")
        paths.append(out / "block-acceptance.png")
    console.print(table)
    console.print(f"wrote {', '.join(str(p) for p in paths)}", style="dim")
    differ = [m["name"] for m in summary["methods"] if m["beta"] == 1 and m["identical_share"] < 1]
    if differ:  # exact methods must reproduce plain decoding token for token
        console.print(f"outputs differ from plain decoding's with exact verification: {', '.join(differ)}", style="red")
    return 1 if differ else 0
