"""Faster float32 linear kernels for decoding on the CPU (``SPECDEC_LINEAR=auto|on|off``).

A decode step multiplies a few rows (1 for plain decoding, gamma + 1 to verify a draft) by every weight
matrix of the model. ``F.linear(x, W)`` hands that to the BLAS as ``x @ W.T``, and torch's CPU wheel
takes a slow kernel for it on some CPUs: on this project's AMD EPYC (Zen 4, MKL 2024.2 and oneDNN 3.12
in torch 2.13, one thread) a pass over the shipped ``code-target``'s 94 MB of linear weights took
8.1-8.6 ms for 1 row (11 GB/s) and 12-16 ms for 2-8 rows, while the same products computed another way
took 5.0 ms (1-2 rows, 19 GB/s) and 5.0-7.2 ms (3-8 rows): 0.36-0.62 of the time
(``benchmarks/linear_kernels.py`` measures every candidate; MKL's environment knobs changed nothing).
The two other ways, each for a range of the number of rows n:

- n <= ``FEW`` (2): ``W @ x.T`` (the weight as the untransposed left operand: a different BLAS kernel), one
  row padded to two (a one-column product is a matrix-vector product, the slow kernel again);
- n > ``FEW``: oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``) on a copy of the weight prepacked
  into oneDNN's blocked layout (``_reorder_linear_weight``): one more copy of the weights in memory.

Which pays is the CPU's: on an Intel Xeon of this project (AVX-512, 2026-11-25) ``F.linear`` at 1 row was the
fastest (7.5 ms a pass, ``W @ x.T`` 17.5 ms: 2.3x) while oneDNN's prepacked kernel still took 0.73 of its
time at 5 rows and 0.69 at 8. So each range is decided apart (``pays``), and a layer keeps ``F.linear`` for
the other.

Same numbers up to float summation order (as a different batch size or thread count gives), so greedy
decoding matches ``generate`` up to near ties and sampling stays lossless (the verification rule is
unchanged); the tests compare both against the stock kernel.

The mechanism: ``install(model)`` gives each plain ``nn.Linear`` of a float32 CPU model (one whose class
does not override ``forward``, without a forward of its own already set) a forward that dispatches to
those kernels while specdec decodes (inside ``active()``: ``Decoder.step``) and to the stock
``F.linear`` everywhere else: ``generate`` on the same model, training, a ``torch.compile`` trace, a
tensor that needs gradients. specdec's target and drafter handles install it on the models they run.
``SPECDEC_LINEAR`` chooses: ``off`` never installs, ``on`` always does (both ranges), ``auto`` (default) takes
each range's kernel where a short probe at install (a pass over the model's own layers at 1 and at 5 rows,
both ways, interleaved) finds it at most ``PAYS`` of the stock time, so a CPU whose BLAS is fast already keeps it.
The probe reads the weights from memory, as decoding does: before each timed pass it reads a buffer
larger than the CPU's last-level cache (``evictor``). A drafter small enough to stay in that cache between
passes would otherwise be timed warm, which in speculative decoding only its later steps of a round are: the
target's forward streams its own weights between the drafter's rounds. Warm, the stock kernel wins for code-drafter's small
layers at 1 row and the probe decided by noise (5 installs in 8 probes); from memory the fast kernels win
(8 in 8), and in the bench's default run (``--compile on``) the drafter's step took 0.89 ms with them
against 1.51 ms without, the default speculation 4.26 against 4.57 ms per token (docs/benchmarks.md,
"The linear kernels").
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

MODES = ("auto", "on", "off")  # SPECDEC_LINEAR
ENV = "SPECDEC_LINEAR"
PAYS = 0.85  # auto installs when the fast kernels take at most this share of the stock kernel's time
FEW = 2  # up to this many rows, the few-row kernel (W @ x.T); more, the prepacked oneDNN one
PACK_ROWS = 8  # the batch size oneDNN's weight layout is chosen for (measured best for 1-8 rows here)
PROBE_ROWS = (1, 5)  # the probe's row counts: a plain step and a verification of gamma + 1 = 5 tokens
PROBE_REPEATS = 3  # timed repeats per kernel and row count (after one untimed)
EVICT_MIN_BYTES = 64 << 20  # the probe's eviction buffer: twice the last-level cache, at least this
EVICT_MAX_BYTES = 256 << 20  # and at most this (a VM reports its host's cache, shared: 480 MiB on one machine here)
_CACHE_SIZES = "/sys/devices/system/cpu/cpu0/cache"

_ACTIVE = threading.local()  # .depth > 0 while this thread decodes (``active``)
_DECIDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (few, many): which kernels it takes
_PLANS: dict[tuple, tuple[bool, bool]] = {}  # threads and the layers' shapes -> auto's plan (a model loaded again)


def mode() -> str:
    """``SPECDEC_LINEAR`` (auto when unset); a clear error for another value."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: use one of {', '.join(MODES)} (off keeps torch's F.linear everywhere, "
                         "on always uses specdec's linear kernels, auto where a probe at load finds they pay)")
    return value


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


class _Packed:
    """A layer's kernels: which row counts take specdec's (``few``: n <= ``FEW`` rows by ``W @ x.T``; ``many``: more
    rows by oneDNN on the prepacked weight; the others keep ``F.linear``), and the prepacked weight, rebuilt when
    the weight changes (a new tensor or an in-place write)."""

    def __init__(self, few: bool = True, many: bool = True) -> None:
        self.few, self.many = few, many
        self.key: tuple[int, int] | None = None
        self.weight: torch.Tensor | None = None

    def __deepcopy__(self, memo: dict) -> _Packed:
        return _Packed(self.few, self.many)  # a copied layer packs its own weight when first used

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version)
        if key != self.key:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
            self.key = key
        return self.weight

    def __call__(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``rows`` [n, in] @ ``weight``.T (+ bias) by oneDNN on the prepacked weight: [n, out]."""
        return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.get(weight), bias, "none", [], "")


Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (rows [n, in], W, b) -> [n, out]


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: _Packed,
                many: Product | None = None, traced: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the kernel that ``kernel`` (the layer's ``_Packed``) takes for x's row count n
    (see the module doc): where ``kernel.few``, ``W @ x.T`` for n <= ``FEW``, one row padded to two (two columns,
    not a matrix-vector product: an expanded view, stride 0, takes a slower kernel still); where ``kernel.many``,
    ``many(rows, weight, bias)`` for more rows, oneDNN on the prepacked weight (``kernel`` itself; in a trace,
    ``specdec.compiled.traced_linear``'s op that finds the layer's pack); else ``F.linear``. ``traced`` leaves the
    layout of the product of n <= ``FEW`` to inductor; eagerly it is made contiguous, with the bias."""
    rows = x.reshape(-1, x.shape[-1])  # [n, in]
    n = rows.shape[0]
    if n <= FEW and kernel.few:
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
            and weight.dtype == torch.float32 and weight.device.type == "cpu")


def _install_on(module: torch.nn.Linear, packed: _Packed) -> None:
    if not _ours(module):
        module._specdec_packed = packed
        module.forward = types.MethodType(_forward, module)  # a bound method: a deep copy binds to the copy


def installed(model: torch.nn.Module) -> bool:
    """Whether ``install`` gave ``model``'s linear layers any of the fast kernels."""
    return any(_DECIDED.get(model, (False, False)))


def describe(model: torch.nn.Module) -> str:
    """Which kernels ``model``'s linear layers take while specdec decodes, by row count (for the reports)."""
    few, many = _DECIDED.get(model, (False, False))
    if not (few or many):
        return "torch"
    return (f"1-{FEW} rows {'W @ x.T' if few else 'torch'}, "
            f"{FEW + 1}+ rows {'oneDNN prepacked' if many else 'torch'}")


def _pass_time(layers: dict[torch.nn.Linear, _Packed], inputs: dict[int, torch.Tensor], fast: bool) -> float:
    started = time.perf_counter()
    for m, packed in layers.items():
        x = inputs[m.in_features]
        fast_linear(x, m.weight, m.bias, packed) if fast else F.linear(x, m.weight, m.bias)
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
    """A function that reads a buffer larger than the last-level cache (``EVICT_MIN_BYTES`` at least, ``EVICT_MAX_BYTES``
    at most): after it, a model's weights come from memory, as in decoding (see the module doc). The cap: in a
    virtual machine the cache read from sysfs is the host's, shared by its tenants (480 MiB on one of this
    project's machines, where reading 960 MiB before each pass made the probe take 1.7-2.5 s and timed the same
    as reading 256 MiB)."""
    buffer = torch.ones(min(EVICT_MAX_BYTES, max(EVICT_MIN_BYTES, 2 * last_level_cache_bytes())) // 4)
    return lambda: buffer.sum()


@torch.inference_mode()
def pays(layers: dict[torch.nn.Linear, _Packed]) -> tuple[bool, bool]:
    """For few rows and for many (``few``, ``many``: ``PROBE_ROWS``' two counts), whether the fast kernel takes at
    most ``PAYS`` of the stock time over ``layers`` (interleaved, medians, each pass reading the weights from
    memory: ``evictor``), i.e. which of them ``auto`` installs on this machine."""
    stock, fast = [], []
    evict = evictor()
    for rows in PROBE_ROWS:
        inputs = {m.in_features: torch.randn(rows, m.in_features) for m in layers}
        times: tuple[list[float], list[float]] = ([], [])
        for i in range(PROBE_REPEATS + 1):
            for kind, timed in ((False, times[0]), (True, times[1])):
                evict()
                seconds = _pass_time(layers, inputs, kind)
                if i:
                    timed.append(seconds)
        stock.append(statistics.median(times[0]))
        fast.append(statistics.median(times[1]))
    few, many = (f <= PAYS * s for f, s in zip(fast, stock, strict=True))
    return few, many


def install(model: torch.nn.Module) -> bool:
    """Give ``model``'s eligible linear layers the fast kernels, as ``SPECDEC_LINEAR`` says (decided once per
    model, for few rows and for many apart: ``pays``, probed once per process for the same layer shapes and
    threads: a drafter named in every ``speculative_generate`` call is loaded again each time); returns whether
    they have any. Nothing changes outside ``active()``."""
    if model in _DECIDED:
        return installed(model)
    chosen = mode()
    found = [m for m in model.modules() if _eligible(m)] if chosen != "off" and available() else []
    layers = {m: _Packed() for m in found}  # each layer once (a tied head is its own module)
    if not layers:
        plan = (False, False)
    elif chosen == "on":
        plan = (True, True)
    else:  # the probe's answer depends on the layers' shapes and the machine, not the weights: once per process
        shapes = (torch.get_num_threads(), *((m.in_features, m.out_features, m.bias is not None) for m in layers))
        if shapes not in _PLANS:
            _PLANS[shapes] = pays(layers)
        plan = _PLANS[shapes]
    if any(plan):
        for m, kernel in layers.items():
            kernel.few, kernel.many = plan
            _install_on(m, kernel)
    _DECIDED[model] = plan
    return installed(model)
