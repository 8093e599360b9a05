"""The server's Host, Origin and Content-Type policy (issue 67; ``specdec.serve.policy``), called as ASGI.

The shapes a page on another site uses on a server on the visitor's machine: a cross-origin "simple" POST
(``text/plain``, no preflight) and DNS rebinding (the attacker's name in ``Host``). Each is refused with an OpenAI
error object before the app runs; the server's own page, same-origin calls, and the origins and hosts the flags name
pass. The same policy over HTTP, on the real server: tests/test_serve.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from specdec.serve.config import ServeConfig
from specdec.serve.policy import Policy, hostname

PORT = 8000


def call(config: ServeConfig, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], dict,
                                                                                        bool]:
    """(status, response headers, JSON body or {}, whether the app behind the policy ran)."""
    ran = []

    async def app(scope, receive, send):
        ran.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})

    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "scheme": "http", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(Policy(app, config)(scope, receive, send))
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return (start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, json.loads(body) if body else {},
            bool(ran))


def post(config: ServeConfig, headers: dict[str, str], path: str = "/v1/completions"):
    return call(config, "POST", path, {"host": f"127.0.0.1:{PORT}", "content-type": "application/json", **headers})


def error(reply) -> tuple[int, str, bool]:
    status, _, body, ran = reply
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    return status, body["error"]["code"], ran


def test_a_same_origin_json_post_passes():
    config = ServeConfig()
    assert post(config, {})[0::3] == (200, True)  # no Origin: a client that is not a browser
    assert post(config, {"origin": f"http://127.0.0.1:{PORT}"})[0::3] == (200, True)  # the server's own page
    assert post(config, {"content-type": "application/json; charset=utf-8"})[0::3] == (200, True)


@pytest.mark.parametrize("media", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_an_api_post_must_be_json(media):
    headers = {"content-type": media} if media else {}
    reply = call(ServeConfig(), "POST", "/v1/chat/completions", {"host": "localhost", **headers})
    assert error(reply) == (415, "unsupported_media_type", False)
    assert "Content-Type: application/json" in reply[2]["error"]["message"]


def test_a_cross_origin_request_is_refused_unless_allowed():
    evil = {"origin": "http://evil.example"}
    for path in ("/v1/completions", "/v1/models", "/metrics", "/stats"):
        method = "POST" if path == "/v1/completions" else "GET"
        reply = call(ServeConfig(), method, path, {"host": "127.0.0.1:8000", "content-type": "application/json",
                                                   **evil})
        assert error(reply) == (403, "origin_not_allowed", False), path
        assert "--allowed-origins" in reply[2]["error"]["message"]
    assert error(post(ServeConfig(), {"origin": "null"})) == (403, "origin_not_allowed", False)  # a sandboxed page
    # an origin on the same host but another port is another origin
    assert error(post(ServeConfig(), {"origin": "http://127.0.0.1:9999"})) == (403, "origin_not_allowed", False)
    # the page, its files and /health hold no data: a navigation or a link from anywhere still loads them
    for path in ("/", "/static/app.js", "/health"):
        assert call(ServeConfig(), "GET", path, {"host": "127.0.0.1:8000", **evil})[0::3] == (200, True), path


def test_allowed_origins_get_cors_answers():
    config = ServeConfig(allowed_origins="http://app.example:3000, https://other.example/")
    status, headers, _, ran = post(config, {"origin": "http://app.example:3000"})
    assert (status, ran, headers["access-control-allow-origin"]) == (200, True, "http://app.example:3000")
    assert post(config, {"origin": "https://other.example"})[0::3] == (200, True)
    assert error(post(config, {"origin": "http://evil.example"})) == (403, "origin_not_allowed", False)
    status, headers, _, ran = call(config, "OPTIONS", "/v1/completions", {
        "host": "127.0.0.1:8000", "origin": "http://app.example:3000", "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})
    assert (status, ran) == (204, False)
    assert headers["access-control-allow-origin"] == "http://app.example:3000"
    assert "POST" in headers["access-control-allow-methods"]
    assert headers["access-control-allow-headers"] == "authorization, content-type"
    assert post(ServeConfig(allowed_origins="*"), {"origin": "http://anything.example"})[0::3] == (200, True)
    # a cross-origin text/plain POST from an allowed origin is still not JSON
    assert error(post(config, {"origin": "http://app.example:3000", "content-type": "text/plain"}))[:2] == (
        415, "unsupported_media_type")


def test_a_loopback_server_answers_only_its_own_host_names():
    config = ServeConfig()
    for host in ("127.0.0.1:8000", "localhost:8000", "localhost", "[::1]:8000", "127.0.0.2", "app.localhost:8000"):
        assert call(config, "GET", "/health", {"host": host})[0::3] == (200, True), host
    for path in ("/health", "/", "/v1/models"):  # DNS rebinding: the attacker's name, resolved to 127.0.0.1
        reply = call(config, "GET", path, {"host": "rebind.evil.example:8000"})
        assert error(reply) == (403, "host_not_allowed", False), path
        assert "--allowed-hosts" in reply[2]["error"]["message"]
    proxied = ServeConfig(allowed_hosts="models.internal")
    assert call(proxied, "GET", "/health", {"host": "models.internal:443"})[0::3] == (200, True)
    assert error(call(proxied, "GET", "/health", {"host": "evil.example"}))[:2] == (403, "host_not_allowed")
    # bound beyond loopback: any Host (the machine has names the server cannot know); the key guards it
    assert call(ServeConfig(host="0.0.0.0"), "GET", "/health", {"host": "evil.example"})[0::3] == (200, True)


def test_hostname():
    assert [hostname(h) for h in ("a.b:80", "A.B", "[::1]:8000", "[::1]", "::1", "127.0.0.1")] == [
        "a.b", "a.b", "::1", "::1", "::1", "127.0.0.1"]
