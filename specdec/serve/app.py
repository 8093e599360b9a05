"""The HTTP app: OpenAI's endpoints over the engines, the metrics, the page, and who may call.

Endpoints (FastAPI):
- ``GET /health``: ``{"status": "ok"}``, never behind the key (for load balancers);
- ``GET /v1/models``: the served models (id = the target's shipped name or folder name);
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI's bodies (``protocol``); with
  ``stream: true`` server-sent events, one chunk per committed round, ending in ``data: [DONE]``;
- ``GET /metrics``: Prometheus text named as vLLM's (``metrics``);
- ``GET /stats``: the load as JSON, for the page (rows running and waiting, batch, tokens/s history);
- ``GET /`` and ``/static/*``: the page (``static/``).

Responses carry OpenAI's fields, plus ``usage.speculation`` (drafted, accepted, rounds, acceptance
rate α = accepted / drafted, mean accepted length τ = tokens per round including the recovered or
bonus token, lossless) and a non-standard ``specdec`` object: on a whole response the token ids and
each token's kind; on each streamed chunk the round's token ids, their kinds, the released text as
``pieces`` (text, kind), and the request's running figures. OpenAI's clients ignore it.

Security: with an API key (``--api-key`` or ``$SPECDEC_API_KEY``) every API endpoint (``/v1/*``,
``/metrics``, ``/stats``) answers 401 without ``Authorization: Bearer KEY`` (compared in constant
time); ``/health`` and the page's static files (which hold no data: the page asks for the key and
sends it) stay open. Bodies over ``max_body_bytes`` get 413 (read to their end and dropped, up to
``DRAIN_BYTES`` more, so the client sees the answer; larger ones at once). Every error is an OpenAI
error object, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import PreTrainedTokenizerBase

from specdec.acceptance import rule_for
from specdec.config import SamplingConfig, VerifyConfig
from specdec.decode import Request as DecodeRequest
from specdec.decode import prompt_request
from specdec.processors import Processing
from specdec.serve.config import ServeConfig
from specdec.serve.engine import Engine, Failed, Finished, Job, Round
from specdec.serve.metrics import CONTENT_TYPE, FINISH_REASONS, ServerMetrics
from specdec.serve.protocol import (
    APIError,
    ChatBody,
    CompletionBody,
    _Body,
    chat_prompt_ids,
    check_n,
    check_prompt_ids,
    completion_prompt_ids,
    max_tokens_of,
    parse_body,
    sampling_of,
    stop_strings_of,
)
from specdec.serve.text import TextStream
from specdec.stats import GenerationStats

if TYPE_CHECKING:
    from specdec.serve.front import RemoteEngine

log = logging.getLogger("specdec.serve")
STATIC = resources.files("specdec.serve") / "static"
DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks that its client is still there
DRAIN_BYTES = 8 << 20  # an oversize body up to this much past the limit is read (and dropped) before its 413


@dataclass
class ServedModel:
    """A model the server answers for: its engine, tokenizer and the defaults of its requests."""

    id: str  # the model id clients name
    engine: Engine | RemoteEngine  # its engine, or the engine's stand-in in an app apart from it
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int  # the target's vocabulary (prompt ids must lie below it)
    context_limit: int | None  # the target's context (a prompt must leave room); an encoder-decoder's: its encoder's
    stop_ids: frozenset[int]  # the target's end-of-sequence ids
    sampling: SamplingConfig  # defaults of temperature, top-k, top-p, seed
    max_new_tokens: int  # default of max_tokens
    verify: VerifyConfig  # the verification rule
    description: dict[str, Any] = field(default_factory=dict)  # target, drafter, gamma...: shown by /stats
    processing: Processing | None = None  # the target's generation config's logits processors (None: none)
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True)
class Prepared:
    """A checked request, ready for its engine."""

    model: ServedModel
    request: DecodeRequest
    stream: bool
    include_usage: bool
    chat: bool


# ------------------------------------------------------------------------------------- the app


def create_app(models: Sequence[ServedModel], config: ServeConfig, metrics: ServerMetrics) -> FastAPI:
    """The app serving ``models`` (their engines start and stop with it)."""
    if not models:
        raise ValueError("create_app needs at least one served model")
    by_id = {m.id: m for m in models}
    key = config.key()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for m in models:
            m.engine.start()
        try:
            yield
        finally:
            for m in models:
                m.engine.stop()

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.models = by_id
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, str(err)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(_: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(APIError(500, f"internal error: {type(err).__name__}").body(), status_code=500)

    def authorize(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with the "
                           "server's key (--api-key or $SPECDEC_API_KEY)", code="invalid_api_key")

    api = APIRouter(dependencies=[Depends(authorize)])

    def model_for(name: str | None) -> ServedModel:
        if name is None:
            return models[0]
        if name not in by_id:
            raise APIError(404, f"the model {name!r} does not exist: this server serves {', '.join(by_id)}",
                           param="model", code="model_not_found")
        return by_id[name]

    async def body_of(request: Request, cls: type[_Body]) -> _Body:
        return parse_body(cls, await read_json(request, config.max_body_bytes))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(str(STATIC / "index.html"), media_type="text/html")

    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")

    @api.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": m.id, "object": "model", "created": m.created, "owned_by": "specdec",
             "max_model_len": m.context_limit} for m in models]}

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await body_of(request, CompletionBody)
        model = model_for(body.model)
        ids = completion_prompt_ids(body.prompt, model.tokenizer)
        return await respond(request, prepare(model, body, ids, chat=False))

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await body_of(request, ChatBody)
        model = model_for(body.model)
        if model.engine.target.encoder_decoder and not getattr(model.tokenizer, "chat_template", None):
            raise APIError(400, f"{model.id} is an encoder-decoder model without a chat template (a translation "
                           "model): send the source text to /v1/completions as the prompt", param="messages",
                           code="invalid_value")
        ids = chat_prompt_ids(body.messages, model.tokenizer)
        return await respond(request, prepare(model, body, ids, chat=True))

    @api.get("/metrics")
    async def prometheus() -> Response:
        return Response(await answer(metrics.exposition()), media_type=CONTENT_TYPE)

    @api.get("/stats")
    async def stats() -> dict[str, Any]:
        return {"models": [await answer(load_of(m)) for m in models]}

    app.include_router(api)
    return app


async def read_json(request: Request, limit: int) -> object:
    """The request's JSON body: 413 past ``limit`` bytes, 400 when it is not JSON.

    An oversize body of up to ``DRAIN_BYTES`` more is read to its end (and dropped) before the 413: a
    client still sending it would otherwise find the connection closed under it (a broken pipe, not
    the answer). Anything larger is refused at once (from its Content-Length, or when it gets there)."""
    length = request.headers.get("content-length", "")
    too_large = APIError(413, f"the request body is larger than {limit} bytes (the server's --max-body-bytes)",
                         code="request_too_large")
    if length.isdigit() and int(length) > limit + DRAIN_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit + DRAIN_BYTES:
            raise too_large
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise too_large
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON ({err}): send a JSON object",
                       code="invalid_json") from None


def prepare(model: ServedModel, body: _Body, ids: list[int], *, chat: bool) -> Prepared:
    """Check every field of a request and build its decoder ``Request``."""
    check_n(body)
    target = model.engine.target
    check_prompt_ids(ids, model.vocab_size, model.context_limit, source=target.encoder_decoder)
    sampling = sampling_of(body, model.sampling)
    try:
        rule_for(model.verify, sampling.greedy)
    except ValueError as err:
        raise APIError(400, str(err), param="temperature", code="invalid_value") from None
    request = prompt_request(target, ids, max_tokens_of(body, model.max_new_tokens), sampling, model.stop_ids,
                             stop_strings_of(body), processing=model.processing)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Prepared(model, request, bool(body.stream), include_usage, chat)


async def respond(request: Request, prepared: Prepared) -> Response:
    """Submit the request to its engine; stream its rounds or wait for its result."""
    job = prepared.model.engine.submit(prepared.request, asyncio.get_running_loop())
    if prepared.stream:
        return StreamingResponse(stream(job, prepared), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return JSONResponse(await complete(request, job, prepared))


# ---------------------------------------------------------------------------------- responses


class Progress:
    """A request's figures as its rounds arrive (for each chunk) and its text."""

    def __init__(self, prepared: Prepared) -> None:
        r = prepared.request
        self.text = TextStream(prepared.model.tokenizer, r.ids, r.stop_strings)
        self.tokens: list[int] = []
        self.kinds: list[str] = []
        self.drafted = self.accepted = self.rounds = 0
        self.started = time.perf_counter()

    def add(self, item: Round) -> list[tuple[str, str]]:
        """Count a round; the text it releases, as (piece, kind) segments."""
        self.tokens += item.tokens
        self.kinds += item.kinds
        self.drafted += item.drafted
        self.accepted += item.accepted
        self.rounds += 1
        self.text.add(item)  # a Round has the tokens and kinds of a RoundEvent
        return self.text.release()

    def figures(self) -> dict[str, Any]:
        return {"completion_tokens": len(self.tokens), "rounds": self.rounds, "drafted": self.drafted,
                "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accepted_length": len(self.tokens) / self.rounds if self.rounds else 0.0,
                "elapsed_s": time.perf_counter() - self.started}


def usage(prompt_tokens: int, stats: GenerationStats) -> dict[str, Any]:
    """OpenAI's usage, plus the speculation figures of the request."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": prompt_tokens + stats.new_tokens,
            "speculation": {"drafted": stats.drafted, "accepted": stats.accepted, "rounds": stats.rounds,
                            "acceptance_rate": stats.acceptance_rate,
                            "mean_accepted_length": stats.mean_accepted_length, "lossless": stats.lossless}}


def finish_reason(stop_reason: str) -> str:
    """OpenAI's finish_reason ("stop" or "length") of one of our stop reasons."""
    return "length" if FINISH_REASONS.get(stop_reason) == "length" else "stop"


def _ids(chat: bool) -> tuple[str, str, str]:
    """(response id, whole-response object, chunk object) of an endpoint."""
    if chat:
        return f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", "chat.completion.chunk"
    return f"cmpl-{uuid.uuid4().hex}", "text_completion", "text_completion"


def _raise_failed(item: Failed) -> None:
    raise APIError(500, item.message, code="decoding_failed")


async def complete(request: Request, job: Job, prepared: Prepared) -> dict[str, Any]:
    """Wait for the whole result (cancelling the job if the client goes away): the response body.

    The client is checked every ``DISCONNECT_POLL_S`` whether rounds arrive or not: a client that gives up while its
    row commits round after round must free its batch slot then, not hold it to ``max_tokens`` (issue 67)."""
    progress = Progress(prepared)
    pending: asyncio.Task | None = None
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            pending = pending or asyncio.ensure_future(job.next())
            done, _ = await asyncio.wait({pending}, timeout=max(0.0, check_at - loop.time()))
            if loop.time() >= check_at:
                if await request.is_disconnected():
                    raise APIError(499, "the client closed the request", code="client_closed")
                check_at = loop.time() + DISCONNECT_POLL_S
            if not done:
                continue
            item, pending = pending.result(), None
            if isinstance(item, Round):
                progress.add(item)
            elif isinstance(item, Failed):
                _raise_failed(item)
            else:
                return _whole(prepared, progress, item)
    finally:
        if pending is not None:
            pending.cancel()
        if not job.finished:
            prepared.model.engine.cancel(job)


def _whole(prepared: Prepared, progress: Progress, item: Finished) -> dict[str, Any]:
    result = item.result
    progress.text.release_final(result.stop_reason)
    text = progress.text.released
    rid, obj, _ = _ids(prepared.chat)
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(result.stop_reason), "logprobs": None}
    if prepared.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": obj, "created": int(time.time()), "model": prepared.model.id, "choices": [choice],
            "usage": usage(prepared.request.prompt_tokens, result.stats),
            "specdec": {"token_ids": result.tokens, "kinds": progress.kinds, "stop_reason": result.stop_reason}}


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def stream(job: Job, prepared: Prepared) -> AsyncIterator[str]:
    """Server-sent events: a chunk per committed round, the finish, the usage if asked, ``[DONE]``.

    A client that disconnects cancels this generator at its next ``await``: the job is cancelled
    and its row leaves the batch before its next round."""
    progress = Progress(prepared)
    rid, _, obj = _ids(prepared.chat)
    created = int(time.time())
    model_id = prepared.model.id

    def chunk(segments: list[tuple[str, str]], finish: str | None, extra: dict[str, Any]) -> str:
        text = "".join(t for t, _ in segments)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if prepared.chat:
            choice["delta"] = {"content": text} if text or finish is None else {}
        else:
            choice["text"] = text
        return _sse({"id": rid, "object": obj, "created": created, "model": model_id, "choices": [choice],
                     "specdec": {"pieces": [{"text": t, "kind": k} for t, k in segments], **extra,
                                 **progress.figures()}})

    try:
        if prepared.chat:
            yield _sse({"id": rid, "object": obj, "created": created, "model": model_id,
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None, "logprobs": None}]})
        while True:
            item = await job.next()
            if isinstance(item, Round):
                yield chunk(progress.add(item), None, {"tokens": item.tokens, "kinds": item.kinds})
            elif isinstance(item, Failed):
                yield _sse(APIError(500, item.message, code="decoding_failed").body())
                break
            else:
                result = item.result
                segments = progress.text.release_final(result.stop_reason)
                yield chunk(segments, finish_reason(result.stop_reason),
                            {"tokens": [], "kinds": [], "stop_reason": result.stop_reason})
                if prepared.include_usage:
                    yield _sse({"id": rid, "object": obj, "created": created, "model": model_id, "choices": [],
                                "usage": usage(prepared.request.prompt_tokens, result.stats)})
                break
        yield _sse("[DONE]")
    finally:
        if not job.finished:
            prepared.model.engine.cancel(job)


async def answer(value: Any) -> Any:
    """``value``, or what it awaits: an app apart from its engines asks their process (``specdec.serve.front``)."""
    return await value if inspect.isawaitable(value) else value


def load_of(model: ServedModel) -> dict[str, Any] | Awaitable[dict[str, Any]]:
    """A served model's load and figures, for the page's second view; ``auto``: what ``--speculate auto`` measured
    and kept per batch-size bucket so far (``Crossover.choices``; empty for another schedule). From an app apart
    from its engines: the engines' process's answer, to await."""
    engine = model.engine
    if not isinstance(engine, Engine):  # a RemoteEngine
        return engine.ask("stats")
    t = engine.totals
    return {"id": model.id, **model.description, "speculate": engine.speculate, "batch_size": engine.batch_size,
            "prefill_beside": engine.prefill_beside, "helper": engine.helper, "running": engine.running, "waiting": engine.waiting,
            "batch": engine.batch, "totals": asdict(t),
            "acceptance_rate": t.accepted / t.drafted if t.drafted else 0.0,
            "mean_accepted_length": t.new_tokens / t.rounds if t.rounds else 0.0,
            "history": [asdict(s) for s in engine.load_history()],
            "auto": [asdict(c) for c in choices()] if (choices := getattr(engine.schedule, "choices", None)) else []}
