"""The drafter's pass and step right after other work: ``python benchmarks/drafter_warmth.py``.

The bench compares the drafter's step (timed as in a round: in runs right after the target's steps) with its
pass over its weights timed back to back (``specdec.bench.floor``). This times, with code-drafter and code-target
compiled as the bench runs them (``--compile on``, 1-token buckets), the drafter's pass (``--what pass``, default)
or its compiled step (``--what step``) at positions 1-6 of a run that follows each of: 4 of the target's steps, 4
passes over the target's weights, a read of 64 MiB (more than the last-level cache), 25 ms of arithmetic on data that
stays in the caches (a 256 x 256 product), a 25 ms sleep, and nothing. Medians over ``--runs`` runs each, ms.
Findings: docs/journal/2026-11-29-llamacpp-epyc.md, "llama.cpp on the AMD EPYC, the drafter after other work".

    OMP_NUM_THREADS=1 python benchmarks/drafter_warmth.py
    OMP_NUM_THREADS=1 python benchmarks/drafter_warmth.py --what step
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch

from specdec.bench.floor import pass_over
from specdec.bench.measure import compiled_start
from specdec.compiled import prepare
from specdec.kernels import active
from specdec.loading import load_model

POSITIONS = 6
BUSY_S = 0.025


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=("pass", "step"), default="pass")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    drafter, target = load_model("code-drafter"), load_model("code-target")
    for model in (drafter, target):
        prepare(model, "on", tokens=(1,))
    context = torch.arange(5, 60)[None]  # [1, 55] token ids
    buffer, square = torch.ones(64 << 18), torch.randn(256, 256)

    def fresh(model: torch.nn.Module) -> list:  # a compiled cache holding the context, and the next token
        return list(compiled_start(model, context))

    def step(state: list) -> None:
        state[1] = state[0].forward(state[1]).logits[:, -1:].argmax(-1)

    def arithmetic() -> None:
        end = time.perf_counter() + BUSY_S
        while time.perf_counter() < end:
            square @ square

    with torch.inference_mode(), active():
        target_pass, drafter_pass = pass_over(target)[0], pass_over(drafter)[0]
        states = {"target": fresh(target), "drafter": fresh(drafter)}
        timed = drafter_pass if args.what == "pass" else lambda: step(states["drafter"])
        before = {
            "4 target steps": lambda: [step(states["target"]) for _ in range(4)],
            "4 target passes": lambda: [target_pass() for _ in range(4)],
            "a 64 MiB read": lambda: buffer.sum(),
            "25 ms arithmetic": arithmetic,
            "a 25 ms sleep": lambda: time.sleep(BUSY_S),
            "nothing": lambda: None,
        }
        print(f"the drafter's {args.what} at positions 1-{POSITIONS} after ..., ms (median of {args.runs}; "
              f"{torch.get_num_threads()} thread(s), load {os.getloadavg()[0]:.2f})")
        for name, work in before.items():
            times = collections.defaultdict(list)
            for run in range(args.runs):
                work()
                for position in range(POSITIONS):
                    start = time.perf_counter()
                    timed()
                    times[position].append(time.perf_counter() - start)
                if run % 10 == 9:  # the caches' slots in use stay near the context's
                    states.update(target=fresh(target), drafter=fresh(drafter))
            print(f"  {name:18s}" + " ".join(f"{statistics.median(times[p]) * 1e3:6.3f}" for p in range(POSITIONS)))


if __name__ == "__main__":
    main()
