"""The OpenAI surface of `specdec serve` (issue 66): log-probabilities, echo, scoring, logit bias and penalties, n and
best_of, strict types, unsupported fields refused by name, the usage's speculation figures.

One server runs in this process (``ServerThread``) over the tiny pair, drafting with the tiny drafter model (it
proposes q distributions and gets rejections, so recovered positions are covered), driven by the official ``openai``
client and by raw HTTP. References are independent of the round loop: one forward of the target over prompt + output
(its own ``log_softmax`` at every position), and a brute-force greedy loop that re-runs the whole prefix each step and
adjusts the logits as OpenAI's reference defines ``logit_bias``, ``presence_penalty`` and ``frequency_penalty``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch
from tiny_models import save_tiny_pair
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.config import ModelConfig, SamplingConfig, SpecConfig, VerifyConfig
from specdec.processors import Penalties
from specdec.serve.config import ServeConfig
from specdec.serve.protocol import ChatMessage, chat_prompt_ids
from specdec.serve.server import ServerThread, build_app

MAX_TOKENS = 16
TOL = 1e-4
PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self, x, y):", "for i in range(10):",
           "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("openai-pair"))


@pytest.fixture(scope="module")
def server(pair):
    app = build_app(ServeConfig(port=0, api_key=None, front="thread"),
                    ModelConfig(target=str(pair.target), drafter=str(pair.drafter), device="cpu", compile="off",
                                threads=1),
                    SpecConfig(max_new_tokens=MAX_TOKENS, batch_size=4, gamma=4, speculate="on"), SamplingConfig(),
                    VerifyConfig())
    with ServerThread(app) as thread:
        yield thread.url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def model(pair):
    return AutoModelForCausalLM.from_pretrained(pair.target).eval()


@pytest.fixture(scope="module")
def tokenizer(pair):
    return AutoTokenizer.from_pretrained(pair.target)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@torch.inference_mode()
def own_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The target's log-probabilities at every position of ``ids`` in one forward: row t scores token t + 1."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]


def adjusted(logits: torch.Tensor, output: list[int], penalties: Penalties) -> torch.Tensor:
    """OpenAI's definition, token by token: logit + bias - frequency * count - presence * (count > 0)."""
    out = logits.clone()
    for token, value in penalties.bias:
        out[token] += value
    for token in set(output):
        count = output.count(token)
        out[token] -= penalties.frequency * count + penalties.presence
    return out


@torch.inference_mode()
def brute_greedy(model, ids: list[int], steps: int, penalties: Penalties) -> tuple[list[int], list[float]]:
    """Greedy decoding by brute force (the whole prefix re-run each step), with OpenAI's adjustments: the tokens and
    each one's log-probability under the adjusted logits."""
    output, logprobs = [], []
    for _ in range(steps):
        logits = adjusted(model(torch.tensor([ids + output])).logits[0, -1].float(), output, penalties)
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        output.append(token)
    return output, logprobs


def check_against_target(model, prompt: list[int], tokens: list[int], token_logprobs: list[float],
                         tops: list[dict[str, float]], k: int) -> None:
    """Each reported log-probability, and each position's top k, equal the target's own (one forward)."""
    reference = own_logprobs(model, prompt + tokens)[len(prompt) - 1:-1]  # [n, V]: position i scores tokens[i]
    for i, token in enumerate(tokens):
        assert abs(token_logprobs[i] - float(reference[i, token])) < TOL, (i, token_logprobs[i])
        best = sorted(tops[i].values(), reverse=True)[:k]  # the top dict also holds the chosen token
        assert torch.allclose(torch.tensor(best), reference[i].topk(k).values, atol=TOL), i


# ------------------------------------------------------------------------------------- log-probabilities


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_targets_own_at_every_token(client, model, tokenizer, temperature):
    """Greedy and sampled requests, 4 prompts in one request, through rounds with rejections: every emitted token's
    log-probability and top 3 equal the target's own forward over prompt + output to 1e-4 (a rejected draft's
    position reports the target's distribution, not the drafter's)."""
    reply = client.completions.create(model="target", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=temperature,
                                      seed=11, logprobs=3)
    kinds = [k for c in reply.specdec["choices"] for k in c["kinds"]]
    assert "recovered" in kinds and "accepted" in kinds, kinds  # the drafter was rejected somewhere
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for text, choice, extra in zip(PROMPTS, reply.choices, reply.specdec["choices"]):
        tokens = extra["token_ids"]
        lp = choice.logprobs
        assert len(tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_TOKENS
        assert lp.tokens == [tokenizer.decode([t]) for t in tokens]
        check_against_target(model, list(tokenizer(text).input_ids), tokens, lp.token_logprobs, lp.top_logprobs, 3)
        assert lp.text_offset[0] == len(text)


def test_chat_logprobs_through_the_official_client(client, model, tokenizer):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    reply = client.chat.completions.create(model="target", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    tokens = reply.model_extra["specdec"]["token_ids"]
    prompt = chat_prompt_ids([ChatMessage(role="user", content=messages[0]["content"])], tokenizer)
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in tokens]
    check_against_target(model, prompt, tokens, [c.logprob for c in content],
                         [{str(i): t.logprob for i, t in enumerate(c.top_logprobs)} for c in content], 2)
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)


def test_streamed_logprobs_equal_the_whole_responses(server, client):
    whole = client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                      logprobs=2)
    streamed = [c for c in client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                                      temperature=0, logprobs=2, stream=True) if c.choices]
    got = [x for c in streamed if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    offsets = [x for c in streamed if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert got == whole.choices[0].logprobs.token_logprobs
    assert offsets == whole.choices[0].logprobs.text_offset


def test_streamed_chat_logprobs_equal_the_whole_responses(client):
    kwargs = {"model": "target", "messages": [{"role": "user", "content": "for i in"}], "max_tokens": MAX_TOKENS,
              "temperature": 0, "logprobs": True, "top_logprobs": 1}
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [x for c in client.chat.completions.create(stream=True, **kwargs)
                if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in whole]
    assert len(whole) == MAX_TOKENS


def test_echo_scores_the_prompt_and_max_tokens_0_scores_only(client, model, tokenizer):
    """lm-evaluation-harness's log-likelihood request (echo, logprobs, max_tokens 0 or 1): the prompt's
    log-probabilities (the first None) equal the target's own, the text starts with the prompt."""
    ids = list(tokenizer(PROMPTS[3] + "def main():").input_ids)
    reference = own_logprobs(model, ids)
    scored = client.completions.create(model="target", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == tokenizer.decode(ids) and scored.choices[0].finish_reason == "length"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    for t in range(1, len(ids)):
        assert abs(lp.token_logprobs[t] - float(reference[t - 1, ids[t]])) < TOL
        assert abs(max(lp.top_logprobs[t].values()) - float(reference[t - 1].max())) < TOL
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    one = client.completions.create(model="target", prompt=[ids, ids[:5]], max_tokens=1, echo=True, logprobs=1,
                                    temperature=0)
    assert one.choices[0].logprobs.token_logprobs[:-1] == lp.token_logprobs  # the same scores, then the new token
    assert len(one.choices[1].logprobs.token_logprobs) == 6
    new = one.specdec["choices"][0]["token_ids"][0]
    assert new == int(reference[-1].argmax())
    assert abs(one.choices[0].logprobs.token_logprobs[-1] - float(reference[-1, new])) < TOL


# ------------------------------------------------------------------------------ logit bias and penalties


def test_logit_bias_bans_and_forces_tokens(client, tokenizer):
    ids = list(tokenizer(PROMPTS[0]).input_ids)
    plain = client.completions.create(model="target", prompt=ids, max_tokens=8, temperature=0)
    first = plain.specdec["token_ids"][0]
    banned = client.completions.create(model="target", prompt=ids, max_tokens=8, temperature=0,
                                       logit_bias={str(first): -100})
    assert first not in banned.specdec["token_ids"]
    forced = client.completions.create(model="target", prompt=ids, max_tokens=8, temperature=1, seed=3,
                                       logit_bias={"14": 100})
    assert forced.specdec["token_ids"] == [14] * 8


@pytest.mark.parametrize("penalties", [Penalties(presence=2.0), Penalties(frequency=1.2),
                                       Penalties(((5, 3.0), (100, -2.5)), presence=-0.5, frequency=0.8)],
                         ids=["presence", "frequency", "all"])
def test_penalties_follow_openais_definition(client, model, tokenizer, penalties):
    """Greedy output and its log-probabilities under presence / frequency penalties and a bias equal a brute-force
    loop applying OpenAI's formula (generated tokens only are counted)."""
    ids = list(tokenizer(PROMPTS[2]).input_ids)
    body = {"presence_penalty": penalties.presence, "frequency_penalty": penalties.frequency,
            "logit_bias": {str(t): v for t, v in penalties.bias}}
    reply = client.completions.create(model="target", prompt=ids, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                      **body)
    tokens, logprobs = brute_greedy(model, ids, MAX_TOKENS, penalties)
    assert reply.specdec["token_ids"] == tokens
    assert torch.allclose(torch.tensor(reply.choices[0].logprobs.token_logprobs), torch.tensor(logprobs), atol=TOL)
    plain = brute_greedy(model, ids, MAX_TOKENS, Penalties())
    assert plain != (tokens, logprobs)  # the penalties changed something
    assert plain[0] == client.completions.create(model="target", prompt=ids, max_tokens=MAX_TOKENS,
                                                 temperature=0).specdec["token_ids"]


# --------------------------------------------------------------------------------------- n and best_of


def test_n_choices_seeded_and_reproducible(client):
    kwargs = {"model": "target", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 5}
    three = client.completions.create(n=3, **kwargs)
    again = client.completions.create(n=3, **kwargs)
    one = client.completions.create(**kwargs)
    texts = [c.text for c in three.choices]
    assert [c.index for c in three.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [c.text for c in again.choices]
    assert texts[0] == one.choices[0].text  # choice j draws from seed + j
    assert three.usage.completion_tokens == sum(len(c["token_ids"]) for c in three.specdec["choices"])
    chat = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "x"}], n=2,
                                          max_tokens=4, temperature=1.0, seed=5)
    assert [c.index for c in chat.choices] == [0, 1]


def test_best_of_returns_the_best_mean_logprob(client):
    kwargs = {"model": "target", "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 1.5, "seed": 2,
              "logprobs": 0}
    every = client.completions.create(n=4, **kwargs)
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(n=2, best_of=4, **kwargs)
    order = sorted(range(4), key=lambda i: means[i], reverse=True)[:2]
    assert [c.text for c in best.choices] == [every.choices[i].text for i in order]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == every.usage.completion_tokens  # the dropped ones count too


def test_usage_carries_the_requests_speculation_figures(client):
    reply = client.completions.create(model="target", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    spec = reply.usage.model_extra["speculation"]
    assert spec["drafted"] > 0 and 0 < spec["accepted"] <= spec["drafted"] and spec["lossless"] is True
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"])
    assert spec["mean_accepted_length"] == pytest.approx(reply.usage.completion_tokens / spec["rounds"])
    assert 1.0 <= spec["mean_accepted_length"] <= 5.0  # gamma 4: at most 5 tokens a round


# ------------------------------------------------------------------------------------ refused by name


CHAT = {"messages": [{"role": "user", "content": "x"}]}
REFUSED = [  # (path, extra body, param, code)
    ("completions", {"suffix": "y"}, "suffix", "unsupported_parameter"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "unsupported_parameter"),
    ("chat/completions", {"tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
    ("completions", {"response_format": {"type": "text"}}, "response_format", "unsupported_parameter"),
    ("completions", {"frobnicate": 1}, "frobnicate", "unsupported_parameter"),
    ("chat/completions", {"echo": True}, "echo", "unsupported_parameter"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages",
     "unsupported_parameter"),
    ("completions", {"stream": True, "n": 2}, "n", "unsupported_parameter"),
    ("completions", {"stream": True, "echo": True}, "echo", "unsupported_parameter"),
    ("completions", {"max_tokens": "5"}, "max_tokens", "invalid_value"),
    ("completions", {"top_p": True}, "top_p", "invalid_value"),
    ("completions", {"stream": "yes"}, "stream", "invalid_value"),
    ("completions", {"n": 1.5}, "n", "invalid_value"),
    ("completions", {"seed": "1"}, "seed", "invalid_value"),
    ("completions", {"logprobs": True}, "logprobs", "invalid_value"),
    ("completions", {"echo": 1}, "echo", "invalid_value"),
    ("chat/completions", {"logprobs": 1}, "logprobs", "invalid_value"),
    ("completions", {"stream_options": {"include_usage": "yes"}}, "stream_options", "invalid_value"),
    ("completions", {"logprobs": 21}, "logprobs", "invalid_value"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
    ("completions", {"logit_bias": {"5": "1"}}, "logit_bias", "invalid_value"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ("completions", {"frequency_penalty": "1"}, "frequency_penalty", "invalid_value"),
    ("completions", {"n": 0}, "n", "invalid_value"),
    ("completions", {"n": 3, "best_of": 2}, "best_of", "invalid_value"),
    ("completions", {"max_tokens": 0}, "max_tokens", "invalid_value"),
]


@pytest.mark.parametrize(("path", "extra", "param", "code"), REFUSED, ids=[f"{i}-{r[2]}" for i,
                                                                           r in enumerate(REFUSED)])
def test_unsupported_fields_and_wrong_types_are_refused_by_name(server, path, extra, param, code):
    body = {"model": "target", **(CHAT if path.startswith("chat") else {"prompt": "x"}), **extra}
    status, reply = post(f"{server}/v1/{path}", body)
    assert status == 400, reply
    error = reply["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert param in error["message"] or param == "messages", error


def test_null_fields_are_absent(server):
    """A client that writes every field, unset ones as null (``"suffix": null``), is not refused."""
    status, reply = post(f"{server}/v1/completions", {"model": "target", "prompt": "x", "max_tokens": 2,
                                                     "suffix": None, "tools": None, "logprobs": None, "n": None})
    assert status == 200 and reply["choices"][0]["logprobs"] is None, reply
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "refusal": None,
                                                   "tool_calls": None}, {"role": "user", "content": "z"}]
    status, reply = post(f"{server}/v1/chat/completions", {"model": "target", "messages": messages, "max_tokens": 2})
    assert status == 200, reply


def test_prompt_scores_equal_each_prompt_alone_in_chunks_or_not(monkeypatch):
    """``logprobs.prompt_logprobs`` pads prompts of several lengths into one forward (or several, past
    ``SCORE_TOKENS``): each equals the target's forward over that prompt alone."""
    from conftest import build_tiny

    from specdec import logprobs
    from specdec.target import make_target
    model = build_tiny(vocab_size=64, seed=0)
    target = make_target(model)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [3] * 11, [40, 41, 42]]
    for budget in (logprobs.SCORE_TOKENS, 12):
        monkeypatch.setattr(logprobs, "SCORE_TOKENS", budget)
        for p, scored in zip(prompts, logprobs.prompt_logprobs(target, prompts, [3] * len(prompts))):
            alone = own_logprobs(model, p)
            assert scored[0] is None and len(scored) == len(p)
            for t in range(1, len(p)):
                assert scored[t].token == p[t] and abs(scored[t].logprob - float(alone[t - 1, p[t]])) < TOL
                assert [i for i, _ in scored[t].top] == alone[t - 1].topk(3).indices.tolist()


def test_a_prompt_only_scored_may_fill_the_context():
    from specdec.serve.protocol import APIError, check_prompt_ids
    check_prompt_ids([1] * 8, 10, 8, generates=False)  # echo with max_tokens 0: nothing to generate
    for ids, generates in (([1] * 8, True), ([1] * 9, False)):
        with pytest.raises(APIError) as err:
            check_prompt_ids(ids, 10, 8, generates=generates)
        assert err.value.param == "prompt" and err.value.code == "context_length_exceeded"
