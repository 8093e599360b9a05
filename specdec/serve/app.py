"""The HTTP app: OpenAI's endpoints over the engines, the metrics, the page, and who may call.

Endpoints (FastAPI):
- ``GET /health``: ``{"status": "ok"}``, never behind the key (for load balancers);
- ``GET /v1/models``: the served models (id = the target's shipped name or folder name);
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI's bodies (``protocol``); with
  ``stream: true`` server-sent events, one chunk per committed round, ending in ``data: [DONE]``;
- ``GET /metrics``: Prometheus text named as vLLM's (``metrics``);
- ``GET /stats``: the load as JSON, for the page (rows running and waiting, batch, tokens/s history);
- ``GET /`` and ``/static/*``: the page (``static/``).

A request is one decoder ``Request`` per sequence (prompts x ``best_of``), each its own row of the batch; its
log-probabilities come from the rounds (``Request.logprobs``) and, with ``echo``, from a forward over the prompt
(``Request.prompt_logprobs``, scored by the engine before the row joins). Responses carry OpenAI's fields (the
``logprobs`` objects of completions and chat), plus ``usage.speculation`` (drafted, accepted, rounds, acceptance
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
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field, replace
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
from specdec.logprobs import TokenLogprob
from specdec.processors import Processing
from specdec.serve import memory
from specdec.serve.config import ServeConfig
from specdec.serve.engine import Engine, Failed, Finished, Job, Round
from specdec.serve.metrics import CONTENT_TYPE, FINISH_REASONS, ServerMetrics
from specdec.serve.policy import Policy
from specdec.serve.protocol import (
    APIError,
    ChatBody,
    CompletionBody,
    _Body,
    chat_prompt_ids,
    check_prompt_ids,
    choices_of,
    completion_prompts,
    logprobs_of,
    max_tokens_of,
    parse_body,
    penalties_of,
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
MAX_DEPTH = 32  # JSON nesting a body may have (OpenAI's bodies nest 4 levels: messages[i].content[j].text)
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
    """A checked request, ready for its engine: one decoder ``Request`` per sequence to generate."""

    model: ServedModel
    requests: list[DecodeRequest]  # prompt p's sequence j at p * best_of + j
    prompts: list[tuple[list[int], str | None]]  # each prompt's token ids, and its text as given (None: ids)
    stream: bool
    include_usage: bool
    chat: bool
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # sequences generated per prompt (the n of them with the best mean log-probability return)
    logprobs: int | None = None  # most probable tokens reported per position; None: no log-probabilities
    echo: bool = False  # the prompt (and its log-probabilities) before each completion

    @property
    def request(self) -> DecodeRequest:
        """The first (a streamed request's only) sequence."""
        return self.requests[0]


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
    app.add_middleware(Policy, config=config)  # Host, Origin and Content-Type, before anything else
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
        prompts = completion_prompts(body.prompt, model.tokenizer)
        return await respond(request, prepare(model, body, prompts, chat=False))

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await body_of(request, ChatBody)
        model = model_for(body.model)
        if model.engine.target.encoder_decoder and not getattr(model.tokenizer, "chat_template", None):
            raise APIError(400, f"{model.id} is an encoder-decoder model without a chat template (a translation "
                           "model): send the source text to /v1/completions as the prompt", param="messages",
                           code="invalid_value")
        ids = chat_prompt_ids(body.messages, model.tokenizer)
        return await respond(request, prepare(model, body, [(ids, None)], chat=True))

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
        data = json.loads(b"".join(chunks))
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels: send OpenAI's flat body",
                       code="invalid_json") from None
    except ValueError as err:  # not JSON, not UTF-8, or an integer past Python's 4300 digits
        if "integer string conversion" in str(err):
            raise APIError(400, f"the request body holds a number of more than {sys.get_int_max_str_digits()} digits: "
                           "send numbers in range", code="invalid_json") from None
        raise APIError(400, f"the request body is not valid JSON ({err}): send a JSON object",
                       code="invalid_json") from None
    check_json(data)
    return data


def check_json(data: object) -> None:
    """Refuse what JSON decodes but nothing downstream takes: nesting past ``MAX_DEPTH`` (a recursion in the
    checks), and a lone UTF-16 surrogate (``"\\ud800"``: not Unicode text; the tokenizer cannot encode it), in a
    key or a value. An ``APIError`` (400) naming the top-level field."""
    stack: list[tuple[object, int, str | None]] = [(data, 0, None)]
    while stack:
        value, depth, field = stack.pop()
        if depth > MAX_DEPTH:
            raise APIError(400, f"'{field}' nests deeper than {MAX_DEPTH} levels", param=field, code="invalid_value")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, field)  # a bad top-level key is named by no field (it cannot be echoed)
                stack.append((item, depth + 1, field or key))
        elif isinstance(value, list):
            stack += [(item, depth + 1, field) for item in value]
        elif isinstance(value, str):
            _check_text(value, field)


def _check_text(text: str, field: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        where = f"'{field}'" if field else "the request body"
        raise APIError(400, f"{where} holds a lone UTF-16 surrogate ({ascii(text[err.start])[1:-1]}), which is not "
                       "a character: send valid Unicode text", param=field, code="invalid_value") from None


def prepare(model: ServedModel, body: _Body, prompts: list[tuple[list[int], str | None]], *, chat: bool) -> Prepared:
    """Check every field of a request and build its decoder ``Request``s (``best_of`` per prompt; with a seed,
    sequence j draws from seed + j, so choice 0 is the request's n = 1 answer)."""
    n, best_of = choices_of(body)
    stream = bool(body.stream)
    echo = isinstance(body, CompletionBody) and bool(body.echo)
    if stream:
        for name, many, what in (("n", n > 1, "n > 1"), ("best_of", best_of > 1, "best_of > 1"),
                                 ("prompt", len(prompts) > 1, "several prompts"), ("echo", echo, "echo")):
            if many:
                raise APIError(400, f"streaming with {what} is not supported: send stream false, or one request "
                               "per choice (they are batched together)", param=name, code="unsupported_parameter")
    logprobs = logprobs_of(body)
    target = model.engine.target
    if echo and target.encoder_decoder:
        raise APIError(400, f"{model.id} is an encoder-decoder model: its prompt is the encoder's source, which it "
                       "does not predict, so it cannot be echoed with log-probabilities", param="echo",
                       code="unsupported_parameter")
    sampling = sampling_of(body, model.sampling)
    try:
        rule_for(model.verify, sampling.greedy)
    except ValueError as err:
        raise APIError(400, str(err), param="temperature", code="invalid_value") from None
    max_tokens = max_tokens_of(body, model.max_new_tokens)
    stops = stop_strings_of(body)
    penalties = penalties_of(body, model.vocab_size)
    ask = logprobs if logprobs is not None else 0 if best_of > n else None  # best_of ranks by log-probability
    requests = []
    for ids, _ in prompts:
        check_prompt_ids(ids, model.vocab_size, model.context_limit, source=target.encoder_decoder,
                         generates=max_tokens > 0)
        base = prompt_request(target, ids, max_tokens, sampling, model.stop_ids, stops,
                              processing=model.processing if max_tokens > 0 else None)  # scoring: no round
        base = replace(base, penalties=penalties, logprobs=ask,
                       prompt_logprobs=(logprobs or 0) if echo and (logprobs is not None or max_tokens == 0) else None)
        for j in range(best_of):
            seed = None if sampling.seed is None else sampling.seed + j
            requests.append(replace(base, sampling=replace(sampling, seed=seed)))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Prepared(model, requests, prompts, stream, include_usage, chat, n, best_of, logprobs, echo)


async def respond(request: Request, prepared: Prepared) -> Response:
    """Submit the request's sequences to its engine; stream its rounds or wait for its results."""
    loop = asyncio.get_running_loop()
    jobs = [prepared.model.engine.submit(r, loop) for r in prepared.requests]
    if prepared.stream:
        return StreamingResponse(stream(jobs[0], prepared), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    tasks = [asyncio.ensure_future(complete(request, job, prepared, r)) for job, r in zip(jobs, prepared.requests)]
    try:
        outcomes = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # one failed, or the client went away: the others' rows leave too
            task.cancel()
        raise
    return JSONResponse(_whole(prepared, outcomes))


# ---------------------------------------------------------------------------------- responses


def token_text(tokenizer: PreTrainedTokenizerBase, token: int) -> str:
    """One token's text, as the log-probability objects name it."""
    return tokenizer.decode([token])


class Progress:
    """A sequence's figures as its rounds arrive (for each chunk), its text and its log-probabilities."""

    def __init__(self, prepared: Prepared, request: DecodeRequest | None = None) -> None:
        r = request or prepared.request
        self.prepared = prepared
        self.text = TextStream(prepared.model.tokenizer, r.ids, r.stop_strings)
        self.tokens: list[int] = []
        self.kinds: list[str] = []
        self.drafted = self.accepted = self.rounds = 0
        self.offset = 0  # text_offset of the next token (completions' log-probabilities)
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

    def logprobs(self, items: Sequence[tuple[int, TokenLogprob | None]]) -> dict[str, Any]:
        """OpenAI's log-probability object of ``items`` (token id, its figures), continuing this sequence's
        offsets: completions' four parallel lists (each position's top dict holds the chosen token too, as
        OpenAI's "up to logprobs + 1" entries), or chat's ``content`` list."""
        tokenizer = self.prepared.model.tokenizer
        if self.prepared.chat:
            def entry(token: int, logprob: float) -> dict[str, Any]:
                text = token_text(tokenizer, token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
            return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                                for t, lp in items if lp is not None]}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in items:
            text = token_text(tokenizer, token)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top: dict[str, float] = {}
            for i, v in (*lp.top, (token, lp.logprob)):
                top.setdefault(token_text(tokenizer, i), v)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top)
        return out

    def figures(self) -> dict[str, Any]:
        return {"completion_tokens": len(self.tokens), "rounds": self.rounds, "drafted": self.drafted,
                "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accepted_length": len(self.tokens) / self.rounds if self.rounds else 0.0,
                "elapsed_s": time.perf_counter() - self.started}


def usage(prompt_tokens: int, stats: GenerationStats | Sequence[GenerationStats]) -> dict[str, Any]:
    """OpenAI's usage (every sequence generated counts, best_of's dropped ones too, as OpenAI bills them), plus
    the speculation figures of the request: drafted, accepted, rounds, α = accepted / drafted, τ = tokens per
    round (vLLM reports the same per request)."""
    every = [stats] if isinstance(stats, GenerationStats) else list(stats)
    new = sum(s.new_tokens for s in every)
    drafted, accepted, rounds = (sum(s.drafted for s in every), sum(s.accepted for s in every),
                                 sum(s.rounds for s in every))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": new, "total_tokens": prompt_tokens + new,
            "speculation": {"drafted": drafted, "accepted": accepted, "rounds": rounds,
                            "acceptance_rate": accepted / drafted if drafted else 0.0,
                            "mean_accepted_length": new / rounds if rounds else 0.0,
                            "lossless": all(s.lossless for s in every)}}


def finish_reason(stop_reason: str) -> str:
    """OpenAI's finish_reason ("stop" or "length") of one of our stop reasons."""
    return "length" if FINISH_REASONS.get(stop_reason) == "length" else "stop"


def _ids(chat: bool) -> tuple[str, str, str]:
    """(response id, whole-response object, chunk object) of an endpoint."""
    if chat:
        return f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", "chat.completion.chunk"
    return f"cmpl-{uuid.uuid4().hex}", "text_completion", "text_completion"


def failure(item: Failed) -> APIError:
    """The error a failed request is answered with: 503 where the server is stopping (or its engines have), else 500."""
    return APIError(item.status, item.message, code="server_shutting_down" if item.status == 503 else "decoding_failed")


def _raise_failed(item: Failed) -> None:
    raise failure(item)


@dataclass
class Outcome:
    """One sequence's end: its progress (text, kinds, offsets) and its ``Finished`` item."""

    progress: Progress
    finished: Finished

    def mean_logprob(self) -> float:
        """Mean log-probability of its tokens (best_of's ranking, as OpenAI defines it; 0 for none)."""
        lps = self.finished.logprobs or []
        return sum(lp.logprob for lp in lps) / len(lps) if lps else 0.0


async def complete(request: Request, job: Job, prepared: Prepared, decode: DecodeRequest) -> Outcome:
    """Wait for a sequence's whole result (cancelling the job if the client goes away).

    The client is checked every ``DISCONNECT_POLL_S`` whether rounds arrive or not: a client that gives up while its
    row commits round after round must free its batch slot then, not hold it to ``max_tokens`` (issue 67)."""
    progress = Progress(prepared, decode)
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
                progress.text.release_final(item.result.stop_reason)
                return Outcome(progress, item)
    finally:
        if pending is not None:
            pending.cancel()
        if not job.finished:
            prepared.model.engine.cancel(job)


def _whole(prepared: Prepared, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The response body: per prompt, its n choices (the best n of its best_of sequences)."""
    rid, obj, _ = _ids(prepared.chat)
    tokenizer = prepared.model.tokenizer
    choices, extras = [], []
    for p, (ids, given) in enumerate(prepared.prompts):
        mine = outcomes[p * prepared.best_of:(p + 1) * prepared.best_of]
        if prepared.best_of > prepared.n:
            mine = sorted(mine, key=Outcome.mean_logprob, reverse=True)[:prepared.n]
        for j, outcome in enumerate(mine):
            result, progress = outcome.finished.result, outcome.progress
            text = progress.text.released
            choice: dict[str, Any] = {"index": p * prepared.n + j, "finish_reason": finish_reason(result.stop_reason),
                                      "logprobs": None}
            items: list[tuple[int, TokenLogprob | None]] = []
            if prepared.echo:
                prompt = given if given is not None else tokenizer.decode(ids)
                text = prompt + text
                if outcome.finished.prompt_logprobs is not None:
                    items += list(zip(ids, outcome.finished.prompt_logprobs))
            else:
                progress.offset = len(given if given is not None else tokenizer.decode(ids))
            if prepared.logprobs is not None:
                items += list(zip(result.tokens, outcome.finished.logprobs or []))
                choice["logprobs"] = progress.logprobs(items)
            if prepared.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
            extras.append({"token_ids": result.tokens, "kinds": progress.kinds, "stop_reason": result.stop_reason})
    prompt_tokens = sum(r.prompt_tokens for r in prepared.requests[::prepared.best_of])
    return {"id": rid, "object": obj, "created": int(time.time()), "model": prepared.model.id, "choices": choices,
            "usage": usage(prompt_tokens, [o.finished.result.stats for o in outcomes]),
            "specdec": {**extras[0], "choices": extras}}


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def stream(job: Job, prepared: Prepared) -> AsyncIterator[str]:
    """Server-sent events: a chunk per committed round, the finish, the usage if asked, ``[DONE]``.

    A client that disconnects cancels this generator at its next ``await``: the job is cancelled
    and its row leaves the batch before its next round."""
    progress = Progress(prepared)
    ids, given = prepared.prompts[0]
    progress.offset = len(given if given is not None else prepared.model.tokenizer.decode(ids))
    rid, _, obj = _ids(prepared.chat)
    created = int(time.time())
    model_id = prepared.model.id

    def chunk(segments: list[tuple[str, str]], finish: str | None, extra: dict[str, Any],
              logprobs: dict[str, Any] | None = None) -> str:
        text = "".join(t for t, _ in segments)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
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
                logprobs = (None if prepared.logprobs is None else
                            progress.logprobs(list(zip(item.tokens, item.logprobs or []))))
                yield chunk(progress.add(item), None, {"tokens": item.tokens, "kinds": item.kinds}, logprobs)
            elif isinstance(item, Failed):
                yield _sse(failure(item).body())
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
            "prefill_beside": engine.prefill_beside, "helper": engine.helper, "running": engine.running,
            "waiting": engine.waiting, "batch": engine.batch, "totals": asdict(t),
            "acceptance_rate": t.accepted / t.drafted if t.drafted else 0.0,
            "mean_accepted_length": t.new_tokens / t.rounds if t.rounds else 0.0,
            "history": [asdict(s) for s in engine.load_history()], "memory": memory.usage(),
            "auto": [asdict(c) for c in choices()] if (choices := getattr(engine.schedule, "choices", None)) else []}
