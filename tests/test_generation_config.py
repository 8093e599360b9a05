"""The target's generation config and logits processors, applied exactly as ``generate`` applies them (issue 25).

1. Greedy: for a tiny Llama, a tiny GPT-2 and a tiny BART, each processor set in the model's
   ``generation_config`` (repetition_penalty, no_repeat_ngram_size, suppress_tokens, bad_words_ids,
   min_new_tokens, forced_eos_token_id, sequence_bias; BART also its stock forced_eos_token_id,
   forced_bos_token_id and begin_suppress_tokens) gives speculative output equal to the model's own
   ``generate`` with that config, one prompt alone and in a ragged batch, with prompt lookup and a
   model drafter, at several gamma; the setting changes the output (else the test would prove nothing).
   The drafter drafts from its logits with the same processors (an identical drafter is always accepted).
2. ``ignore_generation_config`` gives plain argmax decoding; a user's ``logits_processor`` list equals
   ``generate(logits_processor=...)``, a processor of the user's own class included.
3. Sampling with a repetition penalty (and no_repeat_ngram_size) is distributed exactly as the
   processed target distribution, computed by enumeration with the penalty written out here (chi-square;
   the samples are rows of large batches, each row with its own generator and its own prefixes).
4. The generation config's sampling defaults are used (same tokens as passing them) and reported with
   their sources; the caller's values win.
5. Processors that cannot be applied per verified position are refused by name before decoding.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from conftest import build_tiny, build_toy, truncated_copy
from test_core_sampling import chi2_pvalue, reference_probs
from test_seq2seq import build as build_seq2seq
from test_seq2seq import first_decoder_layer
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor
from transformers.generation.logits_process import ClassifierFreeGuidanceLogitsProcessor

import specdec
from specdec.processors import GENERATION_CONFIG, SPECDEC_DEFAULT, TRANSFORMERS_DEFAULT, USER

NEW = 24  # new tokens per generation
PROMPTS = [[1, 5, 6, 7, 5, 6, 7, 5, 6], [3, 9, 9, 4, 9, 9, 4], [8, 11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13]]
SETTINGS = ("repetition_penalty", "no_repeat_ngram_size", "suppress_tokens", "bad_words_ids", "min_new_tokens",
            "forced_eos_token_id", "sequence_bias")


def plain_generate(model, prompt: list[int], **kwargs) -> list[int]:
    """``model.generate`` of one prompt (its generation config applies), new tokens up to the first eos."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kwargs)
    start = 1 if model.config.is_encoder_decoder else len(prompt)
    tokens = out[0, start:].tolist()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def configure(model, setting: str, raw: list[int]) -> dict:
    """The generation-config fields of ``setting``, chosen from the raw greedy output ``raw`` so that
    they change it."""
    common = [t for t, _ in sorted(((t, raw.count(t)) for t in set(raw)), key=lambda x: (-x[1], x[0]))]
    return {
        "repetition_penalty": {"repetition_penalty": 1.6},
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
        "suppress_tokens": {"suppress_tokens": common[:2]},
        "bad_words_ids": {"bad_words_ids": [[common[0]], [raw[2], raw[3]]]},
        # the raw output's 4th token becomes an end of sequence, not allowed before 10 new tokens
        "min_new_tokens": {"min_new_tokens": 10, "eos_token_id": [model.generation_config.eos_token_id, raw[3]]},
        "forced_eos_token_id": {"forced_eos_token_id": common[-1]},
        "sequence_bias": {"sequence_bias": [[[common[0]], -4.0], [[raw[1], raw[2]], -30.0], [[common[-1]], 3.0]]},
    }[setting]


def with_config(model, fields: dict):
    """A shallow copy of ``model`` sharing its weights, with ``fields`` set in its generation config."""
    clone = copy.copy(model)
    clone.generation_config = copy.deepcopy(model.generation_config)
    for name, value in fields.items():
        setattr(clone.generation_config, name, value)
    return clone


@pytest.fixture(scope="module")
def pairs():
    """(target, drafter model) per architecture; the drafter agrees with the target often."""
    out = {}
    for arch in ("llama", "gpt2"):
        target = build_tiny(arch, seed=0, layers=2)
        out[arch] = (target, truncated_copy(target, 1))
    bart = build_seq2seq("bart")
    out["bart"] = (bart, first_decoder_layer(bart))
    return out


def check(target, drafter, fields: dict, gammas=(1, 3, 6)) -> int:
    """Speculative greedy output of ``target`` with ``fields`` in its generation config equals its
    ``generate``, alone and in a ragged batch, with prompt lookup and ``drafter``; returns the drafts accepted."""
    model = with_config(target, fields)
    reference = [plain_generate(model, p) for p in PROMPTS]
    raw = [plain_generate(target, p) for p in PROMPTS]
    assert reference != raw, f"{fields} does not change the output: the test would prove nothing"
    accepted = 0
    for gamma, kind in itertools.product(gammas, ("ngram", "model")):
        chosen = "ngram" if kind == "ngram" else drafter
        one = specdec.speculative_generate(model, chosen, PROMPTS[0], max_new_tokens=NEW, gamma=gamma)
        assert one.tokens == reference[0], (fields, gamma, kind)
        batch = specdec.speculative_generate(model, chosen, PROMPTS, max_new_tokens=NEW, gamma=gamma, batch_size=3)
        assert [r.tokens for r in batch] == reference, (fields, gamma, kind)
        accepted += one.stats.accepted + sum(r.stats.accepted for r in batch)
        assert one.settings.processors and one.settings.generation_config
    plain = specdec.autoregressive_generate(model, PROMPTS, max_new_tokens=NEW, batch_size=2)
    assert [r.tokens for r in plain] == reference
    return accepted


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decoder_only_processors_equal_generate(pairs, arch, setting):
    target, drafter = pairs[arch]
    fields = configure(target, setting, plain_generate(target, PROMPTS[0]))
    assert check(target, drafter, fields) > 0  # drafts were accepted under the processor


BART_SETTINGS = {
    "stock forced_eos_token_id": {"forced_eos_token_id": 2},
    "forced_bos_token_id": {"forced_bos_token_id": 7},
    "begin_suppress_tokens": {"begin_suppress_tokens": None},  # filled from the raw output below
    **{s: None for s in SETTINGS if s != "forced_eos_token_id"},
}


@pytest.mark.parametrize("setting", list(BART_SETTINGS))
def test_encoder_decoder_processors_equal_generate(pairs, setting):
    target, drafter = pairs["bart"]
    raw = plain_generate(target, PROMPTS[0])
    fields = BART_SETTINGS[setting]
    if setting == "begin_suppress_tokens":
        fields = {"begin_suppress_tokens": [raw[0]]}
    elif fields is None:
        fields = configure(target, setting, raw)
    if setting == "stock forced_eos_token_id":  # as a stock BART ships it: the last token is forced to eos
        fields = {**fields, "eos_token_id": None}
    check(target, drafter, fields, gammas=(1, 4))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_drafter_drafts_with_the_processors_too(pairs, temperature):
    """A drafter identical to the target drafts from the same processed logits: every draft is accepted
    (greedy), and sampling accepts almost all (p = q up to the multi-token forward's rounding); without
    the processors on the drafter's side the penalty would reject drafts."""
    target, _ = pairs["llama"]
    model = with_config(target, {"repetition_penalty": 1.6, "no_repeat_ngram_size": 3})
    twin = copy.deepcopy(target)
    out = specdec.speculative_generate(model, twin, PROMPTS, max_new_tokens=NEW, gamma=4, temperature=temperature,
                                       seed=0)
    drafted, accepted = sum(r.stats.drafted for r in out), sum(r.stats.accepted for r in out)
    assert drafted > 0 and (accepted == drafted if temperature == 0 else accepted >= 0.95 * drafted)
    if temperature == 0:
        assert [r.tokens for r in out] == [plain_generate(model, p) for p in PROMPTS]


def test_ignore_generation_config_gives_plain_argmax(pairs):
    target, drafter = pairs["llama"]
    raw = [plain_generate(target, p) for p in PROMPTS]
    model = with_config(target, {"repetition_penalty": 1.6, "suppress_tokens": [raw[0][0]]})
    for chosen in ("ngram", drafter):
        out = specdec.speculative_generate(model, chosen, PROMPTS, max_new_tokens=NEW, gamma=3,
                                           ignore_generation_config=True)
        assert [r.tokens for r in out] == raw
        assert out[0].settings.processors == () and not out[0].settings.generation_config
    processed = specdec.speculative_generate(model, "ngram", PROMPTS, max_new_tokens=NEW, gamma=3)
    assert [r.tokens for r in processed] != raw


class EvenPenalty(LogitsProcessor):
    """A user's own processor: lowers even tokens once the prefix is longer than 12 (depends on the prefix)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] <= 12:
            return scores
        return scores - 3.0 * (torch.arange(scores.shape[-1]) % 2 == 0)


def test_user_logits_processor_equals_generate(pairs):
    target, drafter = pairs["gpt2"]
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.4), EvenPenalty()])
    reference = [plain_generate(target, p, logits_processor=processors) for p in PROMPTS]
    assert reference != [plain_generate(target, p) for p in PROMPTS]
    for gamma in (2, 5):
        out = specdec.speculative_generate(target, drafter, PROMPTS, max_new_tokens=NEW, gamma=gamma,
                                           logits_processor=processors)
        assert [r.tokens for r in out] == reference
    assert out[0].settings.processors == ("RepetitionPenaltyLogitsProcessor (repetition_penalty)", "EvenPenalty")
    plain = specdec.autoregressive_generate(target, PROMPTS[1], max_new_tokens=NEW, logits_processor=processors)
    assert plain.tokens == reference[1]


def penalised_probs(target, prefix: list[int], penalty: float, ngram: int | None) -> torch.Tensor:
    """The processed next-token distribution, written out independently of transformers: [V]."""
    with torch.no_grad():
        logits = target(torch.tensor([prefix]), use_cache=False).logits[0, -1].double()
    seen = torch.tensor(sorted(set(prefix)))
    logits[seen] = torch.where(logits[seen] < 0, logits[seen] * penalty, logits[seen] / penalty)
    if ngram is not None:  # a token that would repeat an earlier bigram is banned
        for a, b in itertools.pairwise(prefix):
            if a == prefix[-1]:
                logits[b] = -float("inf")
    return reference_probs(logits, 1.0, 0, 1.0)


@pytest.mark.parametrize(("drafter_kind", "ngram"), [("model", None), ("model", 2), ("ngram", None)])
def test_sampling_with_a_repetition_penalty_is_the_processed_distribution(drafter_kind, ngram):
    target = build_toy(vocab_size=8, seed=0, scale=0.8)
    target.generation_config.repetition_penalty = 1.8
    target.generation_config.no_repeat_ngram_size = ngram
    drafter = build_toy(vocab_size=8, seed=1, scale=0.8) if drafter_kind == "model" else "ngram"
    prompt, n_new = [3, 4, 3, 5, 3], 3
    exact: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n_new):
        exact = {seq + (t,): mass * float(p) for seq, mass in exact.items() if mass > 0
                 for t, p in enumerate(penalised_probs(target, prompt + list(seq), 1.8, ngram))}
    index = {seq: i for i, seq in enumerate(itertools.product(range(8), repeat=n_new))}
    counts = np.zeros(len(index), dtype=np.int64)
    accepted = drafted = 0
    for call in range(4):  # 4,000 samples: batches of 1,000 copies of the prompt, each row its own generator
        for res in specdec.speculative_generate(target, drafter, [prompt] * 1_000, max_new_tokens=n_new, gamma=2,
                                                temperature=1.0, seed=1_000 * call, stop_token_ids=[],
                                                batch_size=1_000):
            counts[index[tuple(res.tokens)]] += 1
            accepted, drafted = accepted + res.stats.accepted, drafted + res.stats.drafted
    assert 0 < accepted < drafted  # both acceptances and rejections happen
    assert chi2_pvalue(counts, np.array([exact.get(s, 0.0) for s in index])) > 1e-3
    # the power check: the unpenalised distribution is rejected
    plain: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n_new):
        plain = {seq + (t,): mass * float(p) for seq, mass in plain.items() if mass > 0
                 for t, p in enumerate(penalised_probs(target, prompt + list(seq), 1.0, None))}
    assert chi2_pvalue(counts, np.array([plain.get(s, 0.0) for s in index])) < 1e-6


def test_generation_config_sampling_defaults_are_used_and_reported(pairs):
    target, drafter = pairs["llama"]
    model = with_config(target, {"do_sample": True, "temperature": 0.7, "top_p": 0.9})
    out = specdec.speculative_generate(model, drafter, PROMPTS[0], max_new_tokens=NEW, gamma=3, seed=5)
    settings = out.settings
    assert (settings.sampling.temperature, settings.sampling.top_k, settings.sampling.top_p) == (0.7, 50, 0.9)
    assert settings.sources == {"temperature": GENERATION_CONFIG, "top_k": TRANSFORMERS_DEFAULT,
                                "top_p": GENERATION_CONFIG, "do_sample": GENERATION_CONFIG}
    assert settings.to_dict()["sources"]["top_k"] == TRANSFORMERS_DEFAULT
    same = specdec.speculative_generate(target, drafter, PROMPTS[0], max_new_tokens=NEW, gamma=3, seed=5,
                                        temperature=0.7, top_k=50, top_p=0.9)
    assert out.tokens == same.tokens
    assert out.tokens != specdec.speculative_generate(target, drafter, PROMPTS[0], max_new_tokens=NEW, gamma=3,
                                                      seed=5, temperature=1.0).tokens
    # the caller's values win; greedy when asked
    greedy = specdec.speculative_generate(model, drafter, PROMPTS[0], max_new_tokens=NEW, temperature=0)
    assert greedy.settings.sampling.greedy and greedy.settings.sources["temperature"] == USER
    assert greedy.tokens == plain_generate(target, PROMPTS[0])
    mixed = specdec.autoregressive_generate(model, PROMPTS[0], max_new_tokens=4, top_k=3, seed=1)
    assert mixed.settings.sampling.top_k == 3 and mixed.settings.sources["top_k"] == USER
    assert mixed.settings.sources["temperature"] == GENERATION_CONFIG
    raw = specdec.autoregressive_generate(model, PROMPTS[0], max_new_tokens=4, ignore_generation_config=True)
    assert raw.settings.sampling.greedy and raw.settings.sources["temperature"] == SPECDEC_DEFAULT


@pytest.mark.parametrize(("fields", "name"), [
    ({"guidance_scale": 1.5}, "UnbatchedClassifierFreeGuidanceLogitsProcessor"),
    ({"do_sample": True, "min_p": 0.1}, "MinPLogitsWarper"),
    ({"do_sample": True, "typical_p": 0.5}, "TypicalLogitsWarper"),
])
def test_processor_that_cannot_be_applied_is_refused_by_name(pairs, fields, name):
    target, drafter = pairs["llama"]
    model = with_config(target, fields)
    with pytest.raises(ValueError, match=name) as err:
        specdec.speculative_generate(model, drafter, PROMPTS[0], max_new_tokens=4)
    assert "ignore_generation_config" in str(err.value)
    # decoding raw works; greedy never applies the sampling warpers
    specdec.speculative_generate(model, drafter, PROMPTS[0], max_new_tokens=4, ignore_generation_config=True)
    if "min_p" in fields:
        specdec.speculative_generate(model, drafter, PROMPTS[0], max_new_tokens=4, temperature=0)


def test_user_processor_that_cannot_be_applied_is_refused_by_name(pairs):
    target, drafter = pairs["llama"]
    with pytest.raises(ValueError, match="ClassifierFreeGuidanceLogitsProcessor"):
        specdec.speculative_generate(target, drafter, PROMPTS[0], max_new_tokens=4,
                                     logits_processor=LogitsProcessorList([ClassifierFreeGuidanceLogitsProcessor(1.5)]))


def test_no_processor_means_no_extra_work(pairs, monkeypatch):
    """A generation config without processors (the shipped models') never reaches the processing code."""
    import specdec.decode

    target, drafter = pairs["llama"]

    def fail(*args, **kwargs):
        raise AssertionError("processors applied although none is in force")

    monkeypatch.setattr(specdec.decode, "apply", fail)
    out = specdec.speculative_generate(target, drafter, PROMPTS, max_new_tokens=8, gamma=3)
    assert out[0].settings.processors == () and out[0].settings.generation_config


def test_cli_reports_the_settings_and_ignores_the_config_when_asked(tmp_path):
    """``specdec generate``: a target whose generation_config.json sets a repetition penalty and sampling
    decodes with them (the API's tokens, its drafter in the form the CLI picks), says so in --json and the summary;
    --ignore-generation-config decodes raw."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    target = build_tiny("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    paths = {"target": tmp_path / "target", "drafter": tmp_path / "drafter"}
    for name, model in (("target", target), ("drafter", truncated_copy(target, 1))):
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    config_file = paths["target"] / "generation_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "repetition_penalty": 1.5, "do_sample": True, "top_k": 20}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    repo = Path(__file__).resolve().parent.parent

    def run(*flags: str) -> tuple[dict, str]:
        proc = subprocess.run([sys.executable, "-m", "specdec", "generate", "def add(a, b):", "--target",
                               str(paths["target"]), "--drafter", str(paths["drafter"]), "--max-new-tokens", "16",
                               "--seed", "3", *flags], capture_output=True, text=True, env=env, cwd=repo,
                              timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        return (json.loads(proc.stdout) if "--json" in flags else {}), proc.stderr

    target, drafter = specdec.load_model(paths["target"]), specdec.load_model(paths["drafter"])
    ids = tokenizer("def add(a, b):").input_ids
    out, _ = run("--json")
    # the drafter in the form the CLI's --drafter-dtype auto picks for it (sampled draws depend on q's form)
    api = specdec.speculative_generate(target, specdec.drafter_in(drafter), ids, max_new_tokens=16, seed=3)
    assert out["tokens"] == api.tokens
    assert (out["temperature"], out["top_k"], out["top_p"]) == (1.0, 20, 1.0)
    assert out["generation"]["sources"] == {"temperature": TRANSFORMERS_DEFAULT, "top_k": GENERATION_CONFIG,
                                            "top_p": TRANSFORMERS_DEFAULT, "do_sample": GENERATION_CONFIG}
    assert out["generation"]["processors"] == ["RepetitionPenaltyLogitsProcessor (repetition_penalty)"]
    _, stderr = run("--ignore-generation-config")
    assert "| greedy; generation config ignored" in stderr
