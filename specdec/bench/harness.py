"""The benchmark loop: load once, warm up, time every method on the same prompts, never crash.

Order of work (one process, one machine, the same prompts for every method):
1. check the peers asked for (`--peers`: known and installed), load the target (and the drafter
   model when a selected method needs it, in each form of `--drafter-dtype`, and each drafter of
   `--compare`), tokenize the prompts;
2. warm up every (method, setting) block on the first prompts, untimed (a peer builds its engine
   there); then run each once more on the longest prompt inside a memory meter: the block's peak memory;
3. measure the single-token step time of each model, each drafter's steps right after the
   target's as in a round (the cost ratio c), again after each prompt (or block) of step 4, and
   take the medians;
4. time the blocks in one of two orders (``--order``). ``prompt`` (the default): each prompt runs
   with every block in turn (its repeats back to back, the blocks' order rotated from prompt to
   prompt), so a slow spell of the shared machine falls on all methods alike. ``method``: each
   repeat runs every block over all prompts, one block after the other (as Spec-Bench runs
   methods), so each method is timed in its own steady state, but a slow spell can fall on one
   block: on this project's CPU the same command's spec speedup spread twice as wide in that order
   (README, *Benchmark*). After each prompt (or block) a few passes over the target's and the
   drafter's weights are timed: their median is the floor (``specdec.bench.floor``);
5. a method that raises is recorded as failed and skipped from then on; the others go on;
6. greedy outputs are compared with plain-hf's (first repeat) token for token; at the first
   difference the target's two best logits are compared there, since verifying k tokens in one
   forward may legitimately flip a near tie (issue 2: top-two gap below ~1e-4).

Every run is timed by the same clock (CUDA synchronized) and its forward passes are counted by the
same hooks, whatever the method.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from specdec.bench.config import BenchConfig
from specdec.bench.environment import Environment, capture_environment, load_average
from specdec.bench.floor import PassMeter, WeightPass, pass_over
from specdec.bench.measure import Clock, ForwardMeter, MemoryMeter, MemoryReading, step_path, step_times
from specdec.bench.prompts import Prompt, load_prompts
from specdec.bench.records import Record
from specdec.bench.runners import (
    BASELINE,
    BenchModels,
    Meters,
    Runner,
    RunOutput,
    Setting,
    compare_labels,
    compared_runners,
    drafter_label,
    form_label,
    form_runners,
    peer_runners,
    scheduled_runners,
    select_runners,
    tree_runners,
)
from specdec.drafters.model import drafter_form, drafter_in, reads_features
from specdec.kernels import install
from specdec.loading import load_model, load_tokenizer

_STEP_TIME_STEPS = 16  # timed single-token forwards per model for the cost ratio c


@dataclass
class Block:
    """One method at one setting: its records, peak memory and, if it failed, why."""

    runner: Runner
    setting: Setting
    records: list[Record] = field(default_factory=list)
    memory: MemoryReading | None = None  # peak memory of an untimed run on the longest prompt
    error: str | None = None  # "ExceptionType: message" of the first failure
    compared: int = 0  # greedy prompts compared with plain-hf (0 for sampled settings)
    mismatches: dict[str, Mismatch] = field(default_factory=dict)  # prompt id -> first difference

    def fail(self, err: Exception) -> None:
        """Mark the block failed: it is skipped from then on."""
        self.error = f"{type(err).__name__}: {err}"


@dataclass(frozen=True)
class Mismatch:
    """Where a greedy output first differs from plain-hf's, and how close the target's choice was there."""

    position: int  # index of the first differing new token (or the shorter length)
    top2_gap: float  # target's best minus second-best logit at that position (a tie if below ~1e-4)


@dataclass
class BenchRun:
    """Everything a run measured; :mod:`specdec.bench.summary` turns it into figures."""

    config: BenchConfig
    environment: Environment
    prompts: list[Prompt]
    blocks: list[Block]
    target_step_s: float  # median single-token cached forward of the target
    drafter_step_s: float | None  # the same for the drafter model (None when not loaded)
    compared_step_s: dict[str, float] = field(default_factory=dict)  # the same per compared drafter label
    target_pass: WeightPass | None = None  # one pass over the target's linear weights (specdec.bench.floor)
    drafter_pass: WeightPass | None = None  # the same for the drafter model, in its form (None when not loaded)
    drafter_round_pass_s: float | None = None  # its pass timed as its step is, after the target's steps (step_times)
    step_paths: dict[str, str] = field(default_factory=dict)  # "target", "drafter" -> "compiled" or "eager" (step_path)


def _stop_token_ids(target: PreTrainedModel) -> list[int]:
    eos = target.generation_config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def _record(prompt: Prompt, block: Block, repeat: int, out: RunOutput, wall: float, meters: Meters) -> Record:
    n = len(out.tokens)
    speculative = block.runner.speculative
    return Record(
        prompt_id=prompt.id,
        method=block.runner.name,
        gamma=block.setting.gamma,
        temperature=block.setting.temperature,
        repeat=repeat,
        tokens=out.tokens,
        generated_length=n,
        wall_time_s=wall,
        tokens_per_s=n / wall if wall > 0 else 0.0,
        num_LM_call=meters.target.calls,
        drafter_calls=meters.drafter.calls if meters.drafter else 0,
        rounds=out.rounds,
        target_time_s=out.target_time_s,
        drafter_time_s=out.drafter_time_s,
        spec_time=wall if speculative else None,
        target_time=None if speculative else wall,
        generated_length_target=None if speculative else n,
        num_mismatched_tokens=None if out.drafted is None else out.drafted - (out.accepted or 0),
        drafted=out.drafted,
        accepted=out.accepted,
        acceptance_rate=(out.accepted or 0) / out.drafted if out.drafted else None,
        mean_accepted_length=n / out.rounds if out.rounds else 0.0,
        accepted_per_position=out.accepted_per_position,
        drafted_per_position=out.drafted_per_position,
    )


class _Harness:
    """Runs blocks with shared models, clock and progress bar."""

    def __init__(self, models: BenchModels, prompts: list[Prompt], clock: Clock, progress: Progress) -> None:
        self.models = models
        self.prompts = prompts
        self.clock = clock
        self.progress = progress

    def _meters(self, runner: Runner) -> Meters:
        drafter = self.models.drafter_for(runner)
        return Meters(
            target=ForwardMeter(self.models.target, self.clock),
            drafter=ForwardMeter(drafter, self.clock) if drafter is not None else None,
        )

    def run_once(self, block: Block, prompt: Prompt) -> tuple[RunOutput, float, Meters]:
        """One generate call of the block's method, timed, with its forwards counted."""
        meters = self._meters(block.runner)
        with meters.target, meters.drafter or contextlib.nullcontext():
            start = self.clock.now()
            out = block.runner.run(self.models, prompt.input_ids, block.setting, meters)
            wall = self.clock.now() - start
        return out, wall, meters

    def warm_up(self, block: Block, count: int) -> None:
        """Untimed runs on the first prompts; a failure marks the block."""
        try:
            for i in range(count):
                self.run_once(block, self.prompts[i % len(self.prompts)])
        except Exception as err:  # noqa: BLE001 - one method's failure must not end the benchmark
            block.fail(err)

    def measure_memory(self, block: Block) -> None:
        """One untimed run on the longest prompt inside a memory meter: the block's peak memory.

        Apart from the timed runs, whose clocks the meter's release of freed memory would disturb,
        and after every block's warm-up, so one-time allocations of the process (first calls of
        transformers and torch) are not charged to whichever block comes first. A failure marks the block."""
        longest = max(self.prompts, key=lambda p: p.input_ids.numel())
        meter = MemoryMeter(self.models.target.device)
        try:
            with meter:
                self.run_once(block, longest)
        except Exception as err:  # noqa: BLE001 - one method's failure must not end the benchmark
            block.fail(err)
            return
        block.memory = meter.reading

    def timed_run(self, block: Block, prompt: Prompt, repeat: int) -> None:
        """One timed run; a failure marks the block and drops its records."""
        try:
            out, wall, meters = self.run_once(block, prompt)
        except Exception as err:  # noqa: BLE001 - one method's failure must not end the benchmark
            block.fail(err)
            block.records.clear()
            return
        block.records.append(_record(prompt, block, repeat, out, wall, meters))

    def _describe(self, block: Block, task: int, suffix: str = "") -> None:
        setting = block.setting
        gamma = f" γ={setting.gamma}" if setting.gamma is not None else ""
        self.progress.update(task, description=f"{block.runner.name}{gamma} T={setting.temperature:g}{suffix}")

    def timed_pass(self, block: Block, repeat: int, task: int) -> None:
        """``--order method``: the block over all prompts, back to back."""
        self._describe(block, task, f" #{repeat + 1}")
        for prompt in self.prompts:
            if block.error is None:
                self.timed_run(block, prompt, repeat)
            self.progress.advance(task)

    def timed_prompt(self, blocks: list[Block], index: int, repeats: int, task: int) -> None:
        """``--order prompt``: prompt ``index`` with every block in turn, ``repeats`` runs back to back
        per block; the blocks' order rotates by one per prompt."""
        prompt, shift = self.prompts[index], index % len(blocks)
        for block in blocks[shift:] + blocks[:shift]:
            self._describe(block, task)
            for repeat in range(repeats):
                if block.error is None:
                    self.timed_run(block, prompt, repeat)
                self.progress.advance(task)


@torch.inference_mode()
def _top2_gap(target: PreTrainedModel, prompt: Prompt, reference: list[int], position: int) -> float:
    """Best minus second-best target logit after the prompt and `reference[:position]`."""
    ids = torch.cat([prompt.input_ids, torch.tensor(reference[:position], dtype=torch.long)])  # [T + position]
    logits = target(input_ids=ids[None].to(target.device)).logits[0, -1].float()  # [V]
    best = logits.topk(2).values  # [2]
    return (best[0] - best[1]).item()


def compare_greedy(blocks: list[Block], target: PreTrainedModel, prompts: list[Prompt]) -> None:
    """Fill each greedy block's `compared` and `mismatches` against plain-hf's first repeat."""
    baselines = {b.setting.temperature: b for b in blocks if b.runner.name == BASELINE and b.records}
    by_id = {p.id: p for p in prompts}
    for block in blocks:
        base = baselines.get(block.setting.temperature)
        if not block.setting.greedy or base is None or not block.records:
            continue
        reference = {r.prompt_id: r.tokens for r in base.records if r.repeat == 0}
        block.compared = len({r.prompt_id for r in block.records} & set(reference))
        for r in block.records:
            ref = reference.get(r.prompt_id)
            if ref is None or r.tokens == ref or r.prompt_id in block.mismatches:
                continue
            position = next((i for i, (a, b) in enumerate(zip(r.tokens, ref)) if a != b), min(len(r.tokens), len(ref)))
            gap = _top2_gap(target, by_id[r.prompt_id], ref, position)
            block.mismatches[r.prompt_id] = Mismatch(position=position, top2_gap=gap)


def _blocks(config: BenchConfig, runners: list[Runner]) -> list[Block]:
    blocks = []
    for temperature in config.temperature:
        for runner in runners:
            if temperature != 0.0 and getattr(runner, "greedy_only", False):  # a peer: greedy only
                continue
            for gamma in config.gamma if runner.uses_gamma else (None,):
                setting = Setting(
                    temperature=temperature,
                    gamma=gamma,
                    top_k=config.top_k,
                    top_p=config.top_p,
                    max_new_tokens=config.max_new_tokens,
                    seed=config.seed,
                )
                blocks.append(Block(runner=runner, setting=setting))
    return blocks


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' loading bars and generate's advice on flags (they would drown the progress bar)."""
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def run_benchmark(
    config: BenchConfig, registry: dict[str, Runner] | None = None, console: Console | None = None
) -> BenchRun:
    """Run every selected method on the same prompts; return all records and measurements."""
    labels = compare_labels(config.compare)
    selected = select_runners(config.methods, registry)
    runners = (selected + form_runners(config.drafter_dtype, selected) + compared_runners(labels, selected)
               + scheduled_runners(config.schedules) + tree_runners(config.trees)
               + peer_runners(config.peers, config.drafter, config.peer_source))
    try:
        with _quiet_transformers():
            return _run(config, runners, dict(zip(labels, config.compare, strict=True)), console)
    finally:  # a peer's server is stopped however the run ends (an error, Ctrl-C)
        for runner in runners:
            if hasattr(runner, "close"):
                runner.close()


def _compile(config: BenchConfig, target: PreTrainedModel, drafters: dict[str, PreTrainedModel | None]) -> str:
    """``--compile on``: compile the target and the drafter model's forms (as loaded: behind lookup; the form
    ``spec`` drafts with) for the shapes of every method of ours, at every ``--gamma`` (``specdec.plan``: plain
    decoding and prompt lookup before a drafter model, one row), before any timing; what was done."""
    from specdec.compiled import compiles
    from specdec.loading import input_device
    from specdec.plan import Shapes, decode_plan

    if not compiles(config.compile, input_device(target)):
        return config.compile
    plans = [decode_plan(g, lookup=True, drafter_model=True, speculating=True, plain=True) for g in config.gamma]
    verify = Shapes(tuple(sorted({n for p in plans for n in p.target.tokens})), plans[0].target.rows)
    steps = Shapes(tuple(sorted({n for p in plans for n in p.drafter.tokens})), plans[0].drafter.rows, last=True)
    done = [f"target {verify.prepare(target).reason}"]
    seen: set[int] = set()
    for label, drafter in drafters.items():
        if drafter is not None and id(drafter) not in seen:
            seen.add(id(drafter))
            done.append(f"{label} {steps.prepare(drafter).reason}")
    return "; ".join(done)


def _run(config: BenchConfig, runners: list[Runner], compare: dict[str, str], console: Console | None) -> BenchRun:
    load_start = load_average()
    target = load_model(config.target, device=config.device, dtype=config.dtype)
    install(target)  # specdec's linear kernels, decided before the floor is sampled (specdec.kernels)
    form, *others = config.drafter_dtype
    loaded = None
    if any(r.needs_drafter_model and drafter_label(r) not in compare for r in runners):
        loaded = load_model(config.drafter, device=target.device, dtype=target.dtype)
        if form == "auto" and config.compile == "on":  # compiled, auto keeps it as loaded (an int8 copy cannot
            form = drafter_form(loaded, "auto", lookup=True)  # compile: drafter_form), resolved before compiling
    # every drafter model in its form before any run, so the meters and step times see the model that drafts
    drafter = drafter_in(loaded, form) if loaded is not None and any(
        r.needs_drafter_model and drafter_label(r) is None for r in runners) else None
    sources = {label: load_model(path, device=target.device, dtype=target.dtype) for label, path in compare.items()}
    compared = {label: drafter_in(model, form) for label, model in sources.items()}
    forms = dict.fromkeys(compare, form)
    for other in dict.fromkeys(others):
        if loaded is not None and any(drafter_label(r) == form_label(other) for r in runners):
            compared[form_label(other)] = drafter_in(loaded, other)
            compare[form_label(other)] = f"{config.drafter} ({other})"
            forms[form_label(other)] = other
    for model in (drafter, *compared.values()):  # int8 and bf16 forms are left alone by install
        if model is not None:
            install(model)
    compiled = _compile(config, target, {"drafter": loaded, f"drafter ({form})": drafter})
    tokenizer = load_tokenizer(config.tokenizer or config.target)
    prompts = load_prompts(config.prompts, config.num_prompts, config.seed, tokenizer)
    models = BenchModels(target=target, drafter=drafter, stop_token_ids=_stop_token_ids(target), compared=compared,
                         forms=forms, form=form, source=loaded, compared_sources=sources)
    clock = Clock(target.device)

    blocks = _blocks(config, runners)
    progress = Progress(
        TextColumn("{task.description:<32}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console or Console(stderr=True),
        disable=not config.progress,
        transient=True,
    )
    harness = _Harness(models, prompts, clock, progress)
    with progress:
        task = progress.add_task("warm-up", total=config.repeats * len(blocks) * len(prompts))
        for block in blocks:
            harness.warm_up(block, config.warmup)
        for block in blocks:
            if block.error is None:
                harness.measure_memory(block)
        # step times after the warm-up (a fresh process's first forwards can be many times slower), sampled
        # again with the floor after each prompt (or block): their medians, over the same spells as the methods
        # a drafter reading the target's features (feature, parallel) has no step of its own: its cost is the
        # drafting time the runs measure (summary's cost ratio)
        stepped = drafter if drafter is not None and not reads_features(drafter) else None
        stepped_compared = [label for label, m in compared.items() if not reads_features(m)]
        drafters = [m for m in (stepped, *(compared[label] for label in stepped_compared)) if m is not None]
        context = prompts[0].input_ids[None].to(target.device)  # [1, T]
        round_pass = [pass_over(stepped)[0]] if stepped is not None else []  # also timed after the target's steps
        samples = [step_times([target, *drafters], context, _STEP_TIME_STEPS, clock, passes=round_pass)]
        floors = [PassMeter(m, clock) for m in (target, stepped) if m is not None]

        def sample() -> None:
            for floor in floors:
                floor.sample()
            with torch.inference_mode():
                samples.append(step_times([target, *drafters], context, _STEP_TIME_STEPS // 2, clock,
                                          passes=round_pass))

        if config.order == "prompt":
            for index in range(len(prompts)):
                harness.timed_prompt(blocks, index, config.repeats, task)
                sample()
        else:
            for repeat in range(config.repeats):
                for block in blocks:
                    harness.timed_pass(block, repeat, task)
                    sample()
        target_step, *steps = [statistics.median(column) for column in zip(*samples, strict=True)]
        drafter_round_pass = steps.pop() if stepped is not None else None  # the pass timed after the target's steps
        drafter_step = steps.pop(0) if stepped is not None else None
        compared_step = dict(zip(stepped_compared, steps, strict=True))
        target_pass, *rest = [floor.reading() for floor in floors]
        drafter_pass = rest[0] if rest else None
    compare_greedy(blocks, target, prompts)

    environment = capture_environment(
        (config.target, target),
        (config.drafter, drafter) if drafter is not None else None,
        load_start,
        {label: (compare[label], m) for label, m in compared.items()},
        compile=compiled,
    )
    return BenchRun(
        config=config,
        environment=environment,
        prompts=prompts,
        blocks=blocks,
        target_step_s=target_step,
        drafter_step_s=drafter_step,
        compared_step_s=compared_step,
        target_pass=target_pass,
        drafter_pass=drafter_pass,
        drafter_round_pass_s=drafter_round_pass,
        step_paths={name: step_path(m) for name, m in (("target", target), ("drafter", drafter)) if m is not None},
    )
