"""The prompts of rows joining a batch, as padded tensors: what ``Target.prefill`` and ``Drafter.prefill`` take.

Contract: ``PromptBatch.ids`` [B, T] holds each row's committed sequence so far (for a decoder-only
target, the prompt; for an encoder-decoder target, the decoder's start token), **left**-padded so
that every row's newest token sits in the last column; ``lengths`` [B] says how many tokens are real.
``source`` [B, S] holds each row's encoder input (encoder-decoder targets only), right-padded, with
``source_lengths`` [B]. Padding ids are 0 and are never attended to. Lists of ints appear only in
``from_lists`` and ``rows``, at the edge.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# A prefill forward's fixed cost in prompt tokens (``prefill_groups``): code-target's eager forward of 1 token took
# 8 ms against 0.4 ms per token of a 150-600-token prefill (1 thread, the Intel Xeon of docs/benchmarks.md).
PREFILL_FORWARD_TOKENS = 20
PREFILL_GROUP_ROWS = 64  # rows of one prefill group at most (``prefill_groups`` then weighs 64 splits per row, not all)


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


def prefill_groups(widths: Sequence[int], fixed: int = PREFILL_FORWARD_TOKENS) -> list[tuple[int, int]]:
    """The contiguous row ranges ``[start, end)`` to prefill apart, cheapest first by a token count: a range's
    forward feeds each of its rows as wide as its widest (``widths[b]``: the tokens row ``b`` feeds), plus
    ``fixed`` per forward. Rows of like widths share a forward; one much longer or shorter than its neighbours
    gets its own rather than padding the others (16 code prompts of 82-206 tokens joining a server at once:
    3296 fed positions in one forward, 2400 real). A group holds at most ``PREFILL_GROUP_ROWS`` rows."""
    best, cut = [0.0] + [math.inf] * len(widths), [0] * (len(widths) + 1)
    for end in range(1, len(widths) + 1):
        widest = 0
        for start in range(end - 1, max(end - 1 - PREFILL_GROUP_ROWS, -1), -1):
            widest = max(widest, widths[start])
            cost = best[start] + (end - start) * widest + fixed
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(widths)
    while end > 0:
        groups.append((cut[end], end))
        end = cut[end]
    return groups[::-1]


def kept_order(done: Sequence[bool]) -> list[int]:
    """The rows that stay when the ``done`` ones leave, in the order that moves the fewest: a row already within
    the first ``k`` places (``k`` rows stay) keeps its place, and each place a leaving row frees there takes the
    next staying row from beyond them, in order. Caches re-pack rows by place (``select``), so a row leaving the
    middle of 16 moves one row, not every row after it."""
    stay = [i for i, gone in enumerate(done) if not gone]
    later = iter(i for i in stay if i >= len(stay))
    return [i if not done[i] else next(later) for i in range(len(stay))]


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

    def widths(self) -> list[int]:
        """Tokens each row's prefill feeds: its ids (and its source, for an encoder-decoder model)."""
        lengths = self.lengths if self.source_lengths is None else self.lengths + self.source_lengths
        return lengths.tolist()

    def part(self, start: int, end: int) -> PromptBatch:
        """Rows ``start..end-1``, their padding trimmed to the widest of them."""
        lengths = self.lengths[start:end]
        ids = self.ids[start:end, self.ids.shape[1] - int(lengths.max()):]
        if self.source is None or self.source_lengths is None:
            return PromptBatch(ids, lengths)
        source_lengths = self.source_lengths[start:end]
        return PromptBatch(ids, lengths, self.source[start:end, : int(source_lengths.max())], source_lengths)

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
