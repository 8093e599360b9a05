"""The methods a benchmark compares, as runner objects behind one registry.

A runner turns (prompt ids, setting) into a ``RunOutput``: the new tokens plus what it can say
about rounds, drafts and time. The harness (:mod:`specdec.bench.harness`) times every call with
the same clock and counts forward passes with the same hooks, so a runner only generates.

Methods (``RUNNERS``; ``group`` lets ``--methods hf-assisted`` pick both assisted variants):

- ``plain-hf``: the target's own ``generate``: the baseline every speedup is divided by.
- ``plain``: our ``autoregressive_generate``.
- ``spec``: our ``speculative_generate`` with the drafter model.
- ``spec@<label>``: the same with another drafter model (``--compare``), so drafters are compared
  in one run, prompt by prompt (:func:`compared_runners`); ``spec-lookup@<label>`` likewise where
  ``spec-lookup`` runs.
- ``ngram``: our ``speculative_generate`` with the prompt-lookup drafter.
- ``spec-lookup``: ours with ``LookupDrafter``: prompt lookup first (up to 12 copied tokens),
  the drafter model (gamma tokens) when lookup finds nothing; no theoretical speedup (no fixed gamma).
- ``spec-tree<N>`` (``--trees``, :func:`tree_runners`): ``spec`` drafting a token tree of N nodes a round.
- ``spec-heuristic``, ``spec-confidence``, ``spec-ada`` (``--schedules``, :func:`scheduled_runners`):
  ``spec`` with a schedule deciding each round's length instead of a constant gamma
  (``specdec.schedules``, default bound 1..16): the +2/-1 heuristic from transformers' 20 tokens,
  the drafter-confidence stop, SpecDec++'s acceptance head (the drafter's ``acceptance_head/`` and
  its stored threshold); run once per temperature.
- ``hf-assisted``: ``generate(assistant_model=drafter)`` with our gamma as a constant schedule
  (``num_assistant_tokens=gamma``, ``num_assistant_tokens_schedule="constant"``, the confidence
  stop off), and ``hf-assisted-default``: the same with transformers' own defaults. The better of
  the two is reported as the peer.
- ``hf-prompt-lookup``: ``generate(prompt_lookup_num_tokens=gamma)``.

``transformers`` returns no metrics, so for its assisted generation the rounds are the target
forwards (each verifies one draft and emits accepted + 1 tokens), the drafted tokens are the
drafter forwards (one per drafted token), and accepted = tokens - rounds: derived, not reported.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

import torch
from transformers import PreTrainedModel

import specdec
from specdec.bench.measure import ForwardMeter
from specdec.bench.peers import PEERS, Peer, PeerEngine, check_peers, expand_peers
from specdec.config import LOOKUP, DrafterConfig
from specdec.drafters import Drafter, drafter_in, make_drafter
from specdec.drafters.hybrid import LOOKUP_NGRAM
from specdec.kernels import decoding_cores
from specdec.stats import GenerationStats
from specdec.target import make_target


@dataclass(frozen=True)
class Setting:
    """One point of the benchmark grid; every method at a point sees the same values."""

    temperature: float  # 0 = greedy
    gamma: int | None  # tokens drafted per round; None for methods that draft nothing or choose
    top_k: int  # 0 = off
    top_p: float  # 1.0 = off
    max_new_tokens: int  # generation budget per prompt
    seed: int  # sampling seed, the same for every method and repeat

    @property
    def greedy(self) -> bool:
        """True for argmax decoding, where outputs must equal plain-hf token for token."""
        return self.temperature == 0.0


@dataclass
class BenchModels:
    """The models and stop tokens shared by every runner of a run."""

    target: PreTrainedModel
    drafter: PreTrainedModel | None  # None when no selected method needs a drafter model
    stop_token_ids: list[int]  # the target's end-of-sequence ids, passed to every method
    compared: dict[str, PreTrainedModel] = field(default_factory=dict)  # label -> drafter of spec@label
    forms: dict[str, str] = field(default_factory=dict)  # label -> the form its drafter is in (drafter_dtype)
    form: str = "auto"  # the form the drafter is in (specdec.drafters.model.drafter_in)
    source: PreTrainedModel | None = None  # the drafter as loaded: behind lookup, auto may keep this form
    compared_sources: dict[str, PreTrainedModel] = field(default_factory=dict)  # label -> its drafter as loaded

    def drafter_for(self, runner: Runner) -> PreTrainedModel | None:
        """The drafter model a runner drafts with: its compared drafter, else the drafter (each behind prompt lookup
        in the form auto's rule gives there)."""
        label = drafter_label(runner)
        lookup = getattr(runner, "kind", None) == "lookup+model"
        if label is not None:
            if lookup and label in self.compared_sources:
                return drafter_in(self.compared_sources[label], self.forms.get(label, "auto"), lookup=True)
            return self.compared[label]
        if self.source is not None and lookup:  # auto's rule behind lookup
            return drafter_in(self.source, self.form, lookup=True)
        return self.drafter

    def form_for(self, runner: Runner) -> str:
        """The form of the drafter model a runner drafts with (what make_drafter is asked for: no conversion)."""
        label = drafter_label(runner)
        return self.forms.get(label, "auto") if label is not None else self.form


def drafter_label(runner: Runner) -> str | None:
    """The label of the compared drafter a runner drafts with (``spec@<label>``); None for the others."""
    return getattr(runner, "drafter_label", None)


@dataclass(frozen=True)
class Meters:
    """Forward meters attached by the harness around one run."""

    target: ForwardMeter
    drafter: ForwardMeter | None  # None when no drafter model is loaded


@dataclass(frozen=True)
class RunOutput:
    """What one generate call produced and what it can tell about its rounds."""

    tokens: list[int]  # new tokens only
    rounds: int  # rounds (plain decoding: one per token)
    target_time_s: float  # time inside target forwards
    drafter_time_s: float  # time inside drafting (0.0 for plain decoding)
    drafted: int | None = None  # draft tokens proposed; None when the method cannot tell
    accepted: int | None = None  # draft tokens accepted; None when the method cannot tell
    accepted_per_position: list[int] | None = None  # [i]: rounds whose draft i was accepted
    drafted_per_position: list[int] | None = None  # [i]: rounds that drafted a token at i


class DrafterCost(enum.Enum):
    """Where the cost ratio c of the Leviathan et al. formula comes from for a method."""

    NONE = "none"  # no drafter, or drafts without a fixed gamma: no theoretical speedup
    MODEL_STEP = "model_step"  # the drafter model's single-token step / the target's
    MEASURED_DRAFT = "measured_draft"  # drafting seconds per round (from the run) / (gamma x target step)
    UNKNOWN_ALPHA = "unknown_alpha"  # drafts exist but the method does not report them


class Runner(Protocol):
    """One benchmarked method."""

    name: str  # the method's name in records and tables
    description: str  # one line for --list
    group: str  # --methods accepts a group to select all its runners
    uses_gamma: bool  # run once per gamma of the sweep (else once per temperature)
    speculative: bool  # records carry SpecDec++'s spec_time (else target_time)
    needs_drafter_model: bool  # the drafter model must be loaded (and its weights count as extra memory)
    cost: DrafterCost  # how c is obtained for the theoretical speedup

    def run(self, models: BenchModels, input_ids: torch.Tensor, setting: Setting, meters: Meters) -> RunOutput:
        """Generate for one prompt (`input_ids` [T]) and describe the run."""
        ...


def _from_stats(tokens: list[int], stats: GenerationStats) -> RunOutput:
    return RunOutput(
        tokens=list(tokens),
        rounds=stats.rounds,
        target_time_s=stats.target_time_s,
        drafter_time_s=stats.drafter_time_s,
        drafted=stats.drafted,
        accepted=stats.accepted,
        accepted_per_position=list(stats.accepted_per_position),
        drafted_per_position=list(stats.drafted_per_position),
    )


def _hf_kwargs(models: BenchModels, input_ids: torch.Tensor, setting: Setting) -> dict:
    """Arguments of `generate` matching our API's semantics (top_k=0 must be explicit: HF's default is 50)."""
    ids = input_ids.to(models.target.device)[None]  # [1, T]
    kwargs: dict = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": setting.max_new_tokens,
        "eos_token_id": models.stop_token_ids or None,
        "pad_token_id": (models.stop_token_ids or [0])[0],
        "do_sample": not setting.greedy,
    }
    if setting.greedy:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    else:
        torch.manual_seed(setting.seed)
        kwargs.update(temperature=setting.temperature, top_k=setting.top_k, top_p=setting.top_p)
    return kwargs


def _hf_output(out: torch.Tensor, input_ids: torch.Tensor, meters: Meters) -> RunOutput:
    tokens = out[0, input_ids.numel() :].tolist()
    drafter = meters.drafter
    return RunOutput(
        tokens=tokens,
        rounds=meters.target.calls,
        target_time_s=meters.target.seconds,
        drafter_time_s=drafter.seconds if drafter else 0.0,
    )


@contextmanager
def _assistant_config(drafter: PreTrainedModel, **overrides: object) -> Iterator[None]:
    """Temporarily set fields of the drafter's generation config (where transformers reads them)."""
    saved = drafter.generation_config
    drafter.generation_config = copy.deepcopy(saved)
    for key, value in overrides.items():
        setattr(drafter.generation_config, key, value)
    try:
        yield
    finally:
        drafter.generation_config = saved


class PlainHF:
    """The target's own `generate`: the baseline."""

    name = group = "plain-hf"
    description = "the target's own generate(): the baseline every speedup is divided by"
    uses_gamma = speculative = needs_drafter_model = False
    cost = DrafterCost.NONE

    @torch.inference_mode()
    def run(self, models: BenchModels, input_ids: torch.Tensor, setting: Setting, meters: Meters) -> RunOutput:
        out = models.target.generate(**_hf_kwargs(models, input_ids, setting))
        return _hf_output(out, input_ids, meters)


def _decode_kwargs(models: BenchModels, setting: Setting) -> dict:
    """The keyword arguments our two loops share: length, sampling, stops and seed."""
    return {
        "max_new_tokens": setting.max_new_tokens,
        "temperature": setting.temperature,
        "top_k": setting.top_k,
        "top_p": setting.top_p,
        "stop_token_ids": models.stop_token_ids,
        "seed": setting.seed,
    }


class Plain:
    """Our `autoregressive_generate`."""

    name = group = "plain"
    description = "our autoregressive_generate"
    uses_gamma = speculative = needs_drafter_model = False
    cost = DrafterCost.NONE

    def run(self, models: BenchModels, input_ids: torch.Tensor, setting: Setting, meters: Meters) -> RunOutput:
        res = specdec.autoregressive_generate(models.target, input_ids, **_decode_kwargs(models, setting))
        return _from_stats(res.tokens, res.stats)


class Speculative:
    """Our `speculative_generate` with a drafter: the model (`spec`), prompt lookup (`ngram`), or
    lookup first and the model when lookup finds nothing (`spec-lookup`)."""

    uses_gamma = speculative = True
    KINDS: ClassVar[dict[str, str]] = {
        "model": "the drafter model",
        "ngram": "the prompt-lookup (n-gram) drafter",
        "lookup+model": f"prompt lookup first (up to {LOOKUP_NGRAM.num_tokens} tokens), the drafter model (gamma) when "
                        "lookup finds nothing",
    }

    def __init__(self, name: str, kind: str, drafter_label: str | None = None) -> None:
        self.name = self.group = name
        self.kind = kind
        self.drafter_label = drafter_label  # None: the run's drafter; else a compared drafter's label
        what = self.KINDS[kind] if drafter_label is None else f"the compared drafter model {drafter_label!r}"
        self.description = f"our speculative_generate with {what}"
        self.needs_drafter_model = kind != "ngram"
        # lookup+model drafts up to LOOKUP_NGRAM.num_tokens copied tokens or gamma from the model: no fixed gamma
        self.cost = {"model": DrafterCost.MODEL_STEP, "ngram": DrafterCost.MEASURED_DRAFT}.get(kind, DrafterCost.NONE)

    def _drafter(self, models: BenchModels) -> Drafter:
        """The drafter of this method, from the one factory (the loaded drafter model stands for its name)."""
        name = {"model": "model", "ngram": "ngram", "lookup+model": f"{LOOKUP}model"}[self.kind]
        target = make_target(models.target)
        return make_drafter(DrafterConfig(name, dtype=models.form_for(self)), target,
                            loader=lambda _: models.drafter_for(self))

    def run(self, models: BenchModels, input_ids: torch.Tensor, setting: Setting, meters: Meters) -> RunOutput:
        assert setting.gamma is not None
        res = specdec.speculative_generate(
            models.target,
            self._drafter(models),
            input_ids,
            gamma=setting.gamma,
            **_decode_kwargs(models, setting),
        )
        return _from_stats(res.tokens, res.stats)


HEURISTIC_START = 20  # transformers' num_assistant_tokens default: where the heuristic schedule starts


class Scheduled(Speculative):
    """``spec`` with a schedule (heuristic, confidence, ada) choosing each round's draft length."""

    uses_gamma = False

    def __init__(self, schedule: str) -> None:
        super().__init__(f"spec-{schedule}", "model")
        self.schedule = schedule
        self.description = f"our speculative_generate with the drafter model, the {schedule} schedule (bound 1..16)"
        self.cost = DrafterCost.NONE  # no fixed gamma

    def run(self, models: BenchModels, input_ids: torch.Tensor, setting: Setting, meters: Meters) -> RunOutput:
        res = specdec.speculative_generate(
            models.target,
            self._drafter(models),
            input_ids,
            gamma=HEURISTIC_START,  # read by the heuristic only (capped by the bound's MAX)
            schedule=self.schedule,
            **_decode_kwargs(models, setting),
        )
        return _from_stats(res.tokens, res.stats)


class Treed(Speculative):
    """``spec`` drafting a token tree of ``nodes`` nodes per round, gamma deep (``specdec.tree``)."""

    def __init__(self, nodes: int) -> None:
        super().__init__(f"spec-tree{nodes}", "model")
        self.nodes = nodes
        self.description = f"our speculative_generate with the drafter model, a token tree of {nodes} nodes a round"
        self.cost = DrafterCost.NONE  # a tree's drafter forwards carry several tokens each

    def run(self, models: BenchModels, input_ids: torch.Tensor, setting: Setting, meters: Meters) -> RunOutput:
        assert setting.gamma is not None
        res = specdec.speculative_generate(models.target, self._drafter(models), input_ids, gamma=setting.gamma,
                                           tree=self.nodes, **_decode_kwargs(models, setting))
        return _from_stats(res.tokens, res.stats)


class HFAssisted:
    """transformers' assisted generation with the drafter model, with our gamma or its defaults."""

    group = "hf-assisted"
    speculative = needs_drafter_model = True

    def __init__(self, name: str, our_gamma: bool) -> None:
        self.name = name
        self.uses_gamma = our_gamma
        schedule = "our gamma, constant schedule, no confidence stop" if our_gamma else "transformers' defaults"
        self.description = f"generate(assistant_model=drafter), {schedule}"
        self.cost = DrafterCost.MODEL_STEP if our_gamma else DrafterCost.NONE

    @torch.inference_mode()
    def run(self, models: BenchModels, input_ids: torch.Tensor, setting: Setting, meters: Meters) -> RunOutput:
        assert models.drafter is not None
        overrides: dict[str, object] = {}
        if self.uses_gamma:
            overrides = {
                "num_assistant_tokens": setting.gamma,
                "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0,
            }
        with _assistant_config(models.drafter, **overrides):
            out = models.target.generate(
                **_hf_kwargs(models, input_ids, setting), assistant_model=models.drafter
            )
        run = _hf_output(out, input_ids, meters)
        assert meters.drafter is not None
        drafted = meters.drafter.calls  # one drafter forward per drafted token
        return RunOutput(
            tokens=run.tokens,
            rounds=run.rounds,
            target_time_s=run.target_time_s,
            drafter_time_s=run.drafter_time_s,
            drafted=drafted,
            accepted=min(drafted, max(0, len(run.tokens) - run.rounds)),
        )


class HFPromptLookup:
    """transformers' prompt-lookup decoding (`prompt_lookup_num_tokens=gamma`)."""

    name = group = "hf-prompt-lookup"
    description = "generate(prompt_lookup_num_tokens=gamma)"
    uses_gamma = speculative = True
    needs_drafter_model = False
    cost = DrafterCost.UNKNOWN_ALPHA

    @torch.inference_mode()
    def run(self, models: BenchModels, input_ids: torch.Tensor, setting: Setting, meters: Meters) -> RunOutput:
        out = models.target.generate(
            **_hf_kwargs(models, input_ids, setting), prompt_lookup_num_tokens=setting.gamma
        )
        return _hf_output(out, input_ids, meters)


BASELINE = "plain-hf"

RUNNERS: dict[str, Runner] = {
    runner.name: runner
    for runner in (
        PlainHF(),
        Plain(),
        Speculative("spec", "model"),
        Speculative("ngram", "ngram"),
        Speculative("spec-lookup", "lookup+model"),
        HFAssisted("hf-assisted", our_gamma=True),
        HFAssisted("hf-assisted-default", our_gamma=False),
        HFPromptLookup(),
    )
}


def compare_labels(paths: tuple[str, ...]) -> list[str]:
    """A label per compared drafter: its folder's name (or shipped name), numbered when two agree."""
    labels: list[str] = []
    for path in paths:
        base = Path(path).name or str(path)
        label, n = base, 2
        while label in labels:
            label, n = f"{base}#{n}", n + 1
        labels.append(label)
    return labels


def compared_runners(labels: list[str], selected: list[Runner] = ()) -> list[Runner]:
    """``spec@<label>`` for each compared drafter: ``spec``'s method with that drafter model; and
    ``spec-lookup@<label>`` (prompt lookup first, that drafter model behind it) where ``spec-lookup`` is selected."""
    lookup = any(r.name == "spec-lookup" for r in selected)
    return [Speculative(f"{name}@{label}", kind, drafter_label=label) for label in labels
            for name, kind in (("spec", "model"), ("spec-lookup", "lookup+model"))
            if name == "spec" or lookup]


def form_label(form: str) -> str:
    """The compared-drafter label of the run's drafter model in another form (``--drafter-dtype``)."""
    return f"drafter:{form}"


def form_runners(forms: tuple[str, ...], selected: list[Runner]) -> list[Runner]:
    """``spec:FORM`` and ``spec-lookup:FORM`` for each form after the first, for those of spec and
    spec-lookup that are selected: the same methods with the drafter model in that form."""
    kinds = {r.name: r.kind for r in selected if isinstance(r, Speculative) and r.name in ("spec", "spec-lookup")}
    return [Speculative(f"{name}:{form}", kind, drafter_label=form_label(form))
            for form in dict.fromkeys(forms[1:]) for name, kind in kinds.items()]


def tree_runners(trees: tuple[int, ...]) -> list[Runner]:
    """``spec-tree<N>`` for each node count of ``--trees``."""
    return [Treed(n) for n in trees]


def scheduled_runners(schedules: tuple[str, ...]) -> list[Runner]:
    """``spec-<schedule>`` for each schedule of ``--schedules``."""
    return [Scheduled(name) for name in schedules]


def select_runners(methods: tuple[str, ...], registry: dict[str, Runner] | None = None) -> list[Runner]:
    """Runners named (or grouped) by `methods` in registry order; () = all. The baseline is always included."""
    registry = RUNNERS if registry is None else registry
    known = set(registry) | {r.group for r in registry.values()}
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
    wanted = set(methods) | {BASELINE} if methods else known
    return [r for r in registry.values() if r.name in wanted or r.group in wanted]


class PeerRunner:
    """A peer engine as a bench method: greedy, no drafter, built at its first run (the warm-up)."""

    group = "peers"
    uses_gamma = needs_drafter_model = False
    greedy_only = True  # the harness runs it at temperature 0 only
    cost = DrafterCost.NONE

    def __init__(self, peer: Peer, drafter: str | None = None, source: str | None = None) -> None:
        self.peer = peer
        self.drafter = drafter  # the bench's --drafter, for a peer that drafts with it
        self.source = source  # the bench's --peer-source, for a peer that converts the target's folder
        self.name = peer.name
        self.description = f"peer: {peer.description}"
        self.speculative = peer.speculative
        self.lossy = peer.lossy
        self.engine: PeerEngine | None = None
        self.startup_s: float | None = None  # seconds its engine took to start serving, where it tells (a server's)
        self.bytes_read: int | None = None  # weight bytes a step of its engine reads, where it tells (a GGUF file's)

    def run(self, models: BenchModels, input_ids: torch.Tensor, setting: Setting, meters: Meters) -> RunOutput:
        if not setting.greedy:
            raise ValueError(f"peer {self.name} runs greedy only")
        if self.engine is None:
            self.engine = self.peer.build(models.target, decoding_cores(),
                                          *((self.drafter,) if self.peer.drafted else ()),
                                          **({"source": self.source} if self.peer.converts else {}))
            self.startup_s = getattr(self.engine, "startup_s", None)
            self.bytes_read = getattr(self.engine, "bytes_read", None)
        tokens = self.engine.generate(input_ids.tolist(), setting.max_new_tokens, models.stop_token_ids)
        rounds = getattr(self.engine, "rounds", None) or len(tokens)
        return RunOutput(tokens=tokens, rounds=rounds, target_time_s=0.0, drafter_time_s=0.0)

    def close(self) -> None:
        """Let go of the engine (a server is stopped)."""
        engine, self.engine = self.engine, None
        if engine is not None and hasattr(engine, "close"):
            engine.close()


def peer_runners(names: Sequence[str], drafter: str | None = None, source: str | None = None) -> list[PeerRunner]:
    """A runner per peer named, groups expanded (checked first: known and installed); ``drafter`` the
    bench's --drafter, for a peer that drafts with it; ``source`` its --peer-source, for a peer that converts."""
    check_peers(names)
    return [PeerRunner(PEERS[name], drafter, source) for name in expand_peers(names)]
