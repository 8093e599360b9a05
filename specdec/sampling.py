"""Logits -> token choices: greedy argmax, or warped probabilities and seeded sampling.

Contract: ``Sampler.probs`` applies temperature, then top-k, then top-p with ``transformers``'
own logits processors (the order ``generate`` uses), so p (target) and q (drafter) are shaped
identically and autoregressive sampling matches ``target.generate(do_sample=True)`` in
distribution. Greedy never computes a softmax. All randomness comes from one
``torch.Generator`` on the models' device, seeded from ``SamplingConfig.seed`` (or, when that is
None, from torch's global RNG, so ``torch.manual_seed`` also makes runs repeatable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.config import SamplingConfig


def build_warpers(config: SamplingConfig) -> LogitsProcessorList:
    """The logits warpers of ``config``, in ``generate``'s order; empty for greedy."""
    warpers = LogitsProcessorList()
    if config.greedy:
        return warpers
    if config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k))
    if config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p))
    return warpers


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (None: drawn from torch's global RNG)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class Sampler:
    """A sampling policy bound to a generator: turns logits into probabilities and tokens."""

    config: SamplingConfig
    warpers: LogitsProcessorList
    generator: torch.Generator

    @classmethod
    def create(cls, config: SamplingConfig, device: torch.device | str) -> Sampler:
        """Build the warpers of ``config`` and a generator on ``device``."""
        return cls(config, build_warpers(config), make_generator(config.seed, device))

    @property
    def greedy(self) -> bool:
        return self.config.greedy

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped probabilities (float32) of ``logits`` [..., V] -> [..., V]."""
        shape = logits.shape
        scores = logits.reshape(-1, shape[-1]).float()  # [N, V]
        scores = self.warpers(None, scores)
        return torch.softmax(scores, dim=-1).reshape(shape)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of ``probs`` [N, V] -> [N] long."""
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token for each row of ``logits`` [N, V] -> [N]: argmax if greedy, else a sample."""
        if self.greedy:
            return logits.argmax(dim=-1)
        return self.sample(self.probs(logits))


def check_finite(logits: torch.Tensor, who: str) -> None:
    """Raise ValueError if ``logits`` hold NaN or inf (one host sync)."""
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(
            f"the {who} produced NaN/inf logits: its weights or inputs are broken, or its dtype overflows "
            "(try dtype='fp32' or 'bf16' instead of 'fp16')"
        )
