"""``specdec bench --serve``: the server under concurrent clients, speculation on vs off (and auto).

One server per ``--speculate`` mode (off: plain decoding; on: the drafter ``lookup+<--drafter>``,
the CLI's default kind; auto: ``Crossover``, drafting only at batch sizes where it measured faster),
all started in this process on free loopback ports (``ServerThread``) over the same loaded models,
each with its own engine and caches, a batch size of the largest client count (so every client's
request runs at once) and the bench's ``--gamma``, ``--temperature`` and ``--max-new-tokens``.

Clients are threads speaking plain HTTP (``http.client``; streaming, as a chat front end would, so
time to first token is seen): each sends the next prompt as soon as its previous reply ends
(closed loop), C clients at once, for C in ``--clients`` (1, 4, 16). A cell (mode, C) sends the
``--num-prompts`` built-in code prompts (rounded up to a multiple of C). Per cell: the median and
95th-percentile request latency, the median time to first token, and total tokens/s (all tokens
over the cell's wall time). Every cell runs ``--repeats`` times; each figure is the median over
repeats; within each repeat the modes take turns at each C (the order rotating), so a slow spell
of the shared machine falls on all modes alike. A warm-up sends one untimed cell per (mode, C)
first (this also lets ``auto`` measure its crossover at each batch size).

Greedy runs check that speculation changes nothing: every prompt's tokens under ``on`` and ``auto``
equal those under ``off``. The goals (issue 20): at 1 and 4 clients, ``on`` has >= 1.5x lower median
latency than ``off``; at 16 clients its throughput is no worse (and ``auto`` falls back where
speculation loses). Ratios are from this one run.
"""

from __future__ import annotations

import http.client
import json
import queue
import statistics
import threading
import time
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
from specdec.config import LOOKUP, ModelConfig, SamplingConfig, SpecConfig, VerifyConfig

REQUEST_TIMEOUT_S = 600.0  # one request, at most


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

    mode: str  # off / on / auto
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
    crossover: dict[int, bool]  # auto's choice per batch-size bucket (True: draft)

    def cell(self, mode: str, clients: int) -> Cell | None:
        return next((c for c in self.cells if c.mode == mode and c.clients == clients), None)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, linearly interpolated (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def request(port: int, body: dict) -> tuple[float, float, list[int]]:
    """POST one streaming completion; (latency, time to first token, token ids)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        start = time.perf_counter()
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"the server answered {response.status}: {response.read()[:300]!r}")
        first, tokens = None, []
        for line in response:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"the server failed a request: {chunk['error']['message']}")
            new = chunk.get("specdec", {}).get("tokens", [])
            if new and first is None:
                first = time.perf_counter() - start
            tokens += new
        latency = time.perf_counter() - start
        return latency, latency if first is None else first, tokens
    finally:
        connection.close()


def drive(port: int, bodies: list[tuple[int, dict]], clients: int) -> tuple[list[Reply], float]:
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
                latency, ttft, tokens = request(port, body)
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


def run_serve_bench(config: BenchConfig, console: Console | None = None) -> ServeRun:
    """Start a server per mode, drive each with every client count, repeat; the figures."""
    from specdec.bench.harness import _quiet_transformers
    from specdec.console import Session
    from specdec.schedules import Crossover
    from specdec.serve.config import ServeConfig
    from specdec.serve.server import ServerThread, build_app

    with _quiet_transformers():
        load_start = load_average()
        drafter = LOOKUP + config.drafter
        session = Session(ModelConfig(target=config.target, drafter=drafter, device=config.device, dtype=config.dtype,
                                      threads=config.threads))
        tokenizer = session.tokenizer("speculative")
        prompts = load_prompts(config.prompts, config.num_prompts, config.seed, tokenizer)
        temperature = config.temperature[0]
        batch_size = max(config.clients)
        sampling = SamplingConfig(temperature=temperature, top_k=config.top_k, top_p=config.top_p)
        servers: dict[str, ServerThread] = {}
        crossover: dict[int, bool] = {}
        try:
            for mode in config.speculate:
                spec = SpecConfig(gamma=config.gamma[0], max_new_tokens=config.max_new_tokens, batch_size=batch_size,
                                  speculate=mode)
                app = build_app(ServeConfig(), session.models, spec, sampling, VerifyConfig(), session=session)
                servers[mode] = ServerThread(app).start()
                schedule = next(iter(app.state.models.values())).engine.schedule
                if isinstance(schedule, Crossover):
                    crossover = schedule.choice  # filled in as auto measures
            cells = _measure(config, {m: s.port for m, s in servers.items()}, prompts, temperature, console)
        finally:
            for server in servers.values():
                server.stop()
        target = session.model(config.target)
        environment = capture_environment((config.target, target), (config.drafter, session.model(config.drafter)),
                                          load_start)
    return ServeRun(config, environment, prompts, temperature, batch_size, cells, dict(crossover))


def _measure(config: BenchConfig, ports: dict[str, int], prompts: list[Prompt], temperature: float,
             console: Console | None) -> list[Cell]:
    """Every (mode, clients) cell, ``config.repeats`` times after a warm-up; greedy equality with off."""
    modes = list(ports)
    cells = {(m, c): Cell(m, c) for c in config.clients for m in modes}
    first: dict[tuple[str, int], list[Reply]] = {}  # the replies of each cell's first repeat
    progress = Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console or Console(stderr=True), disable=not config.progress, transient=True)
    with progress:
        task = progress.add_task("serve bench", total=len(cells) * (config.repeats + (config.warmup > 0)))
        if config.warmup > 0:
            for mode, clients in cells:
                progress.update(task, description=f"warm-up {mode}, {clients} clients")
                drive(ports[mode], _bodies(prompts, clients, config, temperature), clients)
                progress.advance(task)
        for repeat in range(config.repeats):
            for turn, clients in enumerate(config.clients):
                shift = (repeat + turn) % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    progress.update(task, description=f"{mode}, {clients} clients, run {repeat + 1}")
                    cell = cells[(mode, clients)]
                    n = -(-config.num_prompts // clients) * clients
                    replies, wall = drive(ports[mode], _bodies(prompts, n, config, temperature), clients)
                    latencies = [r.latency_s for r in replies]
                    cell.requests = len(replies)
                    cell.p50_s.append(statistics.median(latencies))
                    cell.p95_s.append(percentile(latencies, 0.95))
                    cell.ttft_s.append(statistics.median(r.ttft_s for r in replies))
                    tokens = sum(len(r.tokens) for r in replies)
                    cell.tokens_per_s.append(tokens / wall)
                    if repeat == 0:
                        cell.tokens = tokens
                        first[(mode, clients)] = replies
                    progress.advance(task)
    if temperature == 0 and "off" in modes:
        for clients in config.clients:
            reference = {r.prompt: r.tokens for r in first[("off", clients)]}
            for mode in modes:
                cell = cells[(mode, clients)]
                for reply in first[(mode, clients)]:
                    cell.compared += 1
                    cell.greedy_equal += reply.tokens == reference[reply.prompt]
    return list(cells.values())


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
    return goals


def serve_table(run: ServeRun) -> Table:
    c = run.config
    table = Table(title=f"specdec serve under load: T={run.temperature:g}, γ={c.gamma[0]}, {c.max_new_tokens} new "
                        f"tokens, batch size {run.batch_size}, drafter {LOOKUP}{c.drafter}, median of {c.repeats} runs")
    for column in ("clients", "speculate", "requests", "p50 latency s", "p95 latency s", "p50 TTFT s", "tokens/s",
                   "p50 × off", "tok/s × off", "greedy = off"):
        table.add_column(column, justify="left" if column == "speculate" else "right")
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
    console.print(serve_table(run))
    env = run.environment
    console.print(f"{env.device} ({env.device_name}), {env.dtype}, {env.threads}, load average "
                  f"{env.load_average_start} -> {env.load_average_end}; server and clients in one process; torch "
                  f"{env.torch_version}, transformers {env.transformers_version}", style="dim")
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
    return 0 if all(c.greedy_equal == c.compared for c in run.cells) else 1
