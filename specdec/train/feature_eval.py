"""Held-out figures of a feature drafter per drafting depth, beside an ordinary drafter model's
(``specdec train feature-eval``).

Contract: ``evaluate(drafter, target, prompts=..., max_new_tokens=...)`` continues ``prompts`` held-out
function prefixes of the test split (never trained on) with the target's own ``generate`` (greedy, the
independent reference), then measures teacher-forced, in one pass per window, what greedy speculative
rounds anchored after each continuation position would accept at each depth (``feature_drafter.measure``;
for an autoregressive drafter model ``lm_depths``: its draft at depth d of a round anchored after
position t is its argmax at position t + d, since the accepted drafts are the window's own greedy
tokens). Returned per drafter: acceptance per depth (the share of depth-d drafts accepted among the
rounds that reached depth d), teacher-forced τ at γ 1, 2, 4, 8, agreement (and KL for the feature
drafter) per depth. Why teacher-forced: it needs no decoder integration and measures every position
instead of the positions where a decode's rounds happen to start; a decode's τ differs from it only by
which anchors it visits.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.loading import load_model, load_tokenizer
from specdec.train.drafter import Example
from specdec.train.feature_drafter import collate, depth_figures, measure


@torch.no_grad()
def heldout_rows(target, tokenizer, prompts: int, max_new_tokens: int, split: str = "test", seed: int = 0
                 ) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy continuation, prompt length) for ``prompts`` function prefixes of ``split``
    (``code_completion_prompts``: one per file, chosen by ``seed``), those that fit the context left out."""
    from specdec.data.prompts import code_completion_prompts

    limit = getattr(target.config, "max_position_embeddings", None) or 10**9
    rows = []
    for p in code_completion_prompts(prompts, split, seed=seed):
        ids = tokenizer(p["prompt"], return_tensors="pt").input_ids
        if ids.shape[1] + max_new_tokens > limit:
            continue
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, pad_token_id=tokenizer.eos_token_id)
        rows.append((out[0].tolist(), ids.shape[1]))
    return rows


@torch.no_grad()
def lm_depths(drafter, target, rows: Sequence[tuple[list[int], int]], depth: int, batch_size: int = 8) -> dict:
    """``depth_figures`` of an autoregressive drafter model over ``rows``: its depth-d draft of a round anchored at
    slot t (after token t + 1) is its argmax at position t + d on the window's greedy tokens."""
    batches = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i: i + batch_size]
        ids, live = collate([Example(r[0]) for r in chunk], "cpu")
        greedy = target(input_ids=ids, attention_mask=live).logits.argmax(-1)  # [B, L]
        guess = drafter(input_ids=ids, attention_mask=live).logits.argmax(-1)
        hit = guess == greedy
        on_chain = torch.zeros_like(hit)
        on_chain[:, :-1] = ids[:, 1:] == greedy[:, :-1]  # the token after position p is the target's argmax
        n = ids.shape[1] - 1
        slots = torch.arange(n)[None, :]
        start = torch.tensor([max(0, r[1] - 1) for r in chunk])[:, None]
        terms = []
        for d in range(1, depth + 1):
            terms.append({"valid": _at(live, d, n) & (slots >= start), "hit": _at(hit, d, n),
                          "chain": _at(on_chain, d, n)})
        batches.append(terms)
    return depth_figures(batches)


def _at(t: torch.Tensor, d: int, n: int) -> torch.Tensor:
    """``t`` [B, L] at position slot + d for slots 0..n-1, False past the window. [B, n] bool"""
    return torch.nn.functional.pad(t[:, d:], (0, d - 1))[:, :n].bool()


def evaluate(drafter: str, target: str, prompts: int = 50, max_new_tokens: int = 128, depth: int = 8,
             compare: Sequence[str] = ("code-drafter",), seed: int = 0, rows_file: str | None = None,
             log=print) -> dict:
    """Figures of the feature drafter ``drafter`` (a folder) and of each drafter model of ``compare`` for ``target``
    on held-out test-split prompts (module docstring). ``rows_file``: where the target's continuations are kept
    (JSON; read when it exists, else written), so that measuring another drafter does not continue them again."""
    from specdec.drafters.feature_model import load_feature_drafter
    from specdec.train.outputs import target_fingerprint

    started = time.perf_counter()
    model = load_model(target, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(target)
    feature = load_feature_drafter(drafter, model, target_fingerprint(target), name=target).eval() if drafter else None
    key = {"target": target_fingerprint(target), "prompts": prompts, "max_new_tokens": max_new_tokens, "seed": seed}
    kept = json.loads(Path(rows_file).read_text()) if rows_file and Path(rows_file).is_file() else None
    if kept is not None and kept["key"] != key:
        raise ValueError(f"{rows_file} holds continuations for {kept['key']}, not {key}: give another --rows file")
    rows = ([tuple(r) for r in kept["rows"]] if kept is not None
            else heldout_rows(model, tokenizer, prompts, max_new_tokens, seed=seed))
    if rows_file and kept is None:
        Path(rows_file).write_text(json.dumps({"key": key, "rows": rows}))
    log(f"{len(rows)} held-out prompts continued by the target ({sum(len(r[0]) - r[1] for r in rows)} tokens) in "
        f"{time.perf_counter() - started:.0f} s")
    out = {"prompts": len(rows), "max_new_tokens": max_new_tokens, "split": "test", "seed": seed,
           **({drafter: measure(feature, model, rows, depth)} if feature is not None else {})}
    for name in compare:
        out[name] = lm_depths(load_model(name, dtype=torch.float32).eval(), model, rows, depth)
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out
