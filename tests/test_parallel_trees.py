"""Token trees from the parallel drafter's one forward (``ParallelDrafter.draft_tree``, ``best_paths``): the best
paths against brute-force enumeration, each round's tree against the model run alone on the committed tokens (the
target's features along the accepted path reach the drafter), greedy output equal to ``generate`` (single rows,
ragged batches, rows finishing and joining; the shipped code-target), sampling against the target's exact
distribution, ``--tree`` on the command line, and SpecDec's top-beta/tau rule with it (beta = 1 exact, a relaxed
run labelled lossy). The drafters are randomly initialised: exactness does not depend on their quality."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch
from conftest import assert_same_greedy, hf_greedy
from test_parallel_drafter import PROMPTS, _llama, _model

import specdec
from specdec.config import SamplingConfig, SpecConfig, VerifyConfig
from specdec.decode import Decoder, Request
from specdec.drafters import ParallelDrafter
from specdec.drafters.parallel import best_paths
from specdec.drafters.parallel_model import new_parallel_drafter
from specdec.schedules import make_schedule
from specdec.target import ModelTarget
from specdec.train.feature_drafter import target_pass
from specdec.tree import TreeConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return _llama()


@pytest.fixture(scope="module")
def references(target):
    return [hf_greedy(target, p, 24, []) for p in PROMPTS]


# ------------------------------------------------------------------------------------------ the best paths


def _token_paths(nodes: list[tuple[int, int]]) -> list[tuple[int, ...]]:
    """Each node's tokens from the root's child down to it, from (token, parent) nodes."""
    paths: list[tuple[int, ...]] = []
    for token, parent in nodes:
        assert 0 <= parent <= len(paths)  # parents come before their children
        paths.append((paths[parent - 1] if parent else ()) + (token,))
    return paths


def _brute_force(logprobs: torch.Tensor, nodes: int, topk: int) -> tuple[set[tuple[int, ...]], dict]:
    """Every path of 1 .. m positions through each position's ``topk`` most probable tokens of ``logprobs`` [m, V],
    scored by the product of its probabilities (in float64): the best ``nodes`` (as a set), and every score."""
    values, tokens = logprobs.double().topk(topk, dim=-1)
    scores = {}
    for depth in range(1, logprobs.shape[0] + 1):
        for ranks in itertools.product(range(topk), repeat=depth):
            path = tuple(int(tokens[j, r]) for j, r in enumerate(ranks))
            scores[path] = math.prod(math.exp(float(values[j, r])) for j, r in enumerate(ranks))
    best = sorted(scores, key=lambda p: -scores[p])[:nodes]
    return set(best), scores


def test_best_paths_equal_brute_force_enumeration():
    """Random blocks (1-4 positions, 1-4 candidates, budgets 1-30): the paths taken are the best by product of
    probabilities (a set equal to brute force's), best first, closed under prefixes (parents first)."""
    rng = random.Random(0)
    for _ in range(300):
        m, vocab, nodes = rng.randint(1, 4), rng.randint(2, 7), rng.randint(1, 30)
        topk = rng.randint(1, min(4, vocab))
        logprobs = torch.log_softmax(torch.randn(m, vocab, dtype=torch.float64) * rng.choice([0.5, 2.0, 5.0]), -1)
        values, tokens = logprobs.topk(topk, dim=-1)
        got = _token_paths(best_paths(values.tolist(), tokens.tolist(), nodes))
        want, scores = _brute_force(logprobs, nodes, topk)
        assert set(got) == want and len(got) == len(want) == min(nodes, len(scores))
        assert all(scores[a] >= scores[b] for a, b in itertools.pairwise(got))  # best first


def test_candidates_of_probability_zero_are_never_nodes():
    values = [[-0.1, -math.inf], [-0.5, -math.inf]]
    assert _token_paths(best_paths(values, [[7, 8], [9, 10]], 10)) == [(7,), (7, 9)]
    assert best_paths([], [], 5) == []


# ------------------------------------------------------------------------------------------ the drafter's trees


class Recording(ParallelDrafter):
    """A parallel drafter that keeps each round's block logits, limits and tree, and what each row committed."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.rounds: list[dict] = []

    def _block(self, limits):
        logits = super()._block(limits)
        self.rounds[-1].update(limits=list(limits), logits=logits.clone())
        return logits

    def draft_tree(self, depth, config):
        self.rounds.append({"limits": [0] * len(self.tokens)})
        tree = super().draft_tree(depth, config)
        self.rounds[-1]["tree"] = tree
        return tree

    def commit_tree(self, tree, paths, next_tokens):
        tokens = tree.tokens.tolist()
        self.rounds[-1]["committed"] = [[tokens[b][i - 1] for i in p] + [t] for b, (p, t) in
                                        enumerate(zip(paths, next_tokens))]
        super().commit_tree(tree, paths, next_tokens)


def _alone(model, target, row: list[int], k: int) -> torch.Tensor:
    """The block's log-probabilities [k, V] after ``row`` by the model alone: no cache, one forward of every context
    pair (features of a plain forward of ``row``) and k mask slots."""
    ids = torch.tensor([row])
    features, _ = target_pass(target, model.config.feature_layers, ids, torch.ones_like(ids))
    fused = model.fuse_features(features[:, :-1])
    inputs = torch.cat([ids[:, 1:], torch.zeros(1, k, dtype=torch.long)], dim=1)
    hidden = torch.cat([fused, fused.new_zeros(1, k, fused.shape[-1])], dim=1)
    return torch.log_softmax(model(inputs, hidden, mask_tokens=k).logits[0].double(), dim=-1)


@torch.no_grad()
def test_each_rounds_tree_is_the_best_paths_of_the_model_alone(target):
    """Tree rounds of a ragged batch (a one-token prompt that drafts nothing in its first round; depths up to the
    block): each row's block equals the model run alone on the tokens it had committed, and its tree equals
    brute force's best paths of that block. So the target's features along each accepted path, and only they,
    reached the drafter paired with the committed tokens, and the cache dropped the mask slots."""
    model = _model(target, layers=2, block=4)
    handle = ModelTarget(target, kernels=False)
    drafter = Recording(model).align(handle)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    config = TreeConfig(nodes=9, topk=6)  # every token a candidate: brute force over the whole vocabulary
    decoder = Decoder(handle, drafter, make_schedule(SpecConfig(gamma=4)), batch_size=3, tree=config)
    for i, p in enumerate(prompts):
        decoder.submit(Request(p, 40, SamplingConfig(temperature=0.0), index=i))
    for _ in range(6):
        decoder.step()
    committed = [r.request.ids + r.tokens for r in decoder.rows]
    assert len(drafter.rounds) == 6 and sum(len(r.tokens) for r in decoder.rows) > 6 * 3  # paths were accepted
    for round_ in reversed(drafter.rounds):  # from the end: each round's committed tokens come off the rows
        committed = [row[: len(row) - len(c)] for row, c in zip(committed, round_["committed"])]
        tree = round_["tree"]
        for b, (row, m) in enumerate(zip(committed, round_["limits"])):
            size = int(tree.sizes[b])
            nodes = list(zip(tree.tokens[b, :size].tolist(), tree.parents[b, :size].tolist()))
            if m == 0:
                assert len(row) == 1 and size == 0  # no pair yet: no tree
                continue
            alone = _alone(model, target, row, m)
            torch.testing.assert_close(torch.log_softmax(round_["logits"][b, :m].double(), -1), alone,
                                       atol=1e-5, rtol=1e-5)
            assert set(_token_paths(nodes)) == _brute_force(alone, config.nodes, 6)[0]
            assert int(tree.depths[b, :size].max()) <= m
    assert committed == [list(p) for p in prompts]


@pytest.mark.parametrize("nodes, topk", [(1, 1), (6, 2), (16, 4)])
def test_greedy_trees_equal_generate_single_and_ragged(target, references, nodes, topk):
    """Single rows and batches of 2 and 4 (prompts of 1 to 9 tokens; with 2, rows finish and join): equal to the
    target's greedy ``generate``; gamma 6 > block 4 (a tree is at most the block deep)."""
    config = TreeConfig(nodes=nodes, topk=topk)
    for batch_size in (1, 2, 4):
        results = specdec.speculative_generate(target, ParallelDrafter(_model(target, layers=2)), PROMPTS,
                                               max_new_tokens=24, gamma=6, stop_token_ids=[], batch_size=batch_size,
                                               tree=config, kernels="off")
        for prompt, result, reference in zip(PROMPTS, results, references):
            assert_same_greedy(target, prompt, result.tokens, reference)
        assert sum(r.stats.accepted for r in results) > 0


def test_trees_commit_more_per_round_than_the_chain(target, references):
    chain = specdec.speculative_generate(target, ParallelDrafter(_model(target)), PROMPTS, max_new_tokens=24, gamma=4,
                                         stop_token_ids=[], batch_size=4, kernels="off")
    tree = specdec.speculative_generate(target, ParallelDrafter(_model(target)), PROMPTS, max_new_tokens=24, gamma=4,
                                        stop_token_ids=[], batch_size=4, kernels="off", tree=16)
    assert [r.tokens for r in tree] == [r.tokens for r in chain]
    assert sum(r.stats.rounds for r in tree) < sum(r.stats.rounds for r in chain)
    assert all(r.stats.lossless for r in tree)


def test_rows_finishing_at_stop_tokens_stay_exact(target):
    stops = [4]
    prompts = PROMPTS * 2
    references = [hf_greedy(target, p, 20, stops) for p in prompts]
    results = specdec.speculative_generate(target, ParallelDrafter(_model(target)), prompts, max_new_tokens=20,
                                           gamma=4, stop_token_ids=stops, batch_size=3, tree=8, kernels="off")
    assert len({len(r.tokens) for r in results}) > 1
    for prompt, result, reference in zip(prompts, results, references):
        assert_same_greedy(target, prompt, result.tokens, reference)


def test_the_shipped_code_target_decodes_exactly_with_trees():
    from specdec.loading import load_tokenizer

    target, tokenizer = specdec.load_model("code-target"), load_tokenizer("code-target")
    prompts = ["def add(a, b):\n    return", "class Stack:\n    def __init__(self):\n        self.", "import"]
    plain = specdec.speculative_generate(target, "ngram", prompts, max_new_tokens=16, tokenizer=tokenizer,
                                         speculate="off")
    model = new_parallel_drafter(target, block_size=8, seed=1)
    for batch_size in (1, 3):
        results = specdec.speculative_generate(target, ParallelDrafter(model), prompts, max_new_tokens=16, gamma=8,
                                               tokenizer=tokenizer, batch_size=batch_size, tree=12, kernels="off")
        assert [r.tokens for r in results] == [r.tokens for r in plain]


# ------------------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize("setting", [(1.0, 0, 1.0), (0.7, 5, 0.85)])
def test_sampling_with_trees_matches_the_targets_distribution(target, setting):
    """Lossless sampling: the first two tokens of 3000 seeded rows with trees of 6 nodes from the parallel drafter
    (temperature, top-k, top-p) against the target's exact distribution of them, by enumeration (chi-square), with
    candidates both accepted and rejected. The tree's candidates are chosen by rule, so they are verified as one-hot
    candidates (q None): verifying them with the drafter's q would be biased (tests/test_trees.py)."""
    from test_core_sampling import chi2_pvalue, exact_sequence_probs

    prompt, n_new, n = [3, 4, 3, 5, 3], 2, 3000
    exact = exact_sequence_probs(target, prompt, n_new, setting)
    index = {seq: i for i, seq in enumerate(itertools.product(range(6), repeat=n_new))}
    outs = specdec.speculative_generate(target, ParallelDrafter(_model(target)), [prompt] * n, max_new_tokens=n_new,
                                        gamma=2, temperature=setting[0], top_k=setting[1], top_p=setting[2], seed=11,
                                        batch_size=250, stop_token_ids=[], tree=TreeConfig(nodes=6, topk=3),
                                        kernels="off", ignore_generation_config=True)
    counts = np.zeros(len(index), dtype=np.int64)
    for o in outs:
        counts[index[tuple(o.tokens)]] += 1
    accepted, drafted = sum(o.stats.accepted for o in outs), sum(o.stats.drafted for o in outs)
    assert n // 4 < accepted < drafted  # candidates accepted often, and rejected
    assert chi2_pvalue(counts, np.array([exact.get(s, 0.0) for s in index])) > 1e-3


# ------------------------------------------------------------------------------------------ top-beta/tau


def test_the_relaxed_walk_of_a_chain_is_top_beta_tau_and_beta_one_is_the_exact_walk():
    """On logits of a coarse grid (ties often): a tree that is a chain accepts what ``top_beta_tau`` accepts (the
    same count and next token); with beta = 1 any tree's relaxed walk is the exact greedy walk; a node takes the
    passing child the target ranks highest."""
    from specdec.acceptance import top_beta_tau
    from specdec.drafters.base import Proposal
    from specdec.sampling import Sampler
    from specdec.tree import Tree, accept_tree

    rng = random.Random(1)
    sampler = Sampler.create(SamplingConfig(), "cpu", rows=1)
    for _ in range(300):
        vocab, k = rng.randint(2, 7), rng.randint(1, 4)
        beta, tau = rng.randint(1, vocab), rng.choice([None, 0.0, 0.5, 1.5])
        config = VerifyConfig(rule="topk_tau", beta=beta, tau=tau)
        logits = torch.tensor([[rng.randint(-3, 3) / 2 for _ in range(vocab)] for _ in range(k + 1)])[None]
        chain = [rng.randrange(vocab) for _ in range(k)]
        tree = Tree.from_lists([[(t, i) for i, t in enumerate(chain)]])
        paths, nexts = accept_tree(tree, logits, sampler, config)
        verdict = top_beta_tau(Proposal(torch.tensor([chain]), torch.tensor([k])), logits, sampler, config)
        assert (len(paths[0]), nexts[0]) == (int(verdict.accepted[0]), int(verdict.next_token[0]))
        # a random tree of distinct siblings: beta 1 walks as exact verification does
        nodes, n = [], rng.randint(1, 8)
        for _ in range(n):
            parent = rng.randint(0, len(nodes))
            taken = {t for t, p in nodes if p == parent}
            free = [t for t in range(vocab) if t not in taken]
            if free:
                nodes.append((rng.choice(free), parent))
        tree = Tree.from_lists([nodes])
        wide = torch.tensor([[rng.randint(-3, 3) / 2 for _ in range(vocab)] for _ in range(len(nodes) + 1)])[None]
        one = VerifyConfig(rule="topk_tau", beta=1, tau=tau)
        assert accept_tree(tree, wide, sampler, one) == accept_tree(tree, wide, sampler)
    # two passing children: the one the target ranks higher, whatever their order in the tree
    tree = Tree.from_lists([[(3, 0), (1, 0)]])
    logits = torch.tensor([[[0.0, 2.0, 0.0, 1.0, 3.0], [0.0] * 5, [0.0] * 5]])
    assert accept_tree(tree, logits, sampler, VerifyConfig(beta=3)) == ([[2]], [0])
    assert accept_tree(tree, logits, sampler, VerifyConfig(beta=3, tau=0.5)) == ([[]], [4])


@pytest.mark.parametrize("tree", [None, 8])
def test_beta_one_is_greedy_and_a_relaxed_run_is_labelled(target, references, tree):
    """SpecDec's top-beta/tau with the parallel drafter, chains and trees: beta = 1 (any tau) reproduces the target's
    greedy output and is labelled lossless; beta 5, tau 3 keeps tokens among the target's top 5 within 3 logits of
    its best, commits some the target would not, is labelled lossy (as with any drafter), and accepts more."""
    from test_topk_tau import teacher_forced_logits

    def run(verify):
        return specdec.speculative_generate(target, ParallelDrafter(_model(target)), PROMPTS, max_new_tokens=24,
                                            gamma=4, stop_token_ids=[], batch_size=4, kernels="off", tree=tree,
                                            verify=verify)

    exact = run(VerifyConfig(rule="topk_tau", beta=1, tau=3.0))
    for prompt, result, reference in zip(PROMPTS, exact, references):
        assert result.stats.lossless is True
        assert_same_greedy(target, prompt, result.tokens, reference)
    relaxed = run(VerifyConfig(beta=5, tau=3.0))
    off = 0
    for prompt, result in zip(PROMPTS, relaxed):
        assert result.stats.lossless is False and len(result.tokens) == 24
        logits = teacher_forced_logits(target, prompt, result.tokens)
        for i, token in enumerate(result.tokens):
            assert int((logits[i] > logits[i, token]).sum()) < 5 and float(logits[i].max() - logits[i, token]) <= 3.0
            off += int(token != int(logits[i].argmax()))
    assert off > 0
    assert sum(r.stats.accepted for r in relaxed) > sum(r.stats.accepted for r in exact)


# ------------------------------------------------------------------------------------------ the command line


def test_generate_tree_switch_with_a_parallel_drafter_folder(tmp_path, capsys):
    """``specdec generate --tree 8 --drafter FOLDER`` (a parallel drafter's folder): the same text as chains."""
    from tiny_models import save_tiny_pair

    from specdec import cli

    pair = save_tiny_pair(tmp_path / "pair")
    model = specdec.load_model(str(pair.target))
    new_parallel_drafter(model, block_size=4, seed=2).save_pretrained(tmp_path / "pd")
    args = ["generate", "def add(a, b):", "--target", str(pair.target), "--drafter", str(tmp_path / "pd"),
            "--max-new-tokens", "12", "--temperature", "0", "--kernels", "off"]
    assert cli.main(args) == 0
    chain = capsys.readouterr().out
    assert cli.main([*args, "--tree", "8"]) == 0
    assert capsys.readouterr().out == chain
