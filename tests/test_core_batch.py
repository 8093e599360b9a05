"""Batches (issue 16): several prompts at once, each row exact, ragged acceptance, rows joining and leaving.

- Greedy: every row of a batch equals the target's own greedy decoding of that prompt alone
  (``generate`` on the row by itself), on several architectures (a GPT-2 target with a Llama
  drafter among them), prompt lengths 1 to 60 in one batch, stop tokens hit by some rows, gamma 1,
  3 and 5, batches smaller than the number of prompts (rows join as others finish). A divergence
  passes only at a near tie of the target's top-2 logits, and near ties are counted.
- Sampling: each row of a batched call is distributed exactly as sampling from the target
  (chi-square on an 8-token vocabulary, against enumeration), and a seeded row's output does not
  depend on the rows beside it.
- The API: one prompt returns one result, a list returns a list in order; batch figures.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
from conftest import TIE_TOL, assert_same_greedy, build_tiny, build_toy, char_tokenizer, hf_greedy, top2_gap
from hypothesis import given, settings
from hypothesis import strategies as st
from test_core_sampling import SETTINGS, chi2_pvalue, exact_sequence_probs

import specdec

LENGTHS = (1, 7, 23, 60, 2, 41, 12)  # prompt lengths of one batch


def ragged_prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=gen).tolist() for n in LENGTHS]


PAIRS = {
    "llama": lambda: (build_tiny("llama", seed=0), None),
    "qwen2": lambda: (build_tiny("qwen2", seed=0), None),
    "gpt2+llama": lambda: (build_tiny("gpt2", seed=0), build_tiny("llama", seed=5, layers=1, hidden=16)),
}


def near_ties(target, prompt: list[int], ours: list[int], reference: list[int]) -> int:
    """1 if ours departs from the reference at a near tie (allowed), 0 if equal; fails otherwise."""
    assert_same_greedy(target, prompt, ours, reference)
    first = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), None)
    return 0 if first is None else int(top2_gap(target, prompt + reference[:first]) < TIE_TOL)


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_batched_greedy_equals_each_prompt_alone(pair, gamma):
    target, drafter = PAIRS[pair]()
    if drafter is None:  # a drafter that agrees often: the target's first layer
        from conftest import truncated_copy

        drafter = truncated_copy(target, 1)
    prompts = ragged_prompts(gamma)
    references = [hf_greedy(target, p, 20, []) for p in prompts]
    stop = references[1][5]  # a token some rows emit: they stop there, the others go on
    expected = [hf_greedy(target, p, 20, [stop]) for p in prompts]
    assert any(len(e) < 20 for e in expected) and any(len(e) == 20 for e in expected)
    ties = 0
    for drafter_kind in (drafter, "ngram", specdec.LookupDrafter(drafter)):
        results = specdec.speculative_generate(target, drafter_kind, prompts, max_new_tokens=20, gamma=gamma,
                                               stop_token_ids=[stop], batch_size=4)
        assert isinstance(results, list) and len(results) == len(prompts)
        for prompt, result, reference in zip(prompts, results, expected):
            ties += near_ties(target, prompt, result.tokens, reference)
            if result.tokens == reference:
                assert result.stop_reason == ("stop_token" if reference[-1] == stop else "max_new_tokens")
        assert results[0].batch.rows == len(prompts) and results[0].batch.max_rows == 4
    plain = specdec.autoregressive_generate(target, prompts, max_new_tokens=20, stop_token_ids=[stop], batch_size=3)
    for prompt, result, reference in zip(prompts, plain, expected):
        ties += near_ties(target, prompt, result.tokens, reference)
    assert ties <= 2, f"{ties} near ties: too many to be chance at TIE_TOL={TIE_TOL}"


def test_one_prompt_returns_one_result_and_a_list_a_list(llama_target, llama_drafter):
    one = specdec.speculative_generate(llama_target, llama_drafter, [3, 4, 5], max_new_tokens=5, stop_token_ids=[])
    assert isinstance(one, specdec.GenerationResult)
    listed = specdec.speculative_generate(llama_target, llama_drafter, [[3, 4, 5]], max_new_tokens=5,
                                          stop_token_ids=[])
    assert isinstance(listed, list) and listed[0].tokens == one.tokens
    tensor = specdec.speculative_generate(llama_target, llama_drafter, torch.tensor([[3, 4, 5], [6, 7, 8]]),
                                          max_new_tokens=5, stop_token_ids=[])
    assert len(tensor) == 2 and tensor[0].tokens == one.tokens


def test_strings_with_a_tokenizer():
    tokenizer = char_tokenizer()
    target = build_tiny("llama", vocab_size=len(tokenizer), seed=0)
    texts = ["hello", "a much longer prompt, with words"]
    results = specdec.speculative_generate(target, "ngram", texts, max_new_tokens=8, tokenizer=tokenizer,
                                           stop_token_ids=[])
    for text, result in zip(texts, results):
        ids = tokenizer(text)["input_ids"]
        assert result.tokens == hf_greedy(target, ids, 8, [])
        assert result.stats.prompt_tokens == len(ids)


def test_batch_figures_add_up(llama_target, llama_drafter):
    prompts = ragged_prompts(0)[:5]
    results = specdec.speculative_generate(llama_target, llama_drafter, prompts, max_new_tokens=16, gamma=3,
                                           stop_token_ids=[], batch_size=2)
    batch = results[0].batch
    assert all(r.batch is batch for r in results)
    assert batch.rows == 5 and batch.max_rows == 2 and batch.new_tokens == sum(len(r.tokens) for r in results) == 80
    assert batch.drafted == sum(r.stats.drafted for r in results)
    assert batch.accepted == sum(r.stats.accepted for r in results)
    assert batch.row_rounds == sum(r.stats.rounds for r in results)
    assert batch.rounds < batch.row_rounds  # rounds were shared
    assert batch.lossless and all(r.stats.lossless for r in results)
    assert 0 < batch.verify_time_s < batch.wall_time_s and batch.bookkeeping_s >= 0


def test_round_events_name_their_row(llama_target, llama_drafter):
    prompts = ragged_prompts(1)[:4]
    events = []
    results = specdec.speculative_generate(llama_target, llama_drafter, prompts, max_new_tokens=12, gamma=2,
                                           stop_token_ids=[], on_round=events.append, batch_size=2)
    for i, result in enumerate(results):
        assert [t for e in events if e.row == i for t in e.tokens] == result.tokens


BATCH_PROMPTS = ([3, 4, 3, 5, 3], [6, 2], [1, 1, 7, 4])  # three rows of different lengths


@pytest.mark.parametrize("drafter_kind", ["model", "lookup+model"])
def test_batched_sampling_keeps_each_rows_distribution(drafter_kind):
    setting = SETTINGS[1]
    target = build_toy(vocab_size=8, seed=0, scale=0.8)
    toy = build_toy(vocab_size=8, seed=1, scale=0.8)
    drafter = (toy if drafter_kind == "model"
               else specdec.LookupDrafter(toy, specdec.NgramConfig(min_ngram=1, num_tokens=3)))
    n_new = 2
    index = {seq: i for i, seq in enumerate(itertools.product(range(8), repeat=n_new))}
    counts = np.zeros((len(BATCH_PROMPTS), len(index)), dtype=np.int64)
    torch.manual_seed(99)
    for _ in range(3000):
        results = specdec.speculative_generate(target, drafter, list(BATCH_PROMPTS), max_new_tokens=n_new, gamma=2,
                                               temperature=setting[0], top_k=setting[1], top_p=setting[2],
                                               stop_token_ids=[])
        for row, result in enumerate(results):
            counts[row, index[tuple(result.tokens)]] += 1
    for row, prompt in enumerate(BATCH_PROMPTS):
        exact = exact_sequence_probs(target, list(prompt), n_new, setting)
        assert chi2_pvalue(counts[row], np.array([exact.get(s, 0.0) for s in index])) > 1e-3


def test_a_seeded_row_does_not_depend_on_its_neighbours(llama_target, llama_drafter):
    """Row i of a call with seed s samples with seed s + i, from its own generator: alone or batched,
    the same tokens."""
    prompts = ragged_prompts(2)[:4]
    kwargs = {"max_new_tokens": 16, "gamma": 3, "temperature": 1.0, "top_k": 30, "stop_token_ids": []}
    batched = specdec.speculative_generate(llama_target, llama_drafter, prompts, seed=10, **kwargs)
    alone = [specdec.speculative_generate(llama_target, llama_drafter, p, seed=10 + i, **kwargs).tokens
             for i, p in enumerate(prompts)]
    assert [r.tokens for r in batched] == alone
    again = specdec.speculative_generate(llama_target, llama_drafter, prompts, seed=10, batch_size=2, **kwargs)
    assert [r.tokens for r in again] == alone


@given(st.lists(st.integers(1, 300), min_size=1, max_size=8), st.integers(0, 60))
@settings(max_examples=200, deadline=None)
def test_prefill_groups_is_the_cheapest_split_into_contiguous_rows(widths, fixed):
    """Against every split of the rows into contiguous ranges: each range costs its rows times its widest, plus
    ``fixed``; the groups cover every row once, in order."""
    from specdec.batch import prefill_groups

    def cost(groups):
        return sum((end - start) * max(widths[start:end]) + fixed for start, end in groups)

    groups = prefill_groups(widths, fixed)
    assert [b for start, end in groups for b in range(start, end)] == list(range(len(widths)))
    splits = []
    for cuts in itertools.product((False, True), repeat=len(widths) - 1):
        bounds = [0, *[i + 1 for i, cut in enumerate(cuts) if cut], len(widths)]
        splits.append(list(itertools.pairwise(bounds)))
    assert cost(groups) == min(cost(split) for split in splits)


def test_rows_of_unlike_lengths_are_prefilled_apart_each_as_alone():
    """A joining batch of prompts of 1-60 tokens is fed in several forwards (not all padded to 60), and each row's
    cache gives the logits of that row prefilled alone."""
    from specdec.batch import PromptBatch, prefill_groups
    from specdec.seq2seq import prefilled_cache

    target = build_tiny("llama", seed=0)
    prompts = ragged_prompts(0)
    batch = PromptBatch.from_lists(prompts, "cpu")
    groups = prefill_groups(batch.widths())
    assert 1 < len(groups) < len(prompts)  # like rows still share a forward
    with torch.inference_mode():
        cache, calls = prefilled_cache(target, batch, "cpu")
        assert calls == sum(1 for start, end in groups if max(LENGTHS[start:end]) > 1)
        assert cache.live.tolist() == [n - 1 for n in LENGTHS]
        logits = cache.forward(batch.ids[:, -1:]).logits[:, -1]
        for row, prompt in enumerate(prompts):
            alone, _ = prefilled_cache(target, PromptBatch.from_lists([prompt], "cpu"), "cpu")
            expected = alone.forward(torch.tensor([prompt[-1:]])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-5)


@given(st.lists(st.booleans(), max_size=20))
@settings(max_examples=200, deadline=None)
def test_rows_leaving_move_only_rows_from_beyond_the_rows_that_stay(done):
    """``kept_order``: every staying row once; one already among the first k places (k stay) keeps its place; each
    place a leaving row frees there takes a staying row from beyond, so exactly as many rows move as such places."""
    from specdec.batch import kept_order

    order = kept_order(done)
    stay = [i for i, gone in enumerate(done) if not gone]
    assert sorted(order) == stay
    k = len(stay)
    assert all(order[i] == i for i in range(k) if not done[i])
    assert sum(row != place for place, row in enumerate(order)) == sum(done[:k])
    assert all(order[i] >= k for i in range(k) if done[i])


def test_a_row_leaving_mid_batch_moves_one_row_of_a_static_cache():
    """Of 4 static rows, the second leaves: only the last row's slots in use are copied (into its place), every
    row left keeps its cache (the next logits equal an eager cache's driven alike), and the dead slots past the
    pointer are not written."""
    from specdec.batch import PromptBatch, kept_order
    from specdec.cache import RaggedCache
    from specdec.compiled import CompiledModel, StaticRaggedCache
    from specdec.seq2seq import prefilled_cache

    model = build_tiny("llama", seed=5)
    compiled = CompiledModel(model, slots=40)
    compiled.rows, compiled.tokens = (4,), (1,)
    prompts = [[1, 4, 5, 6, 7], [1, 9, 10], [1, 2, 3, 8], [1, 11, 12, 13, 14, 15]]
    static, ragged = StaticRaggedCache(model, compiled), RaggedCache(model, 0)
    with torch.inference_mode():
        for cache in (static, ragged):
            cache.merge(prefilled_cache(model, PromptBatch.from_lists(prompts, "cpu"), "cpu")[0])
        keys = static.cache.layers[0].keys
        keys[:, :, static.used:] = 7.0  # marks the dead slots past the pointer
        before = keys.clone()
        order = kept_order([False, True, False, False])
        assert order == [0, 3, 2]
        for cache in (static, ragged):
            cache.select(torch.tensor(order))
        assert torch.equal(keys[[0, 2]], before[[0, 2]])  # rows in place: untouched
        assert torch.equal(keys[1, :, : static.used], before[3, :, : static.used])  # the last row moved in
        assert bool((keys[:, :, static.used:] == 7.0).all())
        ids = torch.tensor([[20], [21], [22]])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nothing warmed: the static step runs eagerly
            ours = static.forward(ids).logits
        assert torch.allclose(ours, ragged.forward(ids).logits, atol=1e-5)


def test_a_rollback_re_packs_rows_whose_dead_slots_widen_attention():
    """Two static rows; one rolls back a long draft while the other keeps it, so the pointer stays past the first
    row's live slots. Once the slots in use past the longest row reach ``REPACK_WASTE`` of it, the rollback re-packs
    (the pointer falls back to the longest row's live slots), and the next forward's logits equal an eager cache's
    driven alike."""
    from specdec.batch import PromptBatch
    from specdec.cache import COMPACT_MIN_SLOTS, REPACK_WASTE, RaggedCache
    from specdec.compiled import CompiledModel, StaticRaggedCache
    from specdec.seq2seq import prefilled_cache

    model = build_tiny("llama", seed=6)
    compiled = CompiledModel(model, slots=240)
    compiled.rows, compiled.tokens = (2,), (1, 8)
    prompts = [[1] + [3 + i % 90 for i in range(100)], [1, 40, 41]]  # 100 and 2 cached tokens
    static, ragged = StaticRaggedCache(model, compiled), RaggedCache(model, 0)
    packs = []  # (slots in use, longest row's live tokens) at each re-pack
    compact = static.compact
    static.compact = lambda: (packs.append((static.used, int(static.live.max()))), compact())

    def forward(ids):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nothing warmed: the static step runs eagerly
            ours = static.forward(torch.tensor(ids), logits_to_keep=len(ids[0])).logits
        assert torch.allclose(ours, ragged.forward(torch.tensor(ids), logits_to_keep=len(ids[0])).logits, atol=1e-5)

    with torch.inference_mode():
        for cache in (static, ragged):
            cache.merge(prefilled_cache(model, PromptBatch.from_lists(prompts, "cpu"), "cpu")[0])
        rounds = 0
        while not packs:  # the long row 0 keeps 1 of 8 drafts, row 1 all of them: dead slots pile up in row 0
            forward([[60 + i for i in range(8)], [70 + i for i in range(8)]])
            keep = static.live - torch.tensor([7, 0])
            for cache in (static, ragged):
                cache.keep(keep)
            rounds += 1
            assert rounds < 12
        (used, longest), = packs
        assert rounds >= 2 and used - longest >= max(COMPACT_MIN_SLOTS, REPACK_WASTE * longest)
        assert static.used == longest == int(static.live.max())  # packed: the pointer right after the longest row
        forward([[80], [81]])  # the packed rows decode as the eager cache's


class _PlainFromThree(specdec.schedules.Constant):
    """Drafts gamma while the batch has 1-2 rows; from 3 rows decodes plain, settled (as ``speculate="auto"`` after
    measuring plain decoding faster at that batch size)."""

    def plan(self, rows, device):
        plan = super().plan(rows, device)
        return specdec.schedules.DraftPlan(plan.limit.clamp(max=0), None, 0) if rows >= 3 else plan

    def settled_plain(self, rows: int) -> bool:
        return rows >= 3


@pytest.mark.parametrize("pair", ["llama", "gpt2+llama"])
def test_the_drafter_sits_out_a_batch_size_settled_as_plain_and_reads_the_rows_back(pair):
    """While the schedule has settled the batch's size as plain (``Schedule.settled_plain``), the drafter drops its
    rows and rows joining (or making such a batch) are not prefilled into it; when the batch shrinks to a size that
    drafts, the drafter reads every row's committed sequence (prompt and new tokens) in one prefill, and drafts from
    there. Every row stays the target's own greedy decoding, through rows joining and leaving on both sides of the
    switch."""
    target, drafter = PAIRS[pair]()
    if drafter is None:
        from conftest import truncated_copy

        drafter = truncated_copy(target, 1)
    prompts = ragged_prompts(11)
    budgets = [20, 6, 14, 9, 30, 4, 25]  # rows finish at different rounds: the batch goes 4 -> 3 -> 2 -> 1
    expected = [hf_greedy(target, p, n, []) for p, n in zip(prompts, budgets)]
    chosen = specdec.drafters.model_drafter(drafter)
    prefills: list[list[list[int]]] = []  # the rows of each of the drafter's prefills
    resets = []
    prefill, reset = chosen.prefill, chosen.reset
    chosen.prefill = lambda batch: prefills.append(batch.rows()) or prefill(batch)
    chosen.reset = lambda: resets.append(True) or reset()
    requests = [specdec.decode.Request(p, n, specdec.config.SamplingConfig(temperature=0.0), index=i)
                for i, (p, n) in enumerate(zip(prompts, budgets))]
    decoder = specdec.decode.Decoder(specdec.target.make_target(target), chosen, _PlainFromThree(3), batch_size=4)
    for request in requests:
        decoder.submit(request)
    finished = []
    while decoder.busy:
        finished += decoder.step()
    by_index = {row.request.index: row.tokens for row in finished}
    for i, (prompt, reference) in enumerate(zip(prompts, expected)):
        near_ties(target, prompt, by_index[i], reference)
    assert len(resets) == 1  # it sat out from the first join (7 prompts keep the batch at 3-4 rows until the tail)
    [read_back] = prefills  # no row joining a batch of 3-4 was prefilled into it; at 2 rows, the batch read back
    assert len(read_back) == 2
    for row in read_back:  # each a prompt and some of its new tokens: its committed sequence
        assert any(row[:len(p)] == p and len(row) > len(p) and row[len(p):] == e[:len(row) - len(p)]
                   for p, e in zip(prompts, expected)), row
    assert decoder.stats.drafted > 0
