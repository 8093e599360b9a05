"""A .gguf file as a target (specdec.gguf): read through transformers' GGUF loading, decoded exactly.

The GGUF is written here with the ``gguf`` package (llama.cpp's layout: q8_0 matrices, q/k rows permuted as
llama.cpp's converter permutes them) from a tiny random Llama with the shipped tokenizer; the reference is the model
transformers itself loads from that file, and its ``generate``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_same_greedy, hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import specdec
from specdec import cli
from specdec.folders import models_dir, resolve_model_path

gguf = pytest.importorskip("gguf", reason="the dev extra installs gguf")  # pyproject's dev: always there in CI

HEADS, KV_HEADS = 4, 2
PARTS = [("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
         ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
         ("mlp.down_proj", "ffn_down"), ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")]


def _permute(a: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf: rotary halves interleaved
    return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def write_gguf(path: Path, architecture: str = "llama") -> LlamaForCausalLM:
    """A tiny random Llama as llama.cpp writes it (q8_0 matrices), the shipped tokenizer in its metadata."""
    tok = json.loads((models_dir() / "code-target" / "tokenizer.json").read_text())
    tokens = [""] * len(tok["model"]["vocab"])
    for text, i in tok["model"]["vocab"].items():
        tokens[i] = text
    added = {a["id"] for a in tok.get("added_tokens", [])}
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, rms_norm_eps=1e-6)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.ndim == 2 else 1.0)  # a spread of logits: no near ties in 24 tokens
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(64 // HEADS)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for i in range(2) for hf, g in PARTS})
    for name, tensor in model.state_dict().items():
        a = tensor.float().numpy()
        a = _permute(a, HEADS) if "q_proj" in name else _permute(a, KV_HEADS) if "k_proj" in name else a
        if a.ndim == 2:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(names[name], q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(names[name], a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture()
def gguf_file(tmp_path, monkeypatch) -> tuple[Path, LlamaForCausalLM]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "g").mkdir()
    source = write_gguf(tmp_path / "g" / "tiny-q8_0.gguf")
    return tmp_path / "g" / "tiny-q8_0.gguf", source


def test_a_gguf_target_decodes_as_the_model_transformers_reads_from_it(gguf_file, monkeypatch) -> None:
    path, source = gguf_file
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    q = reference.model.layers[0].self_attn.q_proj.weight  # read back un-permuted, q8_0's rounding only
    assert not torch.equal(q, source.model.layers[0].self_attn.q_proj.weight)
    assert torch.allclose(q, source.model.layers[0].self_attn.q_proj.weight, atol=0.01)
    model = specdec.load_model(path)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in reference.parameters())
    prompts = [tokenizer("def parse(line):\n    ").input_ids, tokenizer("import os\n").input_ids]
    for drafter in ("ngram", "code-drafter"):  # the shipped drafter shares the tokenizer the file carries
        results = specdec.speculative_generate(model, drafter, prompts, max_new_tokens=24, stop_token_ids=[],
                                               batch_size=2)
        for prompt, result in zip(prompts, results):
            assert_same_greedy(reference, prompt, result.tokens, hf_greedy(reference, prompt, 24, []))
    folder = resolve_model_path(path)  # written once, then reused: transformers' GGUF loading is not run again
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", None)
    assert resolve_model_path(str(path)) == folder and (folder / "tokenizer.json").is_file()
    assert specdec.load_tokenizer(path)("import os\n").input_ids == prompts[1]


def test_the_cli_takes_a_gguf_target(gguf_file, capsys) -> None:
    path, _ = gguf_file
    assert cli.main(["generate", "def f(x):", "--target", str(path), "--drafter", "code-drafter",
                     "--max-new-tokens", "8", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["stats"]["new_tokens"] == 8
    assert out.err.count("reading it through transformers' GGUF loader") == 1


def test_gguf_files_it_cannot_read_are_one_line(gguf_file, tmp_path, monkeypatch, capsys) -> None:
    path, _ = gguf_file
    write_gguf(tmp_path / "g" / "other.gguf", architecture="bert-like")
    assert cli.main(["generate", "x", "--target", str(tmp_path / "g" / "other.gguf"), "--drafter", "ngram"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cannot read a 'bert-like' model from GGUF" in err and "llama" in err
    (tmp_path / "g" / "junk.gguf").write_bytes(b"not a gguf file at all")
    assert cli.main(["generate", "x", "--target", str(tmp_path / "g" / "junk.gguf"), "--drafter", "ngram"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is not a GGUF file" in err
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # the package missing
    assert cli.main(["generate", "x", "--target", str(path), "--drafter", "ngram"]) == 2
    assert capsys.readouterr().err.strip().endswith("needs the gguf package: pip install gguf")
    assert not (tmp_path / "cache" / "specdec" / "gguf").exists()
