"""What a generation did: per-round records and their summaries, plus the result types.

Vocabulary (DESIGN.md): a round drafts ``drafted`` tokens and emits ``accepted`` of them plus one
recovered (at the first rejection) or bonus (all drafts accepted) token.

- acceptance rate  alpha = accepted / drafted            (0.0 when nothing was drafted)
- mean accepted length tau = emitted tokens / rounds     (counts the recovered/bonus token;
  1.0 = plain decoding; Spec-Bench / vLLM convention)

For plain autoregressive decoding every token is one round with nothing drafted.
The time split (``target_time_s``, ``drafter_time_s``) is measured around each model call; on
CUDA the loop synchronizes at those points, so the split is accurate there too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Labels of committed tokens, as passed to ``on_round`` callbacks in ``RoundEvent.kinds``.
ACCEPTED = "accepted"  # a drafted token the target kept
RECOVERED = "recovered"  # the target's replacement at the first rejection
BONUS = "bonus"  # the target's extra token when every draft was accepted
TARGET = "target"  # a token of plain autoregressive decoding

# Values of ``GenerationResult.stop_reason``.
STOP_TOKEN = "stop_token"
STOP_STRING = "stop_string"
MAX_NEW_TOKENS = "max_new_tokens"
CONTEXT_LIMIT = "context_limit"


@dataclass(frozen=True)
class RoundRecord:
    """One round: how many tokens were drafted, accepted, and emitted (committed)."""

    drafted: int  # draft tokens proposed this round (gamma, or fewer near limits)
    accepted: int  # of those, kept by verification (a prefix of the draft)
    emitted: int  # tokens committed this round, after stop truncation


@dataclass
class GenerationStats:
    """Counters of one generate call; summaries are properties so they never go stale."""

    prompt_tokens: int = 0  # length of the prompt
    new_tokens: int = 0  # tokens generated (== len(result.tokens))
    rounds: int = 0  # rounds run (plain decoding: one per token)
    drafted: int = 0  # draft tokens proposed, all rounds
    accepted: int = 0  # draft tokens accepted, all rounds
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: rounds where draft i was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: rounds that drafted a token at i
    target_calls: int = 0  # forward passes of the target
    drafter_calls: int = 0  # forward passes of the drafter (0 for model-free drafters)
    wall_time_s: float = 0.0  # whole call, prefill included
    target_time_s: float = 0.0  # time inside target forwards
    drafter_time_s: float = 0.0  # time inside drafter proposals and catch-up
    records: list[RoundRecord] = field(default_factory=list)  # one per round

    def record_round(self, drafted: int, accepted: int, emitted: int) -> None:
        """Add one round's counts."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.new_tokens += emitted
        for per, n in ((self.drafted_per_position, drafted), (self.accepted_per_position, accepted)):
            if len(per) < n:
                per.extend([0] * (n - len(per)))
            for i in range(n):
                per[i] += 1
        self.records.append(RoundRecord(drafted, accepted, emitted))

    @property
    def acceptance_rate(self) -> float:
        """alpha = accepted / drafted (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """tau = tokens emitted per round, including the recovered or bonus token (0.0 if no round)."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time (0.0 for an empty or instant call)."""
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        """Plain dict (JSON-ready) with the summaries included and the per-round records left out."""
        d = asdict(self)
        d.pop("records")
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            tokens_per_s=self.tokens_per_s,
        )
        return d


@dataclass(frozen=True)
class RoundEvent:
    """What one round committed, passed to ``on_round``; concatenated events == result tokens."""

    tokens: list[int]  # newly committed token ids, in order (after stop truncation)
    kinds: list[str]  # one label per token: ACCEPTED / RECOVERED / BONUS / TARGET


@dataclass
class GenerationResult:
    """The output of ``speculative_generate`` / ``autoregressive_generate``."""

    tokens: list[int]  # the new tokens only, prompt excluded
    stats: GenerationStats  # counters and timings of the call
    stop_reason: str  # STOP_TOKEN / STOP_STRING / MAX_NEW_TOKENS / CONTEXT_LIMIT
