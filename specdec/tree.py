"""Token-tree speculation (SpecInfer, Miao et al. 2024; EAGLE-2, Li et al. 2024): per row, a tree of drafted nodes,
verified by the target in one forward, the longest accepted path committed.

A ``Tree`` holds, per row, up to N nodes below a root (the row's newest committed token): each node's token, its
parent (0 = the root, i = node i - 1, always earlier: parents before children), its depth (1 below the root) and,
optionally, the drafter's q at its parent from which it and its siblings were drawn in turn, without replacement.
``q`` None: deterministic candidates (chosen by any rule, e.g. top-k), each treated as drafted with a one-hot q,
which is lossless whatever chose them (Leviathan et al. 2023, sec. 2.3).

Verification (``verify_tree``): tokens = [root, nodes...] at positions committed length - 1 + depth, each node
attending to the row's cached context and its own ancestors only (``ancestors``; a 4D additive mask,
``RaggedCache.tree_forward``). Acceptance (``accept_tree``), walking from the root:

- greedy rows: accept the child equal to the target's argmax at the parent; the next token is the argmax at the
  last accepted node. Equals the target's greedy decoding.
- sampled rows: multi-candidate rejection sampling (``candidate_chain``): try the children in turn, accepting child
  x with probability min(1, p(x) / q(x)); after a rejection p <- norm(max(0, p - q)) and x is removed from q
  (renormalised); when every child fails, sample the residual p. The output is distributed exactly as p provided
  the children were drawn from q in that order (or q is one-hot per candidate): proof by induction on the number of
  children, each rejection leaving a residual whose remaining procedure outputs it exactly.

Commit: the target's cache (and features, where a feature drafter reads them) keeps the accepted path's entries, in
order (``RaggedCache.reorder_tail``), the rest dropped: cached tokens == committed tokens - 1 again. A model
drafter keeps the path nodes it forwarded (``commit_tree``); a feature drafter drops every tree slot (they read its
own states) and pairs the path's target features with the committed tokens, as after a chain; a drafter with
``draft_tree`` / ``commit_tree`` methods of its own (the parallel drafter) grows and commits its trees itself.
Top-beta/tau: ``relaxed_child``, lossy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.batch import left_mask, left_padded
from specdec.features import features_of, selection
from specdec.sampling import Sampler, check_finite


@dataclass(frozen=True)
class TreeConfig:
    """How a round's tree is grown: at most ``nodes`` per row, each expanded node getting ``topk`` children; its
    depth is the schedule's draft length (gamma) for the row."""

    nodes: int = 16
    topk: int = 4

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.topk < 1:
            raise ValueError(f"a tree needs nodes >= 1 and topk >= 1, got nodes={self.nodes}, topk={self.topk}")


@dataclass(frozen=True)
class Tree:
    """The drafted trees of one round, per row (see the module docstring)."""

    tokens: torch.Tensor  # [B, n] long; row b's nodes are the first sizes[b], the rest padding
    parents: torch.Tensor  # [B, n] long, 0 = the root, i = node i - 1 (earlier in the row)
    depths: torch.Tensor  # [B, n] long, >= 1
    sizes: torch.Tensor  # [B] long
    q: torch.Tensor | None = None  # [B, n, V] the drafter's q at each node's parent; None: deterministic candidates
    calls: int = 0  # drafter forwards spent

    @property
    def n(self) -> int:
        return self.tokens.shape[1]

    def valid(self) -> torch.Tensor:
        """[B, n] bool: the real nodes."""
        return torch.arange(self.n, device=self.tokens.device)[None, :] < self.sizes[:, None]

    @classmethod
    def from_lists(cls, rows: list[list[tuple[int, int]]], device: torch.device | str = "cpu",
                   q: torch.Tensor | None = None) -> Tree:
        """Trees from per-row lists of (token, parent) nodes (parent 0 = root, i = node i - 1)."""
        width = max((len(r) for r in rows), default=0)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        parents = torch.zeros(len(rows), width, dtype=torch.long)
        depths = torch.ones(len(rows), width, dtype=torch.long)
        for b, row in enumerate(rows):
            for i, (token, parent) in enumerate(row):
                if not 0 <= parent <= i:
                    raise ValueError(f"node {i} of row {b} has parent {parent}: parents come before their children")
                tokens[b, i], parents[b, i] = token, parent
                depths[b, i] = 1 if parent == 0 else int(depths[b, parent - 1]) + 1
        sizes = torch.tensor([len(r) for r in rows], dtype=torch.long)
        return cls(tokens.to(device), parents.to(device), depths.to(device), sizes.to(device), q)


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[B, 1+n, 1+n] bool over [root, nodes...]: entry (i, j) when j is i or an ancestor of i. ``parents`` [B, n]."""
    rows, n = parents.shape
    out = torch.zeros(rows, n + 1, n + 1, dtype=torch.bool, device=parents.device)
    out[:, 0, 0] = True
    eye = torch.eye(n + 1, dtype=torch.bool, device=parents.device)
    for i in range(1, n + 1):
        out[:, i] = out[torch.arange(rows), parents[:, i - 1]] | eye[i]
    return out


def children(tree: Tree) -> list[dict[int, list[int]]]:
    """Per row: node (0 = root, i = node i - 1) -> its children, in the tree's order."""
    out = []
    for parents, size in zip(tree.parents.tolist(), tree.sizes.tolist()):
        kids: dict[int, list[int]] = {}
        for i, parent in enumerate(parents[:size]):
            kids.setdefault(parent, []).append(i + 1)
        out.append(kids)
    return out


# ------------------------------------------------------------------------------------------------ acceptance


def candidate_chain(p: torch.Tensor, q: torch.Tensor | None, tokens: list[int]) -> tuple[list[float], torch.Tensor]:
    """Multi-candidate rejection sampling at one node, as numbers: ``p`` [V] the target's distribution, ``q`` [V] the
    drafter's, from which ``tokens`` (distinct) were drawn in turn without replacement (None: deterministic
    candidates, one-hot q each). Returns each candidate's acceptance probability once it is reached, and the residual
    [V] sampled when every candidate fails. Exact: the test enumerates draws against p."""
    p = p.double()
    q = None if q is None else q.double().clone()
    accept = []
    for x in tokens:
        if q is None:
            qx = 1.0
            ratio = float(p[x])
        else:
            qx = float(q[x])
            ratio = 1.0 if qx <= 0.0 else min(1.0, float(p[x]) / qx)
        accept.append(ratio)
        if ratio >= 1.0:
            break  # never rejected: the later candidates are never tried
        if q is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - q).clamp_min(0.0)
        total = float(residual.sum())
        p = residual / total if total > 0.0 else p  # total 0: p == q (rounding), rejection has probability ~0
        if q is not None:
            q[x] = 0.0
            left = float(q.sum())
            q = q / left if left > 0.0 else q
    return accept, p


def _uniform(sampler: Sampler, row: int) -> float:
    generator = sampler.generators[row if len(sampler.generators) > 1 else 0]
    return float(torch.rand((), generator=generator, device=generator.device))


def sample_node(p: torch.Tensor, q: torch.Tensor | None, tokens: list[int], sampler: Sampler,
                row: int) -> tuple[int, int]:
    """One node's multi-candidate rejection sampling with row ``row``'s generator: (index of the accepted candidate,
    or -1, and the token: the candidate's, or a sample of the residual)."""
    accept, residual = candidate_chain(p, q, tokens)
    for i, a in enumerate(accept):
        if _uniform(sampler, row) < a:
            return i, tokens[i]
    cdf = residual.cumsum(0)
    u = _uniform(sampler, row) * float(cdf[-1])
    return -1, int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True).clamp_max(len(cdf) - 1))


def relaxed_child(scores: torch.Tensor, below: list[int], tokens: list[int], config) -> int | None:
    """SpecDec's top-beta/tau rule (``specdec.acceptance.top_beta_tau``) at one node of a greedy row: of the children
    ``below`` (node numbers; ``tokens[c - 1]`` their tokens) whose token is among the target's top ``config.beta``
    (``scores`` [V] its logits: a stable descending rank) within ``config.tau`` of its best logit, the one the target
    ranks highest, or None. Beta 1: the child of the target's argmax, as exact greedy verification."""
    ids = torch.arange(scores.shape[0], device=scores.device)
    top = float(scores.max())
    passing = []
    for c in below:
        x = tokens[c - 1]
        mine = scores[x]
        rank = int(((scores > mine) | ((scores == mine) & (ids < x))).sum())
        if rank < config.beta and (config.tau is None or top - float(mine) <= config.tau):
            passing.append((rank, c))
    return min(passing)[1] if passing else None


def accept_tree(tree: Tree, logits: torch.Tensor, sampler: Sampler, relaxed=None) -> tuple[list[list[int]], list[int]]:
    """Walk each row's tree from the root: ``logits`` [B, 1+n, V] the target's at [root, nodes...]. Returns per row
    the accepted path (node numbers, 1-based: node i - 1 of ``tree``) and the next token (recovered or bonus).
    ``relaxed`` (a ``VerifyConfig`` asking for top-beta/tau, or None): greedy rows take ``relaxed_child``, lossy."""
    kids = children(tree)
    tokens = tree.tokens.tolist()
    best = logits.argmax(dim=-1).tolist()  # [B, 1+n]
    greedy = [c.greedy for c in sampler.configs]
    probs = None if all(greedy) else sampler.probs(logits)
    paths, nexts = [], []
    for b in range(logits.shape[0]):
        node, path = 0, []
        while True:
            below = kids[b].get(node, [])
            if greedy[b] and relaxed is not None:
                pick = relaxed_child(logits[b, node].float(), below, tokens[b], relaxed)
                token = best[b][node]
            elif greedy[b]:
                pick = next((c for c in below if tokens[b][c - 1] == best[b][node]), None)
                token = best[b][node]
            else:
                q = None if tree.q is None or not below else tree.q[b, below[0] - 1]
                i, token = sample_node(probs[b, node], q, [tokens[b][c - 1] for c in below], sampler, b)
                pick = below[i] if i >= 0 else None
            if pick is None:
                break
            path.append(pick)
            node = pick
        paths.append(path)
        nexts.append(token)
    return paths, nexts


def path_order(paths: list[list[int]], width: int, device: torch.device | str) -> torch.Tensor:
    """[B, width]: a permutation of 0..width-1 per row with ``paths[b]`` first, the others after in order."""
    out = []
    for path in paths:
        chosen = set(path)
        out.append(path + [i for i in range(width) if i not in chosen])
    return torch.tensor(out, dtype=torch.long, device=device)


# ------------------------------------------------------------------------------------------------ the target


def verify_tree(target, last: torch.Tensor, tree: Tree) -> torch.Tensor:
    """The target's logits [B, 1+n, V] at [root (``last`` [B]), nodes...], from one forward over each row's tree."""
    cache = target.cache
    tokens = torch.cat([last[:, None], tree.tokens], dim=1)  # [B, 1+n]
    valid = torch.cat([torch.ones_like(last[:, None], dtype=torch.bool), tree.valid()], dim=1)
    depths = torch.cat([torch.zeros_like(last[:, None]), tree.depths], dim=1)
    target._mark = cache.live.clone()
    positions = cache.live[:, None] + depths  # the root at the row's committed length - 1
    layers = getattr(target, "feature_layers", None)  # a feature drafter reads them (``ModelTarget.want_features``)
    asked = {} if layers is None else {"output_hidden_states": selection(layers)}
    out = cache.tree_forward(tokens, valid, positions, ancestors(tree.parents), **asked)
    if layers is not None:  # every node's, kept along the accepted path by ``commit_target``
        target._verified = features_of(out.hidden_states, layers, type(target.model).__name__)
    return out.logits


def commit_target(target, paths: list[list[int]], width: int) -> None:
    """Keep the root and each row's accepted path in the target's cache, in order (``width`` = 1 + n slots), and,
    where it captures features, the same positions' features in its log (as a chain's ``rollback`` keeps them)."""
    order = path_order([[0, *path] for path in paths], width, target.device)
    keep = torch.tensor([len(p) + 1 for p in paths], dtype=torch.long, device=target.device)
    target.cache.reorder_tail(order, target._mark + keep)
    target._mark = None
    verified = getattr(target, "_verified", None)
    if verified is not None:
        target.features.extend(verified.gather(1, order[:, :, None].expand(-1, -1, verified.shape[2])), keep)
        target._verified = None


def tree_refusal(target, drafter) -> str | None:
    """Why this pair cannot decode with trees here, or None."""
    from specdec.cache import RaggedCache
    from specdec.drafters.feature import FeatureDrafter
    from specdec.drafters.model import ModelDrafter

    if type(drafter) not in (ModelDrafter, FeatureDrafter) and not callable(getattr(drafter, "draft_tree", None)):
        kinds = {"LookupDrafter": "prompt lookup with a model (the default, lookup+NAME)", "NgramDrafter":
                 "prompt lookup (ngram)", "BlockDrafter": "a block drafter"}
        given = kinds.get(type(drafter).__name__, type(drafter).__name__)
        return (f"trees are drafted by a drafter model or a feature drafter alone, not {given}: pass --drafter "
                "code-drafter (or a model or feature drafter folder)")
    for who, cache in (("target", getattr(target, "cache", None)), ("drafter", drafter.cache)):
        if type(cache) is not RaggedCache:
            return f"the {who}'s cache ({type(cache).__name__}) is not the eager RaggedCache trees need"
        if (reason := cache.tree_refusal()) is not None:
            return reason
    return None


# ------------------------------------------------------------------------------------------------ the drafter


def _reads_features(drafter) -> bool:
    """Whether ``drafter`` is a feature drafter (EAGLE-3 style: its tree grows from the target's features)."""
    from specdec.drafters.feature import FeatureDrafter

    return isinstance(drafter, FeatureDrafter)


def draft_tree(drafter, depth: list[int], config: TreeConfig) -> Tree:
    """Grow each row's tree to at most ``depth[b]`` levels, from the drafter's pending tokens (forwarded first, as a
    chain proposal does). The drafter remembers the forwarded nodes' slots for ``commit_tree``.

    A ModelDrafter's or a FeatureDrafter's tree, EAGLE-2's way: depth by depth, the ``topk`` most
    probable nodes of the depth (by cumulative drafter probability) are forwarded (one drafter forward per depth, a
    tree mask again; a feature drafter's node reads its parent's output state, the root's from the target's features)
    and each gets its ``topk`` most probable children; the best ``nodes`` of all form the tree (a child never beats
    its parent: closed under ancestors), its candidates deterministic (``q`` None: chosen by their own probability).
    """
    features = _reads_features(drafter)
    if features:  # a row with no (feature, token) pair yet (a one-token prompt) drafts nothing this round
        depth = [d if pairs else 0 for d, pairs in zip(depth, drafter.tokens)]
    rows, device, k = len(depth), drafter.device, config.topk
    levels = max(depth, default=0)
    if levels == 0:
        drafter._tree = None
        drafter._drafts = [[] for _ in range(rows)]
        empty = torch.zeros(rows, 0, dtype=torch.long, device=device)
        return Tree(empty, empty, empty, torch.zeros(rows, dtype=torch.long, device=device))
    if features:  # the root's logits and output state [B, H], from the target's features of the committed prefix
        logits, root = drafter.catch_up()
        check_finite(logits, "drafter", torch.tensor(depth, device=device) > 0)
    else:
        ids, counts = left_padded(drafter.pending, device)
        valid = None if len({len(p) for p in drafter.pending}) == 1 else left_mask(counts, ids.shape[1])
        logits, _ = drafter._step(ids, valid, False)  # [B, V] at the root
        drafter._mark, drafter.pending = drafter.cache.live.clone(), [[] for _ in range(rows)]
    allowed = torch.tensor(depth, device=device)  # [B] levels per row
    ninf = torch.tensor(float("-inf"), device=device)
    value, token = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [B, k]
    values, tokens = [value], [token]
    parents = [torch.full((rows, k), -1, dtype=torch.long, device=device)]  # global node numbers, -1 = root
    levels_of = [torch.ones(rows, k, dtype=torch.long, device=device)]
    fed_nodes: list[torch.Tensor] = []  # per forwarded level: the global nodes forwarded [B, f]
    fed_live: list[torch.Tensor] = []  # and which of them went in live [B, f] (the others are dead slots)
    cap = k + (levels - 1) * k * k
    anc = torch.zeros(rows, cap, cap, dtype=torch.bool, device=device)  # node -> its ancestors and itself
    anc[:, torch.arange(k), torch.arange(k)] = True
    if features:  # each forwarded node's output state, which its children's forward reads
        states = root.new_zeros(rows, cap, root.shape[-1])
    start, calls = 0, 1
    for level in range(1, levels):
        here = torch.cat(values, dim=1)[:, start:]  # [B, c] the nodes of this level
        f = min(k, here.shape[1])
        fv, fi = here.topk(f, dim=-1)  # [B, f]
        frontier = start + fi  # global numbers
        live = torch.isfinite(fv) & (allowed > level)[:, None]  # rows allowed a level below
        if not bool(live.any()):
            break
        fed = torch.cat([*fed_nodes, frontier], dim=1)  # [B, W] the nodes with slots in this round's tail
        rows_of = anc.gather(1, frontier[:, :, None].expand(rows, f, cap))  # [B, f, cap] each frontier node's
        sees = rows_of.gather(2, fed[:, None, :].expand(rows, f, fed.shape[1]))  # [B, f, W] its ancestors with slots
        fed_nodes.append(frontier)
        fed_live.append(live)
        ids = torch.cat(tokens, dim=1).gather(1, frontier)
        positions = (drafter._mark[:, None] + level - 1).expand(rows, f)  # the root at live - 1: level 1 at live
        if features:  # a node reads its parent's output state (the root's: from the target's features)
            up = torch.cat(parents, dim=1).gather(1, frontier)  # [B, f] global, -1 = the root
            fed_states = torch.where((up < 0)[:, :, None], root[:, None, :],
                                     states.gather(1, up.clamp_min(0)[:, :, None].expand(-1, -1, states.shape[2])))
            out = drafter.cache.tree_forward(ids, live, positions, sees, hidden=fed_states)
            states.scatter_(1, frontier[:, :, None].expand(-1, -1, states.shape[2]), out.hidden.to(states.dtype))
            child = out.logits
        else:
            out = drafter.cache.tree_forward(drafter._ids(ids), live, positions, sees)
            child = drafter._aligned(out.logits)
        calls += 1
        check_finite(child, "drafter", live)
        child = torch.log_softmax(child.float(), dim=-1)  # [B, f, V]
        cv, ct = child.topk(k, dim=-1)  # [B, f, k]
        value = torch.where(live[:, :, None], fv[:, :, None] + cv, ninf).reshape(rows, f * k)
        start = sum(v.shape[1] for v in values)
        number = start + torch.arange(f * k, device=device)
        values.append(value)
        tokens.append(ct.reshape(rows, f * k))
        parent = frontier[:, :, None].expand(rows, f, k).reshape(rows, f * k)
        parents.append(parent)
        levels_of.append(torch.full((rows, f * k), level + 1, dtype=torch.long, device=device))
        anc[:, number] = anc.gather(1, parent[:, :, None].expand(rows, f * k, cap))
        anc[:, number, number] = True
    value = torch.cat(values, dim=1)  # [B, M] in creation order: parents first
    total = value.shape[1]
    first = torch.where(torch.cat(levels_of, dim=1) <= allowed[:, None], value, ninf)
    order = torch.sort(-first, dim=1, stable=True).indices[:, : config.nodes]  # best first, parents before ties
    kept = torch.sort(order, dim=1).values  # creation order again: parents before children
    finite = torch.isfinite(first.gather(1, kept))
    sizes = finite.sum(dim=1)
    kept = torch.where(finite, kept, total)  # padding sorts last
    kept = torch.sort(kept, dim=1).values
    safe = kept.clamp_max(total - 1)
    local = torch.zeros(rows, total + 1, dtype=torch.long, device=device)  # global -> 1-based node, root 0
    local.scatter_(1, kept, torch.arange(1, kept.shape[1] + 1, device=device).expand_as(kept))
    parent = torch.cat(parents, dim=1).gather(1, safe)
    tree_parents = torch.where(parent < 0, 0, local.gather(1, parent.clamp_min(0)))
    real = torch.arange(kept.shape[1], device=device)[None, :] < sizes[:, None]
    tree = Tree(torch.where(real, torch.cat(tokens, dim=1).gather(1, safe), 0), torch.where(real, tree_parents, 0),
                torch.where(real, torch.cat(levels_of, dim=1).gather(1, safe), 1), sizes, calls=calls)
    slot = torch.full((rows, total), -1, dtype=torch.long, device=device)  # global node -> its tail slot
    if fed_nodes:
        fed = torch.cat(fed_nodes, dim=1)
        numbers = torch.arange(fed.shape[1], device=device).expand_as(fed)
        slot.scatter_(1, fed, torch.where(torch.cat(fed_live, dim=1), numbers, -1))
    drafter._tree = (slot.gather(1, safe), sum(x.shape[1] for x in fed_nodes))
    drafter._drafts = [[] for _ in range(rows)]
    return tree


def commit_tree(drafter, tree: Tree, paths: list[list[int]], next_tokens: list[int]) -> None:
    """The drafter keeps, of the nodes it forwarded, the leading ones of each row's accepted path (in order); the
    rest of the committed tokens (and the next token) wait as pending."""
    tokens = tree.tokens.tolist()
    committed = [[tokens[b][i - 1] for i in path] + [t] for b, (path, t) in enumerate(zip(paths, next_tokens))]
    if _reads_features(drafter):  # every tree slot read the drafter's own states: dropped, as a chain's drafts are;
        drafter._tree = None      # the path's target features pair with the committed tokens (``follow``)
        drafter.follow(committed)
        return
    reach = drafter._grown(committed)
    state, drafter._tree = drafter._tree, None
    if state is None:
        drafter.pending = [p + c if ok else [] for p, c, ok in zip(drafter.pending, committed, reach)]
        return
    slots, width = state
    slots = slots.tolist()
    kept = []
    for b, path in enumerate(paths):
        run = []
        for i in path:
            if slots[b][i - 1] < 0:
                break
            run.append(slots[b][i - 1])
        kept.append(run)
    if width:
        keep = torch.tensor([len(r) for r in kept], dtype=torch.long, device=drafter.device)
        drafter.cache.reorder_tail(path_order(kept, width, drafter.device), drafter._mark + keep)
    else:
        drafter.cache.keep(drafter._mark)
    drafter.pending = [c[len(r):] if ok else [] for c, r, ok in zip(committed, kept, reach)]
    drafter._mark = None


# ------------------------------------------------------------------------------------------------ the round


def tree_round(decoder) -> None:
    """One round of ``decoder`` (a ``specdec.decode.Decoder`` with ``tree`` set) with trees: propose a tree per row
    (its depth the schedule's limit within the row's room), verify it in one target forward, accept the longest
    path, commit it to both caches and the rows. The schedule and the rows' figures see a chain: drafted = the
    tree's depth, accepted = the path's length."""
    from specdec.acceptance import Verdict
    from specdec.drafters.base import Proposal
    from specdec.events import ACCEPT, COMMIT, PROPOSE, VERIFY, RoundSummary

    device = decoder.device
    with decoder.events.phase(PROPOSE):
        plan = decoder.schedule.plan(len(decoder.rows), device)
        decoder.admission.seat_drafter(plan, decoder.rows)
        out = decoder.admission.drafter_out
        budget = decoder._budget(plan.width)
        depth = [0 if out else min(n, most) for n, most in zip(plan.limit.tolist(), budget)]
        if not out:
            if hasattr(decoder.drafter, "_within_room"):  # a feature drafter's positions are the target's, capped
                _, depth = decoder.drafter._within_room(torch.tensor(depth, dtype=torch.long, device=device))
            own = getattr(decoder.drafter, "draft_tree", None)  # a drafter that grows its own trees
            tree = own(depth, decoder.tree) if own else draft_tree(decoder.drafter, depth, decoder.tree)
        else:
            empty = torch.zeros(len(decoder.rows), 0, dtype=torch.long, device=device)
            tree = Tree(empty, empty, empty, torch.zeros(len(decoder.rows), dtype=torch.long, device=device))
    with decoder.events.phase(VERIFY):
        logits = verify_tree(decoder.target, decoder.last, tree)  # [B, 1+n, V]
    with decoder.events.phase(ACCEPT):
        rule = decoder.verifier.config  # SpecDec's top-beta/tau where asked (greedy rows only: refused otherwise)
        paths, nexts = accept_tree(tree, logits, decoder.sampler, rule if rule.relaxed else None)
    with decoder.events.phase(COMMIT):
        commit_target(decoder.target, paths, tree.n + 1)
        if not out:
            if hasattr(decoder.drafter, "commit_tree"):
                decoder.drafter.commit_tree(tree, paths, nexts)
            else:
                commit_tree(decoder.drafter, tree, paths, nexts)
        tokens = tree.tokens.tolist()
        lists = [[tokens[b][i - 1] for i in path] for b, path in enumerate(paths)]
        drafted = tree.depths.masked_fill(~tree.valid(), 0).amax(dim=1) if tree.n else tree.sizes
        width = max(max((len(p) for p in paths), default=0), 1)
        padded = torch.tensor([p + [0] * (width - len(p)) for p in lists], dtype=torch.long, device=device)
        proposal = Proposal(padded, drafted, calls=tree.calls).knowing(lists)
        verdict = Verdict(torch.tensor([len(p) for p in paths], dtype=torch.long, device=device),
                          torch.tensor(nexts, dtype=torch.long, device=device))
        index = torch.tensor([[0, *p] + [0] * (width - len(p)) for p in paths], dtype=torch.long, device=device)
        path_logits = logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1]))  # [B, width+1, V]
        decoder.schedule.update(proposal, verdict)
        decoder.last = verdict.next_token
        counts = decoder._commit_rows(proposal, verdict, path_logits)
    decoder.events.round_ended(RoundSummary(len(decoder.rows), counts[0], counts[2], decoder.clock.round_seconds,
                                            counts[1], proposal.calls))
