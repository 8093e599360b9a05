"""The shipped default pair (models/code-target, models/code-drafter) loads and works together."""

from __future__ import annotations

import json

import pytest
from conftest import TRANSLATE_NEW

import specdec
from specdec.data.prompts import code_completion_prompts
from specdec.loading import default_model_path, load_tokenizer


@pytest.fixture(scope="module")
def pair():
    return specdec.load_model("code-target"), specdec.load_model("code-drafter"), load_tokenizer("code-target")


def test_shipped_files_are_safetensors_within_the_size_budget():
    total = 0
    for name in ("code-target", "code-drafter"):
        folder = default_model_path(name)
        assert (folder / "config.json").exists() and (folder / "README.md").exists()
        assert (folder / "tokenizer.json").exists()
        weights = list(folder.glob("*.safetensors"))
        assert weights, f"{folder} has no safetensors weights"
        assert not list(folder.glob("*.bin")) and not list(folder.glob("*.pt")), "no pickled weights"
        assert json.loads((folder / "config.json").read_text())["dtype"] in ("bfloat16", "float16")
        total += sum(f.stat().st_size for f in weights)
    assert total <= 64 * 2**20, f"shipped weights take {total / 2**20:.1f} MiB > 64 MiB"


def test_pair_shares_a_vocabulary_and_the_target_is_much_larger(pair):
    target, drafter, tok = pair
    assert target.config.vocab_size == drafter.config.vocab_size == len(tok)
    assert load_tokenizer("code-drafter").get_vocab() == tok.get_vocab()
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in drafter.parameters())
    assert 15e6 <= n_t <= 45e6 and n_t >= 10 * n_d, (n_t, n_d)
    assert target.generation_config.eos_token_id == tok.eos_token_id


def test_default_model_is_the_shipped_target():
    assert specdec.load_model().config.to_dict() == specdec.load_model("code-target").config.to_dict()


def test_shipped_pair_is_lossless_and_drafts_useful_tokens(pair):
    target, drafter, tok = pair
    accepted = drafted = 0
    for p in code_completion_prompts(3, seed=5):
        ids = tok(p["prompt"])["input_ids"]
        plain = specdec.autoregressive_generate(target, ids, max_new_tokens=24)
        spec = specdec.speculative_generate(target, drafter, ids, max_new_tokens=24, gamma=4)
        assert spec.tokens == plain.tokens, p["id"]
        accepted += spec.stats.accepted
        drafted += spec.stats.drafted
    # a trained, distilled drafter agrees with the target far more often than chance (1/8192)
    assert accepted / drafted > 0.2, accepted / drafted


def test_all_shipped_models_stay_within_100_mb():
    total = sum(f.stat().st_size for f in default_model_path("code-target").parent.rglob("*") if f.is_file())
    assert total <= 100 * 10**6, f"models/ takes {total / 1e6:.1f} MB > 100 MB"


def test_shipped_translate_target_is_a_plain_marian_that_translates_exactly(shipped_translations):
    """models/translate-target loads with transformers alone (no specdec class), in bf16 safetensors;
    speculative decoding with source-copy lookup gives its own greedy `generate`, token for token."""
    from transformers import MarianMTModel

    folder = default_model_path("translate-target")
    assert (folder / "README.md").exists() and not list(folder.glob("*.bin"))
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    model, tokenizer, sources, expected = shipped_translations
    assert isinstance(model, MarianMTModel) and model.config.is_encoder_decoder
    results = specdec.speculative_generate(model, "ngram", sources, tokenizer=tokenizer, max_new_tokens=TRANSLATE_NEW)
    for source, result, reference in zip(sources, results, expected):
        assert result.tokens == reference, source
    # it translates: the German for "file" and the format markers come through
    text = tokenizer.decode(results[0].tokens, skip_special_tokens=True)
    assert "Datei" in text and "%s" in text, text


def test_shipped_translate_drafters_are_plain_marians_that_draft_exactly(shipped_translations):
    """models/translate-drafter (autoregressive, distilled) and models/translate-block-drafter (SpecDec's
    block drafter) load with transformers alone, in bf16 safetensors; each, alone and after lookup,
    gives the shipped target's own greedy `generate`, token for token, and its drafts are heard."""
    import torch
    from transformers import AutoModelForSeq2SeqLM, MarianMTModel

    from specdec.drafters.block import is_block_drafter

    target, tokenizer, sources, expected = shipped_translations
    for name, block in (("translate-drafter", False), ("translate-block-drafter", True)):
        folder = default_model_path(name)
        assert (folder / "README.md").exists() and not list(folder.glob("*.bin"))
        assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
        drafter = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert isinstance(drafter, MarianMTModel) and is_block_drafter(drafter) == block
        assert sum(p.numel() for p in drafter.parameters()) < sum(p.numel() for p in target.parameters())
        for chosen in (drafter, specdec.LookupDrafter(specdec.drafters.model_drafter(drafter))):
            results = specdec.speculative_generate(target, chosen, sources, tokenizer=tokenizer,
                                                   max_new_tokens=TRANSLATE_NEW, batch_size=2)
            assert [r.tokens for r in results] == expected, name
            assert sum(r.stats.accepted for r in results) > 0, name
    by_name = specdec.speculative_generate(target, "lookup+block", sources[0], tokenizer=tokenizer,
                                           max_new_tokens=TRANSLATE_NEW)
    assert by_name.tokens == expected[0]  # "block" names the shipped block drafter of an encoder-decoder target
