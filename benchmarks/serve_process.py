"""``specdec serve`` in a process of its own, driven by the serve bench's clients: one mode, one client count.

``specdec bench --serve`` runs its servers in its own process, beside its client threads; this launches the real
command (``python -m specdec serve``, the shipped pair, ``--compile``, ``--threads``, a batch of 16) and times it
as the bench times a cell: closed-loop streaming clients (``specdec.bench.serve.drive``), the bench's built-in
code prompts (``--num-prompts``, cycled to at least one request per client), greedy, 64 new tokens; one untimed
pass, then ``--repeats`` timed ones, each printed (median latency, total tokens/s, median time to first token).
Run it on the same tree before and after a change to the server's path (findings: docs/journal/server.md, "Joining
rows prefilled apart"):

    OMP_NUM_THREADS=1 python benchmarks/serve_process.py --speculate off --clients 16
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys

from transformers import AutoTokenizer

from specdec.bench.config import BenchConfig
from specdec.bench.prompts import load_prompts
from specdec.bench.serve import Endpoint, _bodies, drive, first_reply_s
from specdec.bench.vllm_server import ServerProcess, free_port
from specdec.folders import resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speculate", choices=("off", "on", "auto"), default="off")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", choices=("on", "off", "auto"), default="on")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--front", choices=("process", "thread"), default="process")
    args = parser.parse_args()
    config = BenchConfig(num_prompts=args.num_prompts)
    target = str(resolve_model_path("code-target"))
    prompts = load_prompts(None, args.num_prompts, config.seed, AutoTokenizer.from_pretrained(target))
    port = free_port()
    command = [sys.executable, "-m", "specdec", "serve", "--target", target, "--drafter", "lookup+code-drafter",
               "--port", str(port), "--threads", str(args.threads), "--compile", args.compile,
               "--speculate", args.speculate, "--batch-size", "16", "--front", args.front]
    server = ServerProcess(command, {**os.environ, "PYTHONUNBUFFERED": "1"}, "serve-process-")
    # a SIGTERM (``timeout``) ends this process through the ``finally`` below, which stops the server: a server left
    # behind by a timed-out run spent 15% of a core through the next measurements here
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        endpoint = Endpoint(port)
        probe = {"prompt": prompts[0].input_ids.tolist(), "max_tokens": 1, "temperature": 0.0, "stream": True}
        print("launch to first reply "
              f"{first_reply_s(endpoint, probe, server.launched, server.alive, 'specdec serve', 600):.1f} s")
        bodies = _bodies(prompts, max(args.num_prompts, args.clients), config, 0.0)
        drive(endpoint, bodies, args.clients)  # untimed
        for repeat in range(args.repeats):
            replies, wall = drive(endpoint, bodies, args.clients)
            tokens = sum(len(r.tokens) for r in replies)
            print(f"{args.speculate} {args.clients} clients, pass {repeat + 1}: p50 latency "
                  f"{statistics.median(r.latency_s for r in replies):.3f} s, {tokens / wall:.1f} tokens/s, p50 TTFT "
                  f"{statistics.median(r.ttft_s for r in replies):.3f} s", flush=True)
    finally:
        server.close()


if __name__ == "__main__":
    main()
