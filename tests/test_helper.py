"""The operators' helper threads (``csrc/blocked_op.cpp``, ``kernels.helper``): one or more threads, at the
scheduler's idle priority, that take shares of a linear product's columns or of an attention's rows.

Checked: shared products and attentions equal the one-thread ones bit for bit (every row count, float32 and
bfloat16-pair copies, biases, widths that are not whole blocks, grouped heads, several tokens a row); an owner whose
helper stopped with a share in hand (as a descheduled one is) takes the share back and finishes without it; a stopped
helper keeps the tensors of its share alive after the owner freed them; each with one helper and with three;
greedy decoding with the helper equals ``generate``; ``SPECDEC_HELPER``'s rule and a bad value refused by name.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_greedy, build_tiny, hf_greedy, truncated_copy

import specdec
from specdec import kernels

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=[1, 3], ids=["1 helper", "3 helpers"])
def helper(request):
    """The operator loaded and one or three helpers on (put back as it was after the test): three helpers on this
    machine's cores share them with the owner, as on a larger machine's."""
    assert kernels.blocked_op(), "the blocked operator did not build: it needs a C and a C++ compiler (cc, c++)"
    was = torch.ops.specdec.helpers(request.param)
    yield
    torch.ops.specdec.helper_hold(False)
    torch.ops.specdec.helpers(was)


def _alone(run):
    """``run()`` with the helpers off: the one-thread result."""
    was = torch.ops.specdec.helpers(0)
    try:
        return run()
    finally:
        torch.ops.specdec.helpers(was)


def _counts() -> dict[str, int]:
    shared, helped, stolen, holding = torch.ops.specdec.helper_counts()
    return {"shared": shared, "helped": helped, "stolen": stolen, "holding": holding}


def _until(condition, what: str, seconds: float = 20.0, step=None) -> None:
    """Calls ``step()`` until ``condition()``, at most ``seconds``."""
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, f"the helper never {what} in {seconds:.0f} s (it runs only on an idle core)"
        if step is not None:
            step()
        else:
            time.sleep(0.001)


def _weight(out_features: int, in_features: int, half: bool) -> torch.Tensor:
    weight = torch.randn(out_features, in_features)
    lanes = kernels.blocked().lanes
    if half:
        copy = kernels.blocked_copy(weight.to(torch.bfloat16).float(), lanes)
        assert copy.dtype == torch.bfloat16
        return copy
    return kernels.block_weight(weight, lanes)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 13, 16, 150])
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("shape", [(1408, 512), (8200, 96)])  # 8200: an odd last block, part empty
def test_a_shared_product_is_the_one_thread_product(rows, half, shape, helper):
    torch.manual_seed(rows)
    out_features, in_features = shape
    packed = _weight(out_features, in_features, half)
    x, bias = torch.randn(rows, in_features), (torch.randn(out_features) if rows % 2 else None)
    alone = _alone(lambda: torch.ops.specdec.blocked_linear(x, packed, bias, out_features))
    before = _counts()["shared"]
    for _ in range(10):  # the helper takes a different part each time, or none
        assert torch.equal(torch.ops.specdec.blocked_linear(x, packed, bias, out_features), alone)
    assert _counts()["shared"] > before  # (a product finds the helper's lock held at times, and is computed alone)


@pytest.mark.parametrize("rows,heads,kv_heads,tokens,slots", [(2, 8, 8, 1, 50), (4, 8, 8, 5, 200),
                                                              (16, 8, 2, 1, 288), (3, 5, 5, 3, 77)])
def test_a_shared_attention_is_the_one_thread_attention(rows, heads, kv_heads, tokens, slots, helper):
    torch.manual_seed(slots)
    dim = 64
    q = torch.randn(rows, heads, tokens, dim)
    k = torch.randn(rows, kv_heads, slots + 7, dim)[:, :, :slots]  # a cache's first slots: rows and heads strided
    v = torch.randn(rows, kv_heads, slots + 7, dim)[:, :, :slots]
    mask = torch.zeros(rows, tokens, slots)
    for r in range(rows):
        mask[r, :, torch.randint(0, slots, (slots // 3,))] = torch.finfo(torch.float32).min
    alone = _alone(lambda: torch.ops.specdec.decode_attention(q, k, v, mask, 0.125))
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=0.125,
                                               enable_gqa=heads != kv_heads).transpose(1, 2)
    torch.testing.assert_close(alone, reference, rtol=1e-5, atol=2e-5)
    before = _counts()["shared"]
    for _ in range(10):
        assert torch.equal(torch.ops.specdec.decode_attention(q, k, v, mask, 0.125), alone)
    assert _counts()["shared"] > before


def test_the_owner_takes_back_a_share_the_helper_holds_and_the_helper_keeps_its_tensors(helper):
    """A helper stopped with a share in hand (``helper_hold``, as a helper descheduled by other work) is not waited
    for: the owner computes that share itself, and every product after it is right while the helper stays stopped.
    Its share's tensors, freed by the owner, stay alive for it: released, it finishes with them and goes on."""
    torch.manual_seed(0)
    packed = _weight(1408, 512, True)
    x = torch.randn(4, 512)
    alone = _alone(lambda: torch.ops.specdec.blocked_linear(x, packed, None, 1408))
    torch.ops.specdec.helper_hold(True)
    stolen = _counts()["stolen"]
    held = {"x": torch.randn(4, 512), "packed": _weight(1408, 512, True)}
    held_alone = _alone(lambda: torch.ops.specdec.blocked_linear(held["x"], held["packed"], None, 1408))

    def product() -> None:
        assert torch.equal(torch.ops.specdec.blocked_linear(held["x"], held["packed"], None, 1408), held_alone)

    _until(lambda: _counts()["holding"], "took a share", step=product)
    assert _counts()["stolen"] > stolen
    del held["x"], held["packed"]  # the only references left to the held share's tensors are the helper's
    gc.collect()
    start = time.monotonic()
    for _ in range(50):  # the held helper is never waited for
        assert torch.equal(torch.ops.specdec.blocked_linear(x, packed, None, 1408), alone)
        junk = torch.full((4, 512), float("nan"))  # reuses freed memory
    assert _counts()["holding"] and time.monotonic() - start < 10
    torch.ops.specdec.helper_hold(False)
    _until(lambda: not _counts()["holding"], "let go of its share")
    helped = _counts()["helped"]
    _until(lambda: _counts()["helped"] > helped, "computed a share after it was released",
           step=lambda: torch.ops.specdec.blocked_linear(x, packed, None, 1408))
    for _ in range(10):
        assert torch.equal(torch.ops.specdec.blocked_linear(x, packed, None, 1408), alone)
    del junk


@pytest.mark.parametrize("drafting", ["agree", "plain"])
def test_greedy_with_the_helper_equals_generate(drafting, helper, monkeypatch):
    """A model whose layers are large enough to be shared (128 KiB of weight or more), the blocked kernel on: its
    products in speculative and plain decoding go through the operator, with the helper, and the output is
    ``generate``'s."""
    monkeypatch.setenv(kernels.ENV, "on")
    monkeypatch.setattr(kernels, "_PLANS", {})
    target = build_tiny("llama", seed=11, hidden=256, vocab_size=512)
    drafter = truncated_copy(target, 1)
    assert kernels.install(target) and kernels.describe(target).startswith("specdec blocked")
    prompts = [[5, 17, 33, 8, 41, 9, 12], [7, 3, 60], [44, 45, 46, 47, 44, 45, 46, 47, 44]]
    before = _counts()["shared"]
    if drafting == "plain":
        results = specdec.autoregressive_generate(target, prompts, max_new_tokens=16, stop_token_ids=[],
                                                  batch_size=2)
    else:
        results = specdec.speculative_generate(target, drafter, prompts, max_new_tokens=16, gamma=4,
                                               stop_token_ids=[], batch_size=2)
    assert _counts()["shared"] > before
    for prompt, result in zip(prompts, results):
        assert_same_greedy(target, prompt, result.tokens, hf_greedy(target, prompt, 16, []))


def test_the_helper_is_on_where_a_core_is_left_beside_torchs_threads(monkeypatch):
    monkeypatch.delenv(kernels.HELPER_ENV, raising=False)
    assert [kernels.helpers_wanted(threads=1, usable=n) for n in (1, 2, 16)] == [0, 1, 15]  # one a core left
    assert kernels.helpers_wanted(threads=4, usable=16) == 12
    assert kernels.helper_wanted(threads=1, usable=2)
    assert not kernels.helper_wanted(threads=2, usable=2)
    assert not kernels.helper_wanted(threads=1, usable=1)
    monkeypatch.setenv(kernels.HELPER_ENV, "off")
    assert not kernels.helper_wanted(threads=1, usable=2)
    monkeypatch.setenv(kernels.HELPER_ENV, " ON ")
    assert kernels.helper_wanted(threads=1, usable=1)
    assert kernels.helpers_wanted(threads=1, usable=1) == 1 and kernels.helpers_wanted(threads=1, usable=8) == 7
    monkeypatch.setenv(kernels.HELPER_ENV, "sometimes")
    with pytest.raises(ValueError, match="SPECDEC_HELPER='sometimes': use one of auto, on, off"):
        kernels.helper_wanted()
    with pytest.raises(ValueError, match="SPECDEC_HELPER='sometimes'"):  # refused at load, operator or not
        kernels.install(build_tiny("llama", seed=9))
