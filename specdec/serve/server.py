"""Building a server from the configs, and running it (in the foreground, or on a thread).

``build_app`` loads the models once (through ``specdec.session.Session``: the target, the drafter
named as for ``specdec generate``), builds the ``Engine`` of the target, and returns the app.
The server runs on a socket bound first (``bind``; port 0 = a free port, known before the server
starts), in the foreground (``specdec serve``, which ``specdec bench --serve`` launches) or on a thread
(``ServerThread``: tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Generator
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from specdec.batch import PromptBatch
from specdec.config import ModelConfig, SamplingConfig, ScheduleConfig, SpecConfig, VerifyConfig
from specdec.drafters import NoDrafter
from specdec.loading import SHIPPED_MODELS
from specdec.processors import resolve
from specdec.schedules import make_schedule
from specdec.serve.app import ServedModel, create_app
from specdec.serve.background import Beside
from specdec.serve.background import wanted as compile_beside
from specdec.serve.config import ServeConfig
from specdec.serve.engine import Engine
from specdec.serve.metrics import ServerMetrics
from specdec.session import Session
from specdec.target import Target, make_target


def model_id(target: str) -> str:
    """The id clients name a target by: its shipped name, or its folder's name."""
    return target if target in SHIPPED_MODELS else Path(target).expanduser().resolve().name


def probe(target: Target) -> PromptBatch:
    """A short prompt to self-check the models on at start (any tokens exercise their cached path)."""
    ids = [i % target.vocab_size for i in range(1, 10)]
    if target.encoder_decoder:
        return PromptBatch.from_lists([[target.decoder_start]], target.device, [ids])
    return PromptBatch.from_lists([ids], target.device)


def served_model(models: ModelConfig, spec: SpecConfig, sampling: SamplingConfig, verify: VerifyConfig, *,
                 metrics: ServerMetrics, name: str | None = None, session: Session | None = None,
                 schedule: ScheduleConfig | None = None) -> ServedModel:
    """Load the target (and drafter, unless ``spec.speculate`` is off) and build its engine, drafting as
    ``schedule`` says (None: the constant ``spec.gamma``)."""
    session = session or Session(models)
    schedule = schedule or ScheduleConfig()
    tokenizer = session.tokenizer("speculative")
    compiled = session.compile("speculative", spec, schedule)  # on: compiled at start
    beside, said = (Beside.start(session, spec, schedule) if not compiled and compile_beside(models)
                    else (None, ""))  # auto on a CPU: from the compile cache, else compiled beside serving
    target = make_target(session.model(models.target), models.kernels == "auto")
    drafter = NoDrafter() if spec.speculate == "off" else session.drafter()
    served_id = name or model_id(models.target)
    engine = Engine(target, drafter, make_schedule(spec, schedule, drafter), batch_size=spec.batch_size,
                    tokenizer=tokenizer, verify=verify, metrics=metrics.for_model(served_id),
                    speculate=spec.speculate, beside=beside)
    # a model whose rows cannot share a forward serves one request at a time (the others wait): said at start
    apart = engine.decoder.rows_apart(probe(target)) if spec.batch_size > 1 else None
    description = {"target": models.target, "drafter": "none" if spec.speculate == "off" else models.drafter,
                   "gamma": spec.gamma, "schedule": schedule.schedule,
                   "device": str(target.device), **session.threads.to_dict(),
                   "compile": "; ".join(compiled) or said or models.compile, "rows_apart": apart or "",
                   "front": "thread"}  # where the HTTP app runs: ``front.Front.serve`` says "process" where it is apart
    if beside is not None:
        beside.description = description
    # the target's generation config applies to every request as in generate (repetition penalty, forced tokens...)
    processing = resolve(target.model, ignore_generation_config=sampling.ignore_generation_config, device=target.device)
    description["processors"] = list(processing.settings.processors)
    return ServedModel(served_id, engine, tokenizer, target.vocab_size,
                       target.source_limit if target.encoder_decoder else target.context_limit,
                       frozenset(target.stop_token_ids()), sampling, spec.max_new_tokens, verify, description,
                       processing=processing)


def served_models(config: ServeConfig, models: ModelConfig, spec: SpecConfig, sampling: SamplingConfig,
                  verify: VerifyConfig, session: Session | None = None,
                  schedule: ScheduleConfig | None = None) -> tuple[list[ServedModel], ServerMetrics]:
    """The models a server of ``models.target`` serves, with the decoding settings given (loads them), and its
    metrics."""
    metrics = ServerMetrics()
    served = served_model(models, spec, sampling, verify, metrics=metrics, name=config.model_name, session=session,
                          schedule=schedule)
    return [served], metrics


def build_app(config: ServeConfig, models: ModelConfig, spec: SpecConfig, sampling: SamplingConfig,
              verify: VerifyConfig, session: Session | None = None, schedule: ScheduleConfig | None = None) -> FastAPI:
    """The app serving ``models.target`` with the decoding settings given (loads the models), in this process."""
    served, metrics = served_models(config, models, spec, sampling, verify, session, schedule)
    return create_app(served, config, metrics)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (``host``, ``port``) (0 = a free port): the server's address is known before it runs.

    Its connections send at once (``TCP_NODELAY``): asyncio sets it on each accepted socket only when the listening
    one names ``IPPROTO_TCP`` as its protocol (a socket made with protocol 0 does not), and Linux's accepted sockets
    inherit it from the listening one. Without it a reply written in two sends (headers, then body) waits for the
    client's delayed ACK, ~40 ms on every request of a kept-alive connection."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot listen on {host} port {port}: {err.strerror} (pick another --port)") from None
    return sock


def url_of(sock: socket.socket) -> str:
    """The http:// address of a bound socket."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Server(uvicorn.Server):
    """uvicorn's server, less its signal's comeback: after a graceful stop on SIGTERM or Ctrl-C uvicorn raises the
    signal again, so the process died of it (exit status 143, a traceback's KeyboardInterrupt) when it had stopped as
    asked; here ``run`` returns, and the command exits with its own status.

    With ``cut`` (the app's engines' stop) a stop drains for ``drain_s`` seconds at most: then ``cut`` runs, so the
    requests still in flight are answered (503) and the stop goes on; ``was_cut`` says whether it came to that."""

    def __init__(self, config: uvicorn.Config, cut: Callable[[], None] | None = None, drain_s: float = 30.0) -> None:
        super().__init__(config)
        self.cut, self.drain_s, self.was_cut = cut, drain_s, False

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()

        def cut() -> None:
            self.was_cut = True
            loop.run_in_executor(None, self.cut)  # the engines' stop waits for their rounds: not on the loop

        timer = loop.call_later(self.drain_s, cut) if self.cut is not None else None
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()  # what uvicorn's block raises again as it ends: nothing


def make_server(app: FastAPI, log_level: str = "warning", drain_s: float | None = None) -> Server:
    """The uvicorn server of ``app`` (its engines start and stop with the app's lifespan); with ``drain_s``, a stop
    answers the requests still running after that many seconds 503 (``Server``)."""
    cut = None
    if drain_s is not None:
        def cut() -> None:
            for model in app.state.models.values():
                model.engine.stop()
    return Server(uvicorn.Config(app, log_level=log_level, lifespan="on"), cut, drain_s or 30.0)


class ServerThread:
    """A uvicorn server on a thread, on a socket bound first (``port`` 0 = a free one)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.sock = bind(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = url_of(self.sock)
        self.server = make_server(app, log_level)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="specdec-uvicorn", daemon=True)

    def start(self, timeout: float = 60.0) -> ServerThread:
        """Start serving; return once the server accepts connections (or raise after ``timeout``)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving (the engines stop with the app) and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:  # noqa: PYI034 - a final class
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
