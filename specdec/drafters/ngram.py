"""Prompt lookup: a model-free drafter that copies what followed an earlier occurrence, row by row.

Like ``transformers``' ``prompt_lookup_num_tokens`` (Saxena 2023, "Prompt Lookup Decoding"): take
the last n tokens of a row's committed sequence (n from ``max_ngram`` down to ``min_ngram``), find an
earlier occurrence, and propose the tokens that followed it. Unlike transformers, which takes the
first occurrence, this takes the latest: code repeats what is near (on 30 validation prompts,
greedy, gamma 4, 1.57x -> 1.70x over plain decoding). Drafts are deterministic, so ``q`` is None
and verification treats them as one-hot, which keeps sampling lossless. An index from each n-gram
to the end of its latest occurrence that has a continuation is updated as tokens are committed, so
a lookup costs O(max_ngram) instead of a scan of the whole text.

A draft costs no forward, so its length need not be gamma: ``NgramConfig.num_tokens`` sets it
(``free_tokens``, see ``drafters.base``); None keeps it at the round's limit. A copy that reaches
the end of the text goes on copying itself, so inside a repeat of period p it is still full length,
not p tokens (which the latest occurrence alone would give). Each row keeps its own text and index
(``Lookup``); a row whose limit is 0 proposes nothing.

For an encoder-decoder target (translation) each row also indexes its source: when the output's
latest n-gram has no earlier occurrence in the output but occurs in the source, the tokens that
followed it there are copied (numbers, names and format markers pass through translation unchanged,
and a shared vocabulary spells them alike).
"""

from __future__ import annotations

import torch

from specdec.batch import PromptBatch
from specdec.config import NgramConfig
from specdec.drafters.base import ENDED_LOOKUP, ENDED_NONE, FollowingDrafter, Proposal, StopRule
from specdec.sampling import Sampler


class Lookup:
    """One row's committed sequence and its n-gram index (and, for an encoder-decoder target, its source's)."""

    def __init__(self, config: NgramConfig, tokens: list[int], source: list[int] | None = None) -> None:
        self.config = config
        self.tokens: list[int] = []  # the committed sequence, prompt included
        self._latest_end: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest
                                                           # occurrence before the last token
        self.source = source or []  # the source a translation copies from (numbers, names, format markers)
        self._source_end: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence in the source
        for end in range(1, len(self.source)):  # n-grams of the source that have a continuation there
            for n in range(config.min_ngram, min(config.max_ngram, end) + 1):
                self._source_end[tuple(self.source[end - n : end])] = end
        self.append(tokens)

    def append(self, tokens: list[int]) -> None:
        """Commit ``tokens``; index the n-grams that now have a continuation (those ending before it)."""
        lo, hi = self.config.min_ngram, self.config.max_ngram
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # n-grams ending here are followed by ``token``
            for n in range(lo, min(hi, end) + 1):
                self._latest_end[tuple(self.tokens[end - n : end])] = end

    def propose(self, length: int) -> list[int]:
        """Up to ``length`` tokens that followed the longest matching suffix (in the text itself first,
        then in the source); possibly none."""
        end = len(self.tokens)
        for n in range(min(self.config.max_ngram, end), self.config.min_ngram - 1, -1):
            key = tuple(self.tokens[end - n :])
            start = self._latest_end.get(key) if n < end else None
            if start is not None:  # an earlier occurrence, with a continuation
                return self._copy(start, length)
            start = self._source_end.get(key)
            if start is not None:  # the source had it: copy what followed there
                return self.source[start : start + length]
        return []

    def _copy(self, start: int, length: int) -> list[int]:
        """``length`` tokens from ``start`` on; past the end, the copy goes on copying itself (as
        LZ77 does), so a repeat of period p yields a full-length draft, not p tokens."""
        copied = self.tokens[start : start + length]
        for i in range(len(copied), length):
            copied.append(copied[i - (len(self.tokens) - start)])
        return copied


class NgramDrafter(FollowingDrafter):
    """Proposes, for each row, the continuation of its latest n-gram's latest earlier occurrence."""

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self.rows: list[Lookup] = []  # per row: its committed sequence and n-gram index
        self._drafts: list[list[int]] = []  # per row, as ``rows``: the last proposal's drafts ([] once committed)
        self.device = torch.device("cpu")

    @property
    def free_tokens(self) -> int:  # type: ignore[override]
        """Longest draft it proposes whatever the limit is (0: at most the limit)."""
        return self.config.num_tokens or 0

    def prefill(self, prompts: PromptBatch) -> int:
        """Index the new rows' prompts (and their sources, for an encoder-decoder target)."""
        self.device = prompts.ids.device
        sources = prompts.source_rows() if prompts.source is not None else [None] * prompts.size
        self.rows += [Lookup(self.config, row, source) for row, source in zip(prompts.rows(), sources)]
        # one entry per row, whatever joins and leaves next; a new list, as the last one is also a proposal's (and may
        # be a composing drafter's: extended in place, it grew by the rows of each)
        self._drafts = self._drafts + [[] for _ in range(prompts.size)]
        return 0

    def propose(self, limit: torch.Tensor, sampler: Sampler, stop: StopRule | None = None) -> Proposal:
        """Up to ``limit[b]`` (or ``num_tokens``) copied tokens per row whose limit is not 0."""
        self._drafts = [row.propose(self.config.copy_length(n)) if n > 0 else []
                        for row, n in zip(self.rows, limit.tolist())]
        return Proposal.from_lists(self._drafts, self.device,  # tokens [B, k], lengths [B]
                                   ended=tuple(ENDED_LOOKUP if d else ENDED_NONE for d in self._drafts))

    def last_drafts(self) -> list[list[int]]:
        return self._drafts

    def follow(self, tokens: list[list[int]]) -> None:
        for row, new in zip(self.rows, tokens):
            row.append(new)
        self._drafts = [[] for _ in self.rows]

    def select(self, rows: torch.Tensor) -> None:
        index = rows.tolist()
        self.rows = [self.rows[i] for i in index]
        self._drafts = [self._drafts[i] for i in index]

    def reset(self) -> None:
        self.rows, self._drafts = [], []
