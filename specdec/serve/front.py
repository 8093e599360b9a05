"""The HTTP front in a process of its own (``specdec serve --front process``, the default).

The engine's worker thread runs the models' Python between torch's calls, and the app (uvicorn, the protocol's
checks, each round's tokens detokenized, its JSON, the sockets) is Python too. In one process the two take turns on
the GIL: whenever the worker's torch call lets the GIL go, the event loop's thread may take it, and the worker waits
for it at the call's end. So ``specdec serve`` keeps its engines in its own process and runs the app in a child process
(``multiprocessing``'s spawn), as vLLM runs its API server apart from its engine core. Measured on the AMD EPYC (2
cores, 1 thread, the decoder alone at 4 rows of the shipped pair, ``--speculate auto``:
``benchmarks/gil_neighbour.py``): a Python thread busy 0.7 ms of every 6.7 took 17% of its tokens/s, the same work in
another process 3%; the server at 4 clients answered in 0.90-0.95x the time with its front apart
(docs/journal/2026-12-06-http-front-process.md,
"The HTTP front in a process of its own").

One pipe (``multiprocessing.Pipe``) joins them, each message a tuple:

- front → engines: ``("submit", key, model id, Request)``, ``("cancel", key)``, ``("ask", key, model id, what)``
  (``"stats"``: ``app.load_of``; ``"metrics"``: the Prometheus text);
- engines → front: ``("item", key, Round | Finished | Failed)``, sent by the worker thread as it commits,
  ``("answer", key, value)``.

In the front each served model's engine is a ``RemoteEngine``: the app submits, cancels and asks as of an ``Engine``,
and reads the target's facts a request needs (``TargetFacts``). A request's logits processors (the generation
config's: tensors on the model's device) are built in the engines' process (``with_processors``). The engines'
process binds the socket first (the port is known at once) and lends it to the front. When either process ends the
other follows: the front stops serving when the pipe closes, the engines' process when the front exits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from specdec.serve.engine import Failed, Finished, Item, Job

if TYPE_CHECKING:
    from specdec.decode import Request
    from specdec.serve.app import ServedModel
    from specdec.serve.config import ServeConfig
    from specdec.serve.metrics import ServerMetrics

log = logging.getLogger("specdec.serve")
GONE = "the server's engine process has stopped"  # what a request in flight gets when the engines' process ends


@dataclass(frozen=True)
class TargetFacts:
    """What the app reads of a target to check and build a request (``app.prepare``, ``decode.prompt_request``)."""

    encoder_decoder: bool
    decoder_start: int | None


class Link:
    """The front's end of the pipe: sends the app's messages, and a thread hands the engines' to their jobs."""

    def __init__(self, conn: Connection, on_close: Callable[[], None] | None = None) -> None:
        self.conn = conn
        self.on_close = on_close  # called on the reader thread once the engines' end has closed
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._jobs: dict[int, Job] = {}
        self._asks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self.closed = False
        self._reader = threading.Thread(target=self._read, name="specdec-front-link", daemon=True)
        self._reader.start()

    def send(self, message: tuple) -> None:
        if self.closed:
            raise ConnectionError(GONE)
        with self._lock:
            self.conn.send(message)

    def submit(self, model_id: str, request: Request, loop: asyncio.AbstractEventLoop) -> Job:
        job = RemoteJob(request, loop, key=next(self._keys))
        key = job.key
        self._jobs[key] = job
        try:
            self.send(("submit", key, model_id, request))
        except (ConnectionError, OSError):
            self._jobs.pop(key, None)
            job.push(Failed(GONE, 503))
        return job

    def cancel(self, job: Job) -> None:
        if isinstance(job, RemoteJob) and not job.finished and not self.closed:
            job.cancelled = True
            try:
                self.send(("cancel", job.key))
            except (ConnectionError, OSError):
                pass

    async def ask(self, model_id: str | None, what: str) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        key = next(self._keys)
        self._asks[key] = (loop, future)
        try:
            self.send(("ask", key, model_id, what))
        except (ConnectionError, OSError):
            self._asks.pop(key, None)
            raise ConnectionError(GONE) from None
        return await future

    def _read(self) -> None:
        while True:
            try:
                kind, key, value = self.conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # a message that did not unpickle: the next ones still arrive whole
                log.exception("a message from the engines' process could not be read")
                continue
            if kind == "item":
                job = self._jobs.get(key)
                if job is None:
                    continue
                if isinstance(value, (Finished, Failed)):
                    self._jobs.pop(key, None)
                job.push(value)
            elif kind == "answer" and (asked := self._asks.pop(key, None)) is not None:
                loop, future = asked
                loop.call_soon_threadsafe(_settle, future, value)
        self.closed = True
        for job in list(self._jobs.values()):
            job.push(Failed(GONE, 503))
        self._jobs.clear()
        for loop, future in self._asks.values():
            loop.call_soon_threadsafe(_fail, future)
        self._asks.clear()
        if self.on_close is not None:
            self.on_close()


def _settle(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(ConnectionError(GONE))


class RemoteJob(Job):
    """A request in flight in the front: a ``Job`` fed by the ``Link``, known to the engines' process by ``key``."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop, *, key: int) -> None:
        super().__init__(request, loop)
        self.key = key


class RemoteEngine:
    """A served model's engine as the app in the front sees it: it submits, cancels and asks over the ``Link``."""

    def __init__(self, model_id: str, target: TargetFacts) -> None:
        self.model_id, self.target = model_id, target
        self.link: Link | None = None  # set in the front (``_front``)

    def start(self) -> None:
        """Nothing: the engine runs in the other process (the app's lifespan calls this)."""

    def stop(self) -> None:
        """Nothing: the engine runs in the other process."""

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Job:
        assert self.link is not None
        return self.link.submit(self.model_id, request, loop)

    def cancel(self, job: Job) -> None:
        assert self.link is not None
        self.link.cancel(job)

    def ask(self, what: str) -> Any:
        """The engines' process's answer to ``what`` (``"stats"``), to await."""
        assert self.link is not None
        return self.link.ask(self.model_id, what)


class RemoteMetrics:
    """The server's metrics as the app in the front sees them: ``exposition`` asks the engines' process."""

    def __init__(self) -> None:
        self.link: Link | None = None

    def exposition(self) -> Any:
        assert self.link is not None
        return self.link.ask(None, "metrics")


def front_model(model: ServedModel) -> ServedModel:
    """``model`` as the front holds it: a ``RemoteEngine`` for its engine, no logits processors (built apart)."""
    target = model.engine.target
    facts = TargetFacts(bool(target.encoder_decoder), target.decoder_start if target.encoder_decoder else None)
    return replace(model, engine=RemoteEngine(model.id, facts), processing=None)


# ------------------------------------------------------------------------------------- the engines' process


class Bridge:
    """The engines' end of the pipe: a thread takes the front's messages; the workers send their items."""

    def __init__(self, models: Sequence[ServedModel], metrics: ServerMetrics, conn: Connection) -> None:
        self.models = {m.id: m for m in models}
        self.metrics = metrics
        self.conn = conn
        self._lock = threading.Lock()
        self._jobs: dict[int, tuple[ServedModel, Job]] = {}

    def send(self, message: tuple) -> None:
        with self._lock:
            try:
                self.conn.send(message)
            except (OSError, EOFError):  # the front has gone: the main thread stops the engines
                pass

    def serve(self) -> None:
        """Take the front's messages until the pipe closes (the front ended)."""
        from specdec.serve.app import load_of

        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            kind, key = message[0], message[1]
            if kind == "submit":
                try:
                    model = self.models[message[2]]
                    job = model.engine.submit(with_processors(model, message[3]), None, sink=self._sink(key))
                except Exception as err:  # the request fails, not this thread: the front's other requests go on
                    log.exception("a request from the front could not be submitted")
                    self.send(("item", key, Failed(f"the request could not be decoded: {type(err).__name__}: {err}")))
                    continue
                self._jobs[key] = (model, job)
                if job.finished:  # failed at once, before it was kept
                    self._jobs.pop(key, None)
            elif kind == "cancel" and (held := self._jobs.get(key)) is not None:
                held[0].engine.cancel(held[1])
            elif kind == "ask":
                try:
                    value = (self.metrics.exposition() if message[3] == "metrics" else
                             load_of(self.models[message[2]]))
                except Exception as err:  # answered, so the page's poll does not hang
                    log.exception("a question from the front failed")
                    value = {"error": f"{type(err).__name__}: {err}"}
                self.send(("answer", key, value))

    def _sink(self, key: int) -> Callable[[Item], None]:
        def sink(item: Item) -> None:  # on the worker thread
            if isinstance(item, (Finished, Failed)):
                self._jobs.pop(key, None)
            self.send(("item", key, item))

        return sink


def with_processors(model: ServedModel, request: Request) -> Request:
    """``request`` with its row's logits processors (the target's generation config's), built here, on the model's
    device (the front sends none)."""
    if model.processing is None or request.max_new_tokens == 0:  # a prompt only scored decodes no round
        return request
    target = model.engine.target
    processors = model.processing.for_row(request.ids, request.max_new_tokens, request.source, target.device)
    return replace(request, processors=processors)


class Front:
    """The front's process, started early (it imports the app while the models load), then handed the models."""

    def __init__(self, sock: socket.socket, config: ServeConfig) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_front, args=(theirs, sock, config), name="specdec-front", daemon=True)
        # started with Ctrl-C ignored, which it keeps from its first line: a Ctrl-C while it imports (the terminal
        # sends it to both processes) printed ~60 lines of its imports' traceback; the engines' process ends it
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            self.process.start()
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        theirs.close()

    def serve(self, models: Sequence[ServedModel], metrics: ServerMetrics, drain_s: float = 30.0) -> int:
        """Start the engines, hand the front its models, and serve until the front ends; the exit code.

        Ctrl-C or SIGTERM end the front as uvicorn does: it takes no new connection and the requests in flight
        finish, for ``drain_s`` seconds at most; then the engines stop, so those still running are answered 503 (a
        streamed one: an error event) before the front ends. 0 where every request finished, else 1."""
        bridge = Bridge(models, metrics, self.conn)
        signal.signal(signal.SIGTERM, _interrupt)  # on the main thread: as Ctrl-C
        for m in models:
            m.description["front"] = "process"  # shown by /stats
            m.engine.start()
        interrupted = cut = False
        try:
            self.conn.send([front_model(m) for m in models])
            threading.Thread(target=bridge.serve, name="specdec-bridge", daemon=True).start()
            self.process.join()
        except KeyboardInterrupt:
            interrupted = True
            self.process.terminate()
            self.process.join(drain_s)
            cut = self.process.is_alive()
            if cut:  # the requests still running get 503 from their engines, which the front sends before it ends
                for m in models:
                    m.engine.stop()
                self.process.join(10)
        finally:
            if self.process.is_alive():
                self.process.kill()
                self.process.join(10)
            for m in models:
                m.engine.stop()
        code = self.process.exitcode
        if cut:
            log.error("the requests still running after %g s of draining were answered 503", drain_s)
        if not interrupted and code:
            log.error("the HTTP front's process ended with %s, so the server stops (its engines cannot be reached "
                      "without it): start specdec serve again (a supervisor such as systemd's Restart=on-failure "
                      "does it for you), or with --front thread to keep HTTP in this process", code)
        return 1 if cut or (not interrupted and code) else 0

    def stop(self) -> None:
        """End the front without serving (the models failed to load)."""
        self.conn.close()
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _front(conn: Connection, sock: socket.socket, config: ServeConfig) -> None:
    """The front's process: the app over ``RemoteEngine``s, served by uvicorn on ``sock``."""
    import torch

    torch.set_num_threads(1)  # the front computes nothing with torch
    from specdec.serve.app import create_app
    from specdec.serve.server import make_server

    try:
        models = conn.recv()
    except (EOFError, OSError):  # the models did not load
        return
    metrics = RemoteMetrics()
    server = make_server(create_app(models, config, metrics), config.log_level)
    link = Link(conn, on_close=lambda: setattr(server, "should_exit", True))  # the engines' process ended: stop
    metrics.link = link
    for m in models:
        m.engine.link = link
    server.run(sockets=[sock])
