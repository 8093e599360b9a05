"""The acceptance head for a user's pair: ``specdec train head --target PATH --drafter PATH --data OUT.jsonl``.

Contract: ``check_pair(target, drafter, data)`` refuses, before anything is written, a data file
written for another target (the records' fingerprint, ``specdec.train.outputs.target_data``), an
encoder-decoder target (the head's data, ``specdec.heads.data``, is built with causal LMs), and a
drafter of another vocabulary (``specdec.drafters.model.check_vocabularies``, the rule decoding
applies); it returns the checked data. The head is then built and trained as the shipped one
(``build_head_data`` on ``data``, validation on its ``.valid.jsonl``; ``train_head``), and
``measure_head(...)`` measures it at the end on the held-out prompts, as ``specdec train drafter``
measures a drafter (``measure_schedules``): greedy decoding with ``--schedule ada`` and the head, and
with the constant γ for comparison, each against plain decoding of the target; the figures are
printed, added to ``final/training.json`` and written into a card ``final/README.md``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from specdec.train.outputs import TargetData

FIX = "give a drafter of the target's vocabulary (make one with `specdec train drafter --target ...`)"


def check_pair(target: str, drafter: str, data: str | Path) -> TargetData:
    """The records of ``data`` (a ``specdec data outputs`` file of ``target``), once the pair is checked."""
    from specdec.drafters.model import check_vocabularies
    from specdec.loading import load_model
    from specdec.train.outputs import target_data

    own = target_data(target, data)
    if getattr(own.config, "is_encoder_decoder", False):
        raise ValueError(f"{target} is an encoder-decoder model: `specdec train head` builds its data with "
                         "decoder-only (causal LM) pairs; use --schedule constant or confidence with this target")
    check_vocabularies(load_model(target, dtype="fp32"), load_model(drafter, dtype="fp32"), fix=FIX)
    return own


def measure_head(target: str, drafter: str, head: Path, records: list[dict], prompts: int, max_new_tokens: int,
                 gamma: int = 4, log: Callable[[str], None] = print) -> dict:
    """``measure_schedules``'s figures with ``--schedule ada`` and the head (``ada``), and with the constant
    ``gamma`` (``constant``), interleaved on the held-out ``records``; ``ada_over_constant``: the ratio of their
    speeds."""
    from specdec.config import ScheduleConfig
    from specdec.loading import load_model
    from specdec.train.drafter import measure_schedules

    target_model, drafter_model = load_model(target, dtype="fp32"), load_model(drafter, dtype="fp32")
    figures: dict = measure_schedules(target_model, drafter_model, records, prompts, max_new_tokens,
                                      {"ada": ScheduleConfig("ada", head=str(head)), "constant": None}, log, gamma)
    figures["ada_over_constant"] = round(figures["ada"]["spec_tokens_per_s"]
                                         / figures["constant"]["spec_tokens_per_s"], 3)
    log(f"--schedule ada with this head: {figures['ada_over_constant']:.2f}x the speed of the constant gamma {gamma}"
        + ("" if figures["ada_over_constant"] >= 1 else " - the head does not pay over the constant gamma"))
    return figures


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
        lines += figures_lines(figures["ada"], "the drafter with this head")
        constant = figures["constant"]
        lines += [(f"For comparison, the constant γ {constant['gamma']} without the head: α "
                   f"{constant['greedy_alpha']:.3f}, τ {constant['greedy_tau']:.2f}, {constant['speedup']:.2f}x plain "
                   f"decoding. `--schedule ada` runs at {figures['ada_over_constant']:.2f}x the constant γ's speed"
                   + ("." if figures["ada_over_constant"] >= 1 else ": **the head does not pay over the constant γ**.")),
                  ""]
    else:
        lines += ["Not measured (`--no-measure`, or no held-out prompts).", ""]
    lines += ["## Use", "", "```",
              f"specdec generate --target {target} --drafter {drafter} --schedule ada --head PATH_OF_THIS_FOLDER \"...\"",
              "```", ""]
    return "\n".join(lines)


def finish(final: Path, target: str, drafter: str, data: str, own: TargetData, measure: bool, prompts: int,
           max_new_tokens: int, log: Callable[[str], None] = print) -> dict | None:
    """Measure the head of ``final`` (unless ``measure`` is off or nothing is held out), add the figures to its
    training.json and write its card; returns the figures."""
    figures = None
    if measure and own.valid:
        figures = measure_head(target, drafter, final, own.valid, prompts, max_new_tokens, log=log)
    elif measure:
        log("not measured: no held-out records (make the data with a larger --valid-share)")
    training = json.loads((final / "training.json").read_text())
    training.update({"target": target, "drafter": drafter, "file": str(data), "target_fingerprint": own.fingerprint,
                     "figures": figures})
    (final / "training.json").write_text(json.dumps(training, indent=1) + "\n")
    (final / "README.md").write_text(head_card(target, drafter, str(data), own, training, figures), encoding="utf-8")
    return figures
