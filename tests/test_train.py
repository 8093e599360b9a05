"""The training tool: a tiny run lowers the loss, reloads through specdec.load_model, and resumes."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

import specdec
from specdec.data.stdlib import _corpus_paths, split_of, stdlib_root
from specdec.data.tokenizer import train_tokenizer
from specdec.train.lm import build_model, stream_loss, tokenize_split, train
from specdec.train.presets import PRESETS


@pytest.fixture(scope="module")
def mini_corpus(tmp_path_factory):
    """A small 'stdlib' folder: a few real files of each split, so training takes seconds."""
    root = stdlib_root()
    dst = tmp_path_factory.mktemp("stdlib")
    wanted = {"train": 10, "validation": 2, "test": 2}
    for path in _corpus_paths(root):
        rel = path.relative_to(root).as_posix()
        s = split_of(rel)
        size = path.stat().st_size
        if wanted[s] and 2_000 < size < 30_000:
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            (dst / rel).write_text(text, encoding="utf-8")
            wanted[s] -= 1
        if not any(wanted.values()):
            break
    tok_dir = tmp_path_factory.mktemp("tok")
    from specdec.data.stdlib import load_split

    train_tokenizer([f.text for f in load_split("train", str(dst))], vocab_size=300).save_pretrained(tok_dir)
    return str(dst), tok_dir


def _cfg(**kw):
    return dataclasses.replace(PRESETS["tiny"], **kw)


def test_tiny_training_lowers_loss_and_loads_through_load_model(mini_corpus, tmp_path):
    root, tok_dir = mini_corpus
    cfg = _cfg(max_steps=30)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    val = tokenize_split(tok, "validation", root)
    torch.manual_seed(cfg.seed)
    before = stream_loss(build_model(cfg.shape, tok), val, cfg.seq_len, cfg.eval_windows)
    final = train(cfg, tmp_path / "run", tok_dir, root=root)
    assert final is not None and (final / "model.safetensors").exists()
    model = specdec.load_model(str(final))
    after = stream_loss(model, val, cfg.seq_len, cfg.eval_windows)
    assert after < before - 0.3, (before, after)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    # the saved model decodes through the public API
    res = specdec.autoregressive_generate(model, tok("def f(x):\n")["input_ids"], max_new_tokens=5,
                                          stop_token_ids=[])
    assert len(res.tokens) == 5


def test_resume_continues_from_the_saved_step_and_matches_an_uninterrupted_run(mini_corpus, tmp_path):
    root, tok_dir = mini_corpus
    cfg = _cfg(max_steps=20, save_every=5)
    assert train(cfg, tmp_path / "split", tok_dir, root=root, stop_at_step=10) is None
    state = (tmp_path / "split" / "checkpoint" / "state.json").read_text()
    assert '"step": 10' in state
    final_split = train(cfg, tmp_path / "split", tok_dir, root=root)
    final_whole = train(cfg, tmp_path / "whole", tok_dir, root=root)
    a = specdec.load_model(str(final_split)).state_dict()
    b = specdec.load_model(str(final_whole)).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    import json

    hist = json.loads((tmp_path / "split" / "checkpoint" / "state.json").read_text())["state"]["history"]
    assert [h["step"] for h in hist if "val_loss" in h] == [10, 20]
    shutil.rmtree(tmp_path)


def test_drafter_distillation_runs_against_a_teacher(mini_corpus, tmp_path):
    root, tok_dir = mini_corpus
    teacher = train(_cfg(max_steps=10), tmp_path / "t", tok_dir, root=root)
    cfg = _cfg(max_steps=10, teacher=str(teacher), kd_weight=0.5)
    final = train(cfg, tmp_path / "d", tok_dir, root=root)
    drafter = specdec.load_model(str(final))
    assert drafter.config.vocab_size == specdec.load_model(str(teacher)).config.vocab_size


def test_init_from_continues_a_saved_model(mini_corpus, tmp_path):
    """--init-from starts from saved weights (e.g. the shipped model), not from random ones."""
    root, tok_dir = mini_corpus
    first = train(_cfg(max_steps=30), tmp_path / "a", tok_dir, root=root)
    again = train(_cfg(max_steps=1, init_from=str(first), lr=1e-9, warmup_steps=1), tmp_path / "b", tok_dir,
                  root=root)
    a = specdec.load_model(str(first)).state_dict()
    b = specdec.load_model(str(again)).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-5, msg=k)
    # the model card follows the chain of stages: recipe and validation history cover both runs
    from specdec.train.card import _history, _recipe, _stages

    assert [d.name for d, _ in _stages(tmp_path / "b")] == ["a", "b"]
    recipe = _recipe("target", tmp_path / "b")
    assert recipe.startswith("Stage 1 (`a`): Trained from scratch") and "Stage 2 (`b`): continued from" in recipe
    assert str(first) in recipe and "30 steps" in recipe and "1 steps" in recipe
    assert [h["step"] for h in _history(tmp_path / "b") if "val_loss" in h] == [10, 20, 30, 31]
