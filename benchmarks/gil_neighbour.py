"""What a busy Python neighbour costs the decoder: ``python benchmarks/gil_neighbour.py``.

The server's app (uvicorn, detokenizing, JSON) is Python beside the engine's worker. This runs the decoder alone
(``benchmarks/batch_rows.py``: the shipped pair compiled, the bench's 12 code prompts twice, batches of
``--batch-size`` rows, ``--speculate auto``) with a neighbour that spins in Python for ``--burst`` ms and then sleeps
``--sleep`` ms, over and over (the app's share of a core at 4 clients, about 10%): none, on a thread of this process
(it takes turns with the worker on the GIL), or in a process of its own (it only takes a core's time). The three
take turns, ``--rounds`` times, each in a fresh process; every run's tokens/s is printed, then each neighbour's
median over its runs against none's. Findings: docs/journal/2026-12-06-http-front-process.md, "The HTTP front in a
process of its own".

    OMP_NUM_THREADS=1 python benchmarks/gil_neighbour.py
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

NEIGHBOURS = ("none", "thread", "process")


def spin(burst_s: float, sleep_s: float) -> None:
    """Python busy for ``burst_s``, then asleep for ``sleep_s``, forever."""
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < burst_s:
            pass
        time.sleep(sleep_s)


def run(neighbour: str, burst_s: float, sleep_s: float, batch_size: int) -> None:
    """One decoding run beside ``neighbour`` (in this process)."""
    if neighbour == "thread":
        threading.Thread(target=spin, args=(burst_s, sleep_s), daemon=True).start()
    elif neighbour == "process":
        multiprocessing.get_context("spawn").Process(target=spin, args=(burst_s, sleep_s), daemon=True).start()
    sys.path.insert(0, str(Path(__file__).parent))
    import batch_rows

    sys.argv = ["batch_rows.py", "--batch-size", str(batch_size), "--speculate", "auto", "--copies", "2",
                "--repeats", "3"]
    batch_rows.main()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=float, default=0.7, help="ms the neighbour spins (default: %(default)s)")
    parser.add_argument("--sleep", type=float, default=6.0, help="ms it then sleeps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=NEIGHBOURS, help=argparse.SUPPRESS)  # a single run, in this process
    args = parser.parse_args()
    if args.one:
        run(args.one, args.burst / 1000, args.sleep / 1000, args.batch_size)
        return
    found: dict[str, list[float]] = {n: [] for n in NEIGHBOURS}
    for _ in range(args.rounds):
        for neighbour in NEIGHBOURS:
            out = subprocess.run([sys.executable, __file__, "--one", neighbour, "--burst", str(args.burst), "--sleep",
                                  str(args.sleep), "--batch-size", str(args.batch_size)],
                                 capture_output=True, text=True, check=True).stdout
            rates = [float(r) for r in re.findall(r"([\d.]+) tokens/s", out)][1:]  # the first run warms up
            found[neighbour] += rates
            print(f"{neighbour:8} " + " ".join(f"{r:.1f}" for r in rates) + " tokens/s", flush=True)
    base = statistics.median(found["none"])
    for neighbour, rates in found.items():
        print(f"{neighbour}: median {statistics.median(rates):.1f} tokens/s, "
              f"{statistics.median(rates) / base:.2f}x none")


if __name__ == "__main__":
    main()
