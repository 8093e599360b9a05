"""How long does a second start of ``--compile on`` take? ``python benchmarks/compile_cache.py``.

Each start is a fresh process (``--child``) that loads a model and compiles its step for some token buckets
(rows of 1), timed. The first start of each path runs on an empty cache folder (``XDG_CACHE_HOME`` and
``TORCHINDUCTOR_CACHE_DIR`` inside a temporary folder), the later ones on the folder it filled. Paths:

- ``aot``: what ``specdec.compiled.prepare`` ships: each bucket compiled ahead of time (dynamo's
  ``aot_compile``) and saved; a second start loads it instead of tracing;
- ``dynamo``: ``torch.compile`` of the same step, as the path of before (inductor's options ``--freezing``:
  with freezing, AOT autograd's cache is bypassed; without, it is used, and Dynamo still traces every start).

Every start checks the compiled step against the eager one (as ``prepare`` does). ``--steps`` times the
compiled steps afterwards in one process, ``dynamo`` with freezing (the path of before) against ``aot``,
interleaved, medians, one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def inputs(step: object, n: int, used: int) -> tuple[object, ...]:
    """A compiled step's arguments for ``n`` new tokens after ``used`` cached ones (row of 1, a fresh cache)."""
    import torch

    from specdec.compiled import attended

    with torch.inference_mode():
        cache = step.new_cache(1, "cpu")
        live = torch.zeros(1, step.slots + 1, dtype=torch.bool)[:, : attended(used + n, step.slots)]
        live[:, : used + n] = True
        for layer in cache.layers:
            layer.cumulative_length.fill_(used)
        torch._dynamo.mark_dynamic(live, 1)
        ids = torch.randint(0, step.model.config.get_text_config().vocab_size, (1, n))
        return (ids, live, torch.arange(used, used + n)[None], torch.tensor(used), cache, False)


def child(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    import torch

    from specdec import compiled, kernels
    from specdec.compiled import prepare
    from specdec.loading import load_model

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    loaded = time.perf_counter()
    if args.path == "aot":
        choice = prepare(model, "on", tokens=tuple(args.tokens))
        cached, reason = compiled.compiled_for(model).loaded, choice.reason
    else:
        compiled.use_cache_folder()
        torch._dynamo.config.recompile_limit = 256
        step = compiled.CompiledModel(model, compiled.SLOTS + compiled.SLOT_SLACK)
        fn = torch.compile(step._step, fullgraph=True, options={"freezing": bool(args.freezing)})
        for n in args.tokens:  # compiled, and one eager step beside it (prepare's check)
            with torch.inference_mode(), kernels.active(), torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                fn(*inputs(step, n, 3))
                step._step(*inputs(step, n, 3))
        cached, reason = 0, ""
    print(json.dumps({"load_s": loaded - started, "compile_s": time.perf_counter() - loaded, "from_cache": cached,
                      "reason": reason}))


def steps(args: argparse.Namespace) -> None:
    import torch

    from specdec import compiled
    from specdec.compiled import prepare
    from specdec.loading import load_model

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    prepare(model, "on", tokens=tuple(args.tokens))
    step = compiled.compiled_for(model)
    frozen = torch.compile(step._step, fullgraph=True, options={"freezing": True})
    for used in args.cached:
        times: dict[tuple[str, int], list[float]] = {(v, n): [] for v in ("dynamo", "aot") for n in args.tokens}
        with torch.inference_mode():
            for i in range(args.repeats + 2):
                for n in args.tokens:
                    for variant, fn in (("dynamo", frozen), ("aot", step._graph)):
                        call = inputs(step, n, used)
                        begin = time.perf_counter()
                        fn(*call)
                        if i >= 2:
                            times[(variant, n)].append(time.perf_counter() - begin)
        for n in args.tokens:
            old, new = (statistics.median(times[(v, n)]) * 1e3 for v in ("dynamo", "aot"))
            print(f"{args.model}, {used} cached, {n} token(s): dynamo (freezing) {old:.2f} ms, aot {new:.2f} ms "
                  f"({new / old:.2f}), {args.threads} thread(s), load {os.getloadavg()[0]:.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="code-target")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--paths", nargs="+", default=["aot", "dynamo"], choices=("aot", "dynamo"))
    parser.add_argument("--path", default="aot", choices=("aot", "dynamo"), help=argparse.SUPPRESS)
    parser.add_argument("--freezing", type=int, default=0, help="inductor's freezing for the dynamo path")
    parser.add_argument("--starts", type=int, default=3, help="starts per path: the first on an empty cache")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", action="store_true", help="then time the compiled steps")
    parser.add_argument("--cached", type=int, nargs="+", default=[40, 200])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    for path in args.paths:
        with tempfile.TemporaryDirectory() as folder:
            env = {**os.environ, "XDG_CACHE_HOME": folder, "TORCHINDUCTOR_CACHE_DIR": str(Path(folder) / "inductor"),
                   "OMP_NUM_THREADS": str(args.threads)}
            for start in range(args.starts):
                command = [sys.executable, __file__, "--child", "--path", path, "--model", args.model,
                           "--freezing", str(args.freezing), "--threads", str(args.threads),
                           "--tokens", *map(str, args.tokens)]
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                result = json.loads(done.stdout.splitlines()[-1])
                print(f"{args.model} {path}{f' (freezing {args.freezing})' if path == 'dynamo' else ''}, tokens "
                      f"{args.tokens}, start {start + 1} ({'empty' if start == 0 else 'warm'} cache): load "
                      f"{result['load_s']:.1f} s, compile {result['compile_s']:.1f} s, {result['from_cache']} "
                      f"from the cache, {args.threads} thread(s), load {os.getloadavg()[0]:.1f}", flush=True)
    if args.steps:
        steps(args)


if __name__ == "__main__":
    main()
