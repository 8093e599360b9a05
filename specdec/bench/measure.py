"""Measuring instruments: clocks, forward-pass meters, peak memory, and the cost ratio c.

- ``Clock``: wall time that synchronizes CUDA before reading (``torch.cuda.synchronize()``), so
  asynchronous kernels are counted where they run.
- ``ForwardMeter``: hooks on a model's ``forward`` that count its calls and the time inside them
  (``specdec.events.Intervals``: on CUDA, events the device times; no wait per forward).
  It is attached the same way to every method, so each pays the same (microseconds per call); it
  is the one source of the number of target forwards (``num_LM_call``) for every method and of
  the time split for ``transformers``' generate, which reports none.
- ``MemoryMeter``: peak memory over a block of runs. On CUDA, ``torch.cuda.max_memory_allocated``
  after a reset. On CPU, the process's resident set: Linux's high-water mark (``VmHWM`` in
  /proc/self/status) is reset to the current RSS before the block (``echo 5 >
  /proc/self/clear_refs``, after collecting the young garbage generations and ``malloc_trim`` so
  freed memory of an earlier block is returned first) and read after it; where the reset is not allowed a thread
  samples the RSS every millisecond instead.
- ``step_times``: the median time of a single-token cached forward of each model, each drafter's
  steps right after the target's as in a round, used for the cost ratio c = drafter step / target
  step of Leviathan et al. A model compiled by ``specdec.compiled.prepare`` is timed on its compiled
  step (``StaticRaggedCache.forward``, the path the run decodes with, bookkeeping included); any other
  model on its eager forward with transformers' cache (``step_path`` names which).
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from typing_extensions import Self

from specdec.compat import cache_kwargs, cache_of
from specdec.events import Intervals
from specdec.kernels import active

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_MIB = 1024 * 1024


class Clock:
    """perf_counter that waits for the device's queued work first."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        """Seconds, after all queued CUDA work has finished."""
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


class ForwardMeter:
    """Counts forward calls of one model and the seconds spent inside them (while attached). The seconds are
    ``specdec.events.Intervals``: on CUDA, events the device times, not a wait before and after every forward
    (which kept the host from queuing the next work while the device ran, in every method alike)."""

    def __init__(self, model: torch.nn.Module, clock: Clock) -> None:
        self.model = model
        self.device = torch.device("cuda" if clock.cuda else "cpu")
        self.calls = 0
        self._seconds = 0.0
        self._intervals = Intervals(self.device)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def seconds(self) -> float:
        self._seconds += sum(seconds for _, seconds in self._intervals.settle())
        return self._seconds

    def _pre(self, *_: object) -> None:
        self._intervals.start("forward")

    def _post(self, *_: object) -> None:
        self.calls += 1
        self._intervals.stop("forward")

    def __enter__(self) -> Self:
        self.calls, self._seconds = 0, 0.0
        self._intervals = Intervals(self.device)
        self._handles = [
            self.model.register_forward_pre_hook(self._pre),
            self.model.register_forward_hook(self._post),
        ]
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _release_freed_memory() -> None:
    """Collect young garbage and hand freed heap pages back to the OS, so RSS reflects live memory.

    Only generations 0 and 1: a full collection walks every object transformers created at import
    (over a second on a busy 2-core machine, before every block).
    """
    gc.collect(1)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


@dataclass(frozen=True)
class MemoryReading:
    """Peak memory of a block of runs, in MiB."""

    peak_mib: float  # highest resident (CPU) or allocated (CUDA) memory during the block
    start_mib: float  # the same quantity just before the block
    source: str  # how it was measured: "cuda_allocated", "rss_hwm" or "rss_sampled"

    @property
    def growth_mib(self) -> float:
        """Memory the block needed beyond what was already live (caches, logits, buffers)."""
        return max(0.0, self.peak_mib - self.start_mib)


class MemoryMeter:
    """Context manager measuring peak memory over its block; ``reading`` is set on exit."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reading: MemoryReading | None = None
        self._start = 0.0
        self._source = ""
        self._sampled_peak = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        _release_freed_memory()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._source = "cuda_allocated"
            self._start = torch.cuda.memory_allocated(self.device) / _MIB
            return self
        self._start = _status_kib("VmRSS") / 1024
        try:
            _CLEAR_REFS.write_text("5")
            self._source = "rss_hwm"
        except OSError:
            self._source = "rss_sampled"
            self._sampled_peak = self._start
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._sampled_peak = max(self._sampled_peak, _status_kib("VmRSS") / 1024)

    def __exit__(self, *_: object) -> None:
        if self._source == "cuda_allocated":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) / _MIB
        elif self._source == "rss_hwm":
            peak = _status_kib("VmHWM") / 1024
        else:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            peak = max(self._sampled_peak, _status_kib("VmRSS") / 1024)
        self.reading = MemoryReading(peak_mib=peak, start_mib=self._start, source=self._source)


@torch.inference_mode()
def step_times(
    models: list[torch.nn.Module], context: torch.Tensor, steps: int, clock: Clock, run: int = 4,
    passes: Sequence[Callable[[], None]] = (),
) -> list[float]:
    """Median seconds of one single-token forward with a KV cache after `context` ([1, T]), per model, then of
    each of ``passes`` (a drafter's pass over its weights, ``floor.pass_over``) timed the same way.

    ``models[0]`` is the target, the others drafters. They take turns in runs of ``run`` steps, each
    drafter's run right after a run of the target, as in a round of speculative decoding: a drafter
    step then costs what it costs in the loop (the target's weights have just passed through the CPU
    caches; on this project's CPU 1.7 ms against 1.1 ms for steps of the drafter alone), every
    drafter is measured in the same condition, and a slow spell weighs on all alike. Each pass's run
    also follows a run of the target's steps (untimed), so the pass reads the weights from wherever
    the target's forwards left them, as the drafter's step does. Inside ``specdec.kernels.active()``:
    the linear kernels specdec decodes with, where installed."""
    with active():
        return _step_times(models, context, steps, clock, run, passes)


def step_path(model: torch.nn.Module) -> str:
    """How ``step_times`` times ``model``'s step: "compiled" (its compiled step, as decoded) or "eager"."""
    from specdec.compiled import compiled_for

    return "compiled" if compiled_for(model) is not None else "eager"


def _eager_step(model: torch.nn.Module, ids: torch.Tensor, cache: object) -> tuple[object, torch.Tensor]:
    out = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
    return cache_of(out), out.logits


def _compiled_step(model: torch.nn.Module, ids: torch.Tensor, cache: object) -> tuple[object, torch.Tensor]:
    return cache, cache.forward(ids).logits


def compiled_start(model: torch.nn.Module, context: torch.Tensor) -> tuple[object, torch.Tensor]:
    """A compiled model's static cache holding ``context`` ([B, T]), prefilled eagerly and merged into it as a run
    does, and the greedy next token of each row [B, 1]."""
    from specdec.cache import RaggedCache
    from specdec.seq2seq import decoding_cache

    prefill = RaggedCache(model, context.shape[0], context.device)
    out = prefill.forward(context)
    static = decoding_cache(model, context.device)
    static.merge(prefill)
    return static, out.logits[:, -1:].argmax(-1)


def _step_times(models: list[torch.nn.Module], context: torch.Tensor, steps: int, clock: Clock, run: int,
                passes: Sequence[Callable[[], None]]) -> list[float]:
    caches, tokens, steppers = [], [], []
    for model in models:
        if step_path(model) == "compiled":
            cache, token = compiled_start(model, context)
            steppers.append(_compiled_step)
        else:
            out = model(input_ids=context, use_cache=True)
            cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)  # [1, 1]
            steppers.append(_eager_step)
        caches.append(cache)
        tokens.append(token)
    timed = [*range(len(models)), *passes]  # a model's index (a step) or a pass
    times: list[list[float]] = [[] for _ in timed]

    def take_run(j: int, record: bool = True) -> None:
        for _ in range(run):
            start = clock.now()
            if j < len(models):
                caches[j], logits = steppers[j](models[j], tokens[j], caches[j])
                tokens[j] = logits[:, -1:].argmax(-1)
            else:
                timed[j]()
            if record:
                times[j].append(clock.now() - start)

    while len(times[0]) < steps:
        for drafter in range(1, len(models)) if len(models) > 1 else [None]:
            take_run(0)
            if drafter is not None:
                take_run(drafter)
        for j in range(len(models), len(timed)):
            take_run(0, record=False)
            take_run(j)
    return [statistics.median(t) for t in times]
