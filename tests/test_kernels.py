"""specdec's float32 linear kernels (specdec.kernels): the same products as ``F.linear``, only while specdec decodes.

Checked against float64 products and against the stock forward: every row count (each kernel: the padded
two-column product for 1-2 rows, oneDNN's prepacked linear for more), biases, batched inputs; the stock
``F.linear`` outside ``active()``, bit for bit, and where gradients are needed; a deep copy computes with
its own weights; greedy decoding with the kernels forced on equals ``generate`` (several architectures,
speculative and plain, ragged batches); ``SPECDEC_LINEAR`` off installs nothing, a bad value is refused.
"""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_greedy, build_tiny, hf_greedy, truncated_copy

import specdec
from specdec import kernels, native_build

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not kernels.available(), reason="this torch has no oneDNN linear")]


@pytest.fixture(autouse=True)
def _no_earlier_plans(monkeypatch, tmp_path):
    """Each test probes for itself (auto's plans are kept per process by the layers' shapes, and per machine in a
    file of the cache folder)."""
    monkeypatch.setattr(kernels, "_PLANS", {})
    monkeypatch.setattr(kernels, "plans_path", lambda: tmp_path / "kernels" / kernels.PLANS_FILE)


def _fresh_install(model: torch.nn.Module, monkeypatch, mode: str = "on") -> bool:
    monkeypatch.setenv(kernels.ENV, mode)
    return kernels.install(model)


def _needs(many: str) -> None:
    if many not in kernels.many_kernels():
        pytest.fail(f"no {many} kernel on this machine: the blocked one needs a C and a C++ compiler (cc, c++)")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 25, 40])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("many", kernels.MANY)
@pytest.mark.parametrize("shape", [(96, 64), (100, 37)])  # out not a multiple of the blocks' width, odd in
def test_fast_linear_computes_the_product(rows, bias, many, shape):
    _needs(many)
    torch.manual_seed(rows)
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features)
    b = torch.randn(out_features) if bias else None
    x = torch.randn(rows, in_features)
    packed = kernels._Packed(many=many)
    with torch.inference_mode():
        out = kernels.fast_linear(x, weight, b, packed)
        batched = kernels.fast_linear(x.reshape(1, rows, in_features), weight, b, packed)
        strided = kernels.fast_linear(torch.randn(in_features, rows).T.copy_(x), weight, b, packed)  # not contiguous
    reference = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert out.shape == (rows, out_features) and out.is_contiguous()
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(batched.reshape(rows, out_features), out, rtol=0, atol=0)
    torch.testing.assert_close(strided, out, rtol=0, atol=0)


def test_the_blocked_kernel_is_built_once_per_machine_and_absent_without_a_compiler(tmp_path, monkeypatch, capsys):
    """One build: the blocked kernel is the operator's (``blocked_op``), built into ``$XDG_CACHE_HOME/specdec/kernels``
    keyed by its sources, compilers and CPU (saying so in one line on stderr: a first run's pause), loaded from there
    by the next process; no other library is built beside it; without a C compiler there is no blocked kernel, and
    oneDNN's serves many rows."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_BUILT", {})
    monkeypatch.setattr(native_build, "_SAID", [])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # said at a terminal (not into a pipe or a log)
    kernel = kernels.blocked()
    _needs("blocked")
    said = capsys.readouterr().err.splitlines()
    folder = tmp_path / "specdec" / "kernels"
    assert said == [native_build.BUILDING.format(root=folder)]
    assert said[0].startswith("specdec: building specdec's CPU kernels")
    assert kernel.path.parent == folder and list(folder.iterdir()) == [kernel.path]
    assert kernel.path.name.startswith("blocked_op-")
    assert kernel.lanes in (8, 16)
    built = kernel.path.stat().st_mtime_ns
    monkeypatch.setattr(kernels, "_BUILT", {})
    monkeypatch.setattr(native_build, "_SAID", [])
    assert kernels.blocked().path == kernel.path and kernel.path.stat().st_mtime_ns == built  # loaded, not rebuilt
    assert capsys.readouterr().err == ""  # nothing built, nothing said
    monkeypatch.setattr(kernels, "_BUILT", {})
    monkeypatch.setattr(kernels, "c_compiler", lambda: None)
    assert kernels.blocked() is None and kernels.many_kernels() == ("onednn",)
    assert kernels._Packed().many == "onednn"


@pytest.mark.parametrize("many", kernels.MANY)
def test_packed_weight_follows_weight_changes(many):
    _needs(many)
    weight = torch.randn(32, 16)
    packed = kernels._Packed(many=many)
    x = torch.randn(4, 16)  # 4 rows: the prepacked kernel
    first = kernels.fast_linear(x, weight, None, packed)
    with torch.no_grad():
        weight.mul_(2)  # in place: the packed copy is stale and rebuilt
    torch.testing.assert_close(kernels.fast_linear(x, weight, None, packed), 2 * first)


def test_installed_layers_are_stock_outside_active_and_close_inside(monkeypatch):
    model = build_tiny("llama", seed=3)
    stock = copy.deepcopy(model)
    assert _fresh_install(model, monkeypatch)
    assert kernels.installed(model)
    ids = torch.randint(3, 90, (2, 7))
    with torch.inference_mode():
        expected = stock(ids).logits
        outside = model(ids).logits
        with kernels.active():
            inside = model(ids).logits
            one = model(ids[:1, :1]).logits
    torch.testing.assert_close(outside, expected, rtol=0, atol=0)  # generate, training, ...: untouched
    torch.testing.assert_close(inside, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one, expected[:1, :1], rtol=1e-5, atol=1e-5)


def test_gradients_take_the_stock_kernel(monkeypatch):
    model = build_tiny("llama", seed=4)
    stock = copy.deepcopy(model)
    _fresh_install(model, monkeypatch)
    ids = torch.randint(3, 90, (1, 5))
    with kernels.active():
        loss = model(ids).logits.sum()
    loss.backward()
    stock(ids).logits.sum().backward()
    head, stock_head = model.get_output_embeddings().weight, stock.get_output_embeddings().weight
    torch.testing.assert_close(head.grad, stock_head.grad, rtol=0, atol=0)


def test_a_deep_copy_uses_its_own_weights(monkeypatch):
    model = build_tiny("llama", seed=5)
    _fresh_install(model, monkeypatch)
    twin = copy.deepcopy(model)  # how drafter_in makes another form of a drafter
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    reference = copy.deepcopy(twin)
    ids = torch.randint(3, 90, (1, 6))
    with torch.inference_mode(), kernels.active():
        torch.testing.assert_close(twin(ids).logits, _stock(reference, ids), rtol=1e-5, atol=1e-5)
        half = copy.deepcopy(model).to(torch.bfloat16)  # another dtype: the stock kernel
        assert half(ids).logits.dtype == torch.bfloat16


def test_kernels_off_leaves_the_models_as_they_are_and_auto_installs(monkeypatch):
    """``kernels="off"`` (the API's and the session's option): no handle made by the call installs anything on the
    target or the drafter (no forward set, nothing decided), and greedy output is still ``generate``'s; "auto" (the
    default) installs as ``SPECDEC_LINEAR`` says, on both; the handles themselves take the flag; another value is
    refused in one line."""
    monkeypatch.setenv(kernels.ENV, "on")
    target = build_tiny("llama", seed=12, hidden=64)
    drafter = truncated_copy(target, 1)
    prompt = [5, 17, 33, 8, 41, 9, 12]
    result = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=16, gamma=3, stop_token_ids=[],
                                          kernels="off")
    assert_same_greedy(target, prompt, result.tokens, hf_greedy(target, prompt, 16, []))
    plain = specdec.autoregressive_generate(target, prompt, max_new_tokens=4, stop_token_ids=[], kernels="off")
    assert plain.tokens == result.tokens[:4]
    for model in (target, drafter):
        assert model not in kernels._DECIDED and not any(kernels._ours(m) for m in model.modules())
    specdec.target.ModelTarget(target, kernels=False)
    specdec.drafters.ModelDrafter(drafter, kernels=False)
    assert target not in kernels._DECIDED and drafter not in kernels._DECIDED
    with pytest.raises(ValueError, match="^kernels must be one of auto, off, got 'on'"):
        specdec.speculative_generate(target, drafter, prompt, max_new_tokens=4, kernels="on")
    result = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=16, gamma=3, stop_token_ids=[])
    assert kernels.installed(target) and kernels.installed(drafter)
    assert_same_greedy(target, prompt, result.tokens, hf_greedy(target, prompt, 16, []))


def _stock(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``model``'s logits with the stock kernel (outside ``active``)."""
    depth = getattr(kernels._ACTIVE, "depth", 0)
    kernels._ACTIVE.depth = 0
    try:
        return model(ids).logits
    finally:
        kernels._ACTIVE.depth = depth


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
@pytest.mark.parametrize("drafting", ["agree", "ngram", "plain"])
def test_greedy_with_the_kernels_equals_generate(arch, drafting, monkeypatch):
    target = build_tiny(arch, seed=11, hidden=64)
    drafter = truncated_copy(target, 1)
    _fresh_install(target, monkeypatch)
    assert kernels.installed(target)
    prompts = [[5, 17, 33, 8, 41, 9, 12], [7, 3, 60], [44, 45, 46, 47, 44, 45, 46, 47, 44]]
    if drafting == "plain":
        results = specdec.autoregressive_generate(target, prompts, max_new_tokens=24, stop_token_ids=[],
                                                  batch_size=2)
    else:
        results = specdec.speculative_generate(target, "ngram" if drafting == "ngram" else drafter, prompts,
                                               max_new_tokens=24, gamma=4, stop_token_ids=[], batch_size=2)
    for prompt, result in zip(prompts, results):
        assert_same_greedy(target, prompt, result.tokens, hf_greedy(target, prompt, 24, []))


def test_off_installs_nothing(monkeypatch):
    model = build_tiny("llama", seed=6)
    assert not _fresh_install(model, monkeypatch, "off")
    assert not kernels.installed(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_other_dtypes_are_left_alone(monkeypatch):
    model = build_tiny("llama", seed=6).to(torch.bfloat16)
    assert not _fresh_install(model, monkeypatch, "on")
    assert not any("forward" in vars(m) for m in model.modules())


def test_auto_decides_by_a_probe(monkeypatch):
    model = build_tiny("llama", seed=8, hidden=64)
    decided = _fresh_install(model, monkeypatch, "auto")  # either way, by this machine's timings
    assert decided == kernels.installed(model)
    assert decided == any("forward" in vars(m) for m in model.modules())


def test_the_probe_reads_the_weights_from_memory_before_every_timed_pass(monkeypatch):
    """auto's probe times passes as decoding runs them, the weights out of the caches (each pass after a read
    of a buffer larger than the last-level cache), not warm from the pass before."""
    model = build_tiny("llama", seed=10, hidden=64)
    layers = {m: kernels._Packed() for m in model.modules() if kernels._eligible(m)}
    events: list[str] = []
    evict = kernels.evictor()
    monkeypatch.setattr(kernels, "evictor", lambda: lambda: events.append("evict") or evict())
    real_pass = kernels._pass_time
    monkeypatch.setattr(kernels, "_pass_time", lambda *a: events.append("pass") or real_pass(*a))
    kernels.pays(layers)
    weight_bytes = sum(m.weight.numel() * 4 for m in layers)
    passes = (1 + len(kernels.many_kernels(weight_bytes))) * (kernels.PROBE_REPEATS + 1) * 2  # W @ x.T, each of many
    assert events == ["evict", "pass"] * passes


@pytest.mark.parametrize("few_pays", [False, True])
@pytest.mark.parametrize("fastest", kernels.MANY)
def test_auto_chooses_the_kernel_of_few_rows_and_of_many_apart(few_pays, fastest, monkeypatch):
    """A CPU where ``W @ x.T`` loses at one row and a kernel of many rows wins at five (an Intel Xeon of this project:
    2.3x torch's time at one row; at five, oneDNN's prepacked kernel 0.75x and the blocked one 0.6x) takes torch's
    kernel for 1-2 rows and the fastest of many for more; the probe's timings are faked here, each way, and the
    layers follow the plan."""
    _needs(fastest)
    monkeypatch.setattr(kernels, "STREAMED_BYTES", 0)  # the tiny model offered the blocked kernel as a large one is
    def fake_pass(layers, inputs, kernel):
        rows = next(iter(inputs.values())).shape[0]
        if kernel is None:
            return 1.0
        if rows == 1:
            return 0.5 if few_pays else 2.3
        return 0.6 if kernel == fastest else 0.75
    monkeypatch.setattr(kernels, "_pass_time", fake_pass)
    model = build_tiny("llama", seed=12, hidden=64)
    stock = copy.deepcopy(model)
    assert _fresh_install(model, monkeypatch, "auto")
    layers = [m for m in model.modules() if kernels._ours(m)]
    assert layers and all((m._specdec_packed.few, m._specdec_packed.many) == (few_pays, fastest) for m in layers)
    blocked = fastest == "blocked"  # the blocked kernel serves every row count
                                    # (it reads its copy once whatever the rows)
    assert kernels.describe(model) == ("specdec blocked, every row count" if blocked else
                                       f"1-2 rows {'W @ x.T' if few_pays else 'torch'}, 3+ rows "
                                       f"{kernels.NAMES[fastest]}")
    calls: list[int] = []
    real = kernels._Packed.__call__
    monkeypatch.setattr(kernels._Packed, "__call__", lambda self, rows, *a: calls.append(len(rows)) or real(self, rows,
                                                                                                            *a))
    ids = torch.randint(3, 90, (1, 5))
    with torch.inference_mode(), kernels.active():
        one, five = model(ids[:, :1]).logits, model(ids).logits
    assert set(calls) == ({1, 5} if blocked else {5})  # else only the five-row forward took the kernel of many rows
    with torch.inference_mode():
        stock_one, stock_five = stock(ids[:, :1]).logits, stock(ids).logits
    if few_pays or blocked:
        torch.testing.assert_close(one, stock_one, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(one, stock_one, rtol=0, atol=0)  # torch's own kernel: bit for bit
    torch.testing.assert_close(five, stock_five, rtol=1e-5, atol=1e-5)


def test_the_blocked_kernel_is_offered_only_to_models_that_stream_their_weights(monkeypatch):
    """A model whose linear weights stay in the CPU's caches between steps (below ``STREAMED_BYTES``) is not offered
    the blocked kernel: the probe times only oneDNN's for many rows; a larger one is offered both."""
    _needs("blocked")
    timed: set[str | None] = set()
    monkeypatch.setattr(kernels, "_pass_time", lambda layers, inputs, kernel: timed.add(kernel) or (0.5 if kernel
                                                                                                    else 1.0))
    model = build_tiny("llama", seed=17, hidden=64)
    assert _fresh_install(model, monkeypatch, "auto")
    assert timed == {None, "few", "onednn"} and kernels.describe(model) == "1-2 rows W @ x.T, 3+ rows oneDNN prepacked"
    monkeypatch.setattr(kernels, "STREAMED_BYTES", 1)
    timed.clear()
    large = build_tiny("llama", seed=18, hidden=96)
    assert _fresh_install(large, monkeypatch, "auto")
    assert timed == {None, "few", "onednn", "blocked"}


def test_a_model_of_the_same_shapes_is_probed_once(monkeypatch):
    """A drafter named in every ``speculative_generate`` call is loaded again each time: its probe (0.4-0.7 s with
    the eviction reads on an Intel Xeon here) is not paid again for the same layers on the same machine."""
    probes: list[int] = []
    monkeypatch.setattr(kernels, "pays", lambda layers: probes.append(len(layers)) or (False, "onednn"))
    first, again = build_tiny("llama", seed=14, hidden=64), build_tiny("llama", seed=15, hidden=64)
    assert _fresh_install(first, monkeypatch, "auto") and _fresh_install(again, monkeypatch, "auto")
    assert len(probes) == 1 and kernels.describe(again) == "1-2 rows torch, 3+ rows oneDNN prepacked"
    assert _fresh_install(build_tiny("llama", seed=16, hidden=96), monkeypatch, "auto")  # other shapes: probed
    assert len(probes) == 2


def test_a_plan_is_kept_for_the_next_process(monkeypatch):
    """A server's or a bench's every process would probe again, and a probe timed beside other work could flip a
    choice between near-even kernels (each flip of a compiled model's kernels traces its graphs again): the plan is
    kept in the cache folder, and a later process with the same layers and threads takes it without a probe. A file
    that is not JSON, or a kept plan naming a kernel this machine no longer offers, is probed again and rewritten."""
    probes: list[int] = []
    monkeypatch.setattr(kernels, "pays", lambda layers: probes.append(len(layers)) or (True, "onednn"))
    def next_process() -> torch.nn.Module:
        monkeypatch.setattr(kernels, "_PLANS", {})
        model = build_tiny("llama", seed=19, hidden=64)
        assert _fresh_install(model, monkeypatch, "auto")
        return model

    assert kernels.describe(next_process()) == "1-2 rows W @ x.T, 3+ rows oneDNN prepacked" and len(probes) == 1
    kept = json.loads(kernels.plans_path().read_text())
    assert list(kept.values()) == [[True, "onednn"]]
    assert kernels.describe(next_process()) == "1-2 rows W @ x.T, 3+ rows oneDNN prepacked" and len(probes) == 1
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        next_process()  # other threads: another plan, probed
    finally:
        torch.set_num_threads(previous)
    assert len(probes) == 2 and len(json.loads(kernels.plans_path().read_text())) == 2
    kernels.plans_path().write_text("{not json")
    next_process()
    assert len(probes) == 3 and list(json.loads(kernels.plans_path().read_text()).values()) == [[True, "onednn"]]
    key = next(iter(json.loads(kernels.plans_path().read_text())))
    kernels.plans_path().write_text(json.dumps({key: [True, "a kernel of another machine"]}))
    next_process()
    assert len(probes) == 4 and json.loads(kernels.plans_path().read_text()) == {key: [True, "onednn"]}


def test_auto_installs_nothing_where_neither_kernel_pays(monkeypatch):
    monkeypatch.setattr(kernels, "_pass_time", lambda layers, inputs, kernel: 1.2 if kernel else 1.0)
    model = build_tiny("llama", seed=13, hidden=64)
    assert not _fresh_install(model, monkeypatch, "auto")
    assert kernels.describe(model) == "torch"
    assert not any("forward" in vars(m) for m in model.modules())


def test_the_eviction_buffer_outgrows_the_last_level_cache(tmp_path, monkeypatch):
    for index, size in enumerate(("32K", "1024K", "96M", "bad")):  # L1, L2, L3 (as Linux writes them), a broken file
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    monkeypatch.setattr(kernels, "_CACHE_SIZES", str(tmp_path))
    assert kernels.last_level_cache_bytes() == 96 << 20
    sizes = []
    monkeypatch.setattr(kernels.torch, "ones", lambda n: sizes.append(n) or torch.zeros(1))
    kernels.evictor()
    assert sizes == [2 * (96 << 20) // 4]  # float32 elements: twice the cache
    monkeypatch.setattr(kernels, "_CACHE_SIZES", str(tmp_path / "absent"))
    assert kernels.last_level_cache_bytes() == 0
    kernels.evictor()
    assert sizes[-1] == kernels.EVICT_MIN_BYTES // 4
    monkeypatch.setattr(kernels, "last_level_cache_bytes", lambda: 480 << 20)  # a VM's view of its host's cache
    kernels.evictor()
    assert sizes[-1] == kernels.EVICT_MAX_BYTES // 4


def test_a_bad_mode_is_refused(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "fast")
    with pytest.raises(ValueError, match="SPECDEC_LINEAR='fast'.*auto, on, off"):
        kernels.install(build_tiny("llama", seed=9))


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 13, 20])
@pytest.mark.parametrize("bias", [False, True])
def test_the_blocked_operator_computes_the_product(rows, bias):
    """``specdec::blocked_linear`` (the blocked kernel as a torch operator, which a compiled step calls): the product
    of any number of rows, an odd width and out not a multiple of the blocks'; a weight in another layout is refused
    by name, not read out of bounds."""
    assert kernels.blocked_op(), "the blocked operator did not build: it needs a C and a C++ compiler (cc, c++)"
    weight, x = torch.randn(100, 37), torch.randn(rows, 37)
    b = torch.randn(100) if bias else None
    packed = kernels.block_weight(weight, kernels.blocked().lanes)
    out = torch.ops.specdec.blocked_linear(x, packed, b, 100)
    torch.testing.assert_close(out.double(), F.linear(x.double(), weight.double(), None if b is None else b.double()),
                               rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="not laid out for this kernel"):
        torch.ops.specdec.blocked_linear(x, weight, b, 100)


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 13, 20, 40])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [96, 100])  # 96: whole pairs of blocks; 100: an odd last block, part empty
def test_a_bfloat16_weight_is_copied_at_half_the_bytes_and_multiplied_as_the_float32_copy(rows, bias, out_features):
    """A float32 weight whose every value is a bfloat16 number (a model stored in bfloat16) gets the blocked kernel's
    copy in bfloat16 pairs (``kernels.blocked_copy``): half the bytes, and through the operator and the eager
    kernel the float32 copy's products, bit for bit where the blocks pair up, within float32 rounding of the exact
    product everywhere; a weight that is not all bfloat16 numbers keeps the float32 copy."""
    assert kernels.blocked_op(), "the blocked operator did not build: it needs a C and a C++ compiler (cc, c++)"
    lanes = kernels.blocked().lanes
    torch.manual_seed(rows)
    weight = torch.randn(out_features, 37).to(torch.bfloat16).float()
    x, b = torch.randn(rows, 37), (torch.randn(out_features) if bias else None)
    assert kernels.bf16_exact(weight) and not kernels.bf16_exact(weight + 1e-3)
    full, half = kernels.block_weight(weight, lanes), kernels.blocked_copy(weight, lanes)
    assert half.dtype == torch.bfloat16 and half.nbytes <= full.nbytes // 2 + 37 * lanes * 2
    assert kernels.blocked_copy(weight + 1e-3, lanes).dtype == torch.float32
    reference = F.linear(x.double(), weight.double(), None if b is None else b.double())
    by_op = torch.ops.specdec.blocked_linear(x, half, b, out_features)
    eager = kernels.blocked_product(kernels.blocked(), x, half, out_features, b)
    float32 = torch.ops.specdec.blocked_linear(x, full, b, out_features)
    torch.testing.assert_close(by_op.double(), reference, rtol=1e-5, atol=1e-4)
    assert torch.equal(eager, by_op)
    paired = out_features // (2 * lanes) * 2 * lanes  # columns of whole pairs: the same arithmetic as the float32 copy
    assert paired > 0 and torch.equal(by_op[:, :paired], float32[:, :paired])


def test_the_blocked_operator_is_built_once_per_machine_and_absent_without_a_compiler(tmp_path, monkeypatch):
    """Built into ``$XDG_CACHE_HOME/specdec/kernels`` (keyed by both sources, the compilers, the CPU and torch), not
    rebuilt by the next process; without a C++ compiler there is none (and no error)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_BUILT", {})
    assert kernels.blocked_op()
    built = list((tmp_path / "specdec" / "kernels").glob("blocked_op-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(kernels, "_BUILT", {})
    assert kernels.blocked_op() and built[0].stat().st_mtime_ns == stamp
    monkeypatch.setattr(kernels, "_BUILT", {})
    monkeypatch.setattr(kernels, "cxx", lambda: None)
    assert not kernels.blocked_op()
