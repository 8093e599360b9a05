"""Token trees against chains on the shipped pair: greedy, held-out prompts, methods interleaved, medians of repeats.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/trees.py [--prompts 6] [--tokens 64] [--repeats 3]

Prints, per method, tokens/s (median over repeats of the whole prompt set), tau (committed tokens per round) and the
target forwards; every output is checked equal to plain decoding."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec
from specdec.data.prompts import code_completion_prompts
from specdec.tree import TreeConfig

METHODS = {  # name -> (gamma, tree)
    "chain g4": (4, None),
    "chain g6": (6, None),
    "tree 4x2 g4": (4, TreeConfig(4, 2)),
    "tree 8x2 g4": (4, TreeConfig(8, 2)),
    "tree 8x4 g5": (5, TreeConfig(8, 4)),
    "tree 16x4 g5": (5, TreeConfig(16, 4)),
    "tree 32x4 g6": (6, TreeConfig(32, 4)),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, drafter = specdec.load_model("code-target"), specdec.load_model("code-drafter")
    tok = specdec.load_tokenizer("code-target")
    prompts = [tok(p["prompt"])["input_ids"] for p in code_completion_prompts(args.prompts, split="test", seed=3)]
    plain = [r.tokens for r in (specdec.autoregressive_generate(target, p, max_new_tokens=args.tokens)
                                for p in prompts)]
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    figures: dict[str, tuple[int, int, int]] = {}
    for repeat in range(args.repeats + 1):  # the first is a warm-up
        for name, (gamma, tree) in METHODS.items():
            start = time.perf_counter()
            outs = [specdec.speculative_generate(target, drafter, p, max_new_tokens=args.tokens, gamma=gamma,
                                                 tree=tree) for p in prompts]
            elapsed = time.perf_counter() - start
            assert [o.tokens for o in outs] == plain, name
            if repeat:
                times[name].append(elapsed)
            figures[name] = (sum(o.stats.new_tokens for o in outs), sum(o.stats.rounds for o in outs),
                             sum(o.stats.target_calls for o in outs))
    print(f"{'method':14} {'tok/s':>7} {'tau':>5} {'rounds':>6}  (times: {args.repeats} repeats)")
    for name in METHODS:
        new, rounds, _ = figures[name]
        print(f"{name:14} {new / statistics.median(times[name]):7.1f} {new / rounds:5.2f} {rounds:6d}  "
              + " ".join(f"{t:.2f}" for t in times[name]))


if __name__ == "__main__":
    main()
