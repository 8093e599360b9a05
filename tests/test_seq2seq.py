"""Encoder-decoder targets (issue 19): the same round loop, the same handles, exact against ``generate``.

Random tiny BART, T5 and Marian pairs (the drafter: the target with one decoder layer, so it agrees
often but not always, and an independent model): greedy output equals the target's own
``generate(num_beams=1, do_sample=False)`` for one source and for a batch of sources of different
lengths (rows accept different numbers of tokens, leave, join), gamma 1 and 4, with the drafter
model, prompt lookup (which also copies from the source) and lookup then the model. The encoder runs
once per source; rolling the decoder back keeps the cross-attention; the source-copy drafter copies
numbers and markers; bad input is refused with clear errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    T5Config,
    T5ForConditionalGeneration,
)

import specdec
from specdec.batch import PromptBatch
from specdec.config import NgramConfig
from specdec.target import make_target

VOCAB = 96


def build(arch: str, seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    common = {"vocab_size": VOCAB, "pad_token_id": 0, "eos_token_id": 2}
    if arch == "bart":
        config = BartConfig(d_model=32, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4,
                            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                            max_position_embeddings=128, bos_token_id=1, decoder_start_token_id=2, init_std=0.3,
                            forced_eos_token_id=None, **common)
        model = BartForConditionalGeneration(config)
    elif arch == "t5":
        config = T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_decoder_layers=layers, num_heads=4,
                          decoder_start_token_id=0, initializer_factor=3.0, **common)
        model = T5ForConditionalGeneration(config)
    else:
        config = MarianConfig(d_model=32, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                              max_position_embeddings=128, decoder_start_token_id=0, init_std=0.3,
                              forced_eos_token_id=None, **common)
        model = MarianMTModel(config)
    return damp_last_decoder_layer(model.eval())


def damp_last_decoder_layer(model, factor: float = 0.2):
    """Shrink what the last decoder layer adds to the residual stream, so that the model without it
    (``first_decoder_layer``) agrees with the model often, not always."""
    decoder = model.get_decoder()
    last = decoder.block[-1] if hasattr(decoder, "block") else decoder.layers[-1]
    with torch.no_grad():
        for name, param in last.named_parameters():
            if name.endswith(("out_proj.weight", "fc2.weight", ".o.weight", ".wo.weight")):
                param.mul_(factor)
    return model


def first_decoder_layer(model):
    """The target with only its first decoder layer: a drafter that agrees with it often."""
    drafter = copy.deepcopy(model)
    decoder = drafter.get_decoder()
    if hasattr(decoder, "block"):  # T5
        decoder.block = decoder.block[:1]
        drafter.config.num_decoder_layers = 1
    else:
        decoder.layers = decoder.layers[:1]
        drafter.config.decoder_layers = 1
    return drafter.eval()


def generate(model, source: list[int], n: int, eos: list[int]) -> list[int]:
    """The target's own greedy decoding of one source (new tokens, the start token left out)."""
    out = model.generate(torch.tensor([source]), attention_mask=torch.ones(1, len(source), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, num_beams=1, eos_token_id=eos or None)
    tokens = out[0, 1:].tolist()
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


SOURCES = [[5, 6, 7, 8, 9], [10, 11], list(range(3, 40)), [50, 51, 52, 50, 51], [7]]
PAIRS: dict[str, tuple] = {}


def assert_single_and_batched(target, drafter, references: list[list[int]], gamma: int, name: str) -> list:
    """Decode SOURCES[0] alone and all of SOURCES in batches of 3 (18 new tokens, no stop token):
    both must equal ``references`` (the target's own greedy output). Returns the batch's results."""
    one = specdec.speculative_generate(target, drafter, SOURCES[0], max_new_tokens=18, gamma=gamma, stop_token_ids=[])
    assert one.tokens == references[0], name
    batch = specdec.speculative_generate(target, drafter, SOURCES, max_new_tokens=18, gamma=gamma,
                                         stop_token_ids=[], batch_size=3)
    assert [r.tokens for r in batch] == references, name
    return batch


def pair(arch: str):
    if arch not in PAIRS:
        target = build(arch)
        PAIRS[arch] = (target, first_decoder_layer(target), build(arch, seed=5, layers=1))
    return PAIRS[arch]


@pytest.mark.parametrize("arch", ["bart", "t5", "marian"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_equals_generate_single_and_batched(arch, gamma):
    target, agree, other = pair(arch)
    references = [generate(target, s, 18, []) for s in SOURCES]
    drafters = {"agree": agree, "other": other, "ngram": "ngram", "lookup+agree": specdec.LookupDrafter(agree)}
    accepted = 0
    for name, drafter in drafters.items():
        batch = assert_single_and_batched(target, drafter, references, gamma, name)
        accepted += sum(r.stats.accepted for r in batch)
        if name == "agree":
            rates = {round(r.stats.acceptance_rate, 2) for r in batch}
            assert len(rates) > 1  # rows accepted different amounts: the batch was ragged
    assert accepted > 0
    plain = specdec.autoregressive_generate(target, SOURCES, max_new_tokens=18, stop_token_ids=[], batch_size=2)
    assert [r.tokens for r in plain] == references


@pytest.mark.parametrize("arch", ["bart", "t5"])
def test_the_drafter_sitting_out_plain_stretches_reads_sources_back(arch):
    """A drafter that sat out while 3-4 rows decoded plain (``Schedule.settled_plain``) reads the rows back with
    their sources when the batch falls to 2 rows and drafts again (its own encoder runs on them): every row equal
    to ``generate``, for a model drafter and lookup then the model."""
    from test_core_batch import _PlainFromThree

    target, agree, _ = pair(arch)
    budgets = [18, 5, 12, 8, 16]  # rows finish apart: 4 rows, then 3, 2, 1
    references = [generate(target, s, n, []) for s, n in zip(SOURCES, budgets)]
    handle = make_target(target)
    for drafter in (agree, specdec.LookupDrafter(agree)):
        chosen = specdec.drafters.make_drafter(drafter, handle)
        decoder = specdec.decode.Decoder(handle, chosen, _PlainFromThree(3), batch_size=4)
        for i, (source, n) in enumerate(zip(SOURCES, budgets)):
            decoder.submit(specdec.decode.Request([handle.decoder_start], n, specdec.config.SamplingConfig(0.0),
                                                  source=source, index=i))
        finished = []
        while decoder.busy:
            finished += decoder.step()
        assert [row.tokens for row in sorted(finished, key=lambda r: r.request.index)] == references
        assert decoder.stats.accepted > 0  # the tail drafted, after the plain stretch


@pytest.mark.parametrize("arch", ["marian", "t5"])
def test_stop_tokens_and_sampling(arch):
    target, agree, _ = pair(arch)
    references = [generate(target, s, 18, []) for s in SOURCES]
    stop = references[2][3]
    expected = [generate(target, s, 18, [stop]) for s in SOURCES]
    batch = specdec.speculative_generate(target, agree, SOURCES, max_new_tokens=18, gamma=3, stop_token_ids=[stop])
    assert [r.tokens for r in batch] == expected
    sampled = [specdec.speculative_generate(target, agree, SOURCES, max_new_tokens=10, temperature=1.0, seed=4,
                                            stop_token_ids=[]) for _ in range(2)]
    assert [r.tokens for r in sampled[0]] == [r.tokens for r in sampled[1]]
    assert all(len(r.tokens) == 10 for r in sampled[0])


def test_the_encoder_runs_once_per_source():
    target, agree, _ = pair("marian")
    seen = []
    hooks = [m.get_encoder().register_forward_hook(lambda mod, args, kwargs, out: seen.append(
        kwargs["input_ids"].shape[0]), with_kwargs=True) for m in (target, agree)]
    try:
        results = specdec.speculative_generate(target, agree, SOURCES, max_new_tokens=12, gamma=3, batch_size=2,
                                               stop_token_ids=[])
    finally:
        for h in hooks:
            h.remove()
    assert sum(seen) == 2 * len(SOURCES)  # each source once in the target's encoder, once in the drafter's
    assert all(r.stats.rounds > 1 for r in results)


def test_rollback_keeps_the_cross_attention():
    target_model, _, _ = pair("bart")
    target = make_target(target_model)
    with torch.inference_mode():
        target.prefill(PromptBatch.from_lists([[2], [2]], "cpu", sources=[[5, 6, 7, 8], [9, 10]]))
        scores = target.verify(torch.tensor([[2, 11, 12, 13], [2, 14, 0, 0]]), torch.tensor([4, 2]))
        cross = [layer.keys.clone() for layer in target.cache.cross.layers]
        target.rollback(torch.tensor([2, 1]))  # row 0 keeps [2, 11], row 1 keeps [2]
        assert target.cached().tolist() == [2, 1]
        assert [layer.keys.shape for layer in target.cache.cross.layers] == [c.shape for c in cross]
        assert all(torch.equal(a.keys, b) for a, b in zip(target.cache.cross.layers, cross))
        again = target.verify(torch.tensor([[12, 13], [14, 0]]), torch.tensor([2, 1]))
    torch.testing.assert_close(again.logits[0], scores.logits[0, 2:4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(again.logits[1, 0], scores.logits[1, 1], atol=1e-4, rtol=1e-4)


def test_source_copy_drafts_numbers_and_markers():
    """Lookup with a source: once the output's last token occurs in the source, what followed it there is drafted."""
    number, marker = [31, 41, 59], [70, 71]  # "3.14159", "%s" as token ids
    source = [5, 6, *number, 7, *marker, 8]
    lookup = specdec.NgramDrafter(NgramConfig(min_ngram=1, max_ngram=2, num_tokens=4))
    lookup.prefill(PromptBatch.from_lists([[0, 12, 31], [0, 70]], "cpu", sources=[source, source]))
    assert lookup.propose(torch.tensor([4, 4]), None).drafts() == [[41, 59, 7, 70], [71, 8]]
    target, _, _ = pair("marian")
    res = specdec.speculative_generate(target, "ngram", source, max_new_tokens=12, stop_token_ids=[])
    assert res.tokens == generate(target, source, 12, [])


def test_bad_sources_and_mixed_kinds_are_refused():
    target, agree, _ = pair("marian")
    with pytest.raises(ValueError, match="the source is empty"):
        specdec.speculative_generate(target, agree, [], max_new_tokens=3)
    with pytest.raises(ValueError, match="source 1 has 200 tokens but the encoder's positions hold 128: shorten it by "
                                         "72"):
        specdec.speculative_generate(target, agree, [[5, 6], [7] * 200], max_new_tokens=3)
    from conftest import build_tiny

    causal = build_tiny("llama", vocab_size=VOCAB, seed=0)
    with pytest.raises(ValueError, match="the drafter LlamaForCausalLM is a decoder-only model but the target is an "
                                         "encoder-decoder one"):
        specdec.speculative_generate(target, causal, [5, 6], max_new_tokens=3)
    with pytest.raises(ValueError, match="is an encoder-decoder model but the target is a decoder-only one"):
        specdec.speculative_generate(causal, agree, [5, 6], max_new_tokens=3)
    bart_target = pair("bart")[0]
    with pytest.raises(ValueError, match="starts its decoder with token 0 but the target with 2"):
        specdec.speculative_generate(bart_target, agree, [5, 6], max_new_tokens=3)


def test_saved_encoder_decoder_folders_load_and_decode(tmp_path):
    target, agree, _ = pair("marian")
    target.save_pretrained(tmp_path / "target")
    agree.save_pretrained(tmp_path / "drafter")
    loaded = specdec.load_model(tmp_path / "target")
    assert loaded.config.is_encoder_decoder and type(loaded) is type(target)
    res = specdec.speculative_generate(loaded, str(tmp_path / "drafter"), SOURCES[1], max_new_tokens=12,
                                       stop_token_ids=[])
    assert res.tokens == generate(target, SOURCES[1], 12, [])


def test_decoder_settings_read_as_get_text_config_reads_them_without_its_copy(monkeypatch):
    """Every row that joins builds a cache that reads the decoder's window and chunk settings; for a flat
    encoder-decoder config transformers' get_text_config(decoder=True) deep-copies the config each time, so
    they are read from the config itself, as the copy would give them (``decoder_X`` renamed ``X``)."""
    from transformers import AutoConfig, LEDConfig, MarianConfig, T5GemmaConfig

    from specdec.architectures import attention_chunk, decoder_setting, local_window

    names = ("layer_types", "attention_layers", "sliding_window", "window_size", "attention_window",
             "attention_chunk_size", "is_encoder_decoder")
    flat = [MarianConfig(), AutoConfig.for_model("bart"), AutoConfig.for_model("t5"), LEDConfig(attention_window=16),
            MarianConfig(decoder_sliding_window=5, sliding_window=9)]  # a decoder_ setting wins, as in the copy
    nested = [T5GemmaConfig(), AutoConfig.for_model("llama", sliding_window=7)]
    for config in flat + nested:
        copied = config.get_text_config(decoder=True)
        assert [decoder_setting(config, n) for n in names] == [getattr(copied, n, None) for n in names], config
    assert decoder_setting(flat[-1], "sliding_window") == 5
    for config, window in zip(flat, [None, None, None, None, 5]):  # no copy made
        monkeypatch.setattr(type(config), "get_text_config", lambda *a, **k: pytest.fail("copied the config"))
        assert (local_window(config), attention_chunk(config)) == (window, None)
        monkeypatch.undo()
