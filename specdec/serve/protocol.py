"""The OpenAI protocol's edge: request bodies, their checks, error objects, prompts from messages.

Request bodies follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions``: ``model``,
``prompt`` or ``messages``, ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``,
``top_p``, ``stop``, ``seed``, ``n`` (1 only), ``stream``, ``stream_options.include_usage``; and, as
vLLM accepts, ``top_k``. Unknown fields are ignored, as OpenAI-compatible servers do. A field left
out takes the server's default (its ``specdec serve`` flags: ``--temperature``, ``--max-new-tokens``...).

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

MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM any number


class APIError(Exception):
    """A refused request: HTTP ``status`` and OpenAI's error fields."""

    TYPES: ClassVar[dict[int, str]] = {401: "authentication_error", 500: "server_error", 503: "server_error"}  # else invalid_request_error

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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False  # a last chunk with the usage (and its speculation figures), choices empty


class _Body(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # a served model id; None = the only (first) one served
    max_tokens: int | None = None  # new tokens at most; None = the server's --max-new-tokens
    temperature: float | None = None  # 0 = greedy; None = the server's --temperature
    top_p: float | None = None  # nucleus mass in (0, 1]; None = the server's --top-p
    top_k: int | None = None  # vLLM's extension: keep the k most probable tokens; 0 = off
    stop: str | list[str] | None = None  # stop once the text contains one of these (left out of the text)
    seed: int | None = None  # seeds this request's own sampling generator
    n: int | None = 1  # choices per request: 1 only
    stream: bool | None = False  # server-sent events, one chunk per round, then data: [DONE]
    stream_options: StreamOptions | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(...)  # one prompt: text or token ids


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = "text"
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(...)
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens; wins when both are given


def parse_body(cls: type[_Body], data: object) -> _Body:
    """Validate a decoded JSON body as ``cls``; an ``APIError`` (400) naming the field otherwise."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_body")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(part) for part in first["loc"]]
        param = loc[0] if loc else None
        if first["type"] == "missing" and len(loc) == 1:
            raise APIError(400, f"'{param}' is required", param=param, code="missing_required_parameter") from None
        where = ".".join(p for p in loc if not p.startswith(("str", "list[", "int")))
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
    """The request's token budget: ``max_completion_tokens`` (chat), else ``max_tokens``, else ``default``."""
    name, value = "max_tokens", body.max_tokens
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        name, value = "max_completion_tokens", body.max_completion_tokens
    if value is None:
        return default
    if value < 1:
        raise APIError(400, f"{name} must be >= 1 (new tokens at most), got {value}", param=name,
                       code="invalid_value")
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


def check_n(body: _Body) -> None:
    if body.n not in (None, 1):
        raise APIError(400, f"n must be 1 (this server returns one choice per request), got {body.n}: send n "
                       "requests instead; they are batched together", param="n", code="invalid_value")


def completion_prompt_ids(prompt: str | list, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """One completion prompt (text, token ids, or a list of one of those) -> token ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"one prompt per request, got a list of {len(prompt)}: send one request per "
                           "prompt (they are batched together)", param="prompt", code="invalid_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(tokenizer(prompt).input_ids)
    return list(prompt)


def _content_text(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content if part.type == "text")


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


def check_prompt_ids(ids: list[int], vocab_size: int, context_limit: int | None, source: bool = False) -> None:
    """Refuse an empty prompt, ids outside the vocabulary, and a prompt that fills the context (with
    ``source``, the prompt is an encoder-decoder target's source: it must fit the encoder's positions)."""
    if not ids:
        raise APIError(400, "the prompt is empty (no tokens): send some text", param="prompt", code="invalid_value")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        raise APIError(400, f"prompt token ids must lie in [0, {vocab_size}), got {lo}..{hi}", param="prompt",
                       code="invalid_value")
    if source and context_limit is not None and len(ids) > context_limit:
        raise APIError(400, f"this model's encoder holds {context_limit} tokens, but the source has {len(ids)}: "
                       f"shorten it by {len(ids) - context_limit}", param="prompt", code="context_length_exceeded")
    if not source and context_limit is not None and len(ids) >= context_limit:
        raise APIError(400, f"this model's maximum context length is {context_limit} tokens, but the prompt has "
                       f"{len(ids)} tokens, which leaves no room to generate: shorten the prompt",
                       param="prompt", code="context_length_exceeded")
