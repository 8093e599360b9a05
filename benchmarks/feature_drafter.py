"""A feature drafter beside code-drafter on held-out prompts, decoded (issue 68's chain goal).

Greedy, batch 1, each prompt decoded by every method in turn (interleaved), each output checked against plain
decoding: tau (new tokens per round), alpha (accepted / drafted) and tokens/s per method, medians over prompts of
the per-prompt time ratios to plain decoding. Prints one JSON object.

    OMP_NUM_THREADS=1 python benchmarks/feature_drafter.py --feature DIR --prompts 20 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import specdec
from specdec.data.prompts import code_completion_prompts
from specdec.loading import load_model, load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="models/code-target")
    parser.add_argument("--feature", required=True, help="a feature drafter folder (specdec train feature-drafter)")
    parser.add_argument("--baseline", default="code-drafter")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gammas", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_model(args.target, dtype=torch.float32)
    tok = load_tokenizer(args.target)
    prompts = [p["prompt"] for p in code_completion_prompts(args.prompts, "test")]
    methods = {"plain": None}
    for g in args.gammas:
        methods[f"{args.baseline} γ{g}"] = (args.baseline, g)
        methods[f"feature γ{g}"] = (args.feature, g)
    rows = {m: {"tokens": 0, "rounds": 0, "drafted": 0, "accepted": 0, "ratio": [], "equal": 0} for m in methods}
    for i, text in enumerate(prompts + prompts[:1]):  # the first prompt once more at the start: warm-up
        ids = tok(text).input_ids
        times, plain = {}, None
        for name, spec in methods.items():
            started = time.perf_counter()
            if spec is None:
                out = specdec.autoregressive_generate(target, ids, max_new_tokens=args.max_new_tokens, threads=1)
            else:
                out = specdec.speculative_generate(target, spec[0], ids, max_new_tokens=args.max_new_tokens,
                                                   gamma=spec[1], threads=1)
            times[name] = time.perf_counter() - started
            if i == 0:
                continue
            plain = out.tokens if spec is None else plain
            r = rows[name]
            r["tokens"] += len(out.tokens)
            r["rounds"] += out.stats.rounds
            r["drafted"] += out.stats.drafted
            r["accepted"] += out.stats.accepted
            r["equal"] += out.tokens == plain
        if i > 0:
            for name in methods:
                rows[name]["ratio"].append(times["plain"] / times[name])
    result = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "threads": 1,
              "load": os.getloadavg()[0]}
    for name, r in rows.items():
        result[name] = {"tau": round(r["tokens"] / max(1, r["rounds"]), 3),
                        "alpha": round(r["accepted"] / max(1, r["drafted"]), 3),
                        "speed_over_plain_median": round(statistics.median(r["ratio"]), 3),
                        "equal": f"{r['equal']}/{args.prompts}"}
    print(json.dumps(result, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
