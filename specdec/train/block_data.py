"""SpecDec's block drafter, training data: its records, packed batches, glancing choices and loss.

Follows SpecDec (Xia et al., EMNLP 2023 Findings) and its released training: the labels of a
block are the target's own greedy continuation (distillation), a block is cut at a random place of
it, the loss covers the block positions that hold a real token (end of text included, nothing past
it), label smoothing 0.1, and glancing (GLAT, Qian et al. 2021): a no-grad pass predicts the block,
then ``floor(wrong * ratio)`` of its labelled positions, chosen uniformly, read their gold token as
input and leave the loss; the ratio falls linearly from ``glancing_start`` to ``glancing_end``.

Ours on top (see ``specdec.drafters.block_model``): the prefix is causal, so one training sequence
carries ``ceil(block_tokens / k)`` blocks at once (``BlockLayout.packed``), each seeing exactly the
cached-prefix states it sees when drafting; the block size k of a step is drawn uniformly from
``1..max_block_size``, so every k up to the maximum is trained; the drafting head covers the
``draft_vocab_size`` tokens the target writes most often (FR-Spec, Zhao et al. 2025); optionally each
block reads the target's last hidden state (``condition_on_target``), precomputed once per record.

Contract: the batch and the glancing choices of step ``s`` are a pure function of ``seed`` and ``s``
(``step_generator``), which is what lets ``specdec.train.block``'s resumed run equal an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdec.drafters.block_model import BlockDrafterModel, BlockLayout
from specdec.train.parallel import DataParallel
from specdec.train.presets import BlockTrainConfig

IGNORE = -100  # label of a position without loss


@dataclass(frozen=True)
class Record:
    """One prompt with the target's greedy continuation."""

    ids: torch.Tensor  # [T] long: prompt then continuation
    prompt_len: int  # P: the continuation starts at ids[P]


@dataclass(frozen=True)
class BlockBatch:
    """One step's packed training input (``BlockLayout.packed``)."""

    input_ids: torch.Tensor  # [B, T + m k] prefix tokens, then each block's gold tokens (read only where revealed)
    live: torch.Tensor  # [B, T + m k] bool: prefix padding is dead
    layout: BlockLayout  # which positions are blocks and what they see
    position_ids: torch.Tensor  # [B, T + m k]
    labels: torch.Tensor  # [B, T + m k] long, IGNORE outside blocks and past a record's end
    next_tokens: torch.Tensor  # [B, T] long: each prefix token's successor (IGNORE at the end and on padding)
    target_hidden: torch.Tensor | None  # [B, T + m k, H_t] at block positions (zeros elsewhere), or None
    block_size: int  # k of this step
    drawn: int = 0  # rows of the step's whole batch (all processes) that its random draws cover; 0: these B
    own: tuple[int, int] = (0, 1)  # (first, stride): this process's rows of the whole batch (rank, processes)


def load_records(path: str | Path, records: int | None = None) -> list[Record]:
    """The temperature-0 records of a ``specdec data outputs`` (or ``specdec train outputs``) file (its first
    ``records`` lines)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no generated outputs at {path}: write them with `specdec data outputs` (or "
                                "`specdec train outputs`)")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if records is not None and records > len(lines):
        raise ValueError(f"{path} holds {len(lines)} records, fewer than the {records} asked for")
    out = []
    for line in lines[:records]:
        r = json.loads(line)
        if r["temperature"] == 0 and r["ids"] and r["prompt_ids"]:
            out.append(Record(torch.tensor(r["prompt_ids"] + r["ids"], dtype=torch.long), len(r["prompt_ids"])))
    if not out:
        raise ValueError(f"{path} has no greedy (temperature 0) records: generate more prompts, or with a smaller "
                         "--sampled-share (--sampled-every for `specdec train outputs`)")
    return out


def draft_vocabulary(records: list[Record], size: int, always: list[int]) -> torch.Tensor:
    """The ``size`` tokens most frequent in the continuations (ties by id), ``always`` included. [size]"""
    counts = Counter()
    for r in records:
        counts.update(r.ids[r.prompt_len :].tolist())
    chosen = list(dict.fromkeys(always))
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if token not in chosen:
            chosen.append(token)
    token = 0
    while len(chosen) < size:  # fewer distinct tokens than rows: fill with unused ids
        if token not in chosen:
            chosen.append(token)
        token += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


# ---- target hidden states ------------------------------------------------------------------------

HIDDEN_SPAN = 64  # continuation positions whose hidden state is stored per record


@torch.no_grad()
def target_hidden_states(target, records: list[Record], batch_size: int = 16) -> torch.Tensor:
    """For each record and each anchor ``a = P - 1 + j`` (j < ``HIDDEN_SPAN``: the block follows
    ``ids[a]``), the target's last hidden state at position ``a - 1``: the one whose logits produced
    ``ids[a]``, as the round loop has it after verification. Zeros where there is none. [N, HIDDEN_SPAN, H_t] bf16"""
    width = target.config.get_text_config().hidden_size
    out = torch.zeros(len(records), HIDDEN_SPAN, width, dtype=torch.bfloat16)
    order = sorted(range(len(records)), key=lambda i: len(records[i].ids))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        longest = max(len(records[i].ids) for i in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, : len(records[i].ids)] = records[i].ids
            mask[row, : len(records[i].ids)] = 1
        hidden = target(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]  # [b, T, H]
        for row, i in enumerate(chunk):
            p, t = records[i].prompt_len, len(records[i].ids)
            first = max(0, 2 - p)  # anchor j reads hidden[p - 2 + j]
            last = min(HIDDEN_SPAN - 1, t - p - 1)  # the last anchor is t - 2
            out[i, first : last + 1] = hidden[row, p - 2 + first : p - 1 + last].to(torch.bfloat16)
    return out


def cached_hidden_states(target, records: list[Record], path: Path, log=print) -> torch.Tensor:
    """``target_hidden_states`` of ``records``, computed once and kept in ``path`` (safetensors)."""
    if path.is_file():
        stored = load_file(str(path))["hidden"]
        if stored.shape[0] == len(records):
            return stored
        log(f"{path} holds {stored.shape[0]} records, not {len(records)}: computing again")
    started = time.perf_counter()
    hidden = target_hidden_states(target, records)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # atomic: data parallel processes write it at once
    save_file({"hidden": hidden.contiguous()}, str(tmp))
    os.replace(tmp, path)
    log(f"target hidden states of {len(records)} records in {time.perf_counter() - started:.0f} s -> {path}")
    return hidden




# ---- batches -------------------------------------------------------------------------------------


def glancing_ratio(step: int, cfg: BlockTrainConfig) -> float:
    """Linear from ``glancing_start`` at step 0 to ``glancing_end`` at ``max_steps``."""
    progress = min(1.0, step / max(1, cfg.max_steps))
    return cfg.glancing_start + (cfg.glancing_end - cfg.glancing_start) * progress


def step_generator(step: int, seed: int) -> torch.Generator:
    """The random source of one step (its batch, then its glancing choices)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def pack_blocks(records: list[Record], anchors: list[torch.Tensor], block_size: int, seq_len: int,
                hidden: list[torch.Tensor | None] | None = None) -> BlockBatch:
    """Pack each record's prefix (cropped on the left to ``seq_len``) and one block per anchor.

    ``anchors[b]`` [m]: indices (into ``records[b].ids``) of the last prefix token before each
    block, all in the continuation's range ``P - 1 .. T - 2`` and within the kept prefix.
    ``hidden[b]`` [m, H_t] (optional): the target hidden state each block reads."""
    m, k = len(anchors[0]), block_size
    starts = [min(max(0, len(r.ids) - seq_len), r.prompt_len - 1) for r in records]
    width = max(len(r.ids) - s for r, s in zip(records, starts))
    batch = len(records)
    prefix = torch.zeros(batch, width, dtype=torch.long)
    live_prefix = torch.zeros(batch, width, dtype=torch.bool)
    cuts = torch.zeros(batch, m, dtype=torch.long)
    labels_block = torch.full((batch, m, k), IGNORE, dtype=torch.long)
    for b, (r, s, a) in enumerate(zip(records, starts, anchors)):
        ids = r.ids[s:]
        prefix[b, : len(ids)] = ids
        live_prefix[b, : len(ids)] = True
        cuts[b] = a - s
        follow = (a - s)[:, None] + 1 + torch.arange(k)  # [m, k] indices of the labels in ids
        known = follow < len(ids)
        labels_block[b][known] = ids[follow[known]]
    layout = BlockLayout.packed(width, cuts, k)
    labels = torch.cat([torch.full((batch, width), IGNORE, dtype=torch.long), labels_block.view(batch, m * k)], 1)
    input_ids = torch.cat([prefix, labels_block.view(batch, m * k).clamp_min(0)], 1)
    live = torch.cat([live_prefix, torch.ones(batch, m * k, dtype=torch.bool)], 1)
    target_hidden = None
    if hidden is not None:
        h_t = next(h.shape[-1] for h in hidden if h is not None)
        target_hidden = torch.zeros(batch, width + m * k, h_t)
        for b, h in enumerate(hidden):
            if h is not None:
                target_hidden[b, width:] = h.float().repeat_interleave(k, dim=0)
    next_tokens = torch.where(live_prefix[:, 1:], prefix[:, 1:], IGNORE)  # [B, T - 1]
    next_tokens = torch.cat([next_tokens, torch.full((batch, 1), IGNORE, dtype=torch.long)], 1)
    return BlockBatch(input_ids, live, layout, layout.packed_positions(), labels, next_tokens, target_hidden, k)


def batch_at(records: list[Record], step: int, cfg: BlockTrainConfig,
             hidden: torch.Tensor | None = None, gen: torch.Generator | None = None,
             own: slice = slice(None)) -> BlockBatch:
    """The training batch of ``step``: a pure function of ``cfg.seed`` and ``step`` (and the data);
    with ``own``, those rows of it (the whole batch is drawn, so N processes draw as one)."""
    gen = gen or step_generator(step, cfg.seed)
    k = int(torch.randint(1, cfg.max_block_size + 1, (1,), generator=gen))
    m = -(-cfg.block_tokens // k)  # blocks per sequence
    picks = torch.randint(0, len(records), (cfg.batch_size,), generator=gen).tolist()
    chosen, anchors, block_hidden = [], [], []
    for i in picks:
        r = records[i]
        p, t = r.prompt_len, len(r.ids)
        a = torch.randint(p - 1, t - 1, (m,), generator=gen)  # [m]
        drop = torch.rand(m, generator=gen) < cfg.hidden_dropout  # [m]
        chosen.append(r)
        anchors.append(a)
        if hidden is not None:
            slot = (a - p + 1).clamp(0, HIDDEN_SPAN - 1)  # anchor slot: the hidden that produced ids[a]
            h = hidden[i][slot].float()  # [m, H_t]
            h[drop | (a - p + 1 >= HIDDEN_SPAN)] = 0.0
            block_hidden.append(h)
    batch = pack_blocks(chosen[own], anchors[own], k, cfg.seq_len, block_hidden[own] if hidden is not None else None)
    return batch if own == slice(None) else replace(batch, drawn=cfg.batch_size, own=(own.start or 0, own.step or 1))


def glance(batch: BlockBatch, predictions: torch.Tensor, ratio: float, gen: torch.Generator) -> torch.Tensor:
    """GLAT's choice: in each block, ``floor(wrong * ratio)`` of its labelled positions, uniformly at
    random, get revealed (their gold token as input, no loss). Returns ``revealed`` [B, n] bool."""
    batch_size, n = batch.labels.shape
    k = batch.block_size
    start = n - (batch.layout.block >= 0).sum(1).max().item()
    labels = batch.labels[:, start:].reshape(batch_size, -1, k)  # [B, m, k]
    pred = predictions[:, start:].reshape(batch_size, -1, k)  # [B, m, k]
    labelled = labels != IGNORE
    wrong = ((pred != labels) & labelled).sum(-1)  # [B, m]
    reveal_n = torch.floor(wrong.float() * ratio).long()  # [B, m]
    scores = torch.rand((batch.drawn or batch_size, *labels.shape[1:]), generator=gen)[batch.own[0] :: batch.own[1]]
    scores = scores.masked_fill(~labelled, 2.0)  # unlabelled last
    rank = scores.argsort(-1).argsort(-1)  # [B, m, k] position's rank among its block
    revealed = (rank < reveal_n[..., None]) & labelled
    return torch.cat([torch.zeros(batch_size, start, dtype=torch.bool), revealed.view(batch_size, -1)], 1)


# ---- loss ----------------------------------------------------------------------------------------------


def head_labels(model: BlockDrafterModel, labels: torch.Tensor) -> torch.Tensor:
    """Labels as rows of the drafting head (IGNORE where the token has no row). [B, n]"""
    if model.config.draft_vocab_size == 0:
        return labels
    row_of = torch.full((model.config.vocab_size,), IGNORE, dtype=torch.long)
    row_of[model.draft_vocab] = torch.arange(len(model.draft_vocab))
    return torch.where(labels >= 0, row_of[labels.clamp_min(0)], IGNORE)


def block_forward(model: BlockDrafterModel, batch: BlockBatch, revealed: torch.Tensor | None = None,
                  head_logits: bool = True, prefix: bool = False) -> torch.Tensor:
    """Logits of every block position of a packed batch [B, m k, V or head rows]; with ``prefix``,
    of every position [B, T + m k, ...]."""
    n_block = int((batch.layout.block >= 0).sum(1).max())
    out = model(input_ids=batch.input_ids, attention_mask=batch.live.long(), position_ids=batch.position_ids,
                layout=batch.layout, revealed=revealed, target_hidden=batch.target_hidden,
                logits_to_keep=0 if prefix else n_block, head_logits=head_logits)
    return out.logits


def glancing_loss(model: BlockDrafterModel, batch: BlockBatch, ratio: float, gen: torch.Generator,
                  label_smoothing: float, autocast: bool, prefix_weight: float = 0.0,
                  share: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """One glancing step's loss: predict, reveal, predict again with grad; returns (loss, figures).

    loss = cross-entropy on the unrevealed labelled block positions + ``prefix_weight`` x the
    next-token cross-entropy at the prefix positions (through the same head). Each mean, the
    figures' too, is ``share(sum, count)``: by default ``sum / count``; data parallel, this process's
    share of the whole batch's mean (``DataParallel.share``: the shares add up to it)."""
    share = share or DataParallel().share
    n_block = int((batch.layout.block >= 0).sum(1).max())
    rows = head_labels(model, batch.labels)[:, -n_block:]  # [B, m k] head rows of the labels
    gold = batch.labels[:, -n_block:]  # [B, m k] token ids
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.no_grad():
            drafts = model.draft_vocab[block_forward(model, batch).argmax(-1)]  # [B, m k] token ids
        predictions = torch.full_like(batch.labels, IGNORE)
        predictions[:, -n_block:] = drafts
        revealed = glance(batch, predictions, ratio, gen)  # [B, n]
        logits = block_forward(model, batch, revealed, prefix=prefix_weight > 0).float()  # [B, n or m k, R]
    target = rows.masked_fill(revealed[:, -n_block:], IGNORE)
    loss = share(F.cross_entropy(logits[:, -n_block:].flatten(0, 1), target.flatten(), ignore_index=IGNORE,
                                 label_smoothing=label_smoothing, reduction="sum"), (target != IGNORE).sum())
    labelled = (gold != IGNORE).sum()
    figures = {"block_loss": loss.item(),
               "accuracy": share(((drafts == gold) & (gold != IGNORE)).sum(), labelled).item(),
               "revealed": share(revealed.sum(), labelled).item()}
    if prefix_weight > 0:
        width = batch.next_tokens.shape[1]
        next_rows = head_labels(model, batch.next_tokens)  # [B, T]
        prefix_loss = share(F.cross_entropy(logits[:, :width].flatten(0, 1), next_rows.flatten(), ignore_index=IGNORE,
                                            label_smoothing=label_smoothing, reduction="sum"),
                            (next_rows != IGNORE).sum())
        figures["prefix_loss"] = prefix_loss.item()
        loss = loss + prefix_weight * prefix_loss
    return loss, figures


