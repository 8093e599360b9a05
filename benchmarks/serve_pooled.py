"""Reply times of ``specdec serve`` on a pooled connection (as the openai client, httpx and Prometheus keep one)
against a fresh connection a request: ``/health``, ``/v1/models``, and a 1-token greedy completion.

Launches the real command (``--target``/``--drafter`` as given, the shipped pair by default, one thread), then for
each request times ``--repeats`` calls on one kept-alive ``httpx2`` client (the openai client's transport here) and
as many on a new connection each, and prints the median and the 90th percentile of each in ms. A reply that waits
on the peer's delayed ACK (Nagle's algorithm on a socket without TCP_NODELAY) shows as ~40 ms on the pooled
connection only. Findings: docs/journal/2026-12-07-tcp-nodelay.md, "Replies on a pooled connection".

    OMP_NUM_THREADS=1 python benchmarks/serve_pooled.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import httpx2

from specdec.bench.vllm_server import ServerProcess, free_port

REQUESTS = {"/health": ("GET", None), "/v1/models": ("GET", None),
            "1-token completion": ("POST", {"prompt": "def add(a, b):", "max_tokens": 1, "temperature": 0})}


def timed(client: httpx2.Client, base: str, method: str, path: str, body: dict | None) -> float:
    started = time.perf_counter()
    reply = client.request(method, base + path, json=body)
    reply.read()
    elapsed = time.perf_counter() - started
    if reply.status_code != 200:
        raise SystemExit(f"{method} {path}: {reply.status_code} {reply.text[:200]}")
    return elapsed * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="code-target")
    parser.add_argument("--drafter", default="code-drafter")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--front", default="process")
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "specdec", "serve", "--port", str(port), "--target", args.target, "--drafter",
               args.drafter, "--front", args.front, "--compile", "off", "--threads", "1"]
    server = ServerProcess(command, {**os.environ, "SPECDEC_API_KEY": ""}, "specdec-pooled-")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx2.get(base + "/health").status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            if not server.alive() or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{server.log_tail()}")
            time.sleep(0.2)
        print(f"{'request':<20} {'pooled p50':>10} {'p90':>7} {'fresh p50':>10} {'p90':>7}  (ms, {args.repeats} each)")
        for name, (method, body) in REQUESTS.items():
            path = "/v1/completions" if body else name
            with httpx2.Client() as pooled:
                timed(pooled, base, method, path, body)  # opens the connection
                kept = [timed(pooled, base, method, path, body) for _ in range(args.repeats)]
            fresh = []
            for _ in range(args.repeats):
                with httpx2.Client() as client:
                    fresh.append(timed(client, base, method, path, body))
            row = [statistics.median(kept), statistics.quantiles(kept, n=10)[-1],
                   statistics.median(fresh), statistics.quantiles(fresh, n=10)[-1]]
            print(f"{name:<20} {row[0]:>10.1f} {row[1]:>7.1f} {row[2]:>10.1f} {row[3]:>7.1f}")
    finally:
        server.close()


if __name__ == "__main__":
    main()
