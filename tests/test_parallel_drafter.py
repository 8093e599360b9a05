"""The parallel drafter (``specdec.drafters.parallel_model`` and ``specdec.drafters.parallel``): its attention pattern
against brute force, its rounds against the model run alone, greedy output equal to the target's ``generate``
(a tiny Llama and the shipped code-target, one row and ragged batches with rows finishing), a drafter for another
target refused by name, and a save/load round trip. The drafters are randomly initialised: exactness does not
depend on their quality; a vocabulary of 6 makes the tiny Llama's drafts accepted often enough for partial
acceptances to run."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_greedy, hf_greedy
from transformers import LlamaConfig, LlamaForCausalLM

import specdec
from specdec.drafters import ParallelDrafter, make_drafter
from specdec.drafters.parallel_model import (
    ParallelDrafterModel,
    is_parallel_drafter,
    load_parallel_drafter,
    new_parallel_drafter,
)
from specdec.target import make_target
from specdec.train.feature_drafter import target_pass

PROMPTS = [[3, 4, 5, 1, 2], [2, 1, 3, 5, 4, 4, 1, 2, 3], [5], [1, 2, 3, 1, 2, 3, 1]]


def _llama(layers: int = 4, hidden: int = 64, vocab: int = 6) -> LlamaForCausalLM:
    torch.manual_seed(3)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.2, pad_token_id=0, bos_token_id=0,
                         eos_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target():
    return _llama()


@pytest.fixture(scope="module")
def references(target):
    return [hf_greedy(target, p, 24, []) for p in PROMPTS]


def _model(target, layers: int = 1, block: int = 4, seed: int = 10) -> ParallelDrafterModel:
    return new_parallel_drafter(target, block_size=block, draft_layers=layers, seed=seed, name="tiny-llama").eval()


def _layers(model: ParallelDrafterModel, x: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor):
    """The model's layers on inputs ``x`` [1, n, H] at ``positions`` [1, n] under a boolean pattern [n, n]."""
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(x.dtype).min)[None, None]
    rotary = model.rotary_emb(x, position_ids=positions)
    for layer in model.layers:
        x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        x = x[0] if isinstance(x, tuple) else x
    return x


@torch.no_grad()
def test_the_mask_pattern_equals_brute_force(target):
    """One layer: mask slot j's output equals the last output of a plain causal forward of the context, the other mask
    slots and then slot j (explicit positions, so order is free): it sees the whole context and every mask slot; a
    context slot's output equals a causal forward of the context alone: it sees no mask slot. Two layers: the
    model's output equals its layers under the pattern written out by loops."""
    context, k = 5, 4
    ids = torch.tensor([[3, 1, 4, 1, 5] + [0] * k])
    hidden = torch.randn(1, context + k, 64)
    positions = torch.arange(context + k)[None]
    for layers in (1, 2):
        model = _model(target, layers=layers)
        out = model(ids, hidden, mask_tokens=k)
        x = model.inputs(ids, hidden, k)
        n = context + k
        if layers == 1:
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            for j in range(k):
                order = [*range(context), *(context + i for i in range(k) if i != j), context + j]
                ref = _layers(model, x[:, order], positions[:, order], causal)
                assert torch.allclose(out.hidden[0, context + j], ref[0, -1], atol=1e-5), j
            alone = _layers(model, x[:, :context], positions[:, :context], causal[:context, :context])
            assert torch.allclose(out.hidden[:, :context], alone, atol=1e-5)
        allowed = torch.tensor([[j <= i or (i >= context and j >= context) for j in range(n)] for i in range(n)])
        ref = _layers(model, x, positions, allowed)
        assert torch.allclose(out.hidden, ref, atol=1e-5)
        assert torch.allclose(out.logits, model.head(ref[:, context:]), atol=1e-5)
        # the pattern is not plain causal: the later mask slots change the first one's output
        alone = model(ids[:, :context + 1], hidden[:, :context + 1], mask_tokens=1)
        assert torch.allclose(alone.hidden[:, :context], out.hidden[:, :context], atol=1e-5)
        assert not torch.allclose(alone.hidden[:, context], out.hidden[:, context], atol=1e-3)


def _alone(model, target, row: list[int], k: int) -> list[int]:
    """The greedy drafts of a round after ``row`` by the model alone: no cache, one forward of every context pair
    (features of a plain forward of ``row``) and k mask slots."""
    ids = torch.tensor([row])
    features, _ = target_pass(target, model.config.feature_layers, ids, torch.ones_like(ids))
    fused = model.fuse_features(features[:, :-1])
    inputs = torch.cat([ids[:, 1:], torch.zeros(1, k, dtype=torch.long)], dim=1)
    hidden = torch.cat([fused, fused.new_zeros(1, k, fused.shape[-1])], dim=1)
    return model(inputs, hidden, mask_tokens=k).logits[0].argmax(-1).tolist()


@torch.no_grad()
def test_rounds_draft_what_the_model_drafts_alone(target):
    """Rounds of a ragged batch driven by hand, with made-up acceptances and limits that differ by row: each row's
    proposal equals the model run alone on its committed tokens with a block of its own limit (the features reached
    the drafter paired with the right tokens, the cache kept the context slots only, and a row's block does not
    depend on the rows beside it)."""
    from specdec.batch import PromptBatch
    from specdec.config import SamplingConfig
    from specdec.sampling import Sampler

    model = _model(target, layers=2)
    handle = make_target(target)
    drafter = make_drafter(ParallelDrafter(model), handle)
    rows = [list(p) for p in PROMPTS if len(p) > 1]
    batch = PromptBatch.from_lists(rows, "cpu")
    handle.prefill(batch)
    drafter.prefill(batch)
    sampler = Sampler.create(SamplingConfig(temperature=0.0), "cpu", rows=len(rows))
    for accepted, limits in (([1, 0, 2], [3, 1, 4]), ([0, 3, 1], [4, 4, 2]), ([2, 1, 0], [2, 3, 4])):
        proposal = drafter.propose(torch.tensor(limits), sampler)
        assert proposal.calls == 1
        assert proposal.drafts() == [_alone(model, target, row, n) for row, n in zip(rows, limits)]
        tokens = torch.zeros(len(rows), 5, dtype=torch.long)
        for b, (row, d) in enumerate(zip(rows, proposal.drafts())):
            tokens[b, :len(d) + 1] = torch.tensor([row[-1], *d])
        scores = handle.verify(tokens, torch.tensor([len(d) + 1 for d in proposal.drafts()]))
        keep = torch.tensor(accepted)
        nxt = [int(scores.logits[b, n].argmax()) for b, n in enumerate(accepted)]
        handle.rollback(keep + 1)
        drafter.commit(keep, torch.tensor(nxt))
        rows = [row + d[:n] + [t] for row, d, n, t in zip(rows, proposal.drafts(), accepted, nxt)]


@pytest.mark.parametrize("gamma", [1, 4, 6])
def test_greedy_output_equals_the_targets_single_and_ragged(target, references, gamma):
    """gamma 6 > block 4: the drafter drafts at most its block."""
    for batch_size in (1, 4):
        results = specdec.speculative_generate(target, ParallelDrafter(_model(target, layers=2)), PROMPTS,
                                               max_new_tokens=24, gamma=gamma, stop_token_ids=[],
                                               batch_size=batch_size)
        for prompt, result, reference in zip(PROMPTS, results, references):
            assert_same_greedy(target, prompt, result.tokens, reference)
        drafted = sum(r.stats.drafted for r in results)
        accepted = sum(r.stats.accepted for r in results)
        assert 0 < accepted < drafted, (accepted, drafted)  # some accepted, some rejected: rollback ran


def test_rows_finishing_at_different_lengths_stay_exact(target):
    """Stop tokens end rows at different rounds (rows leave the batch; ``select``) and rows join from a queue."""
    stops = [4]
    prompts = PROMPTS * 2
    references = [hf_greedy(target, p, 20, stops) for p in prompts]
    results = specdec.speculative_generate(target, ParallelDrafter(_model(target)), prompts, max_new_tokens=20,
                                           gamma=4, stop_token_ids=stops, batch_size=3)
    assert len({len(r.tokens) for r in results}) > 1
    for prompt, result, reference in zip(prompts, results, references):
        assert_same_greedy(target, prompt, result.tokens, reference)


def test_the_shipped_code_target_decodes_exactly_with_a_folder():
    from specdec.loading import load_tokenizer

    target, tokenizer = specdec.load_model("code-target"), load_tokenizer("code-target")
    prompts = ["def add(a, b):\n    return", "class Stack:\n    def __init__(self):\n        self.", "import"]
    plain = specdec.speculative_generate(target, "ngram", prompts, max_new_tokens=16, tokenizer=tokenizer,
                                         speculate="off")
    model = new_parallel_drafter(target, block_size=8, seed=1)
    for batch_size in (1, 3):
        results = specdec.speculative_generate(target, ParallelDrafter(model), prompts, max_new_tokens=16, gamma=8,
                                               tokenizer=tokenizer, batch_size=batch_size)
        assert [r.tokens for r in results] == [r.tokens for r in plain]


def test_a_folder_is_recognised_and_round_trips(target, references, tmp_path):
    model = _model(target, layers=2)
    model.save_pretrained(tmp_path / "pd")
    assert not any("embed_tokens" in p.name or "lm_head" in p.name for p in (tmp_path / "pd").iterdir())
    again = load_parallel_drafter(str(tmp_path / "pd"), target).eval()
    ids = torch.tensor([[1, 2, 3, 0, 0]])
    hidden = torch.randn(1, 5, 64)
    with torch.no_grad():
        assert torch.equal(again(ids, hidden, mask_tokens=2).logits, model(ids, hidden, mask_tokens=2).logits)
    assert set(again.state_dict()) == set(model.state_dict())
    assert is_parallel_drafter(again) and (again.config.block_size, again.config.draft_layers) == (4, 2)
    drafter = make_drafter(str(tmp_path / "pd"), make_target(target))
    assert isinstance(drafter, ParallelDrafter)
    results = specdec.speculative_generate(target, str(tmp_path / "pd"), PROMPTS, max_new_tokens=24, gamma=4,
                                           stop_token_ids=[], batch_size=4)
    for prompt, result, reference in zip(PROMPTS, results, references):
        assert_same_greedy(target, prompt, result.tokens, reference)


def test_a_drafter_for_another_target_is_refused_by_name(target, tmp_path):
    new_parallel_drafter(target, block_size=4, fingerprint="print-1", name="tiny-llama").save_pretrained(tmp_path)
    other = _llama(layers=5, hidden=32)
    with pytest.raises(ValueError) as err:
        load_parallel_drafter(str(tmp_path), other, name="other-llama")
    message = str(err.value)
    assert "\n" not in message and "tiny-llama" in message and "other-llama" in message
    assert "hidden 64, 4 layers" in message and "hidden 32, 5 layers" in message
    assert "specdec train parallel-drafter" in message
    with pytest.raises(ValueError, match="fingerprint"):
        ParallelDrafterModel.from_pretrained(tmp_path).bind(target, fingerprint="not-the-same")
    for folder, needle in ((tmp_path / "none", "no parallel drafter at"), ("models/code-drafter", "not a parallel")):
        with pytest.raises(ValueError, match=needle):
            load_parallel_drafter(str(folder), target)
    with pytest.raises(ValueError, match="parallel drafter"):
        make_drafter(str(tmp_path), make_target(other))


def test_sampled_proposals_carry_the_drafters_q(target):
    """A sampled proposal's q is the drafter's warped distribution at each mask slot (rows of sum 1, the drafted
    token with probability > 0), as verification's rejection rule needs."""
    from specdec.batch import PromptBatch
    from specdec.config import SamplingConfig
    from specdec.sampling import Sampler

    handle = make_target(target)
    drafter = make_drafter(ParallelDrafter(_model(target)), handle)
    batch = PromptBatch.from_lists([p for p in PROMPTS if len(p) > 1], "cpu")
    handle.prefill(batch)
    drafter.prefill(batch)
    sampler = Sampler.create(SamplingConfig(temperature=1.0, seed=1), "cpu", rows=3)
    proposal = drafter.propose(torch.tensor([3, 3, 3]), sampler)
    assert proposal.q is not None and proposal.q.shape == (3, 3, 6)
    assert torch.allclose(proposal.q.sum(-1), torch.ones(3, 3), atol=1e-5)
    assert bool((proposal.q.gather(-1, proposal.tokens[..., None]) > 0).all())
