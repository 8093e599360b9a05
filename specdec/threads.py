"""How many CPU threads torch uses: chosen for the run, not inherited.

torch's default is one intra-op thread per logical CPU. Decoding one token of a small model is a few
hundred tiny parallel regions per forward, and OpenMP's threads wait for each other at the end of every
one: when another busy process takes a core, every region waits for the descheduled thread's next time
slice, and decoding gets several times slower than with one thread (measured on 2 cores with one busy
sibling process: see ``SMALL_MODEL_PARAMETERS``). So the count is decided here, once per process,
before any model runs:

1. a count asked for (``--threads N`` on the command line, ``threads=N`` in the API) wins;
2. else ``OMP_NUM_THREADS`` when the user set it;
3. else the default: one thread for a target below ``SMALL_MODEL_PARAMETERS`` parameters (one thread
   per concurrent forward: target and drafter run in turn, and the server decodes its batch in one
   worker); for a larger target stored narrower than float32 (bfloat16, int8, int4: ``narrow_weights``) whose
   products specdec's operator computes with its helper threads (``helped``: its kernels on, its helpers not off, a
   C compiler to build them), also one thread: the helpers take the other cores, at idle priority and never waited
   for (``specdec.kernels``); else the physical cores (not hyperthreads) this process may use. Why:
   docs/journal/2026-12-07-helpers-and-threads.md.

Never more than the cores this process may use (``os.sched_getaffinity``, and a cgroup CPU quota).
``choose_threads`` is the decision as a pure function (the machine's figures are arguments: it
never reads the load); ``use_threads`` reads the machine, decides, applies (``torch.set_num_threads``
and, where torch still allows it, ``torch.set_num_interop_threads``) and returns a ``ThreadChoice``
that says the count and where it came from, for summaries, ``--json`` and the bench's environment.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Below this many target parameters the default is one thread. Measured on the project's 2-core CPU
# (AMD EPYC, torch 2.13, fp32, Llama shapes; a one-token decode step and a 5-token verify forward, 2
# threads against 1): on a quiet machine (load 1.3) two threads gained at most 1.23x (3.7M params:
# 1.22x and 1.10x, 23M: 1.02x and 1.23x; 91M at load 3: 0.92x and 1.02x); with other work on the
# machine (load 8) they lost 2.3x and 14x at 213M, and `specdec generate` with the shipped pair ran at
# 4.3 tokens/s on 2 threads against 45 on one (load 10-15, medians of 3). A larger model's longer
# parallel regions amortise the waits, so it gets the physical cores. 200M lies above every size
# where the second thread gained little; it is a judgment, not a measured crossover (no quiet
# many-core machine was at hand).
SMALL_MODEL_PARAMETERS = 200_000_000
ENV = "OMP_NUM_THREADS"  # the environment variable a user sets the count with (read by torch too)
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2 CPU quota: "QUOTA PERIOD" or "max PERIOD"


@dataclass(frozen=True)
class ThreadChoice:
    """The torch thread count of a run and where it came from."""

    threads: int  # torch intra-op threads
    source: str  # "--threads" / "threads=" (asked for), "OMP_NUM_THREADS", or "default: ..." (why)

    def describe(self) -> str:
        """E.g. "1 thread (default: target < 200M params)"."""
        return f"{self.threads} thread{'s' if self.threads != 1 else ''} ({self.source})"

    def to_dict(self) -> dict[str, int | str]:
        """The fields ``--json`` and the bench's summary carry: threads, threads_source."""
        return {"threads": self.threads, "threads_source": self.source}


def _millions(n: int) -> str:
    return f"{n / 1e6:g}M"


def _checked(count: object, name: str, usable: int) -> int:
    """``count`` as an int in 1..usable, else a ValueError naming ``name`` (the flag or variable) and the fix."""
    default = f"or {'unset it' if name == ENV else 'leave it out'} for the default"
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{name} {count!r} is not a thread count: give a whole number from 1 to {usable} (the cores "
                         f"this process may use), {default}")
    if count > usable:
        raise ValueError(f"{name} {count} is more than the {usable} cores this process may use: give 1 to {usable}, "
                         f"{default}")
    return count


def _from_env(value: str, usable: int) -> int:
    """``OMP_NUM_THREADS``'s count: its first (outermost) level, e.g. "4" or "4,2"."""
    try:
        count = int(value.split(",")[0])
    except ValueError:
        count = value
    return _checked(count, ENV, usable)


def choose_threads(requested: int | None, *, parameters: int | None, usable: int, physical: int,
                   environ: Mapping[str, str], flag: str = "threads=", helped: bool = False) -> ThreadChoice:
    """The thread count for a run: ``requested`` (named ``flag`` in errors and the source), else
    ``environ``'s OMP_NUM_THREADS, else the default for a target of ``parameters`` (None: unknown)
    on a machine where this process may use ``usable`` cores, ``physical`` of them physical, and where
    ``helped`` says specdec's operator and its helper threads compute the products.

    A pure function of its arguments: the machine's load is not one of them. Raises ValueError for a
    count below 1 or above ``usable``."""
    if requested is not None:
        return ThreadChoice(_checked(requested, flag, usable), flag)
    value = environ.get(ENV, "").strip()
    if value:
        return ThreadChoice(_from_env(value, usable), ENV)
    if parameters is not None and parameters < SMALL_MODEL_PARAMETERS:
        return ThreadChoice(1, f"default: target < {_millions(SMALL_MODEL_PARAMETERS)} params")
    size = "model size unknown" if parameters is None else f"target >= {_millions(SMALL_MODEL_PARAMETERS)} params"
    if helped and usable > 1:
        others = f"helpers on the other {usable - 1} cores" if usable > 2 else "a helper on the other core"
        return ThreadChoice(1, f"default: {size}, {others}")
    cores = max(1, min(physical, usable))
    return ThreadChoice(cores, f"default: {size}, {cores} physical core{'s' if cores != 1 else ''}")


def helped(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether specdec's operator and its helper threads will compute a decoded model's products: its kernels and
    helpers not switched off (``SPECDEC_LINEAR``, ``SPECDEC_HELPER``), Linux, and a C compiler to build them."""
    from specdec.config import c_compiler

    off = {environ.get(name, "").strip().lower() for name in ("SPECDEC_LINEAR", "SPECDEC_HELPER")}
    return "off" not in off and sys.platform.startswith("linux") and c_compiler() is not None


# ------------------------------------------------------------------------------------ the machine


def _cpus() -> set[int]:
    """The logical CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def _cgroup_limit(path: Path = CGROUP_CPU_MAX) -> int | None:
    """Whole CPUs a cgroup v2 quota allows (rounded up), or None when there is no quota."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup CPU quota."""
    cpus = len(_cpus())
    limit = _cgroup_limit()
    return min(cpus, limit) if limit else cpus


def physical_cores() -> int:
    """Physical cores among this process's CPUs (hyperthread siblings counted once), capped by
    ``usable_cores``; the logical count where the topology is not readable."""
    cores = set()
    for cpu in _cpus():
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return min(len(cores), usable_cores())


def _safetensors_header(file: Path) -> dict:
    """One safetensors file's tensors (name -> dtype, shape, offsets) from its JSON header (weights not read)."""
    with file.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _safetensors_parameters(file: Path) -> int:
    """Elements stored in one safetensors file."""
    return sum(math.prod(t["shape"]) for t in _safetensors_header(file).values())


def narrow_weights(model: str | Path | PreTrainedModel | None) -> bool:
    """Whether ``model``'s weights are stored narrower than float32 (bfloat16, float16, quantized): the forms whose
    products specdec's kernels take at fewer bytes a weight (a folder's safetensors headers; a loaded model's
    quantization config or parameter dtypes); False where unknown."""
    if model is None:
        return False
    if not isinstance(model, (str, Path)):
        return getattr(model.config, "quantization_config", None) is not None or any(
            p.dtype.itemsize < 4 for p in model.parameters())
    from specdec.folders import resolve_model_path

    files = sorted(resolve_model_path(model).glob("*.safetensors"))
    return any(t["dtype"] not in ("F32", "F64") for f in files for t in _safetensors_header(f).values())


def model_parameters(model: str | Path | PreTrainedModel | None) -> int | None:
    """Parameters of a loaded model, or of a model folder / shipped name from its safetensors headers
    (before loading anything); None when unknown (no model, no safetensors files)."""
    if model is None:
        return None
    if not isinstance(model, (str, Path)):
        return sum(p.numel() for p in model.parameters())
    from specdec.folders import resolve_model_path

    files = sorted(resolve_model_path(model).glob("*.safetensors"))
    return sum(_safetensors_parameters(f) for f in files) if files else None


# -------------------------------------------------------------------------------------- applying

_applied: ThreadChoice | None = None  # the last choice use_threads applied in this process


def machine_choice(threads: int | None = None, *, model: str | Path | PreTrainedModel | None = None,
                   flag: str = "threads=") -> ThreadChoice:
    """``choose_threads`` on this machine (its usable and physical cores, its environment) for the target ``model``,
    applying nothing and importing no torch: a bad count is refused here, before anything heavy is imported."""
    return choose_threads(threads, parameters=model_parameters(model), usable=usable_cores(),
                          physical=physical_cores(), environ=os.environ, flag=flag,
                          helped=helped() and narrow_weights(model))


def use_threads(threads: int | None = None, *, model: str | Path | PreTrainedModel | None = None,
                flag: str = "threads=") -> ThreadChoice:
    """Decide the thread count (``choose_threads`` on this machine, for the target ``model``: a loaded
    model, a folder or a shipped name), apply it to torch, and return the choice. ``threads`` is the
    count asked for (None: OMP_NUM_THREADS, else the default). Call it before any model runs."""
    global _applied
    choice = machine_choice(threads, model=model, flag=flag)
    import torch

    torch.set_num_threads(choice.threads)
    try:
        torch.set_num_interop_threads(choice.threads)
    except RuntimeError:  # torch allows it once, before inter-op work: decoding uses the intra-op count
        pass
    _applied = choice
    return choice


def applied() -> ThreadChoice | None:
    """The last choice ``use_threads`` applied in this process (None: none yet), whether or not it still holds."""
    return _applied


def current() -> ThreadChoice:
    """The count torch uses now and where it came from: the last ``use_threads`` choice while it still
    holds, else torch's own setting (its default, or OMP_NUM_THREADS read at start)."""
    import torch

    count = torch.get_num_threads()
    if _applied is not None and _applied.threads == count:
        return _applied
    if _applied is not None:
        return ThreadChoice(count, "set outside specdec")
    return ThreadChoice(count, f"torch: {ENV}" if os.environ.get(ENV, "").strip() else "torch's default")


HELPER_NOTE = " + helpers on idle cores"  # said after the thread count where helper threads share the products


def helper_note() -> str:
    """``HELPER_NOTE`` where specdec's operators share a decoded model's products with helper threads (threads at the
    scheduler's idle priority: ``specdec.kernels.shares``), with their count, else ""."""
    kernels = sys.modules.get("specdec.kernels")  # not imported: no operator, no helper (and no torch imported here)
    if kernels is None or not kernels.shares():
        return ""
    count = kernels.helper_count()
    return HELPER_NOTE.replace("helpers", f"{count} helper{'s' if count != 1 else ''}")


def room_beside(threads: int | None = None, usable: int | None = None) -> bool:
    """Whether a second forward of ``threads`` threads (torch's count now) has cores of its own beside the first's:
    the server then prefills rows joining its batch on another thread while the batch decodes
    (``specdec.admission``), one thread per concurrent forward as above."""
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    return (usable_cores() if usable is None else usable) >= 2 * threads
