"""Training checkpoints, shared by every trainer (language models, encoder-decoders, drafters, block
drafters, acceptance heads): written so that a kill at any moment keeps a complete one, read back to
resume exactly.

Layout of a checkpoint folder: what ``write_model`` puts there (``model.safetensors``, and the
model's config where the trainer saves one), ``optimizer.safetensors`` (the optimizer's tensors,
keyed ``state.<param index>.<name>``), ``rng.safetensors`` (the random generators' states: torch's
CPU one, every CUDA / MPS device's, numpy's keys) and, written last, ``state.json``: ``{"state": the
run's state dataclass, "config": the run's config, "optimizer": the optimizer's param groups and its
non-tensor per-parameter values, "rng": Python's and numpy's scalar state, "files": the size of every
other file}``. No pickle anywhere.

Contract (the save sequence; ``NAME`` is the checkpoint's path, e.g. ``RUN/checkpoint``):
1. settle what an earlier kill left (below), so ``NAME`` is the newest complete checkpoint or absent;
2. write everything into ``NAME.tmp``, fsync each file, write ``state.json`` last, fsync it and the folder;
3. rename ``NAME`` to ``NAME.old``, rename ``NAME.tmp`` to ``NAME``, fsync the run folder;
4. remove ``NAME.old``.
A checkpoint is *complete* when its ``state.json`` parses and every file it lists has its size. Of
``NAME.tmp``, ``NAME`` and ``NAME.old`` the newer is always the earlier in that order (a complete
``.tmp`` was written after ``NAME``, which was installed after ``.old``), so ``latest_checkpoint``
takes the first complete one: a kill at any step of the sequence (tests/test_checkpoint.py kills it
at each) loses at most the steps since the previous complete checkpoint, and no step removes or
replaces a complete checkpoint before a newer complete one exists. ``load_checkpoint`` restores the
random generators too, so a resumed run draws the same dropout masks as an uninterrupted one and
ends with bit-identical weights (one process; with several, each resumes from the main process's
generators).

A write that fails (a full disk: ``OSError``, or safetensors' ``SafetensorError``) removes the partial
``NAME.tmp`` and raises ``CheckpointWriteError`` (an ``OSError``: the command line prints it as one
line) naming the folder and the fix; the previous checkpoint is untouched.

The append-only record files of the data steps (``specdec data outputs``, ``specdec train translations``)
resume by their records instead: ``drop_unfinished_line`` cuts a line a kill left unfinished (one
``truncate``, so a kill there loses nothing more), and ``append_error`` words a failed append.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

State = TypeVar("State")

STATE_NAME = "state.json"  # written last: its presence (parsed, the files it
                           # lists at their sizes) marks a complete checkpoint
RNG_NAME = "rng.safetensors"

# Test hook: called with the name of each step of the save sequence just before it runs (a fault-injection
# test raises there, as a kill at that moment would stop the sequence). None in normal runs.
fault_hook: Callable[[str], None] | None = None


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a lost mount); the previous one is kept."""


def _step(name: str) -> None:
    if fault_hook is not None:
        fault_hook(name)


def _siblings(folder: Path) -> tuple[Path, Path, Path]:
    """(``NAME.tmp``, ``NAME``, ``NAME.old``): newest first."""
    return folder.with_name(folder.name + ".tmp"), folder, folder.with_name(folder.name + ".old")


def _complete(folder: Path) -> dict | None:
    """``folder``'s parsed ``state.json`` when it is a complete checkpoint, else None."""
    try:
        saved = json.loads((folder / STATE_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or "state" not in saved:
        return None
    for name, size in saved.get("files", {}).items():  # checkpoints of older versions list none
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return None
    return saved


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete checkpoint among ``NAME.tmp``, ``NAME`` and ``NAME.old`` (see the module's
    contract), or None when none is complete. Reads only."""
    for path in _siblings(Path(folder)):
        if _complete(path) is not None:
            return path
    return None


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a folder's entries: a rename is durable once its folder is) to the disk.
    A folder that cannot be synced (Windows, a file system without it) is left to the operating system."""
    if path.is_dir() and os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if not path.is_dir() or err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def _settle(folder: Path) -> None:
    """Make ``NAME`` the newest complete checkpoint (or absent when none is) and remove the others.
    Each step keeps the newest complete one, so a kill here is settled again by the next save."""
    tmp, _, old = _siblings(folder)
    newest = latest_checkpoint(folder)
    if newest == tmp:  # killed after the new one was complete, before it was installed
        _step("settle: remove old")
        _remove(old)
        if folder.exists():
            _step("settle: retire")
            os.replace(folder, old)
        _step("settle: install")
        os.replace(tmp, folder)
        _step("settle: fsync run folder")
        _fsync(folder.parent)
    elif newest == old:  # only reachable from a checkpoint left broken by hand, or by an older version
        _step("settle: remove tmp")
        _remove(tmp)
        _step("settle: remove broken")
        _remove(folder)
        _step("settle: install old")
        os.replace(old, folder)
        _step("settle: fsync run folder")
        _fsync(folder.parent)
    elif newest is None:
        _remove(folder)  # an incomplete one of an older version: nothing to resume from
    _step("settle: remove leftovers")
    _remove(tmp)
    _remove(old)


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """The random generators' states: tensors (torch CPU, each CUDA / MPS device, numpy's keys) and JSON values."""
    tensors = {"torch.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, value in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch.cuda.{i}"] = value
    if torch.backends.mps.is_available():
        tensors["torch.mps"] = torch.mps.get_rng_state()
    version, internal, gauss = random.getstate()
    scalars: dict[str, Any] = {"python": {"version": version, "state": list(internal), "gauss_next": gauss}}
    try:
        import numpy as np
    except ImportError:
        return tensors, scalars
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy.keys"] = torch.from_numpy(keys.astype(np.int64))
    scalars["numpy"] = {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return tensors, scalars


def set_rng_state(tensors: dict[str, torch.Tensor], scalars: dict) -> None:
    """Restore what ``rng_state`` returned (devices this machine lacks are left out)."""
    torch.set_rng_state(tensors["torch.cpu"])
    cuda = sorted((int(k.rsplit(".", 1)[1]), v) for k, v in tensors.items() if k.startswith("torch.cuda."))
    if cuda and torch.cuda.is_available():
        for i, value in cuda[: torch.cuda.device_count()]:
            torch.cuda.set_rng_state(value, i)
    if "torch.mps" in tensors and torch.backends.mps.is_available():
        torch.mps.set_rng_state(tensors["torch.mps"])
    if "python" in scalars:
        py = scalars["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    if "numpy" in scalars and "numpy.keys" in tensors:
        import numpy as np

        n = scalars["numpy"]
        np.random.set_state((n["kind"], tensors["numpy.keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))


def save_checkpoint(folder: Path, write_model: Callable[[Path], None], optimizer: torch.optim.Optimizer,
                    state: Any, config: dict) -> None:
    """Write the checkpoint ``folder`` (the module's save sequence): ``write_model(tmp)``, the optimizer,
    the random generators, ``state.json``. A failed write raises ``CheckpointWriteError``, the previous
    checkpoint kept."""
    folder = Path(folder)
    tmp, _, old = _siblings(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _settle(folder)
    saved = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for i, values in saved["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{i}.{name}"] = value.detach().cpu().clone().contiguous()
            else:
                scalars.setdefault(str(i), {})[name] = value
    rng_tensors, rng_scalars = rng_state()
    try:
        _step("mkdir")
        tmp.mkdir()
        _step("write model")
        write_model(tmp)
        _step("write optimizer")
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        _step("write rng")
        save_file({k: v.contiguous() for k, v in rng_tensors.items()}, str(tmp / RNG_NAME))
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _step(f"fsync {path.name}")
            _fsync(path)
            files[path.relative_to(tmp).as_posix()] = path.stat().st_size
        text = json.dumps({"state": asdict(state), "config": config, "rng": rng_scalars, "files": files,
                           "optimizer": {"param_groups": saved["param_groups"], "scalars": scalars}}, indent=1)
        _step("write state")
        with open(tmp / STATE_NAME, "w") as f:
            f.write(text)
            f.flush()
            _step("fsync state")
            os.fsync(f.fileno())
        _step("fsync tmp")
        _fsync(tmp)
    except (OSError, SafetensorError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = " ".join(str(err).split()) or type(err).__name__
        kept = f"the previous checkpoint {folder} is kept" if folder.exists() else "no checkpoint was written"
        raise CheckpointWriteError(
            f"could not write a checkpoint in {folder.parent} ({reason}); {kept}: free space on that disk (or give "
            "another --out) and run the same command again to resume") from err
    if folder.exists():
        _step("retire")
        os.replace(folder, old)
    _step("install")
    os.replace(tmp, folder)
    _step("fsync run folder")
    _fsync(folder.parent)
    _step("remove old")
    _remove(old)


@contextmanager
def writing(folder: str | Path) -> Iterator[Path]:
    """Around the writes of a run's ``final`` folder: a failed write (a full disk) is one
    ``CheckpointWriteError`` naming the folder and the fix. The run's last checkpoint is complete before
    ``final`` is written, so the same command writes ``final`` again from it."""
    try:
        yield Path(folder)
    except (OSError, SafetensorError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise CheckpointWriteError(f"could not write {folder} ({reason}); the run's last checkpoint is kept: free "
                                   "space on that disk and run the same command again to write it") from err


def untied_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state with tied copies left out (the first name of each shared tensor kept; loading
    with ``strict=False`` and ``tie_weights`` restores them), contiguous, ready for safetensors."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, value in model.state_dict().items():
        key = (value.untyped_storage().data_ptr(), value.storage_offset())
        if key not in seen:
            seen.add(key)
            out[name] = value.contiguous()
    return out


def load_checkpoint(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state_class: type[State], strict: bool = False) -> State:
    """Load the newest complete checkpoint of ``folder`` (``latest_checkpoint``): its weights into
    ``model`` (tied weights re-tied: a trainer may leave them out, hence ``strict=False`` by default),
    its optimizer state into ``optimizer``, its random generators' states into this process's; return
    the run's state. Call it last before the training loop: whatever draws from the generators after it
    draws as the uninterrupted run did after the save."""
    path = latest_checkpoint(folder)
    if path is None:
        raise ValueError(f"{folder} holds no complete checkpoint: delete it (and {folder}.tmp) to start over")
    model.load_state_dict(load_file(str(path / "model.safetensors")), strict=strict)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    saved = json.loads((path / STATE_NAME).read_text())
    state: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in saved["optimizer"]["scalars"].items()}
    for key, value in load_file(str(path / "optimizer.safetensors")).items():
        _, i, name = key.split(".", 2)
        state.setdefault(int(i), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": saved["optimizer"]["param_groups"]})
    if (path / RNG_NAME).is_file():  # checkpoints of older versions have none: the run resumes, not bit-exactly
        set_rng_state(load_file(str(path / RNG_NAME)), saved.get("rng", {}))
    return state_class(**saved["state"])


def saved_run(folder: str | Path) -> dict | None:
    """The newest complete checkpoint's ``state.json`` (``{"state", "config", ...}``), or None when there is none."""
    path = latest_checkpoint(folder)
    return None if path is None else _complete(path)


def saved_config(folder: Path) -> dict | None:
    """The config the newest complete checkpoint in ``folder`` was written with, or None when there is none."""
    saved = saved_run(folder)
    return None if saved is None else saved["config"]


def drop_unfinished_line(path: str | Path) -> bytes:
    """``path``'s bytes up to its last newline. An unfinished last line (a kill or a full disk in the middle of
    an append) is cut off in place by one ``truncate``: rewriting the file would empty it first, and a kill
    then would lose every record."""
    path = Path(path)
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        os.truncate(path, keep)
        data = data[:keep]
    return data


def append_error(path: str | Path, err: OSError) -> OSError:
    """The one-line error of a failed append to the record file ``path`` (a full disk): what is kept, and the fix."""
    reason = " ".join(str(err).split()) or type(err).__name__
    return OSError(f"could not write to {path} ({reason}); the records written before are kept: free space on "
                   "that disk and run the same command again to resume")
