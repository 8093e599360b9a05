"""Logits -> token choices for a batch: greedy argmax, or warped probabilities and seeded sampling.

Contract: ``Sampler.probs`` applies temperature, then top-k, then top-p with ``transformers``' own
logits processors (the order ``generate`` uses), so p (target) and q (drafter) are shaped
identically and autoregressive sampling matches ``target.generate(do_sample=True)`` in
distribution. Greedy never computes a softmax.

Rows may differ: each row of a batch has its own ``SamplingConfig`` (a server's requests each bring
theirs; rows with equal settings are warped together) and, optionally, its own
``torch.Generator``, so a row's random stream does not depend on which other rows share its batch.
A sampler with one generator draws for all rows from it (vectorised). Generators are seeded from
``SamplingConfig.seed`` or, when that is None, from torch's global RNG (so ``torch.manual_seed``
also makes runs repeatable).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.config import SamplingConfig


@cache
def _warpers(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p))
    return warpers


def build_warpers(config: SamplingConfig) -> LogitsProcessorList:
    """The logits warpers of ``config``, in ``generate``'s order; empty for greedy."""
    if config.greedy:
        return LogitsProcessorList()
    return _warpers(float(config.temperature), config.top_k, float(config.top_p))


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (None: drawn from torch's global RNG)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class Sampler:
    """The sampling policies of a batch's rows, bound to their generators."""

    configs: list[SamplingConfig]  # one per row
    generators: list[torch.Generator]  # one per row, or a single one shared by every row

    @classmethod
    def create(cls, config: SamplingConfig, device: torch.device | str, rows: int = 1) -> Sampler:
        """``rows`` rows with the same ``config`` and one shared generator."""
        return cls([config] * rows, [make_generator(config.seed, device)])

    @classmethod
    def per_row(cls, configs: Sequence[SamplingConfig], generators: Sequence[torch.Generator]) -> Sampler:
        """Rows with their own configs and generators."""
        return cls(list(configs), list(generators))

    def _groups(self) -> list[tuple[SamplingConfig, torch.Tensor | None]]:
        """Rows grouped by warping settings: (config, row indices or None for every row)."""
        keys = [(c.temperature, c.top_k, c.top_p) for c in self.configs]
        if len(set(keys)) <= 1:
            return [(self.configs[0], None)] if self.configs else []
        groups: dict[tuple, list[int]] = {}
        for row, key in enumerate(keys):
            groups.setdefault(key, []).append(row)
        return [(self.configs[rows[0]], torch.tensor(rows)) for rows in groups.values()]

    @property
    def greedy(self) -> bool:
        """True when every row chooses by argmax (temperature 0)."""
        return all(c.greedy for c in self.configs)

    @property
    def sampled(self) -> bool:
        """True when every row samples (temperature > 0)."""
        return not any(c.greedy for c in self.configs)

    def greedy_rows(self, device: torch.device | str) -> torch.Tensor:
        """[B] bool: the rows that choose by argmax."""
        return torch.tensor([c.greedy for c in self.configs], dtype=torch.bool, device=device)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped probabilities (float32) of ``logits`` [B, ..., V] -> [B, ..., V], each row with its config."""
        out = logits.float()
        for config, rows in self._groups():
            part = out if rows is None else out[rows.to(out.device)]
            shape = part.shape
            scores = _warpers(float(config.temperature) or 1.0, config.top_k, float(config.top_p))(
                None, part.reshape(-1, shape[-1]))
            probs = torch.softmax(scores, dim=-1).reshape(shape)
            if rows is None:
                return probs
            out = out.index_copy(0, rows.to(out.device), probs)
        return out

    def uniform(self, counts: torch.Tensor, width: int, device: torch.device | str) -> torch.Tensor:
        """[B, width] U(0, 1) draws: row b's first ``counts[b]`` from its own generator (so a row's stream
        depends on its own rounds only), the rest 1.0. With one generator shared by several rows:
        [B, width] from it. A single row with its generator draws as its own (the one sampled row of a
        mixed batch, verified alone, draws exactly what it would beside the others)."""
        if len(self.generators) != counts.shape[0]:  # one generator for several rows
            return torch.rand((counts.shape[0], width), generator=self.generators[0], device=device)
        out = torch.ones(counts.shape[0], width, device=device)
        for row, (n, generator) in enumerate(zip(counts.tolist(), self.generators)):
            if n:
                out[row, :n] = torch.rand(n, generator=generator, device=device)
        return out

    def sample(self, probs: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row of ``probs`` [B, V] -> [B] long (inverse CDF of each row's uniform draw);
        only the rows ``rows`` [B] bool draw (None: all), the others get token 0."""
        counts = torch.ones(probs.shape[0], dtype=torch.long) if rows is None else rows.long().cpu()
        cdf = probs.cumsum(dim=-1)  # [B, V]
        u = self.uniform(counts, 1, probs.device) * cdf[:, -1:]  # [B, 1]
        token = torch.searchsorted(cdf, u.contiguous(), right=True).squeeze(-1)  # [B]
        token = token.clamp_max(probs.shape[-1] - 1)
        return token if rows is None else torch.where(rows, token, 0)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each row of ``logits`` [B, V] -> [B]: argmax if greedy, else a sample."""
        token, _ = self.draft(logits)
        return token

    def draft(self, logits: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Choose a token per row of ``logits`` [B, V] -> (tokens [B], q [B, V] | None).

        q (the warped probabilities each sampled token was drawn from) is None when every row is
        greedy; greedy rows of a mixed batch take the argmax (their q is unused: exact rules ignore it).
        Only the rows ``rows`` [B] bool (None: all) draw random numbers; the others take the argmax."""
        best = logits.argmax(dim=-1)  # [B]
        if self.greedy:
            return best, None
        q = self.probs(logits)  # [B, V]
        drawing = ~self.greedy_rows(logits.device)
        if rows is not None:
            drawing = drawing & rows
        return torch.where(drawing, self.sample(q, drawing), best), q

    def select(self, rows: torch.Tensor) -> Sampler:
        """The sampler of the rows ``rows`` [B'] (in that order)."""
        index = rows.tolist()
        generators = self.generators if len(self.generators) == 1 else [self.generators[i] for i in index]
        return Sampler([self.configs[i] for i in index], generators)


def check_finite(logits: torch.Tensor, who: str, valid: torch.Tensor | None = None) -> None:
    """Raise ValueError if ``logits`` [..., V] hold NaN or inf where ``valid`` [...] (None: everywhere) says
    the position is real (one host sync). Checked first on the sum of the real positions' logits, finite unless a
    logit is NaN or inf or the sum overflows (a sum reads the logits 3-10 times faster than ``isfinite`` here: 7 us
    against 20-78 us for 1-5 positions of 8192 logits, once per forward; one sum and one read: each torch call
    costs microseconds in the round), and only then on every logit."""
    if valid is None:  # (half-precision logits summed in float32)
        total = logits.sum(dtype=torch.float32)
    else:
        total = logits.sum(dim=-1, dtype=torch.float32).masked_fill(~valid, 0.0).sum()
    if math.isfinite(total.item()):
        return
    if valid is None:
        finite = torch.isfinite(logits).all()
    else:
        finite = (torch.isfinite(logits).all(dim=-1) | ~valid).all()
    if not bool(finite):
        raise ValueError(
            f"the {who} produced NaN/inf logits: its weights or inputs are broken, or its dtype overflows "
            "(try dtype='fp32' or 'bf16' instead of 'fp16')"
        )
