"""Language-model training for the shipped pair: a Llama-style target, and a drafter distilled from it.

Contract: ``train(cfg, out_dir, tokenizer_dir)`` trains on the stdlib train split
(:mod:`specdec.data.stdlib`), measures validation loss every ``cfg.eval_every`` steps, writes a
resumable checkpoint every ``cfg.save_every`` steps and, when ``max_steps`` is reached, a
``from_pretrained``-loadable model (safetensors, config, tokenizer, generation config) in
``out_dir/final``. Calling it again on the same ``out_dir`` resumes from the checkpoint: the step,
the optimizer, the schedule and the data order continue exactly where they stopped (the batch of
step ``s`` is a pure function of ``seed`` and ``s``), so a long CPU run survives across sessions.

A drafter (``cfg.teacher`` set) is trained by knowledge distillation (Hinton et al. 2015; the
drafter's job is to agree with the target): loss = kd_weight * KL(p_target || q_drafter)
+ (1 - kd_weight) * cross-entropy on the data. ``cfg.outputs`` mixes the target's own
continuations of train-split prompts (:mod:`specdec.train.outputs`) into each batch.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from specdec.data.stdlib import load_split
from specdec.folders import require_weights
from specdec.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, writing
from specdec.train.outputs import outputs_stream
from specdec.train.parallel import DataParallel
from specdec.train.presets import ModelShape, TrainConfig


def tokenize_split(tokenizer, split: str, root: str | None = None) -> torch.Tensor:
    """All files of a split as one stream of token ids, each file followed by eos. [N] int32."""
    files = load_split(split, root)
    encodings = tokenizer.backend_tokenizer.encode_batch([f.text for f in files])
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in encodings:
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def build_model(shape: ModelShape, tokenizer) -> LlamaForCausalLM:
    """A fresh Llama-style causal LM of the given shape for this tokenizer's vocabulary."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def batch_at(stream: torch.Tensor, step: int, cfg: TrainConfig, outputs: torch.Tensor | None = None) -> torch.Tensor:
    """The training windows of one step: a pure function of (seed, step). [batch, seq_len + 1]

    With ``outputs`` (the target's generated continuations), the first ``round(batch_size *
    outputs_share)`` windows come from it and the rest from ``stream``."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    n_out = 0 if outputs is None else round(cfg.batch_size * cfg.outputs_share)
    windows = []
    for source, n in ((outputs, n_out), (stream, cfg.batch_size - n_out)):
        if n:
            starts = torch.randint(0, len(source) - cfg.seq_len - 1, (n,), generator=gen)
            windows += [source[s : s + cfg.seq_len + 1] for s in starts.tolist()]
    return torch.stack(windows).long()


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def stream_loss(model, stream: torch.Tensor, seq_len: int, max_windows: int, bf16: bool = False) -> float:
    """Mean next-token cross-entropy (nats) over up to ``max_windows`` evenly spaced windows."""
    model.eval()
    n_windows = max(1, min(max_windows, (len(stream) - 1) // seq_len))
    stride = (len(stream) - 1 - seq_len) // max(1, n_windows - 1) if n_windows > 1 else 0
    total, count = 0.0, 0
    for i in range(n_windows):
        w = stream[i * stride : i * stride + seq_len + 1].long()[None]  # [1, seq_len + 1]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and w.device.type == "cpu"):
            logits = model(input_ids=w[:, :-1].to(model.device)).logits  # [1, seq_len, V]
        total += F.cross_entropy(logits.float()[0], w[0, 1:].to(model.device), reduction="sum").item()
        count += seq_len
    model.train()
    return total / count


@dataclass
class TrainState:
    """What a checkpoint records besides weights and optimizer."""

    step: int = 0
    history: list | None = None  # [{"step", "train_loss", "val_loss", "lr", "tokens_per_s"}]


def _save_checkpoint(out: Path, model, optimizer, state: TrainState, cfg: TrainConfig) -> None:
    def write_model(folder: Path) -> None:
        model.config.save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
                  str(folder / "model.safetensors"))

    save_checkpoint(out / "checkpoint", write_model, optimizer, state, asdict(cfg))


def _log(msg: str) -> None:
    print(msg, flush=True)


def train(cfg: TrainConfig, out_dir: str | Path, tokenizer_dir: str | Path, device: str = "cpu",
          root: str | None = None, stop_after_s: float | None = None,
          stop_at_step: int | None = None) -> Path | None:
    """Train (or resume) one model. Returns the ``final`` folder once ``max_steps`` is reached,
    else None (stopped early by ``stop_after_s`` seconds or at step ``stop_at_step``, with a
    checkpoint written; call again to resume). Under ``torchrun`` / ``accelerate launch``: data
    parallel (``specdec.train.parallel``), the main process writes."""
    parallel = DataParallel.start(device)
    device, log = parallel.device, parallel.log(_log)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    train_stream = tokenize_split(tokenizer, "train", root)
    val_stream = tokenize_split(tokenizer, "validation", root)
    outputs = None
    if cfg.outputs is not None:
        if not 0 < cfg.outputs_share <= 1:
            raise ValueError(f"outputs_share must be in (0, 1], got {cfg.outputs_share}")
        outputs = outputs_stream(cfg.outputs, tokenizer.eos_token_id, cfg.outputs_records)
        if len(outputs) <= cfg.seq_len + 1:
            raise ValueError(f"{cfg.outputs} holds {len(outputs)} tokens (loops left out), fewer than one "
                             f"window of {cfg.seq_len + 1}: generate more with `specdec train outputs`")
    model = build_model(cfg.shape, tokenizer)
    if cfg.init_from is not None:  # continue training a saved model (fresh optimizer and schedule)
        start = AutoModelForCausalLM.from_pretrained(require_weights(cfg.init_from), dtype=torch.float32)
        if start.config.to_dict()["vocab_size"] != model.config.vocab_size:
            raise ValueError(f"--init-from {cfg.init_from} has another vocabulary than the tokenizer")
        model = start
    model = model.to(device)
    parallel.broadcast(model)
    teacher = None
    if cfg.teacher is not None:
        teacher = AutoModelForCausalLM.from_pretrained(require_weights(cfg.teacher),
                                                       dtype=torch.float32).to(device).eval()
        if teacher.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"teacher {cfg.teacher} has vocabulary {teacher.config.vocab_size}, "
                             f"the drafter's tokenizer {model.config.vocab_size}: use the teacher's tokenizer")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), fused=False,
    )
    state = TrainState(history=[])
    if latest_checkpoint(out / "checkpoint") is not None:
        state = load_checkpoint(out / "checkpoint", model, optimizer, TrainState)
        log(f"resumed {out} at step {state.step}")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"training {n_params / 1e6:.2f}M parameters on {len(train_stream) / 1e6:.2f}M tokens, "
        f"{cfg.max_steps} steps of {cfg.batch_size}x{cfg.seq_len}, device {device}, "
        f"teacher {cfg.teacher or 'none'}"
        + (f", {cfg.outputs_share:.0%} of windows from {cfg.outputs} ({len(outputs) / 1e6:.2f}M tokens)"
           if outputs is not None else "") + (f", {parallel.world} processes" if parallel.world > 1 else ""))
    amp_device = "cuda" if str(device).startswith("cuda") else "cpu"
    started = time.perf_counter()
    window_t, window_tokens, window_loss, window_n = time.perf_counter(), 0, 0.0, 0
    model.train()
    while state.step < cfg.max_steps:
        step = state.step
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = batch_at(train_stream, step, cfg, outputs)[parallel.rows(cfg.batch_size)].to(device)  # [B, T + 1]
        inputs, labels = batch[:, :-1], batch[:, 1:]
        with torch.autocast(amp_device, dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = model(input_ids=inputs).logits.float()  # [B, T, V]
            # means over the global batch's tokens (this process's share of them: specdec.train.parallel)
            ce = parallel.share(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"),
                                labels.numel())
            loss = ce
            if teacher is not None:
                with torch.no_grad():
                    p_log = F.log_softmax(teacher(input_ids=inputs).logits.float(), dim=-1)  # [B, T, V]
                kl = F.kl_div(F.log_softmax(logits, dim=-1), p_log, log_target=True, reduction="none")
                loss = cfg.kd_weight * parallel.share(kl.sum(), labels.numel()) + (1 - cfg.kd_weight) * ce
        loss.backward()
        parallel.sync_gradients(model.parameters())
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        step_ce, tokens = parallel.sum(ce.detach(), inputs.numel())  # the global batch's
        window_tokens += tokens
        window_loss += step_ce
        window_n += 1
        record = None
        if state.step % 10 == 0 or state.step == cfg.max_steps:
            tps = window_tokens / (time.perf_counter() - window_t)
            record = {"step": state.step, "train_loss": round(window_loss / window_n, 4),
                      "lr": round(lr_at(step, cfg), 6), "tokens_per_s": round(tps, 1)}
            window_t, window_tokens, window_loss, window_n = time.perf_counter(), 0, 0.0, 0
        if state.step % cfg.eval_every == 0 or state.step == cfg.max_steps:
            record = record or {"step": state.step}
            if parallel.main:
                record["val_loss"] = round(stream_loss(model, val_stream, cfg.seq_len, cfg.eval_windows,
                                                       bf16=cfg.bf16 and amp_device == "cpu"), 4)
        if record is not None:
            state.history.append(record)
            log(f"[{out.name}] step {state.step}/{cfg.max_steps} "
                + " ".join(f"{k}={v}" for k, v in record.items() if k != "step"))
        if parallel.main and (state.step % cfg.save_every == 0 or state.step == cfg.max_steps):
            _save_checkpoint(out, model, optimizer, state, cfg)
        out_of_time = stop_after_s is not None and time.perf_counter() - started > stop_after_s
        if parallel.any(out_of_time or state.step == stop_at_step) and state.step < cfg.max_steps:
            if parallel.main:
                _save_checkpoint(out, model, optimizer, state, cfg)
            parallel.barrier()
            log(f"stopped at step {state.step}; run again to resume")
            return None
    final = out / "final"
    if parallel.main:
        with writing(final):
            _write_final(final, model, tokenizer)
    parallel.barrier()
    return final


def _write_final(final: Path, model, tokenizer) -> Path:
    model.eval()
    model.save_pretrained(final, safe_serialization=True)
    tokenizer.save_pretrained(final)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False,
    ).save_pretrained(final)
    return final


def export(src: str | Path, dst: str | Path, dtype: str = "bf16", max_shard_size: str = "16MB") -> Path:
    """Copy a trained model to ``dst`` in a shipping dtype (safetensors, config, tokenizer)."""
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype not in dtypes:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(dtypes)}")
    model = AutoModelForCausalLM.from_pretrained(require_weights(src), dtype=dtypes[dtype])
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst, safe_serialization=True, max_shard_size=max_shard_size)
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(dst)
    GenerationConfig.from_pretrained(str(src)).save_pretrained(dst)
    return dst
