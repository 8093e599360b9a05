"""Faster float32 linear kernels for decoding on the CPU (``SPECDEC_LINEAR=auto|on|off``).

A decode step multiplies a few rows (1 for plain decoding, gamma + 1 to verify a draft) by every weight
matrix, so its time is reading the weights. ``F.linear(x, W)`` hands that to the BLAS as ``x @ W.T``, for
which torch's CPU wheel takes a slow kernel on some CPUs. Per range of the number of rows n, another way: for
n <= ``FEW``, ``W @ x.T`` (one row padded to two); for more, on a copy of the weight in its own layout
(``_Packed.many``), ``blocked`` (specdec's ``csrc/blocked_linear.c``: the weight in blocks of 16 output
columns, streamed once for up to 14 rows, a bfloat16-exact weight read as bfloat16; offered to models of
``STREAMED_BYTES`` or more) or ``onednn`` (oneDNN's prepacked linear). Which pays is the CPU's, so each range
is decided apart (``pays``).

Contract: the same numbers up to float summation order (as another batch size gives), so greedy decoding
matches ``generate`` up to near ties and sampling stays lossless; the tests compare against the stock kernel.
``install(model)`` gives each plain ``nn.Linear`` of a float32 CPU model a forward that takes these kernels
only inside ``active()`` (``Decoder.step``) and the stock ``F.linear`` everywhere else (``generate``,
training, a trace, gradients); specdec's target and drafter handles install it unless the call or session says
``kernels="off"``. The blocked kernel is built once per machine, at first use, as the torch operator
``specdec::blocked_linear`` (``blocked_op``), the one build eager and compiled steps call. ``off`` never
installs, ``on`` always does, ``auto`` takes a range's kernel where a probe at install, reading the weights
from memory as decoding does (``evictor``), finds it at most ``PAYS`` of the stock time; the answer is kept in
``plans.json``, so a probe timed beside other work cannot flip a compiled model's kernels, and with them its
graphs, from one process to the next. The helpers
(``SPECDEC_HELPER=auto|on|off``) share the operators' large products with idle-priority threads, one for each
core beyond torch's threads: the same floats whichever thread computes them, and no share ever waited for. The
measurements:
docs/journal/kernels.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specdec.config import SWITCHES, c_compiler, switch
from specdec.folders import cache_root
from specdec.native_build import cached_library, cpu_flags, cxx

ENV = "SPECDEC_LINEAR"  # auto|on|off (declared in ``config.SWITCHES``)
HELPER_ENV = "SPECDEC_HELPER"  # auto|on|off: the blocked operator's helper thread (``helper``; ``config.SWITCHES``)
MODES = SWITCHES[ENV].values
PAYS = 0.85  # auto installs when the fast kernels take at most this share of the stock kernel's time
FEW = 2  # up to this many rows, the few-row kernel (W @ x.T); more, a kernel of ``MANY``
# The blocked kernel is offered to models of at least this many bytes of linear weights: they stream them from
# memory at every step, where reading them once per product pays. A smaller model's weights stay in the CPU's
# caches between steps, where torch's kernel compiled into the graph was faster: translate-target (27 MB) decoded
# its compiled prompt lookup in 2.12-2.39 ms a token with the blocked kernel against 1.87-2.05 with torch's (two
# processes, each both models interleaved, 7 repeats), while the probe, which reads the weights from memory,
# chose the blocked one.
STREAMED_BYTES = 64 << 20
PACK_ROWS = 8  # the batch size oneDNN's weight layout is chosen for (measured best for 1-8 rows here)
PROBE_ROWS = (1, 5)  # the probe's row counts: a plain step and a verification of gamma + 1 = 5 tokens
PROBE_REPEATS = 3  # timed repeats per kernel and row count (after one untimed)
EVICT_MIN_BYTES = 64 << 20  # the probe's eviction buffer: twice the last-level cache, at least this
EVICT_MAX_BYTES = 256 << 20  # and at most this (a VM reports its host's cache, shared: 480 MiB on one machine here)
_CACHE_SIZES = "/sys/devices/system/cpu/cpu0/cache"
_SOURCE = Path(__file__).with_name("csrc") / "blocked_linear.c"  # the blocked kernel (``blocked``)
_BUILT: dict[str, object] = {}  # "op": whether the operator loaded, "kernel": its ``Blocked``; once per process

_ACTIVE = threading.local()  # .depth > 0 while this thread decodes (``active``)
_DECIDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (few, many): which kernels it takes
_PLANS: dict[tuple, tuple[bool, str | None]] = {}  # threads and the layers' shapes ->
                                                   # auto's plan (a model loaded again)
PLANS_FILE = "plans.json"  # auto's plans kept between processes, in the kernels' cache folder


def mode() -> str:
    """``SPECDEC_LINEAR`` (auto when unset); a clear error for another value (``config.switch``)."""
    return switch(ENV)


def helper_mode() -> str:
    """``SPECDEC_HELPER`` (auto when unset); a clear error for another value (``config.switch``)."""
    return switch(HELPER_ENV)


def helpers_wanted(threads: int | None = None, usable: int | None = None) -> int:
    """How many helper threads share the operators' products (``csrc/blocked_op.cpp``: threads at the scheduler's idle
    priority that take shares of a product's columns, never waited for): one for each core this process may use
    beyond torch's ``threads`` (its count now); ``SPECDEC_HELPER`` off: none, on: at least one."""
    chosen = helper_mode()
    if chosen == "off":
        return 0
    from specdec.threads import usable_cores

    spare = (usable_cores() if usable is None else usable) - (torch.get_num_threads() if threads is None else threads)
    return max(spare, 1 if chosen == "on" else 0)


def helper_wanted(threads: int | None = None, usable: int | None = None) -> bool:
    """Whether any helper thread shares the operators' products (``helpers_wanted``)."""
    return helpers_wanted(threads, usable) > 0


_HELPER: list[int] = [0]  # how many helpers specdec set working (``helper``, ``_build_op``)


def helper() -> bool:
    """Start or park the helpers as ``helpers_wanted`` says now (torch's thread count may have changed since the
    operator loaded: ``install`` calls it for every model); whether any works. False where the operator is not
    loaded."""
    wanted = helpers_wanted()  # a bad SPECDEC_HELPER is refused whether or not the operator is loaded
    if not _BUILT.get("op"):
        return False
    _set_helpers(wanted)
    return helper_on()


def _set_helpers(count: int) -> None:
    torch.ops.specdec.helpers(count)
    _HELPER[0] = count


def _set_helper(on: bool) -> None:
    """One helper at least (the count ``helpers_wanted`` gives, where more), or none."""
    _set_helpers(max(1, helpers_wanted()) if on else 0)


def helper_count() -> int:
    """How many helper threads share the operators' products now."""
    return _HELPER[0] if _BUILT.get("op") else 0


def helper_on() -> bool:
    """Whether the operators share their products with helper threads now."""
    return helper_count() > 0


def decoding_cores() -> int:
    """The cores specdec decodes on now: torch's threads, and the helpers where they share a decoded model's products
    (``shares``); the bench gives a peer engine as many threads."""
    return torch.get_num_threads() + (helper_count() if shares() else 0)


def shares(model: torch.nn.Module | None = None) -> bool:
    """Whether ``model``'s eager linear products (None: any model's this process decodes), its prefill's among them,
    are shared with the helper threads: a helper is on and the model's plan takes the blocked kernel (products of
    128 KiB of weight or more), or its torchao layers the quantized one (``qlinear``). A compiled step traces every
    eligible linear as the operator whatever the plan (``compiled.trace_kernels``), so its products are shared either
    way."""
    from specdec import qlinear

    plans = [_DECIDED.get(model, (False, None))] if model is not None else list(_DECIDED.values())
    quantized = qlinear.installed(model) > 0 if model is not None else qlinear.any_installed()
    return helper_on() and (quantized or any(many == "blocked" for _, many in plans))


def available() -> bool:
    """Whether this torch has the oneDNN linear op with prepacked weights."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_linear_pointwise")
            and hasattr(mkldnn, "_reorder_linear_weight"))


@contextmanager
def active() -> Iterator[None]:
    """Within the block, installed layers run the fast kernels (on this thread)."""
    _ACTIVE.depth = getattr(_ACTIVE, "depth", 0) + 1
    try:
        yield
    finally:
        _ACTIVE.depth -= 1


def _active() -> bool:
    return getattr(_ACTIVE, "depth", 0) > 0


class Blocked(NamedTuple):
    """The blocked kernel, loaded (as the operator ``specdec::blocked_linear``, ``blocked_op``): the width of its weight
    blocks (``lanes`` output columns) and the library it was loaded from."""

    lanes: int
    path: Path




def blocked() -> Blocked | None:
    """The blocked kernel (``csrc/blocked_linear.c``), which specdec runs as the operator ``specdec::blocked_linear``
    (``blocked_op``: built at first use, loaded once per process); ``None`` where the operator cannot be built (no C
    or C++ compiler, torch without its headers, another OS), and oneDNN's kernel serves."""
    return _BUILT.get("kernel") if blocked_op() else None  # type: ignore[return-value]


_OP_SOURCE = Path(__file__).with_name("csrc") / "blocked_op.cpp"  # the blocked kernel as a torch operator
_ATTENTION_SOURCE = Path(__file__).with_name("csrc") / "attention.c"  # specdec::decode_attention's kernel
_QUANT_SOURCE = Path(__file__).with_name("csrc") / "quantized_linear.c"  # specdec::quantized_linear's (qlinear)
_OP_LOADED: list[Path] = []  # the operator's library, once loaded into this process


def blocked_op() -> bool:
    """Whether specdec's operators are loaded (``csrc/blocked_op.cpp``, which inductor's C++ wrapper calls
    through the dispatcher): ``torch.ops.specdec.blocked_linear`` (the blocked kernel) and
    ``torch.ops.specdec.decode_attention`` (``csrc/attention.c``: ``specdec.compiled.specdec_attention``).
    Built at first use with the machine's C and C++ compilers against this torch's headers into
    ``~/.cache/specdec/kernels`` (keyed by the sources, the compilers, the CPU's flags and torch's version),
    loaded once per process; False where they cannot be built or loaded (no C++ compiler, torch without its
    headers, another OS), and the compiled step traces the kernels and the attention it traced before."""
    if "op" not in _BUILT:
        _BUILT["op"] = _build_op()
    return bool(_BUILT["op"])


def _build_op() -> bool:
    compiler, cxx_path = c_compiler(), cxx()
    include = Path(torch.__file__).with_name("include")
    if compiler is None or cxx_path is None or platform.system() != "Linux" or not include.is_dir():
        return False
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)

    def commands(folder: Path, built: Path) -> list[list[tuple[list[str], int]]]:
        objects = [folder / "blocked_linear.o", folder / "attention.o", folder / "quantized.o", folder / "op.o"]
        compiles = [([compiler, "-O3", "-march=native", "-fPIC", "-c", str(source), "-o", str(built_object)], 300)
                    for source, built_object in zip((_SOURCE, _ATTENTION_SOURCE, _QUANT_SOURCE), objects)]
        compiles.append(([cxx_path, "-O2", "-std=c++20", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}",
                          f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", "-c", str(_OP_SOURCE), "-o",
                          str(objects[3])], 300))
        link = [cxx_path, "-shared", *map(str, objects), f"-L{include.with_name('lib')}", "-ltorch_cpu", "-lc10", "-o",
                str(built)]
        return [compiles, [(link, 120)]]

    try:
        sources = [s.read_text() for s in (_SOURCE, _ATTENTION_SOURCE, _QUANT_SOURCE, _OP_SOURCE)]
        path = cached_library("blocked_op", [*sources, torch.__version__, str(abi)],
                               [compiler, cxx_path], commands)
        if not _OP_LOADED:  # an operator is registered once per process (a second library defining it aborts)
            torch.ops.load_library(str(path))
            torch.library.register_fake("specdec::blocked_linear")(_blocked_fake)
            torch.library.register_fake("specdec::decode_attention")(_attention_fake)
            torch.library.register_fake("specdec::quantized_linear")(lambda x, *a: x.new_empty(x.shape[0], a[-2]))
            _OP_LOADED.append(path)
        _set_helpers(helpers_wanted())
        _BUILT["kernel"] = Blocked(int(torch.ops.specdec.lanes()), path)
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return False
    return True


def _blocked_fake(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def _attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    rows, heads, tokens, dim = query.shape
    return query.new_empty(rows, tokens, heads, dim)


def block_weight(weight: torch.Tensor, lanes: int) -> torch.Tensor:
    """``weight`` [out, in] re-laid for the blocked kernel: [ceil(out / lanes), in, lanes], zero rows padding the
    last block."""
    out, width = weight.shape
    padded = torch.cat((weight, weight.new_zeros(-out % lanes, width))) if out % lanes else weight
    return padded.reshape(-1, lanes, width).transpose(1, 2).contiguous()


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of the float32 ``weight`` is a bfloat16 number (the low 16 bits of each zero), as in a model
    stored in bfloat16 and loaded in float32 (the shipped models)."""
    return weight.dtype == torch.float32 and not bool((weight.detach().view(torch.int32) & 0xFFFF).any())


def pair_weight(weight: torch.Tensor, lanes: int) -> torch.Tensor:
    """A bfloat16-exact ``weight`` [out, in] (``bf16_exact``) laid out for the blocked kernel at half the bytes:
    ``block_weight``'s blocks taken in pairs, [ceil(out / lanes / 2), in, lanes, 2] bfloat16, so that each 32-bit
    word (little-endian) holds block 2p's weight in its upper half and block 2p + 1's in its lower, an odd last block
    paired with zeros (``csrc/blocked_linear.c``, ``specdec_blocked_linear_bf16``)."""
    blocks = block_weight(weight, lanes)  # [B, in, lanes]
    if blocks.shape[0] % 2:
        blocks = torch.cat((blocks, blocks.new_zeros(1, *blocks.shape[1:])))
    return torch.stack((blocks[1::2], blocks[0::2]), dim=-1).to(torch.bfloat16)


def blocked_copy(weight: torch.Tensor, lanes: int) -> torch.Tensor:
    """The copy of ``weight`` the blocked kernel reads: in bfloat16 pairs (``pair_weight``) where every weight
    is a bfloat16 number, which the kernel widens back to exactly those float32 numbers as it reads them (the
    results are the float32 copy's, from half the bytes, and a decode step's time is reading its weights; the
    times: docs/journal/kernels.md); else ``block_weight``."""
    if sys.byteorder == "little" and bf16_exact(weight):
        return pair_weight(weight, lanes)
    return block_weight(weight, lanes)


def blocked_product(kernel: Blocked, rows: torch.Tensor, packed: torch.Tensor, out_features: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``rows`` [n, in] (contiguous) times a weight laid out by ``blocked_copy`` for ``kernel`` (+ bias): [n, out], by
    the operator ``specdec::blocked_linear``, which shares the product with its helper (``helper``): the same floats
    whichever thread computes them."""
    return torch.ops.specdec.blocked_linear(rows, packed, None if bias is None else bias.contiguous(), out_features)


MANY = ("blocked", "onednn")  # the kernels of more than ``FEW`` rows, in the order ``on`` prefers them


def many_kernels(weight_bytes: float = math.inf) -> tuple[str, ...]:
    """The kernels of more than ``FEW`` rows this machine has for a model of ``weight_bytes`` of linear weights:
    ``blocked`` where it builds and the model streams its weights from memory (at least ``STREAMED_BYTES``),
    ``onednn``."""
    return tuple(k for k in MANY if k != "blocked" or (weight_bytes >= STREAMED_BYTES and blocked() is not None))


def weight_key(weight: torch.Tensor) -> tuple[int, int]:
    """What a copy of ``weight`` in another layout is kept current by: its storage and its version (a new tensor or an
    in-place write changes it)."""
    return weight.data_ptr(), weight._version


class _Packed:
    """A layer's kernels: which row counts take specdec's (``few``: n <= ``FEW`` rows by ``W @ x.T``; ``many``: more
    rows by the named kernel, ``blocked`` or ``onednn``; the others keep ``F.linear``), and its copy of the weight
    in that kernel's layout, rebuilt when the weight changes (a new tensor or an in-place write)."""

    def __init__(self, few: bool = True, many: str | None = "") -> None:
        self.few = few
        self.many = (many_kernels()[0] if many == "" else many) or None  # "": the best this machine has
        self.key: tuple[int, int, str | None] | None = None
        self.weight: torch.Tensor | None = None

    def __deepcopy__(self, memo: dict) -> _Packed:
        return _Packed(self.few, self.many)  # a copied layer packs its own weight when first used

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (*weight_key(weight), self.many)
        if key != self.key:
            if self.many == "blocked":
                self.weight = blocked_copy(weight.detach(), blocked().lanes)
            else:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
            self.key = key
        return self.weight

    def __call__(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``rows`` [n, in] @ ``weight``.T (+ bias) by the layer's kernel of many rows: [n, out]."""
        rows = rows.contiguous()
        if self.many != "blocked":
            return torch.ops.mkldnn._linear_pointwise(rows, self.get(weight), bias, "none", [], "")
        return blocked_product(blocked(), rows, self.get(weight), weight.shape[0], bias)


Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (rows [n, in], W, b) -> [n, out]


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: _Packed,
                many: Product | None = None, traced: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the kernel that ``kernel`` (the layer's ``_Packed``) takes for x's row count n
    (see the module doc): where ``kernel.few``, ``W @ x.T`` for n <= ``FEW``, one row padded to two (two columns,
    not a matrix-vector product: an expanded view, stride 0, takes a slower kernel still); where ``kernel.many``,
    ``many(rows, weight, bias)`` for more rows, the layer's kernel of many rows on its copy of the weight
    (``kernel`` itself; in a trace, ``specdec.compiled.traced_linear``'s op that finds the layer's copy); else
    ``F.linear``. Where the kernel of many rows is the blocked one, it serves every n: it reads its copy once
    whatever the rows, as a compiled step's operator does (``python benchmarks/linear_kernels.py``, code-target, 1-2
    rows: 0.26-0.36 of ``F.linear``'s time on its bfloat16 pairs, 0.43-0.62 on the float32 copy on this project's AMD
    EPYC; 0.89-0.95 on the float32 copy on its Intel Xeon). ``traced`` leaves the layout of the product of n <= ``FEW``
    to inductor; eagerly it is made contiguous, with the bias."""
    rows = x.reshape(-1, x.shape[-1])  # [n, in]
    n = rows.shape[0]
    if kernel.many == "blocked" and n > 0:
        out = (many or kernel)(rows, weight, bias)
    elif n <= FEW and kernel.few:
        rows = rows.contiguous()  # one layout: the BLAS sums a transposed operand in another order (AMD EPYC, AVX2)
        pair = torch.cat((rows, rows)) if n == 1 else rows  # [2, in]
        product = torch.mm(weight, pair.T)  # [out, 2]
        if traced:
            out = product.T[:n]  # [n, out], a view
            out = out + bias if bias is not None else out
        elif n == 1:
            out = product.select(1, 0)  # [out]
            out = out.contiguous() if bias is None else out + bias
        else:
            out = product.T.contiguous()  # [2, out]
            if bias is not None:
                out += bias
    elif n > FEW and kernel.many:
        out = (many or kernel)(rows, weight, bias)
    else:
        return F.linear(x, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An installed layer's forward: the fast kernels inside ``active()``, else ``nn.Linear``'s own."""
    weight, bias = self.weight, self.bias
    if (getattr(_ACTIVE, "depth", 0) > 0 and x.dtype is torch.float32 and weight.dtype is torch.float32
            and x.is_cpu and weight.is_cpu and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return fast_linear(x, weight, bias, self._specdec_packed)
    return F.linear(x, weight, bias)


def _ours(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs ``_forward`` already (installed, or a deep copy of an installed layer)."""
    return getattr(vars(module).get("forward"), "__func__", None) is _forward


def _eligible(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward
            and ("forward" not in vars(module) or _ours(module)) and isinstance(weight, torch.Tensor)
            and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and type(weight) in (torch.Tensor, torch.nn.Parameter))  # not a quantized subclass: specdec.quantized


def _install_on(module: torch.nn.Linear, packed: _Packed) -> None:
    if not _ours(module):
        module._specdec_packed = packed
        module.forward = types.MethodType(_forward, module)  # a bound method: a deep copy binds to the copy


def installed(model: torch.nn.Module) -> bool:
    """Whether ``install`` gave ``model``'s linear layers any of the fast kernels."""
    from specdec.qlinear import installed as quantized

    return any(_DECIDED.get(model, (False, None))) or quantized(model) > 0


def bytes_read(module: torch.nn.Module) -> int | None:
    """The bytes of weights an installed layer's kernel reads for a one-row product inside ``active()``: its copy for
    the blocked kernel (half the float32 weight's where it is in bfloat16 pairs, ``blocked_copy``), else the weight's
    (``W @ x.T`` or ``F.linear``); None for a layer not installed."""
    packed = vars(module).get("_specdec_packed")
    if not _ours(module) or not isinstance(packed, _Packed):
        return None
    weight = packed.get(module.weight) if packed.many == "blocked" else module.weight
    return weight.numel() * weight.element_size()


NAMES = {"blocked": "specdec blocked", "onednn": "oneDNN prepacked", None: "torch"}  # a kernel of many rows, reported


def describe(model: torch.nn.Module) -> str:
    """Which kernels ``model``'s linear layers take while specdec decodes, by row count (for the reports)."""
    few, many = _DECIDED.get(model, (False, None))
    if not (few or many):
        return "torch"
    if many == "blocked":
        return f"{NAMES[many]}, every row count"
    return f"1-{FEW} rows {'W @ x.T' if few else 'torch'}, {FEW + 1}+ rows {NAMES[many]}"


def _pass_time(layers: dict[torch.nn.Linear, _Packed], inputs: dict[int, torch.Tensor], kernel: str | None) -> float:
    """One pass over ``layers`` by ``kernel`` (``None``: ``F.linear``; ``few``, or a kernel of ``MANY``: the
    layers' ``_Packed``, set to it), in seconds."""
    started = time.perf_counter()
    for m, packed in layers.items():
        x = inputs[m.in_features]
        fast_linear(x, m.weight, m.bias, packed) if kernel else F.linear(x, m.weight, m.bias)
    return time.perf_counter() - started


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from Linux's sysfs (0 where it is not found)."""
    sizes = [0]
    for level in Path(_CACHE_SIZES).glob("index*/size"):
        try:
            text = level.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return max(sizes)


def evictor() -> Callable[[], None]:
    """A function that reads a buffer larger than the last-level cache (``EVICT_MIN_BYTES`` at least,
    ``EVICT_MAX_BYTES`` at most): after it, a model's weights come from memory, as in decoding (see the module
    doc). The cap: in a virtual machine the cache read from sysfs is the host's, shared by its tenants, and
    reading twice that before each pass makes the probe slow without timing anything differently
    (docs/journal/kernels.md)."""
    buffer = torch.ones(min(EVICT_MAX_BYTES, max(EVICT_MIN_BYTES, 2 * last_level_cache_bytes())) // 4)
    return lambda: buffer.sum()


@torch.inference_mode()
def pays(layers: dict[torch.nn.Linear, _Packed]) -> tuple[bool, str | None]:
    """Which fast kernels ``auto`` installs on this machine: for few rows (``PROBE_ROWS[0]``), whether ``W @ x.T`` takes
    at most ``PAYS`` of the stock time over ``layers``; for many (``PROBE_ROWS[1]``), the kernel of ``many_kernels``
    with the smallest share of the stock time, if at most ``PAYS``, else ``None``. Each kernel is timed against the
    stock one, interleaved, medians, each pass reading the weights from memory (``evictor``); one kernel's copies
    of the weights at a time (each is dropped before the next is built)."""
    evict = evictor()

    def share(rows: int, kernel: str) -> float:
        for packed in layers.values():
            packed.few, packed.many = kernel == "few", None if kernel == "few" else kernel
            packed.weight = packed.key = None
        inputs = {m.in_features: torch.randn(rows, m.in_features) for m in layers}
        times: tuple[list[float], list[float]] = ([], [])
        for i in range(PROBE_REPEATS + 1):
            for which, timed in ((None, times[0]), (kernel, times[1])):
                evict()
                seconds = _pass_time(layers, inputs, which)
                if i:
                    timed.append(seconds)
        for packed in layers.values():
            packed.weight = packed.key = None
        return statistics.median(times[1]) / statistics.median(times[0])

    few = share(PROBE_ROWS[0], "few") <= PAYS
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    shares = {kernel: share(PROBE_ROWS[1], kernel) for kernel in many_kernels(weight_bytes)}
    best = min(shares, key=shares.__getitem__)
    return few, best if shares[best] <= PAYS else None


def plans_path() -> Path:
    """Where ``auto``'s plans are kept between processes: ``~/.cache/specdec/kernels/plans.json``."""
    return cache_root() / "kernels" / PLANS_FILE


def _plan_key(shapes: tuple, offered: tuple[str, ...]) -> str:
    """What a probe's answer depends on: the machine (its CPU's flags), torch, the threads and the layers' shapes
    (``shapes``), the kernels offered for many rows, the blocked kernel's source where offered and the probe's rule."""
    source = _SOURCE.read_text() if "blocked" in offered else ""
    parts = [torch.__version__, cpu_flags(), shapes, offered, PAYS, PROBE_ROWS, source]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _kept_plan(key: str, offered: tuple[str, ...]) -> tuple[bool, str | None] | None:
    """The plan kept under ``key``, or None where there is none, the file is unreadable, or it names a kernel not
    offered now."""
    try:
        few, many = json.loads(plans_path().read_text())[key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (few, many) if isinstance(few, bool) and (many is None or many in offered) else None


def _keep_plan(key: str, plan: tuple[bool, str | None]) -> None:
    """Add ``plan`` under ``key`` to the kept plans (a file that is not a JSON object is replaced; written whole,
    then renamed into place, as the project's other caches are; a cache that cannot be written is left as it is:
    probed again next time)."""
    path = plans_path()
    try:
        plans = json.loads(path.read_text())
    except (OSError, ValueError):
        plans = {}
    plans = {**(plans if isinstance(plans, dict) else {}), key: list(plan)}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # atomic: processes starting together may both write it
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(plans))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _planned(layers: dict[torch.nn.Linear, _Packed]) -> tuple[bool, str | None]:
    """``auto``'s plan for ``layers``: this process's, else the one kept for this machine, else probed (``pays``) and
    kept."""
    shapes = (torch.get_num_threads(), *((m.in_features, m.out_features, m.bias is not None) for m in layers))
    if shapes not in _PLANS:
        offered = many_kernels(sum(m.weight.numel() * m.weight.element_size() for m in layers))
        key = _plan_key(shapes, offered)
        plan = _kept_plan(key, offered)
        if plan is None:
            plan = pays(layers)
            _keep_plan(key, plan)
        _PLANS[shapes] = plan
    return _PLANS[shapes]


def install(model: torch.nn.Module) -> bool:
    """Give ``model``'s eligible linear layers the fast kernels, as ``SPECDEC_LINEAR`` says (decided once per
    model, for few rows and for many apart: ``pays``, probed once per machine for the same layer shapes and
    threads, ``_planned``: a drafter named in every ``speculative_generate`` call is loaded again each time, and
    each process of a server or a bench would otherwise probe again); returns whether
    they have any. Nothing changes outside ``active()``."""
    helper()
    if model in _DECIDED:
        return installed(model)
    chosen = mode()
    from specdec import qlinear  # torchao int8/int4 linears: the quantized kernel (qlinear), else their own forward
    qlinear.install(model, chosen, blocked_op, _active)
    found = [m for m in model.modules() if _eligible(m)] if chosen != "off" and available() else []
    layers = {m: _Packed(many=None) for m in found}  # each layer once (a tied head is its own module); the plan sets
    # its kernels below: a smaller model than ``STREAMED_BYTES`` never asks for the blocked kernel, nor builds it
    if not layers:
        plan: tuple[bool, str | None] = (False, None)
    elif chosen == "on":
        plan = (True, many_kernels()[0])
    else:  # the probe's answer depends on the layers' shapes and the machine, not the weights: once per machine
        plan = _planned(layers)
    if any(plan):
        for m, kernel in layers.items():
            kernel.few, kernel.many = plan
            _install_on(m, kernel)
    _DECIDED[model] = plan
    return installed(model)
