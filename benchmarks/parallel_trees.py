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

import torch
from trees import compare  # benchmarks/trees.py, beside this script

import specdec
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
    model = load_parallel_drafter(args.drafter, target).eval()
    block = model.config.block_size
    methods = {f"chain g{block}": (block, None), f"tree 8x2 g{block}": (block, TreeConfig(8, 2)),
               f"tree 16x4 g{block}": (block, TreeConfig(16, 4)), f"tree 32x4 g{block}": (block, TreeConfig(32, 4))}
    compare(target, lambda: ParallelDrafter(model), methods, args.prompts, args.tokens, args.repeats)


if __name__ == "__main__":
    main()
