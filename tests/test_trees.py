"""Token trees (specdec.tree): the multi-candidate acceptance against exact distributions, the one-forward tree
verification against every root-to-node path scored alone, greedy output against ``generate`` (tiny Llama, GPT-2,
Qwen2 pairs and the shipped code pair; single rows, ragged batches, rows finishing and joining), and the sampled
first token's distribution with trees on."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import assert_same_greedy, build_tiny, truncated_copy
from scipy.stats import chisquare

import specdec
from specdec.batch import PromptBatch, left_mask, left_padded
from specdec.config import SamplingConfig, SpecConfig
from specdec.decode import Decoder, Request, speculative_generate
from specdec.drafters.model import ModelDrafter
from specdec.sampling import Sampler
from specdec.schedules import make_schedule
from specdec.target import ModelTarget
from specdec.tree import (
    Tree,
    TreeConfig,
    accept_tree,
    ancestors,
    candidate_chain,
    commit_target,
    sample_node,
    verify_tree,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------ exact acceptance


def _without_replacement(q: torch.Tensor, m: int):
    """Every ordered m-tuple of distinct tokens drawn in turn from q without replacement, with its probability."""
    support = [int(i) for i in torch.nonzero(q > 0).flatten()]
    for draw in itertools.permutations(support, m):
        prob, left = 1.0, 1.0
        for x in draw:
            prob *= float(q[x]) / left
            left -= float(q[x])
        yield list(draw), prob


def _output(p: torch.Tensor, q: torch.Tensor | None, draw: list[int]) -> torch.Tensor:
    """The exact output distribution of one node's procedure for the candidates ``draw``."""
    accept, residual = candidate_chain(p, q, draw)
    out = torch.zeros(p.shape[0], dtype=torch.float64)
    reach = 1.0
    for x, a in zip(draw, accept):
        out[x] += reach * a
        reach *= 1.0 - a
    return out + reach * residual


def _cases():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 2, 0)
    q = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 2, 0)
    p_holes = p.clone()
    p_holes[[1, 4]] = 0.0  # the target gives no mass where the drafter does: residual cases
    p_holes /= p_holes.sum()
    q_holes = q.clone()
    q_holes[[0, 2]] = 0.0  # the drafter never drafts tokens the target likes
    q_holes /= q_holes.sum()
    return [("random", p, q), ("p-zeros", p_holes, q), ("q-zeros", p, q_holes), ("equal", p, p.clone()),
            ("peaked", torch.tensor([0.9, 0.05, 0.05, 0, 0, 0], dtype=torch.float64), q)]


@pytest.mark.parametrize("name,p,q", _cases(), ids=[c[0] for c in _cases()])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_multi_candidate_acceptance_outputs_p_exactly(name, p, q, m):
    """Siblings drawn from q in turn without replacement: summed over every draw, the output is p to rounding."""
    total = torch.zeros_like(p)
    mass = 0.0
    for draw, prob in _without_replacement(q, m):
        total += prob * _output(p, q, draw)
        mass += prob
    assert abs(mass - 1.0) < 1e-12
    torch.testing.assert_close(total, p, atol=1e-12, rtol=0)


@pytest.mark.parametrize("m", [0, 1, 2, 3, 6])
def test_deterministic_candidates_output_p_for_any_candidate_set(m):
    """q None (one-hot per candidate): every fixed list of distinct candidates gives exactly p."""
    p = _cases()[1][1]  # with zeros
    for draw in itertools.permutations(range(6), m):
        torch.testing.assert_close(_output(p, None, list(draw)), p, atol=1e-12, rtol=0)


def test_a_wrong_q_is_not_lossless():
    """The check has teeth: verifying top-k candidates as if they were drawn from q is biased."""
    p, q = _cases()[0][1], _cases()[0][2]
    top = torch.argsort(q, descending=True)[:2].tolist()
    assert (_output(p, q, top) - p).abs().max() > 1e-3


def test_sample_node_draws_p():
    """The sampler itself (its uniforms, its residual's inverse CDF): chi-square over 20000 draws, fixed seed."""
    p, q = _cases()[1][1].float(), _cases()[1][2].float()
    sampler = Sampler.per_row([SamplingConfig(temperature=1.0)], [torch.Generator().manual_seed(7)])
    draws = torch.Generator().manual_seed(3)
    counts = torch.zeros(6)
    accepted = 0
    for _ in range(20000):
        kids = torch.multinomial(q, 3, replacement=False, generator=draws).tolist()
        i, token = sample_node(p, q, kids, sampler, 0)
        counts[token] += 1
        accepted += i >= 0
    support = p > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support].numpy(), (p[support] * 20000).numpy()).pvalue > 1e-3
    assert 0 < accepted < 20000  # both the candidates and the residual were sampled


# ------------------------------------------------------------------------------------------ tree verification


def test_ancestors():
    tree = Tree.from_lists([[(5, 0), (6, 0), (7, 1), (8, 3)]])
    a = ancestors(tree.parents)[0].int().tolist()
    assert a == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    assert tree.depths.tolist() == [[1, 1, 2, 3]]


def test_greedy_walk_takes_the_matching_child_and_the_argmax_after():
    """Row 0: the root's argmax is node 2's token, whose argmax is node 4's token, whose argmax (7) has no child:
    path [2, 4], next 7. Row 1: no child matches the root's argmax (9): path [], next 9."""
    tree = Tree.from_lists([[(3, 0), (4, 0), (5, 1), (6, 2), (6, 1)], [(3, 0)]])
    logits = torch.zeros(2, 6, 10)
    logits[0, 0, 4] = logits[0, 2, 6] = logits[0, 4, 7] = 1.0
    logits[0, 1, 5] = 1.0  # node 1's argmax: never reached
    logits[1, 0, 9] = 1.0
    sampler = Sampler.per_row([SamplingConfig(temperature=0.0)] * 2, [torch.Generator()] * 2)
    assert accept_tree(tree, logits, sampler) == ([[2, 4], []], [7, 9])


def _path(rows, b, node):
    """Tokens from the root's child down to ``node`` (1-based) of row ``b``'s (token, parent) list."""
    out = []
    while node:
        token, parent = rows[b][node - 1]
        out.append(token)
        node = parent
    return out[::-1]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_tree_verify_equals_every_path_scored_alone(arch):
    """A ragged batch (prompts of 3 and 7 tokens, trees of 6 and 3 nodes): each node's logits equal the model's on
    the prompt + that node's path alone; after committing a path, the next forward equals it again."""
    model = build_tiny(arch, seed=2)
    target = ModelTarget(model, kernels=False)
    prompts = [[1, 5, 9], [1, 4, 8, 12, 16, 20, 24]]
    rows = [[(10, 0), (11, 0), (12, 1), (13, 1), (14, 3), (15, 2)], [(30, 0), (31, 1), (32, 0)]]
    with torch.inference_mode():
        target.prefill(PromptBatch.from_lists(prompts, "cpu"))
        for round_ in range(2):
            tree = Tree.from_lists(rows)
            last = torch.tensor([p[-1] for p in prompts])
            logits = verify_tree(target, last, tree)
            for b, prompt in enumerate(prompts):
                for node in range(len(rows[b]) + 1):
                    alone = model(torch.tensor([prompt + _path(rows, b, node)])).logits[0, -1]
                    torch.testing.assert_close(logits[b, node], alone, atol=1e-4, rtol=1e-4)
            paths = [[1, 3, 5], [3]] if round_ == 0 else [[2], []]
            commit_target(target, paths, tree.n + 1)
            prompts = [p + _path(rows, b, path[-1] if path else 0) for b, (p, path) in enumerate(zip(prompts, paths))]
            prompts = [p + [40 + b] for b, p in enumerate(prompts)]  # the next token
            assert target.cached().tolist() == [len(p) - 1 for p in prompts]


# ------------------------------------------------------------------------------------------ greedy end to end


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_greedy_trees_equal_generate(arch):
    """Single rows and a batch of prompts of different lengths (3 prompts, 2 rows at a time: rows finish and
    join), several tree sizes: each output equals the target's own greedy decoding."""
    target = build_tiny(arch, seed=0)
    drafter = truncated_copy(target, 1)
    prompts = [[1, 5, 7, 9, 11], [1, 3], [1, 8, 6, 4, 2, 9, 17, 33, 21]]
    refs = [target.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    for nodes, topk in ((1, 1), (6, 2), (12, 4)):
        config = TreeConfig(nodes=nodes, topk=topk)
        for p, ref in zip(prompts, refs):
            out = speculative_generate(target, drafter, p, max_new_tokens=24, gamma=3, kernels="off", tree=config,
                                       stop_token_ids=[])
            assert_same_greedy(target, p, out.tokens, ref)
        outs = speculative_generate(target, drafter, prompts, max_new_tokens=24, gamma=4, kernels="off", tree=config,
                                    batch_size=2, stop_token_ids=[])
        for p, ref, out in zip(prompts, refs, outs):
            assert_same_greedy(target, p, out.tokens, ref)
    # a stop token inside an accepted path ends its row there (the others go on)
    stop = refs[0][5]
    outs = speculative_generate(target, drafter, prompts, max_new_tokens=24, gamma=4, kernels="off", tree=8,
                                batch_size=3, stop_token_ids=[stop])
    for p, ref, out in zip(prompts, refs, outs):
        cut = ref[: ref.index(stop) + 1] if stop in ref else ref
        assert_same_greedy(target, p, out.tokens, cut)


def test_both_caches_hold_the_committed_tokens_after_tree_rounds():
    """Through tree rounds on a ragged batch: the target caches every committed token but the newest, the drafter
    caches or holds pending every committed token, and both models' next logits equal theirs on the committed
    sequence alone (the kept path's entries are the right ones, in order)."""
    target = build_tiny("llama", seed=0)
    drafter_model = truncated_copy(target, 1)
    handle = ModelTarget(target, kernels=False)
    drafter = ModelDrafter(drafter_model, kernels=False).align(handle)
    decoder = Decoder(handle, drafter, make_schedule(SpecConfig(gamma=3)), batch_size=3, tree=TreeConfig(10, 3))
    prompts = [[1, 5, 7, 9, 11], [1, 3], [1, 8, 6, 4, 2, 9, 17]]
    for i, p in enumerate(prompts):
        decoder.submit(Request(p, 40, SamplingConfig(temperature=0.0), index=i))
    with torch.inference_mode():
        for _ in range(5):
            decoder.step()
            for b, row in enumerate(decoder.rows):
                committed = row.request.ids + row.tokens
                assert int(handle.cached()[b]) == len(committed) - 1
                assert int(drafter.cache.live[b]) + len(drafter.pending[b]) == len(committed)
        assert sum(len(r.tokens) for r in decoder.rows) > 5 * 3  # paths were accepted
        committed = [r.request.ids + r.tokens for r in decoder.rows]
        ids, counts = left_padded(drafter.pending, "cpu")
        mine, _ = drafter._step(ids, left_mask(counts, ids.shape[1]), False)
        scores = handle.verify(decoder.last[:, None], torch.ones(len(committed), dtype=torch.long)).logits[:, 0]
        for b, sequence in enumerate(committed):
            torch.testing.assert_close(mine[b], drafter_model(torch.tensor([sequence])).logits[0, -1],
                                       atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(scores[b], target(torch.tensor([sequence])).logits[0, -1], atol=1e-4, rtol=1e-4)


def test_trees_are_drafted_and_accepted():
    """Trees do what they are for: a tree of 12 nodes commits the same tokens as a chain of the same depth in fewer
    rounds."""
    target = build_tiny("llama", seed=0)
    drafter = truncated_copy(target, 1)
    prompt = [1, 5, 7, 9, 11]
    chain = speculative_generate(target, drafter, prompt, max_new_tokens=40, gamma=3, kernels="off", stop_token_ids=[])
    tree = speculative_generate(target, drafter, prompt, max_new_tokens=40, gamma=3, kernels="off", tree=12,
                                stop_token_ids=[])
    assert tree.tokens == chain.tokens
    assert tree.stats.rounds < chain.stats.rounds, (tree.stats.rounds, chain.stats.rounds)


def test_shipped_pair_greedy_with_trees():
    """models/code-target with models/code-drafter: equal to plain decoding, single and batched."""
    from specdec.data.prompts import code_completion_prompts

    target, drafter = specdec.load_model("code-target"), specdec.load_model("code-drafter")
    tok = specdec.load_tokenizer("code-target")
    prompts = [tok(p["prompt"])["input_ids"] for p in code_completion_prompts(2, seed=5)]
    plain = specdec.autoregressive_generate(target, prompts, max_new_tokens=20, kernels="off")
    spec = specdec.speculative_generate(target, drafter, prompts, max_new_tokens=20, gamma=4, tree=12, batch_size=2,
                                        kernels="off")
    single = specdec.speculative_generate(target, drafter, prompts[0], max_new_tokens=20, gamma=4, tree=12,
                                          kernels="off")
    assert [s.tokens for s in spec] == [p.tokens for p in plain]
    assert single.tokens == plain[0].tokens


def test_trees_refused_in_one_line_for_a_drafter_without_trees():
    target = build_tiny("llama", seed=0)
    with pytest.raises(ValueError, match=r"token trees are not available here: trees are drafted by a drafter model "
                                         r"or a feature drafter alone, not prompt lookup \(ngram\): pass --drafter "
                                         r"code-drafter"):
        speculative_generate(target, "ngram", [1, 2, 3], max_new_tokens=4, kernels="off", tree=8)


# ------------------------------------------------------------------------------------------ sampling end to end


def test_sampled_first_token_with_trees_is_the_targets():
    """Temperature 1, trees of 6 nodes 2 deep: the first new token of 3000 seeded rows against the target's exact
    distribution, and the second after the commonest first (chi-square on a 16-token vocabulary)."""
    target = build_tiny("llama", seed=0, vocab_size=16, init_range=0.1)
    drafter = truncated_copy(target, 1)
    prompt = [1, 5, 7]
    with torch.inference_mode():
        p = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), 0)
    n = 3000
    outs = speculative_generate(target, drafter, [prompt] * n, max_new_tokens=3, gamma=2, kernels="off",
                                tree=TreeConfig(nodes=6, topk=3), temperature=1.0, seed=11, batch_size=250,
                                stop_token_ids=[], ignore_generation_config=True)
    counts = torch.bincount(torch.tensor([o.tokens[0] for o in outs]), minlength=16).double()
    expected = p * n
    big = expected >= 5  # chi-square cells with enough mass; the rest pooled
    observed, wanted = counts[big], expected[big]
    if not bool(big.all()):
        observed = torch.cat([observed, counts[~big].sum()[None]])
        wanted = torch.cat([wanted, expected[~big].sum()[None]])
    assert chisquare(observed.numpy(), wanted.numpy()).pvalue > 1e-3
    assert sum(o.stats.accepted for o in outs) > n // 4  # the trees' candidates were accepted often
    # the second token, after the most frequent first one (accepted at depth 2 or drawn in the next round)
    first = int(counts.argmax())
    seconds = [o.tokens[1] for o in outs if o.tokens[0] == first]
    with torch.inference_mode():
        p2 = torch.softmax(target(torch.tensor([prompt + [first]])).logits[0, -1].double(), 0)
    counts2 = torch.bincount(torch.tensor(seconds), minlength=16).double()
    expected2 = p2 * len(seconds)
    big = expected2 >= 5
    observed, wanted = counts2[big], expected2[big]
    if not bool(big.all()):
        observed = torch.cat([observed, counts2[~big].sum()[None]])
        wanted = torch.cat([wanted, expected2[~big].sum()[None]])
    assert len(seconds) > 300 and chisquare(observed.numpy(), wanted.numpy()).pvalue > 1e-3


# ------------------------------------------------------------------------------------------ the command line


def test_generate_tree_switch(tmp_path, capsys):
    """--tree N decodes (the same text as chains, greedy); bad input is one line and exit 2: a tree size below 1,
    --compile on, a drafter that drafts no trees."""
    from tiny_models import save_tiny_pair

    from specdec import cli

    pair = save_tiny_pair(tmp_path / "pair")
    models = ["--target", str(pair.target), "--drafter", str(pair.drafter), "--max-new-tokens", "12",
              "--temperature", "0", "--kernels", "off"]
    assert cli.main(["generate", "def add(a, b):", *models]) == 0
    chain = capsys.readouterr().out
    assert cli.main(["generate", "def add(a, b):", *models, "--tree", "8"]) == 0
    assert capsys.readouterr().out == chain
    for extra, message in ((["--tree", "0"], "tree must be an int >= 1"),
                           (["--tree", "8", "--compile", "on"], "--tree decodes on the eager path"),
                           (["--tree", "8", "--drafter", "ngram"],
                            "trees are drafted by a drafter model or a feature drafter alone, not prompt lookup")):
        assert cli.main(["generate", "def add(a, b):", *models, *extra]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err
