"""Rows prefilled beside a decoding batch (``Decoder.prefill_beside``, the server's default where a core is spare).

- Every row stays the target's own greedy decoding (``generate`` on the row alone) when the rows joining a running
  batch are prefilled on another thread, with rows finishing, joining and leaving on the way (a model drafter, prompt
  lookup, plain decoding; a compiled target's static cache).
- The batch goes on decoding while a joining row is prefilled: rounds run with the rows already there, and the row
  joins at the round boundary after its prefill ends (a prefill held back by a gate until the batch has run rounds).
- A prefill that fails beside the batch raises on the decoding thread, at the step that would have admitted it.
- The choice: ``SPECDEC_PREFILL_BESIDE`` on / off / auto (a CPU target with cores for a second forward), a bad value
  refused by name.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import build_tiny, hf_greedy, truncated_copy
from test_core_batch import near_ties, ragged_prompts

import specdec
from specdec.config import SamplingConfig, SpecConfig
from specdec.decode import Decoder, Request
from specdec.schedules import make_schedule
from specdec.serve.engine import BESIDE_ENV, prefill_beside
from specdec.threads import room_beside


def _decode(target_model, drafter, prompts, budgets, batch_size=3, beside=True, target=None):
    target = target or specdec.target.make_target(target_model)
    decoder = Decoder(target, drafter, make_schedule(SpecConfig(gamma=3)), batch_size=batch_size,
                      prefill_beside=beside)
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        decoder.submit(Request(p, n, SamplingConfig(temperature=0.0), index=i))
    finished = []
    with torch.inference_mode():
        while decoder.busy:
            finished += decoder.step()
    return {row.request.index: row.tokens for row in finished}, decoder


@pytest.mark.parametrize("kind", ["model", "ngram", "plain"])
def test_rows_prefilled_beside_the_batch_decode_as_alone(kind):
    target = build_tiny("llama", seed=0)
    drafter = {"model": lambda: specdec.drafters.model_drafter(truncated_copy(target, 1)),
               "ngram": lambda: specdec.drafters.make_drafter("ngram", target),
               "plain": lambda: specdec.drafters.NoDrafter()}[kind]()
    prompts = ragged_prompts(11)
    budgets = [20, 6, 14, 9, 30, 4, 25]  # rows finish at different rounds: the others join a running batch
    beside = []
    target_handle = specdec.target.make_target(target)
    split = target_handle.prefill_beside
    target_handle.prefill_beside = lambda batch: beside.append(batch.size) or split(batch)
    out, decoder = _decode(target, drafter, prompts, budgets, target=target_handle)
    assert beside and decoder.tally.beside_s > 0  # rows did join beside the batch
    assert sum(beside) == len(prompts) - 3  # all but the first batch's rows, which joined an empty one
    for i, (prompt, n) in enumerate(zip(prompts, budgets)):
        near_ties(target, prompt, out[i], hf_greedy(target, prompt, n, []))
    assert decoder.batch_stats().prefill_time_s >= decoder.tally.beside_s


def test_the_batch_decodes_while_a_row_is_prefilled_beside_it():
    target = build_tiny("llama", seed=1)
    prompts = ragged_prompts(3)[:3]
    budgets = [30, 2, 8]  # row 1 finishes after a round or two; row 2 joins while row 0 decodes
    handle = specdec.target.make_target(target)
    gate, split = threading.Event(), handle.prefill_beside

    def held(batch):
        run = split(batch)

        def later():
            assert gate.wait(30), "the gate was never opened"
            return run()
        return later
    handle.prefill_beside = held
    decoder = Decoder(handle, specdec.drafters.NoDrafter(), make_schedule(SpecConfig(gamma=3)), batch_size=2,
                      prefill_beside=True)
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        decoder.submit(Request(p, n, SamplingConfig(temperature=0.0), index=i))
    finished = []
    with torch.inference_mode():
        while not decoder.prefilling:  # until row 1 leaves and row 2's prefill starts beside row 0
            finished += decoder.step()
        rounds, tokens = decoder.stats.rounds, len(decoder.rows[0].tokens)
        for _ in range(5):  # its prefill held: row 0 decodes on, alone
            finished += decoder.step()
        assert decoder.stats.rounds == rounds + 5 and len(decoder.rows) == 1
        assert len(decoder.rows[0].tokens) == tokens + 5 and decoder.prefilling == 1 and not decoder.waiting
        gate.set()
        while decoder.busy:
            finished += decoder.step()
    out = {row.request.index: row.tokens for row in finished}
    assert decoder.stats.max_rows == 2
    for i, (prompt, n) in enumerate(zip(prompts, budgets)):
        near_ties(target, prompt, out[i], hf_greedy(target, prompt, n, []))


def test_a_prefill_that_fails_beside_the_batch_raises_on_the_decoding_thread():
    target = build_tiny("llama", seed=2)
    handle = specdec.target.make_target(target)

    def broken(batch):
        def run():
            raise RuntimeError("the prefill broke")
        return run
    handle.prefill_beside = broken
    decoder = Decoder(handle, specdec.drafters.NoDrafter(), make_schedule(SpecConfig(gamma=3)), batch_size=2,
                      prefill_beside=True)
    for i, (p, n) in enumerate(zip(ragged_prompts(4)[:3], [10, 2, 3])):  # row 2 joins when row 1 has left
        decoder.submit(Request(p, n, SamplingConfig(temperature=0.0), index=i))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="the prefill broke"):
        while decoder.busy:
            decoder.step()
    assert decoder.stats.rounds >= 2 and decoder.stats.max_rows == 2


def test_prefill_beside_is_chosen_by_the_environment_else_by_spare_cores(monkeypatch):
    handle = specdec.target.make_target(build_tiny("llama", seed=0))
    monkeypatch.setenv(BESIDE_ENV, "on")
    assert prefill_beside(handle) is True
    monkeypatch.setenv(BESIDE_ENV, "off")
    assert prefill_beside(handle) is False
    monkeypatch.setenv(BESIDE_ENV, "sometimes")
    with pytest.raises(ValueError, match="SPECDEC_PREFILL_BESIDE='sometimes': use one of auto, on, off"):
        prefill_beside(handle)
    monkeypatch.setenv(BESIDE_ENV, "auto")
    assert prefill_beside(handle) is room_beside()
    assert room_beside(1, usable=2) and room_beside(2, usable=4)
    assert not room_beside(1, usable=1) and not room_beside(2, usable=3)


def test_rows_prefilled_beside_join_a_static_cache_as_they_would_in_turn():
    """A compiled target's static cache (its step run eagerly here: ``inductor`` off, nothing traced) takes the rows
    prefilled beside the batch group by group, as ``prefill_into`` gives them: every row as ``generate`` decodes it."""
    from specdec.compiled import CompiledModel, Shape, StaticRaggedCache, set_compiled

    target = build_tiny("llama", seed=10, layers=2)
    compiled = CompiledModel(target, 128)
    compiled.inductor = False
    set_compiled(target, compiled)
    for rows in (1, 4):
        for tokens in (1, 4):
            compiled.warm(Shape(rows, tokens))
    compiled.rows, compiled.tokens = (1, 4), (1, 4)
    handle = specdec.target.make_target(target)
    assert isinstance(handle.cache, StaticRaggedCache)
    split, beside = handle.prefill_beside, []
    handle.prefill_beside = lambda batch: beside.append(batch.size) or split(batch)
    prompts = ragged_prompts(5)
    budgets = [12, 3, 9, 5, 14, 2, 7]
    out, _ = _decode(target, specdec.drafters.make_drafter("ngram", target), prompts, budgets, target=handle)
    assert sum(beside) == len(prompts) - 3
    for i, (prompt, n) in enumerate(zip(prompts, budgets)):
        near_ties(target, prompt, out[i], hf_greedy(target, prompt, n, []))
