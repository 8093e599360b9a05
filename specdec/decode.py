"""The round loop of speculative decoding for a batch of prompts, and the plain baseline.

Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"), batched. Each
round, for every row of the batch at once: **propose** (the drafter drafts up to the schedule's
number of tokens per row; prompt lookup, which costs no forward, may copy up to its
``free_tokens``) -> **verify** (one target forward over [newest committed token, drafts] per row)
-> **accept** (the verification rule keeps a prefix of each row's drafts and picks its recovered or
bonus token) -> **commit** (both models roll each row back to its committed sequence; stops apply;
listeners hear of it). Rows accept different numbers of tokens (ragged); a row that finishes leaves
the batch at once and costs nothing more; waiting prompts join at the next round boundary (``specdec.admission``; a
``Decoder`` fed from a queue is how a server batches continuously). A model whose rows cannot share a
forward (``Target.rows_apart``, ``Drafter.rows_apart``: sparse attention, RoFormer, ...) is never refused
at batch > 1: the batch then holds one row at a time, each prompt decoded as it is alone, said once.

Contracts:
- Greedy output of every row equals the target's own greedy decoding of that prompt alone (up to
  near ties of the target's two best logits, which batched or multi-token forwards may flip);
  sampled output is distributed exactly as sampling from the target, per row (temperature / top-k /
  top-p applied identically to p and q). The target's generation config and a caller's logits
  processors apply to its logits at every verified position with that position's own prefix, as
  ``generate`` applies them (``specdec.processors``); rows without processors cost nothing more. Each
  rule declares whether it is lossless; results say so.
- Caches: after every round, per row, the target caches every committed token but the newest, which
  is the next round's first input; the drafter keeps the analogous invariant with its pending
  tokens. Only uncached tokens are ever fed to a model: no O(n^2) re-forwarding.
- Stops, per row: the first stop token or completed stop string (kept in the output), even inside
  accepted drafts (stop strings are matched in the decoded new text, special tokens skipped,
  checked token by token); never more than ``max_new_tokens``; the sequence never exceeds the
  target's or the drafter's context (a row drafts less near it).
- Log-probabilities, for a row that asks (``Request.logprobs``): each committed token's under the target, from the
  verify's logits at its position after the processors (``token_logprobs``), so speculation never changes them; a
  row that does not ask costs nothing more.
- The loop times, counts and prints nothing itself: it emits events (``specdec.events``).
This module knows nothing about text except through the optional tokenizer (prompts given as
strings, stop strings).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from specdec.acceptance import Verdict, Verifier, rule_for
from specdec.admission import Admission
from specdec.batch import PromptBatch, kept_order
from specdec.config import (
    ModelConfig,
    SamplingConfig,
    ScheduleConfig,
    SpecConfig,
    VerifyConfig,
    check_kernels,
)
from specdec.drafters import Drafter, NoDrafter, Proposal, make_drafter
from specdec.events import (
    ACCEPT,
    COMMIT,
    PROPOSE,
    VERIFY,
    Events,
    Listener,
    OnRound,
    PhaseClock,
    RoundSummary,
    RowRound,
    Tally,
)
from specdec.kernels import active
from specdec.logprobs import TokenLogprob, token_logprobs
from specdec.processors import (
    DraftSampler,
    GenerationSettings,
    Penalties,
    Processing,
    RowProcessors,
    apply,
    resolve,
    round_rows,
)
from specdec.prompts import prompt_list
from specdec.sampling import Sampler, make_generator
from specdec.schedules import Crossover, Schedule, make_schedule
from specdec.stats import (
    ACCEPTED,
    BONUS,
    CONTEXT_LIMIT,
    MAX_NEW_TOKENS,
    RECOVERED,
    STOP_STRING,
    STOP_TOKEN,
    TARGET,
    BatchStats,
    GenerationResult,
    GenerationStats,
    RoundEvent,
)
from specdec.target import Target, make_target
from specdec.tree import TreeConfig, tree_refusal, tree_round

OnRoundFn = Callable[[RoundEvent], None]
OnResultFn = Callable[[GenerationResult], None]


@dataclass(frozen=True)
class Request:
    """One prompt and how to decode it."""

    ids: list[int]  # the committed sequence the target continues (decoder-only: the prompt)
    max_new_tokens: int  # upper bound on new tokens
    sampling: SamplingConfig  # temperature, top-k, top-p, seed of this row
    stop_ids: frozenset[int] = frozenset()  # stop tokens (kept in the output)
    stop_strings: tuple[str, ...] = ()  # stop once the decoded new text contains one of these
    source: list[int] | None = None  # the encoder's input (encoder-decoder targets only)
    index: int = 0  # position in the caller's input order (RoundEvent.row)
    processors: LogitsProcessorList | None = None  # applied to the target's logits at every verified position
    penalties: Penalties | None = None  # OpenAI's logit bias and presence / frequency penalties (another processor)
    logprobs: int | None = None  # None: none; k: each new token's log-probability and the k most probable tokens
    prompt_logprobs: int | None = None  # likewise for the prompt's tokens (``prompt_logprobs``; serving's ``echo``)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length as a user counts it: the source's for an encoder-decoder target."""
        return len(self.ids if self.source is None else self.source)


@dataclass
class Row:
    """A request in the decoder: its output so far, its generator and its figures."""

    request: Request
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # new tokens committed so far
    stats: GenerationStats = field(default_factory=GenerationStats)
    stop_reason: str | None = None
    joined: float = 0.0  # perf_counter when it was submitted
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token, when the request asks

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def room(self, context_limit: int | None) -> int:
        """Tokens this row may still commit: its budget, within ``context_limit`` (None: no limit)."""
        budget = self.request.max_new_tokens - len(self.tokens)
        if context_limit is not None:
            budget = min(budget, context_limit - len(self.request.ids) - len(self.tokens))
        return max(0, budget)

    def stop_if_full(self, context_limit: int | None) -> bool:
        """Mark the row done when it has no room left (its budget first, then the context); whether it is done."""
        if self.stop_reason is None and self.request.max_new_tokens - len(self.tokens) <= 0:
            self.stop_reason = MAX_NEW_TOKENS
        elif self.stop_reason is None and self.room(context_limit) <= 0:
            self.stop_reason = CONTEXT_LIMIT
        return self.done

    def _completes_stop_string(self, new: list[int], tokenizer: PreTrainedTokenizerBase) -> bool:
        """Whether the newest token of ``self.tokens + new`` completes a stop string."""
        # Enough tokens to hold the longest stop string: each token with text adds >= 1 character.
        window = max(len(s) for s in self.request.stop_strings) + 4
        text = tokenizer.decode((self.tokens + new)[-window:], skip_special_tokens=True)
        return any(s in text for s in self.request.stop_strings)

    def commit(self, tokens: list[int], kinds: list[str], tokenizer: PreTrainedTokenizerBase | None,
               logprobs: list[TokenLogprob] | None = None) -> RoundEvent:
        """Append a round's tokens (and their ``logprobs``, when asked) up to the first stop; the event of what
        was kept."""
        for i, token in enumerate(tokens):
            if token in self.request.stop_ids:
                self.stop_reason = STOP_TOKEN
            elif self.request.stop_strings and self._completes_stop_string(tokens[: i + 1], tokenizer):
                self.stop_reason = STOP_STRING
            if self.stop_reason:
                tokens, kinds = tokens[: i + 1], kinds[: i + 1]
                break
        self.tokens.extend(tokens)
        if logprobs is not None:
            self.logprobs.extend(logprobs[: len(tokens)])
        return RoundEvent(tokens, kinds, self.request.index)

    def result(self, batch: BatchStats | None, settings: GenerationSettings | None = None) -> GenerationResult:
        return GenerationResult(self.tokens, self.stats, self.stop_reason or MAX_NEW_TOKENS, batch, self.request.index,
                                settings)


def _kinds(drafted: int, accepted: int) -> list[str]:
    """Labels of a round's committed tokens: the accepted drafts, then recovered / bonus / target."""
    last = TARGET if drafted == 0 else RECOVERED if accepted < drafted else BONUS
    return [ACCEPTED] * accepted + [last]


class Decoder:
    """Decodes requests in batches of up to ``batch_size`` rows; waiting requests join at round boundaries.

    The decoder holds the batch (its rows, in cache-row order, their newest tokens, their sampler) and runs its
    rounds; what is not yet in the batch, and whether the drafter holds the rows, is its ``admission``'s
    (``specdec.admission``); its figures are a listener's (``tally``, ``events.Tally``)."""

    def __init__(self, target: Target, drafter: Drafter, schedule: Schedule, *, verify: VerifyConfig | None = None,
                 batch_size: int = SpecConfig.batch_size, tokenizer: PreTrainedTokenizerBase | None = None,
                 listeners: Sequence[Listener] = (), prefill_beside: bool = False,
                 tree: TreeConfig | None = None) -> None:
        self.target, self.drafter, self.schedule = target, drafter, schedule
        self.tree = tree  # token trees instead of chains (``specdec.tree``), where the models allow them
        if tree is not None and (reason := tree_refusal(target, drafter)) is not None:
            raise ValueError(f"token trees are not available here: {reason}")
        self.verifier = Verifier(verify or VerifyConfig())
        self.batch_size = batch_size
        self.tokenizer = tokenizer
        self.device = target.device
        self.clock = PhaseClock(self.device)
        self.tally = Tally(self.clock)
        self.events = Events([self.clock, self.tally, *listeners,
                              *([schedule] if isinstance(schedule, Listener) else [])])
        self.admission = Admission(target, drafter, schedule, self.events, self.clock, batch_size, prefill_beside)
        self.rows: list[Row] = []  # the batch, in cache-row order
        self.last = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] newest committed token per row
        self.sampler = Sampler.per_row([], [])
        self.processing = False  # whether a row has logits processors
        self._asked: tuple[list[int], torch.Tensor] = ([], self.last)  # the last round's drafts asked, host and device

    @property
    def stats(self) -> BatchStats:
        """The run's counts so far (``batch_stats``: with the times)."""
        self.tally.stats.apart = self.admission.apart or ""
        return self.tally.stats

    @property
    def waiting(self) -> deque[Row]:
        return self.admission.waiting

    @property
    def prefilling(self) -> int:
        """Rows being prefilled beside the batch (``prefill_beside``): no longer waiting, not yet in the batch."""
        return len(self.admission.prefilling)

    @property
    def busy(self) -> bool:
        return bool(self.admission.waiting or self.rows or self.admission.beside)

    # ---------------------------------------------------------------------------- rows in and out

    def submit(self, request: Request) -> Row:
        """Queue a request; it joins the batch at the next round boundary."""
        lossless = self.verifier.lossless(request.sampling)  # refuses a rule that does not fit the temperature
        if request.penalties:  # one more processor of the row, after the generation config's
            own = list(request.processors or [])
            request = replace(request, processors=RowProcessors(
                LogitsProcessorList([*own, request.penalties.processor(len(request.ids))])))
        row = Row(request, make_generator(request.sampling.seed, self.device), joined=time.perf_counter())
        row.stats = GenerationStats(prompt_tokens=len(request.ids), lossless=lossless)
        self.resume(row)
        return row

    def resume(self, row: Row) -> None:
        """Queue a row that another decoder started (a server's engine moves its rows to a fresh decoder after a
        failed round): it keeps its tokens, generator and figures, and joins with its committed sequence, prompt
        and new tokens, as its prompt."""
        self.events.submitted(row.stats)
        self.admission.waiting.append(row)

    def in_flight(self) -> list[Row]:
        """Every row submitted and not yet returned by ``step``: in the batch, prefilled beside it, waiting."""
        return self.rows + self.admission.prefilling + list(self.admission.waiting)

    def cancel(self, row: Row, reason: str = "cancelled") -> None:
        """Stop a row (a client that went away); it leaves the batch at the next step, before its round."""
        row.stop_reason = row.stop_reason or reason

    def rows_apart(self, prompts: PromptBatch | None = None) -> str | None:
        """Why the models' rows cannot share a forward (the batch then holds one row at a time), or None
        (``Admission.rows_apart``: from ``prompts``, a server's probe at start, else once two rows are in sight)."""
        return self.admission.rows_apart(self.rows, prompts)

    def _add(self, joining: list[Row], prompts: PromptBatch) -> None:
        """Rows both models have prefilled join the batch (``Admission.join``)."""
        self.rows.extend(joining)
        self.last = torch.cat([self.last, prompts.ids[:, -1]])
        self._resample()

    def _resample(self) -> None:
        self.sampler = Sampler.per_row([r.request.sampling for r in self.rows], [r.generator for r in self.rows])
        self.processing = any(r.request.processors for r in self.rows)

    def _leave(self) -> list[Row]:
        """Rows that finished leave the batch; the others are compacted in both models' caches, the fewest moved
        (``batch.kept_order``: the rows' order in the batch is not their requests' order)."""
        finished = [r for r in self.rows if r.done]
        if finished:
            order = kept_order([r.done for r in self.rows])
            keep = torch.tensor(order, dtype=torch.long, device=self.device)
            out = self.admission.drafter_out
            for part in (self.target, self.schedule) if out else (self.target, self.drafter, self.schedule):
                part.select(keep)
            self.last = self.last[keep]
            self.rows = [self.rows[i] for i in order]
            self._resample()
        return finished

    # -------------------------------------------------------------------------------------- rounds

    def step(self) -> list[Row]:
        """Admit waiting rows, run one round for the batch, let finished rows go; return those. The models'
        linear layers run specdec's kernels meanwhile (``specdec.kernels``: where installed)."""
        with active():
            finished = self.admission.join(self.rows, self._add) + self._leave()  # cancelled rows go before the round
            if self.rows:
                self._round()
                finished += self._leave()
        for row in finished:
            row.stats.wall_time_s = time.perf_counter() - row.joined
            row.stop_reason = row.stop_reason or MAX_NEW_TOKENS
        return finished

    def _round(self) -> None:
        """One round for every row: propose -> verify -> accept -> commit (of a token tree per row: ``tree_round``,
        unless a row's logits processors need each position's prefix)."""
        self.clock.new_round()
        if self.tree is not None and not self.processing:
            return tree_round(self)
        rows = round_rows([(r.request.ids + r.tokens if r.request.processors else [], r.request.processors)
                           for r in self.rows], self.device) if self.processing else []
        with self.events.phase(PROPOSE):
            plan = self.schedule.plan(len(self.rows), self.device)
            self.admission.seat_drafter(plan, self.rows)
            if self.admission.drafter_out:
                proposal = Proposal.empty(len(self.rows), self.device)
            else:
                budget = self._budget(plan.width)  # per row, on the host
                asked, limit = self._ask([min(n, most) for n, most in zip(plan.limit.tolist(), budget)])
                sampler = DraftSampler.wrap(self.sampler, rows) if self.processing else self.sampler
                proposal = self._within(self.drafter.propose(limit, sampler, plan.stop), asked, budget)
        with self.events.phase(VERIFY):
            candidates = torch.cat([self.last[:, None], proposal.tokens], dim=1)  # [B, k+1]
            scores = self.target.verify(candidates, proposal.lengths + 1)  # logits [B, k+1, V]
            logits = scores.logits
            if self.processing:  # each position with its own prefix: committed tokens + the drafts before it
                logits = apply(logits, candidates, proposal.lengths + 1, rows)
        with self.events.phase(ACCEPT):
            verdict = self.verifier(proposal, logits, self.sampler)  # accepted [B], next_token [B]
        with self.events.phase(COMMIT):
            self.target.rollback(verdict.accepted + 1)
            if not self.admission.drafter_out:
                self.drafter.commit(verdict.accepted, verdict.next_token)
            self.schedule.update(proposal, verdict)
            self.last = verdict.next_token
            drafted, accepted, committed = self._commit_rows(proposal, verdict, logits)
        self.events.round_ended(RoundSummary(len(self.rows), drafted, committed, self.clock.round_seconds, accepted,
                                             proposal.calls))

    def _budget(self, width: int | None) -> list[int]:
        """The most drafts each row's round can verify, once a round, on the host: the room the row has left less
        the verified token, within the drafter's context and the plan's ``width`` (None: no cap). Every row in the
        batch has room (``Row.stop_if_full`` as it joins and after each round)."""
        budget = []
        for row in self.rows:
            most = row.room(self.target.context_limit) - 1
            if self.drafter.context_limit is not None:
                most = min(most, self.drafter.context_limit - len(row.request.ids) - len(row.tokens) + 1)
            if width is not None:
                most = min(most, width)
            budget.append(max(0, most))
        return budget

    def _ask(self, asked: list[int]) -> tuple[list[int], torch.Tensor]:
        """The drafts the drafter is asked for, per row, and as a device tensor: last round's when the same (plain
        decoding, a constant schedule with room left), else a new one (a copy to a CUDA device waits for it)."""
        if self._asked[0] != asked:
            self._asked = (asked, torch.tensor(asked, dtype=torch.long, device=self.device))
        return self._asked

    def _within(self, proposal: Proposal, asked: list[int], budget: list[int]) -> Proposal:
        """The drafts a round verifies: each row's within what it was ``asked`` (or the drafter's free tokens), cut
        to its ``budget`` (checked on the host, from the drafts as lists)."""
        if tuple(proposal.lengths.shape) != (len(asked),):
            raise ValueError(f"the drafter proposed for {tuple(proposal.lengths.shape)} rows, not {len(self.rows)}")
        drafts = proposal.drafts()  # as lists: known to most drafters, else one read of the tensors
        free = self.drafter.free_tokens
        for i, (draft, n) in enumerate(zip(drafts, asked)):
            if len(draft) > max(n, free):
                raise ValueError(f"the drafter proposed {len(draft)} tokens for prompt "
                                 f"{self.rows[i].request.index} when asked for at most {max(n, free)}")
        vocab = self.target.vocab_size
        if any(t < 0 or t >= vocab for draft in drafts for t in draft):
            raise ValueError(f"the drafter proposed token ids outside the target's vocabulary [0, {vocab})")
        longest = max((len(d) for d in drafts), default=0)
        if longest < proposal.k or any(len(d) > most for d, most in zip(drafts, budget)):
            return proposal.cut(torch.tensor(budget, dtype=torch.long, device=self.device))
        return proposal

    def _commit_rows(self, proposal: Proposal, verdict: Verdict, logits: torch.Tensor) -> tuple[int, int, int]:
        """Append each row's accepted drafts and next token (up to its stops), with their log-probabilities
        where the row asks (from ``logits`` [B, k+1, V], the verify's after the processors); tell listeners; mark
        the rows left without room done. Returns the tokens drafted, accepted and committed, all rows."""
        drafts = proposal.drafts()
        lengths, accepted, next_tokens = torch.stack([proposal.lengths, verdict.accepted, verdict.next_token]).tolist()
        ended = proposal.ended or ("",) * len(self.rows)
        committed = 0
        for b, (row, draft, drafted, n, nxt, why) in enumerate(
                zip(self.rows, drafts, lengths, accepted, next_tokens, ended)):
            tokens = draft[:n] + [nxt]
            logprobs = (None if row.request.logprobs is None else
                        token_logprobs(logits[b, : n + 1], tokens, row.request.logprobs))
            event = row.commit(tokens, _kinds(drafted, n), self.tokenizer, logprobs)
            self.events.row_round(RowRound(row.stats, drafted, n, len(event.tokens), why, proposal.calls))
            committed += len(event.tokens)
            self.events.round_committed(event)
            row.stop_if_full(self.target.context_limit)
        return sum(lengths), sum(accepted), committed

    def run(self) -> None:
        """Step until every submitted request is done."""
        while self.busy:
            self.step()

    def batch_stats(self) -> BatchStats:
        """The run's figures so far, times included."""
        s = self.tally.figures()
        s.apart = self.admission.apart or ""
        if isinstance(self.schedule, Crossover):
            s.auto = self.schedule.choices()
        return s


# ------------------------------------------------------------------------------------------ the API


def build_requests(target: Target, prompts: object, *, max_new_tokens: int, sampling: SamplingConfig,
                   stop_token_ids: int | Sequence[int] | None, stop_strings: str | Sequence[str] | None,
                   tokenizer: PreTrainedTokenizerBase | None,
                   processing: Processing | None = None) -> tuple[list[Request], bool]:
    """Validate the prompts and stops shared by both loops -> (one request per prompt, single prompt?).

    A row's generator seed is ``sampling.seed + its index`` (None: each drawn from torch's global RNG);
    its logits processors are built by ``processing`` (None: none)."""
    sources = target.encoder_decoder  # an encoder-decoder target: the prompts are its sources
    rows, single = prompt_list(prompts, tokenizer, "source" if sources else "prompt")
    for i, ids in enumerate(rows):
        where = ("the source" if single else f"source {i}") if sources else ("the prompt" if single else f"prompt {i}")
        if not ids:
            raise ValueError(f"{where} is empty: pass at least one token" + (
                "" if sources else " (e.g. the tokenizer's bos token)"))
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= target.vocab_size:
            raise ValueError(f"{where}'s token ids must lie in [0, {target.vocab_size}) (the target's vocabulary), "
                             f"got {lo}..{hi}")
        limit = target.source_limit if sources else target.context_limit
        if limit is not None and len(ids) > limit:
            whose = "encoder's positions hold" if sources else "target's context holds"
            raise ValueError(f"{where} has {len(ids)} tokens but the {whose} {limit}: shorten it by "
                             f"{len(ids) - limit}")
    if isinstance(stop_strings, str):
        stop_strings = (stop_strings,)
    stop_strings = tuple(stop_strings or ())
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer to decode the output: pass tokenizer=")
    if any(not isinstance(s, str) or not s for s in stop_strings):
        raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
    if stop_token_ids is None:
        stop_ids = frozenset(target.stop_token_ids())
    else:
        stop_ids = frozenset([stop_token_ids] if isinstance(stop_token_ids, int) else map(int, stop_token_ids))
    requests = []
    for i, ids in enumerate(rows):
        seed = sampling.seed if sampling.seed is None else sampling.seed + i
        row_sampling = replace(sampling, seed=seed)
        requests.append(prompt_request(target, ids, max_new_tokens, row_sampling, stop_ids, stop_strings, index=i,
                                       processing=processing))
    return requests, single


def prompt_request(target: Target, ids: list[int], max_new_tokens: int, sampling: SamplingConfig,
                   stop_ids: frozenset[int], stop_strings: tuple[str, ...] = (), index: int = 0,
                   processing: Processing | None = None) -> Request:
    """One prompt's request: the sequence the decoder continues, or, for an encoder-decoder target, the
    encoder's source, with the decoder starting from its start token; with the row's logits processors
    when ``processing`` has any."""
    source = ids if target.encoder_decoder else None
    if target.encoder_decoder:
        ids = [target.decoder_start]
    processors = None if processing is None else processing.for_row(ids, max_new_tokens, source, target.device)
    return Request(ids, max_new_tokens, sampling, stop_ids, stop_strings, source=source, index=index,
                   processors=processors)


def _decode(target: Target, drafter: Drafter, schedule: Schedule, requests: list[Request], *, verify: VerifyConfig,
            batch_size: int, tokenizer: PreTrainedTokenizerBase | None, on_round: OnRoundFn | None,
            on_result: OnResultFn | None, settings: GenerationSettings | None = None,
            tree: TreeConfig | None = None) -> list[GenerationResult]:
    """Decode every request; results in input order, each with the run's batch figures and ``settings``
    (``on_result`` hears of each as its row finishes, with the figures so far)."""
    decoder = Decoder(target, drafter, schedule, verify=verify, batch_size=batch_size, tokenizer=tokenizer,
                      listeners=[OnRound(on_round)] if on_round else [], tree=tree)
    rows = [decoder.submit(r) for r in requests]
    with torch.inference_mode():
        while decoder.busy:
            for row in decoder.step():
                if on_result is not None:
                    on_result(row.result(decoder.batch_stats(), settings))
    batch = decoder.batch_stats()
    return [row.result(batch, settings) for row in rows]


def speculative_generate(
    target: PreTrainedModel | Target,
    drafter: object,
    prompts: object,
    *,
    max_new_tokens: int,
    gamma: int = SpecConfig.gamma,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token_ids: int | Sequence[int] | None = None,
    seed: int | None = None,
    stop_strings: str | Sequence[str] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    on_round: OnRoundFn | None = None,
    on_result: OnResultFn | None = None,
    verify: str | VerifyConfig | None = None,
    batch_size: int = SpecConfig.batch_size,
    speculate: str = SpecConfig.speculate,
    schedule: Schedule | ScheduleConfig | str | None = None,
    logits_processor: LogitsProcessorList | None = None,
    ignore_generation_config: bool = SamplingConfig.ignore_generation_config,
    kernels: str = ModelConfig.kernels,
    tree: int | TreeConfig | None = None,
) -> GenerationResult | list[GenerationResult]:
    """Generate with ``target``, drafting with ``drafter``, for one prompt or a list of prompts.

    ``drafter``: a transformers causal LM, a drafter name ("ngram", "lookup+NAME", a shipped model
    name or folder), a ``DrafterConfig`` or a ``Drafter``. ``prompts``: token ids, a string (with
    ``tokenizer``), or a list of those; one prompt returns one ``GenerationResult``, a list returns
    a list in the same order. Greedy output (``temperature`` 0) equals the target's own greedy
    decoding of each prompt; sampled output is distributed as its sampling. ``verify`` names the
    rule (None: exact when greedy, sampling otherwise); ``batch_size`` rows decode together;
    ``speculate`` "on", "off" (plain decoding) or "auto" (measured per batch size); ``schedule``
    (a name, a ``ScheduleConfig`` or a ``Schedule``) decides how far each row drafts (None: the
    constant ``gamma``). ``on_round`` hears each row's committed tokens as rounds end,
    ``on_result`` each prompt's result as it finishes (in completion order).

    The target's ``generation_config`` applies as in ``generate`` (``specdec.processors``): ``temperature``,
    ``top_k``, ``top_p`` left None come from it when it samples (else greedy, no top-k, no top-p), and
    its logits processors (repetition penalty, forced tokens, ...) and ``logits_processor`` apply to the
    target's logits at every verified position; ``ignore_generation_config`` decodes raw. Each result's
    ``settings`` says what was in force and where it came from. ``kernels`` "auto" gives the models this call makes
    handles for specdec's CPU linear kernels (``specdec.kernels``, as ``SPECDEC_LINEAR`` says: it may build them
    once per machine, probe their timings and set the float32 CPU linear layers' forwards, used only while specdec
    decodes); "off" leaves the models as they are. ``tree`` (a node count or a ``TreeConfig``; None: chains) drafts a
    token tree per row instead of a chain, ``gamma`` deep (``specdec.tree``: a model or feature drafter, eager caches).
    """
    spec = SpecConfig(gamma=gamma, max_new_tokens=max_new_tokens, batch_size=batch_size, speculate=speculate,
                      tree=tree if tree is None or isinstance(tree, int) else tree.nodes)
    tree = TreeConfig(nodes=tree) if isinstance(tree, int) else tree
    verify = verify if isinstance(verify, VerifyConfig) else VerifyConfig(rule=verify)
    fast = check_kernels(kernels)
    handle = make_target(target, fast)
    processing = resolve(handle.model, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         logits_processor=logits_processor, ignore_generation_config=ignore_generation_config,
                         device=handle.device)
    sampling = processing.settings.sampling
    requests, single = build_requests(handle, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                      stop_token_ids=stop_token_ids, stop_strings=stop_strings, tokenizer=tokenizer,
                                      processing=processing)
    rule_for(verify, sampling.greedy)  # refuses a rule that does not fit the temperature, before any work
    chosen = NoDrafter() if spec.speculate == "off" else make_drafter(drafter, handle, tokenizer, kernels=fast)
    chosen.reset()  # a Drafter object passed in may hold the rows of an earlier call
    if not isinstance(schedule, Schedule):
        schedule = make_schedule(spec, ScheduleConfig(schedule) if isinstance(schedule, str) else schedule, chosen)
    results = _decode(handle, chosen, schedule, requests,
                      verify=verify, batch_size=spec.batch_size, tokenizer=tokenizer, on_round=on_round,
                      on_result=on_result, settings=processing.settings, tree=None if spec.speculate == "off" else tree)
    return results[0] if single else results


def autoregressive_generate(
    target: PreTrainedModel | Target,
    prompts: object,
    *,
    max_new_tokens: int,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token_ids: int | Sequence[int] | None = None,
    seed: int | None = None,
    stop_strings: str | Sequence[str] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    on_round: OnRoundFn | None = None,
    on_result: OnResultFn | None = None,
    batch_size: int = SpecConfig.batch_size,
    logits_processor: LogitsProcessorList | None = None,
    ignore_generation_config: bool = SamplingConfig.ignore_generation_config,
    kernels: str = ModelConfig.kernels,
) -> GenerationResult | list[GenerationResult]:
    """Plain decoding with the target alone (the same loop, drafting nothing): one forward per token; the
    generation config, ``logits_processor`` and ``kernels`` apply as in ``speculative_generate``."""
    spec = SpecConfig(max_new_tokens=max_new_tokens, batch_size=batch_size)
    handle = make_target(target, check_kernels(kernels))
    processing = resolve(handle.model, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         logits_processor=logits_processor, ignore_generation_config=ignore_generation_config,
                         device=handle.device)
    requests, single = build_requests(handle, prompts, max_new_tokens=max_new_tokens,
                                      sampling=processing.settings.sampling, stop_token_ids=stop_token_ids,
                                      stop_strings=stop_strings, tokenizer=tokenizer, processing=processing)
    results = _decode(handle, NoDrafter(), make_schedule(spec), requests, verify=VerifyConfig(),
                      batch_size=spec.batch_size, tokenizer=tokenizer, on_round=on_round, on_result=on_result,
                      settings=processing.settings)
    return results[0] if single else results
