"""The Drafter contract: anything that proposes tokens for the target to verify, for a batch of rows.

A drafter follows each row's committed sequence through these calls:

- ``prefill(prompts)`` when rows join the batch (a ``PromptBatch``; the new rows come after the
  existing ones); returns the forward passes it spent;
- ``propose(limit [B], sampler, stop) -> Proposal`` at the start of each round: for each row ``b``
  up to ``limit[b]`` draft tokens continuing its committed sequence, with their probabilities ``q``
  (or ``None`` for a deterministic drafter, which verification treats as one-hot: Leviathan et al.
  2023, sec. 2.3). ``stop`` (a schedule's within-round rule, e.g. SpecDec++'s acceptance head) is
  asked after each drafted position which rows stop there;
- ``commit(accepted [B], next_token [B])`` at the end of each round: row ``b`` kept its first
  ``accepted[b]`` drafts and ``next_token[b]`` (recovered or bonus) follows them. The drafter rolls
  its own state (e.g. its KV cache) back here;
- ``select(rows)`` when rows leave the batch (finished rows cost nothing more); ``reset()`` drops
  every row.

Drafters may return fewer than ``limit`` tokens for a row, including none. A drafter whose drafts
sometimes cost no forward (prompt lookup) declares ``free_tokens``: a row's proposal may then hold
up to that many tokens, more than ``limit``; the round verifies what fits before
``max_new_tokens`` and the context, and ``commit`` treats the rest as rejected. Drafters own no
sampling policy: the ``Sampler`` passed to ``propose`` carries each row's warpers and generator, so
that q is shaped exactly like p. ``context_limit`` is the longest sequence the drafter can hold
(None: unbounded); ``returns_hidden`` says whether it fills ``Proposal.hidden`` (of
``hidden_size``) when a stop rule asks for hidden states.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from specdec.batch import right_padded

if TYPE_CHECKING:
    from specdec.batch import PromptBatch
    from specdec.sampling import Sampler
    from specdec.target import Target


# Why a row's draft ended (``Proposal.ended``; the per-round records carry it, as SpecDec++'s logs do).
ENDED_NONE = "none"  # nothing was drafted (limit 0, or lookup found nothing and no model drafts)
ENDED_LIMIT = "bound"  # the row drafted as many tokens as it was allowed (the schedule's bound or the room left)
ENDED_THRESHOLD = "threshold"  # the schedule's stop rule stopped it (confidence, acceptance head)
ENDED_LOOKUP = "lookup"  # a prompt-lookup copy, whose length is the copy's
ENDED_ROOM = "room"  # cut by the round to what fits before max_new_tokens or the context


@dataclass(frozen=True)
class Proposal:
    """Draft tokens of one round, per row."""

    tokens: torch.Tensor  # [B, k] long; row b's drafts are tokens[b, :lengths[b]], the rest is padding
    lengths: torch.Tensor  # [B] long, drafts per row (0 <= lengths <= k)
    q: torch.Tensor | None = None  # [B, k, V] drafter probabilities per position, or None = one-hot
    hidden: torch.Tensor | None = None  # [B, k, H] the drafter's last hidden state behind each draft, if asked
    calls: int = 0  # drafter forward passes spent on this proposal (0 for model-free drafters)
    ended: tuple[str, ...] = ()  # per row, why its draft ended (ENDED_*); () when the drafter does not say

    @property
    def k(self) -> int:
        """Width of the proposal (the longest row's drafts)."""
        return self.tokens.shape[1]

    @classmethod
    def empty(cls, rows: int, device: torch.device | str, ended: str = ENDED_NONE) -> Proposal:
        """No drafts for any row."""
        return cls(torch.zeros(rows, 0, dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device),
                   ended=(ended,) * rows).knowing([[] for _ in range(rows)])

    def select(self, rows: torch.Tensor) -> Proposal:
        """The proposal of the rows ``rows`` [B']."""
        pick = (lambda t: None if t is None else t[rows])
        return replace(self, tokens=self.tokens[rows], lengths=self.lengths[rows], q=pick(self.q),
                       hidden=pick(self.hidden))

    def cut(self, lengths: torch.Tensor) -> Proposal:
        """The same drafts cut to at most ``lengths`` [B] per row (and the width to the longest)."""
        lengths = torch.minimum(self.lengths, lengths)
        width = int(lengths.max()) if lengths.numel() else 0
        trim = (lambda t: None if t is None else t[:, :width])
        return replace(self, tokens=self.tokens[:, :width], lengths=lengths, q=trim(self.q), hidden=trim(self.hidden))

    @classmethod
    def from_lists(cls, drafts: list[list[int]], device: torch.device | str, **fields: object) -> Proposal:
        """The proposal of each row's ``drafts`` (right-padded), which ``drafts()`` then returns without reading
        the tensors back."""
        return cls(*right_padded(drafts, device), **fields).knowing(drafts)

    def knowing(self, drafts: list[list[int]]) -> Proposal:
        """This proposal, with each row's drafts (as the tensors hold them) already known on the host."""
        object.__setattr__(self, "_lists", drafts)
        return self

    def drafts(self) -> list[list[int]]:
        """Each row's drafts as a list (the edge where Python state, like prompt lookup's, reads them); read
        from the tensors once per proposal (one host sync), then kept: treat the lists as read-only."""
        lists = self.__dict__.get("_lists")
        if lists is None:
            lists = [row[:n] for row, n in zip(self.tokens.tolist(), self.lengths.tolist())]
            object.__setattr__(self, "_lists", lists)
        return lists


@dataclass(frozen=True)
class DraftStep:
    """One drafted position of a round, as a stop rule sees it."""

    position: int  # 0-based position of the draft in the round
    tokens: torch.Tensor  # [B] the tokens drafted there
    logits: torch.Tensor  # [B, V] the drafter's logits they were chosen from (target vocabulary)
    q: torch.Tensor | None  # [B, V] the warped probabilities they were sampled from (None: greedy rows)
    hidden: torch.Tensor | None  # [B, H] the drafter's last hidden state there, when the rule needs it
    drafting: torch.Tensor  # [B] bool, the rows that drafted this position


class StopRule(Protocol):
    """A schedule's within-round stop: after each drafted position, which rows stop there (the draft at
    that position is kept)."""

    needs_hidden: bool  # whether it reads the drafter's hidden state (the drafter must return it)

    def __call__(self, step: DraftStep) -> torch.Tensor:
        """[B] bool: True where the row stops drafting after ``step.position``."""
        ...


def committed_tokens(drafts: list[list[int]], accepted: torch.Tensor, next_token: torch.Tensor) -> list[list[int]]:
    """Each row's tokens committed by a round: its accepted drafts, then the recovered or bonus token."""
    return [row[:n] + [t] for row, n, t in zip(drafts, accepted.tolist(), next_token.tolist())]


class Drafter(ABC):
    """What the round loop needs from a drafter (see the module docstring)."""

    context_limit: int | None = None  # longest sequence the drafter can hold; None = unbounded
    free_tokens: int = 0  # longest model-free draft of a row, past its limit (prompt lookup); 0 = none
    max_draft: int | None = None  # most tokens it drafts per round (a block drafter's trained k); None = any
    returns_hidden: bool = False  # whether it can fill Proposal.hidden (for stop rules that read it)
    hidden_size: int | None = None  # the size of those hidden states

    def head_path(self) -> str | None:
        """Where an acceptance head trained for this drafter sits by default (beside its model), if anywhere."""
        return None

    def align(self, target: Target, tokenizer: object | None = None) -> Drafter:
        """Check the drafter against ``target`` (vocabulary, device) before decoding; returns itself."""
        return self

    @abstractmethod
    def prefill(self, prompts: PromptBatch) -> int:
        """Add the rows of ``prompts`` after the current ones; return the forward passes spent."""

    def rows_apart(self, prompts: PromptBatch) -> str | None:
        """Why rows of different lengths cannot share the drafter's forwards (then each decodes alone), or None
        (a drafter without a model: always None); ``prompts`` serves its model's self-check."""
        return None

    @abstractmethod
    def propose(self, limit: torch.Tensor, sampler: Sampler, stop: StopRule | None = None) -> Proposal:
        """Draft up to ``limit[b]`` tokens for each row ``b`` (``limit`` [B] long)."""

    @abstractmethod
    def commit(self, accepted: torch.Tensor, next_token: torch.Tensor) -> None:
        """Row b keeps its first ``accepted[b]`` drafts, then ``next_token[b]``; roll back the rest."""

    @abstractmethod
    def select(self, rows: torch.Tensor) -> None:
        """Keep only the rows ``rows`` [B'] (in that order)."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every row."""


class FollowingDrafter(Drafter):
    """A drafter that can also follow tokens committed from another drafter's proposal (for composition).

    ``follow(tokens)`` appends each row's newly committed tokens; ``commit`` is ``follow`` of the
    drafter's own accepted drafts and the next token."""

    @abstractmethod
    def follow(self, tokens: list[list[int]]) -> None:
        """Append ``tokens[b]``, the tokens row ``b`` committed this round (whoever drafted them)."""

    @abstractmethod
    def last_drafts(self) -> list[list[int]]:
        """Each row's drafts in the last proposal."""

    def commit(self, accepted: torch.Tensor, next_token: torch.Tensor) -> None:
        self.follow(committed_tokens(self.last_drafts(), accepted, next_token))


class NoDrafter(Drafter):
    """Drafts nothing: the round loop then decodes plainly, one target forward per token."""

    def __init__(self) -> None:
        self.rows = 0
        self.device = torch.device("cpu")
        self._empty: Proposal | None = None  # the last proposal, the same every round while the rows stay

    def prefill(self, prompts: PromptBatch) -> int:
        self.rows += prompts.size
        self.device = prompts.ids.device
        return 0

    def propose(self, limit: torch.Tensor, sampler: Sampler, stop: StopRule | None = None) -> Proposal:
        empty = self._empty
        if empty is None or empty.tokens.shape[0] != self.rows or empty.tokens.device != self.device:
            empty = self._empty = Proposal.empty(self.rows, self.device, ENDED_NONE)  # immutable: shared by rounds
        return empty

    def commit(self, accepted: torch.Tensor, next_token: torch.Tensor) -> None:
        pass

    def select(self, rows: torch.Tensor) -> None:
        self.rows = len(rows)

    def reset(self) -> None:
        self.rows = 0
