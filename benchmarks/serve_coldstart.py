"""``specdec serve`` started as a user starts it the first time: ``--compile auto`` (the default) with an empty
compile cache, so it serves eagerly while a child compiles its buckets, then switches (specdec/serve/background.py).

Launches the real command (the shipped pair, ``--threads``, a batch of 16) with ``XDG_CACHE_HOME`` pointing at a new
temporary folder (or ``--cache-dir``: run it twice with the same folder to time a second start), prints the launch
to its first reply, then drives passes of the bench's code prompts (closed-loop streaming clients, greedy, 64 new
tokens, as ``specdec bench --serve`` does) back to back, one line a pass: seconds since launch, what ``/stats`` says
of the compile, the median latency, tokens/s; until the server has switched and ``--after`` more passes ran. Every
reply is checked against the first pass's tokens (eager and compiled greedy decoding agree up to near ties).
Findings: docs/journal/2026-12-06-background-compile.md, "The server compiles beside serving".

    OMP_NUM_THREADS=1 python benchmarks/serve_coldstart.py --clients 1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request

from transformers import AutoTokenizer

from specdec.bench.config import BenchConfig
from specdec.bench.prompts import load_prompts
from specdec.bench.serve import Endpoint, _bodies, drive, first_reply_s
from specdec.bench.vllm_server import ServerProcess, free_port
from specdec.folders import resolve_model_path


def compile_state(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=30) as reply:
        return json.load(reply)["models"][0]["compile"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--after", type=int, default=5, help="passes once the server serves compiled")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds from launch to give up")
    parser.add_argument("--cache-dir", help="XDG_CACHE_HOME for the server (default: a new temporary folder)")
    args = parser.parse_args()
    config = BenchConfig(num_prompts=args.num_prompts)
    target = str(resolve_model_path("code-target"))
    prompts = load_prompts(None, args.num_prompts, config.seed, AutoTokenizer.from_pretrained(target))
    cache = args.cache_dir or tempfile.mkdtemp(prefix="specdec-coldstart-")
    port = free_port()
    command = [sys.executable, "-m", "specdec", "serve", "--target", target, "--drafter", "lookup+code-drafter",
               "--port", str(port), "--threads", str(args.threads), "--batch-size", "16"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": cache, "SPECDEC_COMPILE_BESIDE": "auto"}
    server = ServerProcess(command, env, "serve-coldstart-")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        endpoint = Endpoint(port)
        probe = {"prompt": prompts[0].input_ids.tolist(), "max_tokens": 1, "temperature": 0.0, "stream": True}
        print(f"XDG_CACHE_HOME={cache}; launch to first reply "
              f"{first_reply_s(endpoint, probe, server.launched, server.alive, 'specdec serve', 600):.1f} s",
              flush=True)
        bodies = _bodies(prompts, max(args.num_prompts, args.clients), config, 0.0)
        first: dict[int, list[int]] | None = None
        after = None
        while time.perf_counter() - server.launched < args.timeout and (after is None or after < args.after):
            state = compile_state(port)
            replies, wall = drive(endpoint, bodies, args.clients)
            tokens = {r.prompt: r.tokens for r in replies}
            first = first or tokens
            equal = sum(tokens[i] == first[i] for i in tokens)
            compiled = not state.startswith("auto: compiling")
            after = (after or 0) + 1 if compiled else None
            print(f"{time.perf_counter() - server.launched:6.1f} s {'compiled' if compiled else 'eager   '} "
                  f"p50 latency {statistics.median(r.latency_s for r in replies):.3f} s, "
                  f"{sum(len(r.tokens) for r in replies) / wall:.1f} tokens/s, {equal}/{len(tokens)} as the first pass",
                  flush=True)
        print(f"compile: {compile_state(port)}")
    finally:
        server.close()


if __name__ == "__main__":
    main()
