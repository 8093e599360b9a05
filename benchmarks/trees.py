"""Token trees against chains on the shipped pair: greedy, held-out prompts, methods interleaved prompt by prompt.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/trees.py [--prompts 6] [--tokens 64] [--repeats 5]

For each repeat and prompt every method runs once, in an order that rotates, so that each method's time is measured
beside the others' on a machine whose load moves by tens of percent within a minute. Prints, per method: tokens/s
(all prompts' tokens over the median repeat's total time), the median over (prompt, repeat) of its speed relative to
the first method measured in the same turn, tau (committed tokens per round) and the rounds; every output is checked
equal to plain decoding."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import specdec
from specdec.data.prompts import code_completion_prompts
from specdec.tree import TreeConfig

METHODS = {  # name -> (gamma, tree); the first is the baseline of the ratios
    "chain g4": (4, None),
    "chain g6": (6, None),
    "tree 4x2 g4": (4, TreeConfig(4, 2)),
    "tree 8x2 g4": (4, TreeConfig(8, 2)),
    "tree 8x2 g6": (6, TreeConfig(8, 2)),
    "tree 12x2 g6": (6, TreeConfig(12, 2)),
    "tree 16x4 g5": (5, TreeConfig(16, 4)),
    "tree 32x4 g6": (6, TreeConfig(32, 4)),
}


def compare(target, drafter: Callable[[], object], methods: dict, prompts: int, tokens: int, repeats: int) -> None:
    """Run ``methods`` (name -> (gamma, tree); the first the ratios' baseline) with ``drafter()`` on ``prompts``
    held-out code prompts × ``tokens``, interleaved as the module says, and print the table."""
    tok = specdec.load_tokenizer("code-target")
    ids = [tok(p["prompt"])["input_ids"] for p in code_completion_prompts(prompts, split="test", seed=3)]
    plain = [specdec.autoregressive_generate(target, p, max_new_tokens=tokens).tokens for p in ids]
    names = list(methods)
    seconds = {m: [[0.0] * len(ids) for _ in range(repeats)] for m in names}
    figures: dict[str, list[tuple[int, int]]] = {m: [(0, 0)] * len(ids) for m in names}
    turn = 0
    for repeat in range(-1, repeats):  # repeat -1 is a warm-up
        for i, prompt in enumerate(ids):
            turn += 1
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                gamma, tree = methods[name]
                start = time.perf_counter()
                out = specdec.speculative_generate(target, drafter(), prompt, max_new_tokens=tokens, gamma=gamma,
                                                   tree=tree)
                elapsed = time.perf_counter() - start
                assert out.tokens == plain[i], (name, i)
                if repeat >= 0:
                    seconds[name][repeat][i] = elapsed
                figures[name][i] = (out.stats.new_tokens, out.stats.rounds)
    base = names[0]
    print(f"{'method':14} {'tok/s':>7} {'x ' + base:>10} {'tau':>5} {'rounds':>6}")
    for name in names:
        new = sum(n for n, _ in figures[name])
        rounds = sum(r for _, r in figures[name])
        total = statistics.median(sum(s) for s in seconds[name])
        ratio = statistics.median(seconds[base][r][i] / seconds[name][r][i]
                                  for r in range(repeats) for i in range(len(ids)))
        print(f"{name:14} {new / total:7.1f} {ratio:10.2f} {new / rounds:5.2f} {rounds:6d}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, drafter = specdec.load_model("code-target"), specdec.load_model("code-drafter")
    compare(target, lambda: drafter, METHODS, args.prompts, args.tokens, args.repeats)


if __name__ == "__main__":
    main()
