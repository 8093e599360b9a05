"""What capturing the target's features costs a round: ``python benchmarks/target_features.py``.

Eager ``--model`` (specdec's kernels active), ``--rows`` rows of the bench's code prompts (about ``--tokens`` tokens
each) prefilled once; then blocks of ``--rounds`` rounds, each a verify of ``--width`` tokens a row, a rollback
keeping 1 to ``--width`` of them (the same sequence every block) and, with features, ``take_features`` (as a feature
drafter takes them each round); each block rolled back to the prompts after. Blocks with and without features
(``want_features("eagle3")`` / ``want_features(None)`` on the same target) take turns, ``--repeats`` each; medians of
the milliseconds a round. Then one prefill of the prompts each way. Findings: docs/benchmarks.md, "The target's
features".

    OMP_NUM_THREADS=1 python benchmarks/target_features.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import kernels
from specdec.batch import PromptBatch
from specdec.bench.prompts import load_prompts
from specdec.loading import load_model, load_tokenizer
from specdec.target import make_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="code-target")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=130)
    parser.add_argument("--width", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model)
    target = make_target(model)
    prompts = [p.input_ids.tolist() for p in load_prompts(None, 12, 0, tokenizer)]
    prompts = sorted(prompts, key=lambda p: abs(len(p) - args.tokens))[: args.rows]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 8000, (args.rounds, args.rows, args.width), generator=generator)
    keeps = torch.randint(1, args.width + 1, (args.rounds, args.rows), generator=generator)
    lengths = torch.full((args.rows,), args.width)
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.inference_mode(), kernels.active():
        target.prefill(PromptBatch.from_lists(prompts, "cpu"))
        start = target.cached().clone()
        for _ in range(args.repeats):
            for features in (False, True):
                target.want_features("eagle3" if features else None)
                began = time.perf_counter()
                for r in range(args.rounds):
                    target.verify(tokens[r], lengths)
                    target.rollback(keeps[r])
                    if features:
                        target.take_features()
                times[features].append((time.perf_counter() - began) / args.rounds * 1e3)
                target.cache.keep(start)
        prefill = {}
        for features in (False, True):
            target.reset()
            target.want_features("eagle3" if features else None)
            began = time.perf_counter()
            target.prefill(PromptBatch.from_lists(prompts, "cpu"))
            prefill[features] = (time.perf_counter() - began) * 1e3
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.model}, {args.rows} row(s) of {[len(p) for p in prompts]} tokens, verify {args.width} tokens, "
          f"{torch.get_num_threads()} thread, helper {kernels.helper_on()}")
    print(f"round without features {off:.2f} ms, with (eagle3 {target.feature_layers}) {on:.2f} ms: "
          f"x{on / off:.3f} (medians of {args.repeats}; each {[f'{t:.2f}' for t in times[True]]} vs "
          f"{[f'{t:.2f}' for t in times[False]]})")
    print(f"one prefill (one run each): without {prefill[False]:.1f} ms, with {prefill[True]:.1f} ms")


if __name__ == "__main__":
    main()
