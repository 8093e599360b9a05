"""SpecDec's block drafter for an encoder-decoder target (Xia et al., EMNLP 2023 Findings), trained here.

The drafter is a standard transformers encoder-decoder of the target's class (Marian here), so
``AutoModelForSeq2SeqLM`` loads it without specdec; its config's ``block_drafter`` entry
(``mask_token_id``, ``max_block_size``) is what makes ``drafters/block.py`` draft with it. As in
SpecDec, the encoder is deep and the decoder shallow: the drafter starts as a copy of the target
with only its first ``decoder_layers`` decoder layers (encoder, shared embeddings and those layers
initialised from the target), and all of it is trained.

One training row is one (source, the target's greedy translation y, cut p, block size k): the
decoder reads ``[start] + y[:p] + k × mask``; the k block positions, which attend to each other
both ways and causally to the prefix (``cache.causal_mask`` with the block, the mask the drafter gets
when drafting), learn y[p], ..., y[p+k-1] (SpecDec's block loss; positions past the end of y are
not scored), and the prefix positions learn the next token with weight ``prefix_loss`` (a dense
signal for the states the blocks read). Each step draws one k for the batch, uniformly in
1..``max_block_size``, and one p per row, uniformly over y (where the row fits the decoder's
positions). Data: ``specdec train translations`` (sequence-level distillation, as SpecDec
trains on the teacher's outputs), or with ``outputs`` the greedy records of a ``specdec data outputs``
file made with the target from the user's sources (its fingerprint checked; held out: its
``.valid.jsonl``, and with ``measure`` decoding with the drafter is measured there at the end, as
``specdec train drafter`` does); every 50th record is held out for evaluation: the share of
block positions j whose argmax is y[p+j] given the true prefix, and the mean accepted length of a
k = ``max_block_size`` block under greedy verification. The optimizer loop, its records and
checkpoints are ``seq2seq.run_steps``, shared with ``specdec train seq2seq``.

Departures from SpecDec, documented: no glancing (GLAT) and one block per row per step, to keep the
trainer small; the decoder is cached causally over the prefix at drafting time, as the decoder-only
block drafter (``drafters/block_model.py``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, PreTrainedModel

from specdec.cache import causal_mask
from specdec.drafters.block import SEQ2SEQ_BLOCK
from specdec.folders import require_weights
from specdec.seq2seq import decoder_start_id
from specdec.train.checkpoint import writing
from specdec.train.drafter import _layer_key as decoder_layers_key
from specdec.train.drafter import block_card, measure_pair
from specdec.train.outputs import target_data
from specdec.train.parallel import DataParallel
from specdec.train.presets import Seq2SeqBlockConfig
from specdec.train.seq2seq import (
    Example,
    Seq2SeqTrainConfig,
    adamw,
    batch_indices,
    load_examples,
    lr_at,
    resume,
    run_steps,
)

HELD_OUT_EVERY = 50  # every 50th translation record is held out for evaluation


def build_drafter(target: PreTrainedModel, cfg: Seq2SeqBlockConfig, mask_token_id: int) -> PreTrainedModel:
    """The target's class with only its first ``cfg.decoder_layers`` decoder layers, weights copied."""
    config = target.config.__class__.from_dict(target.config.to_dict())
    key = decoder_layers_key(config)
    most = getattr(config, key)
    if not 1 <= cfg.decoder_layers <= most:
        raise ValueError(f"--decoder-layers {cfg.decoder_layers}: the target has {most} decoder layers; give 1..{most}")
    setattr(config, key, cfg.decoder_layers)
    config.dropout = config.attention_dropout = config.activation_dropout = cfg.dropout
    setattr(config, SEQ2SEQ_BLOCK, {"mask_token_id": mask_token_id, "max_block_size": cfg.max_block_size})
    drafter = target.__class__(config)
    _, unexpected = drafter.load_state_dict(target.state_dict(), strict=False)
    if any("decoder.layers" not in k for k in unexpected):
        raise ValueError(f"the target's weights do not fit the drafter: {unexpected[:3]}")
    drafter.tie_weights()
    drafter.generation_config = target.generation_config
    return drafter


@dataclass(frozen=True)
class BlockRows:
    """A padded batch of block rows."""

    input_ids: torch.Tensor  # [B, S] sources
    attention_mask: torch.Tensor  # [B, S]
    decoder_input_ids: torch.Tensor  # [B, T] start + prefix + masks (right-padded)
    decoder_mask: torch.Tensor  # [B, 1, T, T] additive block mask
    prefix_labels: torch.Tensor  # [B, T] next token at prefix positions (-100 elsewhere)
    block_labels: torch.Tensor  # [B, T] y[p+j] at block position j (-100 elsewhere)


def block_rows(examples: list[Example], cuts: list[int], k: int, start: int, mask: int, pad: int) -> BlockRows:
    """Rows ``[start] + y[:p] + k masks`` of ``examples`` at ``cuts`` (p per row)."""
    width_s = max(len(e.src) for e in examples)
    width_t = max(p + 1 + k for p in cuts)
    rows = len(examples)
    source = torch.full((rows, width_s), pad, dtype=torch.long)
    decoder = torch.full((rows, width_t), pad, dtype=torch.long)
    valid = torch.zeros(rows, width_t, dtype=torch.bool)
    block = torch.zeros(rows, width_t, dtype=torch.bool)
    prefix_labels = torch.full((rows, width_t), -100, dtype=torch.long)
    block_labels = torch.full((rows, width_t), -100, dtype=torch.long)
    for r, (e, p) in enumerate(zip(examples, cuts)):
        y = e.tgt
        source[r, : len(e.src)] = torch.tensor(e.src)
        decoder[r, : p + 1] = torch.tensor([start, *y[:p]])
        decoder[r, p + 1 : p + 1 + k] = mask
        valid[r, : p + 1 + k] = True
        block[r, p + 1 : p + 1 + k] = True
        prefix_labels[r, : p + 1] = torch.tensor(y[: p + 1])
        scored = y[p : p + k]
        block_labels[r, p + 1 : p + 1 + len(scored)] = torch.tensor(scored)
    return BlockRows(source, (source != pad).long(), decoder,
                     causal_mask(valid, width_t, torch.float32, block), prefix_labels, block_labels)


def block_logits(model: PreTrainedModel, rows: BlockRows) -> torch.Tensor:
    """[B, T, V] logits of every decoder position."""
    return model(input_ids=rows.input_ids, attention_mask=rows.attention_mask,
                 decoder_input_ids=rows.decoder_input_ids,
                 decoder_attention_mask=rows.decoder_mask.to(model.dtype)).logits


def draw_cuts(examples: list[Example], k: int, positions: int, rng: random.Random) -> list[int]:
    """One cut p per row, uniform over y, where the row (start + p tokens + k masks) fits the decoder's positions."""
    return [rng.randrange(max(1, min(len(e.tgt), positions - k))) for e in examples]


@torch.no_grad()
def evaluate_blocks(model: PreTrainedModel, examples: list[Example], k: int, start: int, mask: int, pad: int,
                    seed: int = 0, batch_size: int = 64) -> dict:
    """Held-out block accuracy by position and the mean accepted length of a k-block (greedy, true prefix)."""
    was_training = model.training
    model.eval()
    cuts = draw_cuts(examples, k, model.config.max_position_embeddings, random.Random(seed))
    hits, counts, accepted = [0] * k, [0] * k, []
    for i in range(0, len(examples), batch_size):
        part, part_cuts = examples[i : i + batch_size], cuts[i : i + batch_size]
        rows = block_rows(part, part_cuts, k, start, mask, pad)
        guess = block_logits(model, rows).argmax(-1)  # [B, T]
        for r, p in enumerate(part_cuts):
            labels = rows.block_labels[r, p + 1 : p + 1 + k].tolist()
            right = [g == t for g, t in zip(guess[r, p + 1 : p + 1 + k].tolist(), labels) if t != -100]
            for j, ok in enumerate(right):
                hits[j] += ok
                counts[j] += 1
            lead = next((j for j, ok in enumerate(right) if not ok), len(right))
            accepted.append(lead)
    model.train(was_training)
    return {"accuracy_by_position": [round(h / c, 4) if c else None for h, c in zip(hits, counts)],
            "accepted_per_block": round(sum(accepted) / max(1, len(accepted)), 4)}


def _greedy_examples(records: list[dict], max_tokens: int) -> list[Example]:
    """The greedy records of a ``specdec data outputs`` file as (source, the target's output) pairs."""
    pairs = [Example(r["prompt_ids"], r["ids"]) for r in records if r["temperature"] == 0]
    return [e for e in pairs if len(e.src) <= max_tokens and 1 < len(e.tgt) <= max_tokens]


def train_seq2seq_block(cfg: Seq2SeqBlockConfig, out_dir: str | Path, device: str = "cpu",
                        stop_after_s: float | None = None, log: Callable[[str], None] = print, *,
                        stop_at_step: int | None = None, measure: bool = False, measure_prompts: int = 20,
                        measure_tokens: int = 64) -> Path | None:
    """Train (or resume) the block drafter. Returns the ``final`` folder, or None when stopped early
    by ``stop_after_s`` or ``stop_at_step`` (a checkpoint is written: call again to resume). With
    ``cfg.outputs`` and ``measure``, the drafter is measured at the end on the held-out sources
    (``measure_pair``), printed and written into ``final/training.json`` and a card ``final/README.md``.
    Under ``torchrun`` / ``accelerate launch``: data parallel (``specdec.train.parallel``), the main process
    writes and measures."""
    parallel = DataParallel.start(device)
    device, log = parallel.device, parallel.log(log)
    out = Path(out_dir)
    torch.manual_seed(cfg.seed)
    own = target_data(cfg.target, cfg.outputs) if cfg.outputs else None  # refuses another target's data first
    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    target = AutoModelForSeq2SeqLM.from_pretrained(require_weights(cfg.target), dtype=torch.float32)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else tokenizer.unk_token_id
    if mask is None:
        raise ValueError("the tokenizer has no unk token to use as the block's mask: pass --mask-token-id")
    pad, start = tokenizer.pad_token_id, decoder_start_id(target)
    data_cfg = Seq2SeqTrainConfig(data=cfg.data, translations=cfg.translations, max_tokens=cfg.max_tokens,
                                  batch_size=cfg.batch_size, seed=cfg.seed, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                                  max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio)
    examples = _greedy_examples(own.records, cfg.max_tokens) if own else load_examples(data_cfg, tokenizer, "train")
    held = _greedy_examples(own.valid, cfg.max_tokens)[: cfg.eval_pairs] if own else []
    if held:  # the data's own held-out share
        train = examples
    else:  # every 50th record
        held = examples[::HELD_OUT_EVERY][: cfg.eval_pairs]
        train = [e for i, e in enumerate(examples) if i % HELD_OUT_EVERY]
    if len(train) < cfg.batch_size:
        raise ValueError(f"{cfg.outputs or cfg.translations} gives {len(train)} usable greedy training pairs, fewer "
                         f"than a batch of {cfg.batch_size}: make more data or give a smaller --batch-size")
    lengths = [len(e.src) + len(e.tgt) for e in train]
    model = build_drafter(target, cfg, mask).to(device)
    if not measure:
        del target
    out.mkdir(parents=True, exist_ok=True)
    parallel.broadcast(model)
    optimizer = adamw(model, cfg.lr, cfg.weight_decay)
    state = resume(out, model, optimizer, log)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"training a {params / 1e6:.2f}M-parameter block drafter ({cfg.decoder_layers} decoder layers, k up to "
        f"{cfg.max_block_size}, mask token {mask}) on {len(train)} translations ({len(held)} held out), "
        f"{cfg.max_steps} steps of {cfg.batch_size}, {torch.get_num_threads()} threads")
    def loss_at(step: int) -> tuple[torch.Tensor, int]:
        part = [train[i] for i in batch_indices(lengths, data_cfg, step)]
        rng = random.Random(cfg.seed * 1_000_003 + step)  # k and cuts: a pure function of the step (exact resume)
        k = rng.randint(1, cfg.max_block_size)
        cuts = draw_cuts(part, k, model.config.max_position_embeddings, rng)  # the whole batch's: rows then shard
        part, cuts = zip(*parallel.shard(list(zip(part, cuts))))
        rows = block_rows(list(part), list(cuts), k, start, mask, pad)
        rows = BlockRows(**{f.name: getattr(rows, f.name).to(device) for f in fields(rows)})
        logits = block_logits(model, rows).flatten(0, 1)  # [B*T, V]

        def mean_ce(labels: torch.Tensor) -> torch.Tensor:  # over the global batch's labelled positions
            loss = F.cross_entropy(logits, labels.flatten(), ignore_index=-100, label_smoothing=cfg.label_smoothing,
                                   reduction="sum")
            return parallel.share(loss, (labels != -100).sum())

        loss = mean_ce(rows.block_labels)
        if cfg.prefix_loss:
            loss = loss + cfg.prefix_loss * mean_ce(rows.prefix_labels)
        return loss, len(part)

    finished = run_steps(out, model, optimizer, state, cfg, lambda step: lr_at(step, data_cfg), loss_at,
                         lambda: evaluate_blocks(model, held, cfg.max_block_size, start, mask, pad, seed=cfg.seed),
                         stop_after_s=stop_after_s, stop_at_step=stop_at_step, log=log, parallel=parallel)
    if not finished:
        return None
    final = out / "final"
    parallel.barrier()  # the main process has written the last checkpoint
    if not parallel.main:  # it alone exports, measures and writes the card
        return final
    model.eval()
    for name in ("dropout", "attention_dropout", "activation_dropout"):
        setattr(model.config, name, 0.0)
    with writing(final):
        model.save_pretrained(final, safe_serialization=True)
        tokenizer.save_pretrained(final)
    figures = None
    if measure and own is not None and own.valid:
        figures = measure_pair(target.to(device), model, own.valid, measure_prompts, measure_tokens, log)
    elif measure and own is not None:
        log("not measured: no held-out records (make the data with a larger --valid-share)")
    record = {"config": asdict(cfg), "state": asdict(state), "processes": parallel.world}
    if own is not None:
        record.update({"data": {"file": cfg.outputs, "target": own.fingerprint}, "figures": figures})
    with writing(final):
        (final / "training.json").write_text(json.dumps(record, indent=1))
        if measure and own is not None:
            n = sum(p.numel() for p in model.parameters())
            c = model.config
            (final / "README.md").write_text(block_card(
                cfg.target, f"A {n / 1e6:.2f}M-parameter `{type(model).__name__}` (the target's encoder, "
                f"{getattr(c, decoder_layers_key(c))} decoder layers, blocks of up to {cfg.max_block_size} tokens; it "
                "loads with `AutoModelForSeq2SeqLM`)",
                f"The target with its first {cfg.decoder_layers} decoder layers, trained on blocks of the target's "
                f"greedy outputs, {cfg.max_steps} steps of {cfg.batch_size} rows, peak learning rate {cfg.lr}, seed "
                f"{cfg.seed}.",
                cfg.outputs, len(train), len(own.valid), own.fingerprint, figures), encoding="utf-8")
    return final
