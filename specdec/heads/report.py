"""``specdec train head-eval``: an acceptance head's calibration and its stop rule, simulated offline.

Contract: ``evaluate_head(head, valid_outputs, out_dir)`` builds (or reuses) round data of held-out
records (``specdec.heads.evaluate.build_rounds``: greedy rounds on the target's greedy texts,
sampling rounds on its temperature-1 texts), then writes to ``out_dir``:

- ``calibration.png``: predicted vs observed acceptance per bin, with Brier scores, for each label
  kind, on the rounds (what the stop rule reads) and, with ``valid_data``, on teacher-forced
  validation examples (what the head was trained on);
- ``tradeoff.png``: tau per round against mean drafted length, constant K vs the head's rule at
  each threshold (and the drafter-confidence rule);
- ``summary.json`` / ``summary.md``: every figure, and the threshold chosen as default: the one of
  highest modelled speedup ``tau / (1 + c * drafted)`` (Leviathan et al.'s cost model, c = drafter
  step / target step) summed over both label kinds.

What pairs are compared for calibration: the head's estimate for draft ``i`` (its value behind draft
``i + 1`` for a "mixed" head, behind draft ``i`` for a "response" head: ``specdec.heads.data``) with
draft ``i``'s acceptance probability, over rounds whose drafts before ``i`` were all accepted (the
only ones whose product matters).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from specdec.heads.data import load_head_data, read_records
from specdec.heads.evaluate import (
    RoundData,
    build_rounds,
    calibration,
    draft_lengths,
    head_values,
    load_rounds,
    plot_calibration,
    save_rounds,
    simulate,
    walk,
)
from specdec.heads.model import AcceptanceHead, draft_estimates, drafter_hidden_size

TEXT_TEMPERATURE = {"greedy": 0.0, "sampling": 1.0}  # which records each round kind drafts on
COST_RATIO = 0.19  # drafter step / target step of the shipped pair (models/code-drafter/README.md)
CONFIDENCE = (0.2, 0.4, 0.6, 0.8)  # transformers' assistant_confidence_threshold values simulated


def rounds_for(kind: str, valid_outputs: str, out: Path, target: str, drafter: str, device: str,
               records: int | None, log=print) -> RoundData:
    """The round data of one kind, from ``out/rounds-<kind>.safetensors`` when it is there."""
    path = out / f"rounds-{kind}.safetensors"
    if path.exists():
        return load_rounds(str(path))
    from specdec.loading import load_model

    chosen = [r for r in read_records(valid_outputs, records) if r.temperature == TEXT_TEMPERATURE[kind]]
    if not chosen:
        raise ValueError(f"{valid_outputs} has no record written at temperature {TEXT_TEMPERATURE[kind]} "
                         f"for {kind} rounds: generate it with `specdec train outputs --sampled-every 4`")
    t, d = load_model(target, device=device, dtype="fp32"), load_model(drafter, device=device, dtype="fp32")
    log(f"drafting {kind} rounds from every start of {len(chosen)} records")
    rounds = build_rounds(t, d, chosen, kind, depth=16, seed=0,
                          progress=lambda i, n: log(f"  {i}/{n}") if i % 25 == 0 or i == n else None)
    save_rounds(rounds, str(path))
    return rounds


def round_pairs(values: torch.Tensor, labels: torch.Tensor, inputs: str = "mixed") -> tuple[torch.Tensor, torch.Tensor]:
    """(the head's estimate for draft i, acceptance of draft i) over rounds whose drafts before i were
    all accepted (greedy: exactly; sampling: weighted by that chance, by sampling it). [M], [M]
    A "mixed" head's estimate for draft i is its value behind draft i+1; a "response" head's is its
    value behind draft i itself (``specdec.heads.data``)."""
    pred = draft_estimates(values, inputs)  # [S, K'] column j: the estimate for draft j
    label = labels[:, : pred.shape[1]]
    before = torch.cat([torch.ones_like(label[:, :1]), label[:, :-1].cumprod(-1)], dim=1)  # [S, K']
    keep = torch.rand(before.shape, generator=torch.Generator().manual_seed(0)) < before
    return pred[keep], label[keep]


def evaluate_head(head_path: str | None, valid_outputs: str, out_dir: str, target: str = "code-target",
                  drafter: str = "code-drafter", valid_data: str | None = None,
                  thresholds: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9), bound: tuple[int, int] = (1, 16),
                  device: str = "cpu", records: int | None = None, cost_ratio: float = COST_RATIO,
                  log=print) -> dict:
    """Write the evaluation (module docstring) into ``out_dir``; return the summary."""
    from specdec.loading import load_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head = AcceptanceHead.from_pretrained(head_path)
    head.check_hidden_size(drafter_hidden_size(load_model(drafter, device="cpu")), f"the drafter {drafter}")
    summary: dict = {"head": str(head_path or "shipped"), "head_config": asdict(head.config), "bound": list(bound),
                     "cost_ratio": cost_ratio, "kinds": {}}
    curves = {}
    for kind in ("greedy", "sampling"):
        rounds = rounds_for(kind, valid_outputs, out, target, drafter, device, records, log)
        values = head_values(head, rounds)  # [S, K]
        pred, label = round_pairs(values, rounds.labels, head.config.inputs)
        cal = calibration(pred, label)
        curves[f"{kind} rounds"] = cal
        points = simulate(rounds, values, thresholds, bound, confidence=CONFIDENCE)
        entry = {"rounds": len(rounds), "records": int(rounds.record.unique().numel()),
                 "calibration_rounds": asdict(cal), "points": [asdict(p) for p in points]}
        if kind == "greedy":  # the exact trace of greedy decoding
            traces = {f"constant K={k}": torch.full((len(rounds),), k) for k in range(1, 9)}
            traces.update({f"ada {t}": draft_lengths(values, t, bound) for t in thresholds})
            entry["walk"] = {name: dict(zip(("drafted", "tau", "rounds"), walk(rounds, lengths)))
                             for name, lengths in traces.items()}
        if valid_data is not None:
            data = load_head_data(valid_data, (kind,))
            tf = calibration(head.accept_probability(data.hidden.float()), data.label)
            curves[f"{kind} teacher-forced"] = tf
            entry["calibration_teacher_forced"] = asdict(tf)
        summary["kinds"][kind] = entry
    plot_calibration(curves, str(out / "calibration.png"))
    summary["chosen"] = choose_threshold(summary, thresholds, cost_ratio)
    _plot_tradeoff(summary, str(out / "tradeoff.png"))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(summary_markdown(summary))
    return summary


def modelled_speedup(tau: float, drafted: float, cost_ratio: float) -> float:
    """Tokens per target-forward time: tau / (1 + c * drafted) (Leviathan et al. 2023, with the mean
    drafted length in place of gamma)."""
    return tau / (1.0 + cost_ratio * drafted)


def choose_threshold(summary: dict, thresholds, cost_ratio: float) -> dict:
    """The threshold of highest modelled speedup, summed over label kinds; with the best constant K."""
    score: dict[str, float] = {}
    best_constant: dict[str, tuple[str, float]] = {}
    for kind, entry in summary["kinds"].items():
        for p in entry["points"]:
            s = modelled_speedup(p["tau"], p["drafted"], cost_ratio)
            if p["schedule"].startswith("ada"):
                score[p["schedule"]] = score.get(p["schedule"], 0.0) + s
            if p["schedule"].startswith("constant") and s > best_constant.get(kind, ("", 0.0))[1]:
                best_constant[kind] = (p["schedule"], s)
    name = max(score, key=score.get)
    per_kind = {}
    for kind, entry in summary["kinds"].items():
        pts = {p["schedule"]: p for p in entry["points"]}
        s = modelled_speedup(pts[name]["tau"], pts[name]["drafted"], cost_ratio)
        per_kind[kind] = {"ada": round(s, 4), "best_constant": best_constant[kind][0],
                          "best_constant_speedup": round(best_constant[kind][1], 4),
                          "gain": round(s / best_constant[kind][1] - 1, 4)}
    return {"threshold": float(name.split()[1]), "per_kind": per_kind}


def _plot_tradeoff(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(summary["kinds"])
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5))
    for ax, kind in zip(axes if len(kinds) > 1 else [axes], kinds):
        pts = summary["kinds"][kind]["points"]
        for prefix, style in (("constant", "o-"), ("ada", "s-"), ("confidence", "^-")):
            sel = [p for p in pts if p["schedule"].startswith(prefix)]
            ax.plot([p["drafted"] for p in sel], [p["tau"] for p in sel], style, label=prefix)
            for p in sel:
                ax.annotate(p["schedule"].split()[-1].replace("K=", ""), (p["drafted"], p["tau"]),
                            fontsize=7, xytext=(3, -8), textcoords="offset points")
        ax.set_xlabel("mean drafted tokens per round")
        ax.set_ylabel("tau: tokens per round (accepted + 1)")
        ax.set_title(f"{kind}: {summary['kinds'][kind]['rounds']} rounds from every start")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_markdown(summary: dict) -> str:
    """The summary's tables in Markdown."""
    c = summary["cost_ratio"]
    lines = [(f"Head: {summary['head']} ({summary['head_config']}); bound {summary['bound']}; modelled speedup "
              f"= tau / (1 + {c} x drafted)."), ""]
    for kind, entry in summary["kinds"].items():
        lines += [f"### {kind} ({entry['rounds']} rounds from every start of {entry['records']} records)", ""]
        cal = entry["calibration_rounds"]
        lines.append(f"Calibration on rounds: Brier {cal['brier']:.4f} (predicting the mean {cal['mean_label']:.3f} "
                     f"everywhere: {cal['brier_base']:.4f}).")
        if "calibration_teacher_forced" in entry:
            tf = entry["calibration_teacher_forced"]
            lines.append(f"Teacher-forced validation examples: Brier {tf['brier']:.4f} (base {tf['brier_base']:.4f}).")
        lines += ["", "| schedule | drafted / round | tau | modelled speedup |" + (" walk drafted | walk tau |"
                                                                                  if "walk" in entry else ""),
                  "|---|---|---|---|" + ("---|---|" if "walk" in entry else "")]
        for p in entry["points"]:
            row = (f"| {p['schedule']} | {p['drafted']:.2f} | {p['tau']:.3f} | "
                   f"{modelled_speedup(p['tau'], p['drafted'], c):.3f} |")
            w = entry.get("walk", {}).get(p["schedule"])
            if "walk" in entry:
                row += f" {w['drafted']:.2f} | {w['tau']:.3f} |" if w else " | |"
            lines.append(row)
        lines.append("")
    ch = summary["chosen"]
    lines.append(f"Chosen default threshold: {ch['threshold']} "
                 + "; ".join(f"{k}: {v['ada']:.3f} vs best {v['best_constant']} {v['best_constant_speedup']:.3f} "
                             f"({v['gain']:+.1%})" for k, v in ch["per_kind"].items()))
    return "\n".join(lines) + "\n"
