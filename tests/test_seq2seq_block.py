"""SpecDec's block drafter as an encoder-decoder (issue 19): exact decoding, the block mask, refusals.

Random tiny Marian, BART and T5 block drafters (the target with one decoder layer and a
``block_drafter`` config entry, so its drafts are often wrong): greedy output equals the target's
own ``generate`` for one source and a batch of sources of different lengths, gamma 1 and 4, alone
and after prompt lookup; the cached block forward (rows of different lengths, holes) gives the
same block logits as one uncached forward of the whole decoder input under the block mask; a
block attends to itself both ways and the prefix stays causal.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_seq2seq import SOURCES, assert_single_and_batched, build, first_decoder_layer, generate
from transformers.modeling_outputs import BaseModelOutput

import specdec
from specdec.cache import causal_mask
from specdec.drafters import BlockDrafter, make_drafter, model_drafter
from specdec.drafters.block import is_block_drafter
from specdec.seq2seq import Seq2SeqCache
from specdec.target import make_target

MASK = 3


def block_drafter(target, max_block_size: int = 8):
    drafter = first_decoder_layer(target)
    drafter.config.block_drafter = {"mask_token_id": MASK, "max_block_size": max_block_size}
    return drafter


@pytest.mark.parametrize("arch", ["marian", "bart", "t5"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_equals_generate_single_and_batched(arch, gamma):
    target = build(arch)
    drafter = block_drafter(target)
    assert is_block_drafter(drafter) and not is_block_drafter(target)
    assert isinstance(model_drafter(drafter), BlockDrafter)
    references = [generate(target, s, 18, []) for s in SOURCES]
    for name, chosen in {"block": drafter, "lookup+block": specdec.LookupDrafter(model_drafter(drafter))}.items():
        batch = assert_single_and_batched(target, chosen, references, gamma, name)
        if name == "block":  # one drafter forward per round, whatever gamma
            assert all(r.stats.drafted <= gamma * r.stats.rounds for r in batch)


def test_cached_block_logits_equal_one_uncached_forward():
    target = build("marian")
    model = block_drafter(target).eval()
    start = target.config.decoder_start_token_id
    sources = [[5, 6, 7, 8, 9], [10, 11, 12]]
    prefixes = [[start, 20, 21, 22, 23, 24], [start, 30]]  # rows of different lengths: left padding, holes
    k = 4
    cache = Seq2SeqCache(model, 2)
    src = torch.zeros(2, 5, dtype=torch.long)
    valid_src = torch.zeros(2, 5, dtype=torch.bool)
    for r, s in enumerate(sources):
        src[r, : len(s)] = torch.tensor(s)
        valid_src[r, : len(s)] = True
    cache.encode(src, valid_src)
    width = max(map(len, prefixes))
    ids = torch.zeros(2, width + k, dtype=torch.long)
    valid = torch.zeros(2, width + k, dtype=torch.bool)
    for r, p in enumerate(prefixes):
        ids[r, width - len(p) : width] = torch.tensor(p)
        valid[r, width - len(p) :] = True
    ids[:, width:] = MASK
    with torch.no_grad():
        cached = cache.forward(ids[:, :3], valid[:, :3]).logits  # part of the prefix first
        cached = cache.forward(ids[:, 3:], valid[:, 3:], logits_to_keep=k, block_size=k).logits  # [2, k, V]
        for r, p in enumerate(prefixes):  # each row alone, uncached, under the block mask
            n = len(p) + k
            block = torch.zeros(1, n, dtype=torch.bool)
            block[:, -k:] = True
            mask = causal_mask(torch.ones(1, n, dtype=torch.bool), n, torch.float32, block)
            alone = model(encoder_outputs=BaseModelOutput(last_hidden_state=model.get_encoder()(
                input_ids=torch.tensor([sources[r]])).last_hidden_state),
                decoder_input_ids=torch.tensor([p + [MASK] * k]), decoder_attention_mask=mask).logits
            torch.testing.assert_close(cached[r], alone[0, -k:], rtol=1e-4, atol=1e-4)


def test_the_block_attends_both_ways_and_the_prefix_causally():
    valid = torch.tensor([[False, True, True, True, True, True]])
    block = torch.tensor([[False, False, False, False, True, True]])
    allowed = causal_mask(valid, 4, torch.float32, block)[0, 0] == 0  # queries: the last 4 slots
    assert allowed.tolist() == [
        [False, True, True, False, False, False],
        [False, True, True, True, False, False],
        [False, True, True, True, True, True],
        [False, True, True, True, True, True],
    ]


def test_mismatched_kinds_and_blocks_too_long_are_refused():
    target = build("marian")
    drafter = block_drafter(target, max_block_size=3)
    with pytest.raises(ValueError, match="drafts at most 3"):
        specdec.speculative_generate(target, drafter, SOURCES[0], max_new_tokens=8, gamma=5, stop_token_ids=[])
    other = copy.deepcopy(drafter)
    other.config.decoder_start_token_id = 1
    other.generation_config.decoder_start_token_id = 1
    with pytest.raises(ValueError, match="starts its decoder with token 1"):
        make_drafter(other, make_target(target))
    broken = copy.deepcopy(drafter)
    broken.config.block_drafter = {"mask_token_id": MASK}
    with pytest.raises(ValueError, match="lacks max_block_size"):
        model_drafter(broken)
