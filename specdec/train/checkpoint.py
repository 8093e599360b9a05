"""Training checkpoints, shared by every trainer (language models, encoder-decoders, block drafters,
acceptance heads): one folder, written atomically, read back to resume.

Layout of a checkpoint folder: what ``write_model`` puts there (``model.safetensors``, and the
model's config where the trainer saves one), ``optimizer.safetensors`` (the optimizer's tensors,
keyed ``state.<param index>.<name>``; no pickle) and ``state.json``: ``{"state": the run's state
dataclass, "config": the run's config, "optimizer": the optimizer's param groups and its non-tensor
per-parameter values}``. The folder is written beside the old one as ``<name>.tmp`` and swapped in
with ``os.replace``, so a run killed mid-write keeps its previous checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file

State = TypeVar("State")


def save_checkpoint(folder: Path, write_model: Callable[[Path], None], optimizer: torch.optim.Optimizer,
                    state: Any, config: dict) -> None:
    """Write ``folder`` atomically: ``write_model(tmp)``, the optimizer (safetensors), ``state.json``."""
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write_model(tmp)
    saved = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for i, values in saved["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{i}.{name}"] = value.detach().clone().contiguous()
            else:
                scalars.setdefault(str(i), {})[name] = value
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"state": asdict(state), "config": config, "optimizer": {
        "param_groups": saved["param_groups"], "scalars": scalars}}, indent=1))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


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
    """Load ``folder``'s weights into ``model`` (tied weights re-tied: a trainer may leave them out,
    hence ``strict=False`` by default) and its optimizer state into ``optimizer``; return the state."""
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=strict)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    saved = json.loads((folder / "state.json").read_text())
    state: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in saved["optimizer"]["scalars"].items()}
    for key, value in load_file(str(folder / "optimizer.safetensors")).items():
        _, i, name = key.split(".", 2)
        state.setdefault(int(i), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": saved["optimizer"]["param_groups"]})
    return state_class(**saved["state"])


def saved_config(folder: Path) -> dict | None:
    """The config a checkpoint in ``folder`` was written with, or None when there is none."""
    path = folder / "state.json"
    return json.loads(path.read_text())["config"] if path.is_file() else None
