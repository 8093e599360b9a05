"""specdec's weight-only int8 / int4 kernel (``specdec.qlinear``, ``csrc/quantized_linear.c``) and its place in the
engine.

The kernel's products against float64 products of the torchao tensor's own dequantised weight (``dequantize()``;
int8's ``qdata * scale``, which is what torchao's int8 product computes), for 1-40 rows, widths that are not a
multiple of the kernel's 16 columns, groups of 32/64/128, zero points zero (torchao's symmetric int4: a table
lookup) and not (asymmetric). The engine: greedy decoding of tiny int8 and int4 Llama targets (quantized here, as
``specdec quantize`` does on load) equals that quantized model's own ``generate``, the kernel taken (its packed
copies exist after decoding); with ``SPECDEC_LINEAR=off`` no layer takes it and the tokens are the same; outside
``kernels.active()`` an installed layer is torchao's own forward, to the bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torchao  # noqa: F401  (the dev extra installs it: these tests never skip)
from conftest import assert_same_greedy, build_tiny, hf_greedy
from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, MappingType, PerGroup, quantize_

import specdec
from specdec import kernels, qlinear, quantized

pytestmark = pytest.mark.skipif(not kernels.blocked_op(), reason="specdec's operators do not build here")


def _layer(K: int, N: int, config, bias: bool = True, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    layer = torch.nn.Sequential(torch.nn.Linear(K, N, bias=bias))
    quantize_(layer, config)
    return layer[0]


def _dequantised(weight) -> torch.Tensor:
    if type(weight).__name__ == "Int8Tensor":  # torchao's int8 product: x @ qdata.T * scale
        return weight.qdata.double() * weight.scale.double().reshape(-1, 1)
    return weight.dequantize().double()


def _check(layer: torch.nn.Linear, rows: list[int]) -> None:
    packed = qlinear.Packed(layer.weight)
    reference_w = _dequantised(layer.weight)
    for n in rows:
        x = torch.randn(n, layer.in_features)
        got = packed(x, layer.bias)
        want = x.double() @ reference_w.T
        if layer.bias is not None:
            want += layer.bias.double()
        # float32 sums of K products: the error is bounded by K * eps * sum |x||w| (here far below it)
        bound = 4 * layer.in_features * torch.finfo(torch.float32).eps * (x.double().abs() @ reference_w.abs().T)
        assert got.shape == (n, layer.out_features) and got.dtype == torch.float32
        assert ((got.double() - want).abs() <= bound + 1e-30).all(), (n, (got.double() - want).abs().max())
        assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("K,N", [(100, 37), (33, 16), (257, 70), (1536, 48)])
def test_int8_products_equal_the_dequantised_weights_in_float64(K, N):
    layer = _layer(K, N, Int8WeightOnlyConfig(), bias=K % 2 == 0)
    assert qlinear.form(layer.weight) == "int8"
    _check(layer, [*range(1, 17), 23, 40])


@pytest.fixture(params=["integer", "float"])
def int4_pass(request):
    """int4's two passes (csrc/quantized_linear.c): integer sums of fixed-point activations (AVX-512 VNNI; where the
    CPU lacks it, the float pass runs in both) and nibbles converted to floats."""
    previous = qlinear.int4_pass(request.param == "integer")
    yield request.param
    qlinear.int4_pass(previous)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("mapping", [MappingType.SYMMETRIC, MappingType.ASYMMETRIC])
def test_int4_products_equal_the_dequantised_weights_in_float64(group, mapping, int4_pass):
    config = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group), mapping_type=mapping)
    layer = _layer(3 * group, 37, config, bias=group != 64)
    assert qlinear.form(layer.weight) == "int4"
    assert bool(layer.weight.zero_point.any()) == (mapping == MappingType.ASYMMETRIC)  # both kernel paths
    assert (qlinear.Packed(layer.weight).zeros is None) == (mapping == MappingType.SYMMETRIC)
    _check(layer, [*range(1, 17), 29, 40])


def test_int4_integer_pass_keeps_small_values_beside_large_ones_and_non_finite_rows(int4_pass):
    """A group whose values span 2^40 (the integer pass's fixed point moves the small ones by up to 2^-23 of the
    largest: within float32's own rounding), a row of zeros, a group whose largest values are just under a power of
    two (the fixed point's widest), and rows holding inf / nan, which give what float products give (the integer
    pass hands them to the float one)."""
    asymmetric = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32),
                                      mapping_type=MappingType.ASYMMETRIC)
    layer = _layer(128, 40, asymmetric)
    packed, reference_w = qlinear.Packed(layer.weight), _dequantised(layer.weight)
    x = torch.randn(5, 128)
    x[0, :16] *= 2.0**20
    x[0, 16:32] *= 2.0**-20
    x[1] = 0.0
    x[4, :32] = 0.9999 * x[4, :32].sign()  # largest values just under a power of two: the widest fixed point
    x[2, 5] = float("inf")
    x[3, 70] = float("nan")
    finite = [0, 1, 4]  # three products: a non-finite row sends its whole product to the float pass
    got = torch.cat((packed(x[:2]), packed(x[2:4]), packed(x[4:]))).double()
    want = x.double() @ reference_w.T
    bound = 4 * 128 * torch.finfo(torch.float32).eps * (x[finite].double().abs() @ reference_w.abs().T)
    assert ((got[finite] - want[finite]).abs() <= bound + 1e-30).all()
    assert torch.equal(got[1], torch.zeros(40, dtype=torch.float64))
    assert torch.equal(got[2:4].isnan(), want[2:4].isnan()) and torch.equal(got[2:4].isinf(), want[2:4].isinf())
    assert got[3].isnan().all()


def test_int4_packs_a_head_wider_than_one_slice(monkeypatch):  # packed PACK_ROWS output rows at a time
    monkeypatch.setattr(qlinear, "PACK_ROWS", 2 * qlinear.LANES)
    layer = _layer(64, 5 * qlinear.LANES + 3, quantized.torchao_config("int4", 32), seed=1)
    packed = qlinear.Packed(layer.weight)
    q = layer.weight.qdata
    for column in (0, 31, 32, 70, 82):  # in the first, second and last (padded) slices
        block, lane = divmod(column, qlinear.LANES)
        words = packed.weight[block, :, lane] & 0xFFFFFFFF
        assert [(int(w) >> (4 * i)) & 15 for w in words for i in range(8)] == (q[column] + 8).tolist()
    assert (packed.weight[5, :, 3:] == 0x88888888 - 2**32).all()  # padding columns: nibbles 8 (q 0)
    _check(layer, [1, 5, 16])


def test_int4_packs_two_values_a_byte_from_the_tensors_own_data(monkeypatch):
    monkeypatch.setenv("SPECDEC_LINEAR", "on")
    layer = _layer(128, 40, quantized.torchao_config("int4", 64))
    packed = qlinear.Packed(layer.weight)
    assert packed.weight.numel() * packed.weight.element_size() == 48 * 128 // 2  # 40 columns padded to 48
    q = layer.weight.qdata
    word = packed.weight[0, 1, 3].item() & 0xFFFFFFFF  # block 0, k = 8 .. 15, column 3
    assert [(word >> (4 * i)) & 15 for i in range(8)] == (q[3, 8:16] + 8).tolist()
    with torch.no_grad():  # the kernel reads the tensor's own values: a changed qdata is packed again
        q[5].neg_().clamp_(-8, 7)
    kernels.install(torch.nn.Sequential(layer))
    x = torch.randn(3, 128)
    with kernels.active(), torch.inference_mode():
        got = layer(x)
    want = x.double() @ layer.weight.dequantize().double().T + layer.bias.double()
    assert torch.allclose(got.double(), want, atol=1e-4)


def test_forms_the_kernel_does_not_take_keep_torchaos_forward(monkeypatch):
    monkeypatch.setenv("SPECDEC_LINEAR", "on")
    assert qlinear.form(torch.randn(4, 4)) is None
    odd_group = _layer(48, 8, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(12)))
    assert qlinear.form(odd_group.weight) is None  # a group the words cannot hold whole
    int2 = _layer(64, 8, IntxWeightOnlyConfig(weight_dtype=torch.int2, granularity=PerGroup(32)))
    assert qlinear.form(int2.weight) is None
    model = torch.nn.Sequential(odd_group)
    kernels.install(model)
    assert "forward" not in vars(odd_group) and qlinear.installed(model) == 0
    with pytest.raises(ValueError, match="not a weight-only int8/int4 form"):
        qlinear.Packed(odd_group.weight)


def _quantized_tiny(form: str):
    model = build_tiny("llama", seed=0)
    quantize_(model, quantized.torchao_config(form, 32 if form == "int4" else None))
    return model.eval()


PROMPTS = [[5, 17, 33, 5, 17], [3, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


@pytest.mark.parametrize("form", ["int8", "int4"])
def test_the_engine_takes_the_kernel_and_equals_the_quantized_models_generate(form, monkeypatch):
    monkeypatch.setenv("SPECDEC_LINEAR", "auto")
    model = _quantized_tiny(form)
    references = [hf_greedy(model, prompt, 20, []) for prompt in PROMPTS]
    for prompt, reference in zip(PROMPTS, references):
        plain = specdec.autoregressive_generate(model, prompt, max_new_tokens=20, stop_token_ids=[])
        assert_same_greedy(model, prompt, plain.tokens, reference)
        spec = specdec.speculative_generate(model, "ngram", prompt, max_new_tokens=20, gamma=3, stop_token_ids=[])
        assert_same_greedy(model, prompt, spec.tokens, reference)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and qlinear.form(m.weight)]
    assert linears and qlinear.installed(model) == len(linears)
    assert all("_specdec_qpacked" in vars(m) for m in linears)  # each took the kernel while decoding
    layer = linears[0]  # outside active(): torchao's forward, to the bit
    x = torch.randn(2, layer.in_features)
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("form", ["int8", "int4"])
def test_without_the_kernel_the_tokens_are_the_same(form, monkeypatch):
    fast = _quantized_tiny(form)
    monkeypatch.setenv("SPECDEC_LINEAR", "off")
    slow = copy.deepcopy(fast)
    for prompt in PROMPTS:
        ours = specdec.autoregressive_generate(slow, prompt, max_new_tokens=20, stop_token_ids=[]).tokens
        assert_same_greedy(slow, prompt, ours, hf_greedy(fast, prompt, 20, []))
    assert qlinear.installed(slow) == 0 and not any("forward" in vars(m) for m in slow.modules()
                                                    if isinstance(m, torch.nn.Linear) and qlinear.form(m.weight))
    monkeypatch.setenv("SPECDEC_LINEAR", "auto")
    for prompt in PROMPTS:
        with_kernel = specdec.autoregressive_generate(fast, prompt, max_new_tokens=20, stop_token_ids=[]).tokens
        without = specdec.autoregressive_generate(slow, prompt, max_new_tokens=20, stop_token_ids=[]).tokens
        assert_same_greedy(fast, prompt, with_kernel, without)
    assert qlinear.installed(fast) > 0
