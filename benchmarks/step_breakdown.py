"""Where a decode step's time goes: ``python benchmarks/step_breakdown.py --model code-target --tokens 1 5``.

Times one model's cached forward through specdec's cache handle (``RaggedCache.forward`` inside
``kernels.active()``: what ``Decoder.step`` runs), with ``--cached`` tokens in the cache and ``--tokens`` new
ones, each step rolled back (``keep``) so every step sees the same cache, specdec's linear kernels installed
(``SPECDEC_LINEAR`` on unless set: the probe behind ``auto`` is unreliable on a busy machine):

- ``step``: the forward as specdec runs it;
- ``without products``: the same with every linear layer's product replaced by a free one (a cached tensor
  of zeros of its output's shape): what the forward costs beside its matrix products (transformers' Python,
  norms, rotary, attention, the cache, module dispatch); ``products`` = step - that;
- then, in a separate pass (timers add their own cost, so the parts do not add up to the step exactly), the
  time in the linear kernels, the cache layers' ``update``, attention (SDPA), the norms, the rotary
  embedding and the mask, each summed over one forward.

The two timed variants take turns step by step; medians over ``--repeats`` steps, of the thread's CPU time
(``time.thread_time``: on a machine shared with other work, wall time also counts the spells this process
waits for a core, which on a loaded 2-core machine are as long as a step). Run it with
``PYTHONPATH`` set to another tree to compare trees. Findings: docs/journal/work-around-products.md, "The work around
the
products".
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import os
import statistics
import time

import torch
import torch.nn.functional as F

from specdec import kernels
from specdec.cache import RaggedCache
from specdec.loading import load_model


def timed(key: str, fn, totals: collections.Counter):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.thread_time() - started
    return wrapper


def free_products():
    """A stand-in for ``kernels.fast_linear`` (and ``F.linear``) that returns a cached zeros tensor of the output's
    shape."""
    outputs: dict[tuple, torch.Tensor] = {}

    def free(x, weight, bias=None, packed=None):
        key = (tuple(x.shape[:-1]), weight.shape[0])
        if key not in outputs:
            outputs[key] = torch.zeros(*key[0], key[1], dtype=x.dtype)
        return outputs[key]
    return free


@torch.inference_mode()
def breakdown(model_name: str, cached: int, tokens: int, repeats: int) -> dict[str, float]:
    model = load_model(model_name, dtype="float32")
    if not kernels.install(model):
        print("(specdec's linear kernels are not installed on this machine: products run torch's F.linear)")
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(3, vocab, (1, cached), generator=generator)
    new = torch.randint(3, vocab, (1, tokens), generator=generator)
    real = (kernels.fast_linear, F.linear)
    free = (free_products(),) * 2
    with kernels.active():
        cache = RaggedCache(model, 0)
        cache.forward(prompt)

        def step() -> float:
            started = time.thread_time()
            cache.forward(new, logits_to_keep=tokens)
            seconds = time.thread_time() - started
            cache.keep(cache.live - tokens)
            return seconds

        times: dict[str, list[float]] = {"step": [], "without products": []}
        for i in range(repeats + 3):
            for name, fn in (("step", real), ("without products", free)):
                kernels.fast_linear, F.linear = fn
                try:
                    seconds = step()
                finally:
                    kernels.fast_linear, F.linear = real
                if i >= 3:
                    times[name].append(seconds)
        result = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        result["products"] = result["step"] - result["without products"]

        totals: collections.Counter = collections.Counter()
        patched = [(kernels, "fast_linear", "linear kernels"), (F, "scaled_dot_product_attention", "attention")]
        for layer in {type(layer) for layer in cache.cache.layers}:
            patched.append((layer, "update", "cache update"))
        module = inspect.getmodule(type(model))
        for name, label in (("create_causal_mask", "mask"), ("apply_rotary_pos_emb", "rotary")):
            if hasattr(module, name):
                patched.append((module, name, label))
        base = getattr(model, "model", None)
        if base is not None and hasattr(base, "norm"):
            patched.append((type(base.norm), "forward", "norms"))
        if base is not None and hasattr(base, "rotary_emb"):
            patched.append((type(base.rotary_emb), "forward", "rotary"))
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
        for owner, name, label in patched:
            setattr(owner, name, timed(label, getattr(owner, name), totals))
        parts: dict[str, list[float]] = collections.defaultdict(list)
        try:
            for i in range(repeats + 3):
                totals.clear()
                step()
                if i >= 3:
                    for label in {label for _, _, label in patched}:
                        parts[label].append(totals[label])
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)
    for label, values in sorted(parts.items()):
        result[f"  {label}"] = statistics.median(values) * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="code-target", help="a shipped model name or a folder")
    parser.add_argument("--cached", type=int, default=130, help="tokens in the cache before each step")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 5], help="new tokens per forward")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    os.environ.setdefault(kernels.ENV, "on")
    for tokens in args.tokens:
        result = breakdown(args.model, args.cached, tokens, args.repeats)
        print(f"{args.model}, {tokens} new token(s) after {args.cached}, {torch.get_num_threads()} thread(s), "
              f"ms (medians of {args.repeats}):")
        for name, ms in result.items():
            print(f"  {name:24s} {ms:7.3f}")


if __name__ == "__main__":
    main()
