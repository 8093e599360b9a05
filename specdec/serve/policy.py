"""Who may call the server from a browser: the Host, Origin and Content-Type checks, before the app.

A page on another site can make a visitor's browser send requests to a server on their machine. Two shapes of it,
refused here whether or not the server has a key:

- a cross-origin "simple" request (``Content-Type: text/plain`` or a form, no preflight asked): the browser sends
  it and only hides the answer, so the model generates for any page. The API's POST endpoints take only
  ``Content-Type: application/json`` (415 otherwise), which a browser never sends cross-origin without asking first,
  and any API request whose ``Origin`` is not the server's own is refused (403) unless ``--allowed-origins`` names
  it; those it names get CORS's answers (a preflight's 204, ``Access-Control-Allow-Origin`` on the reply);
- DNS rebinding: a name of the attacker's own pointed at 127.0.0.1, so the browser deems the page and the server
  one origin. Its requests carry the attacker's name in ``Host``: a server bound to loopback answers only a
  ``Host`` naming a loopback address, ``localhost`` or one of ``--allowed-hosts`` (403 otherwise; any port).

The API is ``/v1/*``, ``/metrics`` and ``/stats``; ``/health``, the page and its files pass the Origin check (a
navigation sends none; they hold no data). Refusals are OpenAI error objects, as the app's.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response

from specdec.serve.config import ServeConfig
from specdec.serve.protocol import APIError

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]
API_PREFIXES = ("/v1/", "/metrics", "/stats")  # what needs the key, and the Origin check
JSON = "application/json"


def names(value: str | None) -> frozenset[str]:
    """A comma-separated flag's entries, lower-cased and without a trailing slash."""
    return frozenset(v.strip().lower().rstrip("/") for v in (value or "").split(",") if v.strip())


def hostname(host: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:8000`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: always this machine
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Policy:
    """ASGI middleware: the Host, Origin and Content-Type checks of ``config`` before ``app``."""

    def __init__(self, app: ASGIApp, config: ServeConfig) -> None:
        self.app = app
        self.check_host = config.loopback
        self.hosts = names(config.allowed_hosts) | {hostname(config.host)}
        self.origins = names(config.allowed_origins)

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host")
        if self.check_host and host is not None and not (loopback_name(name := hostname(host)) or name in self.hosts):
            await refuse(403, f"the Host {host!r} is not this server's address (it listens on loopback): call it "
                         "at localhost or 127.0.0.1, or start it with --allowed-hosts NAME where a proxy sends NAME",
                         "host_not_allowed")(scope, receive, send)
            return
        path: str = scope["path"]
        if not path.startswith(API_PREFIXES):
            await self.app(scope, receive, send)
            return
        origin = headers.get("origin")
        cross = origin is not None and origin.lower().rstrip("/") != f"{scope.get('scheme', 'http')}://{host}".lower()
        if cross and not ("*" in self.origins or origin.lower().rstrip("/") in self.origins):
            await refuse(403, f"cross-origin requests from {origin!r} are refused: start the server with "
                         "--allowed-origins ORIGIN to let a page of that origin call it", "origin_not_allowed"
                         )(scope, receive, send)
            return
        if cross and scope["method"] == "OPTIONS":  # a preflight from an allowed origin
            await Response(status_code=204, headers={
                "Access-Control-Allow-Origin": origin, "Vary": "Origin",
                "Access-Control-Allow-Methods": "GET, POST", "Access-Control-Max-Age": "600",
                "Access-Control-Allow-Headers": headers.get("access-control-request-headers",
                                                            "authorization, content-type")})(scope, receive, send)
            return
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != JSON:
                await refuse(415, f"the request's Content-Type is {media or 'missing'!r}: send the JSON body with "
                             f"'Content-Type: {JSON}'", "unsupported_media_type")(scope, receive, send)
                return
        if cross:
            await self.app(scope, receive, _allowing(send, origin))
        else:
            await self.app(scope, receive, send)


def refuse(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(APIError(status, message, code=code).body(), status_code=status)


def _allowing(send: Callable[[Any], Awaitable[None]], origin: str) -> Callable[[Any], Awaitable[None]]:
    """``send`` with CORS's ``Access-Control-Allow-Origin`` on the response's headers."""

    async def wrapped(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []),
                                              (b"access-control-allow-origin", origin.encode("latin-1")),
                                              (b"vary", b"Origin")]}
        await send(message)

    return wrapped
