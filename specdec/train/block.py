"""Training SpecDec's block drafter by distillation from the target, with glancing.

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
``draft_vocab_size`` tokens the target writes most often (FR-Spec, Zhao et al. 2025: the head is
most of a small drafter's cost when it runs on k positions); optionally each block reads the
target's last hidden state (``condition_on_target``), precomputed once per record.

Contract: ``train_block_drafter(cfg, out_dir)`` trains or resumes a run folder: ``checkpoint/``
(weights, optimizer, step; the batch and the glancing choices of step ``s`` are a pure function
of ``seed`` and ``s``, so a resumed run equals an uninterrupted one) and, at ``max_steps``,
``final/`` (``save_pretrained`` safetensors, tokenizer). A run keeps the config it started with,
except ``max_steps`` when a resume asks for ``reschedule_to`` (the lr and glancing schedules then
end there; the run is no longer equal to an uninterrupted one).
``block_acceptance`` measures the teacher-forced greedy acceptance per block position and the
mean accepted length tau (Spec-Bench convention: +1 for the target's own token) on held-out records.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from specdec.compat import cache_kwargs
from specdec.drafters.block_model import BlockDrafterConfig, BlockDrafterModel, BlockLayout
from specdec.folders import require_weights
from specdec.loading import load_model, load_tokenizer
from specdec.train.checkpoint import load_checkpoint, save_checkpoint, saved_config, writing
from specdec.train.drafter import block_card, measure_pair
from specdec.train.outputs import check_records, target_fingerprint, valid_path
from specdec.train.outputs import read_records as read_outputs
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


def build_block_drafter(cfg: BlockTrainConfig, target, draft_vocab: torch.Tensor | None, init=None) -> BlockDrafterModel:
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


# ---- loss and evaluation -------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Acceptance:
    """Teacher-forced greedy acceptance of k-token blocks against the target's continuations."""

    block_size: int  # k
    blocks: int  # blocks measured
    tau: float  # mean accepted length incl. the target's own token: 1 + mean accepted drafts
    position_accuracy: list[float]  # P(draft j == target token j), j < k
    position_acceptance: list[float]  # P(draft j accepted) = P(drafts 0..j all correct)


@torch.no_grad()
def block_acceptance(model: BlockDrafterModel, records: list[Record], block_sizes: list[int],
                     hidden: torch.Tensor | None = None, seq_len: int = 512, chunk: int = 8,
                     horizon: int | None = None) -> dict[int, Acceptance]:
    """Teacher-forced acceptance: every anchor of each record's continuation whose next ``horizon``
    tokens (default: the largest k) are all known drafts a block of each size k from the target's
    own prefix; the draft's accepted length is its longest prefix equal to the target's tokens."""
    model.eval()
    horizon = horizon or max(block_sizes)
    usable = [(i, r) for i, r in enumerate(records) if len(r.ids) - 1 - horizon >= r.prompt_len - 1]
    results = {}
    for k in block_sizes:
        correct_runs: list[torch.Tensor] = []
        for start in range(0, len(usable), chunk):
            part = usable[start : start + chunk]
            anchors = [torch.arange(r.prompt_len - 1, len(r.ids) - 1 - horizon + 1) for _, r in part]
            m = max(len(a) for a in anchors)
            anchors = [torch.cat([a, a[-1:].expand(m - len(a))]) for a in anchors]  # repeat the last anchor
            counts = [len(torch.arange(r.prompt_len - 1, len(r.ids) - horizon)) for _, r in part]
            block_hidden = None
            if hidden is not None:
                block_hidden = [hidden[i][(a - r.prompt_len + 1).clamp(0, HIDDEN_SPAN - 1)].float()
                                for (i, r), a in zip(part, anchors)]
            batch = pack_blocks([r for _, r in part], anchors, k, seq_len, block_hidden)
            logits = block_forward(model, batch, head_logits=False)  # [B, m k, V]
            pred = logits.argmax(-1).view(len(part), m, k)
            labels = batch.labels[:, -m * k :].view(len(part), m, k)
            ok = pred == labels  # [B, m, k]
            for b, c in enumerate(counts):
                correct_runs.append(ok[b, :c])
        ok = torch.cat(correct_runs)  # [N, k]
        run = ok.long().cumprod(-1)  # [N, k] 1 while every draft so far is correct
        results[k] = Acceptance(k, len(ok), 1.0 + run.sum(-1).float().mean().item(),
                                ok.float().mean(0).tolist(), run.float().mean(0).tolist())
    return results


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
        cfg = replace(cfg, outputs_records=sum(1 for line in Path(cfg.outputs).read_text().splitlines() if line.strip()))
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


# ---- offline figures: acceptance by k, forward times, the speed they imply -------------------------


@torch.no_grad()
def ar_acceptance(drafter, records: list[Record], gammas: list[int], horizon: int) -> dict[int, Acceptance]:
    """The same teacher-forced measure for an autoregressive drafter drafting gamma tokens greedily:
    while its drafts match, it reads exactly the target's tokens, so one forward over each record
    gives every anchor's accepted length."""
    usable = [r for r in records if len(r.ids) - 1 - horizon >= r.prompt_len - 1]
    correct = []
    for r in usable:
        pred = drafter(input_ids=r.ids[None]).logits[0].argmax(-1)  # [T]: pred[i] drafts ids[i + 1]
        hit = pred[:-1] == r.ids[1:]  # [T - 1]
        anchors = torch.arange(r.prompt_len - 1, len(r.ids) - horizon)  # as block_acceptance
        correct.append(torch.stack([hit[anchors + j] for j in range(max(gammas))], 1))  # [A, gamma_max]
    ok = torch.cat(correct)
    out = {}
    for g in gammas:
        run = ok[:, :g].long().cumprod(-1)
        out[g] = Acceptance(g, len(ok), 1.0 + run.sum(-1).float().mean().item(), ok[:, :g].float().mean(0).tolist(),
                            run.float().mean(0).tolist())
    return out


@torch.inference_mode()
def forward_times(target, drafter, block: BlockDrafterModel, context: torch.Tensor, block_sizes: list[int],
                  gammas: list[int], steps: int = 24, run: int = 4, target_hidden: bool = False) -> dict[str, float]:
    """Median seconds of one forward, each after a run of the target's single-token steps (as in a
    round): ``target`` (1 token), ``verify{m}`` (the target on m tokens, hidden states too when
    ``target_hidden``), ``drafter`` (1 token), ``block{k}`` (1 committed token + k mask positions),
    all with a KV cache holding ``context`` [1, T], which every probe leaves as it found it."""
    caches = {}
    for name, model in (("target", target), ("drafter", drafter), ("block", block)):
        if model is not None:
            caches[name] = DynamicCache(config=model.config)
            model(input_ids=context, **cache_kwargs(model, caches[name]), use_cache=True)
    mask_id = block.config.mask_token_id
    hidden = torch.zeros(1, block.config.target_hidden_size) if block.config.target_hidden_size else None

    def probe(name: str):
        if name == "target":
            return lambda: (target(input_ids=context[:, -1:], **cache_kwargs(target, caches["target"]), use_cache=True),
                            caches["target"].crop(-1))
        if name.startswith("verify"):
            m = int(name.removeprefix("verify"))
            return lambda: (target(input_ids=context[:, -m:], **cache_kwargs(target, caches["target"]), use_cache=True,
                                   logits_to_keep=m, output_hidden_states=target_hidden), caches["target"].crop(-m))
        if name == "drafter":
            return lambda: (drafter(input_ids=context[:, -1:], **cache_kwargs(drafter, caches["drafter"]), use_cache=True),
                            caches["drafter"].crop(-1))
        k = int(name.removeprefix("block"))
        ids = torch.cat([context[:, -1:], torch.full((1, k), mask_id)], 1)  # [1, 1 + k]
        return lambda: (block(input_ids=ids, past_key_values=caches["block"], use_cache=True, block_size=k,
                              logits_to_keep=k, target_hidden=hidden), caches["block"].crop(-(1 + k)))

    names = ["target", *(f"verify{g + 1}" for g in sorted({*gammas, *block_sizes})),
             *(["drafter"] if drafter is not None else []), *(f"block{k}" for k in block_sizes)]
    probes = {name: probe(name) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up
        probes[name]()
    while len(times[names[-1]]) < steps:
        for name in names[1:]:
            for who in ("target", name):
                for _ in range(run):
                    start = time.perf_counter()
                    probes[who]()
                    times[who].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def implied_speed(tau: float, verify: float, draft: float) -> float:
    """Tokens per target-step of a round: tau / (verification + drafting), both in target steps."""
    return tau / (verify + draft)


BLOCK_SIZES = [4, 8, 12, 16, 25]  # the block sizes reported (issue 17)
GAMMAS = [2, 3, 4, 5, 6]  # the autoregressive drafter's gammas compared


def evaluate_block_drafter(block_path: str | Path, valid: str | Path, *, target: str = "code-target",
                           drafter: str | None = "code-drafter", records: int = 300,
                           block_sizes: list[int] | None = None, gammas: list[int] | None = None,
                           steps: int = 24, log=print) -> dict:
    """The offline figures of a block drafter on held-out greedy records: acceptance and tau by k
    (and by gamma for the autoregressive drafter, same anchors), forward times relative to the
    target's step, and the speed they imply per round in target steps."""
    block_sizes = block_sizes or BLOCK_SIZES
    gammas = gammas or GAMMAS
    block = BlockDrafterModel.from_pretrained(require_weights(block_path), dtype=torch.float32).eval()
    if max(block_sizes) > block.config.max_block_size:
        raise ValueError(f"block sizes up to {max(block_sizes)} asked, but the drafter was built for at most "
                         f"{block.config.max_block_size}")
    tmodel = load_model(target, device="cpu", dtype=torch.float32)
    dmodel = load_model(drafter, device="cpu", dtype=torch.float32) if drafter else None
    held_out = load_records(valid)[:records]
    horizon = max(max(block_sizes), max(gammas))
    hidden = target_hidden_states(tmodel, held_out) if block.config.target_hidden_size else None
    started = time.perf_counter()
    acc = block_acceptance(block, held_out, block_sizes, hidden, horizon=horizon)
    result = {"records": len(held_out), "blocks": acc[block_sizes[0]].blocks, "horizon": horizon,
              "block": {k: asdict(a) for k, a in acc.items()}}
    if hidden is not None:
        plain = block_acceptance(block, held_out, block_sizes, None, horizon=horizon)
        result["block_without_hidden"] = {k: asdict(a) for k, a in plain.items()}
    if dmodel is not None:
        result["drafter"] = {g: asdict(a) for g, a in ar_acceptance(dmodel, held_out, gammas, horizon).items()}
    log(f"acceptance measured in {time.perf_counter() - started:.0f} s")
    context = held_out[0].ids[None, :200]
    times = forward_times(tmodel, dmodel, block, context, block_sizes, gammas, steps=steps,
                          target_hidden=bool(block.config.target_hidden_size))
    step = times["target"]
    result["seconds"] = times
    result["relative"] = {name: t / step for name, t in times.items()}
    rel = result["relative"]
    result["speed_block"] = {k: implied_speed(acc[k].tau, rel[f"verify{k + 1}"], rel[f"block{k}"])
                             for k in block_sizes}
    if dmodel is not None:
        result["speed_drafter"] = {g: implied_speed(result["drafter"][g]["tau"], rel[f"verify{g + 1}"],
                                                    g * rel["drafter"]) for g in gammas}
    return result


def format_evaluation(result: dict) -> str:
    """The figures as a Markdown table (rows: block sizes, then the autoregressive drafter's gammas)."""
    rel = result["relative"]
    lines = [("| drafter | k or gamma | tau | acceptance by position | draft cost (target steps) | verify cost | "
             "tokens per target step |"), "|---|---|---|---|---|---|---|"]
    for k, a in result["block"].items():
        accept = " ".join(f"{x:.2f}" for x in a["position_acceptance"][:8]) + (" ..." if len(a["position_acceptance"]) > 8 else "")
        lines.append(f"| block | {k} | {a['tau']:.3f} | {accept} | {rel[f'block{k}']:.3f} | "
                     f"{rel[f'verify{int(k) + 1}']:.3f} | {result['speed_block'][k]:.3f} |")
    for g, a in result.get("drafter", {}).items():
        accept = " ".join(f"{x:.2f}" for x in a["position_acceptance"])
        lines.append(f"| autoregressive | {g} | {a['tau']:.3f} | {accept} | {int(g) * rel['drafter']:.3f} | "
                     f"{rel[f'verify{int(g) + 1}']:.3f} | {result['speed_drafter'][g]:.3f} |")
    return "\n".join(lines)


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
