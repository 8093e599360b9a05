"""One target verify of n tokens as a chain and as a tree (code-target, a 200-token context, 1 thread): medians of 15.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/tree_verify.py

The tree is a chain of 3 branches from the root (node i's parent is node i - 3); after each verify both roll back to
the root alone, so every call sees the same context."""

from __future__ import annotations

import time

import torch

import specdec
from specdec.batch import PromptBatch
from specdec.kernels import active
from specdec.target import ModelTarget
from specdec.tree import Tree, commit_target, verify_tree


def main() -> None:
    torch.set_num_threads(1)
    target = ModelTarget(specdec.load_model("code-target"))
    with torch.inference_mode(), active():
        target.prefill(PromptBatch.from_lists([list(range(100, 300))], "cpu"))

        def chain(n: int) -> None:
            target.verify(torch.arange(5, 5 + n)[None], torch.tensor([n]))
            target.rollback(torch.tensor([1]))

        def tree(n: int) -> None:
            nodes = Tree.from_lists([[(10 + i, max(0, i - 3)) for i in range(n - 1)]])
            verify_tree(target, torch.tensor([5]), nodes)
            commit_target(target, [[]], n)

        for name, run, n in [("chain", chain, 5), ("chain", chain, 9), ("chain", chain, 17), ("tree", tree, 5),
                             ("tree", tree, 9), ("tree", tree, 17), ("tree", tree, 33)]:
            for _ in range(3):
                run(n)
            times = []
            for _ in range(15):
                start = time.perf_counter()
                run(n)
                times.append(time.perf_counter() - start)
            times.sort()
            print(f"{name} {n:3d} tokens: median {1000 * times[7]:.1f} ms  min {1000 * times[0]:.1f}")


if __name__ == "__main__":
    main()
