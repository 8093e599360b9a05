"""Does the compiled path gain from specdec's linear kernels? ``python benchmarks/compiled_kernels.py``.

Times a model's decode step (1 new token: plain decoding; 5: the verification of gamma 4) four ways,
interleaved (one step of each in turn per repeat; each step rolled back, so every step sees the same
cached prompt), medians:

- ``eager``: the ``RaggedCache`` step with torch's ``F.linear`` (``SPECDEC_LINEAR=off``);
- ``eager+kernels``: the same inside ``kernels.active()`` (what ``Decoder.step`` runs);
- ``compiled``: the shipped ``--compile on`` step (``specdec.compiled``: inductor with freezing, whose
  weight packing turns every linear into MKL's packed ``_mkl_linear``) on its ``StaticRaggedCache``;
- ``compiled+kernels``: the same step traced with the linears written as the kernels compute them
  (``W @ x.T`` for 1-2 rows, an extern ``mm`` that freezing's packing leaves alone; oneDNN on the
  prepacked weight for more rows, through a custom op here, since oneDNN's packed tensors have no fake
  form for the trace to see).

``--slots`` sets the static cache's slots per row (every compiled forward attends all of them; the
shipped width is ``SLOTS + SLOT_SLACK`` = 528).

Findings (docs/benchmarks.md, "Compiled decoding with the linear kernels"), code-target, one thread,
80 cached tokens, 15 repeats, ms per step (share of eager+kernels):

  slots  load    tokens  eager  eager+kernels  compiled      compiled+kernels
  528    4.8-6.7 1       23.9   16.7           15.6 (0.93)   15.4 (0.92)
  528    5.1-6.1 1       22.7   16.8           14.5 (0.86)   14.7 (0.88)
  528    4.8-6.7 5       37.8   18.5           22.0 (1.19)   22.5 (1.22)
  528    5.1-6.1 5       36.6   19.4           20.2 (1.04)   20.0 (1.03)
  144    4.8-5.2 1       25.5   18.0           14.6 (0.81)   12.6 (0.70)
  144    4.8-5.2 5       40.9   23.7           22.0 (0.93)   20.4 (0.86)

At the shipped width the kernels' formulation changes nothing in the compiled step (0.99-1.02 of the
shipped compiled step): a torch profile of the 5-token step puts a quarter of its time in
``_scaled_dot_product_flash_attention_for_cpu`` (about 1 ms a layer: 5 queries over 528 masked slots),
which eager decoding, attending only the cached tokens, does not pay. With narrower caches the compiled
step gains (0.70 / 0.86 of eager+kernels at 144 slots), but the path has one width per model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import types
import weakref
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from specdec import kernels
from specdec.cache import RaggedCache
from specdec.compiled import SLOT_SLACK, SLOTS, CompiledModel, Shape, StaticRaggedCache
from specdec.loading import load_model

VARIANTS = ("eager", "eager+kernels", "compiled", "compiled+kernels")
_PACKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # installed weight's data_ptr -> its _Packed


@torch.library.custom_op("specdec_bench::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [n, in] @ ``weight``.T (+ bias) by oneDNN on the installed layer's prepacked weight."""
    packed = _PACKS.get(weight.data_ptr())
    if packed is None:
        raise KeyError("packed_linear: not an installed layer's weight")
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.get(weight), bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def traced_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``kernels.fast_linear``'s formulation, traceable."""
    rows = x.reshape(-1, x.shape[-1])  # [n, in]
    n = rows.shape[0]
    if n <= 2:
        pair = torch.cat([rows, rows]) if n == 1 else rows  # [2, in]
        out = (weight @ pair.T).T[:n]  # [n, out]
        out = out + bias if bias is not None else out
    else:
        out = packed_linear(rows, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return traced_linear(x, self.weight, self.bias) if self._bench_traced else F.linear(x, self.weight, self.bias)
    return kernels._forward(self, x)


def trace_with(model: torch.nn.Module, fast: bool) -> None:
    """Whether the next trace of ``model`` writes its installed layers as ``traced_linear`` or ``F.linear``."""
    for m in model.modules():
        if kernels._ours(m) or getattr(m, "_bench_traced", None) is not None:
            if getattr(m, "_bench_traced", None) is None:
                _PACKS[m.weight.data_ptr()] = m._specdec_packed
                m.forward = types.MethodType(_forward, m)
            m._bench_traced = fast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="code-target")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--slots", type=int, default=SLOTS + SLOT_SLACK)
    parser.add_argument("--cached", type=int, default=80, help="prompt tokens in the cache")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["SPECDEC_LINEAR"] = "on"
    model = load_model(args.model)
    if not kernels.install(model):
        raise SystemExit("specdec's linear kernels are not available here (oneDNN's linear op is missing)")
    torch._dynamo.config.recompile_limit = 256
    compiled = {}
    for variant in ("compiled", "compiled+kernels"):
        started = time.perf_counter()
        trace_with(model, variant == "compiled+kernels")
        step = CompiledModel(model, args.slots)
        step.rows, step.tokens = (1,), tuple(args.tokens)
        for n in args.tokens:
            step.warm(Shape(1, n, step.slots))  # compiles, and checks against the eager step
        compiled[variant] = step
        print(f"{variant}: {len(args.tokens)} shapes compiled in {time.perf_counter() - started:.1f} s", flush=True)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.cached))
    caches = {}
    with torch.inference_mode():
        for variant in VARIANTS:
            prefill = RaggedCache(model, 1, "cpu")
            prefill.forward(prompt)
            if variant in compiled:
                caches[variant] = StaticRaggedCache(model, compiled[variant], "cpu")
                caches[variant].merge(prefill)
            else:
                caches[variant] = prefill

    def step_time(variant: str, n: int) -> float:
        cache = caches[variant]
        live = cache.live.clone()
        ids = torch.randint(0, model.config.vocab_size, (1, n))
        with kernels.active() if variant != "eager" else nullcontext():
            started = time.perf_counter()
            cache.forward(ids, logits_to_keep=n)
            seconds = time.perf_counter() - started
        cache.keep(live)  # rolled back: the next step sees the same cache
        return seconds

    times: dict[tuple[str, int], list[float]] = {(v, n): [] for v in VARIANTS for n in args.tokens}
    with torch.inference_mode():
        for i in range(args.repeats + 2):
            for n in args.tokens:
                for variant in VARIANTS:
                    seconds = step_time(variant, n)
                    if i >= 2:  # two untimed rounds first
                        times[(variant, n)].append(seconds)
    print(f"{args.model}, {args.threads} thread(s), {args.cached} cached tokens, {args.slots} static slots, "
          f"medians of {args.repeats}; ms per step (share of eager+kernels); load {os.getloadavg()[0]:.1f}")
    for n in args.tokens:
        base = statistics.median(times[("eager+kernels", n)])
        cells = [f"{v} {statistics.median(times[(v, n)]) * 1e3:.2f} ({statistics.median(times[(v, n)]) / base:.2f})"
                 for v in VARIANTS]
        print(f"{n} token(s): " + ", ".join(cells))
    calls = {v: step.calls for v, step in compiled.items()}
    assert all(c["eager"] == 0 for c in calls.values()), f"a compiled step fell back to eager: {calls}"


if __name__ == "__main__":
    main()
