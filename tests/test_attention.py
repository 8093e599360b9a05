"""specdec's attention for compiled decode steps (``specdec.compiled.specdec_attention``, ``csrc/attention.c``).

The operator against the softmax formula in float64, on shapes of decoding (1 to 13 new tokens, grouped key-value
heads, slot widths that are not a multiple of the vector width, masks with dead slots); slots that no query of a
row sees hold NaN, so an operator that read them would return NaN. The attention function under ``torch.compile``:
the operator where it covers the call (dead slots unread), sdpa where it does not. A compiled model whose heads it
covers decodes ragged batches (rows of unlike lengths: dead padding slots; drafts rolled back) as ``generate`` does.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_greedy, build_tiny, hf_greedy
from transformers import LlamaConfig, LlamaForCausalLM

import specdec
from specdec import kernels
from specdec.compiled import prepare, specdec_attention, traced_attention
from specdec.config import NgramConfig
from specdec.drafters.ngram import NgramDrafter

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not kernels.blocked_op(), reason="specdec's operators need a C and a C++ compiler")]
LOWEST = torch.finfo(torch.float32).min


def _inputs(rows, heads, kv_heads, tokens, slots, dim, dead, seed=0):
    """Queries, keys and values (a cache of ``slots + 1`` slots, the first ``slots`` attended), an additive mask
    [R, 1, n, S] (each row's slots live at random but for ``dead`` of them, causal over the last ``tokens``), and
    which slots some query of the row sees [R, S]; the keys and values of the others are NaN."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, heads, tokens, dim, generator=generator)
    keys = torch.randn(rows, kv_heads, slots + 1, dim, generator=generator)
    values = torch.randn(rows, kv_heads, slots + 1, dim, generator=generator)
    live = torch.rand(rows, slots, generator=generator) >= dead
    live[:, slots - tokens:] = True  # the new tokens' own slots
    seen = live[:, None, :].repeat(1, tokens, 1)  # [R, n, S]
    for i in range(tokens):
        seen[:, i, slots - tokens + i + 1:] = False  # causal over the new tokens
    mask = torch.zeros(rows, 1, tokens, slots).masked_fill(~seen[:, None], LOWEST)
    unread = ~seen.any(dim=1)  # [R, S]
    keys[:, :, :slots][unread[:, None, :].expand(-1, kv_heads, -1)] = float("nan")
    values[:, :, :slots][unread[:, None, :].expand(-1, kv_heads, -1)] = float("nan")
    return query, keys[:, :, :slots], values[:, :, :slots], mask, seen


def _reference(query, keys, values, seen, scale):
    """softmax over the seen slots only, in float64: [R, n, H, D]."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).nan_to_num()
    v = values.double().repeat_interleave(group, 1).nan_to_num()
    scores = (query.double() @ k.transpose(2, 3)) * scale
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).float()


@pytest.mark.parametrize(("rows", "heads", "kv_heads", "tokens", "slots", "dim", "dead"), [
    (1, 4, 4, 1, 2, 64, 0.0),
    (1, 8, 8, 1, 37, 64, 0.0),
    (3, 8, 2, 5, 64, 64, 0.5),  # grouped heads, a verification
    (16, 4, 4, 1, 200, 32, 0.4),
    (2, 4, 1, 13, 100, 128, 0.3),  # a prompt-lookup verification of 13 tokens, one key-value head
    (2, 2, 2, 3, 17, 96, 0.9),  # most slots dead, a width not a multiple of the vector width
])
def test_the_operator_computes_attention_over_the_seen_slots_and_reads_no_other(rows, heads, kv_heads, tokens, slots,
                                                                                 dim, dead):
    query, keys, values, mask, seen = _inputs(rows, heads, kv_heads, tokens, slots, dim, dead)
    scale = dim ** -0.5
    out = torch.ops.specdec.decode_attention(query, keys, values, mask[:, 0].contiguous(), scale)
    assert out.shape == (rows, tokens, heads, dim)
    assert torch.isfinite(out).all()  # the NaN slots were not read
    torch.testing.assert_close(out, _reference(query, keys, values, seen, scale), atol=2e-6, rtol=1e-5)


def test_the_operator_refuses_what_it_does_not_compute():
    query, keys, values, mask, _ = _inputs(1, 4, 4, 1, 8, 64, 0.0)
    with pytest.raises(RuntimeError, match="head dimension"):
        torch.ops.specdec.decode_attention(query[..., :8].contiguous(), keys[..., :8].contiguous(),
                                           values[..., :8].contiguous(), mask[:, 0].contiguous(), 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.specdec.decode_attention(query, keys.transpose(2, 3).contiguous().transpose(2, 3), values,
                                           mask[:, 0].contiguous(), 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.specdec.decode_attention(query.double(), keys, values, mask[:, 0].contiguous(), 1.0)


class _Attention(torch.nn.Module):
    """What transformers' sdpa attention reads of the attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _compiled_attention(query, keys, values, mask):
    module = _Attention(query.shape[1] // keys.shape[1])

    def attend(q, k, v, m):
        return specdec_attention(module, q, k, v, m, scaling=q.shape[-1] ** -0.5)[0]

    return torch.compile(attend, fullgraph=True, dynamic=False)(query, keys, values, mask)


def test_compiled_the_attention_function_runs_the_operator_where_it_covers_the_call():
    """Under torch.compile: the operator for a covered call (the NaN slots unread: finite, equal to the reference);
    sdpa for a head dimension it has no kernel for (equal to sdpa eagerly) and for a float64 call."""
    torch._dynamo.reset()
    query, keys, values, mask, seen = _inputs(2, 4, 2, 3, 40, 64, 0.5)
    out = _compiled_attention(query, keys, values, mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _reference(query, keys, values, seen, 0.125), atol=2e-6, rtol=1e-5)
    small = [t.nan_to_num() for t in _inputs(2, 4, 4, 1, 10, 8, 0.0)[:4]]  # head dimension 8: not covered
    expected = torch.nn.functional.scaled_dot_product_attention(*small[:3], attn_mask=small[3]).transpose(1, 2)
    torch.testing.assert_close(_compiled_attention(*small), expected)
    doubled = [t.nan_to_num().double() for t in (query, keys, values, mask)]
    assert torch.isfinite(_compiled_attention(*doubled)).all()  # float64: sdpa (finite once the NaN are gone)
    eager = specdec_attention(_Attention(2), query, keys, values, mask, scaling=0.125)[0]
    assert torch.isnan(eager).any()  # outside a compile it is sdpa, which reads every slot


def _model(seed: int, layers: int = 2) -> LlamaForCausalLM:
    """A tiny Llama whose heads the operator covers (head dimension 32, grouped key-value heads)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.3)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_a_compiled_model_with_the_attention_decodes_ragged_batches_as_generate_does(stored):
    """Rows of unlike prompt lengths share the cache (the shorter ones' padding slots are dead), drafts are rolled
    back, rows leave and the buffers compact: greedy equals each prompt's ``generate``. A model stored in bfloat16
    (its float32 weights all bfloat16 numbers) has its linears' copies in bfloat16 pairs, and decodes the same."""
    model = _model(seed=3)
    if stored == "bfloat16":
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(parameter.to(torch.bfloat16))
    prompts = [[1, 5, 9, 33, 7], [1, *range(40, 80)], [1, 60, 3, 3, 70, 71, 72, 8, 9, 10, 11, 50, 51],
               [1, *range(10, 30), 5, 6]]
    reference = [hf_greedy(model, p, 40, [2]) for p in prompts]
    assert traced_attention(model) == "specdec"
    assert prepare(model, "on", tokens=(1, 4), rows=(1, 4)).compiled
    copies = {m._specdec_blocked.dtype for m in model.modules() if hasattr(m, "_specdec_blocked")}
    assert copies == {getattr(torch, stored)}
    drafter = NgramDrafter(NgramConfig(min_ngram=1, num_tokens=3))
    plain = specdec.autoregressive_generate(model, prompts, max_new_tokens=40, batch_size=4)
    drafted = specdec.speculative_generate(model, drafter, prompts, gamma=3, max_new_tokens=40, batch_size=4)
    for prompt, expected, a, b in zip(prompts, reference, plain, drafted):
        assert_same_greedy(model, prompt, a.tokens, expected)
        assert_same_greedy(model, prompt, b.tokens, expected)
    assert model.config._attn_implementation == "sdpa"  # the trace's choice is not left on the model


def test_the_attention_is_traced_only_for_float32_cpu_models_with_sdpa(monkeypatch):
    model = build_tiny("llama", seed=2)
    assert traced_attention(model) == "specdec"
    model.config._attn_implementation = "eager"  # a decoder-only model set to eager keeps it
    assert traced_attention(model) == "eager"
    model.config._attn_implementation = "sdpa"
    monkeypatch.setenv(kernels.ENV, "off")
    assert traced_attention(model) == "sdpa"
    monkeypatch.delenv(kernels.ENV)
    assert traced_attention(build_tiny("llama", seed=2).to(torch.bfloat16)) == "sdpa"
