"""Training checkpoints survive a kill at any moment (specdec.train.checkpoint's contract).

Checked: a save interrupted at each step of its sequence (a hook raises there, as a kill would stop it),
then a second save interrupted at each of its steps, always leaves a complete checkpoint, the newest one
complete at that moment, holding exactly the weights and optimizer state saved with it; a full disk is one
clear error naming the folder, the previous checkpoint intact; a drafter trained with dropout and
resumed (after a stop, and after a real SIGKILL of the trainer at a random moment) ends bit-identical
to an uninterrupted run.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from specdec.train import checkpoint as ckpt


@dataclass
class RunState:
    step: int = 0


class Killed(BaseException):
    """Stands for a kill: nothing of the save runs after it (not even an ``except Exception``)."""


@functools.cache
def _model_at(step: int) -> tuple[nn.Linear, torch.optim.Optimizer]:
    """A model and an AdamW whose weights and moments are a function of ``step`` (so a load tells which);
    only read."""
    torch.manual_seed(step)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _save(folder: Path, step: int) -> None:
    model, optimizer = _model_at(step)
    ckpt.save_checkpoint(folder, lambda d: save_file(model.state_dict(), str(d / "model.safetensors")), optimizer,
                         RunState(step), {"seed": 0})


def _resumed_step(folder: Path) -> int:
    """The step of the checkpoint a resume picks, after checking it holds that step's weights and optimizer."""
    model, optimizer = nn.Linear(4, 3), None
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = ckpt.load_checkpoint(folder, model, optimizer, RunState, strict=True)
    want_model, want_optimizer = _model_at(state.step)
    for name, value in want_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    for p, q in zip(optimizer.state.values(), want_optimizer.state.values()):
        assert all(torch.equal(p[k], q[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    return state.step


def _steps(folder: Path, step: int) -> list[str]:
    """The names of the steps of one save at ``step`` into ``folder`` (run to the end)."""
    names: list[str] = []
    ckpt.fault_hook = names.append
    try:
        _save(folder, step)
    finally:
        ckpt.fault_hook = None
    return names


def _kill_at(folder: Path, step: int, name: str) -> None:
    def hook(at: str) -> None:
        if at == name:
            raise Killed(at)

    ckpt.fault_hook = hook
    try:
        _save(folder, step)
    except Killed:
        return
    finally:
        ckpt.fault_hook = None
    raise AssertionError(f"the save never reached {name!r}")


@pytest.fixture
def scratch(tmp_path):
    """A folder in memory when /dev/shm is there (hundreds of saves: file system calls are most of the time)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=shm) as folder:
        yield Path(folder)


def test_a_save_killed_at_any_step_resumes_from_the_newest_complete_checkpoint(scratch, monkeypatch):
    """Step 1 saved; the save of step 2 killed at each of its steps, then the save of step 3 killed at each
    of its own (settling what the first kill left included), then an uninterrupted save of step 4: a resume
    always finds a complete checkpoint, never an older one than the newest complete, and ends tidy."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # the order is checked here, not the disk (a few s saved)
    first = _steps(scratch / "probe" / "checkpoint", 1)  # the first save: nothing to retire
    later = _steps(scratch / "probe" / "checkpoint", 2)
    assert {"write model", "write state", "fsync state", "retire", "install", "remove old"} <= set(later)
    assert "retire" not in first
    complete_from = later.index("fsync state")  # state.json written: the new checkpoint is complete
    cases = 0
    for i, name in enumerate(later):
        run = scratch / f"k{i}"
        _save(run / "checkpoint", 1)
        _kill_at(run / "checkpoint", 2, name)
        after_first = 2 if i >= complete_from else 1
        assert _resumed_step(run / "checkpoint") == after_first, name
        seconds = _second_steps(run, scratch / f"p{i}")
        for j, second in enumerate(seconds):
            again = scratch / f"k{i}-{j}"
            shutil.copytree(run, again)
            _kill_at(again / "checkpoint", 3, second)
            after_second = 3 if j >= seconds.index("fsync state") else after_first
            assert _resumed_step(again / "checkpoint") == after_second, (name, second)
            _save(again / "checkpoint", 4)
            assert _resumed_step(again / "checkpoint") == 4
            assert ckpt.latest_checkpoint(again / "checkpoint") == again / "checkpoint"
            assert sorted(p.name for p in again.iterdir()) == ["checkpoint"], (name, second)
            cases += 1
    assert cases > 3 * len(later)


def _second_steps(run: Path, probe: Path) -> list[str]:
    """The steps of the next save in a copy of ``run`` (they include the settling of what a kill left)."""
    shutil.copytree(run, probe)
    return _steps(probe / "checkpoint", 3)


def test_a_torn_file_or_state_makes_a_checkpoint_incomplete(tmp_path):
    """A file shorter than ``state.json`` lists, or a cut ``state.json``, is not resumed from."""
    folder = tmp_path / "checkpoint"
    _save(folder, 1)
    _kill_at(folder, 2, "retire")  # checkpoint.tmp complete at step 2
    assert _resumed_step(folder) == 2
    tmp = tmp_path / "checkpoint.tmp"
    model = tmp / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-8])
    assert _resumed_step(folder) == 1
    state = tmp / ckpt.STATE_NAME
    _save(folder, 2)
    _kill_at(folder, 3, "retire")
    state.write_text(state.read_text()[:-2])
    assert _resumed_step(folder) == 2


def test_a_full_disk_is_one_line_naming_the_folder_and_keeps_the_previous_checkpoint(tmp_path):
    folder = tmp_path / "checkpoint"
    _save(folder, 1)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def full(at: str) -> None:
        if at == "write optimizer":
            raise OSError(28, "No space left on device")

    ckpt.fault_hook = full
    try:
        with pytest.raises(ckpt.CheckpointWriteError) as err:
            _save(folder, 2)
    finally:
        ckpt.fault_hook = None
    message = str(err.value)
    assert "\n" not in message and str(tmp_path) in message and "No space left" in message
    assert "free space" in message and "kept" in message
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]  # the partial one removed
    assert _resumed_step(folder) == 1


def test_a_real_write_failure_is_caught_from_safetensors(tmp_path):
    """A real failing write (the file size limit, RLIMIT_FSIZE: write(2) fails with EFBIG as with a full disk)
    inside safetensors' own writer: one CheckpointWriteError, the previous checkpoint kept; and the same for a
    run's final folder (``writing``)."""
    script = textwrap.dedent(f"""
        import resource, signal, sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import test_checkpoint as t
        from specdec.train import checkpoint as ckpt
        folder = Path({str(tmp_path / "checkpoint")!r})
        t._save(folder, 1)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300, resource.RLIM_INFINITY))
        try:
            t._save(folder, 2)
        except ckpt.CheckpointWriteError as err:
            print("ERROR", err)
        try:
            with ckpt.writing(folder.parent / "final"):
                (folder.parent / "final").mkdir()
                t.save_file({{"w": t.torch.zeros(1000)}}, str(folder.parent / "final" / "model.safetensors"))
        except ckpt.CheckpointWriteError as err:
            print("FINAL", err)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print("STEP", t._resumed_step(folder))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).parent.parent, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ERROR could not write a checkpoint in ") and "free space" in lines[0], lines
    assert lines[1].startswith(f"FINAL could not write {tmp_path / 'final'} (") and "run the same command" in lines[1]
    assert lines[2] == "STEP 1"


def test_a_full_disk_while_building_head_data_is_one_line_and_keeps_the_finished_shards(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    from specdec.heads import data

    tensors = {"hidden": torch.zeros(2, 4), "label": torch.zeros(2)}
    data.write_meta(tmp_path, {"drafter": "d"}, 4)
    kept = data.write_shard(tmp_path, 0, 2, tensors)

    def full(*args, **kwargs):
        Path(args[1]).write_bytes(b"part")  # what a write cut short leaves
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(data, "save_file", full)
    with pytest.raises(OSError) as err:
        data.write_shard(tmp_path, 1, 2, tensors)
    message = str(err.value)
    assert "\n" not in message and "shard-00001-2.safetensors" in message and "No space left" in message
    assert "free space" in message and "run the same command again" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [data.META_NAME, kept.name]


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (its syscall fault injection)")
def test_dropping_an_unfinished_record_line_killed_at_its_syscall_keeps_the_records(tmp_path):
    """The data steps' record files: cutting a line a kill left unfinished, itself killed (strace delivers
    SIGKILL at the write or truncate that touches the file), keeps every finished record. (Rewriting the
    file, as ``read_records`` once did, empties it first: a kill there lost them all.)"""
    path = tmp_path / "records.jsonl"
    path.write_bytes(b'{"id": 1}\n{"id": 2}\n{"id": 3')
    code = ("import sys; from specdec.train.checkpoint import drop_unfinished_line; "
            "drop_unfinished_line(sys.argv[1]); print('not killed')")
    done = subprocess.run(["strace", "-f", "-qq", "-o", os.devnull, "-P", str(path), "-e",
                           "trace=write,truncate,ftruncate",
                           "-e", "inject=write,truncate,ftruncate:signal=KILL", sys.executable, "-c", code, str(path)],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode != 0 and "not killed" not in done.stdout, (done.returncode, done.stdout, done.stderr)
    from specdec.train.outputs import read_records

    assert read_records(path) == [{"id": 1}, {"id": 2}]
    assert path.read_bytes() == b'{"id": 1}\n{"id": 2}\n'


# ------------------------------------------------------------------ a real trainer: dropout, stop, SIGKILL

PROMPTS = [f"def f{i}(x{i}):" for i in range(10)] + [f"for i in range({i}):" for i in range(10)]


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory) -> dict:
    """A tiny GPT-2 target (its config keeps GPT-2's dropout, 0.1: the drafter built from it trains with
    dropout), its ``specdec data outputs`` file, and the drafter's training settings."""
    from tiny_models import build_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    from specdec.train.outputs import user_outputs
    from specdec.train.presets import DrafterTrainConfig

    root = tmp_path_factory.mktemp("gpt2")
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, vocab_size=len(tok),
                                       bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                       initializer_range=0.3))
    assert model.config.resid_pdrop > 0 and model.config.attn_pdrop > 0
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    user_outputs(str(root / "target"), root / "prompts.txt", root / "data.jsonl", max_new_tokens=8, batch_size=8,
                 valid_share=0.2, progress=False, log=lambda m: None)
    cfg = DrafterTrainConfig(target=str(root / "target"), data=str(root / "data.jsonl"), layers=1, steps=8,
                             batch_size=4, save_every=2, eval_every=4)
    return {"root": root, "cfg": cfg}


def _train(cfg, out: Path, **kw) -> Path | None:
    from specdec.train.drafter import train_drafter

    return train_drafter(cfg, out, measure=False, progress=False, log=lambda m: None, **kw)


def _weights(final: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(final / "model.safetensors"))


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


@pytest.fixture(scope="module")
def uninterrupted(gpt2_run) -> dict[str, torch.Tensor]:
    final = _train(gpt2_run["cfg"], gpt2_run["root"] / "whole")
    return _weights(final)


def test_a_drafter_trained_with_dropout_resumes_bit_identical(gpt2_run, uninterrupted, tmp_path):
    """Stopped at step 3 (a checkpoint), resumed after other work drew from every random generator: the final
    weights equal an uninterrupted run's bit for bit (dropout masks drawn as that run drew them)."""
    cfg = gpt2_run["cfg"]
    assert _train(cfg, tmp_path / "split", stop_at_step=3) is None
    torch.manual_seed(1234)
    torch.rand(100)
    random.random()
    _assert_identical(_weights(_train(cfg, tmp_path / "split")), uninterrupted)


def test_a_trainer_killed_at_a_random_moment_resumes_bit_identical(gpt2_run, tmp_path):
    """``specdec train drafter``'s trainer in a subprocess, SIGKILLed at a random moment of its run (saves every
    2 steps, so often inside one): the resume loses at most 2 steps and ends bit-identical to an uninterrupted
    run. The moment is printed on failure (``delay``)."""
    from dataclasses import asdict, replace

    cfg = replace(gpt2_run["cfg"], steps=48, save_every=2, eval_every=16)
    started = time.perf_counter()
    reference = _weights(_train(cfg, tmp_path / "whole"))
    duration = time.perf_counter() - started
    script = textwrap.dedent(f"""
        from specdec.train import drafter
        from specdec.train.presets import DrafterTrainConfig
        drafter._TrainBar.update = lambda self, step, loss, rate: print("step", step, flush=True)
        drafter.train_drafter(DrafterTrainConfig(**{asdict(cfg)!r}), {str(tmp_path / "killed")!r}, measure=False,
                              progress=False, log=lambda m: None)
        print("done", flush=True)
    """)
    for delay in (random.uniform(0, 0.8 * duration), 0.0):  # the second: when the run ended before the first
        shutil.rmtree(tmp_path / "killed", ignore_errors=True)
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).parent.parent)
        first = child.stdout.readline()
        assert first.startswith("step"), first
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        lines = [first, *child.stdout.read().splitlines()]
        child.wait()
        if child.returncode == -signal.SIGKILL and "done" not in lines:
            break
    else:
        pytest.fail("the trainer ended before it could be killed")
    seen = max(int(line.split()[1]) for line in lines if line.startswith("step"))  # steps it had taken, at least
    latest = ckpt.latest_checkpoint(tmp_path / "killed" / "checkpoint")
    kept = 0 if latest is None else json.loads((latest / ckpt.STATE_NAME).read_text())["state"]["step"]
    assert seen - kept <= cfg.save_every, (delay, seen, kept)
    _assert_identical(_weights(_train(cfg, tmp_path / "killed")), reference)
