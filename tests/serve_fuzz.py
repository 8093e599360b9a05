"""The server's fuzz corpus (issue 67), generated from the compact spec below: every field of every endpoint given
values of every JSON type, size, encoding and nesting, bad bytes included, and bodies, headers and methods that are
not what the API takes. ``cases()`` is deterministic (no randomness): the same corpus on every run.

Each case is tagged ``bad`` where any server must refuse it (bad bytes, nesting past the server's 32 levels, a
number past 4,300 digits, a body that is not a JSON object, a wrong Content-Type, method or key): 4xx expected.
The others (``any``) are requests a server may answer (200) or refuse (4xx): the test asserts no 5xx, no hang, and
an OpenAI error object on every refusal (tests/test_serve.py, ``test_the_fuzz_corpus``).

    python tests/serve_fuzz.py   # prints the number of cases by endpoint and tag
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field

DEPTH = 32  # the server's nesting limit (specdec.serve.app.MAX_DEPTH)


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    body: bytes | None
    headers: dict[str, str] = field(default_factory=dict)  # on top of Content-Type JSON and the key
    bad: bool = False  # a 4xx is the only right answer


def nest(depth: int) -> str:
    return "[" * depth + "]" * depth


# JSON values as raw text (NaN, Infinity, big numbers and escapes exactly as a client may send them): (raw, bad)
VALUES: list[tuple[str, bool]] = [
    ("null", False), ("true", False), ("false", False), ("0", False), ("-0", False), ("1", False), ("2", False),
    ("-1", False), ("0.5", False), ("-0.5", False), ("1.0", False), ("3.7", False), ("1e308", False),
    ("-1e308", False), ("1e999", False), ("-1e999", False), ("NaN", False), ("Infinity", False),
    ("-Infinity", False), ("9223372036854775807", False), ("9223372036854775808", False),
    ("18446744073709551615", False), ("18446744073709551616", False), ("-9223372036854775809", False),
    ("1" + "0" * 4000, False), ("1" + "0" * 4400, True), ("-" + "9" * 4400, True),
    ('""', False), ('"x"', False), ('"5"', False), ('"0.5"', False), ('"true"', False), ('"null"', False),
    ('"' + "a" * 20000 + '"', False), ('"h\\u00e9llo \\ud834\\udd1e \\u4e2d"', False), ('"\\u0000"', False),
    ('"\\u202e rtl \\ufeff bom"', False), ('"\\ud800"', True), ('"abc\\udfff"', True), ('"\\udc00\\ud800"', True),
    ("[]", False), ("[1]", False), ('["a"]', False), ("[null]", False), ("[[]]", False), ("[[1, 2]]", False),
    ('[{"a": 1}]', False), ('["\\ud800"]', True), ("{}", False), ('{"a": 1}', False), ('{"\\ud800": 1}', True),
    (nest(DEPTH + 8), True), (nest(3000), True),
]
COMPLETION = {"model": '"target"', "prompt": '"def f(x):"', "max_tokens": "2"}
CHAT = {"model": '"target"', "messages": '[{"role": "user", "content": "hi"}]', "max_tokens": "2"}
SHARED = ["model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "stream", "stream_options",
          "an_unknown_field"]
SHORT = [v for v in VALUES if v[0] in ("null", "true", "0", "-1", "1.0", "1e999", "NaN", '"x"', '"\\ud800"', "[]",
                                       '["a"]', "{}", nest(DEPTH + 8))]  # the shared fields again, on chat
TEMPLATES = {  # a chat field inside a message: where its value goes
    "messages": "{}",
    "messages[].role": '[{{"role": {}, "content": "hi"}}]',
    "messages[].content": '[{{"role": "user", "content": {}}}]',
    "messages[].content[].text": '[{{"role": "user", "content": [{{"type": "text", "text": {}}}]}}]',
    "messages[].content[].type": '[{{"role": "user", "content": [{{"type": {}, "text": "hi"}}]}}]',
    "messages[]": "[{}]",
}


# with a budget field's big values (2**63 tokens...), stop strings that end the text within a few tokens: a valid
# budget decodes to the context's end otherwise (8,186 tokens of the tiny target, 25-60 s), which bounds nothing
STOPS = json.dumps([" ", "\n", "e", "t", "a", "o", "i", "n", "s", "r", "l", "(", ":", "_", "x", "f"])
BUDGETS = ("max_tokens", "max_completion_tokens")


def body(fields: dict[str, str]) -> bytes:
    return ("{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in fields.items()) + "}").encode()


def field_cases() -> list[Case]:
    cases = []
    for name in ["prompt", *SHARED]:
        for i, (raw, bad) in enumerate(VALUES):
            fields = {**COMPLETION, name: raw, **({"stop": STOPS} if name in BUDGETS else {})}
            if name == "stream_options":
                fields["stream"] = "true"
            cases.append(Case(f"completions.{name}#{i}", "POST", "/v1/completions", body(fields), bad=bad))
        if name in ("stream_options",):
            for i, (raw, bad) in enumerate(VALUES):
                fields = {**COMPLETION, "stream": "true", "stream_options": f'{{"include_usage": {raw}}}'}
                cases.append(Case(f"completions.stream_options.include_usage#{i}", "POST", "/v1/completions",
                                  body(fields), bad=bad))
    for where, template in TEMPLATES.items():
        for i, (raw, bad) in enumerate(VALUES):
            cases.append(Case(f"chat.{where}#{i}", "POST", "/v1/chat/completions",
                              body({**CHAT, "messages": template.format(raw)}), bad=bad))
    for name in ["max_completion_tokens", *SHARED]:
        for i, (raw, bad) in enumerate(VALUES if name == "max_completion_tokens" else SHORT):
            fields = {**CHAT, name: raw, **({"stop": STOPS} if name in BUDGETS else {})}
            cases.append(Case(f"chat.{name}#{i}", "POST", "/v1/chat/completions", body(fields), bad=bad))
    return cases


def body_cases() -> list[Case]:
    """Whole bodies: not JSON, not an object, other encodings, sizes, duplicate keys, streamed valid requests."""
    raw: list[tuple[str, bytes, bool]] = [
        ("empty", b"", True), ("null", b"null", True), ("array", b"[]", True), ("string", b'"x"', True),
        ("number", b"1", True), ("true", b"true", True), ("open", b"{", True), ("unclosed", b'{"prompt": "x"', True),
        ("trailing", b'{"prompt": "x"} tail', True), ("two-objects", b'{"prompt": "x"}{"prompt": "y"}', True),
        ("invalid-utf8", b'{"prompt": "\xff\xfe"}', True), ("latin1", '{"prompt": "caf\xe9"}'.encode("latin-1"), True),
        ("nul-byte", b'{"prompt": "x"}\x00', True), ("bare-nul", b"\x00\x00\x00\x00", True),
        ("control-char", b'{"prompt": "a\x01b"}', True), ("single-quotes", b"{'prompt': 'x'}", True),
        ("comment", b'{"prompt": "x" /* c */}', True), ("deep-object", b'{"a":' * 3000 + b"1" + b"}" * 3000, True),
        ("utf8-bom", b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 2}', False),
        ("utf16", '{"prompt": "x", "max_tokens": 2}'.encode("utf-16"), False),
        ("utf32", '{"prompt": "x", "max_tokens": 2}'.encode("utf-32"), False),
        ("duplicate-keys", b'{"prompt": "x", "prompt": "y", "max_tokens": 2}', False),
        ("many-keys", body({**{f"k{i}": str(i) for i in range(20000)}, **COMPLETION}), False),
        ("whitespace", b'\n\t {"prompt" :\n"x", "max_tokens": 2}  \n', False),
        ("escaped-slash", b'{"prompt": "a\\/b", "max_tokens": 2}', False),
        ("stream", body({**COMPLETION, "stream": "true"}), False),
        ("stream-usage", body({**COMPLETION, "stream": "true", "stream_options": '{"include_usage": true}'}), False),
        ("stream-stop", body({**COMPLETION, "stream": "true", "stop": '["\\n"]', "max_tokens": "8"}), False),
        ("token-ids", body({**COMPLETION, "prompt": "[1, 2, 3]"}), False),
        ("token-ids-negative", body({**COMPLETION, "prompt": "[-1]"}), True),
        ("token-ids-huge", body({**COMPLETION, "prompt": "[18446744073709551616]"}), True),
        ("token-ids-float", body({**COMPLETION, "prompt": "[1.5]"}), True),
        ("over-limit", body({**COMPLETION, "prompt": json.dumps("x" * (1 << 20))}), True),
    ]
    cases = []
    for path in ("/v1/completions", "/v1/chat/completions"):
        for name, data, bad in raw:
            if path.endswith("chat/completions") and not bad and data.lstrip(b"\xef\xbb\xbf\n\t ").startswith(b"{"):
                data = data.replace(b'"prompt"', b'"messages"').replace(b'"x"', b'[{"role": "user", "content": "x"}]')
            cases.append(Case(f"body:{name}@{path}", "POST", path, data, bad=bad))
    return cases


def transport_cases() -> list[Case]:
    """Headers, methods and paths: the Content-Type, the key, what each endpoint answers to."""
    ok = body(COMPLETION)
    cases = [Case(f"content-type:{t}", "POST", "/v1/completions", ok, {"Content-Type": t}, bad=True)
             for t in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                       "application/jsonx", "json", "", "text/json")]
    cases += [Case(f"content-type:{t}", "POST", "/v1/completions", ok, {"Content-Type": t})
              for t in ("application/json; charset=utf-8", "APPLICATION/JSON", "application/json ; x=y")]
    cases += [Case(f"key:{name}", "POST", "/v1/completions", ok, {"Authorization": value}, bad=True)
              for name, value in (("none", ""), ("wrong", "Bearer nope"), ("scheme-only", "Bearer"),
                                  ("basic", "Basic dGVzdA=="), ("non-ascii", "Bearer k\xe9y"))]
    cases += [Case(f"origin:{o}", "POST", "/v1/completions", ok, {"Origin": o}, bad=True)
              for o in ("http://evil.example", "null", "file://")]
    cases += [Case(f"host:{h}", "GET", "/v1/models", None, {"Host": h}, bad=True)
              for h in ("evil.example", "127.0.0.1.evil.example:80")]
    cases += [Case(f"method:{m} {p}", m, p, b"{}" if m in ("POST", "PUT", "PATCH") else None, bad=True)
              for m, p in (("GET", "/v1/completions"), ("GET", "/v1/chat/completions"), ("PUT", "/v1/completions"),
                           ("DELETE", "/v1/models"), ("PATCH", "/v1/chat/completions"), ("POST", "/health"),
                           ("POST", "/v1/models"), ("POST", "/metrics"), ("POST", "/stats"),
                           ("OPTIONS", "/v1/completions"))]
    cases += [Case(f"path:{p}", "GET", p, None, bad=True)
              for p in ("/v1/nothing", "/v1", "/v2/models", "/static/../../../etc/passwd", "/static/nothing.js",
                        "/v1/models/target/extra", "/%ff%fe", "/v1/completions%00")]
    cases += [Case(f"get:{p}", "GET", p, None)
              for p in ("/health", "/v1/models", "/metrics", "/stats", "/", "/static/app.js",
                        "/v1/models?x=%ff%fe&y=%C3%A9", "/health?" + "a" * 4000)]
    return cases


def cases() -> list[Case]:
    found = field_cases() + body_cases() + transport_cases()
    assert len({c.name for c in found}) == len(found), "case names are unique"
    return found


if __name__ == "__main__":
    counts = collections.Counter((c.path.split("?")[0], "bad" if c.bad else "any") for c in cases())
    for (path, tag), n in sorted(counts.items()):
        print(f"{n:5d}  {tag:4s} {path}")
    print(f"{sum(counts.values()):5d}  in all")
