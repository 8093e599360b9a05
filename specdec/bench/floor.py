"""The weight-streaming floor: one pass over a model's weights, measured on this machine.

A single-token decoding step reads every weight of the model's linear layers once (one matrix-vector
product each); at batch 1 that read is what the step cannot go below with these kernels. A model's
floor here is the median time of that pass alone: each linear layer once (a tied head included; the
input embedding, a one-row gather, left out) applied to a one-token input as the model runs it
(``module(x)``: ``F.linear`` or specdec's own float32 kernels where ``specdec.kernels`` installed them, on the
copies they read, bfloat16 pairs for the blocked kernel where the weights are bfloat16 numbers (the shipped
models), transformers' ``Conv1D``, an int8 drafter's quantised kernel, or a torchao int8 / int4 linear's packed
copy for specdec's kernel, ``specdec.qlinear``), back to back, with nothing else: no
attention, norms, cache or Python around them. A step's time over its floor is what the engine adds;
an engine below it has faster kernels than ours here. The bench samples the pass after each prompt
(``PassMeter``) and takes the median, so on a busy machine the floor and the methods are timed over the
same spells.

A drafter's step is timed as it runs in a round, right after the target's steps (``measure.step_times``), while
its pass is timed pass after pass, its weights warm in the caches. So the drafter's pass is also timed the way
its step is (``measure.step_times``' ``passes``): in runs right after a run of the target's steps. On the Intel Xeon
of docs/benchmarks.md the first pass after the target's steps took 0.78 ms, the next ones 0.40, and back to back
0.36. The report gives the step over both.

``floor_rows`` sets beside it, per method of a run: the median time per generated token (each
prompt's median over repeats, then the median over prompts; for plain decoding, its step), its
ratio to the target's weight pass and to the fastest exact plain engine of the run (plain-hf, our
plain loop, the peers: those whose greedy outputs all equal plain-hf's), and for a plain method the bytes its
form reads a step (the target's pass, or a peer's own file: a quantized GGUF reads fewer) with its time over
reading those bytes at the rate the target's pass reached (its own floor).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.bench.measure import Clock
from specdec.kernels import active, bytes_read
from specdec.qlinear import bytes_read as quantized_bytes

PASSES = 20  # timed passes per model (after two untimed)


@dataclass(frozen=True)
class WeightPass:
    """One pass over a model's linear weights."""

    seconds: float  # median over passes
    bytes: int  # weight bytes read by one pass
    layers: int  # linear layers applied

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _weight(module: torch.nn.Module) -> torch.Tensor | None:
    """A layer's 2-D weight (an int8 layer's packed one), or None when it has none."""
    weight = getattr(module, "weight", None)
    if callable(weight) and not isinstance(weight, torch.Tensor):  # a dynamically quantised linear layer
        weight = weight()
    return weight if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def linear_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """(layer, input width) of every linear layer of ``model``, each once: ``nn.Linear``, an int8
    quantised linear, transformers' ``Conv1D`` (GPT-2: weight [in, out])."""
    layers = []
    for module in model.modules():
        weight = _weight(module)
        if weight is None:
            continue
        if isinstance(module, torch.nn.Linear) or type(module).__module__.startswith("torch.ao.nn.quantized"):
            layers.append((module, int(module.in_features)))
        elif type(module).__name__ == "Conv1D":
            layers.append((module, int(weight.shape[0])))
    return layers


def pass_over(model: torch.nn.Module) -> tuple[Callable[[], None], int, int]:
    """(one pass over ``model``'s linear weights with a one-token input, as ``weight_pass`` times it; the bytes it
    reads; the layers it applies). The pass runs in the caller's ``inference_mode`` and ``kernels.active()``."""
    layers = linear_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no linear layers to time")
    device = next(model.parameters()).device
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    inputs = {width: torch.randn(1, 1, width, dtype=dtype, device=device) for _, width in layers}

    def one_pass() -> None:
        for module, width in layers:
            module(inputs[width])

    read = sum(_bytes_read(module) for module, _ in layers)
    return one_pass, read, len(layers)


def _bytes_read(module: torch.nn.Module) -> int:
    """The bytes a layer's one-row product reads: a compiled model's blocked copy (``specdec.compiled.trace_kernels``:
    its operator serves eager rows too), the copy ``specdec.kernels`` installed, else the weight."""
    copy = module._buffers.get("_specdec_blocked")
    if copy is None:
        found = bytes_read(module) or quantized_bytes(module)  # the int8/int4 kernel's packed copy (qlinear)
        if found is not None:
            return found
        copy = _weight(module)  # linear_layers found one
    return stored_bytes(copy)


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor holds: a quantized tensor subclass's (torchao's: its integer data, scales and zero points,
    ``tensor_data_names``), whose ``element_size`` is its dequantised dtype's, else numel x element size."""
    names = getattr(tensor, "tensor_data_names", None)
    if names and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        parts = [getattr(tensor, name) for name in names]
        return sum(stored_bytes(part) for part in parts if isinstance(part, torch.Tensor))
    return tensor.numel() * tensor.element_size()


@torch.inference_mode()
def weight_pass(model: torch.nn.Module, passes: int = PASSES, clock: Clock | None = None) -> WeightPass:
    """Median time of one pass over ``model``'s linear weights with a one-token input (see the module doc)."""
    one_pass, read, layers = pass_over(model)
    clock = clock or Clock(next(model.parameters()).device)
    times = []
    with active():  # the kernels the model decodes with in specdec (specdec.kernels), where installed
        for i in range(passes + 2):
            start = clock.now()
            one_pass()
            if i >= 2:
                times.append(clock.now() - start)
    return WeightPass(seconds=statistics.median(times), bytes=read, layers=layers)


class PassMeter:
    """Weight passes of one model sampled through a run (a few after each prompt or block), so the floor
    is measured over the same spells of a shared machine as the methods it is set against."""

    def __init__(self, model: torch.nn.Module, clock: Clock | None = None, passes: int = 5) -> None:
        self.model, self.clock, self.passes = model, clock, passes
        self.readings: list[WeightPass] = []

    def sample(self) -> None:
        self.readings.append(weight_pass(self.model, self.passes, self.clock))

    def reading(self) -> WeightPass:
        """The median of the samples (one sample taken now if there is none)."""
        if not self.readings:
            self.sample()
        last = self.readings[-1]  # the copies the kernels read by the end of the run
        return WeightPass(statistics.median(r.seconds for r in self.readings), last.bytes, last.layers)


@dataclass(frozen=True)
class FloorRow:
    """One method's time per token beside the floor."""

    method: str
    speculative: bool  # drafts and verifies (its time per token is not one step)
    exact: bool  # every greedy output equals plain-hf's
    ms_per_token: float  # median over prompts of each prompt's median over repeats
    over_weight_pass: float  # ms_per_token / the target's weight pass
    over_fastest: float | None  # ms_per_token / the fastest exact plain engine's (None when there is none)
    startup_s: float | None = None  # a peer's start-up to serving (a server's), where it tells
    bytes_per_token: int | None = None  # weight bytes a plain step of this form reads (None: speculative, unknown)
    over_own_bytes: float | None = None  # ms_per_token / the time to read those bytes at the target pass's GB/s


def ms_per_token(records) -> float | None:
    """Median over prompts of each prompt's median (over repeats) wall time per generated token, in ms."""
    by_prompt: dict[str, list[float]] = {}
    for r in records:
        if r.generated_length:
            by_prompt.setdefault(r.prompt_id, []).append(r.wall_time_s / r.generated_length)
    return 1e3 * statistics.median(statistics.median(v) for v in by_prompt.values()) if by_prompt else None


def floor_rows(blocks, target_pass: WeightPass) -> list[FloorRow]:
    """Per greedy block with records: its ms per token over the weight pass and over the fastest exact plain engine."""
    measured = []
    for block in blocks:
        if not block.setting.greedy or not block.records:
            continue
        ms = ms_per_token(block.records)
        if ms is None:
            continue
        exact = not block.mismatches and block.compared == len({r.prompt_id for r in block.records})
        gamma = f" γ={block.setting.gamma}" if block.setting.gamma is not None else ""
        speculative = bool(block.runner.speculative)
        read = None if speculative else getattr(block.runner, "bytes_read", None) or target_pass.bytes
        measured.append((block.runner.name + gamma, speculative, exact, ms, getattr(block.runner, "startup_s", None),
                         read))
    plain = [ms for _, speculative, exact, ms, _, _ in measured if exact and not speculative]
    fastest = min(plain) if plain else None
    floor = 1e3 * target_pass.seconds
    per_byte = floor / target_pass.bytes if target_pass.bytes else None  # ms a byte at the target pass's rate
    return [FloorRow(name, speculative, exact, ms, ms / floor, ms / fastest if fastest else None, startup, read,
                     ms / (read * per_byte) if read and per_byte else None)
            for name, speculative, exact, ms, startup, read in measured]
