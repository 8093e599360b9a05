"""A parallel drafter's token trees against its chain on code-target: greedy, held-out prompts, methods interleaved.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/parallel_trees.py --drafter FOLDER [--prompts 6] [--tokens 64]
        [--repeats 3]

FOLDER: a parallel drafter for code-target (``specdec train parallel-drafter``). For each repeat and prompt every
method runs once, in an order that rotates (benchmarks/trees.py's design: the load of this machine moves within a
minute). Prints, per method: tokens/s (all prompts' tokens over the median repeat's total time), the median over
(prompt, repeat) of its speed relative to the first method in the same turn, tau (committed tokens per round) and
the rounds; every output is checked equal to plain decoding."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec
from specdec.data.prompts import code_completion_prompts
from specdec.drafters import ParallelDrafter
from specdec.drafters.parallel_model import load_parallel_drafter
from specdec.tree import TreeConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = specdec.load_model("code-target")
    tok = specdec.load_tokenizer("code-target")
    model = load_parallel_drafter(args.drafter, target).eval()
    block = model.config.block_size
    methods = {f"chain g{block}": (block, None), f"tree 8x2 g{block}": (block, TreeConfig(8, 2)),
               f"tree 16x4 g{block}": (block, TreeConfig(16, 4)), f"tree 32x4 g{block}": (block, TreeConfig(32, 4))}
    prompts = [tok(p["prompt"])["input_ids"] for p in code_completion_prompts(args.prompts, split="test", seed=3)]
    plain = [specdec.autoregressive_generate(target, p, max_new_tokens=args.tokens).tokens for p in prompts]
    names = list(methods)
    seconds = {m: [[0.0] * len(prompts) for _ in range(args.repeats)] for m in names}
    figures: dict[str, list[tuple[int, int]]] = {m: [(0, 0)] * len(prompts) for m in names}
    turn = 0
    for repeat in range(-1, args.repeats):  # repeat -1 is a warm-up
        for i, prompt in enumerate(prompts):
            turn += 1
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                gamma, tree = methods[name]
                start = time.perf_counter()
                out = specdec.speculative_generate(target, ParallelDrafter(model), prompt, max_new_tokens=args.tokens,
                                                   gamma=gamma, tree=tree)
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
                                  for r in range(args.repeats) for i in range(len(prompts)))
        print(f"{name:14} {new / total:7.1f} {ratio:10.2f} {new / rounds:5.2f} {rounds:6d}")


if __name__ == "__main__":
    main()
