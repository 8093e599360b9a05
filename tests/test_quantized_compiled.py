"""Quantized targets and drafters on the compiled path (``--compile on``, ``specdec.compiled``; issue 71).

A torchao int8 / int4 weight-only linear is traced as ``specdec::quantized_linear`` on the layer's packed copy
(``specdec.compiled.ops``), the same mechanism as a float linear's ``specdec::blocked_linear``: greedy decoding with
the compiled steps equals the quantized model's own ``generate`` (the reference: torchao's forward, outside specdec),
on tiny Llama, Qwen2 and GPT-2 shapes built from config (GPT-2's blocks are ``Conv1D``: its quantized linear is the
LM head), single prompts and a ragged batch, with prompt lookup and with a quantized model drafter; every decode
forward ran a compiled graph. The graph reads the packed bytes, not torchao's tensor: torchao's values changed under
a compiled step leave its logits as they were until the next decoding call re-packs them. The command line's
``--compile on`` and the library call it makes (``autoregressive_generate(..., compile="on")``) on folders written by
``specdec quantize``. Forms still refused: one line each. Compiling costs seconds a shape, so each model compiles one
bucket (4 rows x 4 tokens: a single prompt runs in it with dead rows, a drafter's step padded with dead tokens), and
a drafter of the target's configuration loads the target's step from the compile cache.
"""

from __future__ import annotations

import json

import pytest
import torch
import torchao  # noqa: F401  (the dev extra installs it: these tests never skip)
from conftest import assert_same_greedy, build_tiny, hf_greedy
from torchao.quantization import IntxWeightOnlyConfig, PerGroup, quantize_

import specdec
from specdec import kernels, qlinear, quantized
from specdec.compiled import compile_refusal, compiled_for, prepare
from specdec.config import NgramConfig
from specdec.drafters.ngram import NgramDrafter

pytestmark = pytest.mark.skipif(not kernels.blocked_op(), reason="specdec's operators do not build here")

GAMMA = 3
NEW = 16
ROWS = 4  # the one row bucket compiled: every forward of 1-4 rows runs it (dead rows beside a single prompt)
TOKENS = GAMMA + 1  # the one token bucket: a verification; a drafter's step of 1 or 2 tokens runs it padded
PROMPTS = [[5, 17, 33, 5, 17], [3, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48]]  # ragged: 5, 2 and 9 tokens


def _quantized(arch: str, form: str, seed: int):
    """A tiny one-layer ``arch`` model quantized to ``form``: target and drafter are two of the same configuration,
    so the drafter's compiled step is the target's, loaded from the compile cache (a compile costs seconds)."""
    model = build_tiny(arch, seed=seed, layers=1)
    quantize_(model, quantized.torchao_config(form, 32 if form == "int4" else None))  # the tiny width is 32
    return model.eval()


def _linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and qlinear.form(m.weight)]


@pytest.mark.parametrize("form", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_compiled_greedy_equals_the_quantized_models_generate(arch, form):
    target, drafter = _quantized(arch, form, 0), _quantized(arch, form, 1)
    assert compile_refusal(target) is None and compile_refusal(drafter) is None
    references = [hf_greedy(target, p, NEW, []) for p in PROMPTS]
    choice = prepare(target, "on", tokens=(TOKENS,), rows=(ROWS,))
    assert choice.compiled and "linears traced as specdec::quantized_linear" in choice.reason
    choice = prepare(drafter, "on", tokens=(TOKENS,), rows=(ROWS,))
    assert choice.compiled and "(1 from the compile cache" in choice.reason
    linears = _linears(target)
    assert linears and all(m._specdec_blocked.dtype == (torch.int8 if form == "int8" else torch.int32)
                           for m in linears)  # the packed copy, which the graph reads
    lookup = NgramDrafter(NgramConfig(min_ngram=1, num_tokens=GAMMA))
    for drafting in (lookup, drafter):
        for prompt, reference in zip(PROMPTS, references):
            ours = specdec.speculative_generate(target, drafting, prompt, gamma=GAMMA, max_new_tokens=NEW,
                                                stop_token_ids=[]).tokens
            assert_same_greedy(target, prompt, ours, reference)
        batch = specdec.speculative_generate(target, drafting, PROMPTS, gamma=GAMMA, max_new_tokens=NEW,
                                             stop_token_ids=[], batch_size=ROWS)
        for prompt, result, reference in zip(PROMPTS, batch, references):
            assert_same_greedy(target, prompt, result.tokens, reference)
    for model in (target, drafter):
        calls = compiled_for(model).calls
        assert calls["eager"] == 0 and calls["compiled"] > 0


def test_the_compiled_step_reads_the_packed_copy_and_a_new_call_re_packs_a_changed_weight():
    """torchao's int8 values zeroed under a compiled step: its logits are those of the packed copy, as before (the
    graph never reads torchao's tensor, so never dequantises it); the next decoding call re-packs the layers and
    decodes the changed model exactly."""
    model = _quantized("llama", "int8", 3)
    assert prepare(model, "on", tokens=(TOKENS,), rows=(ROWS,)).compiled
    compiled = compiled_for(model)
    shape = next(iter(compiled.shapes))
    ids = torch.randint(3, 90, (ROWS, TOKENS), generator=torch.Generator().manual_seed(0))

    def step() -> torch.Tensor:
        cache = compiled.new_cache(ROWS, "cpu")
        live = torch.zeros(ROWS, compiled.slots + 1, dtype=torch.bool)[:, :TOKENS + 1]
        live[:, :TOKENS] = True
        return compiled.run(shape, ids, live, cache)[0]

    before = step()
    with torch.no_grad():
        for m in _linears(model)[:-1]:  # every layer but the head: the model changes
            m.weight.qdata.zero_()
    assert torch.equal(step(), before)  # the packed copy, unchanged until a decoding call refreshes it
    changed = hf_greedy(model, PROMPTS[0], NEW, [])
    ours = specdec.speculative_generate(model, "ngram", PROMPTS[0], gamma=GAMMA, max_new_tokens=NEW,
                                        stop_token_ids=[]).tokens
    assert_same_greedy(model, PROMPTS[0], ours, changed)
    assert compiled.calls["eager"] == 0
    assert not any(m._specdec_blocked.any() for m in _linears(model)[:-1])  # re-packed


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny trained target (with its tokenizer) and its int8 and int4 copies written by ``specdec quantize``."""
    from tiny_models import save_tiny_pair

    tmp = tmp_path_factory.mktemp("quantized-compiled")
    pair = save_tiny_pair(tmp)
    out = {}
    for form, group in (("int8", None), ("int4", 32)):
        out["target", form] = tmp / f"target-{form}"
        quantized.quantize(pair.target, form, out["target", form], group, prompts=1, tokens=2)
    return out


@pytest.mark.parametrize("form", ["int8", "int4"])
def test_the_command_line_and_its_library_call_compile_a_quantized_target(folders, form, capsys):
    """`specdec generate --mode target --compile on` on an int8 / int4 folder prints the quantized model's own greedy
    tokens, having compiled it (said on stderr); ``autoregressive_generate(..., compile="on")``, the call the command
    line makes, gives the same tokens on the model loaded again (its step from the compile cache)."""
    from transformers import AutoModelForCausalLM

    from specdec.cli import main

    target = folders["target", form]
    argv = ["generate", "--target", str(target), "--mode", "target", "def add(a, b):", "--max-new-tokens", "12",
            "--compile", "on", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out.strip().splitlines()[-1])
    assert f"{target}: compile on:" in captured.err and "specdec::quantized_linear" in captured.err
    assert "decodes eagerly" not in captured.err
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    ids, stops = printed["prompt_ids"], [model.config.eos_token_id]
    reference = hf_greedy(model, ids, 12, stops)
    assert_same_greedy(model, ids, printed["tokens"], reference)
    ours = specdec.autoregressive_generate(model, ids, max_new_tokens=12, stop_token_ids=stops, compile="on").tokens
    assert_same_greedy(model, ids, ours, reference)
    assert compiled_for(model).loaded > 0 and compiled_for(model).calls["eager"] == 0


def test_forms_the_compiled_path_does_not_trace_are_refused_in_one_line(monkeypatch):
    """A quantized weight that specdec's operator does not take (an int4 group of 12, an embedding), or any quantized
    model where the operators are off: one line naming it; the model decodes eagerly, exactly."""
    model = build_tiny("llama", seed=0, layers=1, hidden=48)
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(12)))
    reason = compile_refusal(model)
    assert reason is not None and "\n" not in reason and "IntxUnpackedToInt8Tensor in Linear" in reason
    assert "--compile off" in reason
    with pytest.warns(UserWarning, match="int4 weight-only linears only"):
        assert not prepare(model, "on").compiled
    reference = hf_greedy(model, PROMPTS[0], 8, [])
    assert specdec.autoregressive_generate(model, PROMPTS[0], max_new_tokens=8, stop_token_ids=[]).tokens == reference
    embedded = build_tiny("llama", seed=0, layers=1)
    quantize_(embedded, quantized.torchao_config("int8", None),
              filter_fn=lambda m, _: isinstance(m, torch.nn.Embedding))
    assert "in Embedding" in compile_refusal(embedded)
    int8 = _quantized("llama", "int8", 0)
    assert compile_refusal(int8) is None
    monkeypatch.setenv("SPECDEC_LINEAR", "off")
    assert "SPECDEC_LINEAR=off" in compile_refusal(int8)
