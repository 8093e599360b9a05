"""The acceptance head's settings: building its data, training it and tuning ada (``specdec train head``).

Plain dataclasses with one comment per field, no torch: ``specdec train head``'s flags are built from them, so
``specdec train --help`` and a bad flag answer without importing torch. ``data.py``, ``train.py`` and ``own.py``
use (and re-export) them.
"""

from __future__ import annotations

from dataclasses import dataclass

LABEL_KINDS = ("greedy", "sampling")  # kind index -> the verification the label comes from
INPUTS = ("mixed", "response")  # what the drafter reads when its states are taken (specdec/heads/data.py says how)


@dataclass(frozen=True)
class HeadDataConfig:
    """One build of head training data (stored in the data folder's meta.json)."""

    outputs: str  # a `specdec train outputs` JSONL file: the target's continuations of prompts
    target: str = "code-target"  # the target that wrote them (a folder or a shipped name)
    drafter: str = "code-drafter"  # the frozen drafter whose hidden states the head reads
    records: int | None = None  # use only the file's first N records (None: all)
    labels: tuple[str, ...] = ("greedy", "sampling")  # label kinds to build for every record
    inputs: str = "response"  # "response": the target's text (stops better); "mixed": SpecDec++'s drafts mixed in
    mixing: float = 0.15  # inputs="mixed": chance that a position keeps the target's token (no example there)
    seed: int = 0  # seeds the draft samples and the mixing (per record, so shards are independent)
    shard_records: int = 250  # records per shard file (the unit of resumption)
    batch_records: int = 8  # records per forward pass

    def __post_init__(self) -> None:
        unknown = [k for k in self.labels if k not in LABEL_KINDS]
        if unknown or not self.labels:
            raise ValueError(f"labels must be a non-empty subset of {', '.join(LABEL_KINDS)}, got {self.labels!r}")
        if self.inputs not in INPUTS:
            raise ValueError(f"inputs must be one of {', '.join(INPUTS)}, got {self.inputs!r}")
        if not 0.0 <= self.mixing < 1.0:
            raise ValueError(f"mixing must be in [0, 1) (the share of positions keeping the target's token), "
                             f"got {self.mixing}")
        if self.records is not None and self.records < 1:
            raise ValueError(f"records must be >= 1 or None (all), got {self.records}")
        if self.shard_records < 1 or self.batch_records < 1:
            raise ValueError("shard_records and batch_records must be >= 1")


@dataclass(frozen=True)
class HeadTrainConfig:
    """One training run of the head (defaults: the shipped head's recipe)."""

    data: str  # head data folder (`specdec.heads.data`): the training examples
    valid: str | None = None  # head data folder of held-out prompts, for the validation loss
    labels: tuple[str, ...] = ("greedy", "sampling")  # label kinds trained on (one head for both by default)
    num_blocks: int = 3  # residual blocks of the head (SpecDec++: 3)
    reject_weight: float = 6.0  # class weight of rejection in the loss (acceptance: 1)
    batch_size: int = 4096  # examples per optimizer step, over all processes
    lr: float = 1e-3  # peak AdamW learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps
    warmup_steps: int = 100  # linear warm-up
    weight_decay: float = 0.0
    max_steps: int = 3000  # total optimizer steps
    eval_every: int = 250  # steps between validation losses
    save_every: int = 250  # steps between checkpoints (resume points)
    seed: int = 0  # initial weights and batch order

    def __post_init__(self) -> None:
        unknown = [k for k in self.labels if k not in LABEL_KINDS]
        if unknown or not self.labels:
            raise ValueError(f"labels must be a non-empty subset of {', '.join(LABEL_KINDS)}, got {self.labels!r}")
        if self.reject_weight <= 0:
            raise ValueError(f"reject_weight must be > 0, got {self.reject_weight}")
        for name in ("batch_size", "max_steps", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class HeadTuneConfig:
    """How ``specdec train head --data`` tunes ada and measures it on the held-out prompts (after training)."""

    tune_thresholds: tuple[float, ...] = (0.3, 0.5, 0.7, 0.8, 0.9, 1.0)  # ada stop thresholds tried (1 = never
                                                                         # stop: ada is then the constant γ MAX)
    tune_max_draft: tuple[int, ...] = (2, 3, 4, 6, 8)  # ada MAX values tried; the final
                                                       # measurement runs each as a constant γ too
    tune_prompts: int | None = None  # the first N held-out prompts tune (the others
                                     # measure); None = half of them; 0 = no tuning
    tune_tokens: int = 64  # new tokens per tuning prompt (the greedy text the grid is replayed on)
    tune_repeats: int = 2  # interleaved passes of the timed decodes the costs are fitted to
    measure_prompts: int = 20  # held-out prompts (after the tuning ones) measured at the end
    measure_tokens: int = 64  # new tokens per measured prompt
    measure_repeats: int = 3  # interleaved passes of the final measurement (medians)

    def __post_init__(self) -> None:
        if not self.tune_thresholds or not all(0 < t <= 1 for t in self.tune_thresholds):
            raise ValueError(f"tune_thresholds must be one or more numbers in (0, 1], got {self.tune_thresholds!r}")
        if not self.tune_max_draft or not all(isinstance(m, int) and m >= 1 for m in self.tune_max_draft):
            raise ValueError(f"tune_max_draft must be one or more ints >= 1, got {self.tune_max_draft!r}")
        if self.tune_prompts is not None and self.tune_prompts < 0:
            raise ValueError(f"tune_prompts must be >= 0 (0 = no tuning) or left out, got {self.tune_prompts}")
        for name in ("tune_tokens", "tune_repeats", "measure_prompts", "measure_tokens", "measure_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
