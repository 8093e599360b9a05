"""The OpenAI protocol's edge: request bodies, their checks, error objects, prompts from messages.

Request bodies follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions``: ``model``,
``prompt`` (one or a list) or ``messages``, ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``,
``top_p``, ``stop``, ``seed``, ``n``, ``stream``, ``stream_options.include_usage``, ``logit_bias``,
``presence_penalty``, ``frequency_penalty``, ``user``; completions also ``logprobs``, ``echo``, ``best_of``; chat
``logprobs`` and ``top_logprobs``; and, as vLLM accepts, ``top_k``. Types are strict, as OpenAI checks them (``"5"``
is not an integer, ``true`` not a number), and a field this server does not support (``suffix``, ``tools``,
``response_format``, any unknown one) is refused by name, never ignored: a client must not believe it was honoured.
A field left out (or null) takes the server's default (its ``specdec serve`` flags: ``--temperature``,
``--max-new-tokens``...).

Every refusal is an ``APIError`` that the app renders as OpenAI's error object
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status; the message names the
field, the bad value and the fix. Sampling values are checked by the core's own ``SamplingConfig``,
so the server and the library accept the same values.

Chat: the tokenizer's chat template when it has one (``apply_chat_template`` with the generation
prompt, as ``specdec generate --chat-template``); otherwise a plain fallback, ``role: content`` per
line, then ``assistant:`` (the shipped code-target has no template).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from transformers import PreTrainedTokenizerBase

from specdec.config import SamplingConfig
from specdec.processors import Penalties

MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM any number
MAX_LOGPROBS = 20  # most probable tokens reported per position (OpenAI: 5 for completions, 20 for chat; vLLM 20)
MAX_CHOICES = 16  # n and best_of at most (every choice is a row of the batch)
MAX_PROMPTS = 64  # prompts in one completion request


class APIError(Exception):
    """A refused request: HTTP ``status`` and OpenAI's error fields."""

    TYPES: ClassVar[dict[int, str]] = {401: "authentication_error", 500: "server_error",
                                       503: "server_error"}  # else invalid_request_error

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or self.TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    """A part of a request: its fields typed as OpenAI validates them (``"5"`` is no integer, ``true`` no number),
    and a field it does not know refused by name (``parse_body``), never ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the usage (and its speculation figures), choices empty


class _Body(_Strict):
    """The fields both endpoints share."""

    model: str | None = None  # a served model id; None = the only (first) one served
    max_tokens: int | None = None  # new tokens at most; None = the server's --max-new-tokens; 0 with echo: scoring
    temperature: float | None = None  # 0 = greedy; None = the server's --temperature
    top_p: float | None = None  # nucleus mass in (0, 1]; None = the server's --top-p
    top_k: int | None = None  # vLLM's extension: keep the k most probable tokens; 0 = off
    stop: str | list[str] | None = None  # stop once the text contains one of these (left out of the text)
    seed: int | None = None  # seeds this request's own sampling generator (choice i: seed + i)
    n: int | None = None  # choices per prompt (1 to MAX_CHOICES; None = 1)
    stream: bool | None = False  # server-sent events, one chunk per round, then data: [DONE]
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit, in [-100, 100]
    presence_penalty: float | None = None  # in [-2, 2]: subtracted from the logit of each token the output holds
    frequency_penalty: float | None = None  # in [-2, 2]: subtracted once per time the output holds the token
    user: str | None = None  # OpenAI's end-user id (for its abuse monitoring): changes nothing here


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(...)  # prompts: text or token ids, or a list
    logprobs: int | None = None  # 0 to MAX_LOGPROBS: each token's log-probability and that many most probable
    echo: bool | None = False  # the prompt before the completion (with its log-probabilities when logprobs is set)
    best_of: int | None = None  # generate this many per prompt and return the n best (mean token log-probability)


class ContentPart(_Strict):
    type: str = "text"
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # a participant's name (OpenAI's field): not part of the prompt


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(...)
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens; wins when both are given
    logprobs: bool | None = False  # each output token's log-probability
    top_logprobs: int | None = None  # 0 to MAX_LOGPROBS most probable tokens at each position (needs logprobs)


# Why a field OpenAI knows is refused here (any other unknown field: "not supported").
UNSUPPORTED = {
    "suffix": "insertion after a suffix (fill-in-the-middle) is not supported",
    "tools": "tool calling is not supported", "tool_choice": "tool calling is not supported",
    "parallel_tool_calls": "tool calling is not supported", "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "response_format": "structured output (JSON mode, JSON schemas) is not supported",
    "modalities": "text is the only modality", "audio": "text is the only modality",
    "prediction": "predicted outputs are not supported", "reasoning_effort": "this is not a reasoning model",
    "echo": "echo is a field of /v1/completions", "best_of": "best_of is a field of /v1/completions",
}


def parse_body(cls: type[_Body], data: object) -> _Body:
    """Validate a decoded JSON body as ``cls``; an ``APIError`` (400) naming the field otherwise: a value of the
    wrong type, or a field this server does not support (a field it does not know that is null is absent, in the
    body and in its messages)."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_body")
    data = {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
    if isinstance(data.get("messages"), list):  # a reply's message sent back carries null refusal, tool_calls...
        data["messages"] = [{k: v for k, v in m.items() if v is not None or k in ChatMessage.model_fields}
                            if isinstance(m, dict) else m for m in data["messages"]]
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(part) for part in first["loc"]]
        param = loc[0] if loc else None
        if first["type"] == "missing" and len(loc) == 1:
            raise APIError(400, f"'{param}' is required", param=param, code="missing_required_parameter") from None
        # the path to the field, less the union members pydantic names (str, list[int], ...)
        where = ".".join(p for p in loc
                         if p not in ("str", "int", "float", "bool") and not p.startswith(("list[", "dict[")))
        if first["type"] == "extra_forbidden":
            reason = UNSUPPORTED.get(loc[-1], "this server does not support it") if len(loc) == 1 else \
                "this server does not know it"
            raise APIError(400, f"unsupported parameter '{where}': {reason}; leave it out", param=param,
                           code="unsupported_parameter") from None
        raise APIError(400, f"invalid '{where or param}': {first['msg']} (got {first.get('input')!r:.80})",
                       param=param, code="invalid_value") from None


def sampling_of(body: _Body, defaults: SamplingConfig) -> SamplingConfig:
    """The request's sampling settings (its own, else the server's), checked by ``SamplingConfig``."""
    values = {"temperature": defaults.temperature if body.temperature is None else body.temperature,
              "top_k": defaults.top_k if body.top_k is None else body.top_k,
              "top_p": defaults.top_p if body.top_p is None else body.top_p,
              "seed": defaults.seed if body.seed is None else body.seed}
    try:
        return SamplingConfig(**values)
    except ValueError as err:
        param = str(err).split()[0]
        raise APIError(400, str(err), param=param if param in values else None, code="invalid_value") from None


def max_tokens_of(body: _Body, default: int) -> int:
    """The request's token budget: ``max_completion_tokens`` (chat), else ``max_tokens``, else ``default``; 0 only
    with ``echo`` (scoring the prompt: lm-evaluation-harness's log-likelihood requests)."""
    name, value = "max_tokens", body.max_tokens
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        name, value = "max_completion_tokens", body.max_completion_tokens
    if value is None:
        return default
    echo = isinstance(body, CompletionBody) and bool(body.echo)
    if value < 0 or (value == 0 and not echo):
        raise APIError(400, f"{name} must be >= 1 (new tokens at most; 0 only with echo, to score the prompt), "
                       f"got {value}", param=name, code="invalid_value")
    return value


def stop_strings_of(body: _Body) -> tuple[str, ...]:
    """The request's stop strings (non-empty, at most ``MAX_STOP_STRINGS``)."""
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if any(not s for s in stops):
        raise APIError(400, "stop strings must be non-empty", param="stop", code="invalid_value")
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop",
                       code="invalid_value")
    return stops


def _within(name: str, value: float | None, lo: float, hi: float) -> None:
    if value is not None and not lo <= value <= hi:
        raise APIError(400, f"{name} must lie in [{lo:g}, {hi:g}], got {value}", param=name, code="invalid_value")


def choices_of(body: _Body) -> tuple[int, int]:
    """(n, best_of): the choices returned per prompt, and the sequences generated per prompt to pick them from."""
    n = 1 if body.n is None else body.n
    _within("n", n, 1, MAX_CHOICES)
    best_of = getattr(body, "best_of", None)
    if best_of is None:
        return n, n
    _within("best_of", best_of, 1, MAX_CHOICES)
    if best_of < n:
        raise APIError(400, f"best_of ({best_of}) must be >= n ({n}): it is how many sequences the n are chosen "
                       "from", param="best_of", code="invalid_value")
    return n, best_of


def logprobs_of(body: _Body) -> int | None:
    """How many most probable tokens to report at each position (None: no log-probabilities): completions'
    ``logprobs``; chat's ``top_logprobs`` when ``logprobs`` is true (else 0)."""
    if isinstance(body, CompletionBody):
        _within("logprobs", body.logprobs, 0, MAX_LOGPROBS)
        return body.logprobs
    chat = body if isinstance(body, ChatBody) else None
    if chat is None:
        return None
    _within("top_logprobs", chat.top_logprobs, 0, MAX_LOGPROBS)
    if not chat.logprobs:
        if chat.top_logprobs is not None:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        return None
    return chat.top_logprobs or 0


def penalties_of(body: _Body, vocab_size: int) -> Penalties | None:
    """The request's ``logit_bias`` and presence / frequency penalties (None: none), checked as OpenAI checks them."""
    _within("presence_penalty", body.presence_penalty, -2.0, 2.0)
    _within("frequency_penalty", body.frequency_penalty, -2.0, 2.0)
    bias = []
    for key, value in (body.logit_bias or {}).items():
        token = int(key) if key.strip().lstrip("-").isdigit() else None
        if token is None or not 0 <= token < vocab_size:
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab_size}) written as strings, got "
                           f"{key!r}", param="logit_bias", code="invalid_value")
        _within("logit_bias", value, -100.0, 100.0)
        bias.append((token, float(value)))
    penalties = Penalties(tuple(sorted(bias)), body.presence_penalty or 0.0, body.frequency_penalty or 0.0)
    return penalties if penalties else None


def completion_prompts(prompt: str | list, tokenizer: PreTrainedTokenizerBase) -> list[tuple[list[int], str | None]]:
    """A completion's prompts (text, token ids, or a list of either) -> each one's (token ids, its text as given,
    None for ids)."""
    many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    prompts = prompt if many else [prompt]
    if not prompts or len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"send 1 to {MAX_PROMPTS} prompts, got {len(prompts)}", param="prompt",
                       code="invalid_value")
    return [(list(tokenizer(p).input_ids), p) if isinstance(p, str) else (list(p), None) for p in prompts]


def _content_text(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    for part in content:
        if part.type != "text":
            raise APIError(400, f"content parts of type {part.type!r} are not supported (text only)",
                           param="messages", code="unsupported_parameter")
    return "".join(part.text or "" for part in content)


def plain_chat(messages: list[dict[str, str]]) -> str:
    """The fallback chat format for tokenizers without a template: "role: content" lines, then "assistant:"."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def chat_prompt_ids(messages: list[ChatMessage], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Chat messages -> token ids, through the tokenizer's chat template or the plain fallback."""
    if not messages:
        raise APIError(400, "'messages' is empty: send at least one message", param="messages",
                       code="invalid_value")
    plain = [{"role": m.role, "content": _content_text(m.content)} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(plain, add_generation_prompt=True, return_dict=True)
        return list(encoded["input_ids"])
    return list(tokenizer(plain_chat(plain)).input_ids)


def check_prompt_ids(ids: list[int], vocab_size: int, context_limit: int | None, source: bool = False,
                     generates: bool = True) -> None:
    """Refuse an empty prompt, ids outside the vocabulary, and a prompt that fills the context (with
    ``source``, the prompt is an encoder-decoder target's source: it must fit the encoder's positions; without
    ``generates``, a prompt only scored, it may fill the context)."""
    if not ids:
        raise APIError(400, "the prompt is empty (no tokens): send some text", param="prompt", code="invalid_value")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        raise APIError(400, f"prompt token ids must lie in [0, {vocab_size}), got {lo}..{hi}", param="prompt",
                       code="invalid_value")
    if source and context_limit is not None and len(ids) > context_limit:
        raise APIError(400, f"this model's encoder holds {context_limit} tokens, but the source has {len(ids)}: "
                       f"shorten it by {len(ids) - context_limit}", param="prompt", code="context_length_exceeded")
    if not source and context_limit is not None and len(ids) >= context_limit + (not generates):
        raise APIError(400, f"this model's maximum context length is {context_limit} tokens, but the prompt has "
                       f"{len(ids)} tokens, which leaves no room to generate: shorten the prompt",
                       param="prompt", code="context_length_exceeded")
