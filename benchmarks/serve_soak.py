"""A soak and a fault run of ``specdec serve`` on loopback (issue 67): what its clients see under a mixed load, under
disconnects, bad requests and signals, and what the engine's memory does meanwhile.

``soak``: launches ``python -m specdec serve`` (the shipped pair by default, ``--compile off``) on 127.0.0.1 and runs
``--clients`` closed-loop client threads until ``--duration-s`` passes or ``--requests`` have been sent (each request
has a socket timeout too: every loop stops by itself). Each request is drawn at random (seeded):

- 5% a case of the fuzz corpus (tests/serve_fuzz.py), sent as is: any 5xx, a hang, or a case tagged bad that is
  not refused with a 4xx is a failure;
- 10% a client that disconnects at a random moment (half-way through its body, right after it, or 0-2 s into its
  answer, streaming or not) and at once sends its next request: joins during cancels;
- the rest good requests, streaming or not, greedy or seeded sampling, 8-64 new tokens over a set of code prompts:
  a good request fails on any status but 200, an error event, a stream without ``[DONE]``, a timeout, a dropped
  connection, or (greedy) tokens other than those the server gave the same request sent alone before the load.

It reports requests ok and failed by cause, HTTP status counts, p50/p99 latency of the good requests, and every
``--rss-every-s`` the engine's and the HTTP front's resident memory (``/proc``) and the engine's malloc heap in use
and free (``/stats``' ``memory``, from ``specdec.serve.memory``); the growth over the last part of the run
(``--plateau-part``) is the figure the issue's goal (≤ 5%) is about.

``faults``: for each signal (SIGTERM, SIGINT, SIGKILL) and each process (the engine's, the HTTP front's), a fresh
server gets ``--clients`` streaming requests, the signal once they are all decoding, and the report says what each
client saw (done, an error event and its text, a status, a cut connection) and how each process exited.

    OMP_NUM_THREADS=1 python benchmarks/serve_soak.py soak --clients 16 --duration-s 600   # the long form
    OMP_NUM_THREADS=1 python benchmarks/serve_soak.py faults
    OMP_NUM_THREADS=1 python benchmarks/serve_soak.py soak --clients 4 --duration-s 30    # tests/test_serve_soak.py

``--json PATH`` writes the whole report. Figures: docs/journal/2026-12-07-soak-and-faults.md, "Soak and faults".
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import http.client
import json
import os
import random
import signal
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fuzz corpus
from serve_fuzz import Case, cases

from specdec.bench.vllm_server import ServerProcess, free_port, stop_process

KEY = "soak-key"
MODEL = "target"  # the served model's name (the fuzz corpus names it so)
PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self, x, y):", "for i in range(10):\n",
           "import os\nimport sys\n\n\ndef main(", "def parse_args(argv):\n    parser = ",
           "if __name__ == '__main__':", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "    # read the file line by line\n    with open(path) as f:\n"]
BUDGETS = (8, 24, 64)
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0  # one request's socket timeout: past it, a hang
FUZZ_SHARE, DISCONNECT_SHARE = 0.05, 0.10


def headers(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(extra or {})}


def launch(flags: list[str], env: dict[str, str] | None = None) -> tuple[ServerProcess, int]:
    """``specdec serve`` on a free loopback port (the shipped pair unless ``flags`` say otherwise), once it answers
    ``/health``: (the server, its port). Its own process is the engines'; the HTTP front is its child."""
    port = free_port()
    command = [sys.executable, "-m", "specdec", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--api-key", KEY, "--model-name", MODEL, "--compile", "off", "--device", "cpu", *flags]
    server = ServerProcess(command, {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, "serve-soak-")
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        with contextlib.suppress(OSError, http.client.HTTPException):
            if call(port, "GET", "/health", None)[0] == 200:
                return server, port
        if not server.alive() or time.monotonic() > deadline:
            tail = server.log_tail()
            server.close()
            raise RuntimeError(f"specdec serve did not come up: {tail}")
        time.sleep(0.2)


def call(port: int, method: str, path: str, body: dict | None, timeout: float = 30.0) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, path, None if body is None else json.dumps(body), headers())
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def front_pid(engine_pid: int) -> int | None:
    """The HTTP front: the engine process's child started by multiprocessing's spawn (``spawn_main``; not its
    resource tracker, also a child whose command line names multiprocessing)."""
    try:
        children = Path(f"/proc/{engine_pid}/task/{engine_pid}/children").read_text().split()
    except OSError:
        return None
    for child in children:
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    return None


def rss_mb(pid: int | None) -> float | None:
    with contextlib.suppress(OSError, ValueError, TypeError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


# ------------------------------------------------------------------------------------------------ one request
@dataclass
class Outcome:
    kind: str  # good, fuzz, disconnect
    ok: bool
    cause: str = ""  # why it failed
    status: int | None = None  # the HTTP status, where one came
    latency_s: float = 0.0


def body_of(rng: random.Random, stream: bool, greedy: bool, prompt: int, budget: int) -> dict:
    body = {"model": MODEL, "prompt": PROMPTS[prompt], "max_tokens": budget, "stream": stream,
            "temperature": 0.0 if greedy else 0.8}
    if not greedy:
        body["seed"] = rng.randrange(1 << 31)
    return body


def read_answer(response: http.client.HTTPResponse, stream: bool) -> tuple[list[int] | None, str]:
    """(the token ids, "") of a 200 answer, or (None, what was wrong with it)."""
    if not stream:
        reply = json.loads(response.read())
        if "choices" not in reply:
            return None, "200 without choices"
        return reply.get("specdec", {}).get("token_ids"), ""
    tokens: list[int] = []
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return tokens, ""
        chunk = json.loads(data)
        if "error" in chunk:
            return None, f"error event: {chunk['error'].get('message', '')[:80]}"
        tokens += chunk.get("specdec", {}).get("tokens", [])
    return None, "stream ended without [DONE]"


def good(port: int, body: dict, reference: list[int] | None) -> Outcome:
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), headers())
        response = connection.getresponse()
        if response.status != 200:
            detail = response.read()[:80].decode(errors="replace")
            return Outcome("good", False, f"status {response.status}: {detail}", response.status)
        tokens, wrong = read_answer(response, body["stream"])
        if wrong:
            return Outcome("good", False, wrong, 200)
        if reference is not None and tokens != reference:
            return Outcome("good", False, "greedy tokens differ from the request sent alone", 200)
        return Outcome("good", True, status=200, latency_s=time.perf_counter() - started)
    except TimeoutError:
        return Outcome("good", False, f"no answer in {REQUEST_TIMEOUT_S:g} s")
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as err:
        return Outcome("good", False, f"connection: {type(err).__name__}")
    finally:
        connection.close()


def fuzz(port: int, case: Case) -> Outcome:
    """One fuzz case as tests/test_serve.py sends it: 5xx, a hang, or a bad case answered other than 4xx fail."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        hdrs = headers(case.headers)
        connection.putrequest(case.method, case.path, skip_host="Host" in hdrs, skip_accept_encoding=True)
        for name, value in hdrs.items():
            connection.putheader(name, value)
        if case.body is not None:
            connection.putheader("Content-Length", str(len(case.body)))
        connection.endheaders(case.body)
        response = connection.getresponse()
        status = response.status
        response.read()
    except TimeoutError:
        return Outcome("fuzz", False, f"fuzz {case.name}: no answer in {REQUEST_TIMEOUT_S:g} s")
    except (OSError, http.client.HTTPException) as err:
        return Outcome("fuzz", False, f"fuzz {case.name}: connection: {type(err).__name__}")
    finally:
        connection.close()
    if status >= 500 or (case.bad and not 400 <= status < 500):
        return Outcome("fuzz", False, f"fuzz {case.name}: status {status}", status)
    return Outcome("fuzz", True, status=status)


def disconnect(port: int, body: dict, rng: random.Random) -> Outcome:
    """A client that gives up: half-way through its body, right after it, or 0-2 s into the answer."""
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    moment = rng.random()
    status = None
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT_S) as sock:
            if moment < 0.1:
                sock.sendall(head + payload[: len(payload) // 2])
                time.sleep(rng.uniform(0, 0.2))
            else:
                sock.sendall(head + payload)
                if moment >= 0.2:
                    end = time.monotonic() + rng.uniform(0, 2.0)
                    sock.settimeout(0.05)
                    seen = b""
                    while time.monotonic() < end:
                        try:
                            data = sock.recv(65536)
                        except TimeoutError:
                            continue
                        if not data:
                            break
                        seen += data
                    if seen.startswith(b"HTTP/1.1 "):
                        status = int(seen[9:12])
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
    except OSError as err:
        return Outcome("disconnect", False, f"disconnect: connection: {type(err).__name__}")
    if status is not None and status >= 500:
        return Outcome("disconnect", False, f"disconnect: status {status}", status)
    return Outcome("disconnect", True, status=status)


# ------------------------------------------------------------------------------------------------------ soak
@dataclass
class Report:
    clients: int
    duration_s: float
    sent: dict = field(default_factory=dict)  # kind: count
    ok: dict = field(default_factory=dict)  # kind: count
    failed: dict = field(default_factory=dict)  # cause: count
    statuses: dict = field(default_factory=dict)  # HTTP status: count
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    memory: list = field(default_factory=list)  # one row every rss_every_s
    plateau_growth: float | None = None  # engine RSS growth over the last part of the run (a fraction)
    load_average: list = field(default_factory=list)  # at the start and the end
    engine_exit: int | None = None

    @property
    def good_failed(self) -> int:
        return sum(n for cause, n in self.failed.items() if not cause.startswith(("fuzz", "disconnect")))


def references(port: int) -> dict[tuple[int, int], list[int]]:
    """Each greedy (prompt, budget)'s tokens, the request sent alone before the load."""
    found = {}
    for prompt in range(len(PROMPTS)):
        for budget in BUDGETS:
            status, data = call(port, "POST", "/v1/completions", body_of(random.Random(0), False, True, prompt, budget),
                                timeout=REQUEST_TIMEOUT_S)
            if status != 200:
                raise RuntimeError(f"the reference request failed: {status} {data[:200]!r}")
            found[prompt, budget] = json.loads(data)["specdec"]["token_ids"]
    return found


def sample_memory(server: ServerProcess, port: int, started: float) -> dict:
    row = {"t_s": round(time.monotonic() - started, 1), "engine_rss_mb": rss_mb(server.process.pid),
           "front_rss_mb": rss_mb(front_pid(server.process.pid))}
    with contextlib.suppress(OSError, http.client.HTTPException, ValueError, KeyError, IndexError):
        status, data = call(port, "GET", "/stats", None)
        if status == 200:
            memory = json.loads(data)["models"][0].get("memory") or {}
            row.update({f"engine_{k}_mb": v for k, v in memory.items() if k.startswith(("heap_", "python_"))})
    return row


def soak(clients: int, duration_s: float, requests: int, seed: int, rss_every_s: float, plateau_part: float,
         flags: list[str], env: dict[str, str] | None = None, log=print) -> Report:
    """The mixed load (see the module's docstring); the report."""
    server, port = launch(flags, env)
    report = Report(clients, duration_s, load_average=[round(x, 2) for x in os.getloadavg()])
    try:
        expected = references(port)
        corpus = cases()
        outcomes: list[Outcome] = []
        lock = threading.Lock()
        remaining = [requests]
        started = time.monotonic()
        deadline = started + duration_s

        def client(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < deadline:
                with lock:
                    if remaining[0] <= 0:
                        return
                    remaining[0] -= 1
                draw = rng.random()
                prompt, budget = rng.randrange(len(PROMPTS)), rng.choice(BUDGETS)
                stream, greedy = rng.random() < 0.5, rng.random() < 0.5
                if draw < FUZZ_SHARE:
                    outcome = fuzz(port, rng.choice(corpus))
                elif draw < FUZZ_SHARE + DISCONNECT_SHARE:
                    outcome = disconnect(port, body_of(rng, stream, greedy, prompt, 4 * budget), rng)
                else:
                    outcome = good(port, body_of(rng, stream, greedy, prompt, budget),
                                   expected[prompt, budget] if greedy else None)
                with lock:
                    outcomes.append(outcome)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for thread in threads:
            thread.start()
        next_sample = started
        while any(t.is_alive() for t in threads):
            if time.monotonic() >= next_sample:
                row = sample_memory(server, port, started)
                report.memory.append(row)
                log(f"  {row}")
                next_sample += rss_every_s
            time.sleep(0.2)
            if time.monotonic() > deadline + REQUEST_TIMEOUT_S + 30:
                raise RuntimeError("the clients did not stop")
        report.memory.append(sample_memory(server, port, started))
        report.duration_s = round(time.monotonic() - started, 1)
    finally:
        report.load_average += [round(x, 2) for x in os.getloadavg()]
        server.close()
        report.engine_exit = server.process.returncode
    report.sent = dict(collections.Counter(o.kind for o in outcomes))
    report.ok = dict(collections.Counter(o.kind for o in outcomes if o.ok))
    report.failed = dict(collections.Counter(o.cause for o in outcomes if not o.ok))
    report.statuses = {str(k): v for k, v in sorted(collections.Counter(
        o.status for o in outcomes if o.status is not None).items())}
    latencies = sorted(o.latency_s for o in outcomes if o.kind == "good" and o.ok)
    if latencies:
        report.latency_p50_s = round(statistics.median(latencies), 3)
        report.latency_p99_s = round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3)
    rss = [(r["t_s"], r["engine_rss_mb"]) for r in report.memory if r["engine_rss_mb"] is not None]
    if len(rss) >= 2:
        tail = [mb for t, mb in rss if t >= rss[-1][0] * (1 - plateau_part)]
        report.plateau_growth = round((tail[-1] - tail[0]) / tail[0], 4) if len(tail) >= 2 else None
    return report


# ---------------------------------------------------------------------------------------------------- faults
def fault(sig: signal.Signals, target: str, clients: int, flags: list[str], log=print) -> dict:
    """A fresh server, ``clients`` streaming requests decoding, then ``sig`` to ``target`` (engine or front): what
    each client saw and how each process exited."""
    server, port = launch(flags)
    seen: list[str] = []
    decoding = threading.Semaphore(0)
    try:
        front = front_pid(server.process.pid)

        def client(index: int) -> None:
            body = body_of(random.Random(index), True, True, index % len(PROMPTS), 400)
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            told = False
            try:
                connection.request("POST", "/v1/completions", json.dumps(body), headers())
                response = connection.getresponse()
                if response.status != 200:
                    seen.append(f"status {response.status}")
                    return
                for line in response:
                    if not told and line.startswith(b"data: {"):
                        decoding.release()
                        told = True
                    if line.startswith(b"data: [DONE]"):
                        seen.append("done")
                        return
                    if line.startswith(b"data: {") and b'"error"' in line:
                        seen.append(f"error event: {json.loads(line[6:])['error'].get('message', '')[:70]}")
                        return
                seen.append("cut before [DONE]")
            except TimeoutError:
                seen.append("no answer in 60 s")
            except (OSError, http.client.HTTPException) as err:
                seen.append(f"connection: {type(err).__name__}")
            finally:
                if not told:
                    decoding.release()
                connection.close()

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for thread in threads:
            thread.start()
        for _ in threads:
            decoding.acquire(timeout=120)
        pid = server.process.pid if target == "engine" else front
        os.kill(pid, sig)
        signalled = time.monotonic()
        for thread in threads:
            thread.join(timeout=max(1.0, signalled + 90 - time.monotonic()))
        engine_exit = None
        with contextlib.suppress(Exception):
            engine_exit = server.process.wait(timeout=max(1.0, signalled + 120 - time.monotonic()))
        front_gone_s = None  # seconds from the signal to the front's exit, within 15 s of the engine's
        until = time.monotonic() + 15
        while front is not None and time.monotonic() < until:
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{front}/cmdline").read_bytes() and \
                        Path(f"/proc/{front}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    time.sleep(0.1)
                    continue
            front_gone_s = round(time.monotonic() - signalled, 1)
            break
        result = {"signal": sig.name, "to": target, "clients": dict(collections.Counter(seen)),
                  "engine_exit": engine_exit, "engine_exit_after_s": round(time.monotonic() - signalled, 1)
                  if engine_exit is not None else None, "front_exit_after_s": front_gone_s,
                  "log_tail": server.log_tail()[-300:]}
    finally:
        stop_process(server.process)
        server.close()
    log(json.dumps(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("soak", "faults"))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--requests", type=int, default=1_000_000, help="at most this many requests in all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-every-s", type=float, default=10.0)
    parser.add_argument("--plateau-part", type=float, default=0.5, help="the last part of the run the growth is over")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in the server's environment (MALLOC_ARENA_MAX=2, PYTHONTRACEMALLOC=1); repeatable")
    parser.add_argument("--to", nargs="+", choices=("engine", "front"), default=["engine", "front"],
                        help="faults: the processes signalled")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("serve_flags", nargs="*", help="more flags for specdec serve (after --)")
    args = parser.parse_args()
    flags = ["--batch-size", str(args.batch_size), *args.serve_flags]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally clauses stop the servers
    if args.what == "soak":
        env = dict(item.split("=", 1) for item in args.env)
        report = soak(args.clients, args.duration_s, args.requests, args.seed, args.rss_every_s, args.plateau_part,
                      flags, env, log=lambda line: print(line, flush=True))
        out = {**asdict(report), "good_failed": report.good_failed}
        print(json.dumps({k: v for k, v in out.items() if k != "memory"}, indent=1))
    else:
        out = {"faults": [fault(sig, target, args.clients, flags)
                          for target in args.to for sig in (signal.SIGTERM, signal.SIGINT,
                                                                        signal.SIGKILL)]}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
