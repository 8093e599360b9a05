"""The SpecDec++ acceptance head (Huang, Guo, Wang 2024): P(a drafted token is accepted).

Contract: ``AcceptanceHead(HeadConfig(hidden_size=H))`` maps the drafter's last-layer hidden states
``[..., H]`` to two logits ``[..., 2]`` (index 0 = rejected, 1 = accepted); ``accept_prob`` gives
the softmax's accept column ``[...]``. The network is ``num_blocks`` residual blocks
``x + SiLU(Linear(x))``, each with its own weights, then ``Linear(H, 2)``. (SpecDec++'s released code
builds ``[ResBlock(h)] * n``, which repeats ONE block object n times, so its "n layers" share one
weight matrix; here every block is a separate module.)

Which hidden state it reads: ``Proposal.hidden[b, i]``, the state at the drafter's input position
whose logits produced draft ``i``. That position's input token is draft ``i - 1`` (the last
committed token for ``i = 0``), and the head was trained, as in SpecDec++, to predict whether the
draft fed at that position is accepted. So the value at ``i >= 1`` is the acceptance of draft
``i - 1`` and the value at ``i = 0`` is replaced by 1 (``specdec.heads.stopping``): exactly what
SpecDec++'s generation loop reads (``hidden_states[-1][0, -1]`` after each drafter step, with the
first step's value set to 1).

Storage: a folder with ``config.json`` (the ``HeadConfig`` fields and ``model_type``) and
``model.safetensors``; ``save_pretrained`` / ``from_pretrained`` write and read it, with no
transformers model class involved. The shipped head lives at
``models/code-drafter/acceptance_head/`` (``DEFAULT_HEAD``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

MODEL_TYPE = "specdec-acceptance-head"  # config.json's model_type: tells a head folder from a model folder
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DEFAULT_HEAD = "code-drafter/acceptance_head"  # the shipped head, relative to the shipped models' folder


@dataclass(frozen=True)
class HeadConfig:
    """The head's shape and what it was trained for (stored as its config.json)."""

    hidden_size: int  # width of the drafter's hidden states the head reads
    num_blocks: int = 3  # residual blocks x + SiLU(Linear(x)) before the 2-way output (SpecDec++: 3)
    labels: str = "greedy+sampling"  # the verification its labels came from: greedy, sampling or both
    drafter: str | None = None  # the drafter whose hidden states it was trained on (a note, not checked)

    def __post_init__(self) -> None:
        if not isinstance(self.hidden_size, int) or self.hidden_size < 1:
            raise ValueError(f"hidden_size must be an int >= 1, got {self.hidden_size!r}")
        if not isinstance(self.num_blocks, int) or self.num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {self.num_blocks!r}")


class ResidualBlock(nn.Module):
    """x + SiLU(Linear(x))."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class AcceptanceHead(nn.Module):
    """Residual blocks, then Linear(H, 2): logits of (rejected, accepted) per hidden state."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(ResidualBlock(config.hidden_size) for _ in range(config.num_blocks))
        self.out = nn.Linear(config.hidden_size, 2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., 2] (0 = rejected, 1 = accepted), in the head's dtype."""
        x = hidden.to(self.out.weight.dtype)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    @torch.no_grad()
    def accept_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> P(accepted) [...] in float32."""
        return self(hidden).float().softmax(dim=-1)[..., 1]

    def check_hidden_size(self, hidden_size: int, what: str = "the drafter") -> None:
        """Raise a ValueError naming both sizes when ``what``'s hidden states do not fit this head."""
        if hidden_size != self.config.hidden_size:
            raise ValueError(
                f"the acceptance head reads hidden states of size {self.config.hidden_size}, but {what} has "
                f"hidden size {hidden_size}: train a head for this drafter with `specdec train head` "
                "or pass the head that was trained on it (--head PATH)"
            )

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into the folder ``path``; return it."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = {"model_type": MODEL_TYPE, **asdict(self.config)}
        (path / CONFIG_NAME).write_text(json.dumps(config, indent=1) + "\n")
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(path / WEIGHTS_NAME))
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, hidden_size: int | None = None,
                        device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> AcceptanceHead:
        """Load a head folder (None: the shipped head) in eval mode; with ``hidden_size`` (the
        drafter's), check that it fits. Errors name the path and the fix."""
        folder = default_head_path() if path is None else Path(path).expanduser()
        if not folder.exists():
            raise FileNotFoundError(
                f"no acceptance head at {str(folder)!r}: pass a folder written by `specdec train head` "
                f"(config.json + {WEIGHTS_NAME}), or leave --head out for the shipped one"
            )
        if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
            raise ValueError(f"{str(folder)!r} is not an acceptance head folder: it needs {CONFIG_NAME} and "
                             f"{WEIGHTS_NAME} (written by `specdec train head`)")
        raw = json.loads((folder / CONFIG_NAME).read_text())
        if raw.get("model_type") != MODEL_TYPE:
            raise ValueError(f"{str(folder / CONFIG_NAME)!r} is not an acceptance head's config (model_type "
                             f"{raw.get('model_type')!r}, expected {MODEL_TYPE!r})")
        known = {f.name for f in fields(HeadConfig)}
        head = cls(HeadConfig(**{k: v for k, v in raw.items() if k in known}))
        head.load_state_dict(load_file(str(folder / WEIGHTS_NAME)))
        head = head.to(device=device, dtype=dtype).eval()
        if hidden_size is not None:
            head.check_hidden_size(hidden_size)
        return head


def default_head_path() -> Path:
    """Where the shipped head lives: ``models/code-drafter/acceptance_head``."""
    from specdec.loading import models_dir

    return models_dir() / DEFAULT_HEAD


def drafter_hidden_size(model: nn.Module) -> int:
    """The width of a transformers drafter's last hidden state (its text config's hidden_size)."""
    config = model.config.get_text_config()
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"cannot tell the hidden size of a {type(model).__name__}: its config has no hidden_size")
