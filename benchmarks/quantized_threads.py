"""specdec's int8 / int4 operator at 1 torch thread (its helper on) against 2 torch threads.

Four layers of issue 71's 409M Llama shape (q, k, v, o 1536 x 1536; gate, up 1536 x 3328; down 3328 x 1536),
quantized by torchao (int8 per channel, int4 in groups of 128) and packed for ``specdec::quantized_linear``
(``qlinear.Packed``; about 100 MiB of int8, so the weights come from memory as in decoding), each product of one
row; the time of all 28 products, the thread counts taking turns, ``--repeats`` times, medians. At 1 thread the
operator shares its products with specdec's helper (``SPECDEC_HELPER`` auto: on where the process may use more cores
than torch's threads); at 2 the helper is off and the operator runs on the calling thread (with the split over
torch's threads of commit 47c507a, reverted: each product an OpenMP region, whose end waits for the second thread's
time slice where another process holds that core; specdec/threads.py). The load average is printed.

    OMP_NUM_THREADS=2 python benchmarks/quantized_threads.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specdec import kernels, qlinear, quantized

SHAPES = [(1536, 1536)] * 4 + [(1536, 3328), (1536, 3328), (3328, 1536)]  # (in, out) of one 409M layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    from torchao.quantization import quantize_

    assert kernels.blocked_op(), "specdec's operators do not build here"
    torch.manual_seed(0)
    packs: dict[str, list[tuple[int, qlinear.Packed]]] = {}
    for form in ("int8", "int4"):
        packs[form] = []
        for _ in range(args.layers):
            for k, n in SHAPES:
                layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
                quantize_(layer, quantized.torchao_config(form, 128 if form == "int4" else None))
                packs[form].append((k, qlinear.Packed(layer[0].weight)))
    rows = {k: torch.randn(1, k) for k, _ in SHAPES}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            helper = kernels.helper()
            for form, layers in packs.items():
                start = time.perf_counter()
                for k, packed in layers:
                    packed(rows[k])
                times.setdefault((form, threads), []).append((time.perf_counter() - start) * 1e3)
            print(f"{threads} thread(s), helper {helper}: " + ", ".join(
                f"{form} {times[form, threads][-1]:.1f} ms" for form in packs) + f"; load {os.getloadavg()[0]:.2f}",
                flush=True)
    for (form, threads), each in sorted(times.items()):
        print(f"{form} at {threads} thread(s): median {statistics.median(each):.1f} ms for {len(packs[form])} products "
              f"[{', '.join(f'{t:.1f}' for t in each)}]")


if __name__ == "__main__":
    main()
