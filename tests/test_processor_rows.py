"""How a round applies a row's logits processors, against transformers' ``LogitsProcessorList`` called on
each position's own prefix alone (what ``generate`` holds there).

``specdec.processors.apply`` (the verification: γ+1 positions per row, processed as rows of one call when
every processor reads only the set of prefix tokens, else one call per position) and ``DraftSampler`` (the
drafter: one position per call, the prefix grown by the drafted tokens) build each row's committed tokens
once per round and call the processors without the list's per-call signature inspection. Each position's
scores must equal, bit for bit, the list's on the explicit prefix committed + the drafts before it; a
ragged batch; processor sets that take the batched path and sets that don't. End-to-end equality with
``generate`` is in tests/test_generation_config.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny, truncated_copy
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

import specdec
from specdec.config import SamplingConfig
from specdec.processors import DraftSampler, RowProcessors, apply, round_rows
from specdec.sampling import Sampler

V = 40
COMMITTED = [[1, 5, 6, 7, 5, 6], [3, 9, 9, 4], [8, 11, 12, 13, 14, 11, 12, 13, 14, 11]]
SETS = {  # name -> (processors, whether apply takes the batched path)
    "repetition": (lambda: [lp.RepetitionPenaltyLogitsProcessor(1.7)], True),
    "repetition+suppress": (lambda: [lp.RepetitionPenaltyLogitsProcessor(0.6),
                                     lp.SuppressTokensLogitsProcessor([3, 7])], True),
    "ngram+min length+bias": (lambda: [lp.RepetitionPenaltyLogitsProcessor(1.3), lp.NoRepeatNGramLogitsProcessor(2),
                                       lp.MinLengthLogitsProcessor(12, eos_token_id=2),
                                       lp.SequenceBiasLogitsProcessor({(5, 6): -3.0, (12,): 2.0})], False),
}


def reference(processors: list, prefix: list[int], scores: torch.Tensor) -> torch.Tensor:
    """transformers' list on one position: ``scores`` [V] after ``prefix``."""
    return LogitsProcessorList(processors)(torch.tensor([prefix]), scores.float().clone()[None])[0]


@pytest.mark.parametrize("name", list(SETS))
def test_verification_positions_equal_each_prefix_alone(name):
    make, batched = SETS[name]
    torch.manual_seed(0)
    drafts = [[5, 6, 7, 9], [9], [11, 12, 13, 14]]  # ragged: row 1 drafted one token
    m = 1 + max(len(d) for d in drafts)
    tokens = torch.tensor([[c[-1]] + d + [0] * (m - 1 - len(d)) for c, d in zip(COMMITTED, drafts)])  # [B, m]
    lengths = torch.tensor([1 + len(d) for d in drafts])
    logits = torch.randn(3, m, V) * 4  # [B, m, V]
    rows = round_rows([(c, LogitsProcessorList(make())) for c in COMMITTED], "cpu")
    assert all(p.set_only == batched for _, p in rows)
    out = apply(logits, tokens, lengths, rows)
    for b, (committed, draft) in enumerate(zip(COMMITTED, drafts)):
        for j in range(m):
            want = reference(make(), committed + draft[:j], logits[b, j]) if j <= len(draft) else logits[b, j]
            assert torch.equal(out[b, j], want), (name, b, j)
    assert not torch.equal(out[:, :2], logits[:, :2])  # the processors did change the scores


def test_a_row_without_processors_is_left_as_it_is():
    logits = torch.randn(2, 3, V)
    rows = round_rows([(COMMITTED[0], RowProcessors(LogitsProcessorList(SETS["repetition"][0]()))),
                       (COMMITTED[1], None)], "cpu")
    out = apply(logits, torch.tensor([[6, 1, 2], [4, 1, 2]]), torch.tensor([3, 3]), rows)
    assert torch.equal(out[1], logits[1]) and not torch.equal(out[0], logits[0])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", list(SETS))
def test_drafter_positions_equal_each_prefix_alone(name, temperature):
    """Three rows draft four positions; row 2 stops drafting after two (its later tokens are padding).
    Each drafted token is the argmax (greedy) of, and q (sampling) is the softmax of, the list's scores
    on committed + the tokens drafted before it."""
    make, _ = SETS[name]
    torch.manual_seed(1)
    config = SamplingConfig(temperature=temperature, top_k=0, top_p=1.0, seed=0)
    sampler = DraftSampler.wrap(Sampler.create(config, "cpu", rows=3),
                                round_rows([(c, LogitsProcessorList(make())) for c in COMMITTED], "cpu"))
    drafted: list[list[int]] = [[], [], []]
    for i in range(4):
        logits = torch.randn(3, V) * 4
        active = torch.tensor([True, True, i < 2])
        token, q = sampler.draft(logits, active)
        for b in range(3):
            if not active[b]:
                continue
            want = reference(make(), COMMITTED[b] + drafted[b], logits[b])
            if temperature == 0:
                assert int(token[b]) == int(want.argmax()), (name, i, b)
            else:
                assert torch.allclose(q[b], torch.softmax(want, dim=-1), atol=1e-7), (name, i, b)
            drafted[b].append(int(token[b]))


def test_single_row_drafts_equal_each_prefix_alone():
    make, _ = SETS["ngram+min length+bias"]
    torch.manual_seed(2)
    sampler = DraftSampler.wrap(Sampler.create(SamplingConfig(temperature=0), "cpu"),
                                round_rows([(COMMITTED[2], LogitsProcessorList(make()))], "cpu"))
    drafted: list[int] = []
    for _ in range(5):
        logits = torch.randn(1, V) * 4
        token, _ = sampler.draft(logits, torch.tensor([True]))
        assert int(token[0]) == int(reference(make(), COMMITTED[2] + drafted, logits[0]).argmax())
        drafted.append(int(token[0]))


class NeedsLength(lp.LogitsProcessor):
    """A processor that wants an argument besides (input_ids, scores)."""

    def __call__(self, input_ids, scores, cur_len):
        return scores


def test_processor_needing_more_arguments_is_refused_before_decoding():
    target = build_tiny("llama", seed=0, layers=2)
    with pytest.raises(ValueError, match=r"NeedsLength needs \['cur_len'\]"):
        specdec.speculative_generate(target, truncated_copy(target, 1), [1, 2, 3], max_new_tokens=4,
                                     logits_processor=LogitsProcessorList([NeedsLength()]))
