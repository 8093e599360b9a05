"""Training of the acceptance head on precomputed drafter states (SpecDec++'s recipe).

Contract: ``train_head(cfg, out_dir)`` trains an ``AcceptanceHead`` on the examples of
``cfg.data`` (built by ``specdec.heads.data``; the drafter is frozen, so its hidden states are
computed once and training only runs the head), writes a resumable checkpoint every
``cfg.save_every`` steps and, at ``cfg.max_steps``, the head folder ``out_dir/final``
(``AcceptanceHead.from_pretrained``-loadable) with ``training.json`` (config and loss history).
Calling it again on the same ``out_dir`` resumes: weights, AdamW state and step are restored and
the batch of step ``s`` is a pure function of ``(seed, s)``, so an interrupted run ends where an
uninterrupted one does. Checkpoints are safetensors + JSON (no pickle).

Loss (SpecDec++ ``train.py``): soft-label cross-entropy with class weights, reject ``w`` (6) and
accept 1, normalised by the batch's total weight:
``sum_n [w (1 - l_n) (-log P_n(reject)) + l_n (-log P_n(accept))] / sum_n [w (1 - l_n) + l_n]``.
The weight makes the head cautious: a missed rejection costs more than a missed acceptance.

Data parallel: run under ``torchrun --nproc_per_node N`` or ``accelerate launch`` (gloo on CPU,
nccl on GPUs; ``specdec.train.parallel``, shared by every trainer). Every process draws the same
global batch of ``cfg.batch_size`` examples and takes every N-th; the loss's denominator is summed
over processes before the division and the gradients are summed, so they equal one process's on the
whole batch: N processes reproduce a single-process run.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.heads.config import LABEL_KINDS, HeadTrainConfig
from specdec.heads.data import HeadData, load_head_data
from specdec.heads.model import AcceptanceHead, HeadConfig
from specdec.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, writing
from specdec.train.parallel import DataParallel


def weighted_soft_ce(logits: torch.Tensor, label: torch.Tensor,
                     reject_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, 2], soft labels [N] (P(accept)) -> (numerator, denominator) of SpecDec++'s loss
    (sums; the loss is their ratio, and the denominator does not depend on the weights)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, 2]
    reject = reject_weight * (1.0 - label)  # [N]
    numerator = -(reject * logp[:, 0] + label * logp[:, 1]).sum()
    return numerator, (reject + label).sum()


def batch_indices(n: int, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """The example indices of step ``step``: consecutive slices of per-epoch permutations of range(n),
    a pure function of (n, step, batch_size, seed). [batch_size] long"""
    first = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(first, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        take = perm[offset : offset + batch_size - len(out)]
        out.extend(take.tolist())
        first += len(take)
    return torch.tensor(out, dtype=torch.long)


def lr_at(step: int, cfg: HeadTrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate_loss(head: AcceptanceHead, data: HeadData, reject_weight: float, batch: int = 65536) -> dict:
    """The weighted loss, the unweighted soft cross-entropy, the Brier score and the mean prediction
    vs the mean label, over all of ``data``."""
    num = den = ce = brier = pred_sum = 0.0
    for i in range(0, len(data), batch):
        h, label = data.hidden[i : i + batch].float(), data.label[i : i + batch]
        logits = head(h)
        n, d = weighted_soft_ce(logits, label, reject_weight)
        n1, _ = weighted_soft_ce(logits, label, 1.0)
        p = logits.float().softmax(-1)[:, 1]
        num, den, ce = num + float(n), den + float(d), ce + float(n1)
        brier += float(((p - label) ** 2).sum())
        pred_sum += float(p.sum())
    count = max(1, len(data))
    return {"loss": num / max(den, 1e-12), "ce": ce / count, "brier": brier / count,
            "mean_pred": pred_sum / count, "mean_label": float(data.label.float().mean()) if len(data) else 0.0}


@dataclass
class TrainState:
    """What a checkpoint records besides weights and optimizer."""

    step: int = 0
    history: list = field(default_factory=list)  # [{"step", "train_loss", "lr", "valid": {kind: metrics}}]


def _save_checkpoint(out: Path, head: AcceptanceHead, optimizer: torch.optim.Optimizer, state: TrainState,
                     cfg: HeadTrainConfig) -> None:
    """Write ``out/checkpoint`` atomically: head weights, AdamW state (safetensors), state.json."""
    save_checkpoint(out / "checkpoint", head.save_pretrained, optimizer, state, _config_json(cfg))


def _config_json(cfg: HeadTrainConfig) -> dict:
    return {**asdict(cfg), "labels": list(cfg.labels)}


def train_head(cfg: HeadTrainConfig, out_dir: str | Path, stop_at_step: int | None = None,
               log=print, show_progress: bool = True) -> Path | None:
    """Train (or resume) the head. Returns ``out_dir/final`` once ``max_steps`` is reached, else None
    (stopped at ``stop_at_step`` with a checkpoint; call again to resume)."""
    parallel = DataParallel.start("cuda" if torch.cuda.is_available() else "cpu")
    world, main = parallel.world, parallel.main
    out = Path(out_dir)
    if main:
        out.mkdir(parents=True, exist_ok=True)
    data = load_head_data(cfg.data, cfg.labels)
    if len(data) == 0:
        raise ValueError(f"{cfg.data} holds no examples with labels {', '.join(cfg.labels)}")
    valid = load_head_data(cfg.valid, cfg.labels) if cfg.valid else None
    hidden_size = int(data.meta["hidden_size"])
    torch.manual_seed(cfg.seed)
    head = AcceptanceHead(HeadConfig(hidden_size=hidden_size, num_blocks=cfg.num_blocks,
                                     labels="+".join(cfg.labels), drafter=data.meta["config"].get("drafter"),
                                     inputs=data.meta["config"].get("inputs", "mixed")))
    head.to(parallel.device)  # before the optimizer, whose state a resume loads onto the head's device
    parallel.broadcast(head)
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    state = TrainState()
    if latest_checkpoint(out / "checkpoint") is not None:
        state = load_checkpoint(out / "checkpoint", head, optimizer, TrainState, strict=True)
        if main:
            log(f"resumed {out} at step {state.step}")
    device = parallel.device
    if main:
        n_params = sum(p.numel() for p in head.parameters())
        log(f"training a {cfg.num_blocks}-block head ({n_params} parameters) on {len(data)} examples "
            f"({', '.join(f'{k}: {int((data.kind == LABEL_KINDS.index(k)).sum())}' for k in cfg.labels)}), "
            f"{cfg.max_steps} steps of {cfg.batch_size} over {world} process(es)")
    progress = None
    if main and show_progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(TextColumn("head"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            TextColumn("{task.fields[info]}"))
        task = progress.add_task("train", total=cfg.max_steps, completed=state.step, info="")
        progress.start()
    window_loss, window_n = 0.0, 0
    try:
        while state.step < cfg.max_steps:
            step = state.step
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            idx = parallel.shard(batch_indices(len(data), step, cfg.batch_size, cfg.seed))  # this process's share
            h = data.hidden[idx].float().to(device)  # [b, H]
            label = data.label[idx].float().to(device)  # [b]
            numerator, denominator = weighted_soft_ce(head(h), label, cfg.reject_weight)
            loss = parallel.share(numerator, denominator)  # over the global batch's weight
            loss.backward()
            parallel.sync_gradients(head.parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            window_loss += parallel.sum(loss.detach())[0]
            window_n += 1
            record = None
            if state.step % 50 == 0 or state.step == cfg.max_steps:
                record = {"step": state.step, "train_loss": round(window_loss / window_n, 5), "lr": lr_at(step, cfg)}
                window_loss, window_n = 0.0, 0
            if valid is not None and (state.step % cfg.eval_every == 0 or state.step == cfg.max_steps):
                record = record or {"step": state.step}
                record["valid"] = {k: {m: round(v, 5) for m, v in
                                       evaluate_loss(head, valid.of_kind(k), cfg.reject_weight).items()}
                                   for k in cfg.labels}
            if record is not None:
                state.history.append(record)
                if main:
                    info = f"loss {record.get('train_loss', float('nan')):.4f}"
                    if "valid" in record:
                        info += " valid " + " ".join(f"{k} {v['loss']:.4f}" for k, v in record["valid"].items())
                    if progress is not None:
                        progress.update(task, info=info)
                    log(f"[{out.name}] step {state.step}/{cfg.max_steps} {info}")
            if progress is not None:
                progress.update(task, completed=state.step)
            stopping = stop_at_step is not None and state.step == stop_at_step and state.step < cfg.max_steps
            if main and (state.step % cfg.save_every == 0 or state.step == cfg.max_steps or stopping):
                _save_checkpoint(out, head, optimizer, state, cfg)
            if stopping:
                parallel.barrier()
                if main:
                    log(f"stopped at step {state.step}; run again to resume")
                return None
    finally:
        if progress is not None:
            progress.stop()
    parallel.barrier()
    final = out / "final"
    if main:
        with writing(final):
            head.save_pretrained(final)
            (final / "training.json").write_text(json.dumps(
                {"config": _config_json(cfg), "data": data.meta, "examples": len(data), "processes": world,
                 "history": state.history}, indent=1) + "\n")
    parallel.barrier()
    return final
