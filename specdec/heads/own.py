"""The acceptance head for a user's pair: ``specdec train head --target PATH --drafter PATH --data OUT.jsonl``.

Contract: ``check_pair(target, drafter, data)`` refuses, before anything is written, a data file
written for another target (the records' fingerprint, ``specdec.train.outputs.target_data``) and a
drafter of another vocabulary (``specdec.drafters.model.check_vocabularies``, the rule decoding
applies); it returns the checked data. The pair is decoder-only or encoder-decoder (``specdec.heads.data``
reads a record's prompt as the source of an encoder-decoder pair). The head is then built and trained as the shipped one
(``build_head_data`` on ``data``, validation on its ``.valid.jsonl``; ``train_head``). At the end
``measure_head(...)`` splits the held-out prompts in two (``split_held_out``). On the first part it tunes
``--schedule ada`` as SpecDec++ tunes its stop threshold on held-out data (``tune_head``): a few decodes of
those prompts are timed (constant γ at the smallest and largest MAX of the grid, and ada's rule all but never
stopping at the largest, whose paired time over that constant's is the rule's cost; interleaved per prompt) and a cost
model is fitted to them (``fit_costs``: seconds per call, per round, per drafted token, per drafted token under
ada's stop rule); every (threshold, MAX) of the grid is then counted exactly on
the greedy text those decodes wrote (``grid_counts``: greedy decoding commits the target's greedy text, so a
decoder-only pair's rounds are replayed offline by ``specdec.heads.evaluate``; an encoder-decoder pair decodes each
setting once) and priced; the fastest is stored in the head's config.json, the defaults of ``--schedule ada --head DIR``
(``--stop-threshold`` and ``--bound`` override them). The grid holds threshold 1, which never stops a round:
ada with MAX m is then the constant γ m, so a head that predicts no better than a constant is tuned into the
best constant γ rather than left slower than it. On the other part it is measured as ``specdec train drafter``
measures a drafter (``measure_schedules``): greedy decoding with ``--schedule ada`` (the stored defaults) and
with every constant γ of the MAX grid, interleaved per prompt, each against plain decoding of the target; ada
against the fastest constant is the median of the paired per-prompt, per-pass time ratios, with their
quartiles and range (a difference is called only when the middle half lies on one side of 1), beside the
ratio the exact counts of both give under the tuned costs. The figures are printed, added to
``final/training.json`` and written into a card ``final/README.md``.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from specdec.heads.config import HeadTuneConfig
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


def split_held_out(valid: list[dict], tune_prompts: int | None) -> tuple[list[dict], list[dict]]:
    """(tuning records, measurement records): the first ``tune_prompts`` held-out records (None: half) tune and
    the rest measure, so no prompt is measured that tuned; fewer than 2 held-out records: nothing tunes."""
    if len(valid) < 2 or tune_prompts == 0:
        return [], valid
    k = len(valid) // 2 if tune_prompts is None else min(tune_prompts, len(valid) - 1)
    return valid[:k], valid[k:]


COSTS = ("calls", "rounds", "drafted", "ada_drafted")  # what a decode's time is modelled from (``fit_costs``)


def result_counts(result, ada: bool) -> dict[str, int]:
    """One decode's counts (exact in greedy decoding): 1 call (its prefill and set-up), its rounds, drafted and
    emitted tokens, and (``ada``: drafted under ada's stop rule) ``ada_drafted``, the drafted tokens that also pay
    for the rule: the drafter's hidden state, the head and a host read at each drafted position."""
    return {"calls": 1, "rounds": result.stats.rounds, "drafted": result.stats.drafted,
            "emitted": len(result.tokens), "ada_drafted": result.stats.drafted if ada else 0}


def modelled_seconds(counts: dict[str, float], costs: dict[str, float]) -> float:
    """The cost model's seconds for ``counts`` (``COSTS``' keys)."""
    return sum(counts.get(k, 0) * costs[k] for k in COSTS)


NEVER = 1 - 1e-6  # a stop threshold the rule (all but) never reaches: its rounds are the constant γ MAX's


def rule_cost(rows: dict[str, list[dict]], probes: dict) -> float:
    """Seconds ada's stop rule adds per drafted token: the median over (prompt, pass) of the ``NEVER`` probe's
    time less constant γ MAX's on the same prompt in the same pass (the same rounds and drafts, the rule
    aside; a prompt where a head predicting ~0 did stop it is left out), per drafted token; 0 without that probe. A
    paired difference: a regression over all the timings lost this ~1-2 ms in the noise and fitted 0."""
    never = next((n for n, c in probes.items() if c is not None and c.stop_threshold == NEVER), None)
    if never is None:
        return 0.0
    constant = rows[f"constant {probes[never].bound[1]}"]
    paired = [(a["seconds"] - c["seconds"]) / a["drafted"] for a, c in zip(rows[never], constant)
              if a["drafted"] and (a["rounds"], a["drafted"]) == (c["rounds"], c["drafted"])]  # where it never stopped
    return max(0.0, statistics.median(paired)) if paired else 0.0


def fit_costs(rows: list[dict], fixed: dict[str, float] | None = None) -> dict[str, float]:
    """Seconds per decode call, per round, per drafted token (its drafter step and its share of verification)
    and per drafted token under ada's stop rule (on top of the last), fitted to timed decodes (each row: ``COSTS``'
    counts and ``seconds``, from ``timed_rows``) by non-negative
    least squares (every subset of the costs solved, the best fit with no negative cost kept); the costs in
    ``fixed`` are taken as given (their share of each row's seconds removed before the fit)."""
    fixed = fixed or {}
    free = [k for k in COSTS if k not in fixed]
    x = torch.tensor([[float(r[k]) for k in free] for r in rows], dtype=torch.float64)  # [M, F]
    y = torch.tensor([r["seconds"] - sum(r[k] * c for k, c in fixed.items()) for r in rows], dtype=torch.float64)
    best: tuple[float, list[float]] | None = None
    for keep in [c for n in range(len(free), 0, -1) for c in itertools.combinations(range(len(free)), n)]:
        sub = x[:, list(keep)]
        if torch.linalg.matrix_rank(sub) < len(keep):
            continue
        coef = torch.linalg.lstsq(sub, y[:, None]).solution[:, 0]
        if (coef < 0).any():
            continue
        residual = float(((sub @ coef - y) ** 2).sum())
        if best is None or residual < best[0] - 1e-12 * max(1.0, residual):
            full = [0.0] * len(free)
            for i, c in zip(keep, coef.tolist()):
                full[i] = c
            best = (residual, full)
    fitted = dict(zip(free, best[1] if best is not None else [0.0] * len(free)))
    return {k: fixed[k] if k in fixed else fitted[k] for k in COSTS}


def timed_rows(figures: dict, counts: list[dict[str, int]]) -> list[dict]:
    """One ``fit_costs`` row per (prompt, pass) of a method's ``measure_schedules`` figures, its ``counts`` per
    prompt, its seconds corrected for the load of the moment: scaled by the prompt's median plain-decoding time
    over the passes over its plain time in that pass (plain decoding ran just before it, on the same prompt), so
    a pass run under twice the load does not read as twice the cost."""
    plain = figures["plain_prompt_seconds_runs"]  # [pass][prompt]
    typical = [statistics.median(p[i] for p in plain) for i in range(len(counts))]
    return [{**c, "seconds": seconds[i] * typical[i] / plain[run][i]}
            for run, seconds in enumerate(figures["prompt_seconds_runs"]) for i, c in enumerate(counts)]


def _setting(threshold: float, max_draft: int, head: Path):
    """The grid's (threshold, MAX) as a schedule: threshold 1 is the constant γ MAX (the head never runs)."""
    from specdec.config import ScheduleConfig

    return None if threshold >= 1 else ScheduleConfig("ada", stop_threshold=threshold, bound=(1, max_draft),
                                                      head=str(head))


def grid_counts(target, drafter, head: Path, prompts: list[list[int]], texts: list[list[int]],
                grid: list[tuple[float, int]]) -> dict[tuple[float, int], dict[str, int]]:
    """Each (threshold, MAX)'s exact greedy counts over ``prompts`` (``texts``: the target's greedy continuation
    of each). A decoder-only pair: replayed offline (``specdec.heads.evaluate``: the drafter's rounds from every
    start of each text, the head's values on them, ``draft_lengths`` and ``walk_counts``); an encoder-decoder
    pair: each setting decoded once."""
    from specdec.decode import speculative_generate
    from specdec.heads.data import Record
    from specdec.heads.evaluate import build_rounds, draft_lengths, head_values, walk_counts
    from specdec.heads.model import AcceptanceHead
    from specdec.seq2seq import is_encoder_decoder

    out = {}
    if is_encoder_decoder(target):
        for t, m in grid:
            results = [speculative_generate(target, drafter, p, max_new_tokens=len(x), gamma=m,
                                            schedule=_setting(t, m, head)) for p, x in zip(prompts, texts)]
            counts = [result_counts(r, t < 1) for r in results]
            out[(t, m)] = {k: sum(c[k] for c in counts) for k in counts[0]}
        return out
    rounds = build_rounds(target, drafter, [Record(i, p, x) for i, (p, x) in enumerate(zip(prompts, texts))],
                          "greedy", depth=max(m for _, m in grid))
    values = head_values(AcceptanceHead.from_pretrained(head), rounds)  # [S, K]
    for t, m in grid:
        lengths = torch.full((len(rounds),), m) if t >= 1 else draft_lengths(values, t, (1, m))
        out[(t, m)] = {"calls": len(prompts), **walk_counts(rounds, lengths)}
        out[(t, m)]["ada_drafted"] = out[(t, m)]["drafted"] if t < 1 else 0
    return out


def tune_head(target, drafter, head: Path, records: list[dict], cfg: HeadTuneConfig,
              log: Callable[[str], None] = print) -> dict:
    """Tune ada's (threshold, MAX) on the held-out ``records``: a few decodes of each prompt are timed
    (constant γ at the grid's smallest and largest MAX, and ada's rule (all but) never stopping at the largest
    MAX, whose time over that constant's is the rule's cost, ``rule_cost``; interleaved per prompt,
    ``cfg.tune_repeats`` passes) and the costs fitted to them (``fit_costs``); every setting of the grid is
    then counted exactly (``grid_counts``, on the greedy text those decodes wrote) and priced; the fastest
    modelled wins (threshold 1 with MAX m is the constant γ m, so a head that does not pay is tuned into
    that). Returns the probes, the costs, the grid and the choice."""
    from specdec.config import ScheduleConfig
    from specdec.train.drafter import measure_schedules

    low, high = min(cfg.tune_max_draft), max(cfg.tune_max_draft)
    stopping = sorted(t for t in cfg.tune_thresholds if t < 1)
    probes: dict[str, ScheduleConfig | None] = {f"constant {g}": None for g in sorted({low, high})}
    if stopping:  # ada's stop rule running but (all but) never stopping: constant γ high's rounds, plus the rule
        probes[f"ada {NEVER:g} max {high}"] = ScheduleConfig("ada", stop_threshold=NEVER, bound=(1, high),
                                                            head=str(head))
    log(f"tuning ada on {len(records)} held-out prompts x {cfg.tune_tokens} tokens: {', '.join(probes)} timed "
        f"({cfg.tune_repeats} interleaved passes) for the costs; thresholds "
        f"{' '.join(f'{t:g}' for t in cfg.tune_thresholds)} x MAX {' '.join(map(str, cfg.tune_max_draft))} counted")
    outputs: dict[str, list] = {}
    timed = measure_schedules(target, drafter, records, len(records), cfg.tune_tokens, probes, lambda _message: None,
                              gammas={n: int(n.split()[1]) for n in probes if probes[n] is None},
                              repeats=cfg.tune_repeats, results=outputs)
    rows = {name: timed_rows(timed[name], [result_counts(r, probes[name] is not None) for r in outputs[name]])
            for name in probes}
    costs = fit_costs([row for name in probes for row in rows[name]], fixed={"ada_drafted": rule_cost(rows, probes)})
    prompts = [r["prompt_ids"] for r in records][: len(outputs["plain"])]
    texts = [r.tokens for r in outputs["plain"]]
    grid = [(t, m) for m in cfg.tune_max_draft for t in cfg.tune_thresholds]
    counted = grid_counts(target, drafter, head, prompts, texts, grid)
    table = []
    for t, m in grid:
        c = counted[(t, m)]
        seconds = modelled_seconds(c, costs)
        table.append({"threshold": t, "max_draft": m, **c, "drafted_per_round": round(c["drafted"] / c["rounds"], 3),
                      "tau": round(c["emitted"] / c["rounds"], 3),
                      "modelled_tokens_per_s": round(c["emitted"] / seconds, 2) if seconds > 0 else 0.0})
    # the probes' decoded counts against the replayed ones: the replay is the decoding's own trace
    replay = {}
    for name, config in probes.items():
        key = (1.0, int(name.split()[1]) if config is None else high)  # the NEVER probe: constant γ high's rounds
        decoded = [result_counts(r, config is not None) for r in outputs[name]]
        replay[name] = {k: [sum(d[k] for d in decoded), counted[key][k]] for k in ("rounds", "drafted")}
    best = max(table, key=lambda r: (r["modelled_tokens_per_s"], r["threshold"] >= 1, -r["max_draft"]))
    log("  fitted costs: " + describe_costs(costs))
    log("  decoded vs replayed counts: " + "; ".join(f"{n}: rounds {v['rounds'][0]}/{v['rounds'][1]}, drafted "
                                                    f"{v['drafted'][0]}/{v['drafted'][1]}" for n, v in replay.items()))
    for r in table:
        log(f"  threshold {r['threshold']:<4g} MAX {r['max_draft']:<2d} {r['rounds']:5d} rounds, tau {r['tau']:.2f}, "
            f"drafted {r['drafted_per_round']:.2f}/round, {r['modelled_tokens_per_s']:7.1f} tokens/s modelled"
            + ("  <- chosen" if r is best else ""))
    return {"prompts": len(prompts), "tokens": cfg.tune_tokens, "repeats": cfg.tune_repeats,
            "rule": "the highest modelled tokens/s: exact greedy counts priced by costs fitted to timed decodes",
            "probes": list(probes), "costs": costs, "replay": replay, "grid": table,
            "chosen": {"threshold": best["threshold"], "max_draft": best["max_draft"]}}


def describe_costs(costs: dict[str, float]) -> str:
    """The fitted costs in words."""
    return (f"{costs['calls'] * 1e3:.1f} ms a call, {costs['rounds'] * 1e3:.1f} ms a round, "
            f"{costs['drafted'] * 1e3:.2f} ms a drafted token, {costs['ada_drafted'] * 1e3:.2f} ms more under ada's "
            "stop rule")


def store_tuned(head: Path, threshold: float, max_draft: int) -> None:
    """Write the tuned threshold and MAX into the head's config.json: `--schedule ada --head` defaults."""
    from specdec.heads.model import AcceptanceHead

    loaded = AcceptanceHead.from_pretrained(head)
    loaded.config = replace(loaded.config, threshold=threshold, max_draft=max_draft)
    loaded.save_pretrained(head)


def _quartiles(values: list[float]) -> list[float]:
    """[min, 25th, median, 75th, max] of ``values`` (inclusive quartiles), rounded."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return [round(v, 3) for v in (min(values), q[0], statistics.median(values), q[2], max(values))]


def measure_head(target: str, drafter: str, head: Path, valid: list[dict], cfg: HeadTuneConfig,
                 log: Callable[[str], None] = print) -> dict:
    """Tune ada on the first held-out records (``split_held_out``, ``tune_head``; the choice stored with the head),
    then measure on the others ``measure_schedules``'s figures with ``--schedule ada --head`` (its stored
    defaults: ``ada``) and with every constant γ of the MAX grid (``constant N``), interleaved per prompt, medians
    of ``cfg.measure_repeats`` passes. ``ada_over_best_constant``: the median over (prompt, pass) of the fastest
    constant's seconds over ada's on that prompt in that pass (paired: both met the same load),
    ``ada_over_best_constant_spread`` [min, 25th, median, 75th, max] of those ratios; with tuning, also the
    ratio modelled from the exact counts of both (``modelled_ada_over_best_constant``). The best constant is the
    fastest by those exact counts priced by costs fitted to all of this measurement's timings (``costs``), not the
    fastest of the noisy medians (``fastest_measured_constant``), which the noise picks as often as the speed."""
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
    outputs: dict[str, list] = {}
    figures: dict = measure_schedules(
        target_model, drafter_model, measured, cfg.measure_prompts, cfg.measure_tokens,
        {"ada": ScheduleConfig("ada", head=str(head)), **constants}, log,
        gammas={name: int(name.split()[1]) for name in constants}, repeats=cfg.measure_repeats, results=outputs)
    threshold = json.loads((head / "config.json").read_text())["threshold"]
    counts = {name: [result_counts(x, name == "ada" and threshold < 1) for x in outputs[name]] for name in figures}
    rows = [row for name in figures for row in timed_rows(figures[name], counts[name])]
    # these decodes' own timings (every method, prompt and pass); the stop rule's cost from tuning's paired probe
    costs = fit_costs(rows, fixed={"ada_drafted": tuning["costs"]["ada_drafted"]} if tuning else None)
    modelled = {}
    for name in figures:
        total = {k: sum(c[k] for c in counts[name]) for k in (*COSTS, "emitted")}
        seconds = modelled_seconds(total, costs)
        modelled[name] = round(total["emitted"] / seconds, 2) if seconds > 0 else 0.0
    # the best constant by the exact counts priced by the fitted costs: the fastest of five noisy medians would
    # favour whichever constant the noise helped (the winner's curse), and ada with it
    best = max(constants, key=lambda name: (modelled[name], figures[name]["spec_tokens_per_s"]))
    fastest = max(constants, key=lambda name: figures[name]["spec_tokens_per_s"])
    ratios = [c / a for ada_pass, best_pass in zip(figures["ada"]["prompt_seconds_runs"],
                                                  figures[best]["prompt_seconds_runs"])
              for a, c in zip(ada_pass, best_pass)]
    spread = _quartiles(ratios)
    out = {"tuning": tuning, "ada": figures["ada"], "constants": {n: figures[n] for n in constants},
           "costs": costs, "modelled_tokens_per_s": modelled,
           "best_constant": figures[best]["gamma"], "fastest_measured_constant": figures[fastest]["gamma"],
           "ada_over_best_constant": spread[2], "ada_over_best_constant_spread": spread,
           "modelled_ada_over_best_constant": round(modelled["ada"] / modelled[best], 3) if modelled[best] else 0.0,
           "ada_over_best_constant_runs": [round(a / c, 3) for a, c in zip(
               figures["ada"]["spec_tokens_per_s_runs"], figures[best]["spec_tokens_per_s_runs"])]}
    log(f"  costs fitted to these decodes: {describe_costs(costs)}; modelled tokens/s: "
        + ", ".join(f"{n} {v:.1f}" for n, v in modelled.items()))
    log(f"--schedule ada with this head: {spread[2]:.2f}x the speed of the best constant gamma "
        f"({out['best_constant']}, by the exact counts priced by the fitted costs; the fastest measured: "
        f"{out['fastest_measured_constant']}) on "
        f"{figures['ada']['prompts']} held-out prompts not used for tuning (median of {len(ratios)} paired prompt-pass "
        f"ratios; quartiles {spread[1]:.2f}-{spread[3]:.2f}, range {spread[0]:.2f}-{spread[4]:.2f}); modelled from "
        f"the exact counts: {out['modelled_ada_over_best_constant']:.2f}x")
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
             (f"Labels {', '.join(cfg['labels'])} ({training['data']['config']['inputs']} inputs), "
              f"{training['examples']} examples, {cfg['max_steps']} steps of {cfg['batch_size']}, peak learning rate "
              f"{cfg['lr']}, reject "
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
            lines += [(f"Tuned on {tuning['prompts']} held-out prompts ({tuning['tokens']} new tokens, greedy): "
                       f"{', '.join(tuning['probes'])} timed ({tuning['repeats']} interleaved passes), costs fitted to "
                       f"those timings ({describe_costs(costs)}), every setting of the grid counted exactly on those "
                       f"prompts' greedy text and priced: stop threshold **{chosen['threshold']:g}**, MAX "
                       f"**{chosen['max_draft']}** drafted per round, "
                       "stored in `config.json` (`threshold`, `max_draft`) as `--schedule ada`'s defaults"
                       + (" (threshold 1: the head never stops a round, so ada drafts the constant γ MAX: the head "
                          "did not pay on these prompts)." if chosen["threshold"] >= 1 else ".")), "",
                      "| threshold | MAX | rounds | τ | drafted/round | tokens/s modelled |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {r['threshold']:g} | {r['max_draft']} | {r['rounds']} | {r['tau']:.2f} | "
                      f"{r['drafted_per_round']:.2f} | {r['modelled_tokens_per_s']:.1f} |" for r in tuning["grid"]]
            lines.append("")
        else:
            lines += [("Not tuned (fewer than 2 held-out prompts, or `--tune-prompts 0`): the stored defaults are "
                       "kept."), ""]
        lines += figures_lines(figures["ada"], "the drafter with this head")
        lines += [(f"Beside it on the same prompts (none used for tuning), interleaved, medians of "
                   f"{figures['ada']['repeats']} passes, and the exact counts priced by costs fitted to these timings "
                   f"({describe_costs(figures['costs'])}):"), "",
                  "| schedule | α | τ | rounds | tokens/s | × plain | tokens/s modelled |",
                  "|---|---|---|---|---|---|---|"]
        for name, f in {"ada": figures["ada"], **figures["constants"]}.items():
            lines.append(f"| {name.replace('constant', 'constant γ').replace('ada', 'ada (tuned)')} | "
                         f"{f['greedy_alpha']:.3f} | {f['greedy_tau']:.2f} | {f['rounds']} | "
                         f"{f['spec_tokens_per_s']:.1f} | {f['speedup']:.2f} | "
                         f"{figures['modelled_tokens_per_s'][name]:.1f} |")
        lines += ["", verdict(figures), ""]
    else:
        lines += ["Not measured (`--no-measure`, or no held-out prompts).", ""]
    lines += ["## Use", "", "```",
              (f"specdec generate --target {target} --drafter {drafter} --schedule ada "
               "--head PATH_OF_THIS_FOLDER \"...\""),
              "```", ""]
    return "\n".join(lines)


def verdict(figures: dict) -> str:
    """The card's sentence on ada against the best constant γ: the median paired ratio, its spread, and a
    verdict that calls a difference only when the middle half of the paired ratios lies on one side of 1."""
    low, q1, ratio, q3, high = figures["ada_over_best_constant_spread"]
    text = (f"`--schedule ada` runs at **{ratio:.2f}x** the speed of the best constant γ ({figures['best_constant']}, "
            "the fastest by the exact counts priced by costs fitted to these timings): "
            f"the median of the paired per-prompt ratios over all passes (quartiles {q1:.2f}-{q3:.2f}, range "
            f"{low:.2f}-{high:.2f})")
    if "modelled_ada_over_best_constant" in figures:
        text += f"; {figures['modelled_ada_over_best_constant']:.2f}x modelled from the exact counts of both"
    if q3 < 1:
        return text + ": **the head does not pay over the best constant γ**."
    if q1 > 1:
        return text + ": faster than the best constant γ."
    return text + ": no difference beyond this machine's noise."


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
