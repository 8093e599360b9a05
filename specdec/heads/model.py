"""The SpecDec++ acceptance head (Huang, Guo, Wang 2024): P(a drafted token is accepted).

Contract: ``AcceptanceHead(HeadConfig(hidden_size=H))`` maps the drafter's last-layer hidden states
``[..., H]`` to two logits ``[..., 2]`` (index 0 = rejected, 1 = accepted); ``accept_probability``
gives the softmax's accept column ``[...]`` (what ``specdec.schedules.Ada`` calls with ``[B, H]``),
``default_threshold`` the stop threshold stored with it (``--stop-threshold`` overrides it) and
``config.max_draft`` ada's MAX (``--bound`` overrides it).
``load_head(path, hidden_size)`` loads a head folder and checks it fits the drafter. The network is ``num_blocks``
residual blocks
``x + SiLU(Linear(x))``, each with its own weights, then ``Linear(H, 2)``. (SpecDec++'s released code
builds ``[ResBlock(h)] * n``, which repeats ONE block object n times, so its "n layers" share one
weight matrix; here every block is a separate module.)

Which hidden state it reads: ``Proposal.hidden[b, i]`` (``DraftStep.hidden``), the state at the
drafter's input position whose logits produce draft ``i``. What the value there means depends on
the training data (``specdec.heads.data``): a head trained on SpecDec++'s mixed inputs estimates
the acceptance of the draft FED at that position (draft ``i - 1``), as SpecDec++'s generation loop
reads it; the shipped head (``inputs="response"``) estimates the acceptance of draft ``i``, the one
those logits produce. The stop rule is the same for both and lives in one place,
``specdec.schedules.Ada``: the product of the values behind drafts 2..i (the first draft is always
made, its value counts as 1).

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
    inputs: str = "mixed"  # the data's inputs (specdec.heads.data): "mixed" (SpecDec++) or "response"
    threshold: float = 0.5  # ada's stop threshold when --stop-threshold is not
                            # given (tuned on held-out prompts; 1 = never stop)
    max_draft: int | None = None  # ada's MAX drafted per round when --bound is not given (tuned with it); None = 16

    def __post_init__(self) -> None:
        if not isinstance(self.hidden_size, int) or self.hidden_size < 1:
            raise ValueError(f"hidden_size must be an int >= 1, got {self.hidden_size!r}")
        if not isinstance(self.num_blocks, int) or self.num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {self.num_blocks!r}")
        if not isinstance(self.threshold, (int, float)) or not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold!r}")
        if self.max_draft is not None and (not isinstance(self.max_draft, int) or self.max_draft < 1):
            raise ValueError(f"max_draft must be an int >= 1 or None, got {self.max_draft!r}")


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
    def accept_probability(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (any device) -> P(accepted) [...] in float32, on hidden's device."""
        logits = self(hidden.to(self.out.weight.device))  # [..., 2]
        return logits.float().softmax(dim=-1)[..., 1].to(hidden.device)

    @property
    def default_threshold(self) -> float:
        """The stop threshold stored with the head (ada's default)."""
        return float(self.config.threshold)

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


def load_head(path: str | Path | None = None, hidden_size: int | None = None,
              device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> AcceptanceHead:
    """The head folder ``path`` (None: the shipped head), checked against the drafter's ``hidden_size``."""
    return AcceptanceHead.from_pretrained(path, hidden_size, device=device, dtype=dtype)


def draft_estimates(values: torch.Tensor, inputs: str) -> torch.Tensor:
    """The head's values behind each draft [..., K] -> its estimate for each draft [..., K'], column j
    estimating draft j: a "mixed" head's value behind draft j + 1 (K' = K - 1), a "response" head's
    value behind draft j itself (module docstring)."""
    return values[..., 1:] if inputs == "mixed" else values


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
