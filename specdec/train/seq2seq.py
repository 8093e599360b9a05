"""Encoder-decoder training for the shipped translation pair: a Marian target, a drafter distilled from it.

Contract: ``train_seq2seq(cfg, out_dir)`` trains a ``MarianMTModel`` (Junczys-Dowmunt et al. 2018;
the Transformer of Vaswani et al. 2017: post-norm, sinusoidal positions, all embeddings tied) on
a ``specdec data gettext`` corpus folder with the tokenizer of ``specdec train seq2seq-tokenizer``:
cross-entropy with label smoothing on the target side, validation loss every ``eval_every``
steps, a resumable checkpoint every ``save_every`` steps, and, at ``max_steps``, a
``from_pretrained``-loadable model in ``out_dir/final`` (safetensors, config, generation config,
tokenizer) that ``AutoModelForSeq2SeqLM`` loads without specdec. Calling it again on the same
``out_dir`` resumes exactly: the batch of step ``s`` is a pure function of ``seed`` and ``s``.

A drafter is trained by sequence-level knowledge distillation (Kim and Rush 2016; SpecDec, Xia et
al. 2023, trains its drafter on an AR teacher's outputs): ``cfg.translations`` names a file of the
target's greedy translations of the train sources (:func:`write_translations`) that replaces the
references, so the drafter learns what the target writes. :func:`agreement` measures what
matters for speculation: the drafter's teacher-forced top-1 agreement with the target's greedy
outputs. :func:`evaluate` reports BLEU and chrF (sacrebleu) of plain ``model.generate``.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GenerationConfig,
    MarianConfig,
    MarianMTModel,
    PreTrainedTokenizerBase,
)

from specdec.data.gettext import load_pairs
from specdec.folders import require_weights
from specdec.train.checkpoint import (
    append_error,
    drop_unfinished_line,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    untied_state,
    writing,
)
from specdec.train.parallel import DataParallel
from specdec.train.presets import SEQ2SEQ_PRESETS as PRESETS  # noqa: F401 (this module's presets, by their old name)
from specdec.train.presets import Seq2SeqShape, Seq2SeqTrainConfig


@dataclass(frozen=True)
class Example:
    """One tokenized training pair."""

    src: list[int]  # source ids, eos included
    tgt: list[int]  # target ids, eos included (the decoder start token is not)


def load_examples(cfg: Seq2SeqTrainConfig, tokenizer: PreTrainedTokenizerBase, split: str,
                  limit: int | None = None) -> list[Example]:
    """The split's pairs tokenized, in file order; pairs longer than ``cfg.max_tokens`` on either
    side are left out (validation loss is measured in the regime trained on). With ``cfg.translations`` (distillation)
    the train targets are the target's translations, and only the sources it has translated so far are used (a file
    still being written by ``write_translations`` serves as far as it goes)."""
    pairs = load_pairs(cfg.data, split)[:limit]
    if split == "train" and cfg.translations is not None:
        records = read_translations(cfg.translations)
        if not records:
            raise ValueError(f"{cfg.translations} holds no translation: write them with `specdec train translations`")
        for i, r in records.items():
            if i >= len(pairs) or r["src"] != pairs[i].src:
                raise ValueError(f"{cfg.translations} was made from another corpus (record {i}'s source differs)")
        chosen = sorted(records)
        sources = [pairs[i].src for i in chosen]
        targets = [records[i]["ids"] for i in chosen]
    else:
        sources = [p.src for p in pairs]
        targets = tokenizer(text_target=[p.tgt for p in pairs])["input_ids"]
    src_ids = tokenizer(sources)["input_ids"]
    examples = [Example(s, t) for s, t in zip(src_ids, targets)]
    return [e for e in examples if len(e.src) <= cfg.max_tokens and 1 < len(e.tgt) <= cfg.max_tokens]


def build_model(shape: Seq2SeqShape, tokenizer: PreTrainedTokenizerBase, dropout: float = 0.1) -> MarianMTModel:
    """A fresh Marian model of the given shape for this tokenizer (pad = decoder start, as Marian)."""
    config = MarianConfig(
        vocab_size=len(tokenizer), decoder_vocab_size=len(tokenizer), d_model=shape.d_model,
        encoder_layers=shape.encoder_layers, decoder_layers=shape.decoder_layers,
        encoder_attention_heads=shape.attention_heads, decoder_attention_heads=shape.attention_heads,
        encoder_ffn_dim=shape.ffn_dim, decoder_ffn_dim=shape.ffn_dim,
        max_position_embeddings=shape.max_position_embeddings,
        dropout=dropout, attention_dropout=dropout, activation_dropout=dropout,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id, forced_eos_token_id=None,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True, scale_embedding=True,
    )
    return MarianMTModel(config)


def generation_config(tokenizer: PreTrainedTokenizerBase, max_length: int = 512) -> GenerationConfig:
    """Plain greedy decoding up to ``max_length`` tokens: what ``generate`` does by default."""
    return GenerationConfig(
        decoder_start_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, max_length=max_length, num_beams=1, do_sample=False,
    )


def epoch_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's batches of example indices: shuffled, grouped by length within windows of
    50 batches (less padding), batches in shuffled order. A pure function of its arguments."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = batch_size * 50
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def batch_indices(lengths: Sequence[int], cfg: Seq2SeqTrainConfig, step: int) -> list[int]:
    """The example indices of training step ``step`` (0-based)."""
    per_epoch = math.ceil(len(lengths) / cfg.batch_size)
    return epoch_batches(lengths, cfg.batch_size, cfg.seed, step // per_epoch)[step % per_epoch]


def collate(examples: Sequence[Example], pad: int) -> dict[str, torch.Tensor]:
    """Padded tensors: input_ids, attention_mask [B, S]; labels [B, T] (-100 at padding)."""
    width_s = max(len(e.src) for e in examples)
    width_t = max(len(e.tgt) for e in examples)
    input_ids = torch.full((len(examples), width_s), pad, dtype=torch.long)  # [B, S]
    labels = torch.full((len(examples), width_t), -100, dtype=torch.long)  # [B, T]
    for i, e in enumerate(examples):
        input_ids[i, : len(e.src)] = torch.tensor(e.src)
        labels[i, : len(e.tgt)] = torch.tensor(e.tgt)
    return {"input_ids": input_ids, "attention_mask": (input_ids != pad).long(), "labels": labels}


def lr_at(step: int, cfg: Seq2SeqTrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Teacher-forced logits [B, T, V]: the decoder reads [start, labels[:-1]] (Marian's shift)."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).logits


@torch.no_grad()
def validation_loss(model, examples: Sequence[Example], pad: int, batch_size: int = 64) -> float:
    """Mean token cross-entropy (nats, no smoothing) of ``examples``' targets, eos included."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        batch = collate(examples[i : i + batch_size], pad)
        logits = _logits(model, batch)  # [B, T, V]
        total += F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                                 reduction="sum").item()
        count += int((batch["labels"] != -100).sum())
    model.train(was_training)
    return total / max(1, count)


@dataclass
class TrainState:
    """What a checkpoint records besides weights and optimizer."""

    step: int = 0
    seconds: float = 0.0  # training wall time so far, across resumes
    history: list = field(default_factory=list)  # [{"step", "train_loss", "val_loss", "lr", "pairs_per_s"}]


def adamw(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over an encoder-decoder: weight decay on matrices (not the position table), none on the rest."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed_positions" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))


def save_run_checkpoint(out: Path, model, optimizer, state: TrainState, config: object) -> None:
    """``out/checkpoint`` of an encoder-decoder run (``config``: the run's dataclass)."""
    def write_model(folder: Path) -> None:  # the tied copies of the shared embedding are left out
        save_file(untied_state(model), str(folder / "model.safetensors"))

    save_checkpoint(out / "checkpoint", write_model, optimizer, state, asdict(config))


def resume(out: Path, model, optimizer, log: Callable[[str], None]) -> TrainState:
    """The run's state from ``out/checkpoint`` (weights and optimizer loaded), or a fresh one."""
    if latest_checkpoint(out / "checkpoint") is None:
        return TrainState()
    state = load_checkpoint(out / "checkpoint", model, optimizer, TrainState)
    log(f"resumed {out} at step {state.step}")
    return state


@torch.enable_grad()  # whatever grad mode the caller left (a library call, a test process) trains
def run_steps(out: Path, model, optimizer, state: TrainState, cfg, lr: Callable[[int], float],
              loss_at: Callable[[int], tuple[torch.Tensor, int]], evaluate: Callable[[], dict],
              stop_after_s: float | None = None, stop_at_step: int | None = None,
              log: Callable[[str], None] = print, stop: Callable[[], bool] | None = None,
              on_step: Callable[[int, float, float], None] | None = None, unit: str = "pairs",
              parallel: DataParallel | None = None) -> bool:
    """The optimizer loop of the encoder-decoder trainers, from ``state.step`` to ``cfg.max_steps``.

    Each step sets the learning rate ``lr(step)``, takes ``loss_at(step)`` -> (loss, pairs in the
    batch), clips the gradient to ``cfg.grad_clip`` and steps. Every 20 steps a record of the mean
    train_loss, lr and pairs_per_s; every ``cfg.eval_every`` steps ``evaluate()``'s figures; both go
    to ``state.history`` and the log. A checkpoint (``save_run_checkpoint``) every ``cfg.save_every``
    steps and at the end. Returns False when stopped early by ``stop_after_s``, ``stop_at_step`` or
    ``stop()`` turning true (a checkpoint written: the run resumes from it), True once ``cfg.max_steps``
    is reached. ``on_step(step, mean loss, units per second)`` hears of each step (a progress bar), both
    over the steps since the last record; ``loss_at``'s count is of ``unit`` (records say ``<unit>_per_s``).
    Data parallel (``parallel``, see ``specdec.train.parallel``): ``loss_at`` returns this process's
    share of the global batch's loss (its rows, ``parallel.share``) and its own count; gradients, loss
    and counts are summed over the processes, the main process alone evaluates, logs and writes the
    checkpoints, and all stop at the same step."""
    parallel = parallel or DataParallel()
    log = parallel.log(log)
    started = time.perf_counter()
    seconds_before = state.seconds
    window = {"t": time.perf_counter(), "loss": 0.0, "n": 0, "pairs": 0}
    model.train()
    while state.step < cfg.max_steps:
        step = state.step
        for group in optimizer.param_groups:
            group["lr"] = lr(step)
        loss, pairs = loss_at(step)
        loss.backward()
        parallel.sync_gradients(model.parameters())
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.seconds = seconds_before + time.perf_counter() - started
        step_loss, pairs = parallel.sum(loss.detach(), pairs)  # the global batch's loss and size
        window["loss"] += step_loss
        window["n"] += 1
        window["pairs"] += pairs
        if on_step is not None:
            on_step(state.step, window["loss"] / window["n"], window["pairs"] / (time.perf_counter() - window["t"]))
        record = None
        if state.step % 20 == 0 or state.step == cfg.max_steps:
            record = {"step": state.step, "train_loss": round(window["loss"] / window["n"], 4),
                      "lr": round(lr(step), 6),
                      f"{unit}_per_s": round(window["pairs"] / (time.perf_counter() - window["t"]), 1)}
            window = {"t": time.perf_counter(), "loss": 0.0, "n": 0, "pairs": 0}
        if state.step % cfg.eval_every == 0 or state.step == cfg.max_steps:
            record = record or {"step": state.step}
            if parallel.main:
                record.update(evaluate())
        if record is not None:
            record["elapsed_s"] = round(state.seconds)
            state.history.append(record)
            log(f"[{out.name}] step {state.step}/{cfg.max_steps} "
                + " ".join(f"{k}={v}" for k, v in record.items() if k != "step"))
        if parallel.main and (state.step % cfg.save_every == 0 or state.step == cfg.max_steps):
            save_run_checkpoint(out, model, optimizer, state, cfg)
        out_of_time = stop_after_s is not None and time.perf_counter() - started > stop_after_s
        stopping = parallel.any(out_of_time or state.step == stop_at_step or (stop is not None and stop()))
        if stopping and state.step < cfg.max_steps:
            if parallel.main:
                save_run_checkpoint(out, model, optimizer, state, cfg)
            parallel.barrier()
            log(f"stopped at step {state.step}; run again to resume")
            return False
    return True


def train_seq2seq(cfg: Seq2SeqTrainConfig, out_dir: str | Path, device: str = "cpu",
                  stop_after_s: float | None = None, stop_at_step: int | None = None,
                  log: Callable[[str], None] = print) -> Path | None:
    """Train (or resume) one encoder-decoder. Returns the ``final`` folder once ``max_steps`` is
    reached, else None (stopped by ``stop_after_s`` or ``stop_at_step`` with a checkpoint
    written: call again to resume). Under ``torchrun`` / ``accelerate launch``: data parallel
    (``specdec.train.parallel``), the main process writes."""
    parallel = DataParallel.start(device)
    device, log = parallel.device, parallel.log(log)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    pad = tokenizer.pad_token_id
    train_examples = load_examples(cfg, tokenizer, "train")
    val_examples = load_examples(cfg, tokenizer, "validation", limit=cfg.eval_pairs)
    if len(train_examples) < cfg.batch_size:
        raise ValueError(f"{cfg.data} has {len(train_examples)} usable train pairs, fewer than a batch of "
                         f"{cfg.batch_size}")
    lengths = [len(e.src) + len(e.tgt) for e in train_examples]
    model = build_model(cfg.shape, tokenizer, cfg.dropout)
    if cfg.init_from is not None:
        model = AutoModelForSeq2SeqLM.from_pretrained(require_weights(cfg.init_from), dtype=torch.float32)
        if model.config.vocab_size != len(tokenizer):
            raise ValueError(f"--init-from {cfg.init_from} has vocabulary {model.config.vocab_size}, "
                             f"the tokenizer {len(tokenizer)}: use the tokenizer it was trained with")
    model = model.to(device)
    parallel.broadcast(model)
    optimizer = adamw(model, cfg.lr, cfg.weight_decay)
    state = resume(out, model, optimizer, log)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"training {n_params / 1e6:.2f}M parameters on {len(train_examples)} pairs "
        f"({sum(len(e.tgt) for e in train_examples) / 1e6:.2f}M target tokens, "
        f"{'the target translations ' + cfg.translations if cfg.translations else 'references'}), "
        f"{cfg.max_steps} steps of {cfg.batch_size} pairs, device {device}, {torch.get_num_threads()} threads"
        + (f", {parallel.world} processes" if parallel.world > 1 else ""))
    def loss_at(step: int) -> tuple[torch.Tensor, int]:
        batch = collate([train_examples[i] for i in parallel.shard(batch_indices(lengths, cfg, step))], pad)
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = _logits(model, batch)  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                               label_smoothing=cfg.label_smoothing, reduction="sum")
        return parallel.share(loss, (batch["labels"] != -100).sum()), batch["input_ids"].shape[0]

    finished = run_steps(out, model, optimizer, state, cfg, lambda step: lr_at(step, cfg), loss_at,
                         lambda: {"val_loss": round(validation_loss(model, val_examples, pad), 4)},
                         stop_after_s=stop_after_s, stop_at_step=stop_at_step, log=log, parallel=parallel)
    if not finished:
        return None
    final = out / "final"
    if parallel.main:
        model.eval()
        model.generation_config = generation_config(tokenizer, cfg.shape.max_position_embeddings)
        with writing(final):
            model.save_pretrained(final, safe_serialization=True)
            tokenizer.save_pretrained(final)
            (final / "training.json").write_text(json.dumps({"config": asdict(cfg), "state": asdict(state),
                                                             "processes": parallel.world}, indent=1))
    parallel.barrier()
    return final


def export(src: str | Path, dst: str | Path, dtype: str = "bf16") -> Path:
    """Copy a trained encoder-decoder to ``dst`` in a shipping dtype (safetensors, config,
    generation config, tokenizer, and its training record)."""
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype not in dtypes:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(dtypes)}")
    model = AutoModelForSeq2SeqLM.from_pretrained(require_weights(src), dtype=dtypes[dtype])
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(dst)
    if (Path(src) / "training.json").is_file():
        shutil.copy(Path(src) / "training.json", dst / "training.json")
    return dst


# ------------------------------------------------------------------------- translations (distillation)


def read_translations(path: str | Path) -> dict[int, dict]:
    """Index -> record of a translations file, after dropping an unfinished last line (an
    interrupted write: that batch is translated again)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no translations at {path}: write them with `specdec train translations`")
    text = drop_unfinished_line(path).decode("utf-8")
    records = (json.loads(line) for line in text.splitlines() if line.strip())
    return {r["i"]: r for r in records}


def _load_for_inference(model_dir: str | Path, device: str):
    model = (AutoModelForSeq2SeqLM.from_pretrained(require_weights(model_dir))
             .to(device=device, dtype=torch.float32).eval())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return model, tokenizer


@torch.inference_mode()
def translate(model, tokenizer, sources: Sequence[str], num_beams: int = 1, batch_size: int = 64,
              max_new_tokens: int = 512, on_batch: Callable[[list[int], list[list[int]]], None] | None = None
              ) -> list[list[int]]:
    """``model.generate`` on ``sources`` in batches of similar length; returns, in input order,
    each translation's ids without the decoder start token, cut after the first eos."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    results: list[list[int] | None] = [None] * len(sources)
    eos = tokenizer.eos_token_id
    max_new_tokens = min(max_new_tokens, model.config.max_position_embeddings - 1)  # the position table's end
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        enc = tokenizer([sources[i] for i in idx], return_tensors="pt", padding=True,
                        truncation=True, max_length=model.config.max_position_embeddings).to(model.device)
        out = model.generate(**enc, num_beams=num_beams, do_sample=False, max_new_tokens=max_new_tokens)
        batch_ids = []
        for j, i in enumerate(idx):
            ids = out[j, 1:].tolist()  # [T] without the decoder start token
            ids = ids[: ids.index(eos) + 1] if eos in ids else ids
            results[i] = ids
            batch_ids.append(ids)
        if on_batch is not None:
            on_batch(idx, batch_ids)
    return results  # type: ignore[return-value]


def write_translations(model_dir: str | Path, data: str | Path, out: str | Path, split: str = "train",
                       batch_size: int = 64, chunk: int = 2048, device: str = "cpu",
                       log: Callable[[str], None] = print) -> int:
    """Append the model's greedy translations of ``split``'s sources to ``out`` as JSON lines
    ``{"i", "src", "tgt", "ids", "catalogue"}`` (``i`` = the pair's index in the split file,
    ``ids`` = translation ids, eos included, decoder start excluded; ``tgt`` = their text).
    Sources go in a fixed shuffled order, ``chunk`` at a time (batched by length within a
    chunk), so a file cut short is a uniform sample of the split. Resumes: indices already in
    ``out`` are skipped. Returns how many records ``out`` holds."""
    if split == "test":
        raise ValueError("the test split is held out for evaluation: translate train or validation")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pairs = load_pairs(data, split)
    done = read_translations(out) if out.exists() else {}
    order = list(range(len(pairs)))
    random.Random(0).shuffle(order)
    todo = [i for i in order if i not in done]
    log(f"{len(pairs)} {split} sources, {len(done)} already in {out}, {len(todo)} to translate")
    model, tokenizer = _load_for_inference(model_dir, device)
    started, count = time.perf_counter(), 0
    with out.open("a", encoding="utf-8") as f:
        for start in range(0, len(todo), chunk):
            part = todo[start : start + chunk]
            ids = translate(model, tokenizer, [pairs[i].src for i in part], batch_size=batch_size)
            for i, t in zip(part, ids):
                record = {"i": i, "src": pairs[i].src, "tgt": tokenizer.decode(t, skip_special_tokens=True),
                          "ids": t, "catalogue": pairs[i].catalogue}
                try:
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
                except OSError as err:  # a full disk: the part line is dropped when the run resumes
                    raise append_error(out, err) from err
            try:
                f.flush()
            except OSError as err:
                raise append_error(out, err) from err
            count += len(part)
            log(f"translated {count}/{len(todo)} ({count / (time.perf_counter() - started):.1f} sources/s)")
    return len(read_translations(out))


# ------------------------------------------------------------------------------------------ evaluation


@dataclass(frozen=True)
class Quality:
    """Translation quality of one decoding on one split."""

    split: str
    num_beams: int
    sentences: int
    bleu: float  # sacrebleu corpus BLEU (13a tokenization)
    chrf: float  # sacrebleu chrF (character 6-grams, beta 2)
    seconds: float  # wall time of generate over the split


def evaluate(model_dir: str | Path, data: str | Path, split: str = "test", beams: Sequence[int] = (1, 5),
             batch_size: int = 64, limit: int | None = None, device: str = "cpu",
             hypotheses_dir: str | Path | None = None) -> list[Quality]:
    """BLEU and chrF of plain ``model.generate`` (greedy and beam search) against the references."""
    import sacrebleu

    pairs = load_pairs(data, split)[:limit]
    model, tokenizer = _load_for_inference(model_dir, device)
    refs = [p.tgt for p in pairs]
    results = []
    for n in beams:
        t = time.perf_counter()
        ids = translate(model, tokenizer, [p.src for p in pairs], num_beams=n, batch_size=batch_size)
        seconds = time.perf_counter() - t
        hyps = tokenizer.batch_decode(ids, skip_special_tokens=True)
        if hypotheses_dir is not None:
            Path(hypotheses_dir).mkdir(parents=True, exist_ok=True)
            (Path(hypotheses_dir) / f"{split}.beam{n}.txt").write_text(
                "".join(json.dumps(h, ensure_ascii=False) + "\n" for h in hyps), encoding="utf-8")
        results.append(Quality(split, n, len(pairs), round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
                               round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2), round(seconds, 1)))
    return results


@torch.inference_mode()
def agreement(drafter_dir: str | Path, translations: str | Path, batch_size: int = 64,
              device: str = "cpu") -> dict[str, float]:
    """Teacher-forced top-1 agreement of a drafter with the target's greedy translations: the share
    of positions (eos included) where the drafter's argmax, given the source and the target's
    prefix, is the target's next token; also the mean run of agreeing tokens from each sentence's
    start (a rough bound on what one round could accept)."""
    model, tokenizer = _load_for_inference(drafter_dir, device)
    records = list(read_translations(translations).values())
    src_ids = tokenizer([r["src"] for r in records], truncation=True,
                        max_length=model.config.max_position_embeddings)["input_ids"]
    examples = [Example(s, r["ids"]) for s, r in zip(src_ids, records) if r["ids"]]
    agree, total, prefix = 0, 0, 0
    for i in range(0, len(examples), batch_size):
        batch = collate(examples[i : i + batch_size], tokenizer.pad_token_id)
        batch = {k: v.to(model.device) for k, v in batch.items()}
        pred = _logits(model, batch).argmax(-1)  # [B, T]
        live = batch["labels"] != -100  # [B, T]
        hit = (pred == batch["labels"]) & live  # [B, T]
        agree += int(hit.sum())
        total += int(live.sum())
        prefix += int(hit.long().cumprod(-1).sum())
    return {"sentences": len(examples), "positions": total, "top1_agreement": round(agree / max(1, total), 4),
            "mean_agreeing_prefix": round(prefix / max(1, len(examples)), 2)}
