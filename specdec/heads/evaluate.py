"""Offline evaluation of an acceptance head: calibration, and the stop rule simulated on real rounds.

Contract:

- ``build_rounds(target, drafter, records, kind, depth)`` drafts, for every start position ``s`` of
  every record's response (the committed text is ``prompt + x_<s``, the target's own text), ``depth``
  tokens with the drafter exactly as a round does (greedy: argmax; sampling: a draw from q at
  temperature 1, each conditioned on the drafts before it), and verifies them with the target:
  ``RoundData`` holds each draft's acceptance probability (greedy ``1[d_i == argmax p_i]``,
  sampling ``min(1, p_i/q_i)``), the drafter's hidden state behind each draft (what
  ``Proposal.hidden`` carries) and the drafter's top probability (for confidence schedules).
  Both models run once over the whole record, then all starts branch from those caches in one
  batch (dead cache slots masked per row), so a record costs one full pass plus ``depth`` tokens per
  start.
- ``expected_accepted(labels, lengths)``: E[accepted drafts] of rounds that draft ``lengths``:
  ``sum_{i <= L} prod_{j <= i} l_j``, exact for greedy (0/1 labels) and, for sampling, the
  expectation over the verifier's coin flips given the drafts.
- ``simulate``: mean drafted length and tau (= accepted + 1, the recovered or bonus token; docs/design.md)
  per round for constant K and for the head's rule at each threshold. ``walk`` (``walk_counts``) replays greedy
  decoding round by round from the start of each response (greedy speculative decoding commits the
  target's greedy text, so for greedy records the trace is the one a real run makes).
- ``calibration``: predicted vs observed acceptance in bins, the Brier score; ``plot_calibration``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from specdec.compat import cache_kwargs
from specdec.config import ScheduleConfig
from specdec.drafters.base import DraftStep
from specdec.heads.data import Record
from specdec.schedules import _AdaStop


@dataclass
class RoundData:
    """Rounds drafted from every start of some records (S rounds of ``depth`` drafts)."""

    labels: torch.Tensor  # [S, K] acceptance probability of each draft given the drafts before it
    hidden: torch.Tensor  # [S, K, H] float16, drafter state behind draft i (Proposal.hidden)
    q_max: torch.Tensor  # [S, K] drafter's top probability behind draft i
    drafts: torch.Tensor  # [S, K] long, the drafted tokens
    record: torch.Tensor  # [S] long, record index
    start: torch.Tensor  # [S] long, response tokens committed before the round
    room: torch.Tensor  # [S] long, response tokens left (n - s): the round can emit at most this many

    def __len__(self) -> int:
        return self.labels.shape[0]

    @staticmethod
    def cat(parts: list[RoundData]) -> RoundData:
        return RoundData(*(torch.cat([getattr(p, f) for p in parts]) for f in
                           ("labels", "hidden", "q_max", "drafts", "record", "start", "room")))


@torch.no_grad()
def _full_pass(model, ids: torch.Tensor, hidden: bool):
    """One forward over ``ids`` [1, L] with a fresh cache: (logits [L, V] f32, hidden [L, H] | None, cache)."""
    cache = DynamicCache()
    out = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, output_hidden_states=hidden)
    return out.logits[0].float(), out.hidden_states[-1][0].float() if hidden else None, cache


@torch.no_grad()
def _branch(model, cache: DynamicCache, live: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
            fed: int, hidden: bool):
    """Feed ``tokens`` [R, t] after each row's live prefix: ``live`` [R, L] marks the full pass's slots
    a row sees, ``fed`` tokens were already fed to the branch cache (all visible), ``pos`` [R] is the
    first new token's position. -> (logits [R, t, V] f32, hidden [R, t, H] | None)."""
    rows, t = tokens.shape
    mask = torch.cat([live, torch.ones(rows, fed + t, dtype=torch.long, device=live.device)], dim=1)
    position_ids = pos[:, None] + fed + torch.arange(t, device=pos.device)  # [R, t]
    out = model(input_ids=tokens, attention_mask=mask, position_ids=position_ids,
                **cache_kwargs(model, cache), use_cache=True, output_hidden_states=hidden)
    return out.logits.float(), out.hidden_states[-1].float() if hidden else None


def _accept(p: torch.Tensor, q: torch.Tensor, d: torch.Tensor, kind: str) -> torch.Tensor:
    """Acceptance probability of drafts ``d`` [...] under p, q [..., V] (probabilities)."""
    if kind == "greedy":
        return (d == p.argmax(dim=-1)).float()
    pd, qd = p.gather(-1, d[..., None])[..., 0], q.gather(-1, d[..., None])[..., 0]
    return (pd / qd).clamp(max=1.0)


@torch.no_grad()
def record_rounds(target, drafter, record: Record, kind: str, depth: int = 16, chunk: int = 16,
                  generator: torch.Generator | None = None) -> RoundData:
    """Rounds of ``depth`` drafts from every start of one record (see the module docstring)."""
    seq = record.prompt + record.response
    m, n = len(record.prompt), len(record.response)
    dev = drafter.device
    ids = torch.tensor([seq], dtype=torch.long, device=dev)  # [1, L]
    q_full, h_full, d_full_cache = _full_pass(drafter, ids, hidden=True)  # [L, V], [L, H]
    p_full, _, t_full_cache = _full_pass(target, ids.to(target.device), hidden=False)  # [L, V]
    parts = []
    for lo in range(0, n, chunk):
        starts = torch.arange(lo, min(n, lo + chunk), device=dev)  # [R] tokens committed
        rows = len(starts)
        pos = m + starts  # [R] position of draft 1
        live = (torch.arange(len(seq), device=dev)[None] < pos[:, None]).long()  # [R, L]
        q_logits = [q_full[pos - 1]]  # draft 1's q comes from the full pass: [R, V]
        states = [h_full[pos - 1]]  # [R, H]
        drafts = []
        d_cache = copy.deepcopy(d_full_cache)
        d_cache.batch_repeat_interleave(rows)
        for i in range(depth):
            q = q_logits[-1].softmax(-1)  # [R, V]
            d = q.argmax(-1) if kind == "greedy" else torch.multinomial(q, 1, generator=generator)[:, 0]  # [R]
            drafts.append(d)
            if i == depth - 1:
                break
            logits, h = _branch(drafter, d_cache, live, d[:, None], pos, i, hidden=True)  # [R,1,V], [R,1,H]
            q_logits.append(logits[:, 0])
            states.append(h[:, 0])
        d_all = torch.stack(drafts, 1)  # [R, K]
        q_all = torch.stack(q_logits, 1).softmax(-1)  # [R, K, V]
        t_cache = copy.deepcopy(t_full_cache)
        t_cache.batch_repeat_interleave(rows)
        p_rest, _ = _branch(target, t_cache, live.to(target.device), d_all[:, :-1].to(target.device),
                            pos.to(target.device), 0, hidden=False)  # [R, K-1, V]
        p_all = torch.cat([p_full[pos.to(target.device) - 1][:, None], p_rest], 1).softmax(-1).to(dev)  # [R, K, V]
        parts.append(RoundData(
            labels=_accept(p_all, q_all, d_all, kind),
            hidden=torch.stack(states, 1).half().cpu(),
            q_max=q_all.max(-1).values.cpu(),
            drafts=d_all.cpu(),
            record=torch.full((rows,), record.index, dtype=torch.long),
            start=starts.cpu(),
            room=(n - starts).cpu(),
        ))
    return RoundData.cat(parts)


def build_rounds(target, drafter, records: list[Record], kind: str, depth: int = 16, seed: int = 0,
                 progress=None) -> RoundData:
    """``record_rounds`` of several records (sampling draws seeded by ``seed``)."""
    g = torch.Generator(device=drafter.device).manual_seed(seed)
    parts = []
    for i, r in enumerate(records):
        parts.append(record_rounds(target, drafter, r, kind, depth, generator=g))
        if progress is not None:
            progress(i + 1, len(records))
    return RoundData.cat(parts)


def draft_lengths(accept: torch.Tensor, threshold: float, bound: tuple[int, int]) -> torch.Tensor:
    """accept [S, K] (the head's values behind drafts 1..K) -> [S] long: how many tokens each round drafts
    under ``specdec.schedules.Ada``'s rule, asked position by position exactly as in decoding (its
    ``_AdaStop``, fed the precomputed values), capped at MAX and at K."""
    ScheduleConfig("ada", stop_threshold=threshold, bound=bound)  # the CLI's checks and messages
    rows, k = accept.shape
    steps = min(k, bound[1])
    lengths = torch.full((rows,), steps, dtype=torch.long, device=accept.device)  # [S] MAX or K unless stopped
    stop = _AdaStop(lambda values: values, threshold, bound[0], rows, accept.device)
    done = torch.zeros(rows, dtype=torch.bool, device=accept.device)  # [S]
    for i in range(steps):
        step = DraftStep(position=i, tokens=torch.zeros(rows, dtype=torch.long), logits=accept.new_zeros(rows, 0),
                         q=None, hidden=accept[:, i].float(), drafting=~done)
        now = stop(step) & ~done  # [S]
        lengths[now] = i + 1
        done |= now
    return lengths


def expected_accepted(labels: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """labels [S, K], lengths [S] -> [S] expected accepted drafts of rounds drafting ``lengths``."""
    chain = labels.float().cumprod(dim=-1)  # [S, K] P(drafts 1..i all accepted)
    upto = torch.arange(labels.shape[1], device=labels.device)[None] < lengths[:, None]  # [S, K]
    return (chain * upto).sum(-1)


@dataclass(frozen=True)
class Point:
    """One schedule's figures over the rounds."""

    schedule: str  # e.g. "constant K=4" or "ada 0.3"
    drafted: float  # mean drafted tokens per round
    tau: float  # mean tokens per round (accepted + the recovered/bonus one)
    rounds: int  # rounds averaged over


def _point(name: str, labels: torch.Tensor, lengths: torch.Tensor) -> Point:
    acc = expected_accepted(labels, lengths)
    return Point(name, float(lengths.float().mean()), float(acc.mean() + 1), len(lengths))


def head_values(head, rounds: RoundData, batch: int = 65536) -> torch.Tensor:
    """The head's P(accept) behind every draft of every round. [S, K]"""
    flat = rounds.hidden.flatten(0, 1)  # [S*K, H]
    out = torch.cat([head.accept_probability(flat[i : i + batch].float()) for i in range(0, len(flat), batch)])
    return out.view(rounds.hidden.shape[:2])


def simulate(rounds: RoundData, accept: torch.Tensor | None, thresholds=(0.1, 0.3, 0.5, 0.7, 0.9),
             bound: tuple[int, int] = (1, 16), constants=range(1, 9),
             confidence=()) -> list[Point]:
    """Mean drafted length and tau per round (each round from every start, uniformly) for constant K,
    the head's rule (``accept`` [S, K] head values) at each threshold, and transformers' confidence rule
    (stop after a draft whose drafter top probability is below the threshold) at ``confidence``."""
    points = [_point(f"constant K={k}", rounds.labels, torch.full((len(rounds),), k)) for k in constants]
    if accept is not None:
        points += [_point(f"ada {t}", rounds.labels, draft_lengths(accept, t, bound)) for t in thresholds]
    for c in confidence:
        low = rounds.q_max < c  # [S, K]; draft i+1 was drafted from a state whose top probability is below c
        low[:, -1] = True
        points.append(_point(f"confidence {c}", rounds.labels, low.long().argmax(-1) + 1))
    return points


def walk_counts(rounds: RoundData, lengths: torch.Tensor) -> dict[str, int]:
    """Replay greedy decoding: each record from its first response token, round after round, each
    round drafting ``lengths`` [S] (capped by the room left less the verified token) and keeping its
    leading accepted drafts. -> totals over the records: ``rounds``, ``drafted`` and ``emitted`` tokens. Greedy
    labels only:
    greedy speculative decoding commits the target's greedy text, so these are the counts a run makes."""
    index = {(int(r), int(s)): i for i, (r, s) in enumerate(zip(rounds.record, rounds.start))}
    first_reject = torch.where(rounds.labels < 0.5, torch.arange(rounds.labels.shape[1])[None],
                               rounds.labels.shape[1]).min(-1).values  # [S]
    totals = dict.fromkeys(("rounds", "drafted", "emitted"), 0)
    for rec in rounds.record.unique().tolist():
        s = 0
        while (rec, s) in index:
            i = index[(rec, s)]
            k = min(int(lengths[i]), int(rounds.room[i]) - 1)
            a = min(k, int(first_reject[i]))
            totals["rounds"] += 1
            totals["drafted"] += k
            totals["emitted"] += a + 1
            s += a + 1
    return totals


def walk(rounds: RoundData, lengths: torch.Tensor) -> tuple[float, float, int]:
    """``walk_counts`` as (mean drafted per round, tau, rounds)."""
    c = walk_counts(rounds, lengths)
    return c["drafted"] / c["rounds"], c["emitted"] / c["rounds"], c["rounds"]


@dataclass(frozen=True)
class Calibration:
    """Predicted vs observed acceptance."""

    edges: list[float]  # bin edges of the predicted probability
    predicted: list[float]  # mean prediction per bin (nan if empty)
    observed: list[float]  # mean label per bin
    counts: list[int]  # examples per bin
    brier: float  # mean (prediction - label)^2 (with soft labels: against the acceptance probability)
    brier_base: float  # Brier of predicting the overall mean label everywhere
    mean_label: float


def calibration(pred: torch.Tensor, label: torch.Tensor, bins: int = 10) -> Calibration:
    """Bin ``pred`` [N] into ``bins`` equal-width bins; compare with ``label`` [N]."""
    pred, label = pred.float().flatten(), label.float().flatten()
    edges = torch.linspace(0, 1, bins + 1)
    which = torch.bucketize(pred, edges[1:-1])  # [N] bin index
    counts = torch.bincount(which, minlength=bins)
    sums_p = torch.bincount(which, weights=pred, minlength=bins)
    sums_l = torch.bincount(which, weights=label, minlength=bins)
    nan = float("nan")
    mean = float(label.mean())
    return Calibration(
        edges=edges.tolist(),
        predicted=[float(sp / c) if c else nan for sp, c in zip(sums_p, counts)],
        observed=[float(sl / c) if c else nan for sl, c in zip(sums_l, counts)],
        counts=counts.tolist(),
        brier=float(((pred - label) ** 2).mean()),
        brier_base=float(((mean - label) ** 2).mean()),
        mean_label=mean,
    )


def plot_calibration(curves: dict[str, Calibration], path: str, title: str = "acceptance head calibration") -> None:
    """A reliability diagram (observed vs predicted acceptance per bin) of each curve, with its Brier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, hist) = plt.subplots(2, 1, figsize=(6, 7), height_ratios=(3, 1), sharex=True)
    ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--", label="perfect")
    for name, c in curves.items():
        xs = [p for p, n in zip(c.predicted, c.counts) if n]
        ys = [o for o, n in zip(c.observed, c.counts) if n]
        ax.plot(xs, ys, marker="o", label=f"{name} (Brier {c.brier:.3f}, base {c.brier_base:.3f})")
        centers = [(a + b) / 2 for a, b in zip(c.edges[:-1], c.edges[1:])]
        hist.plot(centers, [n / max(1, sum(c.counts)) for n in c.counts], marker=".", label=name)
    ax.set_ylabel("observed acceptance")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    hist.set_xlabel("predicted P(accept)")
    hist.set_ylabel("share of drafts")
    hist.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_rounds(rounds: RoundData, path: str) -> None:
    """Write round data to a safetensors file (reused by later evaluations)."""
    from safetensors.torch import save_file

    save_file({f: getattr(rounds, f).contiguous() for f in
               ("labels", "hidden", "q_max", "drafts", "record", "start", "room")}, path)


def load_rounds(path: str) -> RoundData:
    """Round data written by ``save_rounds``."""
    from safetensors.torch import load_file

    t = load_file(path)
    return RoundData(*(t[f] for f in ("labels", "hidden", "q_max", "drafts", "record", "start", "room")))
