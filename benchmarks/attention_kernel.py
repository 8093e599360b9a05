"""specdec's decode attention against a plain read of the same keys and values and SDPA: ``python
benchmarks/attention_kernel.py --rows 4 --slots 250``.

Six layers of code-target's attention shape (8 heads of 64, a static cache of 528 slots a row), one new token a row
(``--tokens``), every slot live: ``torch.ops.specdec.decode_attention`` (``csrc/attention.c``), a ``sum`` over the
same keys and values (what reading them costs here), and ``F.scaled_dot_product_attention``; each timed from memory
(a 64 MB buffer written before every pass), medians of 15, one thread. To compare two versions of the kernel, run it
on each tree in turn (the operator is built once per source). Findings:
docs/journal/2026-11-29-weight-streams-server-time.md, "Weights read as several
streams, and where the server's time goes at 4 clients".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import kernels

LAYERS, HEADS, DIM, SLOTS = 6, 8, 64, 528


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--slots", type=int, default=250)
    parser.add_argument("--tokens", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not kernels.blocked_op():
        raise SystemExit("specdec's operators do not build here "
                         "(a C and a C++ compiler and torch's headers are needed)")
    rows, slots, tokens = args.rows, args.slots, args.tokens
    keys = [torch.randn(rows, HEADS, SLOTS, DIM) for _ in range(LAYERS)]
    values = [torch.randn(rows, HEADS, SLOTS, DIM) for _ in range(LAYERS)]
    query = torch.randn(rows, HEADS, tokens, DIM)
    mask = torch.zeros(rows, tokens, slots)
    evict = torch.randn(16 * 1024 * 1024)

    def specdec() -> None:
        for k, v in zip(keys, values):
            torch.ops.specdec.decode_attention(query, k[:, :, :slots], v[:, :, :slots], mask, DIM ** -0.5)

    def read() -> None:
        for k, v in zip(keys, values):
            k[:, :, :slots].sum()
            v[:, :, :slots].sum()

    def sdpa() -> None:
        for k, v in zip(keys, values):
            torch.nn.functional.scaled_dot_product_attention(query, k[:, :, :slots], v[:, :, :slots],
                                                             attn_mask=mask[:, None])

    megabytes = LAYERS * 2 * rows * HEADS * slots * DIM * 4 / 1e6
    with torch.inference_mode():
        for name, run in (("specdec", specdec), ("read", read), ("sdpa", sdpa)):
            times = []
            for _ in range(15):
                evict.mul_(1.0)
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            ms = 1000 * statistics.median(times)
            print(f"{rows} rows x {tokens} tokens, {slots} slots: {name} {ms:.2f} ms ({megabytes / ms:.1f} GB/s of "
                  "keys and values)", flush=True)


if __name__ == "__main__":
    main()
