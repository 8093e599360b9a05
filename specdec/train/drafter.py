"""A small autoregressive drafter for any target, distilled on the target's own outputs.

Contract: ``train_drafter(cfg, out_dir)`` builds a drafter from the target's own config class (the
same architecture, vocabulary and tokenizer, so ``AutoModelForCausalLM`` / ``AutoModelForSeq2SeqLM``
load it with no specdec code) and trains it on a ``specdec data outputs`` file made with that target
(its fingerprint is checked). Two starting points (``INITS``):
- ``shrunk``: ``cfg.layers`` fresh decoder layers of width ``cfg.hidden`` (the target's number of heads,
  its intermediate size scaled by the width); the token embeddings (and an untied output head,
  learned positions) are the target's when the width matches, else their projection on the top
  ``hidden`` principal directions of the target's token embeddings. An encoder-decoder drafter keeps
  the target's number of encoder layers (a deep encoder runs once per source; Kasai et al. 2021).
- ``first-layers``: the target's width, embeddings, first ``cfg.layers`` decoder layers, final norm and
  head (LayerSkip-style early exit, Elhoushi et al. 2024; an encoder-decoder keeps its whole encoder).

Loss: KL(p_target || q_drafter) at every position of each record (prompt and continuation; for an
encoder-decoder target every decoder position), p computed on the fly by the target in the same
step (DistillSpec, Zhou et al. 2024: the drafter's job is to agree with the target). The batch of
step ``s`` is a pure function of ``seed`` and ``s``; checkpoints every ``save_every`` steps, and at
Ctrl-C, resume exactly (the optimizer loop is ``seq2seq.run_steps``, shared with the encoder-decoder
trainers). At the end, ``out_dir/final`` holds the drafter (safetensors, config, generation config,
tokenizer) and a model card (README.md): recipe, data, and, when ``measure`` is on, the drafter's
greedy α, τ and speedup over plain decoding on the held-out prompts (``OUT.valid.jsonl``).
"""

from __future__ import annotations

import copy
import json
import signal
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, PreTrainedModel

from specdec.config import ScheduleConfig
from specdec.loading import load_model
from specdec.train.checkpoint import saved_config, writing
from specdec.train.outputs import (
    target_data,
    valid_path,
)
from specdec.train.parallel import DataParallel
from specdec.train.presets import DrafterTrainConfig
from specdec.train.seq2seq import adamw, batch_indices, lr_at, resume, run_steps


@dataclass(frozen=True)
class Example:
    """One training record as model inputs."""

    ids: list[int]  # decoder-only: prompt + continuation; encoder-decoder: decoder inputs (start + continuation[:-1])
    source: list[int] | None = None  # the encoder's input (encoder-decoder targets)


# ---------------------------------------------------------------------------------------- the shape


def is_encoder_decoder(config) -> bool:
    return bool(getattr(config, "is_encoder_decoder", False))


def _layer_key(config) -> str:
    """The config field counting the decoder's layers."""
    if is_encoder_decoder(config):
        return next(k for k in ("decoder_layers", "num_decoder_layers", "num_hidden_layers") if hasattr(config, k))
    return "num_hidden_layers"


def _head_keys(config) -> list[str]:
    keys = [k for k in ("encoder_attention_heads", "decoder_attention_heads") if hasattr(config, k)]
    return keys or ["num_attention_heads"]


def drafter_config(target_config, layers: int, hidden: int | None, init: str):
    """The drafter's config: the target's, with ``layers`` decoder layers and width ``hidden``."""
    config = copy.deepcopy(target_config)
    key = _layer_key(config)
    most = getattr(config, key)
    if not 1 <= layers <= most:
        raise ValueError(f"--layers {layers}: the target has {most} decoder layers; give 1..{most}")
    width = config.hidden_size
    hidden = width if hidden is None else hidden
    if init == "first-layers" and hidden != width:
        raise ValueError(f"--init first-layers keeps the target's width ({width}): leave out --hidden {hidden}")
    heads = {k: getattr(config, k) for k in _head_keys(config)}
    for k, n in heads.items():
        if hidden < 1 or hidden % n:
            raise ValueError(f"--hidden {hidden} is not divisible by the target's head count ({n}): give a "
                             f"multiple of {n}")
    setattr(config, key, layers)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    if hidden != width:
        config.hidden_size = hidden
        for k in ("intermediate_size", "n_inner", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff"):
            if isinstance(getattr(config, k, None), int):
                setattr(config, k, max(1, round(getattr(config, k) * hidden / width)))
        for k in ("head_dim", "d_kv"):
            if isinstance(getattr(config, k, None), int):
                setattr(config, k, hidden // next(iter(heads.values())))
    return config


def _projection(target: PreTrainedModel, hidden: int) -> torch.Tensor:
    """[H_target, hidden]: the top ``hidden`` principal directions of the target's token embeddings."""
    emb = target.get_input_embeddings().weight.detach().double()  # [V, H_target]
    centred = emb - emb.mean(0)
    _, vectors = torch.linalg.eigh(centred.T @ centred)  # [H_target, H_target], ascending eigenvalues
    return vectors[:, -hidden:].flip(1).float()  # [H_target, hidden]: deterministic, unlike a randomized SVD


def _init_shrunk(drafter: PreTrainedModel, target: PreTrainedModel) -> None:
    """Token embeddings, an untied head and learned positions from the target (projected when narrower)."""
    width, hidden = target.config.hidden_size, drafter.config.hidden_size
    proj = None if width == hidden else _projection(target, hidden)
    sources = dict(target.named_modules())
    pairs = [(m, sources.get(name)) for name, m in drafter.named_modules()
             if isinstance(m, nn.Embedding) and m.weight.requires_grad]  # sinusoidal tables are fixed: left alone
    head, target_head = drafter.get_output_embeddings(), target.get_output_embeddings()
    if head is not None and head.weight is not drafter.get_input_embeddings().weight:
        pairs.append((head, target_head))
    with torch.no_grad():
        for mine, theirs in pairs:
            if theirs is None or theirs.weight.shape[0] != mine.weight.shape[0]:
                continue
            src = theirs.weight.detach().float()
            mine.weight.copy_(src if proj is None else src @ proj)
        buffers = dict(target.named_buffers())
        for name, buf in drafter.named_buffers():  # e.g. Marian's final_logits_bias
            if name in buffers and buffers[name].shape == buf.shape:
                buf.copy_(buffers[name])


def _init_first_layers(drafter: PreTrainedModel, target: PreTrainedModel) -> None:
    """Every drafter weight from the target's of the same name: the first layers, embeddings, norm, head."""
    mine = drafter.state_dict()
    theirs = {k: v for k, v in target.state_dict().items() if k in mine and v.shape == mine[k].shape}
    missing = [k for k in mine if k not in theirs]
    if missing:
        raise ValueError(f"--init first-layers: the target has no weight for {missing[0]}")
    drafter.load_state_dict(theirs, strict=False)


INITS: dict[str, Callable[[PreTrainedModel, PreTrainedModel], None]] = {
    "shrunk": _init_shrunk,
    "first-layers": _init_first_layers,
}


def build_drafter(target: PreTrainedModel, cfg: DrafterTrainConfig) -> PreTrainedModel:
    """A drafter of the target's class per ``cfg`` (layers, hidden, init), float32, in train mode."""
    if cfg.init not in INITS:
        raise ValueError(f"unknown --init {cfg.init!r}: use one of {', '.join(INITS)}")
    config = drafter_config(target.config, cfg.layers, cfg.hidden, cfg.init)
    auto = AutoModelForSeq2SeqLM if is_encoder_decoder(config) else AutoModelForCausalLM
    torch.manual_seed(cfg.seed)
    drafter = auto.from_config(config, dtype=torch.float32)
    INITS[cfg.init](drafter, target)
    drafter.generation_config = copy.deepcopy(target.generation_config)
    return drafter.train()


# ---------------------------------------------------------------------------------- data and loss


def examples(records: Sequence[dict], model: PreTrainedModel, seq_len: int) -> list[Example]:
    """The records as model inputs (empty continuations left out)."""
    from specdec.seq2seq import decoder_start_id

    out = []
    for r in records:
        if not r["ids"]:
            continue
        if is_encoder_decoder(model.config):
            out.append(Example(([decoder_start_id(model)] + r["ids"][:-1])[:seq_len], r["prompt_ids"]))
        else:
            out.append(Example((r["prompt_ids"] + r["ids"])[-seq_len:]))
    return out


def collate(batch: Sequence[Example], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Right-padded inputs of both models, and ``mask`` [B, T]: the positions scored."""
    def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)  # [B, T]
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        return ids.to(device), mask.to(device)

    ids, mask = padded([e.ids for e in batch])
    if batch[0].source is None:
        return {"inputs": {"input_ids": ids, "attention_mask": mask}, "mask": mask}
    source, source_mask = padded([e.source for e in batch])
    return {"inputs": {"input_ids": source, "attention_mask": source_mask, "decoder_input_ids": ids,
                       "decoder_attention_mask": mask}, "mask": mask}


def distill_terms(drafter: PreTrainedModel, target: PreTrainedModel, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(p || q) [B, T], top-1 agreement [B, T]) at every position; p from the target, no gradient."""
    with torch.no_grad():
        p_log = F.log_softmax(target(**batch["inputs"]).logits.float(), dim=-1)  # [B, T, V]
    q_log = F.log_softmax(drafter(**batch["inputs"]).logits.float(), dim=-1)  # [B, T, V]
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)  # [B, T]
    agree = (p_log.argmax(-1) == q_log.argmax(-1)).float()  # [B, T]
    return kl, agree


@torch.no_grad()
def held_out(drafter: PreTrainedModel, target: PreTrainedModel, data: Sequence[Example], device,
             batch_size: int = 16) -> dict[str, float]:
    """Mean KL and top-1 agreement with the target over ``data``'s positions."""
    was_training = drafter.training
    drafter.eval()
    kl_sum = agree_sum = count = 0.0
    for i in range(0, len(data), batch_size):
        batch = collate(data[i : i + batch_size], device)
        kl, agree = distill_terms(drafter, target, batch)
        mask = batch["mask"].float()
        kl_sum += float((kl * mask).sum())
        agree_sum += float((agree * mask).sum())
        count += float(mask.sum())
    drafter.train(was_training)
    return {"val_kl": round(kl_sum / max(1.0, count), 4), "val_agreement": round(agree_sum / max(1.0, count), 4)}


# ------------------------------------------------------------------------------------------ the run


class _Interrupt:
    """Ctrl-C asks the run to stop after the step under way (a checkpoint follows); a second one stops at once."""

    def __init__(self) -> None:
        self.hit = False

    def _handle(self, signum, frame) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __enter__(self) -> Self:
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _resumed_config(cfg: DrafterTrainConfig, out: Path) -> DrafterTrainConfig:
    """The run's config: ``cfg``, checked against the one ``out`` was started with."""
    saved = saved_config(out / "checkpoint")
    if saved is None:
        return cfg
    for f in fields(cfg):
        given, before = getattr(cfg, f.name), saved.get(f.name, f.default)  # a field newer than the run: default
        if f.name == "records" and given is None:
            continue
        if given != before:
            flag = "--" + f.name.replace("_", "-")
            raise ValueError(f"{out} holds a run with {flag} {before}, not {given}: give the same settings to resume "
                             f"it, or another --out (or delete {out}) to start over")
    return replace(cfg, records=saved["records"])


def train_steps(out: Path, drafter: PreTrainedModel, optimizer, state, cfg, lr_at: Callable, loss_at: Callable,
                evaluate: Callable, parallel, *, progress: bool, stop_after_s: float | None, stop_at_step: int | None,
                log: Callable[[str], None]) -> Path | None:
    """A drafter trainer's steps (``seq2seq.run_steps``) under a progress bar, Ctrl-C writing a checkpoint: the final
    folder ``out/final`` once every step is done and every process has passed the barrier (the main process has
    written it), None where a time or step limit stopped the run first; KeyboardInterrupt, after saying how to
    resume, where Ctrl-C did."""
    bar = _TrainBar(cfg.steps, state.step, progress and parallel.main)
    with _Interrupt() as interrupt, bar:
        finished = run_steps(out, drafter, optimizer, state, cfg, lambda step: lr_at(step, cfg), loss_at, evaluate,
                             stop_after_s=stop_after_s, stop_at_step=stop_at_step, log=bar.log(log),
                             stop=lambda: interrupt.hit, on_step=bar.update, unit="tokens", parallel=parallel)
    if not finished:
        if interrupt.hit:
            log(f"interrupted at step {state.step}: checkpoint written to {out / 'checkpoint'}; run the same "
                "command to resume")
            raise KeyboardInterrupt
        return None
    parallel.barrier()  # the main process has written the last checkpoint
    return out / "final"


def train_drafter(cfg: DrafterTrainConfig, out_dir: str | Path, *, device: str = "cpu",
                  stop_at_step: int | None = None, stop_after_s: float | None = None, measure: bool = True,
                  measure_prompts: int = 20, measure_tokens: int = 64, progress: bool = True,
                  log: Callable[[str], None] = print) -> Path | None:
    """Train or resume a drafter in ``out_dir``; the ``final`` folder once ``cfg.steps`` are done, else None
    (stopped by ``stop_at_step``, ``stop_after_s`` or Ctrl-C with a checkpoint written: call again to resume).
    Under ``torchrun`` / ``accelerate launch``: data parallel (``specdec.train.parallel``); the main process
    writes the checkpoints, then the drafter, its measurement and card while the others have returned."""
    if not cfg.target or not cfg.data:
        raise ValueError("give the target (--target FOLDER) and its data (--data FILE from `specdec data outputs`)")
    for name in ("steps", "batch_size", "seq_len", "eval_every", "save_every", "eval_records"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the run's own bar and log lines only
    if cfg.init not in INITS:
        raise ValueError(f"unknown --init {cfg.init!r}: use one of {', '.join(INITS)}")
    parallel = DataParallel.start(device)
    device, log = parallel.device, parallel.log(log)
    out = Path(out_dir)
    cfg = _resumed_config(cfg, out)
    own = target_data(cfg.target, cfg.data)  # refuses a missing file, another target's data, before any work
    drafter_config(own.config, cfg.layers, cfg.hidden, cfg.init)  # refuses a bad shape before any work
    tokenizer, print_, records, valid_records = own.tokenizer, own.fingerprint, own.records, own.valid
    if cfg.records is None:
        cfg = replace(cfg, records=len(records))  # pin the data: the file may grow while this run lives
    if cfg.records > len(records):
        raise ValueError(f"{cfg.data} holds {len(records)} records, fewer than the {cfg.records} this run started with")
    target = load_model(cfg.target, device=device, dtype=torch.float32)
    train_data = examples(records[: cfg.records], target, cfg.seq_len)
    valid_data = examples(valid_records, target, cfg.seq_len)[: cfg.eval_records]
    if not train_data:
        raise ValueError(f"{cfg.data}: every continuation is empty; make new data with a larger --max-new-tokens")
    drafter = build_drafter(target, cfg).to(device)
    parallel.broadcast(drafter)
    out.mkdir(parents=True, exist_ok=True)
    optimizer = adamw(drafter, cfg.lr, cfg.weight_decay)
    state = resume(out, drafter, optimizer, log)
    n_params = sum(p.numel() for p in drafter.parameters())
    log(f"drafter of {n_params / 1e6:.2f}M parameters ({cfg.init}, {cfg.layers} layers, width "
        f"{drafter.config.hidden_size}) for a target of {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M; "
        f"{len(train_data)} records ({sum(len(e.ids) for e in train_data)} tokens), {len(valid_data)} held out; "
        f"{cfg.steps} steps of {cfg.batch_size}, device {device}, {torch.get_num_threads()} threads"
        + (f", {parallel.world} processes" if parallel.world > 1 else ""))
    lengths = [len(e.ids) + len(e.source or ()) for e in train_data]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=str(device).startswith("cuda")
                              and torch.cuda.is_bf16_supported())

    def loss_at(step: int) -> tuple[torch.Tensor, int]:
        batch = collate([train_data[i] for i in parallel.shard(batch_indices(lengths, cfg, step))], device)
        with autocast:
            kl, _ = distill_terms(drafter, target, batch)
        mask = batch["mask"].float()
        return parallel.share((kl * mask).sum(), mask.sum()), int(mask.sum())

    def evaluate() -> dict:
        return held_out(drafter, target, valid_data, device) if valid_data else {}

    final = train_steps(out, drafter, optimizer, state, cfg, lr_at, loss_at, evaluate, parallel, progress=progress,
                        stop_after_s=stop_after_s, stop_at_step=stop_at_step, log=log)
    # the main process alone exports, measures and writes the card (minutes: nobody waits in a collective)
    if final is None or not parallel.main:
        return final
    drafter.eval()
    with writing(final):
        drafter.save_pretrained(final, safe_serialization=True)
        tokenizer.save_pretrained(final)
    figures = None
    if measure and valid_records:
        figures = measure_pair(target, drafter, valid_records, measure_prompts, measure_tokens, log)
    elif measure:
        log(f"not measured: no held-out records in {valid_path(cfg.data)} (make the data with a larger --valid-share)")
    with writing(final):
        (final / "training.json").write_text(json.dumps({"config": asdict(cfg), "state": asdict(state),
                                                         "data": {"file": cfg.data, "target": print_},
                                                         "figures": figures, "processes": parallel.world}, indent=1))
        (final / "README.md").write_text(render_card(cfg, drafter, target, state.history, figures, print_,
                                                     len(train_data), len(valid_records)), encoding="utf-8")
    return final


class _TrainBar:
    """A rich progress bar of steps with the running loss and tokens per second (nothing when off)."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        self.progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("drafter"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.fields[info]}"), console=Console(stderr=True))
            self.task = self.progress.add_task("train", total=total, completed=done, info="")

    def __enter__(self) -> Self:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=f"kl {loss:.3f}, {tokens_per_s:.0f} tokens/s")

    def log(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """``log`` above the bar while it runs."""
        if self.progress is None:
            return log
        return lambda message: self.progress.console.print(message, markup=False, highlight=False)


# ---------------------------------------------------------------------------------- figures, card


def measure_pair(target: PreTrainedModel, drafter: PreTrainedModel, records: Sequence[dict], prompts: int,
                 max_new_tokens: int, log: Callable[[str], None] = print, gamma: int = 4,
                 schedule: ScheduleConfig | None = None) -> dict:
    """Greedy α, τ and speedup over plain decoding of the target, on the held-out prompts (``measure_schedules``
    with one schedule). ``drafter``: any model ``speculative_generate`` drafts with (a block drafter too);
    ``schedule`` (None: the constant ``gamma``) decides how far it drafts, e.g. ``ScheduleConfig("ada", head=...)``."""
    name = "constant" if schedule is None else schedule.schedule
    return measure_schedules(target, drafter, records, prompts, max_new_tokens, {name: schedule}, log, gamma)[name]


def measure_schedules(target: PreTrainedModel, drafter: PreTrainedModel, records: Sequence[dict], prompts: int,
                      max_new_tokens: int, schedules: dict[str, ScheduleConfig | None],
                      log: Callable[[str], None] = print, gamma: int = 4, gammas: dict[str, int] | None = None,
                      repeats: int = 1, results: dict[str, list] | None = None) -> dict[str, dict]:
    """Per schedule (name -> config, None: the constant γ: ``gammas[name]``, else ``gamma``), greedy α, τ and
    speedup over plain decoding of the target on the first ``prompts`` held-out prompts, batch 1, outputs
    compared. After one warm-up of each, every prompt is decoded by every method in turn, each call timed: the
    methods meet the same load (a shared machine drifts), so their speeds compare with each other and with the
    plain runs. ``repeats`` passes over the prompts: each pass gives every method a speed (its tokens over its
    seconds), and the figures are the medians over passes (``spec_tokens_per_s_runs``: each pass's;
    ``prompt_seconds_runs``: each pass's seconds per prompt, for paired comparisons). ``results``, when given,
    receives each method's results of the first pass (name -> one result per prompt; ``plain`` included)."""
    from specdec.decode import autoregressive_generate, speculative_generate

    chosen = [r["prompt_ids"] for r in records][:prompts]
    drafter.eval()
    gammas = gammas or {}

    def run(name: str, ids: list[int], tokens: int):
        if name == "plain":
            return autoregressive_generate(target, ids, max_new_tokens=tokens)
        return speculative_generate(target, drafter, ids, max_new_tokens=tokens, gamma=gammas.get(name, gamma),
                                    schedule=schedules[name])

    names = ["plain", *schedules]
    for name in names:  # warm-up
        run(name, chosen[0], 4)
    rates: dict[str, list[float]] = {name: [] for name in names}  # per pass: tokens/s
    spent: dict[str, list[float]] = {name: [] for name in names}  # per pass: seconds
    per_prompt: dict[str, list[list[float]]] = {name: [] for name in names}  # per pass, per prompt: seconds
    results = {} if results is None else results
    results.update({name: [] for name in names})  # the first pass's results
    for repeat in range(repeats):
        seconds, tokens = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
        for name in names:
            per_prompt[name].append([])
        for ids in chosen:
            for name in names:
                started = time.perf_counter()
                result = run(name, ids, max_new_tokens)
                took = time.perf_counter() - started
                seconds[name] += took
                per_prompt[name][-1].append(round(took, 4))
                tokens[name] += len(result.tokens)
                if repeat == 0:
                    results[name].append(result)
        for name in names:
            rates[name].append(tokens[name] / seconds[name])
            spent[name].append(seconds[name])
    plain = results["plain"]
    plain_rate = statistics.median(rates["plain"])
    out = {}
    for name, schedule in schedules.items():
        spec = results[name]
        drafted = sum(r.stats.drafted for r in spec)
        figures = {
            "prompts": len(chosen), "max_new_tokens": max_new_tokens, "gamma": gammas.get(name, gamma),
            "schedule": "constant" if schedule is None else schedule.schedule, "threads": torch.get_num_threads(),
            "device": str(next(target.parameters()).device), "repeats": repeats,
            "greedy_alpha": round(sum(r.stats.accepted for r in spec) / drafted, 4) if drafted else 0.0,
            "greedy_tau": round(sum(r.stats.new_tokens for r in spec) / max(1, sum(r.stats.rounds for r in spec)), 3),
            "drafted_per_round": round(drafted / max(1, sum(r.stats.rounds for r in spec)), 3),
            "plain_tokens_per_s": round(plain_rate, 1),
            "spec_tokens_per_s": round(statistics.median(rates[name]), 1),
            "spec_tokens_per_s_runs": [round(r, 1) for r in rates[name]],
            "greedy_equal": sum(a.tokens == b.tokens for a, b in zip(plain, spec)),
            "rounds": sum(r.stats.rounds for r in spec), "drafted": drafted,  # a pass's (greedy: every pass's)
            "new_tokens": sum(len(r.tokens) for r in spec), "seconds_runs": [round(t, 4) for t in spent[name]],
            "prompt_seconds_runs": per_prompt[name], "plain_prompt_seconds_runs": per_prompt["plain"],
        }
        figures["speedup"] = round(figures["spec_tokens_per_s"] / figures["plain_tokens_per_s"], 3)
        how = f"gamma {figures['gamma']}" if schedule is None else f"schedule {schedule.schedule}"
        log(f"held-out figures ({figures['prompts']} prompts, {max_new_tokens} new tokens, {how}, greedy"
            + (f", median of {repeats} passes" if repeats > 1 else "") + "): "
            f"alpha {figures['greedy_alpha']:.3f}, tau {figures['greedy_tau']:.2f}, speedup {figures['speedup']:.2f}x "
            f"over plain decoding, outputs equal {figures['greedy_equal']}/{figures['prompts']}"
            + ("" if figures["speedup"] >= 1 else " - this drafter does not pay on this machine"))
        out[name] = figures
    return out


def render_card(cfg: DrafterTrainConfig, drafter: PreTrainedModel, target: PreTrainedModel, history: list[dict],
                figures: dict | None, target_fingerprint: str, records: int, held: int) -> str:
    """The README.md of a drafter: what it is, how it was made, what it measures."""
    c = drafter.config
    n = sum(p.numel() for p in drafter.parameters())
    last = next((h for h in reversed(history) if "train_loss" in h), {})
    val = next((h for h in reversed(history) if "val_kl" in h), {})
    auto = "AutoModelForSeq2SeqLM" if is_encoder_decoder(c) else "AutoModelForCausalLM"
    lines = [
        f"# Drafter for `{cfg.target}`", "",
        (f"A {n / 1e6:.2f}M-parameter `{type(drafter).__name__}` ({getattr(c, _layer_key(c))} decoder layers, width "
         f"{c.hidden_size}) made by `specdec train drafter` to draft for the target `{cfg.target}`: the same "
         f"architecture and tokenizer, so it loads with `{auto}.from_pretrained` and no specdec code."), "",
        "## Recipe", "",
        (f"Start: `{cfg.init}`" + (" (the target's first layers, embeddings and head)." if cfg.init == "first-layers"
                                   else " (fresh layers; token embeddings from the target's"
                                   + (")." if cfg.hidden in (None, target.config.hidden_size)
                                      else ", projected on their top principal directions).")) + " "
         f"Loss: KL(p_target || q_drafter) at every position, the target computed in the same step. AdamW, peak "
         f"learning rate {cfg.lr}, {cfg.warmup_steps} warm-up steps then cosine decay to {cfg.min_lr_ratio:.0%}, "
         f"{cfg.steps} steps of {cfg.batch_size} records (at most {cfg.seq_len} tokens each), seed {cfg.seed}."), "",
        "## Data", "",
        (f"`{cfg.data}`: the target's own continuations of the user's prompts (`specdec data outputs`), {records} "
         f"records trained on, {held} held out in `{valid_path(cfg.data).name}`; target fingerprint "
         f"`{target_fingerprint}`."), "",
        "## Figures", "",
        (f"Last training KL: {_fmt(last.get('train_loss'))} nats/token. Held out: KL {_fmt(val.get('val_kl'))}, "
         f"top-1 agreement with the target {_fmt(val.get('val_agreement'))}."), "",
    ]
    lines += figures_lines(figures) if figures else ["Not measured (`--no-measure`, or no held-out prompts).", ""]
    lines += ["## Use", "", "```", f"specdec generate --target {cfg.target} --drafter PATH_OF_THIS_FOLDER \"...\"",
              "```", ""]
    return "\n".join(lines)


def figures_lines(figures: dict, who: str = "this drafter") -> list[str]:
    """A card's Markdown table of ``measure_pair``'s figures, and whether ``who`` pays."""
    verdict = ("It pays." if figures["speedup"] >= 1 else
               f"**{who[0].upper() + who[1:]} does not pay on this machine**: decoding with it is slower than "
               "plain decoding.")
    how = (f"gamma {figures['gamma']}" if figures.get("schedule", "constant") == "constant"
           else f"schedule {figures['schedule']}")
    return [
        (f"Speculative decoding with {who} on {figures['prompts']} held-out prompts (greedy, {how}, "
         f"{figures['max_new_tokens']} new tokens, batch 1, {figures['device']}, {figures['threads']} threads):"), "",
        "| figure | value |", "|---|---|",
        f"| acceptance rate α | {figures['greedy_alpha']:.3f} |",
        f"| mean accepted length τ (incl. recovered/bonus token) | {figures['greedy_tau']:.2f} |",
        f"| speedup over plain decoding of the target | {figures['speedup']:.2f}x |",
        f"| outputs equal to plain decoding | {figures['greedy_equal']}/{figures['prompts']} |", "", verdict, "",
    ]


def _fmt(v: object) -> str:
    return f"{v:.3f}" if isinstance(v, float) else "n/a"


def block_card(target: str, what: str, recipe: str, data: str, records: int, held: int, target_fingerprint: str,
               figures: dict | None) -> str:
    """The README.md of a block drafter trained for a user's target: what it is, how it was made, what it measures."""
    lines = [f"# Block drafter for `{target}`", "",
             (f"{what}, made by `specdec train block-drafter`: SpecDec's block drafter (Xia et al. 2023), which "
              "drafts a block of tokens from one forward pass."), "",
             "## Recipe", "", recipe, "",
             "## Data", "",
             (f"`{data}`: the target's own continuations of the user's prompts (`specdec data outputs`), {records} "
              f"records, {held} held out in `{valid_path(data).name}`; target fingerprint `{target_fingerprint}`."), "",
             "## Figures", ""]
    lines += (figures_lines(figures, "this block drafter") if figures
              else ["Not measured (`--no-measure`, or no held-out prompts).", ""])
    lines += ["## Use", "", "```", f"specdec generate --target {target} --drafter block:PATH_OF_THIS_FOLDER \"...\"",
              "```", ""]
    return "\n".join(lines)
