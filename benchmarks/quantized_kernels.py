"""Weight-only int8 / int4 products at decode shapes on the CPU: which kernel reaches the memory floor (issue 71, 3).

For the 409M Llama shape's products (K x N: 1536 x 1536 attention, 1536 x 3328 and 3328 x 1536 MLP, 1536 x 8192
head) and n = 1, 2, 5, 9, 16 float32 rows, the time of one product with the weight read from memory (each kernel
cycles through enough copies of the layer, at least ``--megabytes`` in all, that none is in the caches; a product's
time is the pass's over the copies), against the floor: the bytes the kernel reads at the read bandwidth measured in
the same run (the fastest of a sum, a max and a copy of a 256 MiB buffer, interleaved with the kernels). The kernels:

- ``fp32``: ``F.linear`` on float32 weights; ``bf16 x``: ``F.linear`` with bfloat16 activations and weights (not
  exact to a float32 model: listed for torch's speed); ``blocked``: specdec's blocked kernel on the bf16-exact
  weights (bfloat16 pairs, ``kernels.blocked_copy``);
- ``aten int8`` / ``aten int8 bf16x``: ``torch.ops.aten._weight_int8pack_mm`` (weight int8 [N, K], scales [N]) with
  float32 / bfloat16 activations; ``aten int4``: ``_weight_int4pack_mm_for_cpu`` on
  ``_convert_weight_to_int4pack_for_cpu``'s layout, groups of 64 (float32 activations);
- ``torchao int8`` / ``torchao int4``: ``F.linear`` on torchao 0.18's ``Int8Tensor`` / ``IntxUnpackedToInt8Tensor``
  (groups of 64), what transformers runs; ``specdec int8`` / ``specdec int4``: ``specdec::quantized_linear`` on the
  same tensors re-laid (``specdec.qlinear.Packed``).

Each row: median of ``--repeats`` timed passes taken in turn with the other kernels' (and the bandwidth's). Slow
kernels (a product over 20 ms) are timed over two copies. ``ratio`` is time / floor for the kernel's own bytes.

    OMP_NUM_THREADS=1 python benchmarks/quantized_kernels.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from specdec import kernels, qlinear, quantized

SHAPES = ((1536, 1536), (1536, 3328), (3328, 1536), (1536, 8192))  # (K, N)
ROWS = (1, 2, 5, 9, 16)
GROUP = 64


def kernels_for(K: int, N: int) -> dict[str, tuple[callable, int, dict]]:
    """name -> (make(): (state, product(state, x)), bytes read a product)."""
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    w = (torch.randn(N, K) * 0.02).to(torch.bfloat16).float()
    q8 = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False))
    q8[0].weight.data.copy_(w)
    quantize_(q8, quantized.torchao_config("int8", None))
    q4 = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False))
    q4[0].weight.data.copy_(w)
    quantize_(q4, quantized.torchao_config("int4", GROUP))
    i8, s8 = q8[0].weight.qdata, q8[0].weight.scale.reshape(-1)
    lanes = kernels.blocked().lanes
    uint4 = (q4[0].weight.qdata.to(torch.int32) + 8)
    g4 = torch.stack((q4[0].weight.scale.t(), -q4[0].weight.zero_point.float().t() * q4[0].weight.scale.t()), -1)
    return {
        "fp32": (lambda: w.clone(), N * K * 4, lambda s, x: F.linear(x, s)),
        "bf16 x": (lambda: w.to(torch.bfloat16), N * K * 2, lambda s, x: F.linear(x.to(torch.bfloat16), s)),
        "blocked": (lambda: kernels.blocked_copy(w, lanes), N * K * 2,
                    lambda s, x: kernels.blocked_product(kernels.blocked(), x, s, N)),
        "aten int8": (lambda: (i8.clone(), s8.clone()), N * K,
                      lambda s, x: torch.ops.aten._weight_int8pack_mm(x, *s)),
        "aten int8 bf16x": (lambda: (i8.clone(), s8.to(torch.bfloat16)), N * K,
                            lambda s, x: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), *s)),
        "aten int4": (lambda: (torch.ops.aten._convert_weight_to_int4pack_for_cpu(uint4, 1), g4.contiguous()),
                      N * K // 2, lambda s, x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, s[0], GROUP, s[1])),
        "torchao int8": (lambda: q8[0].weight, N * K, lambda s, x: F.linear(x, s)),
        "torchao int4": (lambda: q4[0].weight, N * K, lambda s, x: F.linear(x, s)),
        "specdec int8": (lambda: qlinear.Packed(q8[0].weight), None, lambda s, x: s(x)),
        "specdec int4": (lambda: qlinear.Packed(q4[0].weight), None, lambda s, x: s(x)),
        "specdec int4 fp": (lambda: qlinear.Packed(q4[0].weight), None, lambda s, x: _float_pass(s, x)),
    }


def _float_pass(packed: qlinear.Packed, x: torch.Tensor) -> torch.Tensor:
    """The int4 product by the kernel's float pass (nibbles converted to floats), not its integer (VNNI) pass."""
    previous = qlinear.int4_pass(False)
    try:
        return packed(x)
    finally:
        qlinear.int4_pass(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--megabytes", type=int, default=96)
    parser.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    parser.add_argument("--only", nargs="*", default=None, help="kernel names to time (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels.blocked_op()  # built and loaded first: the helper's state printed is the one the kernels run with
    print(f"{args.threads} threads, helper {'on' if kernels.helper() else 'off'}, torch {torch.__version__}, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    buffer = torch.ones(64 << 20)  # 256 MiB

    copy = torch.empty_like(buffer)

    def bandwidth() -> float:  # the fastest of three plain reads of the buffer (a copy counts its write)
        rates = []
        for read, moved in ((buffer.sum, 1), (buffer.max, 1), (lambda: copy.copy_(buffer), 2)):
            start = time.perf_counter()
            read()
            rates.append(moved * buffer.numel() * 4 / (time.perf_counter() - start))
        return max(rates)

    torch.set_grad_enabled(False)
    for K, N in SHAPES:
        table = kernels_for(K, N)
        names = [n for n in table if args.only is None or n in args.only]
        states: dict[str, list] = {}
        sizes: dict[str, int] = {}
        for name in names:
            make, size, product = table[name]
            first = make()
            size = size or first.nbytes
            copies = max(2, -(-args.megabytes * 2**20 // size))
            x = torch.randn(16, K)
            start = time.perf_counter()
            product(first, x)
            if time.perf_counter() - start > 0.02:
                copies = 2
            states[name] = [first] + [make() for _ in range(copies - 1)]
            sizes[name] = size
        for n in args.rows:
            x = torch.randn(n, K)
            times: dict[str, list[float]] = {name: [] for name in names}
            rates: list[float] = []
            for repeat in range(args.repeats + 1):
                for name in names:
                    product = table[name][2]
                    start = time.perf_counter()
                    for state in states[name]:
                        product(state, x)
                    if repeat:
                        times[name].append((time.perf_counter() - start) / len(states[name]))
                rates.append(bandwidth())
            rate = statistics.median(rates[1:])
            line = [f"K {K} N {N} n {n:2d} (read {rate / 1e9:.1f} GB/s, load {os.getloadavg()[0]:.2f}):"]
            for name in names:
                t = statistics.median(times[name])
                line.append(f"  {name:16s} {t * 1e3:8.3f} ms  {sizes[name] / 2**20:6.2f} MiB  "
                            f"{t / (sizes[name] / rate):6.2f}x its floor")
            print("\n".join(line), flush=True)
        del states


if __name__ == "__main__":
    main()
