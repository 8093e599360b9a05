"""The prompts of rows joining a batch, as padded tensors: what ``Target.prefill`` and ``Drafter.prefill`` take.

Contract: ``PromptBatch.ids`` [B, T] holds each row's committed sequence so far (for a decoder-only
target, the prompt; for an encoder-decoder target, the decoder's start token), **left**-padded so
that every row's newest token sits in the last column; ``lengths`` [B] says how many tokens are real.
``source`` [B, S] holds each row's encoder input (encoder-decoder targets only), right-padded, with
``source_lengths`` [B]. Padding ids are 0 and are never attended to. Lists of ints appear only in
``from_lists`` and ``rows``, at the edge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def left_padded(rows: Sequence[Sequence[int]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids -> (ids [B, T] left-padded with 0, lengths [B])."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.tensor([[0] * (width - len(r)) + list(r) for r in rows], dtype=torch.long, device=device)
    return ids if rows else ids.view(0, 0), torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)


def left_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] bool: the last ``lengths[b]`` positions of each row (the real tokens of left-padded rows)."""
    return torch.arange(width, device=lengths.device)[None, :] >= (width - lengths)[:, None]


def right_padded(rows: Sequence[Sequence[int]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids -> (ids [B, T] right-padded with 0, lengths [B])."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
    return ids if rows else ids.view(0, 0), torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)


@dataclass(frozen=True)
class PromptBatch:
    """Rows joining a batch."""

    ids: torch.Tensor  # [B, T] long, committed tokens, left-padded (newest token in the last column)
    lengths: torch.Tensor  # [B] long, real tokens per row (>= 1)
    source: torch.Tensor | None = None  # [B, S] long, encoder inputs, right-padded (encoder-decoder only)
    source_lengths: torch.Tensor | None = None  # [B] long

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]], device: torch.device | str,
                   sources: Sequence[Sequence[int]] | None = None) -> PromptBatch:
        ids, lengths = left_padded(rows, device)
        if sources is None:
            return cls(ids, lengths)
        source, source_lengths = right_padded(sources, device)
        return cls(ids, lengths, source, source_lengths)

    @property
    def size(self) -> int:
        return self.ids.shape[0]

    def valid(self) -> torch.Tensor:
        """[B, T] bool: the real (non-padding) positions of ``ids``."""
        return left_mask(self.lengths, self.ids.shape[1])

    def source_valid(self) -> torch.Tensor:
        """[B, S] bool: the real positions of ``source``."""
        assert self.source is not None and self.source_lengths is not None
        width = self.source.shape[1]
        return torch.arange(width, device=self.source.device)[None, :] < self.source_lengths[:, None]

    def source_rows(self) -> list[list[int]]:
        """Each row's real source ids, as lists."""
        assert self.source is not None and self.source_lengths is not None
        return [row[:n] for row, n in zip(self.source.tolist(), self.source_lengths.tolist())]

    def rows(self) -> list[list[int]]:
        """Each row's real ids, as lists (for drafters that keep Python state, like prompt lookup)."""
        width = self.ids.shape[1]
        return [row[width - n:] for row, n in zip(self.ids.tolist(), self.lengths.tolist())]
