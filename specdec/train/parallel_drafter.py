"""Training a parallel drafter (``specdec.drafters.parallel_model``) for any target, on the target's own outputs.

Contract: ``train_parallel_drafter(cfg, out_dir)`` (``specdec train parallel-drafter``) builds a
``ParallelDrafterModel`` for the target and trains it on a ``specdec data outputs`` file made with that target (its
fingerprint is checked). Each step runs the frozen target once on the batch's windows x_0 .. x_{L-1} (no gradient)
for the features of its chosen layers and its distribution at every position, then the drafter runs ONE forward over

- the context slots t = 0 .. L - 2: (f_t, x_{t+1}) at position t, causal (as they are cached at inference);
- blocks cut at a random offset: anchors a = r, r + k, r + 2k, ... (r in 1..k drawn per step, k = block size); the
  block of anchor a is k mask slots at positions a .. a + k - 1 that see the context slots 0 .. a - 1 and the live
  slots of their own block: exactly the round after committed x_0 .. x_a at inference (``block_pattern``).

Mask slot j of anchor a predicts x_{a+j+1}: the loss is KL(p_target(position a + j) || q) at every mask slot whose
position is live in the window, averaged over them. Glancing (GLAT, SpecDec's schedule; off unless ``glancing_start``
/ ``glancing_end`` > 0): a no-grad forward first guesses every block, and in each block floor(ratio x its wrong
guesses) slots, at random, read their gold token instead of the mask and leave the loss (``reveal``; the ratio linear
over the run). The batch of step ``s`` (records, offset, glancing draws) is a pure function of ``seed`` and ``s``;
checkpoints every ``save_every`` steps and at Ctrl-C, resumed exactly (``seq2seq.run_steps``, shared with the other
trainers); data parallel under ``torchrun`` / ``accelerate launch``. At the end ``out_dir/final`` holds the drafter
(its own weights only) and a model card with the held-out KL, agreement and greedy acceptance per block position
(``feature_drafter.depth_figures``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdec.drafters.parallel_model import ParallelDrafterModel, new_parallel_drafter
from specdec.train.checkpoint import writing
from specdec.train.drafter import Example, train_steps
from specdec.train.feature_drafter import (
    autocast_for,
    check_autocast,
    collate,
    depth_figures,
    figures_table,
    start_run,
    target_pass,
)
from specdec.train.outputs import valid_path
from specdec.train.presets import ParallelDrafterTrainConfig
from specdec.train.seq2seq import adamw, batch_indices, lr_at, resume

__all__ = ["ParallelDrafterTrainConfig", "train_parallel_drafter"]


def anchors_of(length: int, block: int, offset: int) -> list[int]:
    """The anchors of a window of ``length`` tokens: offset, offset + block, ... (each >= 1, < length - 1)."""
    return list(range(max(1, offset), length - 1, block))


def block_pattern(live: torch.Tensor, anchors: Sequence[int], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(allowed [B, 1, Q, Q] bool, valid [B, M * block]) over Q = n + M * block slots: the n = L - 1 context slots of
    a window whose tokens ``live`` [B, L] marks, then M = len(anchors) blocks. ``valid``: the mask slots whose
    position (a + j) is live. Context slots: causal over live ones; block slots of anchor a: the live context slots
    0 .. a - 1 and the valid slots of their own block; every slot sees itself."""
    length = live.shape[1]
    n = length - 1
    device = live.device
    ctx_live = live[:, 1:].bool()  # slot t reads x_{t+1}
    pos = torch.tensor([a + j for a in anchors for j in range(block)], dtype=torch.long, device=device)
    valid = (pos < length)[None, :] & live[:, pos.clamp(max=length - 1)].bool()  # [B, M k]
    keys = torch.cat([ctx_live, valid], dim=1)  # [B, Q]
    q = n + len(anchors) * block
    index = torch.arange(q, device=device)
    slot_anchor = torch.tensor([a for a in anchors for _ in range(block)], dtype=torch.long, device=device)
    slot_block = torch.arange(len(anchors), device=device).repeat_interleave(block)
    allowed = torch.zeros(q, q, dtype=torch.bool, device=device)
    allowed[:n, :n] = index[:n, None] >= index[None, :n]  # causal context
    allowed[n:, :n] = torch.arange(n, device=device)[None, :] < slot_anchor[:, None]  # context before the anchor
    allowed[n:, n:] = slot_block[:, None] == slot_block[None, :]  # own block
    allowed = allowed[None] & keys[:, None, :]
    allowed |= torch.eye(q, dtype=torch.bool, device=device)
    return allowed[:, None], valid


def reveal(guess: torch.Tensor, gold: torch.Tensor, known: torch.Tensor, scores: torch.Tensor, ratio: float,
           block: int) -> torch.Tensor:
    """GLAT's choice (as the block drafter's ``block_data.glance``): in each block, ``floor(ratio * wrong)`` of its
    slots whose gold token is ``known``, uniformly at random (``scores``: a uniform draw per slot), get revealed;
    ``wrong`` counts the known slots whose ``guess`` is not the ``gold`` token. All [B, M * block]; returns bool."""
    shape = (guess.shape[0], -1, block)
    known = known.view(shape)
    wrong = ((guess.view(shape) != gold.view(shape)) & known).sum(-1)  # [B, M]
    count = torch.floor(wrong.float() * ratio).long()
    rank = scores.view(shape).masked_fill(~known, 2.0).argsort(-1).argsort(-1)  # a slot's rank in its block
    return ((rank < count[..., None]) & known).view(guess.shape[0], -1)


def block_terms(drafter: ParallelDrafterModel, target: PreTrainedModel, ids: torch.Tensor, live: torch.Tensor,
                offset: int, start: torch.Tensor | None = None,
                glancing: tuple[float, torch.Tensor] | None = None) -> list[dict[str, torch.Tensor]]:
    """Per block position j: ``kl`` [B, M] KL(p_target || q) at each anchor's slot j, ``valid`` [B, M], ``hit``
    (argmax q == argmax p), ``chain`` (the window's x_{a+j+1} is the target's argmax: a greedy round goes on through
    it). ``start`` [B]: the first anchor scored per row (else every one). ``glancing`` (ratio, scores [B, >= L + k]
    uniform draws by position): a no-grad forward guesses every block, ``reveal`` picks slots by the position of the
    token they predict, and the scored forward reads those gold tokens there (``revealed``); a revealed slot is not
    ``valid`` (no loss, no figure)."""
    block = drafter.config.block_size
    length = ids.shape[1]
    anchors = anchors_of(length, block, offset)
    features, p_log = target_pass(target, drafter.config.feature_layers, ids, live)
    if not anchors:
        return []
    allowed, valid = block_pattern(live, anchors, block)
    n, m = length - 1, len(anchors)
    pos = torch.tensor([a + j for a in anchors for j in range(block)], device=ids.device)
    positions = torch.cat([torch.arange(n, device=ids.device), pos])[None].expand(ids.shape[0], -1)
    inputs = torch.cat([ids[:, 1:], ids.new_zeros(ids.shape[0], m * block)], dim=1)
    fused = drafter.fuse_features(features[:, :n])
    hidden = torch.cat([fused, fused.new_zeros(ids.shape[0], m * block, fused.shape[-1])], dim=1)
    kwargs = {"position_ids": positions, "attention_mask": allowed, "mask_tokens": m * block,
              "block_positions": torch.arange(block, device=ids.device).repeat(m)}
    revealed = None
    if glancing is not None and glancing[0] > 0:
        ratio, scores = glancing
        after = (pos + 1).clamp(max=length - 1)  # slot (a, j) predicts x_{a+j+1}
        known = valid & (pos + 1 < length)[None] & live[:, after].bool()
        gold = ids[:, after]
        with torch.no_grad():
            guess = drafter(inputs, hidden, **kwargs).logits.argmax(-1)
        revealed = reveal(guess, gold, known, scores[:, pos + 1], ratio, block)
        inputs = torch.cat([inputs[:, :n], torch.where(revealed, gold, 0)], dim=1)
        valid = valid & ~revealed
    out = drafter(inputs, hidden, revealed=revealed, **kwargs)
    q_log = F.log_softmax(out.logits.float(), dim=-1)  # [B, M k, V]
    clamped = pos.clamp(max=length - 1)
    p = p_log[:, clamped]  # [B, M k, V]
    kl = (p.exp() * (p - q_log)).sum(-1)
    greedy = p_log.argmax(-1)
    nxt = ids[:, (pos + 1).clamp(max=length - 1)]
    chain = (nxt == greedy[:, clamped]) & (pos + 1 < length)[None]
    if start is not None:
        valid = valid & (torch.tensor(anchors, device=ids.device).repeat_interleave(block)[None] >= start[:, None])
    hit = q_log.argmax(-1) == p.argmax(-1)
    shape = (ids.shape[0], m, block)
    return [{"kl": kl.view(shape)[..., j], "valid": valid.view(shape)[..., j], "hit": hit.view(shape)[..., j],
             "chain": chain.view(shape)[..., j]} for j in range(block)]


@torch.no_grad()
def measure(drafter: ParallelDrafterModel, target: PreTrainedModel, rows: Sequence[tuple[list[int], int]],
            device: torch.device | str = "cpu", batch_size: int = 8) -> dict:
    """Held-out figures per block position over ``rows`` (ids, first anchor scored: the prompt's last token), every
    anchor from 1 (offset 1, blocks one block apart): KL and agreement teacher-forced, greedy acceptance and tau as
    ``feature_drafter.depth_figures`` counts them."""
    was = drafter.training
    drafter.eval()
    depths = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i: i + batch_size]
        ids, live = collate([Example(r[0]) for r in chunk], device)
        start = torch.tensor([max(0, r[1] - 1) for r in chunk], device=device)
        terms = block_terms(drafter, target, ids, live, 1, start)
        if terms:
            depths.append(terms)
    drafter.train(was)
    return depth_figures(depths) if depths else {}


def _check(cfg: ParallelDrafterTrainConfig) -> None:
    if not cfg.target or not cfg.data:
        raise ValueError("give the target (--target FOLDER) and its data (--data FILE from `specdec data outputs`)")
    for name in ("steps", "batch_size", "eval_every", "save_every", "eval_records", "block_size"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.draft_layers not in (1, 2):
        raise ValueError(f"--draft-layers must be 1 or 2, got {cfg.draft_layers}")
    for name in ("glancing_start", "glancing_end"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} is a share of a block's wrong slots: give 0 .. 1, got "
                             f"{getattr(cfg, name)}")
    check_autocast(cfg)
    if cfg.seq_len < 3:
        raise ValueError(f"--seq-len must be >= 3 (a context, an anchor and a token to draft), got {cfg.seq_len}")


def step_offset(cfg: ParallelDrafterTrainConfig, step: int) -> int:
    """The block offset of step ``step`` (1 .. block_size), a pure function of the seed and the step."""
    return _step_draws(cfg, step)[0]


def _step_draws(cfg: ParallelDrafterTrainConfig, step: int, rows: int = 0) -> tuple[int, torch.Tensor]:
    """Step ``step``'s random draws, a pure function of the seed and the step: its block offset, then (glancing) a
    uniform score for each of ``rows`` global batch rows and each window position [rows, seq_len + block_size]."""
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    offset = 1 + int(torch.randint(cfg.block_size, (1,), generator=generator))
    return offset, torch.rand(rows, cfg.seq_len + cfg.block_size, generator=generator)


def glancing_ratio(cfg: ParallelDrafterTrainConfig, step: int) -> float:
    """The glancing ratio of step ``step``: linear from ``glancing_start`` at step 0 to ``glancing_end`` at the end."""
    progress = min(1.0, step / max(1, cfg.steps))
    return cfg.glancing_start + (cfg.glancing_end - cfg.glancing_start) * progress


def train_parallel_drafter(cfg: ParallelDrafterTrainConfig, out_dir: str | Path, *, device: str = "cpu",
                           stop_at_step: int | None = None, stop_after_s: float | None = None, progress: bool = True,
                           log: Callable[[str], None] = print) -> Path | None:
    """Train or resume a parallel drafter in ``out_dir``; the ``final`` folder once ``cfg.steps`` are done, else None
    (stopped by ``stop_at_step``, ``stop_after_s`` or Ctrl-C with a checkpoint written: call again to resume)."""
    _check(cfg)
    parallel, device, log, out, cfg, own, layers, target, train_data, valid_rows = start_run(
        cfg, out_dir, device, log, 3, "no record has 3 tokens or more")
    drafter = new_parallel_drafter(target, cfg.block_size, cfg.draft_layers, layers, own.fingerprint, cfg.target,
                                   cfg.seed).to(device)
    parallel.broadcast(drafter)
    out.mkdir(parents=True, exist_ok=True)
    optimizer = adamw(drafter, cfg.lr, cfg.weight_decay)
    state = resume(out, drafter, optimizer, log)
    log(f"parallel drafter of {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, blocks of "
        f"{cfg.block_size}, reading layers {layers} of the target; {len(train_data)} records, {len(valid_rows)} held "
        f"out; {cfg.steps} steps of {cfg.batch_size}, device {device}, {torch.get_num_threads()} threads"
        + (f", {parallel.world} processes" if parallel.world > 1 else ""))
    lengths = [len(e.ids) for e in train_data]
    autocast = autocast_for(cfg, device)

    def loss_at(step: int) -> tuple[torch.Tensor, int]:
        chosen = batch_indices(lengths, cfg, step)
        ids, live = collate([train_data[i] for i in parallel.shard(chosen)], device)
        ratio = glancing_ratio(cfg, step)
        offset, scores = _step_draws(cfg, step, len(chosen) if ratio > 0 else 0)
        glancing = (ratio, scores[parallel.rows(len(chosen))].to(device)) if ratio > 0 else None
        with autocast:
            terms = block_terms(drafter, target, ids, live, offset, glancing=glancing)
        if not terms:  # windows too short for an anchor at this offset: a zero loss that still reaches the weights
            return parallel.share(sum(p.sum() for p in drafter.parameters()) * 0.0, 0), 0
        total = sum((t["kl"] * t["valid"]).sum() for t in terms)
        count = sum(t["valid"].sum() for t in terms)
        return parallel.share(total, count), int(count)

    def evaluate() -> dict:
        if not valid_rows:
            return {}
        m = measure(drafter, target, valid_rows, device)
        return {"val_kl": m.get("kl"), "val_acceptance": m.get("acceptance"), "val_tau": m.get("tau", {}).get(4)}

    final = train_steps(out, drafter, optimizer, state, cfg, lr_at, loss_at, evaluate, parallel, progress=progress,
                        stop_after_s=stop_after_s, stop_at_step=stop_at_step, log=log)
    if final is None or not parallel.main:
        return final
    drafter.eval()
    figures = (measure(drafter, target, valid_rows, device) or None) if valid_rows else None
    curve = [f"{h['step']}: {h['train_loss']:.3f}" for h in state.history if "train_loss" in h]
    card = [f"# Parallel drafter for `{cfg.target}`", "",
            (f"A target-conditioned parallel drafter (blocks of {cfg.block_size}, {cfg.draft_layers} decoder "
             f"layer(s) of the target's class, reading layers {layers}) made by `specdec train parallel-drafter`: "
             f"{cfg.steps} steps of {cfg.batch_size} records (at most {cfg.seq_len} tokens), AdamW at {cfg.lr}, seed "
             f"{cfg.seed}, on `{cfg.data}` ({len(train_data)} records; held out: `{valid_path(cfg.data).name}`); "
             f"target fingerprint `{own.fingerprint}`. The target's embedding and LM head are bound at load."
             + (f" Glancing: {cfg.glancing_start} of each block's wrong slots revealed at step 0, {cfg.glancing_end} "
                "at the last." if cfg.glancing_start or cfg.glancing_end else "")), "",
            "Training loss (mean KL per mask slot) by step: " + (", ".join(curve) or "n/a") + ".", ""]
    card += figures_table(figures) if figures else ["Not measured (no held-out records)."]
    with writing(final):
        drafter.save_pretrained(final, safe_serialization=True)
        (final / "training.json").write_text(json.dumps({"config": asdict(cfg), "state": asdict(state),
                                                         "data": {"file": cfg.data, "target": own.fingerprint},
                                                         "figures": figures, "processes": parallel.world}, indent=1))
        (final / "README.md").write_text("\n".join(card + [""]), encoding="utf-8")
    return final
