"""The acceptance head for a user's pair: ``specdec train head --target PATH --drafter PATH --data OUT.jsonl``.

Contract: ``check_pair(target, drafter, data)`` refuses, before anything is written, a data file
written for another target (the records' fingerprint, ``specdec.train.outputs.target_data``) and a
drafter of another vocabulary (``specdec.drafters.model.check_vocabularies``, the rule decoding
applies); it returns the checked data. The pair is decoder-only or encoder-decoder (``specdec.heads.data``
reads a record's prompt as the source of an encoder-decoder pair). The head is then built and trained as the shipped one
(``build_head_data`` on ``data``, validation on its ``.valid.jsonl``; ``train_head``). At the end
``measure_head(...)`` splits the held-out prompts in two (``split_held_out``). On the first part it tunes
``--schedule ada`` as SpecDec++ tunes its stop threshold on held-out data (``tune_head``): every
(threshold, MAX) of a small grid decodes those prompts, interleaved per prompt, and the fastest wins by a
cost model fitted to all those timings (``fit_costs``: seconds per round, per drafted token, per head call;
each setting's counts are exact in greedy decoding); its threshold and MAX are stored in the head's config.json, the defaults of
``--schedule ada --head DIR`` (``--stop-threshold`` and ``--bound`` override them). The grid holds threshold
1, which never stops a round: ada with MAX m is then the constant γ m, so a head that predicts no better
than a constant is tuned into the best constant γ rather than left slower than it. On the other part it
is measured as ``specdec train drafter`` measures a drafter (``measure_schedules``): greedy decoding with
``--schedule ada`` (the stored defaults) and with every constant γ of the MAX grid, interleaved, medians of
passes, each against plain decoding of the target; the figures are printed, added to
``final/training.json`` and written into a card ``final/README.md``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specdec.train.outputs import TargetData

FIX = "give a drafter of the target's vocabulary (make one with `specdec train drafter --target ...`)"


def check_pair(target: str, drafter: str, data: str | Path) -> TargetData:
    """The records of ``data`` (a ``specdec data outputs`` file of ``target``), once the pair is checked."""
    from specdec.drafters.model import check_vocabularies
    from specdec.loading import load_model
    from specdec.seq2seq import decoder_start_id, is_encoder_decoder
    from specdec.train.outputs import target_data

    own = target_data(target, data)
    target_model, drafter_model = load_model(target, dtype="fp32"), load_model(drafter, dtype="fp32")
    check_vocabularies(target_model, drafter_model, fix=FIX)
    kinds = [is_encoder_decoder(m) for m in (target_model, drafter_model)]
    if kinds[0] != kinds[1] or (kinds[0] and decoder_start_id(target_model) != decoder_start_id(drafter_model)):
        what = {True: "an encoder-decoder", False: "a decoder-only"}
        raise ValueError(f"the drafter {drafter} is {what[kinds[1]]} model and the target {what[kinds[0]]} one"
                         + ("" if kinds[0] != kinds[1] else ", but their decoders start with other tokens")
                         + f": the drafter must read what the target reads; {FIX}")
    return own


@dataclass(frozen=True)
class HeadTuneConfig:
    """How ``specdec train head --data`` tunes ada and measures it on the held-out prompts (after training)."""

    tune_thresholds: tuple[float, ...] = (0.3, 0.5, 0.7, 1.0)  # ada stop thresholds tried (1 = never stop: ada is then the constant γ MAX)
    tune_max_draft: tuple[int, ...] = (2, 3, 4, 6, 8)  # ada MAX values tried; the final measurement runs each as a constant γ too
    tune_prompts: int | None = None  # the first N held-out prompts tune (the others measure); None = half of them; 0 = no tuning
    tune_tokens: int = 32  # new tokens per tuning prompt
    tune_repeats: int = 2  # interleaved passes over the tuning prompts; a setting's speed is its median over passes
    measure_prompts: int = 20  # held-out prompts (after the tuning ones) measured at the end
    measure_tokens: int = 64  # new tokens per measured prompt
    measure_repeats: int = 3  # interleaved passes of the final measurement (medians)

    def __post_init__(self) -> None:
        if not self.tune_thresholds or not all(0 < t <= 1 for t in self.tune_thresholds):
            raise ValueError(f"tune_thresholds must be one or more numbers in (0, 1], got {self.tune_thresholds!r}")
        if not self.tune_max_draft or not all(isinstance(m, int) and m >= 1 for m in self.tune_max_draft):
            raise ValueError(f"tune_max_draft must be one or more ints >= 1, got {self.tune_max_draft!r}")
        if self.tune_prompts is not None and self.tune_prompts < 0:
            raise ValueError(f"tune_prompts must be >= 0 (0 = no tuning) or left out, got {self.tune_prompts}")
        for name in ("tune_tokens", "tune_repeats", "measure_prompts", "measure_tokens", "measure_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def split_held_out(valid: list[dict], tune_prompts: int | None) -> tuple[list[dict], list[dict]]:
    """(tuning records, measurement records): the first ``tune_prompts`` held-out records (None: half) tune and
    the rest measure, so no prompt is measured that tuned; fewer than 2 held-out records: nothing tunes."""
    if len(valid) < 2 or tune_prompts == 0:
        return [], valid
    k = len(valid) // 2 if tune_prompts is None else min(tune_prompts, len(valid) - 1)
    return valid[:k], valid[k:]


COSTS = ("rounds", "drafted", "head_calls")  # what a round's time is modelled from (``fit_costs``)


def _counts(row: dict) -> list[float]:
    """A tuning row's rounds, drafted tokens and head calls (the head runs at each drafted position after a
    round's first, unless the threshold is 1) over one pass."""
    return [row["rounds"], row["drafted"], 0.0 if row["threshold"] >= 1 else row["drafted"] - row["rounds"]]


def fit_costs(rows: list[dict]) -> dict[str, float]:
    """Seconds per round, per drafted token (its drafter step and its share of verification) and per head call,
    fitted to every (setting, pass) of the tuning grid by non-negative least squares (every subset of the
    three costs solved, the best fit with no negative cost kept): one cost model from all the timings,
    steadier than any single setting's measurement on a busy machine."""
    x = torch.tensor([_counts(r) for r in rows for _ in r["seconds_runs"]], dtype=torch.float64)  # [M, 3]
    y = torch.tensor([t for r in rows for t in r["seconds_runs"]], dtype=torch.float64)  # [M]
    best: tuple[float, list[float]] | None = None
    for keep in [c for n in (3, 2, 1) for c in itertools.combinations(range(3), n)]:
        sub = x[:, list(keep)]
        if torch.linalg.matrix_rank(sub) < len(keep):
            continue
        coef = torch.linalg.lstsq(sub, y[:, None]).solution[:, 0]
        if (coef < 0).any():
            continue
        residual = float(((sub @ coef - y) ** 2).sum())
        if best is None or residual < best[0]:
            full = [0.0] * 3
            for i, c in zip(keep, coef.tolist()):
                full[i] = c
            best = (residual, full)
    return dict(zip(COSTS, best[1] if best is not None else [0.0] * 3))


def tune_head(target, drafter, head: Path, records: list[dict], cfg: HeadTuneConfig,
              log: Callable[[str], None] = print) -> dict:
    """Decode the tuning ``records`` with ada at every (threshold, MAX) of ``cfg``'s grid, interleaved per
    prompt, ``cfg.tune_repeats`` passes. The choice: the highest modelled tokens/s, each setting's rounds,
    drafts and head calls (deterministic in greedy decoding) priced by ``fit_costs`` over all the grid's
    timings (threshold 1 with MAX m is the constant γ m, so a head that does not pay is tuned into that).
    Returns the grid (measured and modelled speeds), the fitted costs and the choice."""
    from specdec.config import ScheduleConfig
    from specdec.train.drafter import measure_schedules

    grid = {f"ada {t:g} max {m}": (t, m) for m in cfg.tune_max_draft for t in cfg.tune_thresholds}
    schedules = {name: ScheduleConfig("ada", stop_threshold=t, bound=(1, m), head=str(head))
                 for name, (t, m) in grid.items()}
    log(f"tuning ada on {len(records)} held-out prompts x {cfg.tune_tokens} tokens: thresholds "
        f"{' '.join(f'{t:g}' for t in cfg.tune_thresholds)} x MAX {' '.join(map(str, cfg.tune_max_draft))}, "
        f"{cfg.tune_repeats} interleaved passes")
    figures = measure_schedules(target, drafter, records, len(records), cfg.tune_tokens, schedules,
                                lambda _message: None, repeats=cfg.tune_repeats)
    rows = [{"threshold": t, "max_draft": m, **{k: figures[name][k] for k in (
        "spec_tokens_per_s", "spec_tokens_per_s_runs", "speedup", "greedy_alpha", "greedy_tau", "drafted_per_round",
        "greedy_equal", "rounds", "drafted", "new_tokens", "seconds_runs")}} for name, (t, m) in grid.items()]
    costs = fit_costs(rows)
    for r in rows:
        seconds = sum(c * costs[k] for c, k in zip(_counts(r), COSTS))
        r["modelled_tokens_per_s"] = round(r["new_tokens"] / seconds, 1) if seconds > 0 else 0.0
    best = max(rows, key=lambda r: (r["modelled_tokens_per_s"], r["spec_tokens_per_s"]))
    log(f"  fitted costs: {costs['rounds'] * 1e3:.1f} ms a round, {costs['drafted'] * 1e3:.1f} ms a drafted token, "
        f"{costs['head_calls'] * 1e3:.2f} ms a head call")
    for r in rows:
        log(f"  threshold {r['threshold']:<4g} MAX {r['max_draft']:<2d} {r['spec_tokens_per_s']:7.1f} tokens/s "
            f"measured, {r['modelled_tokens_per_s']:7.1f} modelled ({r['speedup']:.2f}x plain), tau "
            f"{r['greedy_tau']:.2f}, drafted {r['drafted_per_round']:.2f}/round" + ("  <- chosen" if r is best else ""))
    return {"prompts": len(records), "tokens": cfg.tune_tokens, "repeats": cfg.tune_repeats,
            "rule": "the highest modelled tokens/s (costs fitted to every measured time of the grid)",
            "costs": costs, "grid": rows, "chosen": {"threshold": best["threshold"], "max_draft": best["max_draft"]}}


def store_tuned(head: Path, threshold: float, max_draft: int) -> None:
    """Write the tuned threshold and MAX into the head's config.json: `--schedule ada --head` defaults."""
    from specdec.heads.model import AcceptanceHead

    loaded = AcceptanceHead.from_pretrained(head)
    loaded.config = replace(loaded.config, threshold=threshold, max_draft=max_draft)
    loaded.save_pretrained(head)


def measure_head(target: str, drafter: str, head: Path, valid: list[dict], cfg: HeadTuneConfig,
                 log: Callable[[str], None] = print) -> dict:
    """Tune ada on the first held-out records (``split_held_out``, ``tune_head``; the choice stored with the head),
    then measure on the others ``measure_schedules``'s figures with ``--schedule ada --head`` (its stored
    defaults: ``ada``) and with every constant γ of the MAX grid (``constant N``), interleaved, medians of
    ``cfg.measure_repeats`` passes; ``ada_over_best_constant``: ada's speed over the fastest constant's."""
    from specdec.config import ScheduleConfig
    from specdec.loading import load_model
    from specdec.train.drafter import measure_schedules

    target_model, drafter_model = load_model(target, dtype="fp32"), load_model(drafter, dtype="fp32")
    tuning_records, measured = split_held_out(valid, cfg.tune_prompts)
    tuning = None
    if tuning_records:
        tuning = tune_head(target_model, drafter_model, head, tuning_records, cfg, log)
        store_tuned(head, **tuning["chosen"])
    else:
        log("not tuned: " + ("--tune-prompts 0" if cfg.tune_prompts == 0 else
                             "fewer than 2 held-out prompts (make the data with a larger --valid-share)")
            + "; the head keeps its stored threshold and MAX")
    constants = {f"constant {g}": None for g in sorted(set(cfg.tune_max_draft))}
    figures: dict = measure_schedules(
        target_model, drafter_model, measured, cfg.measure_prompts, cfg.measure_tokens,
        {"ada": ScheduleConfig("ada", head=str(head)), **constants}, log,
        gammas={name: int(name.split()[1]) for name in constants}, repeats=cfg.measure_repeats)
    best = max(constants, key=lambda name: figures[name]["spec_tokens_per_s"])
    per_pass = [a / c for a, c in zip(figures["ada"]["spec_tokens_per_s_runs"], figures[best]["spec_tokens_per_s_runs"])]
    out = {"tuning": tuning, "ada": figures["ada"], "constants": {n: figures[n] for n in constants},
           "best_constant": figures[best]["gamma"],
           "ada_over_best_constant": round(figures["ada"]["spec_tokens_per_s"] / figures[best]["spec_tokens_per_s"], 3),
           "ada_over_best_constant_runs": [round(r, 3) for r in per_pass]}
    log(f"--schedule ada with this head: {out['ada_over_best_constant']:.2f}x the speed of the best constant gamma "
        f"({out['best_constant']}) on {figures['ada']['prompts']} held-out prompts not used for tuning"
        + ("" if out["ada_over_best_constant"] >= 1 else " - the head does not pay over the best constant gamma"))
    return out


def head_card(target: str, drafter: str, data: str, own: TargetData, training: dict, figures: dict | None) -> str:
    """The README.md of a head trained for a user's pair: what it is, how it was made, what it measures."""
    from specdec.train.drafter import figures_lines
    from specdec.train.outputs import valid_path

    cfg = training["config"]
    lines = [f"# Acceptance head for `{drafter}` drafting for `{target}`", "",
             (f"SpecDec++'s acceptance head (Huang, Guo, Wang 2024), made by `specdec train head`: {cfg['num_blocks']} "
              "residual blocks on the drafter's last hidden state, predicting whether each draft is accepted; "
              "`--schedule ada` stops drafting once the predicted chance of a rejection passes the threshold."), "",
             "## Recipe", "",
             (f"Labels {', '.join(cfg['labels'])} ({training['data']['config']['inputs']} inputs), {training['examples']} "
              f"examples, {cfg['max_steps']} steps of {cfg['batch_size']}, peak learning rate {cfg['lr']}, reject "
              f"weight {cfg['reject_weight']}, seed {cfg['seed']}."), "",
             "## Data", "",
             (f"`{data}`: the target's own continuations of the user's prompts (`specdec data outputs`), "
              f"{len(own.records)} records, {len(own.valid)} held out in `{valid_path(data).name}`; target "
              f"fingerprint `{own.fingerprint}`."), "",
             "## Figures", ""]
    if figures:
        tuning = figures["tuning"]
        if tuning:
            chosen = tuning["chosen"]
            costs = tuning["costs"]
            lines += [(f"Tuned on {tuning['prompts']} held-out prompts ({tuning['tokens']} new tokens, greedy, "
                       f"{tuning['repeats']} interleaved passes; the fastest by a cost model fitted to all the grid's "
                       f"timings: {costs['rounds'] * 1e3:.1f} ms a round, {costs['drafted'] * 1e3:.1f} ms a drafted "
                       f"token, {costs['head_calls'] * 1e3:.2f} ms a head call): stop "
                       f"threshold **{chosen['threshold']:g}**, MAX **{chosen['max_draft']}** drafted per round, "
                       "stored in `config.json` (`threshold`, `max_draft`) as `--schedule ada`'s defaults"
                       + (" (threshold 1: the head never stops a round, so ada drafts the constant γ MAX: the head "
                          "did not pay on these prompts)." if chosen["threshold"] >= 1 else ".")), "",
                      "| threshold | MAX | tokens/s measured | modelled | × plain | τ | drafted/round |",
                      "|---|---|---|---|---|---|---|"]
            lines += [f"| {r['threshold']:g} | {r['max_draft']} | {r['spec_tokens_per_s']:.1f} | "
                      f"{r['modelled_tokens_per_s']:.1f} | {r['speedup']:.2f} | {r['greedy_tau']:.2f} | "
                      f"{r['drafted_per_round']:.2f} |" for r in tuning["grid"]]
            lines.append("")
        else:
            lines += [("Not tuned (fewer than 2 held-out prompts, or `--tune-prompts 0`): the stored defaults are "
                       "kept."), ""]
        lines += figures_lines(figures["ada"], "the drafter with this head")
        lines += [(f"Beside it on the same prompts (none used for tuning), interleaved, medians of "
                   f"{figures['ada']['repeats']} passes:"), "", "| schedule | α | τ | tokens/s | × plain |",
                  "|---|---|---|---|---|"]
        for name, f in {"ada (tuned)": figures["ada"], **figures["constants"]}.items():
            lines.append(f"| {name.replace('constant', 'constant γ')} | {f['greedy_alpha']:.3f} | "
                         f"{f['greedy_tau']:.2f} | {f['spec_tokens_per_s']:.1f} | {f['speedup']:.2f} |")
        ratio = figures["ada_over_best_constant"]
        lines += ["", (f"`--schedule ada` runs at **{ratio:.2f}x** the speed of the best constant γ "
                       f"({figures['best_constant']})" + ("." if ratio >= 1 else
                                                          ": **the head does not pay over the best constant γ**.")),
                  ""]
    else:
        lines += ["Not measured (`--no-measure`, or no held-out prompts).", ""]
    lines += ["## Use", "", "```",
              f"specdec generate --target {target} --drafter {drafter} --schedule ada --head PATH_OF_THIS_FOLDER \"...\"",
              "```", ""]
    return "\n".join(lines)


def finish(final: Path, target: str, drafter: str, data: str, own: TargetData, measure: bool, tune: HeadTuneConfig,
           log: Callable[[str], None] = print) -> dict | None:
    """Tune and measure the head of ``final`` (``measure_head``; unless ``measure`` is off or nothing is held out),
    add the figures to its training.json and write its card; returns the figures."""
    figures = None
    if measure and own.valid:
        figures = measure_head(target, drafter, final, own.valid, tune, log=log)
    elif measure:
        log("not measured: no held-out records (make the data with a larger --valid-share)")
    training = json.loads((final / "training.json").read_text())
    training.update({"target": target, "drafter": drafter, "file": str(data), "target_fingerprint": own.fingerprint,
                     "figures": figures})
    (final / "training.json").write_text(json.dumps(training, indent=1) + "\n")
    (final / "README.md").write_text(head_card(target, drafter, str(data), own, training, figures), encoding="utf-8")
    return figures
