"""SpecDec's block drafter, its figures: teacher-forced acceptance, forward times, the speed they imply.

``block_acceptance`` measures the teacher-forced greedy acceptance per block position and the mean
accepted length tau (Spec-Bench convention: +1 for the target's own token) on held-out records; the
trainer (``specdec.train.block``) logs it during a run. ``evaluate_block_drafter`` (``specdec train
block-eval``) adds the same measure for an autoregressive drafter on the same anchors, forward times
relative to the target's step, and the tokens per target step they imply, all on CPUs and offline:
it compares block sizes and drafters without decoding.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from specdec.compat import cache_kwargs
from specdec.drafters.block_model import BlockDrafterModel
from specdec.folders import require_weights
from specdec.loading import load_model
from specdec.train.block_data import (
    HIDDEN_SPAN,
    Record,
    block_forward,
    load_records,
    pack_blocks,
    target_hidden_states,
)


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
            return lambda: (drafter(input_ids=context[:, -1:], **cache_kwargs(drafter, caches["drafter"]),
                                    use_cache=True), caches["drafter"].crop(-1))
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
        shown = a["position_acceptance"]
        accept = " ".join(f"{x:.2f}" for x in shown[:8]) + (" ..." if len(shown) > 8 else "")
        lines.append(f"| block | {k} | {a['tau']:.3f} | {accept} | {rel[f'block{k}']:.3f} | "
                     f"{rel[f'verify{int(k) + 1}']:.3f} | {result['speed_block'][k]:.3f} |")
    for g, a in result.get("drafter", {}).items():
        accept = " ".join(f"{x:.2f}" for x in a["position_acceptance"])
        lines.append(f"| autoregressive | {g} | {a['tau']:.3f} | {accept} | {int(g) * rel['drafter']:.3f} | "
                     f"{rel[f'verify{int(g) + 1}']:.3f} | {result['speed_drafter'][g]:.3f} |")
    return "\n".join(lines)


