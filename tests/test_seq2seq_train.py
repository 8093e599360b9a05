"""The encoder-decoder training tool: a tiny Marian run learns, resumes exactly, ships, distils.

The corpus is a small synthetic word-for-word 'translation' written by the test (no catalogues)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from safetensors import safe_open
from tiny_models import toy_corpus, train_texts
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, MarianMTModel

from specdec.data.seq2seq_tokenizer import train_seq2seq_tokenizer
from specdec.train.seq2seq import (
    PRESETS,
    Example,
    agreement,
    batch_indices,
    evaluate,
    export,
    load_examples,
    read_translations,
    train_seq2seq,
    write_translations,
)

WORDS = {"open": "öffnen", "file": "Datei", "the": "die", "cannot": "kann nicht", "save": "speichern",
         "new": "neue", "folder": "Ordner", "error": "Fehler", "%s": "%s", "copy": "kopieren"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("s2s")
    data = toy_corpus(WORDS, {"train": 160, "validation": 16, "test": 12}, 5, root / "data")
    train_seq2seq_tokenizer(train_texts(data), vocab_size=300).save_pretrained(root / "tok")
    cfg = dataclasses.replace(PRESETS["tiny"], data=str(data), tokenizer=str(root / "tok"))
    final = train_seq2seq(cfg, root / "run", log=lambda m: None)
    return root, cfg, final


def test_tiny_run_learns_and_loads_without_specdec(setup):
    _root, _cfg, final = setup
    history = json.loads((final / "training.json").read_text())["state"]["history"]
    losses = [r["val_loss"] for r in history if "val_loss" in r]
    assert len(losses) == 2 and losses[-1] < losses[0]
    model = AutoModelForSeq2SeqLM.from_pretrained(final)
    assert isinstance(model, MarianMTModel) and (final / "model.safetensors").is_file()
    tok = AutoTokenizer.from_pretrained(final)
    assert model.config.decoder_start_token_id == tok.pad_token_id == 0
    assert model.generation_config.num_beams == 1 and not model.generation_config.do_sample
    out = model.generate(**tok(["open the file"], return_tensors="pt"), max_new_tokens=8)
    assert out[0, 0] == 0 and out.shape[1] <= 9
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_resume_reproduces_the_uninterrupted_run(setup, tmp_path):
    _root, cfg, final = setup
    assert train_seq2seq(cfg, tmp_path / "run", stop_at_step=7, log=lambda m: None) is None
    resumed = train_seq2seq(cfg, tmp_path / "run", log=lambda m: None)
    a = AutoModelForSeq2SeqLM.from_pretrained(final).state_dict()
    b = AutoModelForSeq2SeqLM.from_pretrained(resumed).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_resume_with_dropout_is_bit_identical(setup, tmp_path):
    """With dropout on, a resumed run draws the masks an uninterrupted one draws (the checkpoint holds the
    random generators): the weights end bit-identical."""
    _root, cfg, _ = setup
    cfg = dataclasses.replace(cfg, dropout=0.1, max_steps=12, eval_every=6, save_every=6)
    whole = train_seq2seq(cfg, tmp_path / "whole", log=lambda m: None)
    assert train_seq2seq(cfg, tmp_path / "run", stop_at_step=5, log=lambda m: None) is None
    torch.rand(7)  # the generator moves on in between, as in another session
    resumed = train_seq2seq(cfg, tmp_path / "run", log=lambda m: None)
    a = AutoModelForSeq2SeqLM.from_pretrained(whole).state_dict()
    b = AutoModelForSeq2SeqLM.from_pretrained(resumed).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_batches_are_a_pure_function_of_step_and_cover_each_epoch():
    cfg = dataclasses.replace(PRESETS["tiny"], batch_size=7)
    lengths = [random.Random(i).randint(2, 40) for i in range(100)]
    per_epoch = 15  # ceil(100 / 7)
    epoch = [i for s in range(per_epoch) for i in batch_indices(lengths, cfg, s)]
    assert sorted(epoch) == list(range(100))
    assert batch_indices(lengths, cfg, 3) == batch_indices(lengths, cfg, 3)
    assert [batch_indices(lengths, cfg, s) for s in range(per_epoch, 2 * per_epoch)] != \
        [batch_indices(lengths, cfg, s) for s in range(per_epoch)]


def test_translations_resume_and_a_model_agrees_with_its_own_greedy_output(setup, tmp_path):
    _root, cfg, final = setup
    full = tmp_path / "full.jsonl"
    assert write_translations(final, cfg.data, full, split="validation", batch_size=5, log=lambda m: None) == 16
    part = tmp_path / "part.jsonl"
    lines = full.read_text(encoding="utf-8").splitlines(keepends=True)
    part.write_text("".join(lines[:6]) + lines[6][:10], encoding="utf-8")  # an interrupted write
    assert write_translations(final, cfg.data, part, split="validation", batch_size=5, log=lambda m: None) == 16
    assert read_translations(part) == read_translations(full)
    records = read_translations(full)
    assert sorted(records) == list(range(16))
    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForSeq2SeqLM.from_pretrained(final)
    one = model.generate(**tok([records[3]["src"]], return_tensors="pt"), max_new_tokens=64)[0, 1:].tolist()
    assert records[3]["ids"] == one[: one.index(1) + 1] if 1 in one else one
    assert agreement(final, full, batch_size=4)["top1_agreement"] == 1.0  # teacher forcing = its own greedy
    with pytest.raises(ValueError, match="held out"):
        write_translations(final, cfg.data, tmp_path / "t.jsonl", split="test")


def test_distillation_reads_translations_and_refuses_a_foreign_file(setup, tmp_path):
    _root, cfg, final = setup
    path = tmp_path / "train.jsonl"
    write_translations(final, cfg.data, path, split="train", batch_size=32, log=lambda m: None)
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
    kd = dataclasses.replace(cfg, translations=str(path))
    examples = load_examples(kd, tok, "train")
    records = read_translations(path)
    kept = [i for i in range(160) if 1 < len(records[i]["ids"]) <= cfg.max_tokens]
    assert [e.tgt for e in examples] == [records[i]["ids"] for i in kept
                                         if len(tok(records[i]["src"])["input_ids"]) <= cfg.max_tokens]
    lines = path.read_text(encoding="utf-8").splitlines()
    partial = tmp_path / "partial.jsonl"  # a file still being written: only what it holds is used
    partial.write_text("\n".join(lines[:40]) + "\n", encoding="utf-8")
    first = sorted(json.loads(x)["i"] for x in lines[:40])
    got = load_examples(dataclasses.replace(cfg, translations=str(partial)), tok, "train")
    assert [e.tgt for e in got] == [records[i]["ids"] for i in first if 1 < len(records[i]["ids"]) <= cfg.max_tokens
                                    and len(tok(records[i]["src"])["input_ids"]) <= cfg.max_tokens]
    bad = json.loads(lines[0])
    bad["src"] = "something else"
    path.write_text("\n".join([json.dumps(bad)] + lines[1:]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="another corpus"):
        load_examples(kd, tok, "train")


def test_export_bf16_and_evaluate_the_stored_weights(setup, tmp_path):
    root, cfg, final = setup
    dst = export(final, tmp_path / "shipped", dtype="bf16")
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert dtypes == {torch.bfloat16}
    results = evaluate(dst, cfg.data, split="test", beams=(1, 2), hypotheses_dir=tmp_path / "hyp")
    assert [(q.num_beams, q.sentences) for q in results] == [(1, 12), (2, 12)]
    assert all(0 <= q.bleu <= 100 and 0 <= q.chrf <= 100 for q in results)
    hyps = [json.loads(x) for x in (tmp_path / "hyp/test.beam1.txt").read_text(encoding="utf-8").splitlines()]
    import sacrebleu

    refs = [json.loads(x)["tgt"] for x in (root / "data/test.jsonl").read_text(encoding="utf-8").splitlines()]
    assert results[0].bleu == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)


def test_stage_two_continues_from_a_trained_model(setup, tmp_path):
    _root, cfg, final = setup
    stage1 = json.loads((final / "training.json").read_text())["state"]["history"]
    cfg2 = dataclasses.replace(cfg, init_from=str(final), max_steps=10, eval_every=10, seed=1)
    stage2 = train_seq2seq(cfg2, tmp_path / "s2", log=lambda m: None)
    history = json.loads((stage2 / "training.json").read_text())["state"]["history"]
    first = next(r["val_loss"] for r in stage1 if "val_loss" in r)  # fresh weights after 10 steps
    assert history[-1]["val_loss"] < first
    assert AutoModelForSeq2SeqLM.from_pretrained(stage2).config.d_model == cfg.shape.d_model


def test_cli_translations_references_trains_on_the_references(setup, tmp_path):
    """`--translations references` overrides a distillation preset back to the reference translations."""
    from specdec.cli import main

    _root, cfg, _final = setup
    out = tmp_path / "run"
    assert main(["train", "seq2seq", "--preset", "translate-drafter", "--translations", "references",
                 "--data", cfg.data, "--tokenizer", cfg.tokenizer, "--max-steps", "1", "--warmup-steps", "1",
                 "--eval-pairs", "4", "--out", str(out)]) == 0
    config = json.loads((out / "final" / "training.json").read_text())["config"]
    assert config["translations"] is None and config["max_steps"] == 1


def test_block_drafter_trains_resumes_loads_without_specdec_and_drafts_exactly(setup, tmp_path):
    """`specdec train seq2seq-block-drafter`: SpecDec's block drafter, encoder and embeddings from the target."""
    from specdec import speculative_generate
    from specdec.drafters.block import is_block_drafter
    from specdec.train.seq2seq_block import Seq2SeqBlockConfig, block_rows, train_seq2seq_block

    _root, cfg, final = setup
    path = tmp_path / "train.jsonl"
    write_translations(final, cfg.data, path, split="train", batch_size=32, log=lambda m: None)
    block_cfg = Seq2SeqBlockConfig(target=str(final), data=cfg.data, translations=str(path), decoder_layers=1,
                                   max_block_size=4, batch_size=8, max_steps=24, eval_every=12, save_every=12,
                                   eval_pairs=8, warmup_steps=2, lr=3e-3, dropout=0.0)
    drafter_dir = train_seq2seq_block(block_cfg, tmp_path / "run", log=lambda m: None)
    history = json.loads((drafter_dir / "training.json").read_text())["state"]["history"]
    losses = [r["train_loss"] for r in history if "train_loss" in r]
    assert losses[-1] < losses[0]
    assert [len(r["accuracy_by_position"]) for r in history if "accepted_per_block" in r] == [4, 4]
    assert train_seq2seq_block(block_cfg, tmp_path / "cut", stop_after_s=0, log=lambda m: None) is None
    resumed = train_seq2seq_block(block_cfg, tmp_path / "cut", log=lambda m: None)
    a = AutoModelForSeq2SeqLM.from_pretrained(drafter_dir).state_dict()
    b = AutoModelForSeq2SeqLM.from_pretrained(resumed).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5, msg=k)

    drafter = AutoModelForSeq2SeqLM.from_pretrained(drafter_dir)  # a plain MarianMTModel: no specdec needed
    assert isinstance(drafter, MarianMTModel) and is_block_drafter(drafter)
    tok = AutoTokenizer.from_pretrained(final)
    assert drafter.config.block_drafter == {"mask_token_id": tok.unk_token_id, "max_block_size": 4}
    assert drafter.config.decoder_layers == 1
    target = AutoModelForSeq2SeqLM.from_pretrained(final).eval()
    sources = [tok(p)["input_ids"] for p in ("open the file", "cannot save the new folder %s", "copy")]
    references = [target.generate(torch.tensor([s]), max_new_tokens=12)[0, 1:].tolist() for s in sources]
    results = speculative_generate(target, drafter, sources, max_new_tokens=12, gamma=4, batch_size=2,
                                   stop_token_ids=[tok.eos_token_id])
    assert [r.tokens for r in results] == [ref[: ref.index(1) + 1] if 1 in ref else ref for ref in references]

    rows = block_rows([Example([5, 1], [7, 8, 9, 1])], [2], 3, start=0, mask=2, pad=0)
    assert rows.decoder_input_ids.tolist() == [[0, 7, 8, 2, 2, 2]]
    assert rows.block_labels.tolist() == [[-100, -100, -100, 9, 1, -100]]  # y[2], y[3]; past the end unscored
    assert rows.prefix_labels.tolist() == [[7, 8, 9, -100, -100, -100]]
