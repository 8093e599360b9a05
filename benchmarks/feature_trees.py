"""What a round costs with the feature drafter: chains eager and compiled, token trees eager, on the shipped target.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/feature_trees.py [--prompts 4] [--tokens 48] [--repeats 3]

The feature drafter is random-initialised (none is shipped yet): its tau means nothing, so the figures are the cost
of a round (milliseconds per round, and its target and drafter parts as the rows' stats count them), not speed.
code-drafter's chain and tree of the same shapes run beside as the model drafter's reference. Greedy, batch 1, each
(repeat, prompt) turn runs every method once in a rotating order (the machine's load moves within a minute); every
output is checked equal to plain decoding. The compiled method's target has one bucket (1 row x gamma + 1 tokens,
returning the drafter's features: ``specdec.plan``), switched on for that method only (trees decode eagerly).
Prints one line per method: median ms per round over the turns, its target and drafter parts, rounds, tau.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import specdec
from specdec.compiled import compiled_for, prepare, set_compiled
from specdec.data.prompts import code_completion_prompts
from specdec.drafters import FeatureDrafter
from specdec.drafters.feature_model import new_feature_drafter
from specdec.features import drafter_layers
from specdec.tree import TreeConfig

METHODS = {  # name -> (drafter, gamma, tree, compiled)
    "feature chain g4": ("feature", 4, None, False),
    "feature chain g4 compiled": ("feature", 4, None, True),
    "feature tree 8x2 g4": ("feature", 4, TreeConfig(8, 2), False),
    "feature tree 16x4 g5": ("feature", 5, TreeConfig(16, 4), False),
    "feature tree 32x4 g6": ("feature", 6, TreeConfig(32, 4), False),
    "code-drafter chain g4": ("model", 4, None, False),
    "code-drafter tree 16x4 g5": ("model", 5, TreeConfig(16, 4), False),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, code_drafter = specdec.load_model("code-target"), specdec.load_model("code-drafter")
    model = new_feature_drafter(target, seed=0).eval()
    tok = specdec.load_tokenizer("code-target")
    prompts = [tok(p["prompt"])["input_ids"] for p in code_completion_prompts(args.prompts, split="test", seed=3)]
    plain = [specdec.autoregressive_generate(target, p, max_new_tokens=args.tokens).tokens for p in prompts]
    started = time.perf_counter()
    choice = prepare(target, "on", tokens=(5,), rows=(1,), hidden=drafter_layers(model.config), bare=False)
    print(f"load {os.getloadavg()[0]:.1f}; compile {choice.reason} ({time.perf_counter() - started:.0f} s)")
    compiled = compiled_for(target)
    set_compiled(target, None)
    names = list(METHODS)
    per_round: dict[str, list[tuple[float, float, float]]] = {m: [] for m in names}
    figures: dict[str, tuple[int, int]] = {}
    turn = 0
    for repeat in range(-1, args.repeats):  # -1: a warm-up
        for i, prompt in enumerate(prompts):
            turn += 1
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                kind, gamma, tree, compile_it = METHODS[name]
                set_compiled(target, compiled if compile_it else None)
                drafter = FeatureDrafter(model) if kind == "feature" else code_drafter
                start = time.perf_counter()
                out = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=args.tokens, gamma=gamma,
                                                   tree=tree)
                elapsed = time.perf_counter() - start
                set_compiled(target, None)
                assert out.tokens == plain[i], (name, i)
                stats = out.stats
                if compile_it:
                    assert compiled.calls["eager"] == 0
                if repeat >= 0:
                    rounds = stats.rounds
                    per_round[name].append((1e3 * elapsed / rounds, 1e3 * stats.target_time_s / rounds,
                                            1e3 * stats.drafter_time_s / rounds))
                    done = figures.get(name, (0, 0))
                    figures[name] = (done[0] + rounds, done[1] + len(out.tokens))
    print(f"load {os.getloadavg()[0]:.1f}; {args.prompts} prompts x {args.tokens} tokens, {args.repeats} repeats")
    print("| method | ms per round | target ms | drafter ms | rounds | tau |")
    print("|---|---|---|---|---|---|")
    for name in names:
        rounds, tokens = figures[name]
        cols = [statistics.median(x[k] for x in per_round[name]) for k in range(3)]
        print(f"| {name} | {cols[0]:.1f} | {cols[1]:.1f} | {cols[2]:.1f} | {rounds // args.repeats} | "
              f"{tokens / rounds:.2f} |")


if __name__ == "__main__":
    main()
