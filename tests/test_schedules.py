"""Schedules (issue 18): how far each row drafts; every schedule keeps greedy output exact.

- every schedule (constant, heuristic, confidence, ada with a stand-in head) keeps every row of a
  batch equal to the target's greedy decoding, with the drafter model and with lookup first;
- the heuristic's +2 / -1 rule and its bounds, per row;
- the confidence stop and transformers' ROC retuning (against a brute-force search of thresholds);
- SpecDec++'s stop rule: the running product, the first token always drafted, the bounds;
- the records say how long each draft was and why it ended;
- ada at threshold 1 is the constant gamma MAX (no stop rule, the head never asked);
- bad input: threshold outside (0, 1], bounds, ada without hidden states or head.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_greedy, build_tiny, hf_greedy, truncated_copy

import specdec
from specdec.acceptance import Verdict
from specdec.config import ScheduleConfig, SpecConfig
from specdec.drafters.base import DraftStep, Proposal
from specdec.events import DRAFT_PREFILL, PREFILL, RoundSummary
from specdec.report import auto_text
from specdec.schedules import (
    PLAIN_MARGIN,
    Ada,
    Confidence,
    Constant,
    Crossover,
    DraftPlan,
    Heuristic,
    _AdaStop,
    _speeds,
    batch_bucket,
    crossover_widths,
    make_schedule,
    roc_threshold,
)

PROMPTS = [[5, 17, 33, 5, 17], [3], [9, 8, 7, 6, 5, 4, 3, 2, 11, 12], [40, 41]]


@pytest.fixture(scope="module")
def pair():
    target = build_tiny("llama", seed=0)
    return target, truncated_copy(target, 1)


def fake_head(hidden: torch.Tensor) -> torch.Tensor:
    """A stand-in acceptance head: P(accept) from the hidden state's first feature (deterministic)."""
    return torch.sigmoid(3 * hidden[:, 0])


SCHEDULES = {
    "constant": lambda: "constant",
    "heuristic": lambda: "heuristic",
    "confidence": lambda: ScheduleConfig("confidence", stop_threshold=0.3, bound=(1, 6)),
    "ada": lambda: Ada(fake_head, 0.5, (1, 8)),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("lookup", [False, True])
def test_every_schedule_keeps_greedy_exact(pair, name, lookup):
    target, drafter = pair
    chosen = specdec.LookupDrafter(drafter) if lookup else drafter
    results = specdec.speculative_generate(target, chosen, PROMPTS, max_new_tokens=24, gamma=3, stop_token_ids=[],
                                           batch_size=3, schedule=SCHEDULES[name]())
    for prompt, result in zip(PROMPTS, results):
        assert_same_greedy(target, prompt, result.tokens, hf_greedy(target, prompt, 24, []))
        ended = {r.ended for r in result.stats.records}
        assert ended <= {"bound", "threshold", "lookup", "room", "none"}
        if name in ("confidence", "ada"):
            assert max(r.drafted for r in result.stats.records) <= (12 if lookup else 8)
    drafted = [r.drafted for res in results for r in res.stats.records]
    if name == "constant" and not lookup:
        assert set(drafted) <= {0, 1, 2, 3}


class Narrow(Constant):
    """gamma drafts per row, every draft (lookup copies included) capped to ``width`` by the plan."""

    def __init__(self, gamma: int, width: int) -> None:
        super().__init__(gamma)
        self.cap = width

    def plan(self, rows: int, device: torch.device | str) -> DraftPlan:
        return DraftPlan(super().plan(rows, device).limit, width=self.cap)


def test_a_plan_width_caps_every_draft_lookup_copies_included(pair):
    """``DraftPlan.width`` cuts every row's draft, the lookup copies that go past the limit too, and the output
    stays the target's greedy decoding; uncapped, the same lookup copies up to 12 tokens."""
    target, drafter = pair
    prompts = [[5, 17, 33, 5, 17, 33, 5, 17, 33, 5], *PROMPTS]
    drafted = {}
    for width in (None, 2):
        schedule = Constant(3) if width is None else Narrow(3, width)
        results = specdec.speculative_generate(target, specdec.LookupDrafter(drafter), prompts, max_new_tokens=24,
                                               stop_token_ids=[], batch_size=3, schedule=schedule)
        for prompt, result in zip(prompts, results):
            assert_same_greedy(target, prompt, result.tokens, hf_greedy(target, prompt, 24, []))
        drafted[width] = {r.drafted for res in results for r in res.stats.records}
    assert max(drafted[None]) > 3 and max(drafted[2]) == 2


def test_heuristic_moves_each_row_within_its_bounds():
    schedule = Heuristic(4, (2, 7))
    schedule.add(3)
    assert schedule.plan(3, "cpu").limit.tolist() == [4, 4, 4]
    proposal = Proposal(torch.zeros(3, 4, dtype=torch.long), torch.tensor([4, 4, 0]))
    for _ in range(3):  # row 0: all accepted (+2, capped at 7); row 1: a rejection (-1, floored at 2)
        schedule.update(proposal, Verdict(torch.tensor([4, 1, 0]), torch.zeros(3, dtype=torch.long)))
    assert schedule.plan(3, "cpu").limit.tolist() == [7, 2, 4]  # row 2 drafted nothing: unchanged
    schedule.select(torch.tensor([2, 0]))
    schedule.add(1)
    assert schedule.plan(3, "cpu").limit.tolist() == [4, 7, 4]


def brute_force_threshold(probs, matches, cost=3.0):
    """The threshold (from inf and the observed probabilities) minimising fpr + cost * fnr, first on ties."""
    best, best_cost = None, None
    positives = sum(matches)
    negatives = len(matches) - positives
    for t in [float("inf"), *sorted(set(probs), reverse=True)]:
        tp = sum(1 for p, m in zip(probs, matches) if p >= t and m)
        fp = sum(1 for p, m in zip(probs, matches) if p >= t and not m)
        c = fp / negatives + cost * (1 - tp / positives)
        if best_cost is None or c < best_cost - 1e-12:
            best, best_cost = t, c
    return best


@pytest.mark.parametrize("seed", range(6))
def test_roc_threshold_matches_a_brute_force_search(seed):
    gen = torch.Generator().manual_seed(seed)
    probs = (torch.rand(40, generator=gen) * 10).round().div(10).tolist()  # ties included
    matches = [int(torch.rand(1, generator=gen) < p) for p in probs]
    if 0 not in matches or 1 not in matches:
        matches[0], matches[1] = 0, 1
    assert roc_threshold(probs, matches) == brute_force_threshold(probs, matches)


def test_confidence_stops_below_the_threshold_and_learns_from_outcomes():
    schedule = Confidence(0.4, (2, 5))
    schedule.add(2)
    plan = schedule.plan(2, "cpu")
    assert plan.limit.tolist() == [5, 5]
    logits = torch.log(torch.tensor([[0.9, 0.1], [0.3, 0.7]]))  # row 0 drafts token 0 (0.9), row 1 token 1 (0.7)
    step = DraftStep(0, torch.tensor([0, 1]), logits, None, None, torch.tensor([True, True]))
    assert plan.stop(step).tolist() == [False, False]  # MIN is 2: no stop at the first position
    low = DraftStep(1, torch.tensor([1, 1]), logits, None, None, torch.tensor([True, True]))
    assert plan.stop(low).tolist() == [True, False]  # row 0's draft has probability 0.1 < 0.4
    proposal = Proposal(torch.zeros(2, 2, dtype=torch.long), torch.tensor([2, 2]))
    schedule.update(proposal, Verdict(torch.tensor([1, 2]), torch.zeros(2, dtype=torch.long)))
    assert schedule.history[0] == ([pytest.approx(0.9), pytest.approx(0.1)], [1, 0])
    assert schedule.history[1] == ([pytest.approx(0.7), pytest.approx(0.7)], [1, 1])


def test_ada_stop_rule_product_first_token_and_bounds():
    accept = [torch.tensor([0.2, 0.9]), torch.tensor([0.5, 0.5])]
    calls = iter(accept)
    stop = _AdaStop(lambda hidden: next(calls), threshold=0.3, low=1, rows=2, device="cpu")
    drafting = torch.tensor([True, True])
    step = lambda i: DraftStep(i, torch.zeros(2, dtype=torch.long), torch.zeros(2, 3), None,
                               torch.zeros(2, 4), drafting)
    assert stop(step(0)).tolist() == [False, False]  # a_1 := 1: the head is not even asked
    assert stop(step(1)).tolist() == [True, False]  # 1 - 0.2 = 0.8 > 0.3; 1 - 0.9 = 0.1
    assert stop(step(2)).tolist() == [True, True]  # row 1: 1 - 0.9 * 0.5 = 0.55 > 0.3
    lenient = _AdaStop(lambda hidden: torch.tensor([0.0, 0.0]), threshold=0.3, low=3, rows=2, device="cpu")
    assert [lenient(step(i)).tolist() for i in range(3)] == [[False, False], [False, False], [True, True]]


def test_ada_drafts_within_its_bounds_and_stops_on_the_head(pair):
    target, drafter = pair
    never = Ada(lambda hidden: torch.zeros(hidden.shape[0]), 0.5, (2, 9))  # predicts rejection: stop at MIN
    res = specdec.speculative_generate(target, drafter, PROMPTS[0], max_new_tokens=20, stop_token_ids=[],
                                       schedule=never)
    assert {r.drafted for r in res.stats.records[:-2]} == {2}
    assert {r.ended for r in res.stats.records[:-2]} == {"threshold"}
    always = Ada(lambda hidden: torch.ones(hidden.shape[0]), 0.5, (2, 9))  # predicts acceptance: draft MAX
    res = specdec.speculative_generate(target, drafter, PROMPTS[0], max_new_tokens=40, stop_token_ids=[],
                                       schedule=always)
    assert res.stats.records[0].drafted == 9 and res.stats.records[0].ended == "bound"


def test_ada_at_threshold_one_is_the_constant_gamma_max(pair):
    """1 - prod a_j never exceeds 1: ada at threshold 1 drafts MAX every round as the constant gamma MAX does,
    without asking the head (no stop rule, so no hidden states either)."""
    target, drafter = pair

    def head(hidden: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the head was asked at threshold 1")

    assert Ada(head, 1.0, (1, 3)).plan(2, "cpu").stop is None
    ada = specdec.speculative_generate(target, drafter, PROMPTS, max_new_tokens=20, stop_token_ids=[],
                                       schedule=Ada(head, 1.0, (1, 3)))
    constant = specdec.speculative_generate(target, drafter, PROMPTS, max_new_tokens=20, stop_token_ids=[], gamma=3)
    for a, c in zip(ada, constant):
        assert a.tokens == c.tokens
        assert [(r.drafted, r.accepted) for r in a.stats.records] == [(r.drafted, r.accepted) for r in c.stats.records]
    assert {a.stats.records[0].drafted for a in ada} == {3}


class FakeClock:
    """A clock the test moves by hand: the seconds a round, a leave or a prefill costs are injected."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drive(auto: Crossover, clock: FakeClock, rows: int, n: int, draft: tuple[float, int], plain: tuple[float, int],
          leave_s: tuple[float, float] = (0.0, 0.0)) -> list[bool]:
    """``n`` rounds of ``rows`` rows as the decoder runs them: plan, the round's cost in seconds, its committed
    tokens (``draft`` / ``plain``: (seconds, tokens) of a round), then the rows leaving (``leave_s``: seconds after
    a drafting / plain round). The modes the rounds ran in."""
    modes = []
    for _ in range(n):
        drafting = bool(auto.plan(rows, "cpu").limit.any())
        modes.append(drafting)
        seconds, tokens = draft if drafting else plain
        clock.now += seconds
        auto.round_ended(RoundSummary(rows, 4 * rows if drafting else 0, tokens, seconds))
        clock.now += leave_s[0] if drafting else leave_s[1]
    return modes


def test_crossover_measures_both_modes_then_keeps_one():
    clock = FakeClock()
    auto = Crossover(Constant(4), widths=(None, 0), trial_rounds=2, clock=clock, block=1, drop=0.0)
    modes = drive(auto, clock, 3, 5, draft=(0.01, 9), plain=(0.01, 3))
    assert modes == [True, False, True, False, True] and auto.choice == {4: True}
    assert auto.plan(4, "cpu").limit.tolist() == [4] * 4  # the bucket of 3 and 4 rows: decided
    assert auto.plan(5, "cpu").limit.tolist() == [4] * 5  # a new bucket (8): measuring again, drafting first


@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16])
def test_crossover_keeps_the_mode_with_more_committed_tokens_per_second(rows):
    """Per batch size: drafting's rounds commit more tokens but cost more; the mode kept is drafting where its
    tokens per second are at least ``PLAIN_MARGIN`` times plain's, else plain, whichever way the costs fall, and the
    speeds it reports are those."""
    assert PLAIN_MARGIN == pytest.approx(1.10)
    # drafting at 2x, 0.5x, 0.976x, 1.026x (plain kept: inside the margin), 1.081x (inside), 1.111x (drafting)
    for draft_s, plain_s in ((0.02, 0.01), (0.08, 0.01), (0.041, 0.01), (0.039, 0.01), (0.037, 0.01), (0.036, 0.01)):
        clock = FakeClock()
        auto = Crossover(Constant(4), widths=(None, 0), trial_rounds=3, clock=clock)
        drive(auto, clock, rows, 7, draft=(draft_s, 4 * rows), plain=(plain_s, rows))
        draft_speed, plain_speed = 4 * rows / draft_s, rows / plain_s
        assert auto.choice == {batch_bucket(rows): draft_speed >= PLAIN_MARGIN * plain_speed}
        assert auto.choice[batch_bucket(rows)] == (draft_s <= 0.036)
        [choice] = auto.choices()
        assert choice.draft_tokens_per_s == pytest.approx(draft_speed)
        assert choice.plain_tokens_per_s == pytest.approx(plain_speed)


def test_crossover_decides_each_batch_size_on_its_own():
    """Drafting pays at 1 row and loses at 16 (verification of 16 rows' drafts dearer than it saves)."""
    clock = FakeClock()
    auto = Crossover(Constant(4), widths=(None, 0), trial_rounds=4, clock=clock)
    drive(auto, clock, 1, 8, draft=(0.02, 3), plain=(0.01, 1))  # 150 against 100 tokens/s
    drive(auto, clock, 16, 9, draft=(0.25, 48), plain=(0.06, 16))  # 192 against 267 tokens/s
    assert auto.choice == {1: True, 16: False}
    assert drive(auto, clock, 1, 3, draft=(0.02, 3), plain=(0.01, 1)) == [True] * 3
    assert drive(auto, clock, 12, 3, draft=(0.25, 48), plain=(0.06, 16)) == [False] * 3


def test_crossover_forgets_what_it_measured():
    """``forget`` (a server switched to its compiled graphs): every batch size is measured afresh, and what the
    new rounds measure decides, not the old rounds' figures."""
    clock = FakeClock()
    auto = Crossover(Constant(4), widths=(None, 0), trial_rounds=2, clock=clock, block=1, drop=0.0)
    drive(auto, clock, 1, 5, draft=(0.02, 3), plain=(0.01, 1))  # drafting 150 against plain 100 tokens/s
    assert auto.choice == {1: True} and auto.choices()
    auto.forget()
    assert auto.choice == {} and auto.choices() == []
    modes = drive(auto, clock, 1, 5, draft=(0.05, 3), plain=(0.01, 1))  # now drafting 60 against 100
    assert modes[:4] == [True, False, True, False] and auto.choice == {1: False}


def test_crossover_widths():
    """Uncapped first, then powers of two below the schedule's most (and the most itself where lookup copies go
    past it), then plain decoding; make_schedule gives auto the drafter's."""
    assert crossover_widths(4, free=12) == (None, 4, 2, 1, 0)
    assert crossover_widths(4) == (None, 2, 1, 0)
    assert crossover_widths(5) == (None, 4, 2, 1, 0)
    assert crossover_widths(1, free=12) == (None, 1, 0)
    assert crossover_widths(1) == (None, 0)
    with pytest.raises(ValueError, match="include 0"):
        Crossover(Constant(4), widths=(None, 2))


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_crossover_keeps_the_draft_width_with_more_committed_tokens_per_second(rows):
    """A round of ``rows`` rows verifies [rows, width + 1] tokens: its cost grows with both once the forward is
    past streaming the weights, while the tokens it commits per row saturate with the width. The width kept is
    the one with the most committed tokens per second, each round capped to it (lookup copies included)."""
    committed = {None: 4.0, 4: 3.25, 2: 2.5, 1: 1.75, 0: 1.0}  # tokens a row commits per round at each width
    longest = {None: 12, 4: 4, 2: 2, 1: 1, 0: 0}  # the longest draft verified (a lookup copy of 12 uncapped)

    def seconds(width):  # weight streaming (0.01 s) or compute (1 ms a token), whichever is more
        return max(0.01, 0.001 * rows * (longest[width] + 1))

    clock = FakeClock()
    auto = Crossover(Constant(4), trial_rounds=2, clock=clock)
    assert auto.widths == (None, 2, 1, 0)
    auto.widths = widths = (None, 4, 2, 1, 0)
    for _ in range(2 * len(widths) + 1):
        plan = auto.plan(rows, "cpu")
        width = auto._open[1] if auto._open else auto.width[batch_bucket(rows)]
        assert plan.width == width and plan.limit.tolist() == [4 if width is None else min(4, width)] * rows
        clock.now += seconds(width)
        auto.round_ended(RoundSummary(rows, 0, round(rows * committed[width]), seconds(width)))
    speed = {w: round(rows * committed[w]) / seconds(w) for w in widths}
    best = max(widths, key=lambda w: speed[w])
    assert auto.width == {batch_bucket(rows): best} and auto.choice == {batch_bucket(rows): best != 0}
    assert best == {1: None, 4: 2, 16: 0}[rows]  # with these costs: all of it alone, drafts of 2 at 4 rows, none at 16
    [choice] = auto.choices()
    assert choice.plain_tokens_per_s == pytest.approx(speed[0])
    drafting = best if best != 0 else max((w for w in widths if w != 0), key=lambda w: speed[w])
    assert (choice.width, choice.draft_tokens_per_s) == (drafting, pytest.approx(speed[drafting]))


def test_crossover_measures_each_width_in_blocks_of_rounds():
    """A width runs ``block`` rounds in a row while measuring (the holes its rounds leave in the cache are then
    paid mostly by its own rounds), the widths taking turns, the widest first, until each has its rounds."""
    clock = FakeClock()
    auto = Crossover(Constant(4), widths=(None, 2, 0), trial_rounds=4, clock=clock, block=2, drop=0.0)
    widths = []
    for _ in range(12):
        plan = auto.plan(4, "cpu")
        widths.append(plan.width)
        clock.now += 0.01
        auto.round_ended(RoundSummary(4, 0, 4 if plan.width == 0 else 8, 0.01))
    assert widths == [None, None, 2, 2, 0, 0, None, None, 2, 2, 0, 0]
    auto.plan(4, "cpu")
    assert auto.width == {4: None}  # a tie between the widths that draft goes to the first measured


def test_crossover_counts_the_rows_leaving_after_a_round():
    """A round's measure runs to the next round's plan: drafting's rounds are as fast in their phases, but the
    compactions after them (rows finishing in different rounds) make it lose."""
    clock = FakeClock()
    auto = Crossover(Constant(4), widths=(None, 0), trial_rounds=3, clock=clock)
    drive(auto, clock, 8, 7, draft=(0.02, 16), plain=(0.01, 8), leave_s=(0.02, 0.0))  # 400 against 800 tokens/s
    assert auto.choice == {8: False}
    assert auto.choices()[0].draft_tokens_per_s == pytest.approx(400)


def test_crossover_leaves_out_prefill_and_idle_waits():
    """Rows joining (their prefill phases) and the wait after the batch emptied are not a round's cost."""
    clock = FakeClock()
    auto = Crossover(Constant(4), widths=(None, 0), trial_rounds=2, clock=clock)
    for _ in range(5):
        drafting = bool(auto.plan(2, "cpu").limit.any())
        clock.now += 0.01
        auto.round_ended(RoundSummary(2, 8 if drafting else 0, 6 if drafting else 2, 0.01))
        if drafting:  # every drafting round is followed by a slow join of a new row, then an idle wait
            auto.select(torch.tensor([0, 1]))
            for phase in (PREFILL, DRAFT_PREFILL):
                auto.phase_started(phase)
                clock.now += 5.0
                auto.phase_ended(phase)
            auto.select(torch.zeros(0, dtype=torch.long))
            clock.now += 100.0
            auto.add(2)
    assert auto.choice == {2: True}
    assert auto.choices()[0].draft_tokens_per_s == pytest.approx(600)


def test_crossover_drops_a_round_that_raised():
    clock = FakeClock()
    auto = Crossover(Constant(4), widths=(None, 0), trial_rounds=1, clock=clock)
    auto.plan(1, "cpu")
    clock.now += 50.0  # the round raised: no round_ended; the engine starts over with a fresh batch
    drive(auto, clock, 1, 2, draft=(0.02, 2), plain=(0.01, 1))
    assert auto.choices()[0].draft_tokens_per_s == pytest.approx(100)


def test_crossover_measures_again_and_follows_a_change():
    clock = FakeClock()
    auto = Crossover(Constant(4), widths=(None, 0), trial_rounds=2, recheck_rounds=5, clock=clock, block=1, drop=0.0)

    def rounds(n: int, drafting_wins: bool) -> list[bool]:
        return drive(auto, clock, 1, n, draft=(0.01, 4 if drafting_wins else 1), plain=(0.01, 2))

    assert rounds(5, drafting_wins=True) == [True, False, True, False, True] and auto.choice == {1: True}
    assert rounds(3, drafting_wins=False) == [True] * 3  # kept while its recheck is not due
    assert rounds(6, drafting_wins=False) == [True, True, False, True, False, False]  # due: measured again
    assert auto.choice == {1: False}


def _race(auto: Crossover, clock: FakeClock, rows: int, n: int, speed: dict) -> list[int | None]:
    """``n`` rounds of ``rows`` rows, each width's round committing ``speed[width]`` tokens in 0.01 s: the widths
    run."""
    widths = []
    for _ in range(n):
        width = auto.plan(rows, "cpu").width
        widths.append(width)
        clock.now += 0.01
        auto.round_ended(RoundSummary(rows, 0, speed[width], 0.01))
    return widths


def test_crossover_stops_measuring_a_width_that_lost_by_far():
    """Once every width has a block of rounds, a drafting width below ``drop`` of the fastest's speed runs no more
    trial rounds (uncapped drafts at 4 rows cost most while measured); the others go on to their
    ``trial_rounds``, and the figures of the one dropped stay in the choices."""
    clock = FakeClock()
    auto = Crossover(Constant(4), widths=(None, 2, 1, 0), trial_rounds=6, clock=clock, block=2, drop=0.75)
    speed = {None: 5, 2: 15, 1: 14, 0: 16}  # tokens a round of 10 ms: uncapped a third of plain's speed
    widths = _race(auto, clock, 4, 21, speed)  # the 21st round: decided at its plan
    assert widths[:8] == [None, None, 2, 2, 1, 1, 0, 0]  # a block each, the widest first
    assert None not in widths[8:] and auto.width == {4: 0}  # then uncapped no more; plain is kept
    assert [widths[8:20].count(w) for w in (2, 1, 0)] == [4, 4, 4] and widths[20] == 0
    [choice] = auto.choices()
    assert choice.speculate == "off" and (choice.plain_tokens_per_s, choice.draft_tokens_per_s) == pytest.approx((1600,
                                                                                                                  1500))
    assert _speeds(auto._trials[4])[None] == pytest.approx(500)  # its block's figure kept
    with pytest.raises(ValueError, match="include 0"):
        Crossover(Constant(4), widths=(None, 2), drop=0.5)


def test_crossover_measures_plain_decoding_to_the_end_of_its_trial():
    """Plain decoding, the margin's reference, is never dropped: a first block measured slow (a noisy moment) against
    a drafting width's lucky block is outweighed by its later blocks, and plain is kept where it is faster."""
    clock = FakeClock()
    auto = Crossover(Constant(4), widths=(4, 0), trial_rounds=6, clock=clock, block=2, drop=0.75)
    first = _race(auto, clock, 4, 4, {4: 20, 0: 10})  # a block each: plain at half the drafting width's speed
    assert first == [4, 4, 0, 0] and auto._racing[4] == [4, 0]  # below drop, still racing
    rest = _race(auto, clock, 4, 9, {4: 8, 0: 16})  # then plain twice as fast
    assert rest == [4, 4, 0, 0, 4, 4, 0, 0, 0] and auto.width == {4: 0}
    speed = _speeds(auto._trials[4])
    assert speed[0] == pytest.approx((2 * 10 + 4 * 16) / 0.06) and speed[4] == pytest.approx((2 * 20 + 4 * 8) / 0.06)


def test_a_batch_larger_than_one_measured_plain_starts_plain():
    """Drafting pays less the more rows share a verification: once a smaller batch size settled plain decoding, a
    larger one decodes plain from its first round without a trial, says whose choice it follows, and measures itself
    at its recheck (plain against the narrowest draft); a smaller batch size is measured as usual; while the smaller
    one is being rechecked, its plain choice still counts (a burst of rows arriving meanwhile starts plain)."""
    clock = FakeClock()
    auto = Crossover(Constant(4), widths=(2, 1, 0), trial_rounds=2, recheck_rounds=4, clock=clock, block=1, drop=0.0)
    assert _race(auto, clock, 4, 7, {2: 5, 1: 6, 0: 8}) == [2, 1, 0, 2, 1, 0, 0] and auto.width == {4: 0}
    assert _race(auto, clock, 16, 3, {2: 20, 1: 20, 0: 10}) == [0, 0, 0]  # follows 3-4 rows: no trial
    assert auto.settled_plain(16) and 16 not in auto._trials
    choices = {c.rows: c for c in auto.choices()}
    assert choices[(9, 16)].speculate == "off" and choices[(9, 16)].like == (3, 4) and choices[(3, 4)].like is None
    assert auto_text([choices[(9, 16)]]) == "speculate auto: 9-16 rows: off (as at 3-4 rows)"
    assert _race(auto, clock, 16, 6, {2: 20, 1: 20, 0: 10}) == [0, 1, 0, 1, 0, 1]  # its recheck: 1 against plain
    assert auto.width[16] == 1 and auto.choices()[-1].like is None
    assert _race(auto, clock, 2, 4, {2: 9, 1: 6, 0: 4}) == [2, 1, 0, 2]  # smaller than 3-4 rows: its own trial
    assert _race(auto, clock, 4, 4, {2: 5, 1: 6, 0: 8}) == [0, 0, 0, 1]  # 3-4 rows: its recheck begins
    assert 4 not in auto.width and _race(auto, clock, 8, 1, {0: 8}) == [0]  # 5-8 rows meanwhile: plain, as at 3-4
    assert {c.rows: c.like for c in auto.choices()}[(5, 8)] == (3, 4)


def test_crossover_rechecks_the_kept_width_against_its_neighbours():
    """A recheck measures the width kept and the widths next to it (one wider, one narrower), not all of them again;
    a neighbour that has become faster is kept, and the next recheck is around it."""
    clock = FakeClock()
    auto = Crossover(Constant(4), widths=(None, 4, 2, 1, 0), trial_rounds=2, recheck_rounds=3, clock=clock, block=1,
                     drop=0.0)
    speed = {None: 10, 4: 12, 2: 16, 1: 14, 0: 11}
    assert _race(auto, clock, 4, 11, speed) == [None, 4, 2, 1, 0] * 2 + [2] and auto.width == {4: 2}
    assert _race(auto, clock, 4, 2, speed) == [2, 2]  # kept until the recheck is due (3 rounds)
    speed[1] = 20  # narrower drafts now pay more (a busier machine, say)
    assert _race(auto, clock, 4, 6 + 1, speed) == [4, 2, 1] * 2 + [1] and auto.width == {4: 1}
    assert _race(auto, clock, 4, 2, speed) == [1, 1]
    assert _race(auto, clock, 4, 6 + 1, speed) == [2, 1, 0] * 2 + [1]  # the next recheck: around 1
    assert auto.width == {4: 1}
    assert {w: r[0] for w, r in auto._trials[4].items()} == {None: 2, 4: 2, 2: 2, 1: 2, 0: 2}


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"stop_threshold": 0.0}, r"stop_threshold must be in \(0, 1\]"),
    ({"stop_threshold": 1.5}, r"stop_threshold must be in \(0, 1\]"),
    ({"bound": (0, 4)}, "bound must be MIN MAX with 1 <= MIN <= MAX"),
    ({"bound": (5, 4)}, "bound must be MIN MAX with 1 <= MIN <= MAX"),
    ({"schedule": "eager"}, "schedule must be one of constant, heuristic, confidence, ada"),
])
def test_bad_schedule_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScheduleConfig(**kwargs)


def test_ada_needs_hidden_states_and_a_head(pair, tmp_path):
    target, drafter = pair
    with pytest.raises(ValueError, match="reads the drafter's hidden states, and this drafter \\(NgramDrafter\\)"):
        specdec.speculative_generate(target, "ngram", [1, 2], max_new_tokens=3, schedule="ada")
    with pytest.raises(ValueError, match="needs an acceptance head: pass --head PATH"):
        specdec.speculative_generate(target, drafter, [1, 2], max_new_tokens=3, schedule="ada")
    with pytest.raises(ValueError, match="needs the drafter"):
        make_schedule(SpecConfig(), ScheduleConfig("ada"))


def test_crossover_reports_the_drafting_speed_it_compared_with_plain():
    """After a recheck the widths outside it keep their old trial's figures; the choice reported is the comparison
    the recheck made (issue 67: /stats showed ``auto`` keeping plain at 105 tokens/s beside a drafting 388 that an
    earlier trial, of other contexts, had measured)."""
    clock = FakeClock()
    auto = Crossover(Constant(4), widths=(None, 2, 0), trial_rounds=2, recheck_rounds=3, clock=clock, block=1,
                     drop=0.0)
    drive(auto, clock, 1, 6, draft=(0.01, 4), plain=(0.0027, 1))  # drafting 400 tokens/s, plain 370: inside the margin
    drive(auto, clock, 1, 8, draft=(0.01, 1), plain=(0.0095, 1))  # then kept plain 3 rounds, rechecked: 100 against 105
    assert auto.choice == {1: False} and auto._racing[1] == [2, 0]
    [choice] = auto.choices()
    assert choice.speculate == "off" and choice.width == 2
    assert choice.draft_tokens_per_s == pytest.approx(100) and choice.plain_tokens_per_s == pytest.approx(1 / 0.0095)
