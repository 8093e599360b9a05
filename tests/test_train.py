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


def test_outputs_are_the_targets_own_continuations_and_generation_resumes(mini_corpus, tmp_path):
    """`specdec train outputs`: greedy records equal the target's own decoding of each prompt (an
    independent, unbatched reference), every 2nd prompt is sampled, a rerun only fills in what is
    missing, and the test split is refused."""
    import json

    from transformers import AutoTokenizer

    from specdec.data.prompts import function_prompts
    from specdec.train.outputs import generate_outputs

    root, tok_dir = mini_corpus
    target = train(_cfg(max_steps=20), tmp_path / "t", tok_dir, root=root)
    out = tmp_path / "outputs.jsonl"
    kw = {"num_prompts": 5, "batch_size": 2, "max_new_tokens": 6, "sampled_every": 2, "max_prompt_chars": 60,
          "root": root, "log": lambda m: None}
    assert generate_outputs(str(target), out, **kw) == 5
    records = [json.loads(line) for line in out.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(tok_dir)
    model = specdec.load_model(str(target))
    prompts = {p["id"]: p["prompt"] for p in function_prompts("train", max_chars=60, root=root)}
    assert sorted(r["temperature"] for r in records) == [0.0, 0.0, 0.0, 1.0, 1.0]
    for r in records:
        assert r["prompt_ids"] == tok(prompts[r["id"]])["input_ids"]
        assert 1 <= len(r["ids"]) <= 6
        if r["temperature"] == 0.0:
            own = specdec.autoregressive_generate(model, r["prompt_ids"], max_new_tokens=6)
            assert r["ids"] == own.tokens, r["id"]
    # an interrupted run: two records lost and a line cut short; the rerun generates just those
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:3]) + "\n" + lines[3][:10])
    seen = []
    assert generate_outputs(str(target), out, **{**kw, "log": seen.append}) == 5
    assert "2 to generate" in seen[0]
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == sorted(r["id"] for r in records)
    with pytest.raises(ValueError, match="test split is held out"):
        generate_outputs(str(target), out, **{**kw, "split": "test"})


def test_training_mixes_the_generated_outputs_into_each_batch(mini_corpus, tmp_path):
    """outputs_share of every batch's windows come from the outputs stream, whose looping
    continuations are left out; a drafter trains on the mix."""
    import json

    from specdec.train.lm import batch_at
    from specdec.train.outputs import outputs_stream

    out = tmp_path / "outputs.jsonl"
    loop = [7, 8] * 20
    out.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "prompt_ids": list(range(100, 140)), "ids": list(range(140, 200)), "temperature": 0.0},
        {"id": "b", "prompt_ids": [5, 6], "ids": loop, "temperature": 0.0},
        {"id": "c", "prompt_ids": list(range(200, 230)), "ids": list(range(230, 280)) + [0], "temperature": 1.0},
    ]) + "\n")
    stream = outputs_stream(out, eos=0)
    assert stream.tolist() == list(range(100, 200)) + [0] + list(range(200, 280)) + [0]
    corpus = torch.arange(1, 90).repeat(10)
    cfg = _cfg(batch_size=4, outputs_share=0.75)
    batch = batch_at(corpus, 3, cfg, stream)
    assert batch.shape == (4, cfg.seq_len + 1)
    assert [bool((row >= 100).any()) for row in batch] == [True, True, True, False]
    assert torch.equal(batch, batch_at(corpus, 3, cfg, stream))  # a pure function of (seed, step)
    assert outputs_stream(out, eos=0, records=2).tolist() == list(range(100, 200)) + [0]  # b loops: left out
    with pytest.raises(ValueError, match="holds 3 records, fewer than the 4"):
        outputs_stream(out, eos=0, records=4)
    with pytest.raises(FileNotFoundError, match="specdec train outputs"):
        outputs_stream(tmp_path / "missing.jsonl", eos=0)

    root, tok_dir = mini_corpus
    teacher = train(_cfg(max_steps=10), tmp_path / "t", tok_dir, root=root)
    from specdec.train.outputs import generate_outputs

    generate_outputs(str(teacher), tmp_path / "gen.jsonl", num_prompts=8, batch_size=4, max_new_tokens=20,
                     max_prompt_chars=60, root=root, log=lambda m: None)
    cfg = _cfg(max_steps=10, teacher=str(teacher), outputs=str(tmp_path / "gen.jsonl"))
    assert train(cfg, tmp_path / "d", tok_dir, root=root) is not None


def test_train_flags_parse_optional_numbers_as_numbers():
    """`specdec train lm` flags come from TrainConfig; an `int | None` field takes an int."""
    import argparse

    from specdec.train.cli import _config_from, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["train", "lm", "--preset", "code-drafter-s4", "--out", "x", "--tokenizer", "t",
                              "--outputs-records", "100", "--outputs-share", "0.25"])
    cfg = _config_from(args)
    assert (cfg.outputs_records == 100 and cfg.outputs_share == 0.25
            and cfg.outputs == PRESETS["code-drafter-s4"].outputs)


def test_card_pair_figures_read_spec_and_spec_lookup(tmp_path):
    """The card's figures come from a bench summary: ratios of mean tokens/s, lookup rows when run."""
    import json

    from specdec.train.card import pair_figures

    def row(method, temperature, rate, **extra):
        return {"method": method, "temperature": temperature, "mean_tokens_per_s": rate, "speedup": rate / 80,
                "speedup_non_loop": rate / 90, "alpha": 0.5, "tau": 2.5, "cost_ratio": 0.2, "greedy_equal": 20,
                "greedy_total": 20, "loop_prompts": 10, "prompts": 20, "error": None, **extra}

    rows = [row("plain-hf", 0.0, 80.0), row("plain", 0.0, 100.0), row("spec", 0.0, 120.0), row("spec", 1.0, 90.0)]
    summary = {"rows": rows, "prompts": ["a"] * 20, "config": {"max_new_tokens": 64, "gamma": [4]}, "environment": {}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    plain = pair_figures(tmp_path)
    assert plain["greedy_speedup_vs_plain"] == pytest.approx(1.2) and plain["greedy_speedup_vs_plain_hf"] == 1.5
    assert plain["lookup_greedy_speedup_vs_plain"] is None and plain["lookup_greedy_equal"] is None
    summary["rows"] += [row("spec-lookup", 0.0, 200.0, greedy_equal=19), row("spec-lookup", 1.0, 100.0)]
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    both = pair_figures(tmp_path)
    assert both["lookup_greedy_speedup_vs_plain"] == pytest.approx(2.0)
    assert both["lookup_greedy_speedup_vs_plain_hf"] == 2.5 and both["lookup_sampled_speedup_vs_plain_hf"] == 1.25
    assert both["lookup_greedy_equal"] == "19/20" and both["degenerate_loops"] == "10/20"
