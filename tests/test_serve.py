"""`specdec serve` (issue 20): the OpenAI API over a continuously batched decoder, its metrics and its page.

One server runs for the module: the real command (`python -m specdec serve`) in a subprocess on a
free loopback port, over the tiny pair of `tiny_models` (drafter `lookup+<tiny drafter>`, batch
size 3, the heuristic schedule, an API key), driven by the official `openai` client and by raw HTTP. References come
from the same code path as `specdec generate` (`session.Session.generate`) in this process, each prompt
decoded alone, and once from the `specdec generate --json` command itself:

- completion and chat, streaming and not, equal to the reference at temperature 0 (text and token
  ids), a seeded sampled request equal to its seeded reference, stop strings left out of the text;
- 32 requests from 4 concurrent clients (more than the batch holds, so rows wait and join at round
  boundaries) with mixed settings: each equals its own reference (nothing lost, nothing mixed), and
  the Prometheus counters add up to the responses' usage;
- a client that disconnects mid-stream, or gives up on a non-streaming request while its row produces tokens:
  its row leaves (running back to 0, an abort counted) and the next request is served normally;
- every bad input answers an OpenAI error object with the right status, and the server keeps serving;
  the API key: 401 on every endpoint but /health;
- the page in headless Chromium (driven over the DevTools protocol): a prompt streams into coloured
  tokens, equal to the reference, and a screenshot is saved.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import browser
import openai
import pytest
import torch
from tiny_models import TinyPair, save_tiny_pair
from transformers import AutoTokenizer

from specdec.arguments import Settings
from specdec.config import ModelConfig, SamplingConfig, ScheduleConfig, SpecConfig
from specdec.serve.cli import exposure_warning
from specdec.serve.config import ServeConfig
from specdec.serve.protocol import ChatMessage, chat_prompt_ids, plain_chat
from specdec.serve.server import bind, model_id
from specdec.session import Session
from specdec.threads import room_beside

KEY = "test-key-123"
MAX_TOKENS = 24  # the server's --max-new-tokens
BATCH = 3  # the server's --batch-size: fewer rows than the load test's 4 clients
SCHEDULE = ScheduleConfig("heuristic")  # the server's --schedule: per-row state that rows joining and leaving must keep
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self, x, y):", "for i in range(10):",
           "import os\nimport sys\n", "def parse_args(argv):\n    parser = ", "if __name__ == '__main__':"]
START_TIMEOUT = 180  # seconds for the server to come up on a loaded machine
HTTP_TIMEOUT = 60  # seconds for one request
FUZZ_TIMEOUT = 30  # seconds for one fuzz case's answer (past it: a hang)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    port: int
    pair: TinyPair
    log: Path


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> TinyPair:
    """The tiny pair, its tokenizer given a chat template (the template path of chat completions)."""
    pair = save_tiny_pair(tmp_path_factory.mktemp("serve-pair"))
    for folder in (pair.target, pair.drafter):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(folder)
    return pair


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    """`specdec serve` in a subprocess on a free loopback port."""
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    with serving(pair, log, "--max-new-tokens", str(MAX_TOKENS), "--batch-size", str(BATCH),
                 "--schedule", SCHEDULE.schedule, "--speculate", "on") as (url, port):
        yield Server(url, port, pair, log)


@contextlib.contextmanager
def serving(pair: TinyPair, log: Path, *flags: str):
    """`specdec serve` of ``pair`` (drafter lookup+drafter, key KEY, one thread) in a subprocess on a free
    loopback port, with ``flags``; yields (url, port) once it answers /health, and stops it after."""
    proc, url, port = launch(pair, log, *flags)
    try:
        yield url, port
    finally:
        stop(proc)


def launch(pair: TinyPair, log: Path, *flags: str) -> tuple[subprocess.Popen, str, int]:
    """`specdec serve` as ``serving`` starts it: (the process, its url, its port) once it answers /health."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECDEC_API_KEY": ""}
    command = [sys.executable, "-m", "specdec", "serve", "--port", str(port), "--api-key", KEY,
               "--target", str(pair.target), "--drafter", f"lookup+{pair.drafter}", "--device", "cpu", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"specdec serve exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if get(url + "/health", key=None)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"specdec serve did not answer /health in {START_TIMEOUT} s:\n{log.read_text()}")
            time.sleep(0.2)
    except BaseException:
        stop(proc)
        raise
    return proc, url, port


def stop(proc: subprocess.Popen) -> None:
    """Terminate ``proc``, killing it if it has not exited within 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def session(pair) -> Session:
    """The models as `specdec generate` loads them, for references (each prompt decoded alone)."""
    return Session(ModelConfig(target=str(pair.target), drafter=f"lookup+{pair.drafter}", device="cpu"))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=HTTP_TIMEOUT, max_retries=0)


def reference(session: Session, ids: list[int], max_tokens: int = MAX_TOKENS, temperature: float = 0.0,
              seed: int | None = None, stop: tuple[str, ...] = ()) -> tuple[list[int], str]:
    """(token ids, OpenAI text) of `specdec generate`'s code path for `ids` alone."""
    settings = Settings(sampling=SamplingConfig(temperature=temperature, seed=seed),
                        spec=SpecConfig(max_new_tokens=max_tokens), mode="speculative", stop_strings=stop,
                        schedule=SCHEDULE)
    result = session.generate(ids, settings)
    text = session.tokenizer("speculative").decode(result.tokens, skip_special_tokens=True)
    if result.stop_reason == "stop_string":
        text = text[: min(i for i in (text.find(s) for s in stop) if i >= 0)]
    return result.tokens, text


def encode(session: Session, text: str) -> list[int]:
    return list(session.tokenizer("speculative")(text).input_ids)


def get(url: str, key: str | None = KEY) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def post(url: str, body: bytes, key: str | None = KEY, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus series' samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            series, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in series for k, v in labels.items()):
                total += float(value)
    return total


def stats(server: Server) -> dict:
    return json.loads(get(server.url + "/stats")[1])["models"][0]


# ------------------------------------------------------------------------------ equal to generate


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["target"]
    assert stats(server)["schedule"] == SCHEDULE.schedule
    assert stats(server)["auto"] == []  # --speculate on: no crossover measured (auto's: the bench --serve test)
    assert (stats(server)["threads"], stats(server)["threads_source"]) == (1, "OMP_NUM_THREADS")  # set by the fixture
    assert stats(server)["prefill_beside"] is room_beside(1)  # a second forward where the cores hold two of one thread
    assert stats(server)["helper"] is False  # a tiny model: no blocked kernel, no products shared
    assert stats(server)["front"] == "process"  # the app apart from the engine (specdec.serve.front), by default
    assert (f"batch size {BATCH}, 1 thread (OMP_NUM_THREADS); HTTP in a process of its own) on http://"
            in server.log.read_text())  # the start line
    assert get(server.url + "/health", key=None) == (200, b'{"status":"ok"}')


def test_completion_equals_generate_streaming_and_not(server, client, session):
    prompt = PROMPTS[0]
    tokens, text = reference(session, encode(session, prompt))
    whole = client.completions.create(model="target", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].text == text and whole.specdec["token_ids"] == tokens
    assert whole.choices[0].finish_reason == "length"
    usage = whole.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(encode(session, prompt)), len(tokens))
    spec = usage.speculation
    assert spec["lossless"] is True and 0 < spec["accepted"] <= spec["drafted"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"])
    assert spec["mean_accepted_length"] == pytest.approx(len(tokens) / spec["rounds"])
    kinds = whole.specdec["kinds"]
    assert len(kinds) == len(tokens) and set(kinds) <= {"accepted", "recovered", "bonus"}

    chunks = list(client.completions.create(model="target", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [t for c in chunks if c.choices for t in c.specdec["tokens"]] == tokens
    assert [k for c in chunks if c.choices for k in c.specdec["kinds"]] == kinds
    pieces = [p for c in chunks if c.choices for p in c.specdec["pieces"]]
    assert "".join(p["text"] for p in pieces) == text and {p["kind"] for p in pieces} <= set(kinds)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.speculation == spec


def test_a_raw_stream_is_server_sent_events_ending_in_done(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT)
    body = json.dumps({"model": "target", "prompt": PROMPTS[2], "max_tokens": 10, "stream": True})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                         "Authorization": f"Bearer {KEY}"})
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    events = response.read().decode().split("\n\n")
    connection.close()
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2]) and len(chunks) >= 2
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    assert sum(len(c["specdec"]["tokens"]) for c in chunks) == 10 and chunks[-1]["choices"][0]["finish_reason"]


def test_completion_equals_the_generate_command(server, client, pair, capsys):
    """The `specdec generate --json` command itself (in this process: the same code, no interpreter start)."""
    from specdec.cli import main

    prompt = PROMPTS[1]
    assert main(["generate", "--json", "--target", str(pair.target), "--drafter", f"lookup+{pair.drafter}",
                 "--max-new-tokens", "20", "--device", "cpu", "--schedule", SCHEDULE.schedule, prompt]) == 0
    cli = json.loads(capsys.readouterr().out)
    whole = client.completions.create(model="target", prompt=prompt, max_tokens=20, temperature=0)
    assert whole.specdec["token_ids"] == cli["tokens"] and whole.choices[0].text == cli["text"]


def test_chat_uses_the_template_and_equals_generate(client, session):
    messages = [{"role": "system", "content": "write python"}, {"role": "user", "content": "def add(a, b):"}]
    tokenizer = session.tokenizer("speculative")
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    assert tokenizer.decode(ids).endswith("<|assistant|>")
    tokens, text = reference(session, ids)
    whole = client.chat.completions.create(model="target", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text and whole.specdec["token_ids"] == tokens
    assert whole.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="target", messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_fallback_without_a_template(session):
    tokenizer = AutoTokenizer.from_pretrained(session.models.target)
    tokenizer.chat_template = None
    messages = [ChatMessage(role="user", content="hello"), ChatMessage(role="assistant", content="hi")]
    text = plain_chat([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}])
    assert text == "user: hello\nassistant: hi\nassistant:"
    assert chat_prompt_ids(messages, tokenizer) == list(tokenizer(text).input_ids)


def test_seeded_sampling_and_stop_strings(client, session):
    prompt = PROMPTS[2]
    tokens, text = reference(session, encode(session, prompt), temperature=0.9, seed=7)
    whole = client.completions.create(model="target", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.9, seed=7)
    assert whole.specdec["token_ids"] == tokens and whole.choices[0].text == text
    assert whole.usage.speculation["lossless"] is True
    # a stop string the greedy text contains: cut before it (OpenAI), kept in the token ids (the core)
    greedy_tokens, greedy_text = reference(session, encode(session, PROMPTS[0]))
    stop = greedy_text.strip().split()[2]
    tokens, text = reference(session, encode(session, PROMPTS[0]), stop=(stop,))
    assert stop not in text and len(tokens) < len(greedy_tokens)
    for stream in (False, True):
        reply = client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                          stop=[stop], stream=stream)
        if stream:
            chunks = list(reply)
            assert "".join(c.choices[0].text for c in chunks) == text
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            assert reply.choices[0].text == text and reply.specdec["token_ids"] == tokens
            assert reply.choices[0].finish_reason == "stop" and reply.specdec["stop_reason"] == "stop_string"


# ---------------------------------------------------------------------------------------- batching


def test_load_32_requests_from_4_clients(server, client, session):
    """Each request's output is its own reference, whatever ran beside it; the counters add up."""
    cases = []
    for i in range(32):
        prompt = PROMPTS[i % len(PROMPTS)]
        sampled = i % 4 == 3
        cases.append({"prompt": prompt, "max_tokens": 8 + (i * 5) % 17, "temperature": 0.8 if sampled else 0.0,
                      "seed": 100 + i if sampled else None, "stream": i % 3 == 0})
    expected = {}
    for case in cases:
        key = (case["prompt"], case["max_tokens"], case["temperature"], case["seed"])
        if key not in expected:
            expected[key] = reference(session, encode(session, case["prompt"]), case["max_tokens"],
                                      case["temperature"], case["seed"])
    before = get(server.url + "/metrics")[1].decode()
    results: dict[int, tuple[list[int], str, dict]] = {}
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(worker, 32, 4):
                c = cases[i]
                kwargs = {"model": "target", "prompt": c["prompt"], "max_tokens": c["max_tokens"],
                          "temperature": c["temperature"], "seed": c["seed"]}
                if c["stream"]:
                    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                                            **kwargs))
                    tokens = [t for ch in chunks if ch.choices for t in ch.specdec["tokens"]]
                    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
                    results[i] = (tokens, text, chunks[-1].usage.speculation)
                else:
                    reply = client.completions.create(**kwargs)
                    results[i] = (reply.specdec["token_ids"], reply.choices[0].text, reply.usage.speculation)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    history = stats(server)["history"]
    since = history[-1]["time"] if history else 0.0
    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    # the engine samples its load every half second: wait for the sample that covers the load's end
    ended = stats(server)["history"][-1]["time"]
    deadline = time.monotonic() + 10
    while (history := stats(server)["history"])[-1]["time"] <= ended and time.monotonic() < deadline:
        time.sleep(0.1)
    during = [s for s in history if s["time"] > since]
    peak = {"batch": max(s["peak_batch"] for s in during), "waiting": max(s["peak_waiting"] for s in during)}
    assert not errors, errors
    assert sorted(results) == list(range(32))
    for i, case in enumerate(cases):
        tokens, text = expected[(case["prompt"], case["max_tokens"], case["temperature"], case["seed"])]
        assert results[i][:2] == (tokens, text), f"request {i} ({case}) differs from its reference"
    assert peak["batch"] == BATCH, peak  # a round ran with the batch full...
    assert peak["waiting"] >= 1, peak  # ...and the 4th client's request waited to join
    after = get(server.url + "/metrics")[1].decode()
    delta = {name: metric(after, name) - metric(before, name) for name in (
        "vllm:request_success_total", "vllm:generation_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total", "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count")}
    assert delta["vllm:request_success_total"] == 32
    assert delta["vllm:generation_tokens_total"] == sum(len(r[0]) for r in results.values())
    assert delta["vllm:spec_decode_num_draft_tokens_total"] == sum(r[2]["drafted"] for r in results.values())
    assert delta["vllm:spec_decode_num_accepted_tokens_total"] == sum(r[2]["accepted"] for r in results.values())
    assert delta["vllm:time_to_first_token_seconds_count"] == delta["vllm:e2e_request_latency_seconds_count"] == 32
    # one inter-token latency per committed round after a request's first
    assert delta["vllm:inter_token_latency_seconds_count"] == sum(r[2]["rounds"] for r in results.values()) - 32
    assert metric(after, "vllm:spec_decode_draft_acceptance_rate") == pytest.approx(
        metric(after, "vllm:spec_decode_num_accepted_tokens_total")
        / metric(after, "vllm:spec_decode_num_draft_tokens_total"))
    assert metric(after, "vllm:num_requests_running") == 0 and metric(after, "vllm:num_requests_waiting") == 0


def test_disconnect_mid_stream_frees_the_row(server, client, session):
    aborted = metric(get(server.url + "/metrics")[1].decode(), "vllm:request_success_total", finished_reason="abort")
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT)
    body = json.dumps({"model": "target", "prompt": PROMPTS[3], "max_tokens": 4000, "stream": True})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                         "Authorization": f"Bearer {KEY}"})
    response = connection.getresponse()
    assert response.status == 200
    events = 0
    while events < 3:
        line = response.fp.readline()
        assert line, "the stream ended before the client went away"
        events += line.startswith(b"data: {")
    assert stats(server)["running"] == 1
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    deadline = time.monotonic() + 30
    while True:
        metrics = get(server.url + "/metrics")[1].decode()
        if metric(metrics, "vllm:request_success_total", finished_reason="abort") == aborted + 1:
            break
        assert time.monotonic() < deadline, "the disconnected request was not cancelled"
        time.sleep(0.05)
    s = stats(server)
    assert s["running"] == 0 and s["waiting"] == 0
    assert s["totals"]["cancelled"] >= 1
    tokens, text = reference(session, encode(session, PROMPTS[4]))
    reply = client.completions.create(model="target", prompt=PROMPTS[4], max_tokens=MAX_TOKENS, temperature=0)
    assert reply.specdec["token_ids"] == tokens and reply.choices[0].text == text


def test_logprobs_echo_and_bias_cross_the_front_process(client, session):
    """The module's server runs its HTTP front in a process apart: log-probabilities, echo's prompt scores, a logit
    bias and n choices travel through its pipe (tests/test_serve_openai.py checks their values in one process)."""
    ids = encode(session, PROMPTS[0])
    tokens, text = reference(session, ids, max_tokens=8)
    reply = client.completions.create(model="target", prompt=ids, max_tokens=8, temperature=0, logprobs=2, echo=True)
    lp = reply.choices[0].logprobs
    assert reply.specdec["token_ids"] == tokens and reply.choices[0].text.endswith(text)
    assert len(lp.token_logprobs) == len(ids) + 8 and lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    forced = client.completions.create(model="target", prompt=ids, max_tokens=4, temperature=0, n=2,
                                       logit_bias={str(tokens[0] + 1): 100})
    assert [c["token_ids"] for c in forced.specdec["choices"]] == [[tokens[0] + 1] * 4] * 2


def test_a_non_streaming_client_that_gives_up_is_cancelled_while_its_row_produces_tokens(server, client, session):
    """Issue 67: a non-streaming client that closes its connection while its row commits round after round is
    cancelled within a few seconds (``app.complete`` checks the client every ``DISCONNECT_POLL_S`` whether or not
    rounds arrive); its row does not hold its batch slot to ``max_tokens``."""
    before = metric(get(server.url + "/metrics")[1].decode(), "vllm:request_success_total", finished_reason="abort")
    produced = stats(server)["totals"]["new_tokens"]
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT)
    body = json.dumps({"model": "target", "prompt": PROMPTS[3], "max_tokens": 4000, "temperature": 0})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                         "Authorization": f"Bearer {KEY}"})
    deadline = time.monotonic() + 30
    while stats(server)["totals"]["new_tokens"] < produced + 16:  # its row is decoding
        assert time.monotonic() < deadline, "the request did not start decoding"
        time.sleep(0.05)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    gone = time.monotonic()
    while True:
        metrics = get(server.url + "/metrics")[1].decode()
        if metric(metrics, "vllm:request_success_total", finished_reason="abort") == before + 1:
            break
        assert time.monotonic() < gone + 10, "the client that gave up was not cancelled within 10 s"
        time.sleep(0.05)
    s = stats(server)
    assert s["running"] == 0 and s["waiting"] == 0
    assert s["totals"]["new_tokens"] - produced < 4000  # cancelled, not run to max_tokens
    tokens, text = reference(session, encode(session, PROMPTS[4]))
    reply = client.completions.create(model="target", prompt=PROMPTS[4], max_tokens=MAX_TOKENS, temperature=0)
    assert reply.specdec["token_ids"] == tokens and reply.choices[0].text == text


# ------------------------------------------------------------------------------ bad input and keys


BAD = [  # (path, body, status, param, code)
    ("/v1/completions", b'{"model": "target", "prompt": "x",', 400, None, "invalid_json"),
    ("/v1/completions", b'["not", "an", "object"]', 400, None, "invalid_body"),
    ("/v1/completions", b'{"model": "target"}', 400, "prompt", "missing_required_parameter"),
    ("/v1/chat/completions", b'{"model": "target"}', 400, "messages", "missing_required_parameter"),
    ("/v1/chat/completions", b'{"model": "target", "messages": []}', 400, "messages", "invalid_value"),
    ("/v1/completions", b'{"model": "gpt-4", "prompt": "x"}', 404, "model", "model_not_found"),
    ("/v1/chat/completions", b'{"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}', 404,
     "model", "model_not_found"),
    ("/v1/completions", b'{"model": "target", "prompt": "x", "max_tokens": 0}', 400, "max_tokens", "invalid_value"),
    ("/v1/completions", b'{"model": "target", "prompt": "x", "max_tokens": -3}', 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", json.dumps({"model": "target", "messages": [{"role": "user", "content": "x"}],
                                         "max_completion_tokens": 0}).encode(), 400, "max_completion_tokens",
     "invalid_value"),
    ("/v1/completions", b'{"model": "target", "prompt": "x", "temperature": -0.5}', 400, "temperature",
     "invalid_value"),
    ("/v1/completions", b'{"model": "target", "prompt": "x", "top_p": 0}', 400, "top_p", "invalid_value"),
    ("/v1/completions", b'{"model": "target", "prompt": "x", "top_p": 1.5}', 400, "top_p", "invalid_value"),
    ("/v1/completions", b'{"model": "target", "prompt": "x", "n": 0}', 400, "n", "invalid_value"),
    ("/v1/completions", b'{"model": "target", "prompt": ""}', 400, "prompt", "invalid_value"),
    ("/v1/completions", json.dumps({"model": "target", "prompt": ["a"] * 65}).encode(), 400, "prompt",
     "invalid_value"),
    ("/v1/completions", b'{"model": "target", "prompt": [1, 99999]}', 400, "prompt", "invalid_value"),
    ("/v1/completions", b'{"model": "target", "prompt": "x", "stop": [""]}', 400, "stop", "invalid_value"),
    ("/v1/completions", b'{"model": "target", "prompt": "x", "temperature": "hot"}', 400, "temperature",
     "invalid_value"),
    ("/v1/completions", json.dumps({"model": "target", "prompt": [5] * 8192}).encode(), 400, "prompt",
     "context_length_exceeded"),
    ("/v1/completions", json.dumps({"model": "target", "prompt": "x" * (1 << 20)}).encode(), 413, None,
     "request_too_large"),
    # bad bytes (issue 67): JSON that decodes, but that nothing downstream took (each was a 500)
    ("/v1/completions", b'{"model": "target", "prompt": "abc\\ud800"}', 400, "prompt", "invalid_value"),
    ("/v1/chat/completions", b'{"model": "target", "messages": [{"role": "user", "content": "abc\\ud800"}]}', 400,
     "messages", "invalid_value"),
    ("/v1/completions", b'{"model": "target", "\\udc00": 1, "prompt": "x"}', 400, None, "invalid_value"),
    ("/v1/completions", b'{"model": "target", "prompt": "x", "stop": ' + b"[" * 2000 + b"]" * 2000 + b"}", 400, None,
     "invalid_json"),
    ("/v1/completions", b'{"model": "target", "prompt": "x", "stop": ' + b"[" * 100 + b"]" * 100 + b"}", 400, "stop",
     "invalid_value"),
    ("/v1/completions", b'{"model": "target", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None,
     "invalid_json"),
    ("/v1/completions", json.dumps({"model": "target", "prompt": "x", "seed": 1 << 64}).encode(), 400, "seed",
     "invalid_value"),
    ("/v1/completions", json.dumps({"model": "target", "prompt": "x", "seed": -(1 << 63) - 1, "stream": True}).encode(),
     400, "seed", "invalid_value"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), BAD,
                         ids=[f"{i}-{b[3] or b[4]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_an_openai_error(server, path, body, status, param, code):
    got, reply = post(server.url + path, body)
    assert got == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code), error
    assert error["type"] == "invalid_request_error"


def test_a_huge_declared_body_is_refused_before_it_is_sent(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT)
    connection.putrequest("POST", "/v1/completions")
    for name, value in (("Content-Type", "application/json"), ("Authorization", f"Bearer {KEY}"),
                        ("Content-Length", str(1 << 30))):
        connection.putheader(name, value)
    connection.endheaders()  # headers only: the server answers from Content-Length alone
    response = connection.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
    connection.close()


def test_the_server_keeps_serving_after_bad_input(server, client, session):
    for path, body, *_ in BAD[:6]:
        post(server.url + path, body)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="target", prompt="x", temperature=-1)
    tokens, text = reference(session, encode(session, PROMPTS[5]))
    reply = client.completions.create(model="target", prompt=PROMPTS[5], max_tokens=MAX_TOKENS, temperature=0)
    assert reply.specdec["token_ids"] == tokens and reply.choices[0].text == text
    assert get(server.url + "/health", key=None)[0] == 200


def test_browser_shapes_of_a_foreign_page_are_refused(server):
    """The Host, Origin and Content-Type policy (specdec.serve.policy; its cases: tests/test_serve_policy.py) on the
    real server: a cross-origin simple POST, a foreign Origin, a rebound Host are refused with OpenAI errors, while
    the same origin, the page and /health pass."""
    body = b'{"model": "target", "prompt": "x", "max_tokens": 1}'
    own = f"http://127.0.0.1:{server.port}"
    for headers, status, code in [({"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
                                  ({"Origin": "http://evil.example"}, 403, "origin_not_allowed"),
                                  ({"Host": f"rebind.evil.example:{server.port}"}, 403, "host_not_allowed"),
                                  ({"Origin": own}, 200, None), ({"Host": f"localhost:{server.port}"}, 200, None)]:
        got, reply = post(server.url + "/v1/completions", body, headers=headers)
        assert got == status and (code is None or reply["error"]["code"] == code), (headers, reply)
    request = urllib.request.Request(server.url + "/health", headers={"Host": "rebind.evil.example"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=HTTP_TIMEOUT)
    assert refused.value.code == 403
    page = urllib.request.Request(server.url + "/", headers={"Host": f"localhost:{server.port}", "Origin": own})
    with urllib.request.urlopen(page, timeout=HTTP_TIMEOUT) as response:
        assert response.status == 200 and b"<html" in response.read().lower()


def send_case(port: int, case) -> str | None:
    """One fuzz case (tests/serve_fuzz.py) on a connection of its own: what is wrong with the answer, None if right."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **case.headers}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=FUZZ_TIMEOUT)
    try:
        connection.putrequest(case.method, case.path, skip_host="Host" in headers, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        if case.body is not None:
            connection.putheader("Content-Length", str(len(case.body)))
        connection.endheaders(case.body)
        response = connection.getresponse()
        status, data = response.status, response.read()
        kind = response.getheader("content-type", "")
    except TimeoutError:
        return f"no answer in {FUZZ_TIMEOUT} s"
    finally:
        connection.close()
    if status >= 500 or (case.bad and not 400 <= status < 500):
        return f"{status}: {data[:200]!r}"
    if status >= 400:
        try:
            error = json.loads(data)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        except (ValueError, KeyError, TypeError, AssertionError):
            return f"{status} without an OpenAI error object: {data[:200]!r}"
    elif kind.startswith("text/event-stream"):
        events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
        if events[-1:] != ["[DONE]"] or any('"error"' in e for e in events):
            return f"a stream that failed: {data[-300:]!r}"
    elif case.method == "POST" and "choices" not in json.loads(data):
        return f"200 without choices: {data[:200]!r}"
    return None


def test_the_fuzz_corpus(server):
    """Every case of the fuzz corpus (tests/serve_fuzz.py: every field of every endpoint, every JSON type, sizes,
    encodings, nesting, bad bytes, headers, methods; over 1,000 cases) against the running server, 4 at a time: no
    5xx, no hang, every refusal a 4xx with an OpenAI error object, every case tagged bad refused; then the server
    still answers."""
    from concurrent.futures import ThreadPoolExecutor

    from serve_fuzz import cases

    corpus = cases()
    assert len(corpus) >= 300
    with ThreadPoolExecutor(4) as pool:
        wrong = [f"{case.name}: {problem}" for case, problem in zip(corpus, pool.map(
            lambda case: send_case(server.port, case), corpus)) if problem]
    errors = [line for line in server.log.read_text(errors="replace").splitlines() if "Error" in line]
    assert not wrong, f"{len(wrong)} of {len(corpus)} cases:\n" + "\n".join(wrong[:40] + errors[-20:])
    assert get(server.url + "/health", key=None)[0] == 200


def test_a_pooled_connection_gets_its_replies_at_once(server):
    """A kept-alive connection (the openai client's, Prometheus's): each reply comes without waiting for the client's
    delayed ACK (~40 ms a reply while the server's sockets lacked TCP_NODELAY; well under 1 ms on loopback now)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT)
    times = []
    for _ in range(16):
        started = time.perf_counter()
        connection.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        response = connection.getresponse()
        assert response.status == 200 and response.read()
        times.append(time.perf_counter() - started)
    connection.close()
    times.sort()
    assert times[len(times) // 2] < 0.02, times  # the median, on a loaded machine too
    with contextlib.closing(bind("127.0.0.1", 0)) as sock:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) and sock.proto == socket.IPPROTO_TCP


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_every_endpoint_but_health_needs_the_key(server, key):
    for path in ("/v1/models", "/metrics", "/stats"):
        status, body = get(server.url + path, key=key)
        assert status == 401, path
        assert json.loads(body)["error"]["type"] == "authentication_error"
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, body = post(server.url + path, b'{"model": "target", "prompt": "x"}', key=key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key=key or "none", max_retries=0).models.list()
    assert get(server.url + "/health", key=key)[0] == 200
    assert get(server.url + "/", key=key)[0] == 200  # the page's static files hold no data


# ------------------------------------------------------------------------- the front's process


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux's /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"  # a zombie has ended
    except (FileNotFoundError, IndexError):
        return False


def wait_until(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_front_ends_when_the_engines_process_is_killed(pair, tmp_path):
    """SIGKILL of the engines' process (no chance to stop its front): the front sees its pipe close and stops
    serving, so no process is left holding the port."""
    proc, url, _ = launch(pair, tmp_path / "server.log")
    try:
        fronts = children(proc.pid)
        assert fronts, "the HTTP front runs in a process of its own"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert wait_until(lambda: not any(alive(p) for p in fronts)), "the front outlived the engines' process"
        with pytest.raises(OSError):
            get(url + "/health", key=None)
    finally:
        stop(proc)


def test_the_engines_process_ends_when_its_front_dies(pair, tmp_path):
    """A front killed from outside: the engines' process stops its engines and exits with 1, said in its log."""
    log = tmp_path / "server.log"
    proc, _, _ = launch(pair, log)
    try:
        for front in children(proc.pid):
            os.kill(front, signal.SIGKILL)
        assert proc.wait(60) == 1
        assert "the HTTP front's process ended with -9" in log.read_text()
    finally:
        stop(proc)


@pytest.mark.parametrize("front", ["process", "thread"])
def test_a_stop_past_its_drain_answers_503_and_exits_1(pair, tmp_path, front):
    """SIGTERM while two long requests run (a stream and a whole one), with --drain-s 1: each is answered 503 (the
    stream: an error event) rather than cut off with no bytes, and the exit status is 1, said in the log (issue 67)."""
    log = tmp_path / "server.log"
    proc, url, _ = launch(pair, log, "--drain-s", "1", "--speculate", "on", "--front", front)
    long = {"model": "target", "prompt": "def f(x):", "max_tokens": 1 << 20, "temperature": 0}
    got: dict[str, object] = {}

    def whole() -> None:
        got["whole"] = post(url + "/v1/completions", json.dumps(long).encode())

    def streamed() -> None:
        request = urllib.request.Request(url + "/v1/completions", json.dumps({**long, "stream": True}).encode(),
                                         {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:
            got["stream"] = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]

    try:
        clients = [threading.Thread(target=whole), threading.Thread(target=streamed)]
        for client in clients:
            client.start()
        assert wait_until(lambda: json.loads(get(url + "/stats")[1])["models"][0]["running"] == 2, 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 1
        for client in clients:
            client.join(30)
    finally:
        stop(proc)
    status, body = got["whole"]
    assert status == 503 and body["error"]["code"] == "server_shutting_down", body
    assert got["stream"][-1] == "[DONE]"
    assert json.loads(got["stream"][-2])["error"]["code"] == "server_shutting_down"
    assert "the requests still running after 1 s of draining were answered 503" in log.read_text()


def test_ctrl_c_while_the_front_imports_prints_no_traceback(pair, tmp_path):
    """Ctrl-C reaches both processes (the terminal signals its foreground group): one while the front still imports
    printed ~60 lines of its imports' traceback. The front now starts with Ctrl-C ignored; the engines' process ends
    it, and the command ends in a line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECDEC_API_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--port", str(free_port()), "--target",
                             str(pair.target), "--drafter", f"lookup+{pair.drafter}", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        assert wait_until(lambda: children(proc.pid), 30), "the front starts at once"
        time.sleep(0.3)  # the front imports torch, transformers, fastapi... for seconds from its start
        os.killpg(proc.pid, signal.SIGINT)
        output = proc.communicate(timeout=60)[0].decode()
    finally:
        stop(proc)
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert len(output.strip().splitlines()) <= 2, output  # the start line, if it got that far


def test_the_thread_front_exits_0_on_sigterm(pair, tmp_path):
    """uvicorn raises SIGTERM again after its graceful stop: the one-process server died of it (143)."""
    log = tmp_path / "server.log"
    proc, _, _ = launch(pair, log, "--front", "thread")
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        stop(proc)
    assert "Traceback" not in log.read_text()


def test_the_app_can_stay_on_a_thread_of_the_engines_process(pair, session, tmp_path):
    """``--front thread``: one process, as before the front had its own; the same greedy completion."""
    log = tmp_path / "server.log"
    ids = encode(session, PROMPTS[0])
    with serving(pair, log, "--front", "thread", "--max-new-tokens", str(MAX_TOKENS), "--schedule",
                 SCHEDULE.schedule, "--speculate", "on") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=HTTP_TIMEOUT, max_retries=0)
        reply = client.completions.create(model="target", prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
        assert json.loads(get(url + "/stats")[1])["models"][0]["front"] == "thread"
    assert reply.choices[0].text == reference(session, ids)[1]
    assert "HTTP on a thread of this process) on http://" in log.read_text()
    with pytest.raises(ValueError, match="front must be one of process, thread, got 'fork'"):
        ServeConfig(front="fork")


def test_the_server_speculates_auto_by_default():
    """A server's batch grows with its clients: by default it keeps the draft width measured fastest per batch
    size (plain decoding included), while generate drafts every round."""
    from specdec.cli import build_parser
    from specdec.config import SpecConfig

    assert build_parser("serve").parse_args(["serve"]).speculate == "auto"
    assert build_parser("serve").parse_args(["serve", "--speculate", "on"]).speculate == "on"
    assert SpecConfig().speculate == "on"


def test_exposure_warning():
    assert ServeConfig().host == "127.0.0.1" and exposure_warning(ServeConfig()) is None
    assert exposure_warning(ServeConfig(host="::1")) is None
    assert "every interface" in exposure_warning(ServeConfig(host="0.0.0.0", api_key=None))
    assert "every interface" in exposure_warning(ServeConfig(host="::"))
    assert exposure_warning(ServeConfig(host="0.0.0.0", api_key="k")) is None


def test_the_command_warns_when_it_listens_everywhere_without_a_key(tmp_path, capsys, monkeypatch):
    from specdec.cli import main

    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    # the warning comes before the models load; a missing target then ends it with one line, exit 2
    assert main(["serve", "--host", "0.0.0.0", "--port", "0", "--target", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("specdec serve: warning: listening on every interface without an API key")
    assert err[1].startswith("specdec serve: error: ") and len(err) == 2
    monkeypatch.setenv("SPECDEC_API_KEY", "from-env")
    assert ServeConfig(host="0.0.0.0").key() == "from-env" and exposure_warning(ServeConfig(host="0.0.0.0")) is None
    assert ServeConfig(api_key="flag").key() == "flag"


def test_model_ids_are_shipped_names_or_folder_names(pair):
    assert model_id("code-target") == "code-target"
    assert model_id(str(pair.target)) == "target"


# ------------------------------------------------------------------------------------- the page


class DevTools:
    """A page of headless Chromium, driven over the DevTools protocol (one websocket)."""

    def __init__(self, ws) -> None:
        self.ws = ws  # a websockets.sync connection to the page's DevTools address
        self.ids = itertools.count(1)

    def call(self, method: str, timeout: float = 30.0, **params) -> dict:
        n = next(self.ids)
        self.ws.send(json.dumps({"id": n, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == n:
                assert "error" not in message, message
                return message["result"]

    def evaluate(self, expression: str) -> object:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0) -> object:
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """Headless Chromium with a fresh profile and a DevTools port; its page's websocket address."""
    try:
        executable = browser.find_or_install()
    except RuntimeError as error:
        pytest.fail(str(error))
    profile = tmp_path_factory.mktemp("chromium-profile")
    proc = subprocess.Popen([executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                             "--no-first-run", "--disable-background-networking", "--disable-component-update",
                             "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
                             "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
                             "--window-size=1280,900", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, "Chromium did not open its DevTools port"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as response:
            pages = [t for t in json.loads(response.read()) if t["type"] == "page"]
        yield pages[0]["webSocketDebuggerUrl"]
    finally:
        stop(proc)


def test_page_streams_coloured_tokens(server, chromium, session, tmp_path):
    from websockets.sync.client import connect

    prompt = "class Point:"
    tokens, text = reference(session, encode(session, prompt), max_tokens=40)
    with connect(chromium, max_size=None, open_timeout=30) as ws:
        check_page(DevTools(ws), server, prompt, tokens, text, tmp_path)


def check_page(page: DevTools, server: Server, prompt: str, tokens: list[int], text: str, tmp_path: Path) -> None:
    """Load the page, give it the key, submit the prompt, wait for coloured tokens, save a screenshot."""
    page.call("Page.enable")
    page.call("Page.navigate", url=server.url + "/")
    page.wait_for("document.readyState === 'complete' && !!document.getElementById('generate')")
    page.wait_for("document.getElementById('key-label').classList.contains('needed')")  # 401 without the key
    # the page points to its own key box, not to a header the person at it cannot send
    assert "type it in the API key box above" in page.wait_for("document.getElementById('status').textContent")
    page.evaluate(f"""(() => {{
        const key = document.getElementById('api-key');
        key.value = {json.dumps(KEY)};
        key.dispatchEvent(new Event('change'));
    }})()""")
    page.wait_for("document.getElementById('model').options.length === 1")
    page.evaluate(f"""(() => {{
        document.getElementById('prompt').value = {json.dumps(prompt)};
        document.getElementById('max-tokens').value = '40';
        document.getElementById('generate').click();
    }})()""")
    page.wait_for("document.body.dataset.state === 'done' && "
                  "document.querySelectorAll('#output span.tok.accepted').length > 0")
    shown = page.evaluate("document.getElementById('output').textContent")
    assert shown == text
    kinds = page.evaluate("[...document.querySelectorAll('#output span.tok')].map(s => s.className)")
    assert {"tok accepted"} <= set(kinds) <= {"tok accepted", "tok recovered", "tok bonus"}
    colour = page.evaluate("getComputedStyle(document.querySelector('#output span.tok.accepted')).color")
    assert colour == "rgb(26, 127, 55)"  # the accepted green of style.css
    assert page.evaluate("document.getElementById('ntokens').textContent") == str(len(tokens))
    assert page.evaluate("document.getElementById('tau').textContent") != "–"
    page.wait_for("document.getElementById('requests').textContent !== '–'")  # the load view polls /stats
    assert f"schedule {SCHEDULE.schedule}," in page.evaluate("document.getElementById('server').textContent")
    shot = base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"])
    path = tmp_path / "page.png"
    path.write_bytes(shot)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 10_000
    keep = os.environ.get("SPECDEC_SCREENSHOT")  # a place to keep the screenshot, to look at it
    if keep:
        shutil.copy(path, keep)


# ------------------------------------------------------------------------------------ bench --serve


def test_bench_serve_runs_every_cell_and_checks_greedy_equality(pair, tmp_path):
    from rich.console import Console

    from specdec.bench.config import BenchConfig
    from specdec.bench.serve import percentile, print_serve, run_serve_bench, serve_goals, write_serve

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:3])))
    config = BenchConfig(target=str(pair.target), drafter=str(pair.drafter), serve=True, clients=(1, 2),
                         speculate=("off", "on", "auto"), prompts=str(prompts), num_prompts=3, max_new_tokens=6,
                         repeats=2,
                         warmup=1, progress=False, device="cpu", output=str(tmp_path))
    run = run_serve_bench(config)
    assert sorted((c.mode, c.clients) for c in run.cells) == [("auto", 1), ("auto", 2), ("off", 1), ("off", 2),
                                                              ("on", 1), ("on", 2)]
    assert run.batch_size == 2
    for cell in run.cells:
        assert cell.requests == (3 if cell.clients == 1 else 4)  # rounded up to a multiple of the clients
        assert len(cell.p50_s) == len(cell.tokens_per_s) == 2
        assert 0 < cell.median("ttft_s") <= cell.median("p50_s") <= cell.median("p95_s")
        assert 0 < cell.tokens <= 6 * cell.requests
        assert cell.greedy_equal == cell.compared == cell.requests  # speculation changes no greedy token
    assert [g.name for g in serve_goals(run)] == ["median latency off / on at 1 client(s)",
                                                  "median latency off / auto at 1 client(s)",
                                                  "median latency off / on at 2 client(s)",
                                                  "median latency off / auto at 2 client(s)",
                                                  "specdec serve launched to its first reply, s"]
    assert run.auto and {c.rows for c in run.auto} <= {(1, 1), (2, 2)}  # auto's buckets, with what it measured
    assert run.crossover == {c.rows[1]: c.width if c.speculate == "on" else 0 for c in run.auto
                             if c.speculate != "measuring"}
    console = Console(file=io.StringIO(), width=200)
    print_serve(run, console)
    assert "speculate auto: 1 row: " in console.file.getvalue()
    # the servers' own word (/stats) on prefilling beside the batch, said in the environment line
    printed = " ".join(console.file.getvalue().split())  # (rich wraps the environment line)
    assert ("prefilling joining prompts on a second thread" in printed) is run.prefill_beside
    assert ("sharing its products with a helper on the idle core" in printed) is run.helper
    assert list(run.startup_s) == ["specdec serve"] and run.startup_s["specdec serve"] > 0  # the real command
    saved = json.loads(write_serve(run, tmp_path).read_text())
    assert len(saved["cells"]) == 6 and saved["config"]["serve"] is True and len(saved["auto"]) == len(run.auto)
    assert saved["prefill_beside"] is run.prefill_beside and saved["vllm_bind"] == "nobind"
    assert saved["helper"] is run.helper
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5 and percentile([1.0, 2.0], 0.95) == pytest.approx(1.95)


# ------------------------------------------------------------------------- the generation config


def test_the_server_applies_the_targets_generation_config(tmp_path):
    """A target whose generation_config.json sets a repetition penalty and no_repeat_ngram_size: the server's
    greedy completion (speculative, lookup + drafter) equals the model's own generate with that config."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    pair = save_tiny_pair(tmp_path / "gc")
    config = GenerationConfig.from_pretrained(pair.target)
    config.repetition_penalty, config.no_repeat_ngram_size = 1.6, 3
    config.save_pretrained(pair.target)
    model = AutoModelForCausalLM.from_pretrained(pair.target).eval()
    prompt = AutoTokenizer.from_pretrained(pair.target)("def add(a, b):\n    return a + b\n")["input_ids"]
    max_tokens = 24
    expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=max_tokens, do_sample=False)[0, len(prompt):].tolist()
    raw = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_tokens, do_sample=False, repetition_penalty=1.0,
                         no_repeat_ngram_size=0)[0, len(prompt):].tolist()
    assert expected != raw, "the generation config must change this completion for the test to mean anything"
    with serving(pair, tmp_path / "server.log", "--max-new-tokens", str(max_tokens)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=HTTP_TIMEOUT, max_retries=0)
        reply = client.completions.create(model="target", prompt=prompt, max_tokens=max_tokens, temperature=0)
    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
