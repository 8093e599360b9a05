"""Batch 1 against the single-prompt path the batched core replaced (commit a3dbb50): issue 28's bookkeeping goal.

The shipped pair (``models/code-target``; ``lookup+code-drafter``, the drafter model alone with γ 4, and plain
decoding), greedy, batch 1, one torch thread, the built-in held-out code prompts, one ``speculative_generate``
(or ``autoregressive_generate``) call per prompt. Each tree runs in its own process (``PYTHONPATH`` = the tree),
the trees taking turns in an order that rotates per repeat, so the machine's load drifts across all of them.
Both trees make the same forwards (the script checks that every tree's tokens and rounds are the same); what
differs is the Python around them. Per run: wall seconds, CPU seconds (``time.process_time``), the CPU seconds
inside the models' forwards and outside them (the loop's bookkeeping, per-call setup included), medians over the
repeats, and each tree's ratio to the first tree named; each run names the linear kernels its models took
(``specdec.kernels.describe``: auto's probe decides in each process).

    git worktree add /tmp/specdec-a3dbb50 a3dbb50
    python benchmarks/batch1_loop.py --trees old=/tmp/specdec-a3dbb50 new=. --repeats 3

On a GPU the loop's host time is most of a token (docs/benchmarks.md, "On a GPU"): ``--device cuda --compile on``
decodes with each step a CUDA graph (``specdec.compiled.prepare``). Compare ms per token there: a compiled step does
not pass through ``model.forward`` (only the prefill is "inside the forwards"), and CPU seconds include the host's
waits for the device (CUDA spins). Two trees on one machine, e.g.

    python benchmarks/batch1_loop.py --trees before=/tmp/before after=. --device cuda --compile on --methods \\
        plain lookup

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


def worker(method: str, prompts: int, new_tokens: int, device: str = "cpu", compile_mode: str = "off",
           probe: bool = False) -> dict:
    """One process's run: every prompt decoded once (after a warm-up), timed; tokens and rounds for the check."""
    import functools

    import torch

    from specdec import decode
    from specdec.loading import load_model, load_tokenizer

    torch.set_num_threads(1)
    target = load_model(MODELS / "code-target", device=device, dtype="fp32")
    drafter = None if method == "plain" else load_model(MODELS / "code-drafter", device=device, dtype="fp32")
    if compile_mode == "on":
        from specdec.compiled import prepare

        prepare(target, "on", tokens=(1,) if method == "plain" else (1, 5, 13))
        if drafter is not None:
            prepare(drafter, "on", tokens=(1, 2))
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

    for prompt in ids[:2]:  # warm-up (on CUDA the graphs are captured at first use)
        run(prompt)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    inside[0] = 0.0
    wall, cpu = time.perf_counter(), time.process_time()
    results = [run(prompt) for prompt in ids]
    sync()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    try:
        from specdec.kernels import describe
    except ImportError:  # a tree from before specdec's linear kernels (a3dbb50)
        def describe(model: torch.nn.Module) -> str:
            return "torch"

    record = {"wall": wall, "cpu": cpu, "forward": inside[0], "outside": cpu - inside[0],
              "tokens": [list(r.tokens) for r in results], "rounds": sum(r.stats.rounds for r in results),
              "linear": "; ".join(f"{name} {describe(m)}" for name, m in (("target", target), ("drafter", drafter))
                                  if m is not None)}
    if probe:
        record.update(probed(lambda: [run(prompt) for prompt in ids[:3]], device))
    return record


def probed(runs: object, device: str) -> dict:
    """Where the loop's host time goes, over ``runs()`` (a few prompts): the functions with the most own time
    (cProfile), and on CUDA each place the host waits for the device (torch's sync debug mode, per round)."""
    import cProfile
    import io
    import pstats
    import warnings

    import torch

    profile = cProfile.Profile()
    profile.enable()
    results = runs()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
    waits: dict[str, int] = {}
    if device == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                results = runs()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            where = f"{w.filename.split('site-packages/')[-1]}:{w.lineno}"
            waits[where] = waits.get(where, 0) + 1
    rounds = sum(r.stats.rounds for r in results)
    return {"profile": text.getvalue(), "waits_per_round": {k: v / rounds for k, v in sorted(waits.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=None, help="NAME=PATH of each source tree; the first is the base")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--compile", default="off", choices=("off", "on"),
                        help="on: specdec.compiled.prepare each model")
    parser.add_argument("--probe", action="store_true", help="print each tree's cProfile top and, on CUDA, its host "
                        "waits per round (torch's sync debug mode), from its first repeat")
    parser.add_argument("--run", nargs=2, metavar=("TREE", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(worker(args.run[1], args.prompts, args.new, args.device, args.compile, args.probe)))
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
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (path, os.environ.get("PYTHONPATH")))),
                       "OMP_NUM_THREADS": "1"}
                out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run", name, method,
                                      "--prompts", str(args.prompts), "--new", str(args.new),
                                      "--device", args.device, "--compile", args.compile,
                                      *(["--probe"] if args.probe and repeat == 0 else [])],
                                     env=env, cwd=path, capture_output=True, text=True, check=True)
                record = json.loads(out.stdout.strip().splitlines()[-1])
                record["load"] = os.getloadavg()[0]
                runs.setdefault((method, name), []).append(record)
                if "profile" in record:
                    print(f"-- {method} {name}: host waits per round {json.dumps(record['waits_per_round'])}\n"
                          + "\n".join(record["profile"].splitlines()[:30]), flush=True)
                print(f"{method:6} {name:6} repeat {repeat + 1}: wall {record['wall']:.2f} s, cpu {record['cpu']:.2f} "
                      f"s, outside the forwards {record['outside']:.3f} s (load {record['load']:.1f}; linear: "
                      f"{record['linear']})", flush=True)
    print(f"\nmedians of {args.repeats} (1 thread, {args.device}, compile {args.compile}, {args.prompts} prompts x "
          f"{args.new} tokens); ratio = tree / {names[0]}")
    for method in args.methods:
        first = runs[(method, names[0])]
        same = all(r["tokens"] == first[0]["tokens"] and r["rounds"] == first[0]["rounds"]
                   for name in names for r in runs[(method, name)])
        base = {key: statistics.median(r[key] for r in first) for key in ("wall", "cpu", "outside")}
        tokens = sum(len(t) for t in first[0]["tokens"])
        for name in names:
            median = {key: statistics.median(r[key] for r in runs[(method, name)])
                      for key in ("wall", "cpu", "outside")}
            print(f"{method:6} {name:6} wall {median['wall']:6.2f} s ({median['wall'] / base['wall']:.3f}x)  "
                  f"cpu {median['cpu']:6.2f} s ({median['cpu'] / base['cpu']:.3f}x)  outside the forwards "
                  f"{median['outside']:.3f} s  {1e3 * median['wall'] / tokens:.3f} ms/token  rounds "
                  f"{first[0]['rounds']}  same tokens: {same}")


if __name__ == "__main__":
    main()
