"""Training an EAGLE-3-style feature drafter for any target, on the target's own outputs.

Contract: ``train_feature_drafter(cfg, out_dir)`` (``specdec train feature-drafter``) builds a
``FeatureDrafterModel`` for the target (``specdec.drafters.feature_model``) and trains it on a
``specdec data outputs`` file made with that target (its fingerprint is checked). Each step runs the
frozen target once on the batch's windows (no gradient) for the features of its chosen layers and its
distribution at every position, then the drafter unrolls ``cfg.ttt_steps`` drafting steps
(training-time test, EAGLE-3):

- step 0, slot t: the fused target feature f_t and the embedding of x_{t+1}, at position t; a causal
  mask over the step-0 slots; predicts the target's distribution at position t + 1;
- step k >= 1, slot t: the drafter's own output hidden state of step k - 1 at slot t and the embedding
  of x_{t+k+1}, at position t + k; it attends to the step-0 slots up to t (the context the target's
  features gave, as the drafter's cache holds them at inference) and to slot t of steps 1..k (its own
  chain's earlier drafts); predicts the target's distribution at position t + k + 1.

So slot t of step k is exactly the k-th drafting step of a round anchored after x_{t+1} at inference,
with the target's tokens as the drafts (``ttt_pattern``; ``tests/test_feature_drafter.py`` checks it
against an unrolled step-by-step decode). The loss is KL(p_target || q_drafter) at every valid slot and
step, step k weighted by ``cfg.step_decay ** k``. The step-k keys go through a transformers
``DynamicCache`` like any drafter's cache, with a 4D mask.

The batch of step ``s`` is a pure function of ``seed`` and ``s``; checkpoints every ``save_every``
steps and at Ctrl-C, resumed exactly (``seq2seq.run_steps``, shared with the other trainers); data
parallel under ``torchrun`` / ``accelerate launch`` (``specdec.train.parallel``). At the end,
``out_dir/final`` holds the drafter (its own weights only: the target's embedding and LM head are bound
at load) and a model card with the recipe, the loss curve and the held-out figures per depth
(``acceptance``: the greedy acceptance a round anchored at each held-out position would see).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from specdec.drafters.feature_model import (
    LAYOUTS,
    FeatureDrafterModel,
    default_feature_layers,
    features_of,
    new_feature_drafter,
)
from specdec.loading import load_model
from specdec.train.checkpoint import writing
from specdec.train.drafter import Example, _resumed_config, examples, train_steps
from specdec.train.outputs import target_data, valid_path
from specdec.train.parallel import DataParallel
from specdec.train.presets import FeatureDrafterTrainConfig
from specdec.train.seq2seq import adamw, batch_indices, lr_at, resume

GAMMAS = (1, 2, 4, 8)  # drafting depths whose teacher-forced tau the figures give


def parse_layers(text: str, layers: int) -> list[int]:
    """``--feature-layers`` (``"1,3,4"``; ``""`` = EAGLE-3's default for a target of ``layers`` decoder layers)."""
    if not text:
        return default_feature_layers(layers)
    try:
        chosen = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--feature-layers {text!r}: give 3 comma-separated layer numbers, e.g. 1,3,4") from None
    if len(chosen) != 3 or len(set(chosen)) != 3 or not all(0 <= i < layers for i in chosen):
        raise ValueError(f"--feature-layers {text!r}: give 3 distinct decoder layers of the target (0..{layers - 1})")
    return chosen


# ---------------------------------------------------------------------------- training-time test


def ttt_pattern(live: torch.Tensor, step: int) -> torch.Tensor:
    """Who a query of unrolled step ``step`` may attend to: boolean [B, 1, n, (step + 1) n] over the keys of
    steps 0..step (n slots each, in that order). ``live`` [B, n]: the live step-0 slots (padding dead).

    Step 0: the live slots up to the query's own. Step k >= 1: the live step-0 slots up to the query's slot
    and the query's own slot of steps 1..k. Every query sees its own slot, so no row is empty."""
    batch, n = live.shape
    slot = torch.arange(n, device=live.device)
    own = slot[None, :] == slot[:, None]  # [n, n]
    context = ((slot[None, :] <= slot[:, None]) & live[:, None, :].bool()) | own  # [B, n, n]
    chain = own.expand(batch, n, n)
    return torch.cat([context] + [chain] * step, dim=-1)[:, None]


def unroll(drafter: FeatureDrafterModel, ids: torch.Tensor, features: torch.Tensor, live: torch.Tensor, steps: int):
    """Training-time test over windows ``ids`` [B, L] (right-padded, ``live`` [B, L]) with the target's
    ``features`` [B, L, 3H]: yields (k, logits [B, L - 1, V]) for k = 0..steps-1, slot t of step k predicting
    the target's distribution at position t + k + 1 (module docstring)."""
    n = ids.shape[1] - 1
    live_slots = live[:, 1:]  # slot t reads x_{t+1}: live where that token is
    tokens = ids[:, 1:]
    hidden = drafter.fuse_features(features[:, :n])
    cache = DynamicCache()
    positions = torch.arange(n, device=ids.device)[None, :]
    for k in range(steps):
        mask = live_slots if k == 0 else ttt_pattern(live_slots, k)
        out = drafter(tokens, hidden, position_ids=positions + k, attention_mask=mask, past_key_values=cache,
                      use_cache=True)
        yield k, out.logits
        hidden = out.hidden
        tokens = F.pad(ids[:, k + 2:], (0, k + 1))  # x_{t+k+2}, zeros past the window


def shifted(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` [B, L, ...] at positions t + k + 1 for slots t = 0..L-2 (zeros past the end). [B, L - 1, ...]"""
    out = t[:, k + 1:]
    pad = [0, 0] * (t.dim() - 2) + [0, k]
    return F.pad(out, pad)


def target_pass(target: PreTrainedModel, layers: list[int], ids: torch.Tensor, live: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [B, L, 3H], log-probabilities [B, L, V] float32) of the frozen target, one forward."""
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=live, output_hidden_states=True)
        return features_of(out.hidden_states, layers).float(), F.log_softmax(out.logits.float(), dim=-1)


def ttt_terms(drafter: FeatureDrafterModel, target: PreTrainedModel, ids: torch.Tensor, live: torch.Tensor,
              steps: int, start: torch.Tensor | None = None) -> list[dict[str, torch.Tensor]]:
    """Per unrolled step: ``kl`` [B, n] KL(p_target || q), ``valid`` [B, n] (slots scored), ``hit`` [B, n] (the
    drafter's argmax equals the target's), ``chain`` [B, n] (the window's token at this depth is the target's
    argmax: a greedy round would have drafted through it). ``start`` [B]: first slot scored per row (else 0)."""
    features, p_log = target_pass(target, drafter.config.feature_layers, ids, live)
    greedy = p_log.argmax(-1)  # [B, L]
    slots = torch.arange(ids.shape[1] - 1, device=ids.device)[None, :]
    first = slots >= (start[:, None] if start is not None else 0)
    out = []
    for k, logits in unroll(drafter, ids, features, live, steps):
        p = shifted(p_log, k)  # [B, n, V]
        q_log = F.log_softmax(logits.float(), dim=-1)
        kl = (p.exp() * (p - q_log)).sum(-1)
        valid = shifted(live, k).bool() & first
        # the token read at depth k + 1 (x_{t+k+2}) is the one a greedy round drafts iff it is the target's argmax
        chain = shifted(ids, k + 1) == shifted(greedy, k)
        out.append({"kl": kl, "valid": valid, "hit": q_log.argmax(-1) == p.argmax(-1), "chain": chain})
    return out


def loss_of(terms: list[dict[str, torch.Tensor]], decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over steps of decay**k x the step's summed KL, the step-0 slot count): the loss is their ratio."""
    total = sum(decay ** k * (t["kl"] * t["valid"]).sum() for k, t in enumerate(terms))
    return total, terms[0]["valid"].sum()


def collate(batch: Sequence[Example], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and live mask [B, L]."""
    ids = torch.zeros(len(batch), max(len(e.ids) for e in batch), dtype=torch.long)
    live = torch.zeros_like(ids)
    for i, e in enumerate(batch):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        live[i, : len(e.ids)] = 1
    return ids.to(device), live.to(device)


def depth_figures(depths: Sequence[Sequence[dict[str, torch.Tensor]]]) -> dict:
    """Per-depth figures from, per batch, one dict per drafting depth d = 1, 2, ... of [B, n] tensors over the
    round anchors: ``valid`` (depth d is scored there), ``hit`` (the depth-d draft is the target's argmax), ``chain``
    (the window's token after depth d is the target's argmax: a greedy round goes on through it), and optionally
    ``kl``. A round reaches depth d when depths 1..d-1 were hits on a greedy chain (module docstring of
    ``measure``)."""
    steps = max(len(d) for d in depths)
    kl, agree, count, reached, accepted = ([0.0] * steps for _ in range(5))
    for terms in depths:
        alive = torch.ones_like(terms[0]["valid"])
        for k, t in enumerate(terms):
            v = t["valid"]
            if "kl" in t:
                kl[k] += float((t["kl"] * v).sum())
            agree[k] += float((t["hit"] & v).sum())
            count[k] += float(v.sum())
            alive = alive & v
            reached[k] += float(alive.sum())
            alive = alive & t["hit"]
            accepted[k] += float(alive.sum())
            alive = alive & t["chain"]
    alpha = [round(a / r, 4) if r else None for a, r in zip(accepted, reached)]
    tau, run, prefix = {}, 1.0, 1.0
    for d, a in enumerate(alpha, start=1):
        prefix *= a or 0.0
        run += prefix
        if d in GAMMAS:
            tau[d] = round(run, 3)
    out = {"agreement": [round(x / max(1.0, c), 4) for x, c in zip(agree, count)], "acceptance": alpha, "tau": tau,
           "slots": int(count[0])}
    if "kl" in depths[0][0]:
        out["kl"] = [round(x / max(1.0, c), 4) for x, c in zip(kl, count)]
    return out


@torch.no_grad()
def measure(drafter: FeatureDrafterModel, target: PreTrainedModel, rows: Sequence[tuple[list[int], int]], steps: int,
            device: torch.device | str = "cpu", batch_size: int = 8) -> dict:
    """Held-out figures per drafting depth over ``rows`` (ids, first position to score: the prompt's length).

    ``kl`` and ``agreement``: teacher-forced, every scored slot. ``acceptance``: for rounds anchored after each
    continuation position (greedy: a draft is accepted when it equals the target's argmax, and a round goes on only
    through accepted drafts), the share of depth-d drafts accepted among the rounds that reached depth d, counted
    where the window's tokens are the target's greedy ones that far (there the teacher-forced chain is the round's
    chain). ``tau``: 1 + the expected accepted drafts of a round of gamma drafts, for gamma in ``GAMMAS`` (<= steps)."""
    was = drafter.training
    drafter.eval()
    depths = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i: i + batch_size]
        ids, live = collate([Example(r[0]) for r in chunk], device)
        start = torch.tensor([max(0, r[1] - 1) for r in chunk], device=device)  # anchor after the prompt's last token
        depths.append(ttt_terms(drafter, target, ids, live, steps, start))
    drafter.train(was)
    return depth_figures(depths)


# ------------------------------------------------------------------------------------------- the run


def _check(cfg: FeatureDrafterTrainConfig) -> None:
    if not cfg.target or not cfg.data:
        raise ValueError("give the target (--target FOLDER) and its data (--data FILE from `specdec data outputs`)")
    for name in ("steps", "batch_size", "seq_len", "eval_every", "save_every", "eval_records", "ttt_steps"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2 (a token and the next), got {cfg.seq_len}")
    if cfg.layout not in LAYOUTS:
        raise ValueError(f"--layout {cfg.layout!r}: give one of {', '.join(LAYOUTS)}")
    check_autocast(cfg)
    if not 0 < cfg.step_decay <= 1:
        raise ValueError(f"--step-decay must lie in (0, 1], got {cfg.step_decay}")


def check_autocast(cfg) -> None:
    """Refuse an ``--autocast`` other than bf16 or none (this trainer's and the parallel drafter's)."""
    if cfg.autocast not in ("", "bf16"):
        raise ValueError(f"--autocast {cfg.autocast!r}: give bf16, or leave it out for float32")


def autocast_for(cfg, device: str) -> torch.autocast:
    """The context both models' forwards run in: bf16 autocast where ``cfg.autocast`` is "bf16", else a no-op."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cfg.autocast == "bf16")


def start_run(cfg, out_dir: str | Path, device: str, log: Callable[[str], None], shortest: int, empty: str):
    """What a run of a trainer on the target's features starts with (this one's and the parallel drafter's): data
    parallel started, the config resumed from ``out_dir``, the target's data checked and pinned, the frozen target,
    the training examples of at least ``shortest`` tokens (none: a ValueError saying ``empty``) and the held-out
    rows. Returns (parallel, device, log, out, cfg, data, layers, target, train_data, valid_rows)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    parallel = DataParallel.start(device)
    device, log = parallel.device, parallel.log(log)
    out = Path(out_dir)
    cfg = _resumed_config(cfg, out)
    own = target_data(cfg.target, cfg.data)  # refuses a missing file, another target's data, before any work
    layers = parse_layers(cfg.feature_layers, own.config.num_hidden_layers)
    if cfg.records is None:
        cfg = replace(cfg, records=len(own.records))  # pin the data: the file may grow while this run lives
    if cfg.records > len(own.records):
        raise ValueError(f"{cfg.data} holds {len(own.records)} records, fewer than the {cfg.records} this run "
                         "started with")
    target = load_model(cfg.target, device=device, dtype=torch.float32).eval()
    target.requires_grad_(False)
    train_data = [e for e in examples(own.records[: cfg.records], target, cfg.seq_len) if len(e.ids) >= shortest]
    valid_rows = [((r["prompt_ids"] + r["ids"])[-cfg.seq_len:],
                   max(0, len(r["prompt_ids"]) - max(0, len(r["prompt_ids"]) + len(r["ids"]) - cfg.seq_len)))
                  for r in own.valid if r["ids"]][: cfg.eval_records]
    if not train_data:
        raise ValueError(f"{cfg.data}: {empty}; make new data with a larger --max-new-tokens")
    return parallel, device, log, out, cfg, own, layers, target, train_data, valid_rows


def train_feature_drafter(cfg: FeatureDrafterTrainConfig, out_dir: str | Path, *, device: str = "cpu",
                          stop_at_step: int | None = None, stop_after_s: float | None = None, progress: bool = True,
                          log: Callable[[str], None] = print) -> Path | None:
    """Train or resume a feature drafter in ``out_dir``; the ``final`` folder once ``cfg.steps`` are done, else None
    (stopped by ``stop_at_step``, ``stop_after_s`` or Ctrl-C with a checkpoint written: call again to resume)."""
    _check(cfg)
    parallel, device, log, out, cfg, own, layers, target, train_data, valid_rows = start_run(
        cfg, out_dir, device, log, 2, "every continuation is empty")
    drafter = new_feature_drafter(target, layers, own.fingerprint, cfg.target, cfg.seed, cfg.layout).to(device)
    drafter.config.ttt_steps = cfg.ttt_steps
    if cfg.init_from:  # a new stage from an earlier run's drafter (fresh optimizer and schedule)
        from specdec.drafters.feature_model import load_feature_drafter

        start = load_feature_drafter(cfg.init_from, target, own.fingerprint, name=cfg.target)
        if start.config.feature_layers != layers:
            raise ValueError(f"--init-from {cfg.init_from} reads layers {start.config.feature_layers}, not {layers}: "
                             f"give --feature-layers {','.join(map(str, start.config.feature_layers))}")
        if start.config.layout != cfg.layout:
            raise ValueError(f"--init-from {cfg.init_from} has the {start.config.layout} layout, not {cfg.layout}: "
                             f"give --layout {start.config.layout}")
        drafter.load_state_dict(start.state_dict())
    parallel.broadcast(drafter)
    out.mkdir(parents=True, exist_ok=True)
    optimizer = adamw(drafter, cfg.lr, cfg.weight_decay)
    state = resume(out, drafter, optimizer, log)
    log(f"feature drafter of {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters reading layers "
        f"{layers} of a {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M target; {len(train_data)} records "
        f"({sum(len(e.ids) for e in train_data)} tokens), {len(valid_rows)} held out; {cfg.steps} steps of "
        f"{cfg.batch_size}, {cfg.ttt_steps} unrolled steps, device {device}, {torch.get_num_threads()} threads"
        + (f", {parallel.world} processes" if parallel.world > 1 else ""))
    lengths = [len(e.ids) for e in train_data]
    autocast = autocast_for(cfg, device)

    def loss_at(step: int) -> tuple[torch.Tensor, int]:
        ids, live = collate([train_data[i] for i in parallel.shard(batch_indices(lengths, cfg, step))], device)
        with autocast:
            terms = ttt_terms(drafter, target, ids, live, cfg.ttt_steps)
        total, count = loss_of(terms, cfg.step_decay)
        return parallel.share(total, count), int(count)

    def evaluate() -> dict:
        if not valid_rows:
            return {}
        m = measure(drafter, target, valid_rows, cfg.ttt_steps, device)
        return {"val_kl": m["kl"], "val_acceptance": m["acceptance"], "val_tau": m["tau"].get(4)}

    final = train_steps(out, drafter, optimizer, state, cfg, lr_at, loss_at, evaluate, parallel, progress=progress,
                        stop_after_s=stop_after_s, stop_at_step=stop_at_step, log=log)
    if final is None or not parallel.main:
        return final
    drafter.eval()
    figures = measure(drafter, target, valid_rows, cfg.ttt_steps, device) if valid_rows else None
    with writing(final):
        drafter.save_pretrained(final, safe_serialization=True)
        (final / "training.json").write_text(json.dumps({"config": asdict(cfg), "state": asdict(state),
                                                         "data": {"file": cfg.data, "target": own.fingerprint},
                                                         "figures": figures, "processes": parallel.world}, indent=1))
        (final / "README.md").write_text(render_card(cfg, drafter, state.history, figures, own.fingerprint,
                                                     len(train_data), len(own.valid)), encoding="utf-8")
    return final


def figures_table(figures: dict) -> list[str]:
    """Markdown rows of ``measure``'s figures, one per depth."""
    lines = ["| depth | KL (nats) | top-1 agreement | greedy acceptance |", "|---|---|---|---|"]
    for d, (kl, ag, ac) in enumerate(zip(figures["kl"], figures["agreement"], figures["acceptance"]), start=1):
        lines.append(f"| {d} | {kl:.3f} | {ag:.3f} | {'n/a' if ac is None else f'{ac:.3f}'} |")
    lines += ["", "Teacher-forced τ (1 + expected accepted drafts of a greedy round of γ drafts): "
              + ", ".join(f"γ {g}: {t:.2f}" for g, t in figures["tau"].items()) + "."]
    return lines


def render_card(cfg: FeatureDrafterTrainConfig, drafter: FeatureDrafterModel, history: list[dict],
                figures: dict | None, target_fingerprint: str, records: int, held: int) -> str:
    """The README.md of a feature drafter: what it is, how it was made, what it measures."""
    n = sum(p.numel() for p in drafter.parameters())
    c = drafter.config
    curve = [f"{h['step']}: {h['train_loss']:.3f}" for h in history if "train_loss" in h]
    lines = [
        f"# Feature drafter for `{cfg.target}`", "",
        (f"An EAGLE-3-style feature drafter ({n / 1e6:.2f}M parameters of its own) made by `specdec train "
         f"feature-drafter`: one `{type(drafter.layer).__name__}` reading the target's layers {c.feature_layers} "
         "(fused 3H -> H) and the next token's embedding; the target's embedding and LM head are shared, not "
         "saved here (bound at load)."), "",
        "## Recipe", "",
        ((f"Continued from `{cfg.init_from}` (fresh optimizer). " if cfg.init_from else "")
         + f"Training-time test over {cfg.ttt_steps} unrolled steps, loss KL(p_target || q_drafter) at every slot and "
         f"step (step k weighted {cfg.step_decay}^k). AdamW, peak learning rate {cfg.lr}, {cfg.warmup_steps} warm-up "
         f"steps then cosine decay to {cfg.min_lr_ratio:.0%}, {cfg.steps} steps of {cfg.batch_size} records (at most "
         f"{cfg.seq_len} tokens each), seed {cfg.seed}."), "",
        "## Data", "",
        (f"`{cfg.data}`: the target's own continuations (`specdec data outputs`), {records} records trained on, "
         f"{held} held out in `{valid_path(cfg.data).name}`; target fingerprint `{target_fingerprint}`."), "",
        "## Figures", "", "Training loss (weighted KL sum) by step: " + (", ".join(curve) or "n/a") + ".", "",
    ]
    lines += figures_table(figures) if figures else ["Not measured (no held-out records)."]
    return "\n".join(lines + [""])
