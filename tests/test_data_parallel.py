"""Data parallel training (``specdec.train.parallel``): the trainers, launched unchanged as two gloo
processes by ``torchrun`` or ``accelerate launch``, take the optimizer steps one process takes, and a
checkpoint written by two processes resumes with one.

Tolerance. Each step's global batch is split over the processes and their gradients summed, so two
processes compute the same update as one; what differs is the order of float32 sums (each process's
smaller, less padded batch, then the all-reduce), about 1e-7 relative per operation. Measured on
these runs: the weights (of order 1) differ by at most 2e-7 (drafter) and 1.2e-7 (block drafter),
and the recorded losses and figures (rounded to 4 digits) not at all. The tolerances, 1e-5 on the
weights and 1e-4 relative on the history, leave a margin of 50 and still fail on a real divergence:
with the gradients left unsynced (each process stepping on its own rows) the drafter's weights
differ by 2e-2 and its losses by 5e-3 relative. The models have no dropout (each process would draw
its own masks). The acceptance head's own test is in test_heads.py.
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from conftest import build_tiny, char_tokenizer
from safetensors.torch import load_file
from tiny_models import build_tokenizer, toy_corpus, train_texts
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.train.block import train_block_drafter
from specdec.train.drafter import DrafterTrainConfig, train_drafter
from specdec.train.outputs import read_records, user_outputs
from specdec.train.presets import BlockTrainConfig

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [f"def f{i}(x{i}):" for i in range(12)] + [f"for i in range({i}):" for i in range(12)]
TIMING = {"elapsed_s", "seconds", "tokens_per_s", "pairs_per_s"}  # wall-clock figures, not compared


def _launch(launcher: str, *argv: str) -> str:
    """``specdec ARGV`` (or ``python SCRIPT.py ARGS``) as two gloo processes; returns their stdout (the run
    must succeed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    program = list(argv) if argv[0].endswith(".py") else ["-m", "specdec", *argv]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", port, *program]
    else:
        # accelerate's --cpu starts one process (or mpirun); --multi_gpu starts N with torchrun's launcher, and
        # the trainer's CPU device makes them gloo processes
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines",
               "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1",
               "--main_process_port", port, *program]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def _same_history(one: list[dict], two: list[dict], skip: frozenset = frozenset()) -> None:
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        assert a.keys() == b.keys(), (a, b)
        for key in a.keys() - TIMING - skip:
            assert _close(a[key], b[key]), (a["step"], key, a[key], b[key])


def _close(a: object, b: object) -> bool:
    """Equal figures up to summation order: numbers (and lists of them) approximately, None (a depth no round
    reached, say) exactly."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if a is None or b is None or isinstance(a, (str, bool)):
        return a == b
    return b == pytest.approx(a, rel=1e-4, abs=1e-6)


def _same_weights(one: Path, two: Path) -> None:
    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith("k_proj.bias"):
            # a key bias shifts all of a query's scores by one amount, which softmax cancels: its gradient is zero but
            # for rounding, whose sign depends on the summation order, and Adam makes a full step of that sign (on
            # the AMD EPYC the cross-attention's key bias drifted past 1e-5 between one process and two)
            continue
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama target folder (no dropout) and its `specdec data outputs` file."""
    root = tmp_path_factory.mktemp("ddp")
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                         initializer_range=0.3))
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    user_outputs(str(root / "target"), root / "prompts.txt", root / "data.jsonl", max_new_tokens=8, batch_size=8,
                 valid_share=0.25, progress=False, log=lambda m: None)
    return root / "target", root / "data.jsonl"


def test_two_processes_train_a_drafter_as_one_and_their_checkpoint_resumes_with_one(own, tmp_path):
    """`specdec train drafter` (the shared optimizer loop of every encoder-decoder trainer too) under
    torchrun: the history and the drafter equal one process's; stopped at step 4 by two processes, the
    run resumes with one and ends where one process's uninterrupted run ends. A batch of all records but
    one makes each epoch's second batch a single row, which both processes compute whole."""
    target, data = own
    batch = len(read_records(data)) - 1
    cfg = DrafterTrainConfig(target=str(target), data=str(data), layers=1, hidden=16, steps=8, batch_size=batch,
                             eval_every=2, save_every=4, lr=3e-3, warmup_steps=2)
    flags = ["--target", str(target), "--data", str(data), "--layers", "1", "--hidden", "16", "--steps", "8",
             "--batch-size", str(batch), "--eval-every", "2", "--save-every", "4", "--lr", "3e-3", "--warmup-steps",
             "2", "--no-measure"]
    stdout = _launch("torchrun", "train", "drafter", "--out", str(tmp_path / "two"), *flags)
    assert stdout.count("2 processes") == 1, stdout  # the main process alone logs
    _launch("torchrun", "train", "drafter", "--out", str(tmp_path / "mixed"), "--stop-at-step", "4", *flags)
    assert not (tmp_path / "mixed" / "final").exists()
    quiet = {"measure": False, "progress": False, "log": lambda m: None}
    one = train_drafter(cfg, tmp_path / "one", **quiet)
    mixed = train_drafter(cfg, tmp_path / "mixed", **quiet)  # the two-process checkpoint, resumed by one process
    two = json.loads((tmp_path / "two" / "final" / "training.json").read_text())
    assert two["processes"] == 2 and json.loads((one / "training.json").read_text())["processes"] == 1
    history = json.loads((one / "training.json").read_text())["state"]["history"]
    assert [r["step"] for r in history if "val_kl" in r] == [2, 4, 6, 8] and "train_loss" in history[-1]
    _same_history(history, two["state"]["history"])
    # a resumed run's last train_loss is the mean of its own steps since the resume (so for one process too)
    _same_history(history, json.loads((mixed / "training.json").read_text())["state"]["history"], {"train_loss"})
    for other in (tmp_path / "two" / "final", mixed):
        _same_weights(one, other)
    assert (tmp_path / "two" / "final" / "README.md").is_file()


def test_two_processes_train_a_parallel_drafter_with_glancing_as_one(tmp_path):
    """`specdec train parallel-drafter` with glancing under torchrun: each process guesses its rows' blocks and takes
    its rows of the step's draws (one per global row and position), so the history and the drafter equal one
    process's."""
    from specdec.train.parallel_drafter import ParallelDrafterTrainConfig, train_parallel_drafter

    tok = build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                         initializer_range=0.3))
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    data = tmp_path / "data.jsonl"
    user_outputs(str(tmp_path / "target"), tmp_path / "prompts.txt", data, max_new_tokens=8, batch_size=8,
                 valid_share=0.25, progress=False, log=lambda m: None)
    cfg = ParallelDrafterTrainConfig(target=str(tmp_path / "target"), data=str(data), block_size=4, steps=6,
                                     batch_size=6, eval_every=3, save_every=3, lr=3e-3, warmup_steps=1,
                                     glancing_start=0.9, glancing_end=0.5)
    flags = [f"--{name.replace('_', '-')}={getattr(cfg, name)}" for name in
             ("target", "data", "block_size", "steps", "batch_size", "eval_every", "save_every", "lr", "warmup_steps",
              "glancing_start", "glancing_end")]
    _launch("torchrun", "train", "parallel-drafter", "--out", str(tmp_path / "two"), *flags)
    one = train_parallel_drafter(cfg, tmp_path / "one", progress=False, log=lambda m: None)
    two = json.loads((tmp_path / "two" / "final" / "training.json").read_text())
    history = json.loads((one / "training.json").read_text())["state"]["history"]
    assert two["processes"] == 2 and "train_loss" in history[-1]
    _same_history(history, two["state"]["history"])
    _same_weights(one, tmp_path / "two" / "final")


def test_two_processes_train_a_block_drafter_as_one(tmp_path):
    """`specdec train block-drafter` under accelerate launch: each process packs its rows of the step's
    batch, the glancing draws are the whole batch's, so the losses, figures and weights equal one process's."""
    tok = char_tokenizer()
    target = build_tiny("llama", vocab_size=len(tok), hidden=32, layers=1, eos_token_id=tok.eos_token_id)
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    gen = torch.Generator().manual_seed(5)
    lines = []
    for i in range(16):
        ids = torch.randint(0, len(tok), (int(torch.randint(12, 24, (1,), generator=gen)),), generator=gen).tolist()
        lines.append(json.dumps({"id": f"r{i}", "prompt_ids": ids[:6], "ids": ids[6:], "temperature": 0.0}))
    (tmp_path / "outputs.jsonl").write_text("\n".join(lines) + "\n")
    cfg = BlockTrainConfig(target=str(tmp_path / "target"), init_from="", outputs=str(tmp_path / "outputs.jsonl"),
                           valid=str(tmp_path / "outputs.jsonl"), valid_records=4, hidden_size=16, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=32, max_block_size=4, draft_vocab_size=20,
                           condition_on_target=True, block_tokens=8, seq_len=32, batch_size=5, max_steps=10,
                           warmup_steps=2, eval_every=5, save_every=5, lr=3e-3)
    flags = [f"--{name.replace('_', '-')}={getattr(cfg, name)}" for name in
             ("target", "init_from", "outputs", "valid", "valid_records", "hidden_size", "num_hidden_layers",
              "num_attention_heads", "intermediate_size", "max_block_size", "draft_vocab_size", "block_tokens",
              "seq_len", "batch_size", "max_steps", "warmup_steps", "eval_every", "save_every", "lr")]
    _launch("accelerate", "train", "block-drafter", "--out", str(tmp_path / "two"), "--condition-on-target", *flags)
    one = train_block_drafter(cfg, tmp_path / "one", log=lambda *_: None, progress=False)
    two = json.loads((tmp_path / "two" / "final" / "training.json").read_text())
    history = json.loads((one / "training.json").read_text())["state"]["history"]
    assert two["processes"] == 2 and [r["step"] for r in history] == [5, 10]
    assert {"loss", "block_loss", "prefix_loss", "accuracy", "revealed", "tau_k4"} <= history[-1].keys()
    _same_history(history, two["state"]["history"])
    _same_weights(one, tmp_path / "two" / "final")


def test_two_processes_train_the_encoder_decoders_as_one(tmp_path):
    """`specdec train seq2seq` and `seq2seq-block-drafter` (their own batches and losses, the shared loop)
    under torchrun on a toy word-for-word corpus: the history and the weights equal one process's."""
    from specdec.data.seq2seq_tokenizer import train_seq2seq_tokenizer
    from specdec.train.seq2seq import PRESETS, train_seq2seq, write_translations
    from specdec.train.seq2seq_block import Seq2SeqBlockConfig, train_seq2seq_block

    words = {"open": "öffnen", "file": "Datei", "the": "die", "save": "speichern", "new": "neue", "error": "Fehler"}
    data = toy_corpus(words, {"train": 48, "validation": 8, "test": 4}, 5, tmp_path / "data")
    train_seq2seq_tokenizer(train_texts(data), vocab_size=200).save_pretrained(tmp_path / "tok")
    cfg = replace(PRESETS["tiny"], data=str(data), tokenizer=str(tmp_path / "tok"), batch_size=6, max_steps=10,
                  eval_every=5, save_every=5, eval_pairs=8)  # tiny: no dropout
    quiet = {"log": lambda m: None}
    one = train_seq2seq(cfg, tmp_path / "one", **quiet)
    _launch("torchrun", "train", "seq2seq", "--preset", "tiny", "--data", str(data), "--tokenizer",
            str(tmp_path / "tok"),
            "--batch-size", "6", "--max-steps", "10", "--eval-every", "5", "--save-every", "5", "--eval-pairs", "8",
            "--out", str(tmp_path / "two"))
    history = json.loads((one / "training.json").read_text())["state"]["history"]
    two = json.loads((tmp_path / "two" / "final" / "training.json").read_text())
    assert two["processes"] == 2 and [r["step"] for r in history if "val_loss" in r] == [5, 10]
    _same_history(history, two["state"]["history"])
    _same_weights(one, tmp_path / "two" / "final")

    translations = tmp_path / "translations.jsonl"
    write_translations(one, data, translations, split="train", batch_size=48, log=lambda m: None)
    block = Seq2SeqBlockConfig(target=str(one), data=str(data), translations=str(translations), decoder_layers=1,
                               max_block_size=4, batch_size=6, max_steps=8, eval_every=4, save_every=4, eval_pairs=4,
                               warmup_steps=2, lr=3e-3, dropout=0.0)
    flags = [f"--{name.replace('_', '-')}={getattr(block, name)}" for name in
             ("target", "data", "translations", "decoder_layers", "max_block_size", "batch_size", "max_steps",
              "eval_every", "save_every", "eval_pairs", "warmup_steps", "lr", "dropout")]
    _launch("torchrun", "train", "seq2seq-block-drafter", "--out", str(tmp_path / "block-two"), *flags)
    one = train_seq2seq_block(block, tmp_path / "block-one", **quiet)
    history = json.loads((one / "training.json").read_text())["state"]["history"]
    two = json.loads((tmp_path / "block-two" / "final" / "training.json").read_text())
    assert two["processes"] == 2 and [r["step"] for r in history if "accepted_per_block" in r] == [4, 8]
    _same_history(history, two["state"]["history"])
    _same_weights(one, tmp_path / "block-two" / "final")


LM_RUN = """import dataclasses, sys
from specdec.train.lm import train
from specdec.train.presets import PRESETS
cfg = dataclasses.replace(PRESETS["tiny"], max_steps=10, eval_every=5, save_every=5, batch_size=5, bf16=False,
                          teacher=sys.argv[4] or None)
train(cfg, sys.argv[1], sys.argv[2], root=sys.argv[3])
"""


def test_two_processes_train_a_language_model_as_one(tmp_path):
    """`specdec train lm` (the shipped pair's trainer), a drafter distilled from a teacher (KL and
    cross-entropy), 5 rows over 2 processes (3 and 2): the history and the weights equal one process's.
    In float32: under the preset's bf16 autocast the processes' smaller products round differently
    (bf16 keeps 8 bits) and the weights agree to about 1e-3 only."""
    from specdec.data.stdlib import load_split, split_of
    from specdec.data.tokenizer import train_tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    wanted, i = {"train": 30, "validation": 3, "test": 0}, 0
    while any(wanted.values()):  # synthetic modules; the split is a hash of each file's name
        if wanted[split_of(f"m{i}.py")]:
            wanted[split_of(f"m{i}.py")] -= 1
            (corpus / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x, y={j}):\n    return x * {i} + y - {j}\n\n"
                                                     for j in range(12)))
        i += 1
    tok = tmp_path / "tok"
    train_tokenizer([f.text for f in load_split("train", str(corpus))], vocab_size=300).save_pretrained(tok)
    (tmp_path / "lm_run.py").write_text(LM_RUN)
    for out, teacher in (("teacher", ""), ("one", str(tmp_path / "teacher" / "final"))):  # one process, here
        with patch.object(sys, "argv", ["lm_run.py", str(tmp_path / out), str(tok), str(corpus), teacher]):
            runpy.run_path(str(tmp_path / "lm_run.py"))
    _launch("torchrun", str(tmp_path / "lm_run.py"), str(tmp_path / "two"), str(tok), str(corpus),
            str(tmp_path / "teacher" / "final"))
    history = [json.loads((tmp_path / run / "checkpoint" / "state.json").read_text())["state"]["history"]
               for run in ("one", "two")]
    assert [r["step"] for r in history[0]] == [5, 10] and "val_loss" in history[0][-1]
    _same_history(*history)
    _same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")


def test_rows_are_split_by_rank_and_a_batch_smaller_than_the_processes_is_computed_by_each():
    from specdec.train.parallel import DataParallel

    assert DataParallel(rank=1, world=2).shard([10, 11, 12, 13, 14]) == [11, 13]
    assert DataParallel(rank=0, world=2).shard([10, 11, 12, 13, 14]) == [10, 12, 14]
    assert DataParallel(rank=2, world=3).shard([1, 2]) == [1, 2]  # each holds 1/3 of the loss: share() counts 3x
    one = DataParallel()
    assert one.sum(2, torch.tensor(3.5)) == [2.0, 3.5] and one.any(True) and not one.any(False)
    assert one.share(torch.tensor(6.0), 4).item() == 1.5 and one.share(torch.tensor(6.0), 0).item() == 0.0
