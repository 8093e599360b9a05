"""OpenAI's logit bias and presence / frequency penalties as a row's processor (``processors.Penalties``), in the core.

1. The processor on its own: OpenAI's formula written out token by token, counting only the tokens past the prompt,
   ignoring padding ids >= V (the rows ``apply`` pads).
2. Sampling stays lossless: speculative sampling with a drafter model, under a bias and both penalties, draws
   sequences distributed as sampling from the penalised target, whose distribution is computed here independently
   (chi-squared over every sequence of 2 tokens of a vocabulary of 8); the unpenalised distribution is rejected.
3. Greedy decoding under them equals a brute-force loop (the whole prefix re-run each step) for several rows at once.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from conftest import build_toy
from test_core_sampling import chi2_pvalue, reference_probs

from specdec.config import SamplingConfig, SpecConfig, VerifyConfig
from specdec.decode import Request, _decode
from specdec.drafters import make_drafter
from specdec.processors import Penalties
from specdec.schedules import make_schedule
from specdec.target import make_target

PENALTIES = Penalties(((2, 1.5), (5, -2.0)), presence=0.7, frequency=0.9)


def formula(logits: torch.Tensor, output: list[int], p: Penalties) -> torch.Tensor:
    """OpenAI's API reference: logit[j] + bias[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = logits.double().clone()
    for token, value in p.bias:
        out[token] += value
    for j in range(out.shape[0]):
        c = output.count(j)
        out[j] -= c * p.frequency + (c > 0) * p.presence
    return out


def test_the_processor_is_openais_formula_on_the_output_only():
    torch.manual_seed(0)
    prompt, output, vocab = [3, 3, 4], [4, 6, 6, 2], 8
    scores = torch.randn(2, vocab)
    padded = torch.tensor([prompt + output, prompt + output[:2] + [vocab, vocab]])  # row 1: 2 outputs, then padding
    got = PENALTIES.processor(len(prompt))(padded, scores)
    assert torch.allclose(got[0].double(), formula(scores[0], output, PENALTIES), atol=1e-6)
    assert torch.allclose(got[1].double(), formula(scores[1], output[:2], PENALTIES), atol=1e-6)
    assert not Penalties() and PENALTIES  # no adjustment: no processor at all


def penalised_probs(target, prompt: list[int], output: list[int], p: Penalties) -> torch.Tensor:
    with torch.no_grad():
        logits = target(torch.tensor([prompt + output]), use_cache=False).logits[0, -1]
    return reference_probs(formula(logits, output, p), 1.0, 0, 1.0)


def decode(target, drafter, prompts: list[list[int]], penalties: Penalties, temperature: float, n_new: int,
           seed: int = 0) -> list:
    handle = make_target(target)
    chosen = make_drafter(drafter, handle, None)
    requests = [Request(p, n_new, SamplingConfig(temperature=temperature, top_k=0, top_p=1.0, seed=seed + i),
                        penalties=penalties, index=i) for i, p in enumerate(prompts)]
    schedule = make_schedule(SpecConfig(gamma=2, max_new_tokens=n_new))
    return _decode(handle, chosen, schedule, requests, verify=VerifyConfig(), batch_size=len(prompts),
                   tokenizer=None, on_round=None, on_result=None)


def test_sampling_under_penalties_is_the_penalised_distribution():
    target = build_toy(vocab_size=8, seed=0, scale=0.8)
    drafter = build_toy(vocab_size=8, seed=1, scale=0.8)
    prompt, n_new = [3, 4, 3, 5, 3], 2
    exact: dict[tuple[int, ...], float] = {(): 1.0}
    plain: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n_new):
        exact = {seq + (t,): mass * float(q) for seq, mass in exact.items() if mass > 0
                 for t, q in enumerate(penalised_probs(target, prompt, list(seq), PENALTIES))}
        plain = {seq + (t,): mass * float(q) for seq, mass in plain.items() if mass > 0
                 for t, q in enumerate(penalised_probs(target, prompt, list(seq), Penalties()))}
    index = {seq: i for i, seq in enumerate(itertools.product(range(8), repeat=n_new))}
    counts = np.zeros(len(index), dtype=np.int64)
    accepted = drafted = 0
    for call in range(2):  # 2,000 samples: 1,000 copies of the prompt a call, each row its own generator
        for res in decode(target, drafter, [prompt] * 1_000, PENALTIES, 1.0, n_new, seed=1_000 * call):
            counts[index[tuple(res.tokens)]] += 1
            accepted, drafted = accepted + res.stats.accepted, drafted + res.stats.drafted
    assert 0 < accepted < drafted  # both acceptances and rejections happen
    assert chi2_pvalue(counts, np.array([exact.get(s, 0.0) for s in index])) > 1e-3
    assert chi2_pvalue(counts, np.array([plain.get(s, 0.0) for s in index])) < 1e-6  # the power check


def test_greedy_under_penalties_equals_brute_force_for_each_row():
    target = build_toy(vocab_size=12, seed=2, scale=1.5)
    drafter = build_toy(vocab_size=12, seed=3, scale=1.5)
    prompts, n_new = [[1, 2, 3], [4, 4, 4, 4, 5], [7]], 10
    penalties = Penalties(((0, -100.0), (9, 0.8)), presence=0.6, frequency=0.4)
    for res, prompt in zip(decode(target, drafter, prompts, penalties, 0.0, n_new), prompts):
        output: list[int] = []
        for _ in range(n_new):
            output.append(int(penalised_probs(target, prompt, output, penalties).argmax()))
        assert res.tokens == output and 0 not in output
