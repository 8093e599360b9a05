"""Training SpecDec's block drafter by distillation from the target, with glancing: the run.

The method, its records, batches and loss are in ``specdec.train.block_data``; its figures in
``specdec.train.block_eval``. Here: the drafter's initial weights (``build_block_drafter``), the
schedule and optimizer, the resumable loop, and ``train_own_block_drafter`` for any target's data.

Contract: ``train_block_drafter(cfg, out_dir)`` trains or resumes a run folder: ``checkpoint/``
(weights, optimizer, step; the batch and the glancing choices of step ``s`` are a pure function
of ``seed`` and ``s``, so a resumed run equals an uninterrupted one) and, at ``max_steps``,
``final/`` (``save_pretrained`` safetensors, tokenizer). A run keeps the config it started with,
except ``max_steps`` when a resume asks for ``reschedule_to`` (the lr and glancing schedules then
end there; the run is no longer equal to an uninterrupted one).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.drafters.block_model import BlockDrafterConfig, BlockDrafterModel
from specdec.loading import load_model, load_tokenizer
from specdec.train.block_data import (
    batch_at,
    cached_hidden_states,
    draft_vocabulary,
    glancing_loss,
    glancing_ratio,
    load_records,
    step_generator,
)
from specdec.train.block_eval import block_acceptance
from specdec.train.checkpoint import load_checkpoint, save_checkpoint, saved_config, writing
from specdec.train.drafter import block_card, measure_pair
from specdec.train.outputs import check_records, target_fingerprint, valid_path
from specdec.train.outputs import read_records as read_outputs
from specdec.train.parallel import DataParallel
from specdec.train.presets import BlockTrainConfig

# ---- model ---------------------------------------------------------------------------------------


def _projected_embeddings(target_embeddings: torch.Tensor, width: int) -> torch.Tensor:
    """The target's embeddings [V, H_t] brought to ``width`` columns: as is when equal, else the top
    principal directions (a truncated SVD keeps the most of their geometry). [V, width]"""
    if target_embeddings.shape[1] == width:
        return target_embeddings.clone()
    if target_embeddings.shape[1] < width:  # a narrower target: its embeddings, the extra columns zero
        return F.pad(target_embeddings.float(), (0, width - target_embeddings.shape[1]))
    u, s, _ = torch.linalg.svd(target_embeddings.float(), full_matrices=False)
    proj = u[:, :width] * s[:width]  # [V, width]
    scale = target_embeddings.float().norm(dim=1).mean() / proj.norm(dim=1).mean()  # keep the typical row norm
    return proj * scale


def build_block_drafter(cfg: BlockTrainConfig, target, draft_vocab: torch.Tensor | None,
                        init=None) -> BlockDrafterModel:
    """A fresh block drafter for ``target`` (its vocabulary, ids, context). With ``init`` (a Llama
    causal LM of the same vocabulary, e.g. the shipped autoregressive drafter) its shape and weights
    start the drafter; otherwise fresh layers of ``cfg``'s shape with the target's embeddings
    (projected to the width). The head rows start from the embeddings of their tokens."""
    tconf = target.config.get_text_config()
    source = init.config if init is not None else None
    if source is not None and (source.model_type != "llama" or source.vocab_size != tconf.vocab_size):
        raise ValueError(f"init_from must be a Llama causal LM with the target's {tconf.vocab_size}-token vocabulary, "
                         f"got {source.model_type} with {source.vocab_size}")
    shape = {"hidden_size": source.hidden_size, "num_hidden_layers": source.num_hidden_layers,
                 "num_attention_heads": source.num_attention_heads, "num_key_value_heads": source.num_key_value_heads,
                 "intermediate_size": source.intermediate_size, "head_dim": source.head_dim,
                 "rms_norm_eps": source.rms_norm_eps} if source is not None else {
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size}
    config = BlockDrafterConfig(
        vocab_size=tconf.vocab_size,
        max_position_embeddings=tconf.max_position_embeddings,
        rope_parameters=dict(tconf.rope_parameters) if getattr(tconf, "rope_parameters", None) else None,
        tie_word_embeddings=draft_vocab is None,
        bos_token_id=tconf.bos_token_id,
        eos_token_id=tconf.eos_token_id,
        pad_token_id=tconf.pad_token_id,
        max_block_size=cfg.max_block_size,
        draft_vocab_size=0 if draft_vocab is None else len(draft_vocab),
        target_hidden_size=tconf.hidden_size if cfg.condition_on_target else 0,
        **shape,
    )
    model = BlockDrafterModel(config)
    with torch.no_grad():
        if init is not None:
            missing, unexpected = model.model.load_state_dict(init.model.state_dict(), strict=False)
            if missing or unexpected:
                raise ValueError(f"init_from's layers do not fit: missing {missing}, unexpected {unexpected}")
            emb = init.get_output_embeddings().weight.detach().float()
        else:
            emb = _projected_embeddings(target.get_input_embeddings().weight.detach(), config.hidden_size)
            model.get_input_embeddings().weight.copy_(emb)
        if draft_vocab is not None:
            model.draft_vocab.copy_(draft_vocab)
            model.lm_head.weight.copy_(emb[draft_vocab])
        else:
            model.lm_head.weight.copy_(emb)
    return model


# ---- the run -------------------------------------------------------------------------------------


def lr_at(step: int, cfg: BlockTrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: BlockDrafterModel, cfg: BlockTrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms, embeddings' extra vectors, biases)."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "block_position" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "block_position" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


@dataclass
class RunState:
    """What a checkpoint records besides weights and optimizer."""

    step: int = 0
    seconds: float = 0.0  # training time so far, summed over sessions
    history: list | None = None  # [{"step", "loss", "accuracy", "revealed", "lr", ...}]


def _save(folder: Path, model: BlockDrafterModel, optimizer, state: RunState, cfg: BlockTrainConfig) -> None:
    save_checkpoint(folder, model.save_pretrained, optimizer, state, asdict(cfg))


def _saved_config(folder: Path) -> BlockTrainConfig | None:
    saved = saved_config(folder)
    if saved is None:
        return None
    return BlockTrainConfig(**{f.name: saved[f.name] for f in fields(BlockTrainConfig) if f.name in saved})


def train_block_drafter(cfg: BlockTrainConfig, out_dir: str | Path, *, stop_after_s: float | None = None,
                        stop_at_step: int | None = None, reschedule_to: int | None = None, log=print,
                        progress: bool = True, measure: bool = False, measure_prompts: int = 20,
                        measure_tokens: int = 64) -> Path | None:
    """Train or resume a block drafter in ``out_dir``; the ``final`` folder at ``max_steps``, else
    None (stopped by ``stop_after_s`` or ``stop_at_step`` with a checkpoint written).
    ``reschedule_to`` moves a resumed run's ``max_steps`` (where the cosine lr and the glancing
    anneal end): the run is then no longer equal to an uninterrupted one, and its record says so.
    Data written for another target (the records' fingerprint) is refused before anything is written.
    With ``measure`` (and ``cfg.valid``), decoding with the drafter is measured at the end on the first
    ``measure_prompts`` held-out prompts (``measure_pair``: α, τ, speedup over plain decoding), printed and
    written into ``final/training.json`` and a model card ``final/README.md``.
    Under ``torchrun`` / ``accelerate launch``: data parallel (``specdec.train.parallel``; gloo, the
    trainer runs on CPUs), the main process writes and measures."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the run's own bar and log lines only
    parallel = DataParallel.start("cpu")
    log = parallel.log(log)
    out = Path(out_dir)
    ckpt = out / "checkpoint"
    saved = _saved_config(ckpt)
    if saved is not None:
        if saved != replace(cfg, outputs_records=saved.outputs_records):
            changed = [f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(saved, f.name)
                       and f.name != "outputs_records"]
            log(f"resuming {out} with the config it started with (ignoring changed {', '.join(changed)})")
        cfg = saved
    if reschedule_to is not None and reschedule_to != cfg.max_steps:
        if saved is None:
            raise ValueError("--reschedule-to moves a resumed run's schedule; start a new run with --max-steps")
        log(f"rescheduling {out}: max_steps {cfg.max_steps} -> {reschedule_to}")
        cfg = replace(cfg, max_steps=reschedule_to)
    for name in ("batch_size", "block_tokens", "max_steps", "max_block_size", "seq_len", "num_hidden_layers"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    print_ = target_fingerprint(cfg.target)
    for path in (cfg.outputs, cfg.valid):
        if path is not None:
            load_records(path)  # a missing file, or one without greedy records, is refused here
            check_records(read_outputs(path), path, print_)
    if cfg.outputs_records is None:  # pin the data: the file may grow while this run lives
        lines = Path(cfg.outputs).read_text().splitlines()
        cfg = replace(cfg, outputs_records=sum(1 for line in lines if line.strip()))
    target = load_model(cfg.target, device="cpu", dtype=torch.float32)
    tokenizer = load_tokenizer(cfg.target)
    records = load_records(cfg.outputs, cfg.outputs_records)
    valid = load_records(cfg.valid)[: cfg.valid_records] if cfg.valid else None
    out.mkdir(parents=True, exist_ok=True)
    hidden = valid_hidden = None
    if cfg.condition_on_target:
        hidden = cached_hidden_states(target, records, out / "target-hidden.safetensors", log)
        if valid is not None:
            valid_hidden = cached_hidden_states(target, valid, out / "valid-hidden.safetensors", log)
    eos = tokenizer.eos_token_id
    vocab = target.config.get_text_config().vocab_size
    draft_vocab = (draft_vocabulary(records, cfg.draft_vocab_size, [eos] if eos is not None else [])
                   if 0 < cfg.draft_vocab_size < vocab else None)  # a head as large as the vocabulary: all of it
    torch.manual_seed(cfg.seed)
    init = load_model(cfg.init_from, device="cpu", dtype=torch.float32) if cfg.init_from else None
    model = build_block_drafter(cfg, target, draft_vocab, init)
    del init
    if not measure:
        del target
    parallel.broadcast(model)
    optimizer = make_optimizer(model, cfg)
    state = RunState(history=[])
    if saved is not None:
        state = load_checkpoint(ckpt, model, optimizer, RunState)
        log(f"resumed {out} at step {state.step}")
    else:
        log(f"{len(records)} greedy records from {cfg.outputs} (first {cfg.outputs_records} lines); "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    model.train()
    started = time.perf_counter()
    session_start = state.seconds
    window: list[dict[str, float]] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[figures]}"))
    with Progress(*columns, console=Console(stderr=True), disable=not (progress and parallel.main)) as bar:
        task = bar.add_task(f"block drafter {out.name}", total=cfg.max_steps, completed=state.step, figures="")
        while state.step < cfg.max_steps:
            step = state.step
            gen = step_generator(step, cfg.seed)
            batch = batch_at(records, step, cfg, hidden, gen, own=parallel.rows(cfg.batch_size))
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            loss, figures = glancing_loss(model, batch, glancing_ratio(step, cfg), gen, cfg.label_smoothing, cfg.bf16,
                                          cfg.prefix_loss, share=parallel.share)
            loss.backward()
            parallel.sync_gradients(model.parameters())
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.seconds = session_start + time.perf_counter() - started
            shares = parallel.sum(loss.detach(), *figures.values())  # the processes' shares add up to the batch's
            window.append(dict(zip(["loss", *figures], shares)))
            record = None
            if state.step % 10 == 0 or state.step == cfg.max_steps:
                record = {"step": state.step, "seconds": round(state.seconds, 1), "lr": round(lr_at(step, cfg), 6)}
                for key in window[0]:
                    record[key] = round(sum(w[key] for w in window) / len(window), 4)
                window = []
            if valid is not None and (state.step % cfg.eval_every == 0 or state.step == cfg.max_steps):
                record = record or {"step": state.step}
                if parallel.main:
                    acc = block_acceptance(model, valid, [4, 8], valid_hidden, horizon=8)
                    model.train()
                    record.update({f"tau_k{k}": round(a.tau, 3) for k, a in acc.items()})
            if record is not None:
                state.history.append(record)
                shown = " ".join(f"{k}={v}" for k, v in record.items() if k not in ("step",))
                bar.update(task, figures=shown)
                if not progress or not bar.console.is_terminal:
                    log(f"[{out.name}] step {state.step}/{cfg.max_steps} {shown}")
            bar.update(task, completed=state.step)
            if parallel.main and (state.step % cfg.save_every == 0 or state.step == cfg.max_steps):
                _save(ckpt, model, optimizer, state, cfg)
            out_of_time = stop_after_s is not None and time.perf_counter() - started > stop_after_s
            if parallel.any(out_of_time or state.step == stop_at_step) and state.step < cfg.max_steps:
                if parallel.main:
                    _save(ckpt, model, optimizer, state, cfg)
                parallel.barrier()
                log(f"stopped at step {state.step}; run the same command again to resume")
                return None
    final = out / "final"
    parallel.barrier()  # the main process has written the last checkpoint
    if not parallel.main:  # it alone exports, measures and writes the card (nobody waits in a collective)
        return final
    model.eval()
    with writing(final):
        model.save_pretrained(final)
        tokenizer.save_pretrained(final)
    figures = None
    if measure and cfg.valid:
        figures = measure_pair(target, model, read_outputs(cfg.valid), measure_prompts, measure_tokens, log)
    elif measure:
        log("not measured: no held-out greedy records (make the data with a larger --valid-share)")
    with writing(final):
        (final / "training.json").write_text(json.dumps({"config": asdict(cfg), "state": asdict(state),
                                                         "data": {"file": cfg.outputs, "target": print_},
                                                         "figures": figures, "processes": parallel.world}, indent=1))
        if measure:
            n = sum(p.numel() for p in model.parameters())
            c = model.config
            (final / "README.md").write_text(block_card(
                cfg.target, f"A {n / 1e6:.2f}M-parameter `BlockDrafterModel` ({c.num_hidden_layers} layers, width "
                f"{c.hidden_size}, blocks of up to {c.max_block_size} tokens; `specdec` registers it with "
                "`AutoModelForCausalLM`)",
                f"Glancing training on the target's greedy continuations, {cfg.max_steps} steps of {cfg.batch_size} "
                f"sequences, peak learning rate {cfg.lr}, seed {cfg.seed}"
                + (f", started from `{cfg.init_from}`" if cfg.init_from else ", fresh layers, the target's embeddings")
                + ".", cfg.outputs, len(records), len(read_outputs(cfg.valid)) if cfg.valid else 0, print_, figures),
                encoding="utf-8")
    return final


# ---- any target: the block drafter from a `specdec data outputs` file ------------------------------

# BlockTrainConfig fields an encoder-decoder target's block drafter (``seq2seq_block``) takes, by its own name
SEQ2SEQ_FIELDS = {"num_hidden_layers": "decoder_layers", "max_block_size": "max_block_size",
                  "prefix_loss": "prefix_loss", "batch_size": "batch_size", "label_smoothing": "label_smoothing",
                  "lr": "lr", "min_lr_ratio": "min_lr_ratio", "warmup_steps": "warmup_steps",
                  "weight_decay": "weight_decay", "grad_clip": "grad_clip", "max_steps": "max_steps",
                  "eval_every": "eval_every", "save_every": "save_every", "seed": "seed"}


def train_own_block_drafter(target: str, data: str | Path, out_dir: str | Path, settings: dict | None = None, *,
                            device: str = "cpu", stop_after_s: float | None = None, stop_at_step: int | None = None,
                            measure: bool = True, measure_prompts: int = 20, measure_tokens: int = 64,
                            log=print, progress: bool = True) -> Path | None:
    """``specdec train block-drafter --target PATH --data OUT.jsonl``: SpecDec's block drafter for any target,
    trained on a ``specdec data outputs`` file made with it (held out: its ``.valid.jsonl``). A decoder-only
    target gets a ``BlockDrafterModel`` (``train_block_drafter``; ``settings``: ``BlockTrainConfig`` fields,
    fresh layers by default), an encoder-decoder one a copy of itself with its first decoder layers
    (``seq2seq_block.train_seq2seq_block``; ``settings`` mapped by ``SEQ2SEQ_FIELDS``, others refused).
    Both check the data's fingerprint before writing anything and measure the drafter at the end."""
    from specdec.train.outputs import target_data

    settings = dict(settings or {})
    for name in ("target", "outputs", "valid", "outputs_records"):
        if name in settings:
            raise ValueError(f"--{name.replace('_', '-')} does not go with --data: --data names the data file "
                             "(its held-out share is read from beside it)")
    own = target_data(target, data)  # refuses a missing file, another target's data, before any work
    if getattr(own.config, "is_encoder_decoder", False):
        from specdec.train.drafter import _layer_key
        from specdec.train.seq2seq_block import Seq2SeqBlockConfig, train_seq2seq_block

        other = [k for k in settings if k not in SEQ2SEQ_FIELDS]
        if other:
            raise ValueError(f"--{other[0].replace('_', '-')} does not apply to an encoder-decoder target's block "
                             "drafter (the target with its first --num-hidden-layers decoder layers): leave it out")
        layers = settings.get("num_hidden_layers", Seq2SeqBlockConfig.decoder_layers)
        most = getattr(own.config, _layer_key(own.config))
        if not 1 <= layers <= most:
            raise ValueError(f"--num-hidden-layers {layers}: the target has {most} decoder layers; give 1..{most}")
        cfg = Seq2SeqBlockConfig(target=target, outputs=str(data), data="", translations="",
                                 **{SEQ2SEQ_FIELDS[k]: v for k, v in settings.items()})
        return train_seq2seq_block(cfg, out_dir, device=device, stop_after_s=stop_after_s, log=log,
                                   stop_at_step=stop_at_step, measure=measure, measure_prompts=measure_prompts,
                                   measure_tokens=measure_tokens)
    if device != "cpu":
        raise ValueError("the decoder-only block drafter trains on the CPU: leave out --device")
    greedy_held = any(r["temperature"] == 0 and r["ids"] and r["prompt_ids"] for r in own.valid)
    valid = str(valid_path(data)) if greedy_held else None  # the trainer's held-out figures read greedy records
    cfg = BlockTrainConfig(**{"init_from": None, **settings, "target": target, "outputs": str(data), "valid": valid})
    return train_block_drafter(cfg, out_dir, stop_after_s=stop_after_s, stop_at_step=stop_at_step, log=log,
                               progress=progress, measure=measure, measure_prompts=measure_prompts,
                               measure_tokens=measure_tokens)
