"""Quantized targets and drafters (issue 71, the eager path): torchao int8 / int4 weight-only models.

A quantized model is a target like any other: specdec's greedy output equals that quantized model's own
``generate``, its sampling keeps that model's distribution (chi-square against enumeration, as
tests/test_core_sampling.py), with quantized targets and quantized drafters. The models are tiny ones of the fixtures,
quantized the way users get them (``specdec quantize`` writes a folder; ``from_pretrained`` loads it back), and the
shipped code-drafter through the CLI. The quantized linears take specdec's int8 / int4 kernel inside the engine
(``specdec.qlinear``; its own tests: tests/test_quantized_kernels.py). Bad input to
``specdec quantize`` is one line, status 2, nothing written. torchao comes with the dev extra (pyproject: ``quant``).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torchao  # noqa: F401  (the dev extra installs it: these tests never skip)
from conftest import assert_same_greedy, build_tiny, hf_greedy, truncated_copy
from test_core_sampling import P_MIN, chi2_pvalue, exact_sequence_probs
from transformers import AutoModelForCausalLM

import specdec
from specdec import kernels, quantized
from specdec.cli import main

FORMS = {"int8": ("int8", None), "int4": ("int4", 32)}  # the tiny models' width is 32: groups of 32
PROMPTS = [[5, 17, 33, 5, 17], [3, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7] * 6]


def _save(model, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _quantized(tmp: Path, source: Path, form: str):
    to, group = FORMS[form]
    out = tmp / f"{source.name}-{form}"
    quantized.quantize(source, to, out, group, prompts=2, tokens=4)
    return AutoModelForCausalLM.from_pretrained(out).eval(), out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The float tiny Llama target and its truncated-copy drafter saved, and their int8 and int4 copies loaded."""
    tmp = tmp_path_factory.mktemp("quantized")
    target = build_tiny("llama", seed=0)
    src = {"target": _save(target, tmp / "target"), "drafter": _save(truncated_copy(target, 1), tmp / "drafter")}
    loaded = {(role, form): _quantized(tmp, path, form) for role, path in src.items() for form in FORMS}
    return src, loaded


@pytest.mark.parametrize("form", FORMS)
def test_the_folder_loads_back_quantized_as_safetensors_with_its_card(folders, form):
    _, loaded = folders
    model, out = loaded["target", form]
    expected = {"int8": "Int8Tensor", "int4": "IntxUnpackedToInt8Tensor"}[form]
    assert quantized.describe(model) == f"torchao ({expected})"
    assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == expected
    assert type(model.lm_head.weight) is torch.nn.Parameter  # the head kept by default
    files = {p.name for p in out.iterdir()}
    assert "model.safetensors" in files and not any(f.endswith((".bin", ".pt", ".pth", ".pkl")) for f in files)
    card = (out / "README.md").read_text()
    figures = json.loads(card.split("```json\n")[1].split("```")[0])
    assert figures["bytes"] == (out / "model.safetensors").stat().st_size and figures["to"] == form
    agree = figures["agreement"]
    assert (agree["prompts"], agree["tokens"]) == (2, 4) and 0 <= agree["equal_prompts"] <= 2
    assert f"{agree['equal_prompts']} of 2 prompts" in card
    assert quantized.describe(build_tiny("llama", seed=0)) is None
    assert quantized.compile_refusal(build_tiny("llama", seed=0)) is None
    assert f"quantized models yet (torchao ({expected})): use --compile off" in quantized.compile_refusal(model)


def test_quantized_weights_are_smaller_and_dequantise_close_to_the_float_ones(folders):
    src, loaded = folders
    float_w = AutoModelForCausalLM.from_pretrained(src["target"]).model.layers[0].mlp.up_proj.weight
    for form in FORMS:
        w = loaded["target", form][0].model.layers[0].mlp.up_proj.weight
        assert w.qdata.dtype == torch.int8 and w.qdata.shape == float_w.shape
        error = (w.dequantize().float() - float_w).abs().max() / float_w.abs().max()
        assert 0 < error < {"int8": 0.01, "int4": 0.15}[form]  # quantized, and to the nearest level


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("which", ["float drafter", "quantized drafter", "ngram", "lookup+quantized", "plain"])
def test_greedy_equals_the_quantized_models_generate(folders, form, which):
    src, loaded = folders
    target = loaded["target", form][0]
    q_drafter = loaded["drafter", form][0]
    drafter = {"float drafter": AutoModelForCausalLM.from_pretrained(src["drafter"]).eval(),
               "quantized drafter": q_drafter, "ngram": "ngram", "lookup+quantized": specdec.LookupDrafter(q_drafter),
               "plain": None}[which]
    for prompt in PROMPTS:
        reference = hf_greedy(target, prompt, 24, [])
        if drafter is None:
            res = specdec.autoregressive_generate(target, prompt, max_new_tokens=24, stop_token_ids=[])
        else:
            res = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=24, gamma=3, stop_token_ids=[])
        assert_same_greedy(target, prompt, res.tokens, reference)
    if drafter is not None:  # a ragged batch: every row its own generate
        results = specdec.speculative_generate(target, drafter, PROMPTS, max_new_tokens=16, gamma=4,
                                               stop_token_ids=[], batch_size=4)
        for prompt, res in zip(PROMPTS, results):
            assert_same_greedy(target, prompt, res.tokens, hf_greedy(target, prompt, 16, []))


def test_a_float_target_with_a_quantized_drafter_stays_exact(folders):
    src, loaded = folders
    target = AutoModelForCausalLM.from_pretrained(src["target"]).eval()
    for form in FORMS:
        for prompt in PROMPTS:
            res = specdec.speculative_generate(target, loaded["drafter", form][0], prompt, max_new_tokens=24,
                                               gamma=4, stop_token_ids=[])
            assert_same_greedy(target, prompt, res.tokens, hf_greedy(target, prompt, 24, []))


def test_the_quantized_linears_take_specdecs_kernel_else_the_slow_form_is_said_once(folders, monkeypatch):
    _, loaded = folders
    model = loaded["target", "int8"][0]
    monkeypatch.setenv("SPECDEC_LINEAR", "on")  # every eligible layer takes the fast kernels
    monkeypatch.setattr(quantized, "_NOTED", set())
    fresh = AutoModelForCausalLM.from_pretrained(loaded["target", "int8"][1]).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernels.install(fresh)
    assert not [w for w in caught if "no fast" in str(w.message)]  # specdec.qlinear's kernel serves them
    for name, module in fresh.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert "forward" in vars(module), name  # the quantized layers (qlinear) and the float head (kernels)
    monkeypatch.setenv("SPECDEC_LINEAR", "off")  # no kernels: torchao's forward, said once a process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernels.install(AutoModelForCausalLM.from_pretrained(loaded["target", "int8"][1]).eval())
        kernels.install(AutoModelForCausalLM.from_pretrained(loaded["target", "int8"][1]).eval())
    lines = [str(w.message) for w in caught if "no fast" in str(w.message)]
    assert lines == [quantized.slow_line(model)] and "torchao (Int8Tensor)" in lines[0]
    assert quantized.slow_line(build_tiny("llama", seed=0)) is None


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["quantized", "ngram"])
def test_sampling_keeps_the_quantized_targets_distribution(tmp_path, drafter_kind):
    setting = (1.0, 0, 1.0)
    src = _save(build_tiny("llama", vocab_size=8, seed=3, init_range=0.5), tmp_path / "t")
    target, _ = _quantized(tmp_path, src, "int4")
    drafter = _quantized(tmp_path, _save(build_tiny("llama", vocab_size=8, seed=4, init_range=0.5), tmp_path / "d"),
                         "int8")[0] if drafter_kind == "quantized" else "ngram"
    prompt, n_new = [3, 4, 3, 5, 3], 2
    exact = exact_sequence_probs(target, prompt, n_new, setting)
    index = {seq: i for i, seq in enumerate(itertools.product(range(8), repeat=n_new))}
    counts = np.zeros(len(index), dtype=np.int64)
    torch.manual_seed(99)
    accepted = drafted = 0
    for _ in range(2000):
        res = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=n_new, gamma=2,
                                           temperature=1.0, stop_token_ids=[])
        counts[index[tuple(res.tokens)]] += 1
        accepted, drafted = accepted + res.stats.accepted, drafted + res.stats.drafted
    assert 0 < drafted and accepted < drafted
    assert chi2_pvalue(counts, np.array([exact.get(s, 0.0) for s in index])) > P_MIN


def test_the_cli_quantizes_a_shipped_drafter_that_specdec_decodes_as_its_generate(tmp_path, capsys):
    out = tmp_path / "code-drafter-int8"
    assert main(["quantize", "code-drafter", "--to", "int8", "--out", str(out), "--prompts", "2",
                 "--tokens", "8"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert "held-out code-completion prompts" in (out / "README.md").read_text()
    model, tokenizer = specdec.load_model(out), specdec.load_tokenizer(out)  # as specdec loads a folder
    assert quantized.describe(model) == "torchao (Int8Tensor)"
    ids = tokenizer("def parse_args(argv):").input_ids
    config = model.generation_config
    reference = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, generation_config=config,
                               attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    ours = specdec.speculative_generate(model, "ngram", ids, max_new_tokens=32)  # its generation config's stops
    assert ours.tokens == reference[:len(ours.tokens)] and len(ours.tokens) >= min(len(reference), 1)
    if ours.stop_reason == "max_new_tokens":
        assert ours.tokens == reference


def _status(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()  # what the test's own saving printed
    status = main(argv)
    return status, capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--to", "int4", "--group-size", "64"], "does not divide the model's width 32"),
    (["--to", "int8", "--group-size", "32"], "--group-size applies to --to int4"),
    (["--to", "int8", "--prompts", "0"], "--prompts and --tokens must be at least 1"),
    (["--to", "int8", "--quantize-embeddings"], "--quantize-embeddings needs --quantize-head"),
])
def test_bad_input_is_one_line_status_2_nothing_written(folders, tmp_path, capsys, flags, says):
    src, _ = folders
    model = src["target"]
    if "--quantize-embeddings" in flags:  # an untied head: transformers' quantizer takes both embeddings or neither
        untied = build_tiny("llama", seed=0)
        untied.config.tie_word_embeddings = False
        untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
        model = _save(untied, tmp_path / "untied")
        assert AutoModelForCausalLM.from_pretrained(model).lm_head.weight is not None
    out = tmp_path / "out"
    status, err = _status(["quantize", str(model), *flags, "--out", str(out)], capsys)
    assert status == 2 and err.count("\n") == 1 and says in err, err
    assert not out.exists()


def test_a_format_whose_backend_is_missing_is_one_line_naming_the_package(folders, monkeypatch):
    _, loaded = folders
    folder = loaded["target", "int8"][1]
    assert quantized.describe(specdec.load_model(folder)) == "torchao (Int8Tensor)"
    monkeypatch.setattr(quantized, "_installed", lambda package: package != "torchao")
    with pytest.raises(ValueError, match=r"quantized with torchao, which is not installed: pip install torchao$"):
        specdec.load_model(folder)


def test_the_head_by_choice_untied_quantized_and_tied_given_its_own_copy(folders, tmp_path, capsys):
    src, _ = folders  # the tiny Llama's head is its own matrix
    out = tmp_path / "head"
    assert main(["quantize", str(src["target"]), "--to", "int8", "--quantize-head", "--out", str(out),
                 "--prompts", "1", "--tokens", "4"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model.lm_head.weight).__name__ == "Int8Tensor"
    assert type(model.model.embed_tokens.weight) is torch.nn.Parameter
    for prompt in PROMPTS[:2]:
        res = specdec.speculative_generate(model, "ngram", prompt, max_new_tokens=16, stop_token_ids=[])
        assert_same_greedy(model, prompt, res.tokens, hf_greedy(model, prompt, 16, []))
    tied = tmp_path / "tied"  # code-drafter's head is its input embeddings' matrix: it gets its own copy, quantized
    assert main(["quantize", "code-drafter", "--to", "int8", "--quantize-head", "--out", str(tied),
                 "--prompts", "1", "--tokens", "4"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tied).eval()
    assert not model.config.tie_word_embeddings and "its own" in (tied / "README.md").read_text()
    assert type(model.lm_head.weight).__name__ == "Int8Tensor"
    assert type(model.model.embed_tokens.weight) is torch.nn.Parameter
    source = AutoModelForCausalLM.from_pretrained(specdec.loading.resolve_model_path("code-drafter")).eval()
    assert torch.equal(model.model.embed_tokens.weight, source.model.embed_tokens.weight.float())
    assert torch.allclose(model.lm_head.weight.dequantize(), source.lm_head.weight.float(), atol=0.02)
    res = specdec.speculative_generate(model, "ngram", PROMPTS[0], max_new_tokens=16, stop_token_ids=[])
    assert_same_greedy(model, PROMPTS[0], res.tokens, hf_greedy(model, PROMPTS[0], 16, []))


def test_the_clis_group_sizes_are_the_library_s() -> None:
    from specdec import quantize_cli

    assert quantize_cli.GROUP_SIZES == quantized.GROUP_SIZES


def test_an_already_quantized_model_or_a_used_folder_is_refused(folders, tmp_path, capsys):
    src, loaded = folders
    status, err = _status(["quantize", str(loaded["target", "int8"][1]), "--to", "int4", "--out",
                           str(tmp_path / "x")], capsys)
    assert status == 2 and "already quantized (torchao)" in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    status, err = _status(["quantize", str(src["target"]), "--to", "int8", "--out", str(used)], capsys)
    assert status == 2 and "not an empty folder" in err and [p.name for p in used.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("argv, status", [
    (["quantize", "--help"], 0),
    (["quantize", "code-target", "--to", "int3", "--out", "x"], 2),
    (["quantize", "code-target", "--to", "int4", "--group-size", "48", "--out", "x"], 2),
    (["quantize", "code-target", "--out", "x"], 2),
])
def test_quantize_help_and_flag_errors_import_no_torch(argv, status, tmp_path):
    code = ("import contextlib, io, json, sys\nfrom specdec import cli\nerr = io.StringIO()\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):\n"
            f"    try:\n        status = cli.main({argv!r})\n    except SystemExit as e:\n        status = e.code\n"
            "print(json.dumps({'status': status, 'err': err.getvalue(), 'torch': 'torch' in sys.modules}))")
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                    cwd=tmp_path, env=None).stdout)
    assert out["status"] == status and not out["torch"]
    if status:
        assert out["err"].strip().splitlines()[-1].startswith("specdec quantize: error:")


@pytest.mark.parametrize("form", FORMS)
def test_the_compiled_path_refuses_a_quantized_model_by_name_and_decodes_it_eagerly(folders, form):
    from specdec import compiled

    _, loaded = folders
    model, _ = loaded["target", form]
    reason = compiled.compile_refusal(model)
    assert reason is not None and "quantized" in reason and "torchao" in reason and "--compile off" in reason
    with pytest.warns(UserWarning, match="quantized"):
        choice = compiled.prepare(model, "on")
    assert not choice.compiled and compiled.compiled_for(model) is None


def test_a_quantized_drafter_keeps_its_form_and_refuses_another_in_one_line(folders):
    """``drafter_form`` "auto" would give a float32 CPU drafter torch's int8 dynamic quantisation; a torchao model is
    kept as loaded (quantising its quantized weights again fails inside torch), and another form asked for is
    refused by name."""
    from specdec.drafters.model import drafter_form, drafter_in

    _, loaded = folders
    model, _ = loaded["drafter", "int8"]
    form = drafter_form(model)
    assert form == "float32" and drafter_in(model, form) is model
    with pytest.raises(ValueError, match="quantized already"):
        drafter_in(model, "int8")
