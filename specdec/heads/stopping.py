"""SpecDec++'s stop rule as pure tensor functions, and a ``StopRule`` that applies it with a head.

The rule (Huang, Guo, Wang 2024, eq. 6; their generation loop): after drafting token ``i``
(1-based) of a round, with ``a_1 := 1`` and ``a_j`` the head's P(accept) read from the hidden
state behind draft ``j`` for ``j >= 2``, keep the running product ``P_i = prod_{j <= i} a_j`` (the
estimated chance that no draft so far is rejected) and stop when ``1 - P_i > threshold``. At least
``min_len`` and at most ``max_len`` tokens are drafted (both inclusive); below ``min_len`` the rule
never stops, at ``max_len`` it always does. Every row of a batch decides for itself.

``a_1 := 1``: the state behind the first draft sits on the last committed token, which is certain
(see ``specdec.heads.model``), so the first token is always drafted and the rule's first chance to
stop comes after it.

- ``running_acceptance(accept [B, k]) -> [B, k]``: ``P_i`` for every prefix, with ``a_1 := 1``.
- ``should_stop(product [B], drafted, threshold, bound) -> [B] bool``: the decision after a step.
- ``draft_lengths(accept [B, k], threshold, bound) -> [B]``: where each row stops, given all of its
  head values at once (offline simulation; the schedule decides step by step).
- ``HeadStop``: the ``specdec.drafters.base.StopRule`` a schedule hands to ``Drafter.propose``.
"""

from __future__ import annotations

import torch

from specdec.heads.model import AcceptanceHead


def check_rule(threshold: float, bound: tuple[int, int]) -> None:
    """Raise a ValueError naming the problem for a threshold outside (0, 1) or a bad bound."""
    if not isinstance(threshold, (int, float)) or not 0.0 < float(threshold) < 1.0:
        raise ValueError(f"the stop threshold must be in (0, 1) (stop when 1 - P(all accepted) exceeds it), "
                         f"got {threshold!r}")
    lo, hi = bound
    if not (isinstance(lo, int) and isinstance(hi, int)) or lo < 1 or lo > hi:
        raise ValueError(f"the bound (MIN, MAX) needs 1 <= MIN <= MAX drafted tokens, got ({lo!r}, {hi!r})")


def running_acceptance(accept: torch.Tensor) -> torch.Tensor:
    """accept [B, k] (the head's values behind drafts 1..k) -> P [B, k], ``P[:, i] = prod a_1..a_(i+1)``
    with ``a_1 := 1`` (column 0 is ignored)."""
    a = accept.float().clone()  # [B, k]
    if a.shape[-1]:
        a[..., 0] = 1.0
    return a.cumprod(dim=-1)


def should_stop(product: torch.Tensor, drafted: int | torch.Tensor, threshold: float,
                bound: tuple[int, int]) -> torch.Tensor:
    """After drafting ``drafted`` tokens ([B] or one int for all rows), with running product
    ``product`` [B]: [B] bool, True where the row stops drafting."""
    lo, hi = bound
    drafted = torch.as_tensor(drafted, device=product.device).expand_as(product)  # [B]
    return ((1.0 - product > threshold) & (drafted >= lo)) | (drafted >= hi)


def draft_lengths(accept: torch.Tensor, threshold: float, bound: tuple[int, int]) -> torch.Tensor:
    """accept [B, k] -> [B] long: how many tokens each row drafts under the rule, at most ``k``
    (a row that never stops within its k values drafts all k)."""
    check_rule(threshold, bound)
    rows, k = accept.shape
    if k == 0:
        return torch.zeros(rows, dtype=torch.long, device=accept.device)
    product = running_acceptance(accept)  # [B, k]
    drafted = torch.arange(1, k + 1, device=accept.device).expand(rows, k)  # [B, k]
    stop = should_stop(product.flatten(), drafted.flatten(), threshold, bound).view(rows, k)  # [B, k]
    stop[:, -1] = True  # out of values: the row drafted all k
    return stop.long().argmax(dim=-1) + 1  # first True, 1-based


class HeadStop:
    """SpecDec++'s rule as a ``StopRule``: asked by ``Drafter.propose`` after each drafted position.

    Call it with ``position`` 0, 1, ... in order within a round (position 0 starts a new round);
    ``hidden`` [B, H] is the drafter's last hidden state behind the draft at ``position``. It keeps
    the running product per row; rows keep their own decisions (a row that stopped may be asked
    again, its answer is then meaningless and ignored by the drafter). The schedule's per-row
    limit should be ``bound[1]``; the rule stops there too.
    """

    needs_hidden = True

    def __init__(self, head: AcceptanceHead, threshold: float, bound: tuple[int, int]) -> None:
        check_rule(threshold, bound)
        self.head = head
        self.threshold = float(threshold)
        self.bound = bound
        self.product: torch.Tensor | None = None  # [B] running product of this round
        self.history: list[torch.Tensor] = []  # [B] head value (a_i) per position of this round

    def __call__(self, position: int, logits: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        if hidden is None:
            raise ValueError("the acceptance head's stop rule needs the drafter's hidden states "
                             "(a drafter with returns_hidden): use another schedule for this drafter")
        if position == 0:
            a = torch.ones(hidden.shape[0], device=hidden.device)  # [B], a_1 := 1
            self.product, self.history = a.clone(), []
        else:
            if self.product is None or len(self.history) != position:
                raise ValueError(f"HeadStop asked about position {position} before position {len(self.history)}")
            a = self.head.accept_prob(hidden).to(self.product.device)  # [B]
            self.product = self.product * a
        self.history.append(a)
        return should_stop(self.product, position + 1, self.threshold, self.bound)
