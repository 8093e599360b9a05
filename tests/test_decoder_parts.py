"""The decoder's parts beside its round (issue 70): ``Row.room`` is a query and ``Row.stop_if_full`` the step that
marks a row done; the run's figures come from the ``Tally`` listener, and any listener hears the same events.

The figures are checked against what the rows committed, independently of the tally: per row, one ``row_round``
event per round and its ``emitted`` counts summing to the row's tokens; per run, the sums over the rows."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny, truncated_copy
from test_core_batch import ragged_prompts

import specdec
from specdec.config import SamplingConfig, SpecConfig
from specdec.decode import Decoder, Request, Row
from specdec.events import Listener, Prefilled, RowRound
from specdec.schedules import make_schedule
from specdec.stats import CONTEXT_LIMIT, MAX_NEW_TOKENS

pytestmark = pytest.mark.usefixtures("one_thread")


def _row(prompt: int, budget: int, tokens: int) -> Row:
    row = Row(Request(list(range(prompt)), budget, SamplingConfig(temperature=0.0)), torch.Generator())
    row.tokens = [1] * tokens
    return row


def test_room_is_a_query_and_stop_if_full_marks_the_row():
    row = _row(prompt=4, budget=3, tokens=3)
    assert row.room(None) == 0 and row.room(100) == 0
    assert row.stop_reason is None  # asking marks nothing
    assert row.stop_if_full(100) and row.stop_reason == MAX_NEW_TOKENS
    row = _row(prompt=4, budget=10, tokens=2)
    assert row.room(None) == 8 and row.room(9) == 3 and row.room(6) == 0 and row.stop_reason is None
    assert not row.stop_if_full(9) and row.stop_reason is None
    assert row.stop_if_full(6) and row.stop_reason == CONTEXT_LIMIT
    row = _row(prompt=4, budget=2, tokens=2)  # both spent: the budget is named first
    assert row.stop_if_full(6) and row.stop_reason == MAX_NEW_TOKENS
    row = _row(prompt=4, budget=2, tokens=0)
    row.stop_reason = "cancelled"
    assert row.stop_if_full(4) and row.stop_reason == "cancelled"  # a reason already given is kept


class Heard(Listener):
    def __init__(self) -> None:
        self.parts: list[RowRound] = []
        self.prefilled_rows = 0
        self.count = 0  # rows submitted

    def submitted(self, stats) -> None:
        self.count += 1

    def prefilled(self, prefilled: Prefilled) -> None:
        self.prefilled_rows += len(prefilled.rows)

    def row_round(self, part: RowRound) -> None:
        self.parts.append(part)


def test_the_figures_are_the_sums_of_the_events():
    target = build_tiny("llama", seed=0)
    handle = specdec.target.make_target(target)
    drafter = specdec.drafters.model_drafter(truncated_copy(target, 1))
    heard = Heard()
    decoder = Decoder(handle, drafter, make_schedule(SpecConfig(gamma=3)), batch_size=3, listeners=[heard])
    budgets = [20, 6, 14, 9, 30, 0, 11]
    rows = [decoder.submit(Request(p, n, SamplingConfig(temperature=0.0), index=i))
            for i, (p, n) in enumerate(zip(ragged_prompts(3), budgets))]
    with torch.inference_mode():
        decoder.run()
    batch = decoder.batch_stats()
    assert heard.count == batch.rows == len(rows)
    assert heard.prefilled_rows == len(rows) - 1  # the row with no budget never joined
    for row in rows:
        mine = [p for p in heard.parts if p.stats is row.stats]
        assert len(mine) == row.stats.rounds and sum(p.emitted for p in mine) == len(row.tokens)
        assert sum(p.drafted for p in mine) == row.stats.drafted and sum(p.accepted for p in mine) == row.stats.accepted
        assert row.stats.target_calls > row.stats.rounds or not row.request.max_new_tokens  # its prefill, and a
                                                                                            # verify a round
    assert batch.new_tokens == sum(len(r.tokens) for r in rows) == sum(p.emitted for p in heard.parts)
    assert batch.drafted == sum(r.stats.drafted for r in rows) and batch.accepted == sum(r.stats.accepted for r in rows)
    assert batch.row_rounds == len(heard.parts) and batch.max_rows == 3
    assert batch.drafted > batch.accepted > 0
