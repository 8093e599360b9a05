"""Whether and where a model is compiled: the ``--compile`` modes, the refusals, the compile cache's folders.

Contract: ``compiles(mode, device)`` answers ``--compile``: ``on`` compiles, ``off`` never, ``auto`` only on a
CUDA device (CUDA graphs pay there; on a CPU the start of tens of seconds was measured not to repay itself).
``compile_refusal`` (and ``seq2seq_refusal`` for encoder-decoder models) names why a model decodes eagerly
whatever the mode says, or None; ``compiler_missing`` what torch.compile's CPU backend lacks here. Compiled code
lives under ``~/.cache/specdec/{inductor,graphs}/torch-VERSION`` (``cache_folder``): another torch's folder is
never read. The constants below size the static cache (slots per row, slot step) and the compile checks.

Why a separate module: the server's background compiler and the command line ask these questions without
building anything. Measurements behind the choices: docs/journal/compiled-path.md.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from specdec import kernels, qlinear
from specdec.architectures import attention_chunk, local_window
from specdec.config import check_mode, compiles  # noqa: F401 (the package re-exports them)
from specdec.folders import cache_root
from specdec.positions import positions_for

SLOTS = 512  # slots per row of a static cache (at most the model's context): attention cost vs room
SLOT_STEP = 32  # a forward attends the first S slots: the pointer plus its new tokens, rounded up to this
RECOMPILE_LIMIT = 256  # compiled (model, bucket) pairs allowed in one process
SLOT_SLACK = 16  # slots beyond the context for dead padding before a re-pack is needed
SPARE_CACHES = 2  # released static caches a CompiledModel keeps per (rows, device) for the next handle
# inductor's options for the step (freezing off: its graphs cannot be cached). Its C++ wrapper (the graph's calls
# in C++, not Python): on the Intel Xeon of docs/benchmarks.md the drafter's step 0.52 -> 0.47 ms and the default
# speculation 2.79x -> 2.97x generate (three alternated bench runs), its compiles no slower.
INDUCTOR: dict[str, object] = {"cpp_wrapper": True}
GRAPH_FORMAT = 2  # the layout of a graph file (``graph_file``; 2: the step reads its model through a weak reference)
CHECK_TOLERANCE = 1e-3  # largest |compiled - eager| logit difference (relative to the logits' scale) at warm-up
INSTALL = ("torch.compile on CPU needs a C++ compiler and Python's headers: install them (Debian/Ubuntu: "
           "apt-get install g++ python3-dev; or set CXX to a compiler), or use --compile off")

def compiler_missing() -> str | None:
    """What torch.compile's CPU backend lacks here (a C++ compiler, Python's headers), or None."""
    compilers = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    if not any(shutil.which(c) for c in compilers):
        return f"no C++ compiler found ({', '.join(compilers)})"
    include = sysconfig.get_paths().get("include")
    if not include or not (Path(include) / "Python.h").is_file():
        return f"Python's headers are missing (no Python.h in {include})"
    return None


def cache_folder(kind: str = "inductor") -> Path:
    """specdec's on-disk compile cache for this torch version (another version's folder is never read):
    ``inductor`` (inductor's generated code and its C++ builds) or ``graphs`` (``graph_file``)."""
    return cache_root() / kind / f"torch-{torch.__version__}"


def use_cache_folder() -> None:
    """Point inductor at ``cache_folder()`` unless the user chose a folder (``TORCHINDUCTOR_CACHE_DIR``).
    Importing torch._dynamo already sets that variable to inductor's default (under /tmp), so a
    ``setdefault`` would never apply."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_folder())


def probed_isa(record: bool = False) -> bool:
    """Skip inductor's probe of the CPU's vector instruction sets (it builds and loads a test library for each
    in a child process: 2-3 s of every start; the AVX-512 variants' own probes, about half of it, still run)
    where an earlier start probed them here: the sets the probe accepted are kept in ``cache_folder("graphs")
    / "vec-isa.json"``, and trusted only when they are the ones the CPU's flags name (else probed again).
    ``record``: keep this process's probe. Whether the probe was skipped."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    file = cache_folder("graphs") / "vec-isa.json"
    if record:
        if config.cpp.vec_isa_ok is None:  # probed in this process
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(json.dumps(sorted(str(isa) for isa in valid_vec_isa_list())))
        return False
    if config.cpp.vec_isa_ok is not None or not file.is_file():  # the user's choice, or never probed here
        return False
    try:
        probed = json.loads(file.read_text())
    except ValueError:
        probed = None
    config.cpp.vec_isa_ok = True  # the sets the CPU's flags name, unprobed
    valid_vec_isa_list.cache_clear()
    if sorted(str(isa) for isa in valid_vec_isa_list()) == probed:
        return True
    config.cpp.vec_isa_ok = None  # another machine's record: probe
    valid_vec_isa_list.cache_clear()
    return False


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message ('' if it has none)."""
    return str(error).splitlines()[0] if str(error) else ""

def quantized_refusal(model: PreTrainedModel) -> str | None:
    """Why the compiled path refuses ``model``'s quantization, in one line (None where it has none, or where every
    quantized weight is a torchao int8 / int4 weight-only linear that ``specdec.qlinear`` installs on: the compiled
    step traces those as the operator ``specdec::quantized_linear`` on their packed copies, ``specdec.compiled.ops``).
    Refused: a model quantized in another form (another format, a quantized embedding, an int4 group the kernel does
    not take: their products would be traced as their own library computes them, dequantising in the graph, which is
    untested), and any quantized model where specdec's operators are not there (``SPECDEC_LINEAR=off``, no compiler).
    The eager path runs them all exactly (tests/test_quantized.py)."""
    from specdec.quantized import describe

    name = describe(model)
    if name is None:
        return None
    if kernels.mode() == "off" or not kernels.blocked_op():
        why = "SPECDEC_LINEAR=off" if kernels.mode() == "off" else "specdec's operators do not build here"
        return f"the compiled path takes quantized models ({name}) on specdec's quantized operator only ({why})"
    ours = {id(m.weight) for m in model.modules()  # a plain nn.Linear (its forward ours, or a compiled step's)
            if isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward
            and qlinear.form(m.weight) is not None}
    other = sorted({f"{type(t).__name__} in {type(m).__name__}" for m in model.modules()
                    for t in m._parameters.values()
                    if t is not None and type(t) not in (torch.Tensor, torch.nn.Parameter) and id(t) not in ours})
    if not ours or other:
        what = ", ".join(other) or "no torchao int8 / int4 weight-only linear"
        return (f"the compiled path takes torchao int8 / int4 weight-only linears only ({name}: {what}): "
                "use --compile off")
    return None


def compile_refusal(model: PreTrainedModel) -> str | None:
    """Why ``model`` decodes eagerly whatever ``--compile`` says, or None when it can be compiled."""
    name = type(model).__name__
    config = model.config
    if (reason := quantized_refusal(model)) is not None:  # torchao's weight tensors (specdec.quantized)
        return reason
    if getattr(config, "is_encoder_decoder", False):
        if (reason := seq2seq_refusal(model)) is not None:
            return reason
    elif not positions_for(model).argument:
        return f"{name}'s forward takes no position_ids"
    if attention_chunk(config) or local_window(config):
        return f"{name} has local or chunked attention (windows over slots a static cache does not keep)"
    if any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in model.modules()):
        return f"{name} is dynamically quantised (int8 linears have no traceable form here)"
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return f"{name} uses the {config._attn_implementation!r} attention implementation (sdpa or eager only)"
    try:
        layers = StaticCache(config=config, max_cache_len=1).layers
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        return f"{name} has no transformers StaticCache ({error})"
    if not all(type(layer) is StaticLayer for layer in layers):
        return f"{name}'s cache layers are not all full attention"
    return None

def cross_attentions(model: PreTrainedModel) -> list[torch.nn.Module] | None:
    """The decoder layers' cross-attention modules (BART-style ``encoder_attn``), or None."""
    try:
        layers = getattr(model.get_decoder(), "layers", None)
    except (AttributeError, NotImplementedError, ValueError):
        return None
    modules = [getattr(layer, "encoder_attn", None) for layer in layers or ()]
    return modules if modules and all(hasattr(m, "layer_idx") for m in modules) else None


def seq2seq_refusal(model: PreTrainedModel) -> str | None:
    """Why the encoder-decoder ``model`` cannot take the static cache (``compile_refusal``), or None."""
    name = type(model).__name__
    positions = positions_for(model)
    if not positions.supported or positions.needs_keys:
        how = "a relative position bias" if positions.needs_keys else "positions of its own"
        return f"{name}'s decoder computes {how} (the compiled path gives positions from a table)"
    if cross_attentions(model) is None:
        return f"{name}'s decoder layers have no BART-style cross-attention (encoder_attn) reading a cache"
    return None

