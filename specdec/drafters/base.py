"""The Drafter protocol: anything that proposes tokens for the target to verify.

A drafter follows the committed sequence through three calls per generation:

- ``prefill(input_ids)`` once, with the prompt ``[1, T]``;
- ``propose(k, sampler) -> Proposal`` at the start of each round: up to ``k`` draft tokens that
  continue the committed sequence, with their probabilities ``q`` (or ``None`` for a
  deterministic drafter, which verification treats as one-hot: Leviathan et al. 2023, sec. 2.3);
- ``commit(n_accepted, next_token)`` at the end of each round: the first ``n_accepted`` drafts
  were kept and ``next_token`` (recovered or bonus) follows them. The drafter rolls its own
  state (e.g. its KV cache) back here.

Drafters may return fewer than ``k`` tokens, including none. A drafter whose drafts sometimes cost
no forward (prompt lookup) may declare ``free_tokens``: such a proposal (``q`` None, ``calls`` 0)
may then hold up to that many tokens, more than ``k``; the round verifies what fits before
``max_new_tokens`` and the context, and ``commit`` treats the rest as rejected. Drafters own no
sampling policy: the ``Sampler`` passed to ``propose`` carries the warpers and the generator, so
that q is shaped exactly like p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from specdec.sampling import Sampler


@dataclass(frozen=True)
class Proposal:
    """Draft tokens of one round."""

    tokens: torch.Tensor  # [1, k] long, the drafted continuation (k may be 0)
    q: torch.Tensor | None  # [1, k, V] drafter probabilities of each position, or None = one-hot
    calls: int = 0  # drafter forward passes spent on this proposal (0 for model-free drafters)

    @property
    def k(self) -> int:
        """Number of drafted tokens."""
        return self.tokens.shape[1]


@runtime_checkable
class Drafter(Protocol):
    """What the round loop needs from a drafter (see module docstring)."""

    def prefill(self, input_ids: torch.Tensor) -> None:
        """Start a generation from the prompt ``input_ids`` [1, T]."""
        ...

    def propose(self, k: int, sampler: Sampler) -> Proposal:
        """Draft up to ``k`` tokens continuing the committed sequence."""
        ...

    def commit(self, n_accepted: int, next_token: int) -> None:
        """Keep the first ``n_accepted`` drafts, then ``next_token``; roll back the rest."""
        ...
