"""The feature drafter behind the Drafter contract (``specdec.drafters.feature.FeatureDrafter``): greedy output equal
to the target's own ``generate``, one row and ragged batches (a one-token prompt among them), by object, by folder
and behind prompt lookup. A vocabulary of 6, so that a random drafter's drafts are accepted often enough for the
rollback after a partial acceptance to run."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_greedy, hf_greedy
from transformers import LlamaConfig, LlamaForCausalLM

import specdec
from specdec.drafters import FeatureDrafter, LookupDrafter, make_drafter
from specdec.drafters.feature_model import FeatureDrafterModel
from specdec.target import make_target

PROMPTS = [[3, 4, 5, 1, 2], [2, 1, 3, 5, 4, 4, 1, 2, 3], [5], [1, 2, 3, 1, 2, 3, 1]]


def _target() -> LlamaForCausalLM:
    torch.manual_seed(3)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=6, max_position_embeddings=256, tie_word_embeddings=True,
                         initializer_range=0.2, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target():
    return _target()


@pytest.fixture(scope="module")
def references(target):
    return [hf_greedy(target, p, 24, []) for p in PROMPTS]


def _drafter_model(target, seed: int = 10) -> FeatureDrafterModel:
    from specdec.drafters.feature_model import new_feature_drafter

    return new_feature_drafter(target, seed=seed).eval()


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_output_equals_the_targets_single_and_ragged(target, references, gamma):
    for batch_size in (1, 4):
        results = specdec.speculative_generate(target, FeatureDrafter(_drafter_model(target)), PROMPTS,
                                               max_new_tokens=24, gamma=gamma, stop_token_ids=[],
                                               batch_size=batch_size)
        for prompt, result, reference in zip(PROMPTS, results, references):
            assert_same_greedy(target, prompt, result.tokens, reference)
        drafted = sum(r.stats.drafted for r in results)
        accepted = sum(r.stats.accepted for r in results)
        assert 0 < accepted < drafted, (accepted, drafted)  # some accepted, some rejected: rollback ran


def test_the_eagle3_layout_decodes_exactly(target, references, tmp_path):
    """EAGLE-3's own layer (what `specdec export` writes) behind the same contract: by folder, single and ragged."""
    from specdec.drafters.feature_model import new_feature_drafter

    new_feature_drafter(target, seed=10, layout="eagle3").save_pretrained(tmp_path / "fd")
    for batch_size in (1, 4):
        results = specdec.speculative_generate(target, str(tmp_path / "fd"), PROMPTS, max_new_tokens=24, gamma=3,
                                               stop_token_ids=[], batch_size=batch_size)
        for prompt, result, reference in zip(PROMPTS, results, references):
            assert_same_greedy(target, prompt, result.tokens, reference)
        accepted, drafted = sum(r.stats.accepted for r in results), sum(r.stats.drafted for r in results)
        assert 0 < accepted < drafted, (accepted, drafted)


def test_a_folder_and_lookup_plus_folder_decode_exactly(target, references, tmp_path):
    _drafter_model(target, seed=4).save_pretrained(tmp_path / "fd")
    handle = make_target(target)
    assert isinstance(make_drafter(str(tmp_path / "fd"), handle), FeatureDrafter)
    hybrid = make_drafter(f"lookup+{tmp_path / 'fd'}", make_target(target))
    assert isinstance(hybrid, LookupDrafter) and isinstance(hybrid.fallback, FeatureDrafter)
    for name in (str(tmp_path / "fd"), f"lookup+{tmp_path / 'fd'}"):
        results = specdec.speculative_generate(target, name, PROMPTS, max_new_tokens=24, gamma=4, stop_token_ids=[],
                                               batch_size=4)
        for prompt, result, reference in zip(PROMPTS, results, references):
            assert_same_greedy(target, prompt, result.tokens, reference)


def _unrolled(model, target, row: list[int], gamma: int) -> list[int]:
    """The drafts of a round after ``row`` by the model alone, on the features of a plain forward of ``row``."""
    from transformers import DynamicCache

    from specdec.train.feature_drafter import target_pass

    ids = torch.tensor([row])
    features, _ = target_pass(target, model.config.feature_layers, ids, torch.ones_like(ids))
    cache = DynamicCache()
    out = model(ids[:, 1:], model.fuse_features(features[:, :-1]), past_key_values=cache, use_cache=True)
    drafts = []
    for k in range(gamma):
        drafts.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[drafts[-1]]]), out.hidden[:, -1:], past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[len(row) - 1 + k]]))
    return drafts


def test_rounds_draft_what_the_model_drafts_on_the_targets_features(target):
    """Two rounds of a ragged batch driven by hand: each proposal equals the model unrolled alone on the features of
    a plain forward of the row's committed tokens (the features reached the drafter, paired with the right tokens,
    and the rollback kept the context's slots only)."""
    from specdec.batch import PromptBatch
    from specdec.config import SamplingConfig
    from specdec.sampling import Sampler

    model = _drafter_model(target)
    handle = make_target(target)
    drafter = make_drafter(FeatureDrafter(model), handle)
    rows = [list(p) for p in PROMPTS if len(p) > 1]
    batch = PromptBatch.from_lists(rows, "cpu")
    handle.prefill(batch)
    drafter.prefill(batch)
    sampler = Sampler.create(SamplingConfig(temperature=0.0), "cpu", rows=len(rows))
    for accepted in ([1, 0, 2], [0, 3, 1]):
        proposal = drafter.propose(torch.tensor([3, 3, 3]), sampler)
        assert proposal.drafts() == [_unrolled(model, target, row, 3) for row in rows]
        # verify the newest committed token and the drafts; commit a made-up number of them plus the target's token
        tokens = torch.tensor([[row[-1], *d] for row, d in zip(rows, proposal.drafts())])
        scores = handle.verify(tokens, torch.tensor([4, 4, 4]))
        keep = torch.tensor(accepted)
        nxt = [int(scores.logits[b, n].argmax()) for b, n in enumerate(accepted)]
        handle.rollback(keep + 1)
        drafter.commit(keep, torch.tensor(nxt))
        rows = [row + d[:n] + [t] for row, d, n, t in zip(rows, proposal.drafts(), accepted, nxt)]


def test_sampled_rounds_carry_the_drafters_q(target):
    """A sampled proposal's q is the drafter's warped distribution at each drafted position (rows of sum 1, the
    drafted token with probability > 0), as verification's rejection rule needs."""
    from specdec.batch import PromptBatch
    from specdec.config import SamplingConfig
    from specdec.sampling import Sampler

    handle = make_target(target)
    drafter = make_drafter(FeatureDrafter(_drafter_model(target)), handle)
    batch = PromptBatch.from_lists([p for p in PROMPTS if len(p) > 1], "cpu")
    handle.prefill(batch)
    drafter.prefill(batch)
    proposal = drafter.propose(torch.tensor([3, 3, 3]), Sampler.create(SamplingConfig(temperature=1.0, seed=1), "cpu",
                                                                       rows=3))
    assert proposal.q is not None and proposal.q.shape == (3, 3, 6)
    assert torch.allclose(proposal.q.sum(-1), torch.ones(3, 3), atol=1e-5)
    assert bool((proposal.q.gather(-1, proposal.tokens[..., None]) > 0).all())


def test_int8_forms_draft_with_an_int8_head_copy_and_stay_exact(target, references):
    """``--drafter-dtype int8`` (auto on a CPU with int8 kernels, behind lookup too) for the drafters reading the
    target's features: their own linears and a copy of the target's head, made once per head, drafted in int8; the
    target's head is left as it is and the output is still the target's own."""
    from specdec.drafters.model import drafter_form, drafter_in, int8_available, is_int8
    from specdec.drafters.parallel_model import new_parallel_drafter

    if not int8_available():
        pytest.skip("this torch build has no int8 CPU kernels")
    head = target.get_output_embeddings()
    for model in (_drafter_model(target), new_parallel_drafter(target, block_size=4, seed=10).eval()):
        assert drafter_form(model, "auto") == drafter_form(model, "auto", lookup=True) == "int8"  # lookup too
        int8 = drafter_in(model, "int8")
        assert is_int8(int8) and not is_int8(model)
        for batch_size in (1, 4):
            results = specdec.speculative_generate(target, int8, PROMPTS, max_new_tokens=24, gamma=3,
                                                   stop_token_ids=[], batch_size=batch_size)
            for prompt, result, reference in zip(PROMPTS, results, references):
                assert_same_greedy(target, prompt, result.tokens, reference)
            assert sum(r.stats.accepted for r in results) > 0
        drafting = int8.shared()[1]
        assert drafting is not head and "quantized" in type(drafting).__module__ and type(head) is torch.nn.Linear
        assert int8.bind(target).shared()[1] is drafting  # made once per head and weight
        assert model.bind(target).shared()[1] is head  # a float drafter shares the target's head itself


def test_the_shipped_code_feature_drafter_decodes_exactly_and_drafts_well():
    """``code-feature-drafter`` by name, alone and behind prompt lookup, single and batched: the target's own greedy
    output (its ``generate``), and most drafts accepted (it was trained for this target; an untrained one is not)."""
    from specdec.loading import load_tokenizer

    target, tokenizer = specdec.load_model("code-target"), load_tokenizer("code-target")
    prompts = ["def add(a, b):\n    return", "class Stack:\n    def __init__(self):\n        self.", "import os\n"]
    references = [hf_greedy(target, tokenizer(p).input_ids, 32, [tokenizer.eos_token_id]) for p in prompts]
    for name in ("code-feature-drafter", "lookup+code-feature-drafter"):
        for batch_size in (1, 3):
            results = specdec.speculative_generate(target, name, prompts, max_new_tokens=32, gamma=4,
                                                   tokenizer=tokenizer, batch_size=batch_size)
            for prompt, result, reference in zip(prompts, results, references):
                assert_same_greedy(target, tokenizer(prompt).input_ids, result.tokens, reference)
            if name == "code-feature-drafter":
                assert sum(r.stats.accepted for r in results) > 0.5 * sum(r.stats.drafted for r in results)
