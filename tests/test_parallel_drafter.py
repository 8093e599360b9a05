"""The parallel drafter (``specdec.drafters.parallel_model`` and ``specdec.drafters.parallel``): its attention pattern
against brute force, its rounds against the model run alone, greedy output equal to the target's ``generate``
(a tiny Llama and the shipped code-target, one row and ragged batches with rows finishing), a drafter for another
target refused by name, and a save/load round trip. The drafters are randomly initialised: exactness does not
depend on their quality; a vocabulary of 6 makes the tiny Llama's drafts accepted often enough for partial
acceptances to run."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_greedy, hf_greedy, target_with_outputs
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
    for name in (str(tmp_path / "pd"), f"lookup+{tmp_path / 'pd'}"):
        results = specdec.speculative_generate(target, name, PROMPTS, max_new_tokens=24, gamma=4, stop_token_ids=[],
                                               batch_size=4)
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


# ------------------------------------------------------------------------------------------ the trainer


@torch.no_grad()
def test_each_trained_block_is_the_inference_round_at_its_anchor(target):
    """The trainer's one forward over a window's context and its blocks (cut at an offset) gives, at each anchor a and
    block position j, the KL of the model run alone as at inference after x_0 .. x_a (a block of k, or fewer where the
    window ends) against the target's distribution at a + j: the training pattern, positions and block positions are
    inference's."""
    import torch.nn.functional as F

    from specdec.train.parallel_drafter import anchors_of, block_terms

    model = _model(target, layers=2, block=4)
    row = [3, 4, 5, 1, 2, 2, 1, 3, 5, 4, 4, 1, 2]
    ids = torch.tensor([row, row[:9] + [0] * 4])
    live = torch.tensor([[1] * 13, [1] * 9 + [0] * 4])
    for offset in (1, 3):
        terms = block_terms(model, target, ids, live, offset)
        _, p_log = target_pass(target, model.config.feature_layers, ids[:1], live[:1])
        for m, a in enumerate(anchors_of(13, 4, offset)):
            k = min(4, 13 - a)
            prefix = torch.tensor([row[: a + 1]])
            features, _ = target_pass(target, model.config.feature_layers, prefix, torch.ones_like(prefix))
            fused = model.fuse_features(features[:, :-1])
            inputs = torch.cat([prefix[:, 1:], torch.zeros(1, k, dtype=torch.long)], dim=1)
            q_log = F.log_softmax(model(inputs, torch.cat([fused, fused.new_zeros(1, k, 64)], dim=1),
                                        mask_tokens=k).logits[0], dim=-1)
            for j in range(4):
                assert bool(terms[j]["valid"][0, m]) == (j < k)
                assert bool(terms[j]["valid"][1, m]) == (a + j < 9)
                if j < k:
                    p = p_log[0, a + j]
                    kl = float((p.exp() * (p - q_log[j])).sum())
                    assert abs(float(terms[j]["kl"][0, m]) - kl) < 1e-4, (offset, a, j)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from specdec.train.parallel_drafter import ParallelDrafterTrainConfig

    root = target_with_outputs(tmp_path_factory.mktemp("parallel"), lambda vocab: _llama(vocab=vocab))
    cfg = ParallelDrafterTrainConfig(target=str(root / "target"), data=str(root / "data.jsonl"), steps=8,
                                     batch_size=4, save_every=2, eval_every=4, block_size=4, lr=3e-3, warmup_steps=1)
    return {"root": root, "cfg": cfg}


def _train(cfg, out, **kw):
    from specdec.train.parallel_drafter import train_parallel_drafter

    return train_parallel_drafter(cfg, out, progress=False, log=lambda m: None, **kw)


def test_the_loss_falls_and_a_resumed_run_equals_the_uninterrupted_one(run, tmp_path):
    import json
    import random
    from dataclasses import replace

    from safetensors.torch import load_file

    from specdec.train.drafter import Example

    cfg = replace(run["cfg"], steps=40, eval_every=20, save_every=10, lr=1e-2)
    whole = _train(cfg, tmp_path / "whole")
    history = json.loads((whole / "training.json").read_text())["state"]["history"]
    losses = [h["train_loss"] for h in history if "train_loss" in h]
    assert losses[-1] < 0.85 * losses[0], losses  # averages of steps 1-20 and 21-40
    # and on one batch, the trained drafter's KL against the untrained one's (the same seed)
    from specdec.train.feature_drafter import collate
    from specdec.train.parallel_drafter import block_terms

    target = specdec.load_model(cfg.target)
    rows = [json.loads(line) for line in (run["root"] / "data.jsonl").read_text().splitlines()[:8]]
    ids, live = collate([Example(r["prompt_ids"] + r["ids"]) for r in rows], "cpu")
    trained = load_parallel_drafter(str(whole), target).eval()
    fresh = new_parallel_drafter(target, block_size=4, seed=cfg.seed).eval()

    def mean_kl(model) -> float:
        with torch.no_grad():
            terms = block_terms(model, target, ids, live, 1)
        return float(sum((t["kl"] * t["valid"]).sum() for t in terms) / sum(t["valid"].sum() for t in terms))

    assert mean_kl(trained) < 0.6 * mean_kl(fresh)  # measured here: 1.31 vs 2.42 nats
    assert (whole / "README.md").read_text().count("| 4 |") == 1  # the card's per-position table
    assert _train(cfg, tmp_path / "split", stop_at_step=13) is None
    torch.manual_seed(99)
    random.random()
    split = _train(cfg, tmp_path / "split")
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    again = [h["train_loss"] for h in json.loads((split / "training.json").read_text())["state"]["history"]
             if "train_loss" in h]
    assert again[-1] == losses[-1]  # the record after the resume averages steps 21-40 in both runs
    assert is_parallel_drafter(trained) and trained.config.block_size == 4


def test_bad_input_is_one_line(run, tmp_path):
    from dataclasses import replace

    from specdec.train.parallel_drafter import train_parallel_drafter

    cfg = run["cfg"]
    for bad, needle in ((replace(cfg, data=str(tmp_path / "none.jsonl")), "no data at"),
                        (replace(cfg, feature_layers="1,2"), "--feature-layers"),
                        (replace(cfg, draft_layers=3), "--draft-layers"),
                        (replace(cfg, block_size=0), "--block-size"),
                        (replace(cfg, autocast="fp16"), "--autocast")):
        with pytest.raises(ValueError, match=needle) as err:
            train_parallel_drafter(bad, tmp_path / "out", progress=False, log=lambda m: None)
        assert "\n" not in str(err.value)


def test_a_bf16_autocast_run_trains_and_rounds_differently_from_float32(run, tmp_path):
    import json
    from dataclasses import replace

    def losses(autocast: str) -> list[float]:
        cfg = replace(run["cfg"], steps=40, eval_every=20, save_every=40, lr=1e-2, autocast=autocast)
        final = _train(cfg, tmp_path / (autocast or "fp32"))
        history = json.loads((final / "training.json").read_text())["state"]["history"]
        return [h["train_loss"] for h in history if "train_loss" in h]

    bf16, fp32 = losses("bf16"), losses("")
    assert bf16[-1] < 0.85 * bf16[0], bf16
    assert bf16[0] != fp32[0] and abs(bf16[0] - fp32[0]) < 0.05 * fp32[0], (bf16, fp32)  # autocast engaged


def test_sampling_with_it_matches_the_targets_distribution(target):
    """Lossless sampling: the first two tokens sampled with the parallel drafter (temperature, top-k and top-p) follow
    the target's exact distribution of them, by enumeration (chi-square), with drafts both accepted and rejected."""
    import itertools

    import numpy as np
    from test_core_sampling import SETTINGS, chi2_pvalue, exact_sequence_probs

    setting = SETTINGS[1]
    prompt, n_new = [3, 4, 3, 5, 3], 2
    exact = exact_sequence_probs(target, prompt, n_new, setting)
    index = {seq: i for i, seq in enumerate(itertools.product(range(6), repeat=n_new))}
    counts = np.zeros(len(index), dtype=np.int64)
    drafter = ParallelDrafter(_model(target))
    torch.manual_seed(4321)
    accepted = drafted = 0
    for _ in range(1_500):
        res = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=n_new, gamma=2,
                                           temperature=setting[0], top_k=setting[1], top_p=setting[2],
                                           stop_token_ids=[])
        counts[index[tuple(res.tokens)]] += 1
        accepted += res.stats.accepted
        drafted += res.stats.drafted
    assert 0 < accepted < drafted  # drafts were accepted and rejected
    assert chi2_pvalue(counts, np.array([exact.get(s, 0.0) for s in index])) > 1e-3


# ------------------------------------------------------------------------------------------ glancing


def test_reveal_takes_floor_ratio_times_the_wrong_guesses_of_each_block():
    from specdec.train.parallel_drafter import reveal

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        rows, blocks, k = 3, 4, 5
        gold = torch.randint(0, 4, (rows, blocks * k), generator=g)
        guess = torch.randint(0, 4, (rows, blocks * k), generator=g)
        known = torch.rand(rows, blocks * k, generator=g) > 0.2
        ratio = float(torch.rand((), generator=g))
        revealed = reveal(guess, gold, known, torch.rand(rows, blocks * k, generator=g), ratio, k)
        assert not bool((revealed & ~known).any())
        wrong = ((guess != gold) & known).view(rows, blocks, k).sum(-1)
        assert torch.equal(revealed.view(rows, blocks, k).sum(-1), torch.floor(wrong * ratio).long())
    assert not reveal(guess, gold, known, torch.rand(rows, blocks * k), 0.0, k).any()


@torch.no_grad()
def test_a_revealed_slot_reads_its_gold_token(target):
    """A revealed mask slot's input is the gold token as a context pair with no feature plus its block position's
    embedding; the others are the mask's; the output of a slot that is not revealed changes (it sees the gold)."""
    model = _model(target, block=4)
    ids = torch.tensor([[3, 1, 4, 1, 5, 2, 0, 3, 0]])
    hidden = torch.randn(1, 9, 64)
    revealed = torch.tensor([[False, True, False, True]])
    x = model.inputs(ids, hidden, 4, revealed=revealed)
    plain = model.inputs(ids, hidden, 4)
    for j in range(4):
        if revealed[0, j]:
            want = model.pairs(ids[:, 5 + j: 6 + j], torch.zeros(1, 1, 64))[0, 0] + model.block_embed.weight[j]
            assert torch.allclose(x[0, 5 + j], want, atol=1e-6)
        else:
            assert torch.equal(x[0, 5 + j], plain[0, 5 + j])
    assert torch.equal(x[:, :5], plain[:, :5])
    out, alone = model(ids, hidden, mask_tokens=4, revealed=revealed), model(ids, hidden, mask_tokens=4)
    assert not torch.allclose(out.logits[0, 0], alone.logits[0, 0], atol=1e-4)


@torch.no_grad()
def test_glancing_block_terms_reveal_and_leave_the_loss(target):
    """Ratio 1: every known wrong guess is revealed; those slots leave ``valid``; a block with a revealed slot scores
    its other slots differently, a block with none exactly as without glancing (blocks do not see each other)."""
    from specdec.train.parallel_drafter import block_terms

    model = _model(target, layers=2, block=4)
    row = [3, 4, 5, 1, 2, 2, 1, 3, 5, 4, 4, 1, 2]
    ids, live = torch.tensor([row, row[:9] + [0] * 4]), torch.tensor([[1] * 13, [1] * 9 + [0] * 4])
    plain = block_terms(model, target, ids, live, 1)
    glanced = block_terms(model, target, ids, live, 1, glancing=(1.0, torch.rand(2, 40)))
    valid = torch.stack([t["valid"] for t in plain], -1)  # [B, M, k]
    left = torch.stack([t["valid"] for t in glanced], -1)
    revealed = valid & ~left
    assert bool(revealed.any()) and not bool((left & ~valid).any())
    kl, kl_glanced = torch.stack([t["kl"] for t in plain], -1), torch.stack([t["kl"] for t in glanced], -1)
    touched = revealed.any(-1)  # [B, M]
    assert torch.allclose(kl[~touched], kl_glanced[~touched], atol=1e-5)
    assert not torch.allclose(kl[touched & left.any(-1)], kl_glanced[touched & left.any(-1)], atol=1e-4)


def test_glancing_runs_resume_exactly(run, tmp_path):
    """With glancing on (0.5 -> 0.3), a run stopped and resumed equals the uninterrupted one, and differs from the
    run without glancing; the card says so; a ratio outside 0 .. 1 is refused in one line."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from specdec.train.parallel_drafter import train_parallel_drafter

    cfg = replace(run["cfg"], steps=12, save_every=4, eval_every=6, lr=1e-2, glancing_start=0.5, glancing_end=0.3)
    whole = _train(cfg, tmp_path / "whole")
    assert _train(cfg, tmp_path / "split", stop_at_step=5) is None
    torch.manual_seed(99)  # the resumed process's global random state is not the first one's
    split = _train(cfg, tmp_path / "split")
    plain = _train(replace(cfg, glancing_start=0.0, glancing_end=0.0), tmp_path / "plain")
    a, b, c = (load_file(str(f / "model.safetensors")) for f in (whole, split, plain))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert "Glancing: 0.5" in (whole / "README.md").read_text()
    with pytest.raises(ValueError, match="--glancing-start") as err:
        train_parallel_drafter(replace(cfg, glancing_start=1.5), tmp_path / "bad", progress=False, log=lambda m: None)
    assert "\n" not in str(err.value)


def test_a_run_saved_before_glancing_existed_resumes(run, tmp_path, monkeypatch):
    """A checkpoint whose config has no glancing fields (written before they existed) resumes with them at their
    defaults (off); asking for glancing on it is refused by name."""
    from dataclasses import asdict, replace

    from specdec.train import drafter

    cfg = replace(run["cfg"], records=10)
    saved = {k: v for k, v in asdict(cfg).items() if not k.startswith("glancing")}
    monkeypatch.setattr(drafter, "saved_config", lambda folder: saved)
    assert drafter._resumed_config(run["cfg"], tmp_path) == cfg
    with pytest.raises(ValueError, match="--glancing-start 0.0, not 0.5"):
        drafter._resumed_config(replace(run["cfg"], glancing_start=0.5), tmp_path)
