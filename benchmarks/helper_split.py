"""The blocked operator's helper thread, on and off: ``python benchmarks/helper_split.py --rows 1 4 16 150``.

Times one pass over every linear layer of a model (code-target's 43 layers by default, in the blocked kernel's copy:
bfloat16 pairs for the shipped models) through ``specdec::blocked_linear`` with n input rows, the helper off (one
thread) and on (its shares taken by a second thread at the idle priority: ``csrc/blocked_op.cpp``), in turns, each
pass after a read of a buffer larger than the last-level cache (the weights come from memory, as in decoding);
medians of ``--repeats``. Every shared product is checked equal, bit for bit, to the one-thread product first.
Prints the thread count and the load average beside the figures. Findings: docs/journal/2026-12-04-helper-thread.md, "A
helper thread on
the idle core".

    OMP_NUM_THREADS=1 python benchmarks/helper_split.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from specdec import kernels
from specdec.folders import resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="code-target", help="a shipped name or a model folder")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16, 150])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not kernels.blocked_op():
        raise SystemExit("the blocked operator did not build: it needs a C and a C++ compiler (cc, c++)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model), dtype=torch.float32)
    lanes = kernels.blocked().lanes
    layers = [(kernels.blocked_copy(m.weight.detach(), lanes), m.out_features, m.in_features)
              for m in model.modules() if isinstance(m, torch.nn.Linear)]
    evict = kernels.evictor()
    print(f"{args.model}: {len(layers)} layers, {sum(w.nbytes for w, _, _ in layers) / 1e6:.1f} MB copied, "
          f"{torch.get_num_threads()} thread(s), load {os.getloadavg()[0]:.2f}; ms per pass, medians of {args.repeats}")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k) for k in {k for _, _, k in layers}}

        def run(on: bool, inputs: dict[int, torch.Tensor] = inputs) -> tuple[float, list[torch.Tensor]]:
            torch.ops.specdec.helper(on)
            evict()
            start = time.perf_counter()
            out = [torch.ops.specdec.blocked_linear(inputs[k], w, None, n) for w, n, k in layers]
            return (time.perf_counter() - start) * 1e3, out

        alone = run(False)[1]
        assert all(torch.equal(a, b) for a, b in zip(run(True)[1], alone)), "a shared product differs"
        times: dict[bool, list[float]] = {False: [], True: []}
        for repeat in range(args.repeats):
            for on in (False, True) if repeat % 2 else (True, False):
                times[on].append(run(on)[0])
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"  {rows:4d} rows: alone {off:7.2f}, with the helper {on:7.2f} ({on / off:.2f}x)", flush=True)
    shared, helped, stolen, _ = torch.ops.specdec.helper_counts()
    print(f"products shared {shared}, shares the helper computed {helped}, taken back from it {stolen}; "
          f"load {os.getloadavg()[0]:.2f}")
    torch.ops.specdec.helper(kernels.helper_wanted())


if __name__ == "__main__":
    main()
