"""The round loop of speculative decoding, and the plain autoregressive baseline.

Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"), batch size 1.
Each round: **propose** (the drafter drafts k <= gamma tokens; prompt lookup, which costs no
forward, may copy up to its ``free_tokens``) -> **verify** (one target forward
over [last committed token, drafts] gives logits for k+1 positions) -> **accept** (a rule from
``acceptance`` keeps a prefix of the drafts and picks the recovered or bonus token) -> **commit**
(both caches roll back to the committed sequence; stops are applied; ``on_round`` is told).

Contracts:
- Greedy output equals the target's own greedy decoding; sampled output is distributed exactly as
  sampling from the target (temperature / top-k / top-p applied identically to p and q).
- Caches: the target's cache holds every committed token but the newest, which is the next
  round's first input (cache length == committed - 1 after every round); the drafter keeps the
  analogous invariant with its pending tokens (see ``drafters.model``). Only uncached tokens are
  ever fed to a model: no O(n^2) re-forwarding.
- Stops: generation ends at the first stop token or completed stop string (kept in the output),
  even inside accepted drafts (stop strings are matched in the decoded new text, special tokens
  skipped, checked token by token); never more than ``max_new_tokens``; the sequence never exceeds the
  target's context (gamma shrinks near it).
This module knows nothing about text except through the optional tokenizer for stop strings.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.acceptance import rule_for
from specdec.cache import KVCache
from specdec.config import SamplingConfig, SpecConfig
from specdec.drafters import Proposal, make_drafter
from specdec.loading import context_limit, input_device, vocab_size
from specdec.sampling import Sampler, check_finite
from specdec.stats import (
    ACCEPTED,
    BONUS,
    CONTEXT_LIMIT,
    MAX_NEW_TOKENS,
    RECOVERED,
    STOP_STRING,
    STOP_TOKEN,
    TARGET,
    GenerationResult,
    GenerationStats,
    RoundEvent,
)

OnRound = Callable[[RoundEvent], None]


def _prompt_tensor(input_ids: object, device: torch.device, vocab: int) -> torch.Tensor:
    """Validate ``input_ids`` (list of ints, LongTensor [T] or [1, T]) -> LongTensor [1, T] on device."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got a {input_ids.dtype} tensor")
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise ValueError(f"input_ids has batch size {input_ids.shape[0]}; only batch size 1 is supported")
        if input_ids.dim() not in (1, 2):
            raise ValueError(f"input_ids must have shape [T] or [1, T], got {list(input_ids.shape)}")
        ids = input_ids.reshape(1, -1).to(device=device, dtype=torch.long)
    elif isinstance(input_ids, Sequence) and not isinstance(input_ids, (str, bytes)):
        try:
            values = [operator.index(t) for t in input_ids]
        except TypeError as err:
            raise TypeError("input_ids must be a list of ints or a LongTensor (token ids, not text)") from err
        ids = torch.tensor([values], dtype=torch.long, device=device)
    else:
        raise TypeError(f"input_ids must be a list of ints or a LongTensor, got {type(input_ids).__name__}")
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty: pass at least one token (e.g. the tokenizer's bos token)")
    lo, hi = torch.aminmax(ids)
    if lo.item() < 0 or hi.item() >= vocab:
        raise ValueError(f"input_ids must lie in [0, {vocab}) (the target's vocabulary), got {lo.item()}..{hi.item()}")
    return ids


def _stop_ids(target: PreTrainedModel, stop_token_ids: int | Sequence[int] | None) -> frozenset[int]:
    """None -> the target's end-of-sequence id(s) from its generation config; [] -> none."""
    if stop_token_ids is None:
        config = getattr(target, "generation_config", None)
        stop_token_ids = getattr(config, "eos_token_id", None)
        if stop_token_ids is None:
            stop_token_ids = getattr(target.config, "eos_token_id", None)
    if stop_token_ids is None:
        return frozenset()
    if isinstance(stop_token_ids, int):
        return frozenset([stop_token_ids])
    return frozenset(int(t) for t in stop_token_ids)


@dataclass
class _Run:
    """Bookkeeping shared by both loops: budget, stops, stats, timing, output."""

    prompt: torch.Tensor  # [1, T]
    max_new_tokens: int
    limit: int | None  # the target's context length
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    tokenizer: PreTrainedTokenizerBase | None
    on_round: OnRound | None
    sampler: Sampler
    sync: bool  # synchronize CUDA around timed phases
    stats: GenerationStats = field(default_factory=GenerationStats)
    tokens: list[int] = field(default_factory=list)
    stop_reason: str | None = None
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def start(
        cls,
        target: PreTrainedModel,
        input_ids: object,
        max_new_tokens: int,
        sampling: SamplingConfig,
        stop_token_ids: int | Sequence[int] | None,
        stop_strings: str | Sequence[str] | None,
        tokenizer: PreTrainedTokenizerBase | None,
        on_round: OnRound | None,
    ) -> _Run:
        """Validate the inputs shared by both loops and set up the run."""
        if not isinstance(target, PreTrainedModel):
            raise TypeError(f"target must be a transformers causal LM, got {type(target).__name__}")
        device = input_device(target)
        prompt = _prompt_tensor(input_ids, device, vocab_size(target))
        limit = context_limit(target)
        if limit is not None and prompt.shape[1] > limit:
            raise ValueError(
                f"the prompt has {prompt.shape[1]} tokens but the target's context holds {limit}: shorten it"
            )
        if isinstance(stop_strings, str):
            stop_strings = (stop_strings,)
        stop_strings = tuple(stop_strings or ())
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer to decode the output: pass tokenizer=")
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
        return cls(
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            limit=limit,
            stop_ids=_stop_ids(target, stop_token_ids),
            stop_strings=stop_strings,
            tokenizer=tokenizer,
            on_round=on_round,
            sampler=Sampler.create(sampling, device),
            sync=device.type == "cuda",
            stats=GenerationStats(prompt_tokens=prompt.shape[1]),
        )

    def clock(self) -> float:
        """perf_counter, after a CUDA sync when on GPU so phase times are real."""
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def room(self) -> int:
        """Tokens still allowed by max_new_tokens and the context; sets stop_reason at 0."""
        budget = self.max_new_tokens - len(self.tokens)
        if budget <= 0:
            self.stop_reason = self.stop_reason or MAX_NEW_TOKENS
            return 0
        if self.limit is not None:
            context_room = self.limit - self.prompt.shape[1] - len(self.tokens)
            if context_room <= 0:
                self.stop_reason = self.stop_reason or CONTEXT_LIMIT
                return 0
            budget = min(budget, context_room)
        return budget

    def _completes_stop_string(self, new: list[int]) -> bool:
        """Whether the newest token of ``self.tokens + new`` completes a stop string."""
        # Enough tokens to hold the longest stop string: each token with text adds >= 1 character.
        window = max(len(s) for s in self.stop_strings) + 4
        tail = (self.tokens + new)[-window:]
        text = self.tokenizer.decode(tail, skip_special_tokens=True)
        return any(s in text for s in self.stop_strings)

    def commit(self, tokens: list[int], kinds: list[str], drafted: int, accepted: int) -> bool:
        """Append a round's tokens up to the first stop; record it; True when generation is over."""
        for i, token in enumerate(tokens):
            if token in self.stop_ids:
                self.stop_reason = STOP_TOKEN
            elif self.stop_strings and self._completes_stop_string(tokens[: i + 1]):
                self.stop_reason = STOP_STRING
            if self.stop_reason:
                tokens, kinds = tokens[: i + 1], kinds[: i + 1]
                break
        self.tokens.extend(tokens)
        self.stats.record_round(drafted, accepted, len(tokens))
        if self.on_round is not None:
            self.on_round(RoundEvent(tokens, kinds))
        return self.stop_reason is not None

    def result(self) -> GenerationResult:
        """Close the run: wall time and the result."""
        self.stats.wall_time_s = self.clock() - self.started
        if self.stop_reason is None:
            self.room()
        return GenerationResult(self.tokens, self.stats, self.stop_reason or MAX_NEW_TOKENS)


def _admitted(proposal: Proposal, k: int, limit: int, free_tokens: int) -> Proposal:
    """The drafts a round verifies: at most ``k`` (gamma), or for a model-free proposal (q None, no
    forward) at most the drafter's ``free_tokens``, cut to the ``limit`` the round has room for."""
    free = proposal.q is None and proposal.calls == 0
    allowed = max(k, free_tokens) if free else k
    if proposal.k > allowed:
        raise ValueError(f"the drafter proposed {proposal.k} tokens when asked for at most {allowed}")
    return proposal if proposal.k <= limit else Proposal(proposal.tokens[:, :limit], None, 0)


def speculative_generate(
    target: PreTrainedModel,
    drafter: object,
    input_ids: object,
    *,
    max_new_tokens: int,
    gamma: int = SpecConfig.gamma,
    temperature: float = SamplingConfig.temperature,
    top_k: int = SamplingConfig.top_k,
    top_p: float = SamplingConfig.top_p,
    stop_token_ids: int | Sequence[int] | None = None,
    seed: int | None = None,
    stop_strings: str | Sequence[str] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    on_round: OnRound | None = None,
) -> GenerationResult:
    """Generate with ``target``, drafting with ``drafter`` (a causal LM, "ngram", or a Drafter).

    Returns the new tokens (equal to the target's own greedy decoding when ``temperature`` is 0,
    distributed as its sampling otherwise), stats, and why generation stopped.
    """
    spec = SpecConfig(gamma=gamma, max_new_tokens=max_new_tokens)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    run = _Run.start(target, input_ids, max_new_tokens, sampling, stop_token_ids, stop_strings, tokenizer, on_round)
    drafter = make_drafter(drafter, target, tokenizer)
    rule, stats, prompt = rule_for(run.sampler), run.stats, run.prompt
    draft_limit = getattr(drafter, "context_limit", None)
    free_tokens = getattr(drafter, "free_tokens", 0)  # longest model-free draft it may propose (prompt lookup)
    with torch.inference_mode():
        cache = KVCache(target)
        t0 = run.clock()
        if prompt.shape[1] > 1:
            cache.forward(prompt[:, :-1])
            stats.target_calls += 1
        t1 = run.clock()
        stats.drafter_calls += drafter.prefill(prompt) or 0
        stats.target_time_s, stats.drafter_time_s = t1 - t0, run.clock() - t1
        last = prompt[:, -1:]  # [1, 1] the newest committed token, not yet in the target's cache
        while (room := run.room()) > 0:
            committed = prompt.shape[1] + len(run.tokens)
            limit = room - 1  # drafts that fit with the token verification adds
            if draft_limit is not None:
                limit = max(0, min(limit, draft_limit - committed + 1))
            k = min(spec.gamma, limit)
            # propose
            t0 = run.clock()
            proposal = _admitted(drafter.propose(k, run.sampler), k, limit, free_tokens)
            # verify
            t1 = run.clock()
            logits = cache.forward(torch.cat([last, proposal.tokens], dim=1), proposal.k + 1)  # [1, k+1, V]
            check_finite(logits, "target")
            # accept
            verdict = rule(proposal.tokens, proposal.q, logits, run.sampler)
            n, next_token, *drafts = torch.cat([verdict.n_accepted, verdict.next_token, proposal.tokens[0]]).tolist()
            t2 = run.clock()
            # commit: roll the target back to committed - 1 tokens, the drafter likewise
            cache.crop_to(cache.length - proposal.k + n)
            drafter.commit(n, next_token)
            stats.target_calls += 1
            stats.drafter_calls += proposal.calls
            stats.target_time_s += t2 - t1
            stats.drafter_time_s += t1 - t0 + run.clock() - t2
            kinds = [ACCEPTED] * n + [TARGET if proposal.k == 0 else RECOVERED if n < proposal.k else BONUS]
            if run.commit([*drafts[:n], next_token], kinds, drafted=proposal.k, accepted=n):
                break
            last = verdict.next_token[:, None]  # [1, 1]
    return run.result()


def autoregressive_generate(
    target: PreTrainedModel,
    input_ids: object,
    *,
    max_new_tokens: int,
    temperature: float = SamplingConfig.temperature,
    top_k: int = SamplingConfig.top_k,
    top_p: float = SamplingConfig.top_p,
    stop_token_ids: int | Sequence[int] | None = None,
    seed: int | None = None,
    stop_strings: str | Sequence[str] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    on_round: OnRound | None = None,
) -> GenerationResult:
    """Plain decoding with the target alone: one forward per token, the baseline of every speedup."""
    SpecConfig(max_new_tokens=max_new_tokens)  # validates max_new_tokens
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    run = _Run.start(target, input_ids, max_new_tokens, sampling, stop_token_ids, stop_strings, tokenizer, on_round)
    stats = run.stats
    with torch.inference_mode():
        cache = KVCache(target)
        if run.room() <= 0:
            return run.result()
        t0 = run.clock()
        logits = cache.forward(run.prompt)[:, -1]  # [1, V]
        while True:
            check_finite(logits, "target")
            token = run.sampler.choose(logits)  # [1]
            stats.target_calls += 1
            stats.target_time_s += run.clock() - t0
            if run.commit([token.item()], [TARGET], drafted=0, accepted=0) or run.room() <= 0:
                break
            t0 = run.clock()
            logits = cache.forward(token[:, None])[:, -1]  # [1, V]
    return run.result()
