"""Architectures beyond the core tests (issue 25): each exact against its own ``generate``, or refused by name.

Tiny random models built from each architecture's config (``AutoConfig.for_model`` with tiny sizes):

- Exact, greedy, single prompt and a ragged batch of 5 prompts (lengths 1 to 23, in batches of 3 so
  rows join and leave), gamma 1 and 4, with prompt lookup and a model drafter (the target with noise
  on its head: it agrees often, not always), each row equal to ``generate`` of that prompt alone:
  RoBERTa-family decoders (which need ``position_ids`` from the first token), BART-family
  decoder-only classes (positions from the cache length, overridden per row), an MoE encoder-decoder
  (``router_logits`` in its encoder output), UMT5 (a relative position bias in every layer), MPT
  (ALiBi over cache slots: rows re-packed before a dead slot sits inside one),
  Pegasus-X (sinusoids computed from shared ``position_ids``, recomputed per row), LED (whose decoder builds
  no mask for a one-token step: such steps beside dead slots go in as two tokens), GIT (whose cached
  text-only forward widens a 2D mask by image tokens: it gets the 4D mask), DeepSeek-V3's
  latent attention (values narrower than keys) through compaction and rows joining; DeepSeek-V3.2's
  sparse attention (fed one token at a time, as generate feeds it) alone.
- Gemma-3n's KV-shared layers (DummyLayer cache entries, storing nothing): exact, single and batched; a
  window beside sparse attention (Dots3-Note) keeps its indexed cache layers: prompts alone exact.
- Local attention windows (GPT-Neo's ``attention_layers``, Mistral's and Gemma-2's sliding layers) and
  Llama 4's attention chunks, and LFM3 (a hybrid whose self-trimming sliding layers the cache replaces by
  plain ones), prompts longer than the window: exact alone and in ragged batches (rows re-packed before a
  dead slot enters a window or chunk).
- Rows that cannot share a forward, decoded one at a time in a ragged batch (each equal to generate, in the
  batch's order, said once by class and reason): sparse attention (DeepSeek-V3.2), RoFormer (rotary
  positions from the slot count, baked into cached keys; seeded sampling equal to each prompt alone; the
  self-check finds it by itself); the serving engine likewise, saying so at start; a cache driven directly
  with two such rows refuses them by name.
- Refused before decoding, naming the class and the reason: state outside the cache (XLNet, XLM,
  RWKV with its ``ARGUMENT_STATES`` entry removed) or no cache (OpenAI GPT), a generate that depends on how tokens are
  fed (Moshi), hybrid cache layers holding recurrent state (Falcon-H1), a cached path that disagrees with the model's
  own one-pass forward (FSMT, whose cached decoder drops its causal mask, and a model made to disagree) or fails inside
  transformers (ProphetNet). The self-check is skipped for known-good families (the shipped Llama's start-up makes no
  extra forward).
"""

from __future__ import annotations

import asyncio
import copy
import functools

import pytest
import torch
import transformers
from conftest import build_tiny, build_toy, hf_greedy
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BertConfig,
    EncoderDecoderConfig,
    EncoderDecoderModel,
)

import specdec
from specdec import architectures
from specdec import cache as cache_module
from specdec.architectures import INSTEAD
from specdec.cache import RaggedCache
from specdec.compat import cache_keyword
from specdec.module_state import ARGUMENT_STATES, MODULE_STATES
from specdec.selfcheck import Verdict, verdict_of
from specdec.target import make_target

VOCAB = 96
COMMON = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
DECODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 256, "initializer_range": 0.3}
BART = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "max_position_embeddings": 256,
        "init_std": 0.3, "decoder_start_token_id": 2, "forced_eos_token_id": None}

# name -> (model_type, encoder-decoder?, config overrides)
CONFIGS: dict[str, tuple[str, bool, dict]] = {
    "roberta": ("roberta", False, {**DECODER, "is_decoder": True}),
    "roformer": ("roformer", False, {**DECODER, "is_decoder": True, "embedding_size": 32}),
    "xlm-roberta": ("xlm-roberta", False, {**DECODER, "is_decoder": True}),
    "bart": ("bart", False, BART),
    "pegasus": ("pegasus", False, BART),
    "trocr": ("trocr", False, {"d_model": 32, "decoder_layers": 2, "decoder_attention_heads": 4, "decoder_ffn_dim": 64,
                               "max_position_embeddings": 256, "init_std": 0.3, "decoder_start_token_id": 2}),
    "deepseek_v3": ("deepseek_v3", False, {**DECODER, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
                                           "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 4, "head_dim": 8,
                                           "n_routed_experts": 4, "n_group": 1, "topk_group": 1,
                                           "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                           "first_k_dense_replace": 1}),
    "deepseek_v32": ("deepseek_v32", False, {**DECODER, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
                                             "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                                             "head_dim": 8, "n_routed_experts": 4, "n_group": 1, "topk_group": 1,
                                             "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                             "first_k_dense_replace": 1, "index_topk": 8, "index_head_dim": 16,
                                             "index_n_heads": 2}),
    "mpt": ("mpt", False, {"d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 256, "expansion_ratio": 2}),
    "moshi": ("moshi", False, {**DECODER, "sliding_window": 6}),
    "switch_transformers": ("switch_transformers", True, {
        "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
        "num_experts": 4, "expert_capacity": 64, "num_sparse_encoder_layers": 1, "num_sparse_decoder_layers": 1,
        "decoder_start_token_id": 0, "initializer_factor": 3.0}),
    "m2m_100": ("m2m_100", True, BART),
    "umt5": ("umt5", True, {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_decoder_layers": 2,
                            "num_heads": 4, "decoder_start_token_id": 0, "initializer_factor": 3.0}),
    "pegasus_x": ("pegasus_x", True, {**BART, "block_size": 4, "num_global_tokens": 2}),
    "prophetnet": ("prophetnet", True, {"hidden_size": 32, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
                                        "num_encoder_layers": 2, "num_decoder_layers": 2, "ngram": 2,
                                        "num_encoder_attention_heads": 4, "num_decoder_attention_heads": 4,
                                        "max_position_embeddings": 256, "decoder_start_token_id": 0}),
    "openai-gpt": ("openai-gpt", False, {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256}),
    "gpt_neo": ("gpt_neo", False, {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "window_size": 6,
                                   "attention_types": [[["global", "local"], 1]], "max_position_embeddings": 256,
                                   "initializer_range": 0.3}),
    "mistral": ("mistral", False, {**DECODER, "sliding_window": 6}),
    "gemma2": ("gemma2", False, {**DECODER, "sliding_window": 6, "head_dim": 8, "query_pre_attn_scalar": 8}),
    "llama4_text": ("llama4_text", False, {**DECODER, "intermediate_size_mlp": 64, "head_dim": 8,
                                           "num_local_experts": 2,
                                           "attention_chunk_size": 4}),
    "xlnet": ("xlnet", False, {"d_model": 32, "n_layer": 2, "n_head": 4, "d_inner": 64}),
    "rwkv": ("rwkv", False, {"hidden_size": 32, "attention_hidden_size": 32, "intermediate_size": 64,
                             "num_hidden_layers": 2, "context_length": 256}),
    "mamba": ("mamba", False, {"hidden_size": 32, "state_size": 8, "num_hidden_layers": 2}),
    "xlm": ("xlm", False, {"emb_dim": 32, "n_layers": 2, "n_heads": 4, "max_position_embeddings": 256}),
    "falcon_h1": ("falcon_h1", False, {**DECODER, "mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8,
                                       "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_chunk_size": 8}),
    "gemma3n_text": ("gemma3n_text", False, {**DECODER, "head_dim": 8, "num_hidden_layers": 4,
                                             "num_kv_shared_layers": 2,
                                             "layer_types": ["sliding_attention", "full_attention"] * 2,
                                             "sliding_window": 6, "intermediate_size": [64] * 4,
                                             "activation_sparsity_pattern": [0.0] * 4, "laurel_rank": 8,
                                             "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8}),
    "dots3_note_text": ("dots3_note_text", False, {
        **DECODER, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8, "v_head_dim": 8, "head_dim": 16, "n_routed_experts": 4, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_experts_intermediate_size": 16, "index_topk": 8, "index_head_dim": 16, "index_n_heads": 2,
        "sliding_window": 8, "layer_types": ["indexed_attention", "sliding_attention"],
        "mlp_layer_types": ["dense", "sparse"], "per_layer_config": {}}),
    "recurrent_gemma": ("recurrent_gemma", False, {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
                                                   "lru_width": 32, "block_types": ["recurrent", "attention"],
                                                   "attention_window_size": 16}),
    "fsmt": ("fsmt", True, {**BART, "src_vocab_size": VOCAB, "tgt_vocab_size": VOCAB, "langs": ["en", "de"]}),
    "lfm3": ("lfm3", False, {**DECODER, "num_hidden_layers": 3, "head_dim": 8, "sliding_window": 6,
                             "layer_types": ["conv", "sliding_attention", "full_attention"]}),
    "led": ("led", True, {**{k: v for k, v in BART.items() if k != "max_position_embeddings"}, "attention_window": 8,
                          "max_encoder_position_embeddings": 256, "max_decoder_position_embeddings": 256}),
    "git": ("git", False, {**{k: v for k, v in DECODER.items() if k != "num_key_value_heads"},
                           "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                             "num_attention_heads": 4, "image_size": 32, "patch_size": 16}}),
}
EXACT = ["roberta", "xlm-roberta", "bart", "pegasus", "trocr", "switch_transformers", "m2m_100", "pegasus_x", "umt5",
         "mpt",
         "led", "git"]
LENGTHS = (1, 7, 23, 12, 3)  # prompt lengths of the ragged batch
NEW = 14  # new tokens per prompt


def build(name: str, seed: int = 0):
    kind, encoder_decoder, overrides = CONFIGS[name]
    config = AutoConfig.for_model(kind, **COMMON, **overrides)
    torch.manual_seed(seed)
    auto = AutoModelForSeq2SeqLM if encoder_decoder else AutoModelForCausalLM
    model = auto.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def noisy_copy(model, scale: float = 0.5, seed: int = 1):
    """The model with noise on its head: a drafter that agrees with it often, not always."""
    drafter = copy.deepcopy(model)
    head = drafter.get_output_embeddings().weight
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.add_(torch.randn(head.shape, generator=gen) * scale * head.std())
    return drafter.eval()


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def generate(model, prompt: list[int], new: int = NEW) -> list[int]:
    """The model's own greedy decoding of ``prompt`` alone (for an encoder-decoder: ``prompt`` is the source)."""
    ids = torch.tensor([prompt])
    kwargs = {"do_sample": False, "num_beams": 1, "max_new_tokens": new, "eos_token_id": None, "pad_token_id": 0}
    if model.config.is_encoder_decoder:
        return model.generate(ids, **kwargs)[0, 1:].tolist()
    return model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)[0, len(prompt):].tolist()


def assert_exact(target, drafter, rows: list[list[int]], references: list[list[int]], gamma: int, label: str) -> list:
    """One prompt alone, then all of ``rows`` in batches of 3, decoded together: every row equals its reference."""
    one = specdec.speculative_generate(target, drafter, rows[2], max_new_tokens=NEW, gamma=gamma, stop_token_ids=[])
    assert one.tokens == references[2], f"{label}: single prompt"
    batch = specdec.speculative_generate(target, drafter, rows, max_new_tokens=NEW, gamma=gamma, stop_token_ids=[],
                                         batch_size=3)
    for i, (result, reference) in enumerate(zip(batch, references)):
        assert result.tokens == reference, f"{label}: row {i} of the batch (prompt length {LENGTHS[i]})"
    assert batch[0].batch.max_rows == 3, f"{label}: rows not decoded together: {batch[0].batch.apart}"
    return batch


@pytest.mark.parametrize("name", EXACT)
def test_greedy_equals_generate_single_and_batched(name):
    target = build(name)
    rows = prompts()
    references = [generate(target, p) for p in rows]
    accepted = 0
    for gamma in (1, 4):
        for label, drafter in (("ngram", "ngram"), ("model", noisy_copy(target))):
            batch = assert_exact(target, drafter, rows, references, gamma, f"{name} gamma {gamma} {label}")
            accepted += sum(r.stats.accepted for r in batch)
    assert accepted > 0


def test_decoder_starts_with_bos_when_no_start_token_is_declared():
    """A stock SwitchTransformers config declares no decoder_start_token_id: generate starts the decoder with
    bos_token_id, and so does specdec (it refused the model before)."""
    target = build("switch_transformers")
    target.config.decoder_start_token_id = target.generation_config.decoder_start_token_id = None
    source = prompts()[3]
    reference = generate(target, source)
    assert specdec.speculative_generate(target, "ngram", source, max_new_tokens=NEW, gamma=4,
                                        stop_token_ids=[]).tokens == reference


def test_encoder_decoder_model_gets_decoder_positions_through_its_kwargs():
    """EncoderDecoderModel (BERT to BERT) has no position table specdec can override: its decoder reads
    ``decoder_position_ids``, routed through its ``**kwargs``; single and batched equal generate (the batch
    was refused before)."""
    bert = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 256, "initializer_range": 0.3, "pad_token_id": 0}
    config = EncoderDecoderConfig.from_encoder_decoder_configs(
        BertConfig(**bert), BertConfig(**bert, is_decoder=True, add_cross_attention=True),
        decoder_start_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    target = EncoderDecoderModel(config=config).eval()
    target.generation_config.decoder_start_token_id, target.generation_config.pad_token_id = 1, 0
    rows = prompts()
    references = [generate(target, p) for p in rows]
    for gamma in (1, 4):
        assert_exact(target, "ngram", rows, references, gamma, f"EncoderDecoderModel gamma {gamma}")


def test_roberta_gets_positions_from_zero_as_generate_gives_them():
    """Without position_ids a RoBERTa decoder counts from padding_idx + 1: the model's forward alone
    differs from generate's first token, so the positions specdec passes are what make it exact."""
    target = build("roberta")
    prompt = prompts()[2]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        own = target(input_ids=ids).logits[0, -1]
        zero_based = target(input_ids=ids, position_ids=torch.arange(len(prompt))[None]).logits[0, -1]
    first = generate(target, prompt, 1)[0]
    assert int(zero_based.argmax()) == first and not torch.allclose(own, zero_based)
    assert specdec.speculative_generate(target, "ngram", prompt, max_new_tokens=1, stop_token_ids=[]).tokens == [first]


def test_latent_attention_through_compaction_and_joining_rows(monkeypatch):
    """DeepSeek-V3 caches keys 16 wide and values 4 wide: re-packing the rows (one long prompt beside
    short ones, rows finishing at a stop token; re-packed whenever a slot in use is past the longest row's live
    ones, not only when that pays) and rows joining (merge) keep each row exact."""
    target = build("deepseek_v3")
    layer = target.model.layers[0].self_attn
    assert layer.qk_head_dim != target.config.v_head_dim
    monkeypatch.setattr(cache_module, "REPACK_WASTE", 0.0)
    monkeypatch.setattr(cache_module, "COMPACT_MIN_SLOTS", 1)
    compactions = []
    original = RaggedCache.compact
    monkeypatch.setattr(RaggedCache, "compact", lambda self: (compactions.append(self.slots), original(self))[1])
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (40, 1, 2, 1, 3, 30)]
    references = [generate(target, p, 24) for p in rows]
    stop = references[1][4]  # some rows stop early, the others go on
    expected = [r[: r.index(stop) + 1] if stop in r else r for r in references]
    assert any(len(e) < 24 for e in expected) and any(len(e) == 24 for e in expected)
    for drafter in ("ngram", noisy_copy(target)):
        batch = specdec.speculative_generate(target, drafter, rows, max_new_tokens=24, gamma=4,
                                             stop_token_ids=[stop], batch_size=4)
        assert [r.tokens for r in batch] == expected
    assert compactions, "the batch never compacted: the test lost its point"


@pytest.mark.parametrize("name", ["gpt_neo", "mistral", "gemma2", "llama4_text", "lfm3"])
def test_local_window_exact_alone_and_in_ragged_batches(name, monkeypatch):
    """A 6-token window (GPT-Neo's local layers: a mask over cache slots on plain layers; Mistral's and
    Gemma-2's sliding layers; LFM3's, a hybrid whose sliding layers trimmed themselves until the cache gave it
    plain ones: its batches were refused) or Llama 4's 4-token attention chunks (cut at positions counted from a row's
    left padding), prompts up to 23 tokens: rows that accept different numbers of drafts are re-packed
    before their dead slots would enter a window or chunk, and each equals generate alone."""
    target = build(name)
    inner = []
    original = RaggedCache.compact
    monkeypatch.setattr(RaggedCache, "compact", lambda self: (inner.append(self._inner_holes()), original(self))[1])
    rows = prompts()
    references = [generate(target, p) for p in rows]
    for gamma in (1, 4):
        for label, drafter in (("ngram", "ngram"), ("model", noisy_copy(target))):
            assert_exact(target, drafter, rows, references, gamma, f"{name} gamma {gamma} {label}")
    assert any(inner), "no row ever had a dead slot inside its window: the test lost its point"


def test_sparse_attention_fed_as_generate_feeds_it_alone_and_batches_row_by_row(monkeypatch):
    """DeepSeek-V3.2's indexer picks each query's top 8 keys among scores full of exact ties (ReLU zeros): a
    multi-token cached forward picks other keys than single steps, so specdec feeds it one token at a time
    after the prefill, as generate does. One prompt equals generate with a drafter that is the target itself
    (every draft accepted: each verification is multi-token) and with a noisy one; fed multi-token, the
    same decoding differs. A dead slot before a row changes its picks too (the model's own left-padded forward
    differs from the row alone), so a batch decodes its rows one at a time, saying so by class and reason."""
    target = build("deepseek_v32")
    rows = [p for p in prompts() if len(p) < 20]
    references = [generate(target, p) for p in rows]
    for prompt, reference in zip(rows, references):
        for drafter in (copy.deepcopy(target), noisy_copy(target)):
            for gamma in (1, 4):
                assert specdec.speculative_generate(target, drafter, prompt, max_new_tokens=NEW, gamma=gamma,
                                                    stop_token_ids=[]).tokens == reference
    assert_row_by_row(target, noisy_copy(target), rows[:3], references[:3],
                      r"DeepseekV32ForCausalLM decodes rows one at a time: its sparse attention picks its top-k keys")
    init = RaggedCache.__init__

    def multi_token(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.one_at_a_time = False

    monkeypatch.setattr(RaggedCache, "__init__", multi_token)
    outputs = [specdec.speculative_generate(target, copy.deepcopy(target), p, max_new_tokens=NEW, gamma=4,
                                            stop_token_ids=[]).tokens for p in rows]
    assert outputs != references, "multi-token forwards agree here: the test lost its point"


def test_a_hybrid_whose_layers_hold_keys_and_recurrent_state_is_exact():
    """Falcon-H1's layers hold attention keys and a recurrent state together: specdec.recurrent checkpoints the
    state and the keys roll back as any attention layer's; one prompt and a ragged batch equal generate."""
    target = build("falcon_h1")
    rows = prompts()[:5]
    for gamma in (1, 4):
        for prompt in rows[:2]:
            assert specdec.speculative_generate(target, "ngram", prompt, max_new_tokens=NEW, gamma=gamma,
                                                stop_token_ids=[]).tokens == generate(target, prompt)
        results = specdec.speculative_generate(target, "ngram", rows, max_new_tokens=NEW, gamma=gamma,
                                               stop_token_ids=[], batch_size=3)
        assert [r.tokens for r in results] == [generate(target, p) for p in rows]


def test_kv_shared_layers_are_not_taken_for_recurrent_state():
    """Gemma-3n's last layers read the keys of an earlier layer of their kind (its cache holds a DummyLayer for
    each): they store nothing, so nothing is refused; one prompt and a ragged batch (prompts longer than the
    6-token window) equal generate (it was refused as holding recurrent state)."""
    target = build("gemma3n_text")
    assert target.config.num_kv_shared_layers == 2
    rows = prompts()
    references = [generate(target, p) for p in rows]
    for gamma in (1, 4):
        assert_exact(target, noisy_copy(target), rows, references, gamma, f"gemma3n_text gamma {gamma}")


def test_a_window_beside_sparse_attention_keeps_its_indexed_cache_layers():
    """Dots3-Note has sliding-window and sparse-attention (indexed) layers: the window's plain cache layers used
    to replace every layer, so the indexer found no indexed layer and its cached forward failed inside
    transformers. Now only the sliding layers are made plain; prompts alone equal generate."""
    target = build("dots3_note_text")
    cache = make_target(target).cache.cache
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicIndexedLayer", "DynamicLayer"]
    for prompt in prompts()[:2]:  # 1 and 7 tokens (the self-check reads 9)
        reference = generate(target, prompt)
        for gamma in (1, 4):
            assert specdec.speculative_generate(target, noisy_copy(target), prompt, max_new_tokens=NEW, gamma=gamma,
                                                stop_token_ids=[]).tokens == reference


@pytest.mark.parametrize(("name", "reason"), [
    ("xlnet", r"XLNetLMHeadModel keeps its memory \(`mems`\) outside a transformers Cache"),
    ("xlm", r"XLMWithLMHeadModel keeps its own `cache` dictionary outside a transformers Cache"),
    ("openai-gpt", r"OpenAIGPTLMHeadModel has no KV cache \(its forward takes no transformers Cache\)"),
])
def test_state_the_cache_cannot_roll_back_is_refused_by_name(name, reason):
    target = build(name)
    for drafter in ("ngram", None):
        with pytest.raises(TypeError, match=reason):
            if drafter is None:  # as a drafter beside a target that works
                specdec.speculative_generate(build_tiny("llama"), target, [3, 4, 5], max_new_tokens=3)
            else:
                specdec.speculative_generate(target, drafter, [3, 4, 5], max_new_tokens=3)


def test_recurrent_state_passed_as_an_unregistered_argument_is_refused_by_name(monkeypatch):
    """RWKV takes its state as the ``state`` argument; with its entry removed from
    ``specdec.module_state.ARGUMENT_STATES`` nothing hands that state to its forward or checkpoints it, so it is
    refused (as a target and as a drafter), naming the class and the argument. Registered, it decodes exactly
    (tests/test_recurrent.py)."""
    monkeypatch.delitem(ARGUMENT_STATES, "rwkv")
    reason = r"RwkvForCausalLM keeps its recurrent state \(the `state` argument\) outside a transformers Cache"
    with pytest.raises(TypeError, match=reason):
        specdec.speculative_generate(build("rwkv"), "ngram", [3, 4, 5], max_new_tokens=3)
    with pytest.raises(TypeError, match=reason):
        specdec.speculative_generate(build_tiny("llama"), build("rwkv"), [3, 4, 5], max_new_tokens=3)


def test_recurrent_state_kept_on_unregistered_modules_is_refused_by_name(monkeypatch):
    """A model whose cache has a linear-attention layer but whose forward keeps the state on its own modules and
    leaves that layer empty, in a family ``specdec.module_state`` does not know where to find it (RecurrentGemma
    with its entry removed): nothing can checkpoint or roll it back, so it is refused (as a target and as a
    drafter), naming the class and where the state lives. Registered, it decodes exactly (tests/test_recurrent.py)."""
    monkeypatch.delitem(MODULE_STATES, "recurrent_gemma")
    target = build("recurrent_gemma")
    reason = (r"RecurrentGemmaForCausalLM keeps its recurrent state outside the transformers Cache .* "
              r"lives on its modules")
    with pytest.raises(ValueError, match=reason) as refused:
        specdec.speculative_generate(target, "ngram", prompts()[2], max_new_tokens=4, stop_token_ids=[])
    assert str(refused.value).count(INSTEAD) == 1  # raised inside the self-check: its fix said once
    with pytest.raises((TypeError, ValueError), match=reason):
        specdec.speculative_generate(build_tiny("llama"), build("recurrent_gemma"), [3, 4, 5], max_new_tokens=3)


def assert_row_by_row(target, drafter, rows: list[list[int]], references: list[list[int]], reason: str,
                      gamma: int = 4) -> list:
    """A ragged batch (batch_size 3) of a model whose rows cannot share a forward: decoded one row at a time,
    said once by a warning matching ``reason``; each row equals its reference, in the batch's order."""
    with pytest.warns(UserWarning, match=reason):
        batch = specdec.speculative_generate(target, drafter, rows, max_new_tokens=NEW, gamma=gamma,
                                             stop_token_ids=[], batch_size=3)
    assert [r.tokens for r in batch] == references
    assert batch[0].batch.max_rows == 1 and batch[0].batch.rows == len(rows)
    assert batch[0].batch.apart.startswith(f"{type(target).__name__} decodes rows one at a time: ")
    return batch


def test_roformer_rows_decode_one_at_a_time_exact_greedy_and_seeded(monkeypatch):
    """RoFormer's rotary positions are the cache's slot count, baked into each key as it is cached: a row
    beside others (left padding, dead slots between its live ones, re-packing) sees its keys at the wrong
    distances. Shared forwards differ from generate; a batch decodes its rows one at a time (each equal to
    generate, seeded sampling equal to each prompt alone with its own seed). The self-check's row with a dead
    slot inside finds it by itself (without the family's entry) on a prompt of distinct tokens (a 1-token
    prompt, repeated, attends to equal values whatever the distances: it cannot tell)."""
    target = build("roformer")
    rows = prompts()
    references = [generate(target, p) for p in rows]
    for prompt, reference in zip(rows, references):
        for gamma in (1, 4):
            assert specdec.speculative_generate(target, noisy_copy(target), prompt, max_new_tokens=NEW, gamma=gamma,
                                                stop_token_ids=[]).tokens == reference
    assert_row_by_row(target, noisy_copy(target), rows, references,
                      r"RoFormerForCausalLM decodes rows one at a time: its rotary positions are the cache's "
                      r"slot count")
    sampled = {"max_new_tokens": NEW, "temperature": 1.0, "seed": 5, "stop_token_ids": []}
    with pytest.warns(UserWarning, match="decodes rows one at a time"):
        batch = specdec.speculative_generate(target, noisy_copy(target), rows[:3], batch_size=3, **sampled)
    alone = [specdec.speculative_generate(target, noisy_copy(target), p, **{**sampled, "seed": 5 + i}).tokens
             for i, p in enumerate(rows[:3])]
    assert [r.tokens for r in batch] == alone
    monkeypatch.setattr(architectures, "ROWS_APART", {})
    fresh = build("roformer")
    with pytest.warns(UserWarning, match=r"RoFormerForCausalLM decodes rows one at a time: a row behind a dead slot "
                                         r"and with one inside it .* decodes differently"):
        specdec.speculative_generate(fresh, "ngram", rows[1:3], max_new_tokens=2, stop_token_ids=[], batch_size=2)
    monkeypatch.setattr(RaggedCache, "apart", lambda self: None)  # rows forced to share forwards
    shared = specdec.speculative_generate(build("roformer"), noisy_copy(target), rows, max_new_tokens=NEW, gamma=4,
                                          stop_token_ids=[], batch_size=3)
    assert [r.tokens for r in shared] != references, "shared forwards agree here: the test lost its point"


def test_a_cache_driven_directly_still_refuses_rows_that_cannot_share_a_forward():
    """Only the round loop decodes such rows one at a time: a RaggedCache given two rows of DeepSeek-V3.2
    (sparse attention) refuses them, naming the class and the reason."""
    target = build("deepseek_v32")
    cache = RaggedCache(target, 0)
    for prompt in prompts()[1:3]:
        one = RaggedCache(target, 1)
        one.forward(torch.tensor([prompt]))
        if cache.rows:
            with pytest.raises(ValueError, match=r"DeepseekV32ForCausalLM decodes rows one at a time: its sparse "
                                                 r"attention .* Give this cache one row"):
                cache.merge(one)
        else:
            cache.merge(one)


def test_the_server_engine_serves_rows_apart_one_at_a_time_and_says_so_at_start():
    """The serving engine over RoFormer with batch size 3: the probe at start names the class and the reason;
    three requests at once are each served exactly (one row at a time: the others wait)."""
    from specdec.config import SamplingConfig
    from specdec.decode import prompt_request
    from specdec.drafters import make_drafter
    from specdec.schedules import make_schedule
    from specdec.serve.engine import Engine, Failed, Finished
    from specdec.serve.server import probe

    target_model = build("roformer")
    target = make_target(target_model)
    drafter = make_drafter(noisy_copy(target_model), target, None)
    engine = Engine(target, drafter, make_schedule(specdec.SpecConfig(gamma=4)), batch_size=3)
    with pytest.warns(UserWarning, match="RoFormerForCausalLM decodes rows one at a time"):
        assert engine.decoder.rows_apart(probe(target)).startswith("RoFormerForCausalLM decodes rows one at a time")
    rows = prompts()[:3]
    requests = [prompt_request(target, p, NEW, SamplingConfig(), frozenset()) for p in rows]

    async def serve() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        jobs = [engine.submit(r, loop) for r in requests]
        out = []
        for job in jobs:
            while not isinstance(item := await job.next(), (Finished, Failed)):
                pass
            assert isinstance(item, Finished), item
            out.append(item.result.tokens)
        assert engine.decoder.stats.max_rows == 1  # (read before stop(), which starts a fresh decoder)
        return out

    engine.start()
    try:
        served = asyncio.run(serve())
    finally:
        engine.stop()
    assert served == [generate(target_model, p) for p in rows]


def test_a_family_whose_generate_depends_on_how_tokens_are_fed_is_refused_by_name():
    """Moshi declares a 6-token window its attention never applies; generate's cache trims itself to it, so
    generate's greedy output differs from the model's own one-pass greedy decoding: refused, naming the class."""
    target = build("moshi")
    prompt = prompts()[2]
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            sequence.append(int(target(input_ids=torch.tensor([sequence]), use_cache=False).logits[0, -1].argmax()))
    assert generate(target, prompt) != sequence[len(prompt):], "generate equals the one-pass decoding: no point"
    with pytest.raises(TypeError, match=r"MoshiForCausalLM declares a sliding_window that its attention never "
                                        r"applies .* Decode it with generate\(\) instead"):
        specdec.speculative_generate(target, "ngram", prompt, max_new_tokens=4, stop_token_ids=[])


def test_cached_path_that_disagrees_is_refused_at_prefill():
    """FSMT's cached decoder drops its causal mask: its cached forward differs from its one-pass forward."""
    target = build("fsmt")
    with pytest.raises(ValueError, match=r"FSMTForConditionalGeneration's cached forward disagrees with its own "
                                         r"one-pass forward .* Decode it with generate\(\) instead"):
        specdec.speculative_generate(target, "ngram", prompts()[2], max_new_tokens=4, stop_token_ids=[])


def test_cached_path_that_fails_inside_transformers_is_refused_by_name():
    """ProphetNet's cached decoder asserts on inputs longer than one token: specdec says so, naming it."""
    target = build("prophetnet")
    with pytest.raises(ValueError, match=r"ProphetNetForConditionalGeneration's cached forward fails where specdec "
                                         r"uses it .*AssertionError"):
        specdec.speculative_generate(target, "ngram", prompts()[2], max_new_tokens=4, stop_token_ids=[])


def counted(model) -> list:
    """Count ``model``'s forward calls (its signature kept, which specdec reads); returns the list of calls."""
    calls, forward = [], model.forward

    @functools.wraps(forward)
    def counting(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    model.forward = counting
    return calls


def test_self_check_catches_a_wrong_multi_token_forward_and_spares_known_good_models():
    """A GPT-2 whose cached forwards of several tokens see one position too far is refused (its single
    steps are right); a correct unknown family passes once and is not checked again; a known-good
    family (the shipped Llama's) starts up with no extra forward."""
    target = build_tiny("gpt2")
    target.config.model_type = "gpt2-unknown"  # not known good: checked
    forward, keyword = target.forward, cache_keyword(target)

    @functools.wraps(forward)
    def shifted(*args, position_ids=None, **kwargs):
        cache = kwargs.get(keyword)
        if position_ids is not None and position_ids.shape[1] > 1 and cache and cache.get_seq_length():
            position_ids = position_ids + 1
        return forward(*args, position_ids=position_ids, **kwargs)

    target.forward = shifted
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel's cached forward disagrees .* in a 5-token cached forward"):
        specdec.speculative_generate(target, "ngram", list(range(3, 20)), max_new_tokens=4, stop_token_ids=[])
    target.forward = forward
    del target._specdec_verdict
    calls = counted(target)
    specdec.speculative_generate(target, "ngram", list(range(3, 20)), max_new_tokens=2, stop_token_ids=[])
    checked = len(calls)
    calls.clear()
    specdec.speculative_generate(target, "ngram", list(range(3, 20)), max_new_tokens=2, stop_token_ids=[])
    assert len(calls) < checked and verdict_of(target) == Verdict("", "")  # checked once, passed
    llama = build_tiny("llama")
    calls = counted(llama)
    result = specdec.speculative_generate(llama, "ngram", list(range(3, 20)), max_new_tokens=1, stop_token_ids=[])
    assert len(calls) == result.stats.target_calls == 2 and verdict_of(llama) is None  # prefill, one round: no check


def test_positions_of_its_own_decide_batches_by_the_self_check():
    """A model that reads no position_ids and has no position table (ALiBi-style, or none) is checked behind a
    dead slot: the toy LM, whose prefix enters through the mask only, decodes batches exactly."""
    target = build_toy(vocab_size=12)
    assert not make_target(target).cache.positions.supported
    rows = [[3, 4, 5, 6, 7, 8, 9, 10, 3], [5], [7, 3, 4]]
    references = [hf_greedy(target, p, 10, []) for p in rows]
    batch = specdec.speculative_generate(target, "ngram", rows, max_new_tokens=10, gamma=3, stop_token_ids=[],
                                         batch_size=3)
    assert [r.tokens for r in batch] == references and verdict_of(target) == Verdict("", "")


def test_only_a_transformers_release_known_not_to_work_is_refused_by_name_with_the_fix():
    """A release before 5.23 (5.17, on a lent GPU machine, failed as ``cannot import name 'DummyLayer'``) is refused
    at import with the supported range and the install command; the installed one, 5.23 and the releases that renamed
    ``past_key_values`` to ``cache`` (5.24 on, read through ``specdec.compat``) pass."""
    from specdec.supported import check_installed, check_transformers

    check_transformers(transformers.__version__)
    check_installed()
    for version in ("5.23.0", "5.24.0", "5.25.0", "5.26.0.dev0"):
        check_transformers(version)
    for version in ("5.17.0", "5.22.1", "4.57.0"):
        with pytest.raises(ImportError, match=r"transformers .* needs transformers >= 5\.23 .*pip install -U "
                                              r"'transformers>=5"):
            check_transformers(version)


def test_a_torch_specdec_cannot_run_on_is_refused_by_name_with_the_fix():
    """transformers 5.23 disables PyTorch below torch 2.6, and the dynamo of torch 2.6-2.7 cannot trace all its forwards
    (every model class, or a compile, then fails later, far from the cause): such a torch is refused at import, with
    the install command; the installed one and 2.8 on (CUDA or CPU builds) pass."""
    from specdec.supported import check_torch

    check_torch(torch.__version__)
    for version in ("2.8.0+cu128", "2.13.0+cpu", "2.15.0"):
        check_torch(version)
    for version in ("2.7.1+cu126", "2.6.0+cu124", "2.5.1", "2.4.0+cpu", "1.13.1"):
        with pytest.raises(ImportError, match=r"torch .* is installed, .* torch >= 2\.8 .*pip install -U 'torch>=2\.8"):
            check_torch(version)
