"""Batch 1 against the single-prompt path the batched core replaced (commit a3dbb50): issue 28's bookkeeping goal.

The shipped pair (``models/code-target``; ``lookup+code-drafter``, the drafter model alone with γ 4, and plain
decoding), greedy, batch 1, one torch thread, the built-in held-out code prompts, one ``speculative_generate``
(or ``autoregressive_generate``) call per prompt. Each tree runs in its own process (``PYTHONPATH`` = the tree),
the trees taking turns in an order that rotates per repeat, so the machine's load drifts across all of them.
Both trees make the same forwards (the script checks that every tree's tokens and rounds are the same); what
differs is the Python around them. Per run: wall seconds, CPU seconds (``time.process_time``), the CPU seconds
inside the models' forwards and outside them (the loop's bookkeeping, per-call setup included), medians over the
repeats, and each tree's ratio to the first tree named.

    git worktree add /tmp/specdec-a3dbb50 a3dbb50
    python benchmarks/batch1_loop.py --trees old=/tmp/specdec-a3dbb50 new=. --repeats 3

(``--run TREE METHOD`` is the per-process worker; it runs against whichever ``specdec`` is importable.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = Path(__file__).resolve().parent.parent / "models"
METHODS = ("lookup", "model", "plain")


def worker(method: str, prompts: int, new_tokens: int) -> dict:
    """One process's run: every prompt decoded once (after a warm-up), timed; tokens and rounds for the check."""
    import functools

    import torch

    from specdec import decode
    from specdec.loading import load_model, load_tokenizer

    torch.set_num_threads(1)
    target = load_model(MODELS / "code-target", device="cpu", dtype="fp32")
    drafter = None if method == "plain" else load_model(MODELS / "code-drafter", device="cpu", dtype="fp32")
    tokenizer = load_tokenizer(MODELS / "code-target")
    from specdec.data.prompts import code_completion_prompts

    ids = [tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]
           for p in code_completion_prompts(prompts, split="test", seed=0)]
    inside = [0.0]

    def timed(model: torch.nn.Module) -> None:  # CPU time inside the model's forward
        inner = model.forward

        @functools.wraps(inner)
        def forward(*args: object, **kwargs: object) -> object:
            start = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                inside[0] += time.process_time() - start

        model.forward = forward

    for model in (target, drafter):
        if model is not None:
            timed(model)

    def lookup() -> object:  # prompt lookup first, the drafter model otherwise (named differently at a3dbb50)
        from specdec.drafters import hybrid

        if hasattr(hybrid, "LookupDrafter"):
            from specdec.drafters.model import ModelDrafter

            return hybrid.LookupDrafter(ModelDrafter(drafter))
        return hybrid.LookupModelDrafter(drafter)

    def run(prompt: list[int]) -> object:
        if method == "plain":
            return decode.autoregressive_generate(target, prompt, max_new_tokens=new_tokens)
        return decode.speculative_generate(target, lookup() if method == "lookup" else drafter, prompt,
                                           max_new_tokens=new_tokens, gamma=4)

    run(ids[0][:20])  # warm-up
    inside[0] = 0.0
    wall, cpu = time.perf_counter(), time.process_time()
    results = [run(prompt) for prompt in ids]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall": wall, "cpu": cpu, "forward": inside[0], "outside": cpu - inside[0],
            "tokens": [list(r.tokens) for r in results], "rounds": sum(r.stats.rounds for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=None, help="NAME=PATH of each source tree; the first is the base")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--run", nargs=2, metavar=("TREE", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(worker(args.run[1], args.prompts, args.new)))
        return
    if not args.trees:
        parser.error("--trees NAME=PATH ... is required (e.g. old=/tmp/specdec-a3dbb50 new=.)")
    trees = dict(tree.split("=", 1) for tree in args.trees)
    runs: dict[tuple[str, str], list[dict]] = {}
    names = list(trees)
    for repeat in range(args.repeats):
        for method in args.methods:
            for j in range(len(names)):
                name = names[(j + repeat) % len(names)]
                path = str(Path(trees[name]).resolve())
                env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
                out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run", name, method,
                                      "--prompts", str(args.prompts), "--new", str(args.new)],
                                     env=env, cwd=path, capture_output=True, text=True, check=True)
                record = json.loads(out.stdout.strip().splitlines()[-1])
                record["load"] = os.getloadavg()[0]
                runs.setdefault((method, name), []).append(record)
                print(f"{method:6} {name:6} repeat {repeat + 1}: wall {record['wall']:.2f} s, cpu {record['cpu']:.2f} s, "
                      f"outside the forwards {record['outside']:.3f} s (load {record['load']:.1f})", flush=True)
    print(f"\nmedians of {args.repeats} (1 thread, {args.prompts} prompts x {args.new} tokens); ratio = tree / {names[0]}")
    for method in args.methods:
        first = runs[(method, names[0])]
        same = all(r["tokens"] == first[0]["tokens"] and r["rounds"] == first[0]["rounds"]
                   for name in names for r in runs[(method, name)])
        base = {key: statistics.median(r[key] for r in first) for key in ("wall", "cpu", "outside")}
        for name in names:
            median = {key: statistics.median(r[key] for r in runs[(method, name)]) for key in ("wall", "cpu", "outside")}
            print(f"{method:6} {name:6} wall {median['wall']:6.2f} s ({median['wall'] / base['wall']:.3f}x)  "
                  f"cpu {median['cpu']:6.2f} s ({median['cpu'] / base['cpu']:.3f}x)  outside the forwards "
                  f"{median['outside']:.3f} s  rounds {first[0]['rounds']}  same tokens: {same}")


if __name__ == "__main__":
    main()
