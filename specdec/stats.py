"""What a generation did: per-round records and their summaries, plus the result types.

Vocabulary (docs/design.md): a round drafts ``drafted`` tokens and emits ``accepted`` of them plus one
recovered (at the first rejection) or bonus (all drafts accepted) token.

- acceptance rate  alpha = accepted / drafted            (0.0 when nothing was drafted)
- mean accepted length tau = emitted tokens / rounds     (counts the recovered/bonus token;
  1.0 = plain decoding; Spec-Bench / vLLM convention)

For plain autoregressive decoding every token is one round with nothing drafted.

A batch decodes several rows at once: each row has its own ``GenerationStats`` (its rounds, drafts,
acceptance, and the time of the rounds it took part in, shared with the rows beside it), and the
run has one ``BatchStats`` (rounds of the whole batch, forward passes, and where the wall time went:
prefill, proposing (drafter forwards and drafting), verifying (the target's forward), and the rest,
accepting and committing: the loop's bookkeeping). Times come from the loop's phase events
(``specdec.events.PhaseClock``), synchronised on CUDA.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.processors import GenerationSettings

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

    drafted: int  # draft tokens proposed this round (the drafted length: gamma, or what the schedule chose)
    accepted: int  # of those, kept by verification (a prefix of the draft)
    emitted: int  # tokens committed this round, after stop truncation
    ended: str = ""  # why the draft ended: bound, threshold, lookup, room or none ("" when the drafter does not say)


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
    target_calls: int = 0  # forward passes of the target (shared with the rows batched beside this one)
    drafter_calls: int = 0  # forward passes of the drafter (0 for model-free drafters; shared likewise)
    wall_time_s: float = 0.0  # from joining the batch (prefill included) to finishing
    target_time_s: float = 0.0  # time verifying (and prefilling the target) in this row's rounds
    drafter_time_s: float = 0.0  # time proposing (and prefilling the drafter) in this row's rounds
    lossless: bool = True  # whether the verification rule reproduces the target exactly
    records: list[RoundRecord] = field(default_factory=list)  # one per round

    def record_round(self, drafted: int, accepted: int, emitted: int, ended: str = "") -> None:
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
        self.records.append(RoundRecord(drafted, accepted, emitted, ended))

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
class AutoChoice:
    """``speculate="auto"`` at one batch-size bucket: the mode it kept and the speeds it measured."""

    rows: tuple[int, int]  # the bucket: batches of rows[0] to rows[1] rows share one measurement
    speculate: str  # "on" (drafting measured faster), "off" (plain decoding did) or "measuring" (trials unfinished)
    draft_tokens_per_s: float  # committed tokens per second over the trial rounds that drafted (0: none yet)
    plain_tokens_per_s: float  # the same over the trial rounds that did not draft
    width: int | None = None  # drafting's width: the longest draft a row holds (None: uncapped)
    like: tuple[int, int] | None = None  # "off" unmeasured, as at this smaller bucket, where plain decoding won

    @classmethod
    def from_dict(cls, fields: dict) -> AutoChoice:
        """The choice from its ``dataclasses.asdict`` read back from JSON (the buckets' lists as tuples)."""
        like = fields.get("like")
        return cls(**{**fields, "rows": tuple(fields["rows"]), "like": None if like is None else tuple(like)})


@dataclass
class BatchStats:
    """Counters of one batched run (every row of a generate call); times from the loop's phase events."""

    rows: int = 0  # prompts decoded
    rounds: int = 0  # rounds of the batch
    row_rounds: int = 0  # rows summed over rounds (row_rounds / rounds = mean rows per round)
    max_rows: int = 0  # most rows decoded together
    new_tokens: int = 0  # tokens generated, all rows
    drafted: int = 0  # draft tokens verified, all rows
    accepted: int = 0  # draft tokens accepted, all rows
    target_calls: int = 0  # forward passes of the target (a batch's forward counts once)
    drafter_calls: int = 0  # forward passes of the drafter
    wall_time_s: float = 0.0  # the whole call
    prefill_time_s: float = 0.0  # prefilling both models as rows join
    propose_time_s: float = 0.0  # proposing: drafter forwards and drafting
    verify_time_s: float = 0.0  # the target's verification forwards
    accept_time_s: float = 0.0  # applying the verification rule
    commit_time_s: float = 0.0  # rolling caches back, stops, statistics, callbacks
    lossless: bool = True  # every row's rule reproduces the target exactly
    auto: list[AutoChoice] = field(default_factory=list)  # speculate="auto": per batch-size bucket (else empty)
    apart: str = ""  # why the rows decoded one at a time, by model class ("": rows shared forwards)

    @property
    def mean_rows(self) -> float:
        """Rows per round, averaged over rounds."""
        return self.row_rounds / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def bookkeeping_s(self) -> float:
        """Wall time outside prefill, proposing and verifying: the loop's own work."""
        return max(0.0, self.wall_time_s - self.prefill_time_s - self.propose_time_s - self.verify_time_s)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(mean_rows=self.mean_rows, acceptance_rate=self.acceptance_rate, tokens_per_s=self.tokens_per_s,
                 bookkeeping_s=self.bookkeeping_s)
        return d


@dataclass(frozen=True)
class RoundEvent:
    """What one round committed for one row, passed to ``on_round``; a row's concatenated events ==
    its result tokens."""

    tokens: list[int]  # newly committed token ids, in order (after stop truncation)
    kinds: list[str]  # one label per token: ACCEPTED / RECOVERED / BONUS / TARGET
    row: int = 0  # index of the prompt in the call's input order


@dataclass
class GenerationResult:
    """The output of ``speculative_generate`` / ``autoregressive_generate`` for one prompt."""

    tokens: list[int]  # the new tokens only, prompt excluded
    stats: GenerationStats  # counters and timings of this prompt
    stop_reason: str  # STOP_TOKEN / STOP_STRING / MAX_NEW_TOKENS / CONTEXT_LIMIT
    batch: BatchStats | None = None  # the run's batch figures (shared by every prompt of the call)
    index: int = 0  # position of the prompt in the call's input order
    settings: GenerationSettings | None = None  # the sampling and logits processors in force, and where from
