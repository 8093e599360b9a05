"""What a benchmark ran on: device, dtype, threads, library versions, model sizes, load.

Every figure is only meaningful next to these; ``summary.json`` carries them and the table's
caption repeats the essentials. The load average is recorded at the start and the end because
other jobs sharing the CPU make timings noisy.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

import torch
import transformers
from transformers import PreTrainedModel

from specdec.kernels import describe, mode, shares
from specdec.threads import HELPER_NOTE, ThreadChoice
from specdec.threads import current as current_threads


@dataclass(frozen=True)
class ModelInfo:
    """Size of one benchmarked model."""

    path: str  # where it was loaded from (as given)
    architecture: str  # the transformers class
    parameters: int  # number of parameters
    weight_mib: float  # bytes of parameters and buffers in memory, MiB
    layers: int | None  # decoder layers (num_hidden_layers), when the config says
    hidden_size: int | None  # width, when the config says


def _packed(model: PreTrainedModel) -> list[torch.Tensor]:
    """The int8 weights of a dynamically quantised model's linear layers (not parameters; [] for a float model)."""
    return [m.weight() for m in model.modules()
            if type(m).__module__.startswith("torch.ao.nn.quantized.dynamic") and callable(getattr(m, "weight", None))]


def weight_mib(model: PreTrainedModel) -> float:
    """Bytes of a model's parameters and buffers in memory (int8 weights included), MiB."""
    tensors = (*model.parameters(), *model.buffers(), *_packed(model))
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def model_info(path: str, model: PreTrainedModel) -> ModelInfo:
    """Size facts of a loaded model."""
    return ModelInfo(
        path=path,
        architecture=type(model).__name__,
        parameters=sum(p.numel() for p in (*model.parameters(), *_packed(model))),
        weight_mib=weight_mib(model),
        layers=getattr(model.config, "num_hidden_layers", None),
        hidden_size=getattr(model.config, "hidden_size", None),
    )


# the CPU features that decide which kernels run (specdec's blocked kernel, oneDNN's and llama.cpp's int8 and bf16
# paths): two CPUs of one brand name (this project's Intel Xeons) differ in them, and their figures with them
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


def cpu_description(cpuinfo: str) -> str | None:
    """A CPU from /proc/cpuinfo's text: its model name, family/model/stepping and which of ``CPU_FEATURES`` it has,
    e.g. "Intel(R) Xeon(R) Processor @ 2.50GHz; 6/85/7; avx2 avx512f avx512_vnni"; None without a model name."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if not line.strip():
            break  # the first processor's block is enough
        fields.setdefault(key.strip(), value.strip())
    if "model name" not in fields:
        return None
    flags = set(fields.get("flags", "").split())
    ident = "/".join(fields[k] for k in ("cpu family", "model", "stepping") if k in fields)
    features = " ".join(f for f in CPU_FEATURES if f in flags) or "none of " + " ".join(CPU_FEATURES)
    return "; ".join(filter(None, (fields["model name"], ident, features)))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            described = cpu_description(f.read())
    except OSError:
        described = None
    return described or platform.processor() or "unknown"


@dataclass(frozen=True)
class Environment:
    """The machine and software of a run."""

    device: str  # where the models ran, e.g. "cpu" or "cuda:0"
    device_name: str  # CPU model or GPU name
    dtype: str  # parameter dtype of the target
    torch_threads: int  # torch.get_num_threads()
    threads_source: str  # where that count came from: --threads, OMP_NUM_THREADS
                         # or the default's reason (specdec.threads)
    cpu_count: int | None  # logical CPUs of the machine
    torch_version: str
    transformers_version: str
    python_version: str
    platform: str
    load_average_start: tuple[float, float, float] | None  # 1, 5, 15-minute load when the run began
    load_average_end: tuple[float, float, float] | None  # the same when it ended
    target: ModelInfo
    drafter: ModelInfo | None  # None when no drafter model was loaded
    compared: dict[str, ModelInfo] = field(default_factory=dict)  # label -> a compared drafter (--compare)
    linear: str = ""  # the target's linear kernels while specdec decodes, by row
                      # count, or "torch" (specdec.kernels.describe)
    compile: str = ""  # --compile: "off", or what was compiled and how long it took (specdec.compiled)
    helper: bool = False  # whether the target's products were shared with the helper thread (specdec.kernels.shares)

    @property
    def threads(self) -> str:
        """The thread count and its source, e.g. "1 thread (default: target < 200M params)", and the helper where it
        were on (" + helpers on idle cores")."""
        return ThreadChoice(self.torch_threads, self.threads_source).describe() + (HELPER_NOTE if self.helper else "")


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15-minute load averages (None where the OS does not say)."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())  # type: ignore[return-value]
    except OSError:
        return None


def capture_environment(
    target: tuple[str, PreTrainedModel],
    drafter: tuple[str, PreTrainedModel] | None,
    load_average_start: tuple[float, float, float] | None,
    compared: dict[str, tuple[str, PreTrainedModel]] | None = None,
    compile: str = "",
) -> Environment:
    """Describe this process's machine and the models (called at the end of a run)."""
    model = target[1]
    device = model.device
    threads = current_threads()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return Environment(
        device=str(device),
        device_name=name,
        dtype=str(model.dtype).removeprefix("torch."),
        torch_threads=threads.threads,
        threads_source=threads.source,
        cpu_count=os.cpu_count(),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        python_version=platform.python_version(),
        platform=platform.platform(),
        load_average_start=load_average_start,
        load_average_end=load_average(),
        target=model_info(*target),
        drafter=model_info(*drafter) if drafter else None,
        compared={label: model_info(*named) for label, named in (compared or {}).items()},
        linear=f"{describe(model)} (SPECDEC_LINEAR={mode()})",
        compile=compile,
        helper=shares(model),
    )
