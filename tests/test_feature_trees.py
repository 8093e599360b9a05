"""Token trees drafted by the feature drafter (EAGLE-2's dynamic tree on EAGLE-3's drafter, ``specdec.tree``).

Independent references: the target's own ``generate`` (greedy, single rows and ragged batches with rows finishing
and joining); every tree node's target logits and features against the target run on the prompt + that node's path
alone; the drafted tree against a brute-force EAGLE-2 construction whose every distribution comes from the drafter
unrolled alone along the node's path (the target's features of the prompt from a plain forward, then its own output
states); after tree rounds, both models' next outputs against the committed sequence alone; the first two sampled
tokens against the target's exact distributions (chi-square). A vocabulary of 6, so that a random drafter's
candidates are accepted often enough for paths of several nodes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_greedy, hf_greedy
from scipy.stats import chisquare
from test_feature_drafter_decoding import PROMPTS, _drafter_model, _target
from transformers import DynamicCache

from specdec.batch import PromptBatch
from specdec.config import SamplingConfig, SpecConfig
from specdec.decode import Decoder, Request, speculative_generate
from specdec.drafters import FeatureDrafter, make_drafter
from specdec.features import features_of, selection
from specdec.sampling import Sampler
from specdec.schedules import make_schedule
from specdec.target import ModelTarget
from specdec.tree import Tree, TreeConfig, accept_tree, commit_target, draft_tree, tree_refusal, verify_tree

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def target():
    return _target()


@pytest.fixture(scope="module")
def references(target):
    return [hf_greedy(target, p, 24, []) for p in PROMPTS]


def _drafter(target, seed: int = 10) -> FeatureDrafter:
    return FeatureDrafter(_drafter_model(target, seed))


# ------------------------------------------------------------------------------------------ brute force


def _target_alone(model, sequence: list[int], layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [V] after ``sequence``, the features [N, F] of its every position), from one plain forward."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([sequence]), output_hidden_states=True)
    return out.logits[0, -1], features_of(out.hidden_states, layers, "reference")[0]


def _drafter_alone(model, target, row: list[int], path: list[int]) -> torch.Tensor:
    """log q [V] after drafting ``path`` past the committed ``row``: the drafter's catch-up over the pairs
    (f_t, x_{t+1}) of a plain forward of ``row``, then one step per path token on its own output state."""
    layers = tuple(i + 1 for i in model.config.feature_layers)
    _, features = _target_alone(target, row, layers)
    ids = torch.tensor([row])
    cache = DynamicCache()
    with torch.no_grad():
        out = model(ids[:, 1:], model.fuse_features(features[None, :-1]), past_key_values=cache, use_cache=True)
        for k, token in enumerate(path):
            out = model(torch.tensor([[token]]), out.hidden[:, -1:], past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[len(row) - 1 + k]]))
    return torch.log_softmax(out.logits[0, -1].float(), dim=-1)


def _eagle2(model, target, row: list[int], depth: int, config: TreeConfig) -> set[tuple[int, ...]]:
    """The paths of EAGLE-2's tree for ``row`` built by brute force: level by level, the ``topk`` nodes of the level
    with the highest cumulative log q get their ``topk`` most probable children; the best ``nodes`` of all kept."""
    root = _drafter_alone(model, target, row, [])
    values, tokens = root.topk(config.topk)
    level = [((int(t),), float(v)) for v, t in zip(values, tokens)]
    every = list(level)
    for _ in range(depth - 1):
        frontier = sorted(level, key=lambda node: -node[1])[: config.topk]
        level = []
        for path, value in frontier:
            child = _drafter_alone(model, target, row, list(path))
            cv, ct = child.topk(config.topk)
            level += [((*path, int(t)), value + float(v)) for v, t in zip(cv, ct)]
        every += level
    return {path for path, _ in sorted(every, key=lambda node: -node[1])[: config.nodes]}


def _made_up_path(tree: Tree, b: int, length: int) -> list[int]:
    """Nodes (1-based) of row ``b``'s tree from the root down its first children, at most ``length`` of them."""
    paths, out = _paths(tree, b), []
    for i, path in enumerate(paths):
        if len(out) < length and len(path) == len(out) + 1 and (not out or path[:-1] == paths[out[-1] - 1]):
            out.append(i + 1)
    return out


def _paths(tree: Tree, b: int) -> list[tuple[int, ...]]:
    """Row ``b``'s nodes as token paths from the root, in the tree's order."""
    tokens, parents = tree.tokens[b].tolist(), tree.parents[b].tolist()
    out: list[tuple[int, ...]] = []
    for i in range(int(tree.sizes[b])):
        out.append((*(out[parents[i] - 1] if parents[i] else ()), tokens[i]))
    return out


# ------------------------------------------------------------------------------------------ the tree itself


@pytest.mark.parametrize("config", [TreeConfig(nodes=8, topk=2), TreeConfig(nodes=14, topk=3)])
def test_the_drafted_tree_is_eagle2s_on_the_drafter_unrolled_alone(target, config):
    """A ragged batch (a one-token prompt among it), three rounds: each row's tree equals the brute-force EAGLE-2
    tree over the drafter run alone on the row's committed tokens (so step 1 read the target's features of the
    prefix and each deeper level its parent node's own output state, under the tree's ancestor mask); the
    one-token row drafts nothing in the first round. Between rounds a path of 0-3 nodes per row (made up: any path
    will do, the references follow the committed tokens) is committed to both models, as a tree round does."""
    from specdec.tree import commit_tree

    model = _drafter_model(target)
    handle = ModelTarget(target, kernels=False)
    drafter = make_drafter(FeatureDrafter(model), handle)
    greedy = Sampler.create(SamplingConfig(temperature=0.0), "cpu", rows=len(PROMPTS))  # its next tokens only
    rows = [list(p) for p in PROMPTS]
    batch = PromptBatch.from_lists(rows, "cpu")
    with torch.inference_mode():
        handle.prefill(batch)
        drafter.prefill(batch)
        accepted = []
        for round_ in range(3):
            depth = [3, 3, 2, 3]
            tree = draft_tree(drafter, depth, config)
            for b, row in enumerate(rows):
                if len(row) == 1 and round_ == 0:
                    assert int(tree.sizes[b]) == 0  # no (feature, token) pair yet
                    continue
                assert set(_paths(tree, b)) == _eagle2(model, target, row, depth[b], config), (round_, b)
            logits = verify_tree(handle, torch.tensor([r[-1] for r in rows]), tree)
            _, nexts = accept_tree(tree, logits, greedy)
            paths = [_made_up_path(tree, b, (b + round_) % 4) for b in range(len(rows))]  # 0-3 nodes kept
            accepted.append(sum(len(p) for p in paths))
            commit_target(handle, paths, tree.n + 1)
            commit_tree(drafter, tree, paths, nexts)
            rows = [row + [tree.tokens[b, i - 1].item() for i in path] + [t]
                    for b, (row, path, t) in enumerate(zip(rows, paths, nexts))]
        assert sum(accepted[:-1]) > 0, accepted  # a later round drafted after an accepted path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tree_verify_with_features_equals_every_path_alone(arch):
    """A ragged batch (prompts of 3 and 7 tokens, trees of 6 and 3 nodes): each node's logits and features equal the
    target's on the prompt + that node's path alone; after committing a path the features taken are the root's and
    the path's, in order, and equal the plain forward's of the committed sequence."""
    from conftest import build_tiny

    model = build_tiny(arch, seed=2, layers=4)
    handle = ModelTarget(model, kernels=False)
    layers = handle.want_features((1, 2, 4))
    prompts = [[1, 5, 9], [1, 4, 8, 12, 16, 20, 24]]
    rows = [[(10, 0), (11, 0), (12, 1), (13, 1), (14, 3), (15, 2)], [(30, 0), (31, 1), (32, 0)]]
    with torch.inference_mode():
        handle.prefill(PromptBatch.from_lists(prompts, "cpu"))
        handle.take_features()
        for round_ in range(2):
            tree = Tree.from_lists(rows)
            logits = verify_tree(handle, torch.tensor([p[-1] for p in prompts]), tree)
            for b, prompt in enumerate(prompts):
                for node in range(len(rows[b]) + 1):
                    path = [rows[b][i - 1][0] for i in _node_path(rows[b], node)]
                    alone, features = _target_alone(model, prompt + path, layers)
                    torch.testing.assert_close(logits[b, node], alone, **TOL)
                    torch.testing.assert_close(handle._verified[b, node], features[-1], **TOL)
            paths = [[1, 3, 5], [3]] if round_ == 0 else [[2], []]
            commit_target(handle, paths, tree.n + 1)
            taken, lengths = handle.take_features()
            nexts = [40, 41]
            for b, (prompt, path) in enumerate(zip(prompts, paths)):
                committed = prompt + [rows[b][i - 1][0] for i in path]
                assert int(lengths[b]) == len(path) + 1
                _, features = _target_alone(model, committed, layers)
                torch.testing.assert_close(taken[b, : len(path) + 1], features[len(prompt) - 1:], **TOL)
            prompts = [p + [rows[b][i - 1][0] for i in path] + [nexts[b]] for b, (p, path) in
                       enumerate(zip(prompts, paths))]
            assert handle.cached().tolist() == [len(p) - 1 for p in prompts]
    assert selection(layers) == [1, 2, 4]


def _node_path(row: list[tuple[int, int]], node: int) -> list[int]:
    """The nodes (1-based) from the root's child down to ``node`` in a (token, parent) list."""
    out = []
    while node:
        out.append(node)
        node = row[node - 1][1]
    return out[::-1]


# ------------------------------------------------------------------------------------------ greedy end to end


@pytest.mark.parametrize("nodes,topk", [(1, 1), (6, 2), (12, 4)])
def test_greedy_feature_trees_equal_generate(target, references, nodes, topk):
    """Single rows, and a ragged batch of 4 prompts 2 rows at a time (a one-token prompt among them: rows finish and
    join): each output equals the target's own greedy decoding."""
    config = TreeConfig(nodes=nodes, topk=topk)
    for prompt, reference in zip(PROMPTS, references):
        out = speculative_generate(target, _drafter(target), prompt, max_new_tokens=24, gamma=3, kernels="off",
                                   tree=config, stop_token_ids=[])
        assert_same_greedy(target, prompt, out.tokens, reference)
    outs = speculative_generate(target, _drafter(target), PROMPTS, max_new_tokens=24, gamma=4, kernels="off",
                                tree=config, batch_size=2, stop_token_ids=[])
    for prompt, reference, out in zip(PROMPTS, references, outs):
        assert_same_greedy(target, prompt, out.tokens, reference)
    assert sum(o.stats.accepted for o in outs) > 0


def test_a_stop_token_inside_a_path_ends_its_row(target, references):
    stop = references[0][5]
    outs = speculative_generate(target, _drafter(target), PROMPTS, max_new_tokens=24, gamma=4, kernels="off",
                                tree=8, batch_size=3, stop_token_ids=[stop])
    for prompt, reference, out in zip(PROMPTS, references, outs):
        cut = reference[: reference.index(stop) + 1] if stop in reference else reference
        assert_same_greedy(target, prompt, out.tokens, cut)


def test_trees_accept_more_per_round_than_the_chain(target):
    """The same drafter, a chain of gamma 3 and a tree of 12 nodes 3 deep: the same tokens in fewer rounds."""
    prompt = PROMPTS[1]
    chain = speculative_generate(target, _drafter(target), prompt, max_new_tokens=40, gamma=3, kernels="off",
                                 stop_token_ids=[])
    tree = speculative_generate(target, _drafter(target), prompt, max_new_tokens=40, gamma=3, kernels="off",
                                tree=12, stop_token_ids=[])
    assert tree.tokens == chain.tokens
    assert tree.stats.rounds < chain.stats.rounds, (tree.stats.rounds, chain.stats.rounds)


def test_both_models_follow_the_committed_tokens_after_tree_rounds(target):
    """Through tree rounds on a ragged batch: the target caches every committed token but the newest; the drafter's
    cached slots and pending pairs are every committed token but the newest; the drafter's next catch-up equals
    the drafter run alone on the committed sequence (its cache kept no tree slot, and the features it holds are the
    accepted path's, in order), and the target's next logits equal its own on the sequence alone."""
    model = _drafter_model(target)
    handle = ModelTarget(target, kernels=False)
    drafter = make_drafter(FeatureDrafter(model), handle)
    decoder = Decoder(handle, drafter, make_schedule(SpecConfig(gamma=3)), batch_size=4, tree=TreeConfig(10, 3))
    for i, p in enumerate(PROMPTS):
        decoder.submit(Request(p, 40, SamplingConfig(temperature=0.0), index=i))
    with torch.inference_mode():
        for _ in range(5):
            decoder.step()
            for b, row in enumerate(decoder.rows):
                committed = row.request.ids + row.tokens
                assert int(handle.cached()[b]) == len(committed) - 1
                assert int(drafter.cache.live[b]) + len(drafter.tokens[b]) == len(committed) - 1
        assert sum(len(r.tokens) for r in decoder.rows) > 5 * len(decoder.rows)  # paths were accepted
        committed = [r.request.ids + r.tokens for r in decoder.rows]
        mine, _ = drafter.catch_up()
        scores = handle.verify(decoder.last[:, None], torch.ones(len(committed), dtype=torch.long)).logits[:, 0]
        for b, sequence in enumerate(committed):
            torch.testing.assert_close(torch.log_softmax(mine[b].float(), -1), _drafter_alone(model, target, sequence,
                                                                                             []), **TOL)
            torch.testing.assert_close(scores[b], _target_alone(target, sequence, (1,))[0], **TOL)


def test_feature_trees_are_allowed_and_lookup_in_front_still_refused(target):
    from specdec.drafters import LookupDrafter

    handle = ModelTarget(target, kernels=False)
    assert tree_refusal(handle, make_drafter(_drafter(target), handle)) is None
    reason = tree_refusal(handle, LookupDrafter(_drafter(target)))
    assert reason.startswith("trees are drafted by a drafter model or a feature drafter alone, not prompt lookup")


# ------------------------------------------------------------------------------------------ sampling


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    big = expected >= 5  # cells with enough mass; the rest pooled
    observed, wanted = counts[big], expected[big]
    if not bool(big.all()):
        observed = torch.cat([observed, counts[~big].sum()[None]])
        wanted = torch.cat([wanted, expected[~big].sum()[None]])
    return float(chisquare(observed.numpy(), wanted.numpy()).pvalue)


@pytest.mark.parametrize("tree", [TreeConfig(nodes=6, topk=3), None], ids=["tree", "chain"])
def test_sampled_tokens_with_the_feature_drafter_follow_the_target(target, tree):
    """Temperature 1, trees of 6 nodes 3 wide and 2 deep (and chains of 2, the drafter's warped q verified): the
    first new token of 3000 seeded rows against the target's exact distribution, and the second after the commonest
    first (chi-square)."""
    prompt = PROMPTS[0]
    with torch.inference_mode():
        p = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), 0)
    n = 3000
    outs = speculative_generate(target, _drafter(target), [prompt] * n, max_new_tokens=3, gamma=2, kernels="off",
                                tree=tree, temperature=1.0, seed=11, batch_size=250,
                                stop_token_ids=[], ignore_generation_config=True)
    counts = torch.bincount(torch.tensor([o.tokens[0] for o in outs]), minlength=p.numel()).double()
    assert _chi2(counts, p) > 1e-3
    assert sum(o.stats.accepted for o in outs) > n // 4  # the trees' candidates were accepted often
    first = int(counts.argmax())
    seconds = [o.tokens[1] for o in outs if o.tokens[0] == first]
    with torch.inference_mode():
        p2 = torch.softmax(target(torch.tensor([prompt + [first]])).logits[0, -1].double(), 0)
    counts2 = torch.bincount(torch.tensor(seconds), minlength=p.numel()).double()
    assert len(seconds) > 300 and _chi2(counts2, p2) > 1e-3


# ------------------------------------------------------------------------------------------ the command line


def test_generate_tree_with_a_feature_drafter_folder(tmp_path, capsys):
    """``specdec generate --drafter FOLDER --tree 8`` with a feature drafter's folder prints what the chain prints
    (greedy); behind prompt lookup it is refused in one line, exit 2."""
    from tiny_models import save_tiny_pair

    from specdec import cli, load_model
    from specdec.drafters.feature_model import new_feature_drafter

    pair = save_tiny_pair(tmp_path / "pair")
    new_feature_drafter(load_model(str(pair.target)), seed=3).save_pretrained(tmp_path / "fd")
    models = ["--target", str(pair.target), "--max-new-tokens", "12", "--temperature", "0", "--kernels", "off"]
    outputs = []
    for extra in ([], ["--tree", "8"]):
        assert cli.main(["generate", "def add(a, b):", *models, "--drafter", str(tmp_path / "fd"), *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].strip()
    assert cli.main(["generate", "def add(a, b):", *models, "--drafter", f"lookup+{tmp_path / 'fd'}", "--tree",
                     "8"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "not prompt lookup with a model" in err[0], err
