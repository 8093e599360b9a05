"""Decoding beside one busy process (issue 28's busy-sibling goal): speculation ≥ 1.5× plain, nothing ≥ 2× slower.

The shipped pair, greedy, batch 1, the built-in held-out code prompts, one ``speculative_generate`` (or
``autoregressive_generate``) call per prompt, in one process whose torch thread count is specdec's default
(``specdec.threads.use_threads``: one thread for a target this small) or ``--threads N`` (``--threads 0``: torch's
own default, one per logical CPU, as an un-managed program gets). Each repeat times every method twice, once
with the machine as it is and once beside a sibling: another process spinning on the CPU (pure Python, no
threads), started before the timed run and stopped after it; the order of methods and of quiet/busy turns
rotates per repeat so the machine's own load drifts across all of them. Printed per method: median seconds per
token quiet and busy, their ratio (busy ÷ quiet: the goal is < 2), and speculation's speedup over plain in each
condition (the goal: ≥ 1.5 busy). The load average is printed beside each turn; tokens are checked equal across
turns (the same greedy output).

    python benchmarks/busy_sibling.py --repeats 3
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from pathlib import Path

MODELS = Path(__file__).resolve().parent.parent / "models"
METHODS = ("plain", "lookup+code-drafter", "code-drafter")


def spin() -> None:
    """A CPU-bound sibling: one core's worth of pure Python, until killed."""
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2147483648


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: specdec's choice; 0: torch's own default)")
    args = parser.parse_args()

    import torch

    from specdec import decode
    from specdec.data.prompts import code_completion_prompts
    from specdec.loading import load_model, load_tokenizer
    from specdec.threads import use_threads

    if args.threads == 0:
        threads = f"{torch.get_num_threads()} (torch's default)"
    else:
        choice = use_threads(args.threads, model=MODELS / "code-target")
        threads = f"{choice.threads} ({choice.source})"
    target = load_model(MODELS / "code-target", device="cpu", dtype="fp32")
    tokenizer = load_tokenizer(MODELS / "code-target")
    ids = [tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]
           for p in code_completion_prompts(args.prompts, split="test", seed=0)]

    def run(method: str) -> tuple[float, list]:
        start = time.perf_counter()
        if method == "plain":
            results = [decode.autoregressive_generate(target, p, max_new_tokens=args.new) for p in ids]
        else:
            results = [decode.speculative_generate(target, method, p, max_new_tokens=args.new, gamma=4) for p in ids]
        seconds = time.perf_counter() - start
        return seconds / sum(len(r.tokens) for r in results), [list(r.tokens) for r in results]

    for method in METHODS:  # warm-up: loads, first-call costs
        run(method)
    times: dict[tuple[str, bool], list[float]] = {}
    reference: dict[str, list] = {}
    print(f"torch threads: {threads}; {os.cpu_count()} logical CPUs; {args.prompts} prompts x {args.new} tokens")
    for repeat in range(args.repeats):
        order = METHODS[repeat % len(METHODS):] + METHODS[:repeat % len(METHODS)]
        for method in order:
            for busy in ((False, True) if repeat % 2 == 0 else (True, False)):
                sibling = multiprocessing.Process(target=spin, daemon=True) if busy else None
                if sibling is not None:
                    sibling.start()
                    time.sleep(0.5)  # let it take its core
                try:
                    per_token, tokens = run(method)
                finally:
                    if sibling is not None:
                        sibling.kill()
                        sibling.join()
                if reference.setdefault(method, tokens) != tokens:
                    raise SystemExit(f"{method}: the tokens differ between turns (greedy output must not)")
                times.setdefault((method, busy), []).append(per_token)
                print(f"  repeat {repeat + 1} {method:22s} {'busy ' if busy else 'quiet'} "
                      f"{per_token * 1e3:6.2f} ms/token  load {os.getloadavg()[0]:.2f}", flush=True)
    median = {key: statistics.median(value) for key, value in times.items()}
    print(f"\n{'method':22s} {'quiet ms/tok':>12s} {'busy ms/tok':>12s} {'busy/quiet':>10s} "
          f"{'x plain quiet':>13s} {'x plain busy':>12s}")
    for method in METHODS:
        quiet, busy = median[method, False], median[method, True]
        print(f"{method:22s} {quiet * 1e3:12.2f} {busy * 1e3:12.2f} {busy / quiet:10.2f} "
              f"{median['plain', False] / quiet:13.2f} {median['plain', True] / busy:12.2f}")


if __name__ == "__main__":
    main()
