"""The drafter's cheaper forms (issue 28, item 4): int8 and bf16 drafters keep decoding exact.

1. ``drafter_in``: int8 replaces the linear layers by dynamically quantised ones in a copy (the
   source untouched, the same copy on a second ask), bf16 casts a copy, auto is int8 on this CPU,
   and a form the machine cannot give is refused with the fix.
2. Greedy: the shipped pair with an int8 drafter (the model alone and behind prompt lookup) and tiny
   pairs of two architectures, single and ragged batches, give the target's own ``generate`` output
   token for token, while the int8 drafter's logits do differ from the float32 one's.
3. Sampling: with an int8 toy drafter, 2,500 generations of 2 tokens match the exact distribution of sampling
   from the target (chi-square, as tests/test_core_sampling.py).
4. The bench runs spec and spec-lookup once per extra form, each with its own forwards and c.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_tiny, build_toy, hf_greedy
from test_core_sampling import SETTINGS, chi2_pvalue, exact_sequence_probs
from tiny_models import save_tiny_pair

import specdec
from specdec.bench import BenchConfig, build_report, run_benchmark
from specdec.config import DrafterConfig, ModelConfig
from specdec.drafters import make_drafter
from specdec.drafters.model import drafter_form, drafter_in, int8_available, is_int8
from specdec.target import make_target

needs_int8 = pytest.mark.skipif(not int8_available(), reason="this torch build has no int8 CPU kernels")
CODE = ["def parse_args(argv):\n    ", "class Stack:\n    def push(self, item):\n        ", "import os\n\n\ndef walk("]


pytestmark = pytest.mark.usefixtures("one_thread")


@needs_int8
def test_int8_quantises_a_copy_and_keeps_it() -> None:
    model = build_tiny("llama", seed=3, layers=1)
    int8 = drafter_in(model, "int8")
    assert is_int8(int8) and not is_int8(model)
    assert all(type(m) is torch.nn.Linear for m in model.modules() if "Linear" in type(m).__name__)
    assert drafter_in(model, "int8") is int8  # converted once
    assert drafter_in(int8, "int8") is int8 and drafter_in(int8, "auto") is int8
    assert drafter_form(model, "auto") == "int8"  # this CPU runs int8 kernels: auto is int8 here...
    assert drafter_form(model, "auto", lookup=True) == "float32"  # ...but not behind prompt lookup (measured)
    target = make_target(build_tiny("llama", seed=0))
    alone = make_drafter(DrafterConfig("tiny"), target, loader=lambda _: model)
    behind = make_drafter(DrafterConfig("lookup+tiny"), target, loader=lambda _: model)
    assert alone.model is int8 and behind.fallback.model is model  # what the CLI's default does
    assert drafter_in(model, "float32") is model  # already float32
    bf16 = drafter_in(model, "bf16")
    assert bf16.dtype == torch.bfloat16 and model.dtype == torch.float32
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.inference_mode():
        exact, cheap = model(ids).logits, int8(ids).logits
    assert cheap.dtype == torch.float32 and cheap.shape == exact.shape
    assert not torch.equal(cheap, exact)  # it really runs other numbers...
    assert ((cheap - exact).norm() / exact.norm()).item() < 0.1  # ...close to the float ones


@needs_int8
def test_auto_keeps_a_compiled_drafter_in_float32() -> None:
    """An int8 copy cannot be compiled (it would run eagerly, slower than the compiled float32 step): once
    ``--compile on`` compiled the drafter, auto keeps it as it is, and the drafter built drafts with it."""
    from specdec.compiled import compiled_for, prepare

    model = build_tiny("llama", seed=4, layers=1)
    assert drafter_form(model, "auto") == "int8"
    assert prepare(model, "on", tokens=(1,)).compiled and compiled_for(model) is not None
    assert drafter_form(model, "auto") == "float32"
    alone = make_drafter(DrafterConfig("tiny"), make_target(build_tiny("llama", seed=0)), loader=lambda _: model)
    assert alone.model is model
    assert drafter_form(model, "int8") == "int8"  # asked for by name: int8 all the same


def test_forms_refused_with_the_fix() -> None:
    model = build_tiny("llama", seed=3, layers=1)
    with pytest.raises(ValueError, match="drafter dtype must be one of auto, float32, bf16, int8, got 'fp8'"):
        drafter_in(model, "fp8")
    with pytest.raises(ValueError, match="drafter dtype must be one of"):
        DrafterConfig("code-drafter", dtype="int4")
    with pytest.raises(ValueError, match="drafter dtype must be one of"):
        ModelConfig(drafter_dtype="half").drafter_config  # noqa: B018
    if int8_available():
        with pytest.raises(ValueError, match="cannot run in float32: load it again"):
            drafter_in(drafter_in(model, "int8"), "float32")


def test_command_line_refuses_a_bad_drafter_dtype() -> None:
    out = subprocess.run([sys.executable, "-m", "specdec", "generate", "x", "--drafter-dtype", "int4"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "drafter dtype must be one of auto, float32, bf16, int8, got 'int4'" in out.stderr


@needs_int8
@pytest.mark.parametrize("name", ["code-drafter", "lookup+code-drafter"])
def test_shipped_pair_greedy_with_an_int8_drafter_equals_generate(name: str) -> None:
    target = specdec.load_model("code-target")
    tokenizer = specdec.load_tokenizer("code-target")
    prompts = [tokenizer(p).input_ids for p in CODE]
    handle = make_target(target)
    drafter = make_drafter(DrafterConfig(name, dtype="int8"), handle, tokenizer)
    inner = getattr(drafter, "fallback", drafter)
    assert is_int8(inner.model)
    stop = [target.generation_config.eos_token_id]
    results = specdec.speculative_generate(handle, drafter, prompts, max_new_tokens=32, gamma=4, temperature=0,
                                           stop_token_ids=stop, batch_size=3)
    for prompt, result in zip(prompts, results):
        assert result.tokens == hf_greedy(target, prompt, 32, stop)
    assert sum(r.stats.accepted for r in results) > 0


@needs_int8
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tiny_pairs_greedy_with_an_int8_drafter_equals_generate(arch: str) -> None:
    target = build_tiny(arch, seed=0)
    drafter = drafter_in(build_tiny(arch, seed=0, layers=1), "int8")
    prompts = [[1, 5, 6, 1, 5], [7, 8], [1, 9, 9, 9, 4, 3, 2, 5]]  # ragged rows
    for batch in (1, 3):
        results = specdec.speculative_generate(target, drafter, prompts, max_new_tokens=20, gamma=3,
                                               temperature=0, stop_token_ids=[], batch_size=batch)
        assert [r.tokens for r in results] == [hf_greedy(target, p, 20, []) for p in prompts]


@needs_int8
def test_sampling_with_an_int8_drafter_matches_target_sampling() -> None:
    setting = SETTINGS[1]
    target = build_toy(vocab_size=8, seed=0, scale=0.8)
    drafter = drafter_in(build_toy(vocab_size=8, seed=1, scale=0.8), "int8")
    assert is_int8(drafter)
    prompt, n_new = [3, 4, 3, 5, 3], 2
    exact = exact_sequence_probs(target, prompt, n_new, setting)
    index = {seq: i for i, seq in enumerate(itertools.product(range(8), repeat=n_new))}
    counts = np.zeros(len(index), dtype=np.int64)
    torch.manual_seed(4321)
    accepted = drafted = 0
    for _ in range(2_500):
        res = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=n_new, gamma=2,
                                           temperature=setting[0], top_k=setting[1], top_p=setting[2],
                                           stop_token_ids=[])
        counts[index[tuple(res.tokens)]] += 1
        accepted += res.stats.accepted
        drafted += res.stats.drafted
    assert 0 < accepted < drafted  # drafts were accepted and rejected
    assert chi2_pvalue(counts, np.array([exact.get(s, 0.0) for s in index])) > 1e-3


@needs_int8
def test_bench_runs_each_extra_form_with_its_own_figures(tmp_path: Path) -> None:
    tiny = save_tiny_pair(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "def add(a, b):"}\n{"id": "b", "prompt": "for i in range(10):"}\n')
    config = BenchConfig(target=str(tiny.target), drafter=str(tiny.drafter), prompts=str(prompts), num_prompts=2,
                         max_new_tokens=8, repeats=1, warmup=0, device="cpu", progress=False, gamma=(3,),
                         methods=("plain-hf", "spec", "spec-lookup"))
    report = build_report(run_benchmark(replace(config, drafter_dtype=("float32", "int8"))))
    rows = {r.method: r for r in report.rows}
    assert set(rows) == {"plain-hf", "spec", "spec-lookup", "spec:int8", "spec-lookup:int8"}
    assert all(r.greedy_equal == r.greedy_total == 2 for r in rows.values())
    assert rows["spec"].cost_ratio is not None and rows["spec:int8"].cost_ratio is not None
    assert report.run.compared_step_s["drafter:int8"] > 0
    by_method = {b.runner.name: b for b in report.run.blocks}
    assert all(r.drafter_calls > 0 for name in ("spec", "spec:int8") for r in by_method[name].records)
    assert "drafter:int8" in report.run.environment.compared
    with pytest.raises(ValueError, match="drafter_dtype must be one or more of"):
        replace(config, drafter_dtype=("int4",))
