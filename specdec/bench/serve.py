"""``specdec bench --serve``: the server under concurrent clients, speculation on vs off (and auto).

One server per ``--speculate`` mode (off: plain decoding; on: ``lookup+<--drafter>``; auto: ``Crossover``),
each the real command (``specdec serve``) in a process of its own on a free loopback port, as a user and as
vLLM run it, with the bench's target, drafter, threads, ``--compile``, ``--gamma``, ``--max-new-tokens`` and a
batch size of the largest client count. Clients are threads streaming plain HTTP in a closed loop, C at once
for C in ``--clients``; a cell (mode, C) sends the ``--num-prompts`` built-in code prompts. Per cell: median
and 95th-percentile latency, median time to first token and total tokens/s, each the median over
``--repeats``. Within a repeat the modes take turns at each C (the order rotating), each timed cell starting
once every server is quiet (``vllm_server.settle``), so a slow spell of the shared machine falls on all modes
alike; an untimed warm-up cell per (mode, C) comes first (and lets ``auto`` measure its crossover).

Greedy runs check that every prompt's tokens under ``on`` and ``auto`` equal those under ``off``. ``--peers
vllm`` (or ``vllm-plain``, ``vllm-ngram``, ``vllm-draft``; greedy only) adds vLLM's CPU build as more modes of
the same cells, one server process at a time, its replies checked against ``off``'s. Start-up is the seconds
from launching each server to its first reply. The goals printed (issues 20 and 28) are ratios within this one
run; the goals in full, the design's history and the figures: docs/journal/bench-serve.md and
docs/benchmarks.md.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from specdec.bench.batched import Goal, print_choices_and_goals
from specdec.bench.config import BenchConfig
from specdec.bench.environment import Environment, capture_environment, load_average
from specdec.bench.prompts import Prompt, load_prompts
from specdec.bench.vllm_server import QUIET_SHARE, QUIET_WINDOW_S, ServerProcess, settle
from specdec.config import LOOKUP, ModelConfig, switch
from specdec.stats import AutoChoice

REQUEST_TIMEOUT_S = 600.0  # one request, at most
SPECDEC_SERVE = "specdec serve"  # the start-up figure of our own server (the real command, a subprocess)
SERVE_START_TIMEOUT_S = 900.0  # `specdec serve` launched to its first reply, at
                               # most (compiling afresh after a change to
# the traced code took 265 s for code-target alone on the AMD EPYC, 2026-11-28)
STARTUP_GOAL_S = 20.0  # issue 28: start-up to serving
POLL_S = 0.1  # between tries of a first reply while a server is not listening yet


@dataclass(frozen=True)
class Endpoint:
    """A server the clients drive, and how its stream carries tokens: ``specdec`` (our chunks'
    ``specdec.tokens``) or ``vllm`` (its ``token_ids`` deltas; a stop token it leaves out is put back)."""

    port: int
    kind: str = "specdec"
    extra: dict = field(default_factory=dict)  # fields added to every request's body


@dataclass(frozen=True)
class Reply:
    """One request as a client saw it."""

    prompt: int  # index of the prompt
    latency_s: float  # request sent -> last byte
    ttft_s: float  # request sent -> first chunk with tokens
    tokens: list[int]  # the completion's token ids


@dataclass
class Cell:
    """One (mode, clients) of the bench: its figures per repeat."""

    mode: str  # off / on / auto, or a vLLM configuration (vllm-plain, vllm-ngram, vllm-draft)
    clients: int
    p50_s: list[float] = field(default_factory=list)  # median latency, per repeat
    p95_s: list[float] = field(default_factory=list)  # 95th percentile latency, per repeat
    ttft_s: list[float] = field(default_factory=list)  # median time to first token, per repeat
    tokens_per_s: list[float] = field(default_factory=list)  # all tokens / wall time, per repeat
    requests: int = 0  # requests per repeat
    tokens: int = 0  # tokens of the first repeat
    greedy_equal: int = 0  # prompts whose tokens equal speculation off's (greedy runs, first repeat)
    compared: int = 0

    def median(self, name: str) -> float:
        return statistics.median(getattr(self, name))


@dataclass
class ServeRun:
    config: BenchConfig
    environment: Environment
    prompts: list[Prompt]
    temperature: float
    batch_size: int
    cells: list[Cell]
    crossover: dict[int, int | None]  # auto's draft width per batch-size bucket (0: plain; None: uncapped)
    startup_s: dict[str, float] = field(default_factory=dict)  # launch -> first reply: specdec serve, each vLLM server
    auto: list[AutoChoice] = field(default_factory=list)  # auto's choices with the speeds it measured, at the end
    prefill_beside: bool = False  # our servers prefilled joining prompts on a second thread (their /stats said so)
    vllm_bind: str = "nobind"  # VLLM_CPU_OMP_THREADS_BIND as vLLM's servers had it ("nobind": as many threads as ours)
    helper: bool = False  # our servers shared their target's products with a helper thread (their /stats said so)
    settle_s: list[float] = field(default_factory=list)  # seconds waited for the servers to go quiet, per timed cell

    def cell(self, mode: str, clients: int) -> Cell | None:
        return next((c for c in self.cells if c.mode == mode and c.clients == clients), None)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, linearly interpolated (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def request(endpoint: Endpoint, body: dict) -> tuple[float, float, list[int]]:
    """POST one streaming completion; (latency, time to first token, token ids)."""
    connection = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=REQUEST_TIMEOUT_S)
    try:
        start = time.perf_counter()
        connection.request("POST", "/v1/completions", json.dumps({**body, **endpoint.extra}),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"the server answered {response.status}: {response.read()[:300]!r}")
        first, tokens, stop = None, [], None
        for line in response:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"the server failed a request: {chunk['error']['message']}")
            if endpoint.kind == "vllm":
                choices = chunk.get("choices") or [{}]
                new = choices[0].get("token_ids") or []
                stop = choices[0].get("stop_reason", stop)
            else:
                new = chunk.get("specdec", {}).get("tokens", [])
            if new and first is None:
                first = time.perf_counter() - start
            tokens += new
        if isinstance(stop, int) and (not tokens or tokens[-1] != stop):
            tokens.append(stop)  # the stop token, which vLLM may leave out of its ids
        latency = time.perf_counter() - start
        return latency, latency if first is None else first, tokens
    finally:
        connection.close()


def drive(endpoint: Endpoint, bodies: list[tuple[int, dict]], clients: int) -> tuple[list[Reply], float]:
    """Send ``bodies`` from ``clients`` closed-loop client threads; (replies, wall seconds)."""
    work: queue.SimpleQueue[tuple[int, dict]] = queue.SimpleQueue()
    for item in bodies:
        work.put(item)
    replies: list[Reply] = []
    errors: list[BaseException] = []

    def client() -> None:
        while not errors:
            try:
                index, body = work.get_nowait()
            except queue.Empty:
                return
            try:
                latency, ttft, tokens = request(endpoint, body)
            except BaseException as err:  # noqa: BLE001 - re-raised by the caller's thread
                errors.append(err)
                return
            replies.append(Reply(index, latency, ttft, tokens))

    threads = [threading.Thread(target=client, name=f"bench-client-{i}") for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S * len(bodies))
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return replies, wall


def first_reply_s(endpoint: Endpoint, body: dict, launched: float, alive: Callable[[], bool], what: str,
                  timeout_s: float) -> float:
    """Seconds from ``launched`` (``time.perf_counter``) to the first successful reply to ``body``, trying
    again while the server is not listening yet; a RuntimeError if it exits or ``timeout_s`` passes first."""
    while True:
        try:
            request(endpoint, body)
            return time.perf_counter() - launched
        except OSError:  # refused or cut off: not serving yet
            if not alive():
                raise RuntimeError(f"{what} exited before its first reply") from None
            if time.perf_counter() - launched > timeout_s:
                raise RuntimeError(f"{what} gave no reply within {timeout_s:g} s of its launch") from None
            time.sleep(POLL_S)


def launch_specdec_serve(config: BenchConfig, mode: str | None = None, batch_size: int | None = None):
    """``specdec serve`` launched now (a subprocess: the real command, the bench's target, drafter, threads and
    ``--compile``; ``mode`` its ``--speculate``, with the bench's ``--gamma`` and ``--max-new-tokens`` and
    ``batch_size``, else the command's defaults) -> (the process, its endpoint)."""
    from specdec.bench.vllm_server import ServerProcess, free_port

    port = free_port()
    command = [sys.executable, "-m", "specdec", "serve", "--target", config.target, "--drafter",
               LOOKUP + config.drafter, "--port", str(port), "--threads", str(torch.get_num_threads()),
               "--compile", config.compile]
    for flag, value in (("--device", config.device), ("--dtype", config.dtype)):
        if value is not None:
            command += [flag, value]
    if mode is not None:
        command += ["--speculate", mode, "--gamma", str(config.gamma[0]), "--max-new-tokens",
                    str(config.max_new_tokens), "--batch-size", str(batch_size or max(config.clients))]
    # the bench's --compile auto decodes eagerly on a CPU, as in its other runs: a server that compiled beside serving
    # would change how it runs between cells (specdec.serve.background)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPECDEC_COMPILE_BESIDE": "off"}
    return ServerProcess(command, env, "specdec-serve-"), Endpoint(port)


def serving(config: BenchConfig, body: dict, mode: str | None = None, batch_size: int | None = None):
    """``launch_specdec_serve``, waited for until it answers ``body`` -> (the process, its endpoint, the seconds
    from launch to that reply). A failure stops it and quotes the tail of its output."""
    server, endpoint = launch_specdec_serve(config, mode, batch_size)
    try:
        seconds = first_reply_s(endpoint, body, server.launched, server.alive, SPECDEC_SERVE, SERVE_START_TIMEOUT_S)
    except RuntimeError as err:
        tail = server.log_tail()
        server.close()
        raise RuntimeError(f"{err} ({' '.join(server.command)}); its output ends:\n{tail}") from None
    except BaseException:
        server.close()
        raise
    return server, endpoint, seconds


def time_specdec_serve(config: BenchConfig, body: dict) -> float:
    """Launch ``specdec serve`` as a user would (the command's own defaults beside the bench's models, threads
    and ``--compile``) and time it to its first reply to ``body``; then stop it."""
    server, _, seconds = serving(config, body)
    server.close()
    return seconds


def server_stats(endpoint: Endpoint) -> dict:
    """A specdec server's ``/stats`` (its served model's load and figures, ``speculate="auto"``'s choices)."""
    connection = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("GET", "/stats")
        response = connection.getresponse()
        payload = response.read()
        if response.status != 200:
            raise RuntimeError(f"/stats answered {response.status}: {payload[:200]!r}")
        return json.loads(payload)
    finally:
        connection.close()


def _bodies(prompts: list[Prompt], n: int, config: BenchConfig, temperature: float) -> list[tuple[int, dict]]:
    """``n`` request bodies cycling over the prompts (greedy: no seed; sampled: seeded per prompt)."""
    bodies = []
    for i in range(n):
        p = i % len(prompts)
        body = {"prompt": prompts[p].input_ids.tolist(), "max_tokens": config.max_new_tokens,
                "temperature": temperature, "top_p": config.top_p, "top_k": config.top_k, "stream": True}
        if temperature > 0:
            body["seed"] = config.seed + p
        bodies.append((p, body))
    return bodies


def serve_peers(config: BenchConfig) -> list[str]:
    """The vLLM configurations ``--peers`` names for ``--serve`` (groups expanded); a ValueError for a peer
    that is no server, or for sampling (vLLM's cells run greedy only)."""
    from specdec.bench.peers import PEER_GROUPS, expand_peers

    names = expand_peers(config.peers)
    other = [n for n in names if n not in PEER_GROUPS["vllm"]]
    if other:
        raise ValueError(f"--serve runs only vLLM's servers as peers ({', '.join(PEER_GROUPS['vllm'])}), not "
                         f"{', '.join(other)}: leave {'it' if len(other) == 1 else 'them'} out of --peers, or drop "
                         "--serve")
    if names and config.temperature[0] != 0:
        raise ValueError(f"--serve with vLLM's peers runs greedy only (--temperature 0), got {config.temperature[0]:g}")
    return names


def run_serve_bench(config: BenchConfig, console: Console | None = None) -> ServeRun:
    """Start a server per mode (and each vLLM peer in turn), drive each with every client count, repeat;
    the figures, and each server's start-up."""
    from specdec.bench.harness import _quiet_transformers
    from specdec.bench.peers import vllm_config
    from specdec.bench.vllm_server import (
        SERVED_NAME,
        TIMEOUT_ENV,
        VLLMServer,
        max_model_len,
    )
    from specdec.session import Session
    from specdec.target import make_target

    peers = serve_peers(config)
    with _quiet_transformers():
        load_start = load_average()
        session = Session(ModelConfig(target=config.target, drafter=LOOKUP + config.drafter, device=config.device,
                                      dtype=config.dtype, threads=config.threads, compile="off"))
        tokenizer = session.tokenizer("speculative")
        prompts = load_prompts(config.prompts, config.num_prompts, config.seed, tokenizer)
        temperature = config.temperature[0]
        batch_size = max(config.clients)
        probe = {"prompt": prompts[0].input_ids.tolist(), "max_tokens": 1, "temperature": 0.0, "stream": True}
        startup = {SPECDEC_SERVE: time_specdec_serve(config, probe)}  # while nothing else of ours runs
        target = session.model(config.target)
        vllm_extra = {"model": SERVED_NAME, "stop_token_ids": sorted(make_target(target).stop_token_ids()),
                      "ignore_eos": True, "skip_special_tokens": False, "return_token_ids": True}
        servers: dict[str, ServerProcess] = {}
        waits: list[float] = []  # seconds waited for the servers to go quiet before each cell (``settle``)
        ours: dict[str, Endpoint] = {}
        auto: list[AutoChoice] = []
        cells: dict[tuple[str, int], Cell] = {}
        first: dict[tuple[str, int], list[Reply]] = {}
        try:
            for mode in config.speculate:  # one at a time, each ready before the next starts
                servers[mode], ours[mode], _ = serving(config, probe, mode, batch_size)
            said = [m for e in ours.values() for m in server_stats(e)["models"]]
            beside, helper = (any(m.get(name, False) for m in said) for name in ("prefill_beside", "helper"))
            progress = Progress(TextColumn("{task.description:<36}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=console or Console(stderr=True),
                                disable=not config.progress, transient=True)
            phases = [[name] for name in peers] or [[]]  # one vLLM server up at a time
            per_repeat = len(config.clients) * len(ours)
            total = sum(config.repeats * (per_repeat + len(config.clients) * len(p)) for p in phases)
            total += len(config.clients) * (len(ours) + len(peers)) * (config.warmup > 0)
            with progress:
                task = progress.add_task("serve bench", total=total)
                for phase in phases:
                    up: list[VLLMServer] = []
                    try:
                        theirs = {}
                        for name in phase:
                            progress.update(task, description=f"starting {name}")
                            server = VLLMServer(target.name_or_path, torch.get_num_threads(),
                                                vllm_config(name, config.drafter), max_model_len(target))
                            up.append(server)
                            theirs[name] = Endpoint(server.port, "vllm", vllm_extra)
                            startup[name] = first_reply_s(
                                theirs[name], probe, server.launched, server.alive, name,
                                float(switch(TIMEOUT_ENV)))
                        _measure(config, {**ours, **theirs}, prompts, temperature, cells, first, progress, task,
                                 [*servers.values(), *up], waits)
                    finally:
                        for server in up:
                            server.close()
            if "auto" in ours:  # what auto measured and kept, per batch-size bucket
                (model,) = server_stats(ours["auto"])["models"]
                auto = [AutoChoice.from_dict(c) for c in model["auto"]]
        finally:
            for server in servers.values():
                server.close()
        crossover = {c.rows[1]: (c.width if c.speculate == "on" else 0) for c in auto if c.speculate != "measuring"}
        if temperature == 0 and "off" in config.speculate:
            _check_greedy(config, cells, first)
        environment = capture_environment((config.target, target), (config.drafter, session.model(config.drafter)),
                                          load_start)
    return ServeRun(config, environment, prompts, temperature, batch_size, list(cells.values()), crossover,
                    startup, auto, beside, os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "nobind", helper, waits)


def _measure(config: BenchConfig, endpoints: dict[str, Endpoint], prompts: list[Prompt], temperature: float,
             cells: dict[tuple[str, int], Cell], first: dict[tuple[str, int], list[Reply]], progress: Progress,
             task, servers: list[ServerProcess], waits: list[float]) -> None:
    """Every (mode, clients) cell of ``endpoints``, ``config.repeats`` times after a warm-up of the modes not
    warmed yet, into ``cells`` (a cell met again gets more runs); ``first``: each cell's first replies. Each timed
    cell starts once ``servers`` (every server up) are quiet (``settle``), its wait appended to ``waits``."""
    modes = list(endpoints)
    if config.warmup > 0:
        for clients in config.clients:
            for mode in modes:
                if (mode, clients) not in cells:
                    progress.update(task, description=f"warm-up {mode}, {clients} clients")
                    drive(endpoints[mode], _bodies(prompts, clients, config, temperature), clients)
                    progress.advance(task)
    for clients in config.clients:
        for mode in modes:
            cells.setdefault((mode, clients), Cell(mode, clients))
    for repeat in range(config.repeats):
        for turn, clients in enumerate(config.clients):
            shift = (repeat + turn) % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                progress.update(task, description=f"{mode}, {clients} clients, run {repeat + 1}")
                cell = cells[(mode, clients)]
                n = -(-config.num_prompts // clients) * clients
                waits.append(settle(servers))
                replies, wall = drive(endpoints[mode], _bodies(prompts, n, config, temperature), clients)
                latencies = [r.latency_s for r in replies]
                cell.requests = len(replies)
                cell.p50_s.append(statistics.median(latencies))
                cell.p95_s.append(percentile(latencies, 0.95))
                cell.ttft_s.append(statistics.median(r.ttft_s for r in replies))
                tokens = sum(len(r.tokens) for r in replies)
                cell.tokens_per_s.append(tokens / wall)
                if (mode, clients) not in first:
                    cell.tokens = tokens
                    first[(mode, clients)] = replies
                progress.advance(task)


def _check_greedy(config: BenchConfig, cells: dict[tuple[str, int], Cell],
                  first: dict[tuple[str, int], list[Reply]]) -> None:
    """Each cell's first replies against ``off``'s at the same client count, prompt by prompt."""
    for clients in config.clients:
        reference = {r.prompt: r.tokens for r in first[("off", clients)]}
        for (mode, at), cell in cells.items():
            if at == clients:
                for reply in first[(mode, clients)]:
                    cell.compared += 1
                    cell.greedy_equal += reply.tokens == reference[reply.prompt]


def serve_goals(run: ServeRun) -> list[Goal]:
    """Issue 20's goals, as ratios of this run's medians."""
    goals = []
    for clients in run.config.clients:
        off = run.cell("off", clients)
        for mode in ("on", "auto"):
            cell = run.cell(mode, clients)
            if off is None or cell is None:
                continue
            if clients <= 4:
                value = off.median("p50_s") / cell.median("p50_s")
                goals.append(Goal(f"median latency off / {mode} at {clients} client(s)", value, ">= 1.5",
                                       value >= 1.5))
            else:
                value = cell.median("tokens_per_s") / off.median("tokens_per_s")
                goals.append(Goal(f"throughput {mode} / off at {clients} clients", value, ">= 1.0",
                                       value >= 1.0))
    return goals + peer_goals(run)


VLLM_SPECULATIVE = ("vllm-ngram", "vllm-draft")  # vLLM's speculative configurations: the best one is the bar


def peer_goals(run: ServeRun) -> list[Goal]:
    """Issue 28's goals against vLLM's servers, as ratios of this run's medians, and our start-up."""
    goals = []
    off, plain = run.cell("off", 1), run.cell("vllm-plain", 1)
    if off and plain:
        value = plain.median("p50_s") / off.median("p50_s")
        goals.append(Goal("median latency vllm-plain / off at 1 client", value, ">= 1.0", value >= 1.0))
    for clients in run.config.clients:
        theirs = [c for c in (run.cell(n, clients) for n in VLLM_SPECULATIVE) if c is not None]
        if not theirs:
            continue
        if clients <= 4:  # vLLM's best: the lowest median latency, else the most tokens/s
            best = min(theirs, key=lambda c: c.median("p50_s"))
        else:
            best = max(theirs, key=lambda c: c.median("tokens_per_s"))
        for mode in ("on", "auto"):  # the drafter always, and the server's default (auto: drafting where it pays)
            ours = run.cell(mode, clients)
            if ours is None:
                continue
            if clients <= 4:
                value = best.median("p50_s") / ours.median("p50_s")
                goals.append(Goal(f"median latency {best.mode} (vLLM's best) / {mode} at {clients} client(s)", value,
                                  ">= 1.5", value >= 1.5))
            else:
                value = ours.median("tokens_per_s") / best.median("tokens_per_s")
                goals.append(Goal(f"throughput {mode} / {best.mode} (vLLM's best) at {clients} clients", value,
                                  ">= 1.0", value >= 1.0))
    if SPECDEC_SERVE in run.startup_s:
        value = run.startup_s[SPECDEC_SERVE]
        goals.append(Goal(f"{SPECDEC_SERVE} launched to its first reply, s", value, f"<= {STARTUP_GOAL_S:g}",
                          value <= STARTUP_GOAL_S))
    return goals


def serve_table(run: ServeRun) -> Table:
    c = run.config
    runs = max(len(cell.p50_s) for cell in run.cells)
    ours = f" (ours {runs}: with each vLLM server in turn)" if runs > c.repeats else ""
    table = Table(title=f"specdec serve under load: T={run.temperature:g}, γ={c.gamma[0]}, {c.max_new_tokens} new "
                        f"tokens, batch size {run.batch_size}, drafter {LOOKUP}{c.drafter}, median of {c.repeats} "
                        f"runs{ours}")
    for column in ("clients", "mode", "requests", "p50 latency s", "p95 latency s", "p50 TTFT s", "tokens/s",
                   "p50 × off", "tok/s × off", "greedy = off"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for clients in c.clients:
        off = run.cell("off", clients)
        for cell in (x for x in run.cells if x.clients == clients):
            faster = off.median("p50_s") / cell.median("p50_s") if off else None
            more = cell.median("tokens_per_s") / off.median("tokens_per_s") if off else None
            equal = f"{cell.greedy_equal}/{cell.compared}" if cell.compared else "–"
            table.add_row(str(clients), cell.mode, str(cell.requests), f"{cell.median('p50_s'):.3f}",
                          f"{cell.median('p95_s'):.3f}", f"{cell.median('ttft_s'):.3f}",
                          f"{cell.median('tokens_per_s'):.1f}", "–" if faster is None else f"{faster:.2f}x",
                          "–" if more is None else f"{more:.2f}x", equal)
    return table


def print_serve(run: ServeRun, console: Console) -> None:
    from specdec.report import auto_text

    console.print(serve_table(run))
    env = run.environment
    peers = sorted({c.mode for c in run.cells} - set(run.config.speculate))
    each = [part for part, said in (("prefilling joining prompts on a second thread", run.prefill_beside),
                                    ("sharing its products with a helper on the idle core", run.helper)) if said]
    ours = "ours all up" + (f", each {' and '.join(each)}" if each else "")
    theirs = ("as many threads a forward as ours" if run.vllm_bind == "nobind" else
              f"its threads bound to cores {run.vllm_bind} (VLLM_CPU_OMP_THREADS_BIND)")
    where = (f"each server a process of its own ({ours}; vLLM's one at a time, {theirs}), the clients in the bench's"
             if peers else f"each server a process of its own ({ours}), the clients in the bench's")
    console.print(f"{env.device} ({env.device_name}), {env.dtype}, {env.threads}, load average "
                  f"{env.load_average_start} -> {env.load_average_end}; {where}; torch "
                  f"{env.torch_version}, transformers {env.transformers_version}", style="dim")
    if run.settle_s:
        console.print(f"each cell timed once every server was quiet (under {QUIET_SHARE:.0%} of a core over "
                      f"{QUIET_WINDOW_S:g} s): waited {statistics.median(run.settle_s):.1f} s at the median, "
                      f"{max(run.settle_s):.1f} s at most", style="dim")
    console.print("start-up, launch to the first reply: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds
                                                                      in run.startup_s.items()))
    if run.auto:
        console.print(auto_text(run.auto), style="dim")
    print_choices_and_goals(console, run.crossover, serve_goals(run))


def write_serve(run: ServeRun, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "serve_bench.json"
    path.write_text(json.dumps({
        "config": asdict(run.config),
        "environment": asdict(run.environment),
        "temperature": run.temperature,
        "batch_size": run.batch_size,
        "cells": [{**asdict(c), **{f"median_{k}": c.median(k) for k in ("p50_s", "p95_s", "ttft_s", "tokens_per_s")}}
                  for c in run.cells],
        "crossover": {str(k): v for k, v in run.crossover.items()},
        "auto": [asdict(c) for c in run.auto],
        "startup_s": run.startup_s,
        "prefill_beside": run.prefill_beside,
        "vllm_bind": run.vllm_bind,
        "helper": run.helper,
        "settle_s": run.settle_s,
        "goals": [asdict(g) for g in serve_goals(run)],
    }, indent=2))
    return path


def run_and_report(config: BenchConfig, console: Console) -> int:
    """``specdec bench --serve``: run, print, write; exit status 1 when a greedy output differs between modes."""
    with torch.no_grad():  # not torch.set_grad_enabled(False): that would outlive the bench (the docs test runs on)
        run = run_serve_bench(config)
    path = write_serve(run, Path(config.output))
    print_serve(run, console)
    console.print(f"wrote {path}", style="dim")
    return 0 if all(c.greedy_equal == c.compared for c in run.cells) else 1  # vLLM's cells too: float32, exact
