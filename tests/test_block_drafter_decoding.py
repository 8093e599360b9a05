"""The block drafter as a ``Drafter`` (``specdec/drafters/block.py``) on tiny random models.

Exactness is checked against the target's own ``generate`` (greedy, single and a ragged batch of 3,
alone and behind prompt lookup, through the factory's names); the cache rollback against a fresh
drafter prefilled with each row's committed tokens alone (no shared cache, no rollback); bad input
against the errors it must raise.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_greedy, build_tiny, hf_greedy

import specdec
from specdec.batch import PromptBatch
from specdec.config import SamplingConfig
from specdec.drafters import BlockDrafter, LookupDrafter, make_drafter
from specdec.drafters.block_model import BlockDrafterConfig, BlockDrafterModel
from specdec.sampling import Sampler
from specdec.target import make_target

V = 16  # a small vocabulary, so that even a random block drafter gets some drafts accepted
PROMPTS = [[3, 4, 5, 6], [7, 8, 3, 9, 10, 11, 12], [5]]  # ragged, one of a single token


def block_model(seed: int = 0, vocab_size: int = V, **kw) -> BlockDrafterModel:
    """A tiny block drafter with random weights; by default its head covers 12 of the 16 tokens."""
    settings = {"vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "max_position_embeddings": 256, "pad_token_id": 0, "max_block_size": 8,
                "tie_word_embeddings": False, "draft_vocab_size": 12, "initializer_range": 0.3}
    settings.update(kw)
    torch.manual_seed(seed)
    return BlockDrafterModel(BlockDrafterConfig(**settings)).eval()


@pytest.fixture(scope="module")
def target():
    return build_tiny("llama", vocab_size=V, seed=3)


@pytest.fixture(scope="module")
def references(target):
    return [hf_greedy(target, p, 24, []) for p in PROMPTS]


@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_greedy_output_equals_the_targets_single_and_batched(target, references, gamma):
    drafter = BlockDrafter(block_model())
    for batch_size in (1, 3):
        results = specdec.speculative_generate(target, drafter, PROMPTS, max_new_tokens=24, gamma=gamma,
                                               stop_token_ids=[], batch_size=batch_size)
        for prompt, result, reference in zip(PROMPTS, results, references):
            assert_same_greedy(target, prompt, result.tokens, reference)
        if gamma > 1:  # the drafts were verified, some accepted: the rollback paths ran
            assert sum(r.stats.drafted for r in results) > 0 and sum(r.stats.accepted for r in results) > 0


def test_factory_names_block_and_lookup_block_decode_exactly(target, references, tmp_path):
    block_model(seed=1).save_pretrained(tmp_path / "block")
    handle = make_target(target)
    alone = make_drafter(f"block:{tmp_path / 'block'}", handle)
    hybrid = make_drafter(f"lookup+block:{tmp_path / 'block'}", handle)
    assert isinstance(alone, BlockDrafter)
    assert isinstance(hybrid, LookupDrafter) and isinstance(hybrid.fallback, BlockDrafter)
    prompts = [*PROMPTS, [3, 4, 5, 3, 4, 5, 3, 4]]  # a repeating prompt, for lookup
    for name in (f"block:{tmp_path / 'block'}", f"lookup+block:{tmp_path / 'block'}"):
        results = specdec.speculative_generate(target, name, prompts, max_new_tokens=24, gamma=6,
                                               stop_token_ids=[], batch_size=3)
        for prompt, result in zip(prompts, results):
            assert_same_greedy(target, prompt, result.tokens, hf_greedy(target, prompt, 24, []))


def _committed_rounds(target, drafter: BlockDrafter, rounds: int, seed: int) -> tuple[list[list[int]], list]:
    """Run ``rounds`` rounds on PROMPTS with made-up verdicts (accepted counts and next tokens drawn at
    random), some followed by tokens another drafter proposed; return each row's committed tokens and the last
    proposal's q [B, k, V]."""
    gen = torch.Generator().manual_seed(seed)
    drafter.prefill(PromptBatch.from_lists(PROMPTS, "cpu"))
    committed = [list(p) for p in PROMPTS]
    sampler = Sampler.create(SamplingConfig(temperature=1.0, seed=seed), "cpu", rows=len(PROMPTS))
    for _ in range(rounds):
        limit = torch.randint(0, 7, (len(PROMPTS),), generator=gen)  # [B], rows that draft nothing included
        limit[0] = max(1, int(limit[0]))
        proposal = drafter.propose(limit, sampler)
        assert proposal.lengths.tolist() == limit.tolist() and proposal.calls == 1
        accepted = torch.stack([torch.randint(0, int(n) + 1, (), generator=gen) for n in proposal.lengths])  # [B]
        nxt = torch.randint(1, V, (len(PROMPTS),), generator=gen)  # [B]
        drafts = proposal.drafts()
        for b in range(len(PROMPTS)):
            committed[b] += drafts[b][: int(accepted[b])] + [int(nxt[b])]
        drafter.commit(accepted, nxt)
        if bool(torch.rand((), generator=gen) < 0.5):  # a round another drafter (lookup) proposed: follow only
            copied = [torch.randint(1, V, (int(torch.randint(1, 4, (), generator=gen)),), generator=gen).tolist()
                      for _ in PROMPTS]
            drafter.follow(copied)
            committed = [c + t for c, t in zip(committed, copied)]
        # invariant: cached + pending == committed, per row; no block slot is left in the cache
        assert [int(n) + len(p) for n, p in zip(drafter.cache.live, drafter.pending)] == [len(c) for c in committed]
        assert drafter.cache.stored_length() == drafter.cache.slots
        assert drafter.cache.slots <= max(len(c) for c in committed) + max(len(c) for c in committed)
    last = drafter.propose(torch.full((len(PROMPTS),), 5), sampler)
    return committed, last.q


def test_cache_rollback_gives_what_a_fresh_drafter_gives_for_each_row(target):
    model = block_model(seed=2)
    drafter = BlockDrafter(model).align(make_target(target))
    committed, q = _committed_rounds(target, drafter, rounds=6, seed=0)
    for b, row in enumerate(committed):  # each row alone, prefilled with its committed tokens: no rollback
        fresh = BlockDrafter(model).align(make_target(target))
        fresh.prefill(PromptBatch.from_lists([row], "cpu"))
        alone = fresh.propose(torch.tensor([5]), Sampler.create(SamplingConfig(temperature=1.0), "cpu"))
        torch.testing.assert_close(q[b], alone.q[0], atol=1e-5, rtol=1e-4)
        assert float(q[b][:, 12:].sum()) == 0.0  # tokens without a head row are never drafted


def test_select_keeps_rows_and_their_state(target):
    model = block_model(seed=2)
    drafter = BlockDrafter(model).align(make_target(target))
    committed, _ = _committed_rounds(target, drafter, rounds=3, seed=1)
    drafter.commit(torch.zeros(3, dtype=torch.long), torch.tensor([4, 5, 6]))  # the last proposal: all rejected
    committed = [c + [t] for c, t in zip(committed, [4, 5, 6])]
    drafter.select(torch.tensor([2, 0]))
    sampler = Sampler.create(SamplingConfig(temperature=1.0), "cpu", rows=2)
    q = drafter.propose(torch.tensor([4, 4]), sampler).q
    for i, b in enumerate([2, 0]):
        fresh = BlockDrafter(model).align(make_target(target))
        fresh.prefill(PromptBatch.from_lists([committed[b]], "cpu"))
        alone = fresh.propose(torch.tensor([4]), Sampler.create(SamplingConfig(temperature=1.0), "cpu")).q
        torch.testing.assert_close(q[i], alone[0], atol=1e-5, rtol=1e-4)


def test_bad_input_is_refused_with_the_fix(target, tmp_path):
    handle = make_target(target)
    drafter = BlockDrafter(block_model()).align(handle)
    drafter.prefill(PromptBatch.from_lists([[3, 4]], "cpu"))
    with pytest.raises(ValueError, match=r"at most 8 tokens per round.*--gamma 8"):
        drafter.propose(torch.tensor([9]), Sampler.create(SamplingConfig(), "cpu"))
    with pytest.raises(ValueError, match="block drafter vocabulary .*32 tokens.* differs from the target's"):
        BlockDrafter(block_model(vocab_size=32, draft_vocab_size=0)).align(handle)
    with pytest.raises(ValueError, match="cannot be cached"):
        BlockDrafter(block_model(prefix_attention="bidirectional"))
    with pytest.raises(ValueError, match="trained to read the target's last hidden state"):
        BlockDrafter(block_model(target_hidden_size=8))
    with pytest.raises(TypeError, match="block drafter model"):
        BlockDrafter(target)
    target.save_pretrained(tmp_path / "causal")
    with pytest.raises(ValueError, match="not a block drafter"):
        make_drafter(f"block:{tmp_path / 'causal'}", handle)
    with pytest.raises(ValueError, match="unknown drafter"):
        make_drafter(f"lookup+block:{tmp_path / 'missing'}", handle)
    with pytest.raises(ValueError, match="block:PATH needs"):
        make_drafter("block:", handle)
    # a schedule that may ask for more than the trained k is refused before any decoding, even behind lookup
    # and when the output would be too short to reach it
    calls = []
    for drafter, schedule in ((BlockDrafter(block_model()), "constant"),
                              (LookupDrafter(BlockDrafter(block_model())), "heuristic")):
        drafter.prefill = lambda *a, **k: calls.append(a)  # type: ignore[method-assign]
        with pytest.raises(ValueError, match=r"ask for 9 drafted tokens per round.*at most 8.* 8 or less"):
            specdec.speculative_generate(target, drafter, PROMPTS[0], max_new_tokens=2, gamma=9,
                                         schedule=specdec.ScheduleConfig(schedule, bound=(1, 9)))
    assert calls == []


def test_the_shipped_block_drafter_decodes_the_shipped_target_exactly():
    from specdec.loading import load_tokenizer

    target, tokenizer = specdec.load_model("code-target"), load_tokenizer("code-target")
    block = specdec.load_model("code-block-drafter")
    assert isinstance(block, BlockDrafterModel) and block.config.vocab_size == target.config.vocab_size
    assert load_tokenizer("code-block-drafter").get_vocab() == tokenizer.get_vocab()
    prompts = ["def add(a, b):\n    return", "class Stack:\n    def __init__(self):\n        self."]
    plain = specdec.speculative_generate(target, "ngram", prompts, max_new_tokens=24, tokenizer=tokenizer,
                                         speculate="off")
    for name in ("block", "lookup+block"):
        results = specdec.speculative_generate(target, name, prompts, max_new_tokens=24, gamma=8,
                                               tokenizer=tokenizer, batch_size=2)
        assert [r.tokens for r in results] == [r.tokens for r in plain]
        assert sum(r.stats.accepted for r in results) > 0  # a trained drafter: drafts are accepted


def test_a_row_drafting_fewer_than_the_block_drafts_as_it_would_alone(target):
    """The block attends within itself: a row asked for 1 draft beside a row asked for 3 must see a block of 1, as
    alone (its mask positions past its limit dead); its logits there used to change with the rows beside it, and a
    seeded sampled row's output with them (found by tests/test_decoder_schedules.py)."""
    seen = []

    def first_logits(limits: list[int]) -> torch.Tensor:
        drafter = BlockDrafter(block_model()).align(make_target(target))
        drafter.prefill(PromptBatch.from_lists([[3, 4, 5]] * len(limits), "cpu"))
        sampler = Sampler.create(SamplingConfig(temperature=1.0, seed=3), "cpu", rows=len(limits))
        draft = sampler.draft
        sampler.draft = lambda logits, rows=None: seen.append(logits[0].clone()) or draft(logits, rows)
        with torch.inference_mode():
            drafter.propose(torch.tensor(limits), sampler)
        return seen[-len(seen)]

    seen.clear()
    alone = first_logits([1])
    seen.clear()
    beside = first_logits([1, 3])
    torch.testing.assert_close(beside, alone)
