"""Which float32 kernel computes a decode-shaped ``F.linear`` fastest here: ``python benchmarks/linear_kernels.py``.

Times one pass over every linear layer of a model (its real weights: code-target's 94 MB do not fit the
cache, as in decoding) with n input rows, for each candidate kernel, interleaved (one pass of each in
turn per repeat), medians; every candidate is first checked against a float64 product. Candidates:

- ``F.linear``: what transformers runs (``x @ W.T``: MKL's sgemm / sgemv);
- ``mv``: ``torch.mv(W, x)`` (1 row only);
- ``x @ Wt``: a pre-transposed contiguous copy ``Wt = W.T`` (equivalently F.linear with a column-major W);
- ``(W @ x.T).T``: the weight as the untransposed left operand, 1 row padded to 2;
- ``mkl packed``: ``torch.ops.mkl._mkl_linear`` on ``_mkl_reorder_linear_weight`` (what inductor's
  freezing uses for float32 linears, i.e. specdec's compiled path);
- ``onednn dense`` / ``onednn packed``: ``torch.ops.mkldnn._linear_pointwise`` on the plain weight, or on
  one prepacked by ``_reorder_linear_weight`` for batch size 8;
- ``blocked``: specdec's blocked kernel (``specdec/csrc/blocked_linear.c``: the weight re-laid in blocks of 16
  output columns, streamed once per product, each block's floats multiplied by up to 14 rows in one pass), where a
  C compiler builds it, on the copy ``kernels.blocked_copy`` makes (in bfloat16 pairs where every weight is a
  bfloat16 number: the shipped models, stored in bfloat16); ``blocked float32``: the same kernel on the float32
  copy (``block_weight``), where the two differ;
- ``blocked (other)``: with ``--blocked-source FILE``, that version of the blocked kernel's source, built with the same
  flags as a plain shared library called through ``ctypes`` (``build_other``: specdec runs the shipped one as a torch
  operator, which a process registers once), to time a change to it against the shipped one in one process;
- ``specdec``: ``specdec.kernels.fast_linear`` with both its kernels on (``(W @ x.T).T`` for 1-2 rows, for more the
  first of ``kernels.many_kernels()``: the blocked kernel where it builds, else oneDNN packed).

Findings on this project's CPU (AMD EPYC Zen 4, 2 cores, torch 2.13 CPU wheel: MKL 2024.2, oneDNN 3.12;
one thread; load 0.2-0.9), code-target, ms per pass (share of F.linear):

  rows  F.linear   x @ Wt        (W @ x.T).T   mkl packed    onednn packed  specdec
  1     8.1-8.6    6.2 (0.72)    5.0 (0.61)    6.3 (0.73)    6.6-6.9 (0.80) 5.0 (0.61)
  2     12.2-13.3  8.5 (0.65)    4.9 (0.39)    8.7 (0.68)    7.7-8.0 (0.63) 4.9 (0.39)
  3     15.1-15.9  10.6 (0.67)   7.7 (0.50)    -             5.5-5.8 (0.36) 5.5 (0.36)
  5     12.8-14.2  12.5 (0.96)   9.8 (0.70)    12.5 (0.96)   4.9-5.3 (0.38) 4.9 (0.38)
  8     13.1-14.4  12.9 (0.96)   13.3 (0.97)   12.9 (0.96)   6.8-7.2 (0.51) 6.8 (0.51)

(up to 256 rows oneDNN packed stays faster: 0.58 at 16 rows, 0.75 at 64, 0.85 at 256). ``torch.mv`` is no
faster than F.linear (0.99), nor oneDNN on the unpacked weight (0.81-0.92 at 2-8 rows). The MKL
environment knobs ``MKL_ENABLE_INSTRUCTIONS=AVX512`` or ``AVX2``, ``MKL_DEBUG_CPU_TYPE=5`` and
``MKL_CBWR=AVX2`` changed nothing (within 5%). code-drafter (7.8 MB, in cache): ``(W @ x.T).T`` 0.69 of
F.linear at 1 row and 0.38 at 2, oneDNN packed 0.53-0.75 at 3-8 rows. A one-row product through an
expanded (stride-0) view instead of a copied pair took 3-6x longer: the padding is a real copy.

On an Intel Xeon of this project (AVX-512; 2026-11-25, 1 thread, load about 1; no eviction between passes, so
the weights may come partly from its large shared cache), ms per pass (share of F.linear):

  rows  F.linear  x @ Wt        mkl packed    onednn packed  blocked       specdec (1-2 rows W @ x.T)
  1     9.42      8.79 (0.93)   10.13 (1.08)  11.30 (1.20)   8.96 (0.95)   24.61 (2.61)
  2     11.72     11.53 (0.98)  11.38 (0.97)  12.45 (1.06)   10.45 (0.89)  24.08 (2.05)
  5     20.06     16.02 (0.80)  17.80 (0.89)  13.69 (0.68)   10.45 (0.52)  11.41 (0.57)
  8     24.64     19.61 (0.80)  15.41 (0.63)  15.17 (0.62)   11.43 (0.46)  12.61 (0.51)
  13    31.15     22.90 (0.74)  17.68 (0.57)  18.17 (0.58)   15.08 (0.48)  15.15 (0.49)
  20    27.96     22.68 (0.81)  18.45 (0.66)  19.45 (0.70)   16.54 (0.59)  17.62 (0.63)
  64    46.81     31.27 (0.67)  30.64 (0.65)  34.95 (0.75)   34.13 (0.73)  35.42 (0.76)
  150   85.65     67.39 (0.79)  56.34 (0.66)  64.32 (0.75)   69.25 (0.81)  69.55 (0.81)

(specdec there took the blocked kernel for 3+ rows, the first of ``many_kernels``; ``SPECDEC_LINEAR=auto``'s
probe keeps F.linear for 1-2 rows on this CPU.)
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specdec.kernels import (
    _compiler,
    _Packed,
    bf16_exact,
    block_weight,
    blocked_copy,
    blocked_product,
    fast_linear,
    many_kernels,
)
from specdec.kernels import blocked as blocked_kernel
from specdec.loading import load_model


class Other(NamedTuple):
    """Another version of the blocked kernel, loaded through ctypes: its C function, the width of its weight blocks and
    its bfloat16 form (None where that source has none)."""

    function: Callable[..., None]
    lanes: int
    pairs: Callable[..., None] | None


def build_other(source: Path) -> Other | None:
    """``source`` (a version of ``specdec/csrc/blocked_linear.c``) built with the machine's C compiler as specdec builds
    the shipped one (``-O3 -march=native``) into a temporary folder and loaded; None where it cannot be built."""
    compiler = _compiler()
    if compiler is None:
        return None
    built = Path(tempfile.mkdtemp()) / "blocked_other.so"
    try:
        subprocess.run([compiler, "-O3", "-march=native", "-shared", "-fPIC", "-o", str(built), str(source)],
                       check=True, capture_output=True, timeout=120)
        library = ctypes.CDLL(str(built))
        function = library.specdec_blocked_linear
        function.argtypes, function.restype = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3, None
        pairs = getattr(library, "specdec_blocked_linear_bf16", None)  # absent from an older source
        if pairs is not None:
            pairs.argtypes, pairs.restype = function.argtypes, None
        return Other(function, int(library.specdec_lanes()), pairs)
    except (OSError, subprocess.SubprocessError, AttributeError):
        return None


def other_product(other: Other, rows: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``rows`` [n, in] (contiguous) times a weight laid out for ``other`` by its kernel: [n, out]."""
    out = rows.new_empty(rows.shape[0], out_features)
    function = other.pairs if packed.dtype == torch.bfloat16 else other.function
    function(rows.data_ptr(), packed.data_ptr(), None, out.data_ptr(), rows.shape[0], out_features, rows.shape[1])
    return out


def _left(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    pair = torch.cat([x, x]) if x.shape[0] == 1 else x
    return (w @ pair.T).T[: x.shape[0]]


def candidates(weights: list[torch.Tensor], rows: int,
               other: Other | None = None) -> dict[str, Callable[[torch.Tensor, int], torch.Tensor]]:
    """name -> f(x, i) computing x @ weights[i].T by that kernel (prepared state made here); ``other``: another
    build of the blocked kernel (``--blocked-source``), timed beside the shipped one as "blocked (other)"."""
    transposed = [w.t().contiguous() for w in weights]
    mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
    packed = [_Packed() for _ in weights]
    blocked = [_Packed(many="blocked") for _ in weights] if "blocked" in many_kernels() else []
    found: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "F.linear": lambda x, i: F.linear(x, weights[i]),
        "x @ Wt": lambda x, i: x @ transposed[i],
        "(W @ x.T).T": lambda x, i: _left(x, weights[i]),
        "mkl packed": lambda x, i: torch.ops.mkl._mkl_linear(x, mkl[i], weights[i], None, rows),
        "onednn dense": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, weights[i], None, "none", [], ""),
        "onednn packed": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
        "specdec": lambda x, i: fast_linear(x, weights[i], None, packed[i]),
    }
    if blocked:
        found["blocked"] = lambda x, i: blocked[i](x, weights[i], None)
        if any(bf16_exact(w) for w in weights):
            full = [block_weight(w, blocked_kernel().lanes) for w in weights]
            found["blocked float32"] = lambda x, i: blocked_product(blocked_kernel(), x, full[i], weights[i].shape[0])
    if other is not None:
        laid = [blocked_copy(w, other.lanes) if other.pairs is not None else block_weight(w, other.lanes)
                for w in weights]  # the shipped kernel's copy (bfloat16 pairs where exact), where the other has it
        found["blocked (other)"] = lambda x, i: other_product(other, x, laid[i], weights[i].shape[0])
    if rows == 1:
        found["mv"] = lambda x, i: torch.mv(weights[i], x[0])[None]
    return found


@torch.inference_mode()
def measure(weights: list[torch.Tensor], rows: int, repeats: int, other: Other | None = None) -> dict[str, float]:
    """Median ms of one pass over ``weights`` per candidate, interleaved; each checked against float64 first."""
    inputs = [torch.randn(rows, w.shape[1]) for w in weights]
    kernels = candidates(weights, rows, other)
    for name, kernel in kernels.items():
        for i, (x, w) in enumerate(zip(inputs, weights)):
            reference = x.double() @ w.double().T
            torch.testing.assert_close(kernel(x, i).double(), reference, rtol=1e-5, atol=1e-4, msg=name)
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for r in range(repeats + 2):
        for name, kernel in kernels.items():
            started = time.perf_counter()
            for i, x in enumerate(inputs):
                kernel(x, i)
            if r >= 2:
                times[name].append(time.perf_counter() - started)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="code-target", help="a shipped name or a model folder")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 8])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--blocked-source", type=Path, default=None, metavar="FILE",
                        help="another version of csrc/blocked_linear.c to time beside the shipped one, e.g. "
                        "<(git show COMMIT:specdec/csrc/blocked_linear.c)")
    args = parser.parse_args()
    other = None
    if args.blocked_source is not None:
        copy = Path(tempfile.mkdtemp()) / "blocked_linear.c"  # a file the compiler can read again (not a pipe)
        copy.write_text(args.blocked_source.read_text())
        other = build_other(copy)
        if other is None:
            parser.error(f"could not build {args.blocked_source} (a C compiler is needed)")
    torch.set_num_threads(1)
    model = load_model(args.model, dtype=torch.float32)
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    print(f"{args.model}: {len(weights)} layers, {sum(w.numel() for w in weights) * 4 / 1e6:.1f} MB, 1 thread, "
          f"{args.repeats} repeats; ms per pass (share of F.linear)")
    for rows in args.rows:
        found = measure(weights, rows, args.repeats, other)
        stock = found["F.linear"]
        print(f"rows {rows}: " + ", ".join(f"{name} {ms:.2f} ({ms / stock:.2f})" for name, ms in found.items()))


if __name__ == "__main__":
    main()
