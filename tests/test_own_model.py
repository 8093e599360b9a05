"""A drafter for the user's own target, on the user's own prompts: ``specdec data outputs`` then
``specdec train drafter``, end to end on tiny random targets of three architectures (a Llama, a GPT-2,
a Marian encoder-decoder), each saved to a folder with a tokenizer as a user's model would be.

Checked: the data are the target's own greedy continuations (against transformers' ``generate``), held
out by a stable hash; the drafter loads with ``AutoModelFor*`` and decodes exactly (greedy equal to
plain decoding of the target); an interrupted data step or training run (Ctrl-C included) resumes to
what an uninterrupted one writes; each bad input is one line on stderr, exit status 2, nothing written.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from tiny_models import build_tokenizer
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import specdec
from specdec.cli import main
from specdec.train.drafter import DrafterTrainConfig, train_drafter
from specdec.train.outputs import read_records, user_outputs, valid_path

NEW = 8  # new tokens per prompt
CODE = [f"def f{i}(x{i}):" for i in range(10)] + [f"for i in range({i}):" for i in range(10)] + [
    "class Point:", "import os", "    return a + b", "print(i, i * i)"]
SOURCES = ["the file is open", "save the file", "open a new window", "close all windows", "the window is new",
           "print the page", "a new page", "the page is saved", "quit", "open the file again", "undo", "redo"]


def _save_causal(arch: str, folder: Path) -> Path:
    tok = build_tokenizer()
    common = {"vocab_size": len(tok), "bos_token_id": tok.eos_token_id, "eos_token_id": tok.eos_token_id,
              "initializer_range": 0.3}
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128, tie_word_embeddings=False, **common))
        tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    else:
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **common))
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def _save_marian(folder: Path) -> Path:
    from specdec.train.seq2seq import Seq2SeqShape, build_model

    tok = AutoTokenizer.from_pretrained(specdec.default_model_path("translate-target"))
    torch.manual_seed(0)
    model = build_model(Seq2SeqShape(16, 1, 2, 2, 32, 64), tok, dropout=0.0)
    model.config.init_std = 0.3
    model.init_weights()  # spread logits: no greedy near-ties
    model.generation_config.decoder_start_token_id = tok.pad_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """arch -> (target folder, prompts file)."""
    root = tmp_path_factory.mktemp("own")
    out = {}
    for arch in ("llama", "gpt2"):
        target = _save_causal(arch, root / arch)
        lines = [json.dumps({"prompt": p}) for p in CODE]
        if arch == "llama":  # chat messages, rendered by the target's chat template
            lines += [json.dumps({"messages": [{"role": "user", "content": f"write f{i}"}]}) for i in range(3)]
        prompts = root / f"{arch}.jsonl"
        prompts.write_text("\n".join(lines) + "\n")
        out[arch] = (target, prompts)
    prompts = root / "sources.txt"
    prompts.write_text("\n".join(SOURCES) + "\n")
    out["marian"] = (_save_marian(root / "marian"), prompts)
    return out


def _data(target: Path, prompts: Path, out: Path, **kw) -> dict:
    args = {"max_new_tokens": NEW, "batch_size": 4, "valid_share": 0.25, "progress": False, "log": lambda m: None}
    return user_outputs(str(target), prompts, out, **{**args, **kw})


def _hf_greedy(model, ids: list[int]) -> list[int]:
    """transformers' own greedy continuation (cut after the first eos, as ours stops there)."""
    x = torch.tensor([ids])
    if model.config.is_encoder_decoder:
        new = model.generate(input_ids=x, max_new_tokens=NEW, do_sample=False, num_beams=1)[0, 1:].tolist()
    else:
        new = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False)[0, len(ids):]
        new = new.tolist()
    eos = model.generation_config.eos_token_id
    return new[: new.index(eos) + 1] if eos in new else new


@pytest.mark.parametrize("arch", ["llama", "gpt2", "marian"])
def test_data_then_drafter_decodes_exactly(arch, targets, tmp_path):
    """data -> drafter -> the drafter loads with AutoModel* and speculative decoding with it equals plain
    decoding of the target on the held-out prompts; records are the target's own greedy outputs."""
    target_dir, prompts = targets[arch]
    out = tmp_path / "data.jsonl"
    counts = _data(target_dir, prompts, out, sampled_share=0.3)
    train, held = read_records(out), read_records(valid_path(out))
    total = len(CODE) + 3 if arch == "llama" else len(CODE) if arch == "gpt2" else len(SOURCES)
    assert counts == {str(out): len(train), str(valid_path(out)): len(held)} and len(train) + len(held) == total
    assert held and train and {r["temperature"] for r in train + held} == {0.0, 1.0}
    target = specdec.load_model(str(target_dir))
    for r in (train + held)[:6]:
        if r["temperature"] == 0.0:
            assert r["ids"] == _hf_greedy(target, r["prompt_ids"]), r["id"]
    final = train_drafter(DrafterTrainConfig(target=str(target_dir), data=str(out), layers=1, hidden=16, steps=4,
                                             batch_size=4, eval_every=2, save_every=2), tmp_path / "run",
                          measure_prompts=3, measure_tokens=NEW, progress=False, log=lambda m: None)
    auto = AutoModelForSeq2SeqLM if arch == "marian" else AutoModelForCausalLM
    drafter = auto.from_pretrained(final).eval()
    assert type(drafter) is type(target) and drafter.config.hidden_size == 16
    assert AutoTokenizer.from_pretrained(final).get_vocab() == AutoTokenizer.from_pretrained(target_dir).get_vocab()
    prompts_ids = [r["prompt_ids"] for r in held]
    plain = specdec.autoregressive_generate(target, prompts_ids, max_new_tokens=NEW)
    spec = specdec.speculative_generate(target, drafter, prompts_ids, max_new_tokens=NEW, gamma=3)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert sum(r.stats.drafted for r in spec) > 0
    card = (final / "README.md").read_text()
    figures = json.loads((final / "training.json").read_text())["figures"]
    assert figures["greedy_equal"] == figures["prompts"] == min(3, len(held))
    assert f"| acceptance rate α | {figures['greedy_alpha']:.3f} |" in card and str(out) in card


def test_first_layers_drafter_is_the_targets_first_layers(targets, tmp_path):
    """--init first-layers copies the target's embeddings, first layers, norm and head: before any step
    its logits equal the target's own computed with the later layers skipped."""
    from specdec.train.drafter import build_drafter

    target = specdec.load_model(str(targets["llama"][0]))
    drafter = build_drafter(target, DrafterTrainConfig(layers=1, init="first-layers")).eval()
    assert drafter.config.num_hidden_layers == 1 and drafter.config.hidden_size == target.config.hidden_size
    ids = torch.tensor([[5, 9, 30, 7]])
    skipped = target.model.layers[1]
    target.model.layers = target.model.layers[:1]
    try:
        torch.testing.assert_close(drafter(ids).logits, target(ids).logits)
    finally:
        target.model.layers.append(skipped)
    # a shrunk copy starts from the target's embeddings and (untied) head, projected when narrower
    from specdec.train.drafter import _projection

    for hidden in (32, 16):
        shrunk = build_drafter(target, DrafterTrainConfig(layers=1, hidden=hidden))
        proj = torch.eye(32) if hidden == 32 else _projection(target, hidden)
        for mine, theirs in ((shrunk.get_input_embeddings(), target.get_input_embeddings()),
                             (shrunk.get_output_embeddings(), target.get_output_embeddings())):
            torch.testing.assert_close(mine.weight, theirs.weight @ proj)
        assert shrunk.config.intermediate_size == 64 * hidden // 32 and shrunk.config.head_dim == hidden // 4
    # an encoder-decoder keeps the target's whole encoder and its first decoder layers
    marian = specdec.load_model(str(targets["marian"][0]))
    drafter = build_drafter(marian, DrafterTrainConfig(layers=1, init="first-layers")).eval()
    assert (drafter.config.encoder_layers, drafter.config.decoder_layers) == (1, 1)
    source, start = torch.tensor([[40, 41, 42, 0]]), torch.tensor([[marian.config.decoder_start_token_id, 50]])
    marian.model.decoder.layers = marian.model.decoder.layers[:1]
    torch.testing.assert_close(drafter(input_ids=source, decoder_input_ids=start).logits,
                               marian(input_ids=source, decoder_input_ids=start).logits)


def test_data_step_resumes_to_an_uninterrupted_run(targets, tmp_path):
    """A killed data step (records lost, a line cut short) rerun equals one uninterrupted run, sampled
    records included (each row has its own seed, whatever batch it lands in)."""
    target_dir, prompts = targets["gpt2"]
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    _data(target_dir, prompts, whole, sampled_share=0.5)
    _data(target_dir, prompts, cut, sampled_share=0.5, num_prompts=9)
    lines = cut.read_text().splitlines()
    cut.write_text("\n".join(lines[:4]) + "\n" + lines[4][:15])
    _data(target_dir, prompts, cut, sampled_share=0.5, batch_size=3)
    for a, b in ((whole, cut), (valid_path(whole), valid_path(cut))):
        assert {r["id"]: r for r in read_records(a)} == {r["id"]: r for r in read_records(b)}


def test_a_drafter_without_held_out_records_says_it_is_not_measured(targets, tmp_path):
    """Data made with --valid-share 0: the run says why it measures nothing (and its card), not silence."""
    target_dir, prompts = targets["gpt2"]
    data = tmp_path / "data.jsonl"
    _data(target_dir, prompts, data, valid_share=0.0)
    assert read_records(data) and not read_records(valid_path(data))
    said: list[str] = []
    final = train_drafter(DrafterTrainConfig(target=str(target_dir), data=str(data), layers=1, steps=2, batch_size=4),
                          tmp_path / "run", progress=False, log=said.append)
    assert [m for m in said if m.startswith("not measured: no held-out records") and "--valid-share" in m], said
    assert "Not measured" in (final / "README.md").read_text()


def test_training_resumes_after_a_stop_and_ctrl_c(targets, tmp_path):
    """Stopped at a step, or by Ctrl-C (a checkpoint written), the run resumes to the same weights as
    one uninterrupted run."""
    target_dir, prompts = targets["llama"]
    data = tmp_path / "data.jsonl"
    _data(target_dir, prompts, data)
    cfg = DrafterTrainConfig(target=str(target_dir), data=str(data), layers=1, steps=5, batch_size=3, save_every=2,
                             eval_every=3)
    kw = {"measure": False, "progress": False, "log": lambda m: None}
    whole = train_drafter(cfg, tmp_path / "whole", **kw)
    assert train_drafter(cfg, tmp_path / "stopped", stop_at_step=3, **kw) is None
    stopped = train_drafter(cfg, tmp_path / "stopped", **kw)

    def ctrl_c(message: str) -> None:  # Ctrl-C while step 3's record is logged: the run stops after that step
        if message.startswith("[ctrl-c] step 3/"):
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        train_drafter(cfg, tmp_path / "ctrl-c", measure=False, progress=False, log=ctrl_c)
    assert json.loads((tmp_path / "ctrl-c" / "checkpoint" / "state.json").read_text())["state"]["step"] == 3
    resumed = train_drafter(cfg, tmp_path / "ctrl-c", **kw)
    reference = AutoModelForCausalLM.from_pretrained(whole).state_dict()
    for other in (stopped, resumed):
        state = AutoModelForCausalLM.from_pretrained(other).state_dict()
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)


def _run(capsys, *argv: str) -> str:
    """Run the CLI; it must fail with exit status 2 and one line on stderr, which is returned."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_prompts_are_one_line_errors_and_write_nothing(targets, tmp_path, capsys):
    llama, _ = targets["llama"]
    gpt2, _ = targets["gpt2"]
    out = tmp_path / "out.jsonl"
    data = ["data", "outputs", "--out", str(out), "--max-new-tokens", "4"]
    files = {"empty.txt": b"\n  \n", "binary.txt": b"\x00\x01\xff\xfe",
             "lacking.jsonl": b'{"prompt": "a"}\n{"text": "b"}\n',
             "messages.jsonl": b'{"messages": [{"role": "user", "content": "hi"}]}\n'}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    assert "does not exist" in _run(capsys, *data, "--target", str(llama), "--prompts", str(tmp_path / "missing.txt"))
    assert "holds no prompt" in _run(capsys, *data, "--target", str(llama), "--prompts", str(tmp_path / "empty.txt"))
    assert "is binary" in _run(capsys, *data, "--target", str(llama), "--prompts", str(tmp_path / "binary.txt"))
    err = _run(capsys, *data, "--target", str(llama), "--prompts", str(tmp_path / "lacking.jsonl"))
    assert "lacking.jsonl, line 2" in err and '"prompt", "messages" or "source"' in err
    err = _run(capsys, *data, "--target", str(gpt2), "--prompts", str(tmp_path / "messages.jsonl"))
    assert "chat template" in err and "line 1" in err
    bare = tmp_path / "bare"  # a model folder without its tokenizer
    bare.mkdir()
    for f in llama.iterdir():
        if f.name in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, bare / f.name)
    err = _run(capsys, *data, "--target", str(bare), "--prompts", str(tmp_path / "messages.jsonl"))
    assert "has no tokenizer" in err
    assert not out.exists() and not valid_path(out).exists()


def test_bad_drafter_settings_are_one_line_errors_and_write_nothing(targets, tmp_path, capsys):
    llama, prompts = targets["llama"]
    gpt2, _ = targets["gpt2"]
    data = tmp_path / "data.jsonl"
    _data(llama, prompts, data)
    out = tmp_path / "run"
    train = ["train", "drafter", "--data", str(data), "--out", str(out), "--steps", "2", "--no-measure"]
    assert "give 1..2" in _run(capsys, *train, "--target", str(llama), "--layers", "0")
    assert "give 1..2" in _run(capsys, *train, "--target", str(llama), "--layers", "3")
    assert "not divisible by the target's head count (4)" in _run(capsys, *train, "--target", str(llama),
                                                                   "--hidden", "18")
    assert "keeps the target's width" in _run(capsys, *train, "--target", str(llama), "--hidden", "16",
                                              "--init", "first-layers")
    assert "written for another target" in _run(capsys, *train, "--target", str(gpt2))
    assert not out.exists()
    # a run folder of other settings is refused, naming the setting
    assert main([*train, "--target", str(llama), "--layers", "1", "--stop-at-step", "1"]) == 0
    capsys.readouterr()
    err = _run(capsys, *train, "--target", str(llama), "--layers", "1", "--lr", "0.01")
    assert "--lr 0.001, not 0.01" in err and "to resume" in err
    # a data file for another target is refused by the data step too
    gpt2_prompts = targets["gpt2"][1]
    err = _run(capsys, "data", "outputs", "--target", str(gpt2), "--prompts", str(gpt2_prompts), "--out", str(data))
    assert "written for another target" in err
