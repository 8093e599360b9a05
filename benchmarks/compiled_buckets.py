"""Does the compiled step pay with slot-width buckets? ``python benchmarks/compiled_buckets.py``.

Times one model's decode step, eager (``RaggedCache`` inside ``kernels.active()``: what ``Decoder.step``
runs, with specdec's linear kernels where they install) against the compiled step (``specdec.compiled``:
the static cache, attending only the slot bucket the live slots fit in), interleaved (one step of each
in turn per repeat; every step rolled back, so each sees the same cached prompt), medians, for several
new-token counts and cached lengths. Compiling every (tokens, slot bucket) shape is timed too.

An encoder-decoder model (``--model translate-target``) is timed the same way on its decoder step
(``Seq2SeqCache`` against ``specdec.compiled``'s StaticSeq2SeqCache), each row's source of ``--source``
random tokens encoded once, untimed; ``--cached`` counts the decoder's cached tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import nullcontext

import torch

from specdec import compiled, kernels
from specdec.cache import RaggedCache
from specdec.compiled import (
    SLOT_SLACK,
    SLOTS,
    CompiledModel,
    CompiledSeq2Seq,
    Shape,
    StaticRaggedCache,
    StaticSeq2SeqCache,
    cache_folder,
)
from specdec.loading import load_model
from specdec.seq2seq import Seq2SeqCache, is_encoder_decoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="code-target")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--cached", type=int, nargs="+", default=[40, 200], help="prompt tokens in the cache")
    parser.add_argument("--slots", type=int, default=SLOTS + SLOT_SLACK)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--source", type=int, default=30, help="source tokens of an encoder-decoder model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--linear", choices=("auto", "off"), default="auto",
                        help="specdec's linear kernels (SPECDEC_LINEAR): eager and traced into the compiled step")
    parser.add_argument("--options", default="", help="inductor options, e.g. cpp_wrapper=1,freezing=0")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_folder()))
    torch._dynamo.config.recompile_limit = 256
    model = load_model(args.model)
    if args.linear == "off":
        os.environ["SPECDEC_LINEAR"] = "off"
    options = dict(compiled.INDUCTOR)
    for item in filter(None, args.options.split(",")):
        key, value = item.split("=")
        options[key] = bool(int(value))
    compiled.INDUCTOR.clear()
    compiled.INDUCTOR.update(options)
    seq2seq = is_encoder_decoder(model)
    eager_cache, static_cache = (Seq2SeqCache, StaticSeq2SeqCache) if seq2seq else (RaggedCache, StaticRaggedCache)
    step = (CompiledSeq2Seq if seq2seq else CompiledModel)(model, args.slots)
    linear = "specdec" if step.kernels else "torch"
    step.rows, step.tokens = (1,), tuple(sorted(args.tokens))
    for n in args.tokens:
        started = time.perf_counter()
        step.warm(Shape(1, n))  # compiles, and checks against the eager step
        print(f"compiled {n} token(s) in {time.perf_counter() - started:.1f} s", flush=True)
    vocab = model.config.vocab_size
    for cached in args.cached:
        prompt = torch.randint(0, vocab, (1, cached))
        caches = {}
        with torch.inference_mode():
            for variant in ("eager", "compiled"):
                prefill = eager_cache(model, 1, "cpu")
                if seq2seq:
                    source = torch.randint(2, vocab, (1, args.source))
                    prefill.encode(source, torch.ones_like(source, dtype=torch.bool))
                prefill.forward(prompt)
                caches[variant] = prefill
                if variant == "compiled":
                    caches[variant] = static_cache(model, step, "cpu")
                    caches[variant].merge(prefill)

        def step_time(variant: str, n: int, caches: dict = caches) -> float:
            cache = caches[variant]
            live = cache.live.clone()
            ids = torch.randint(0, vocab, (1, n))
            with kernels.active() if variant == "eager" else nullcontext():
                started = time.perf_counter()
                cache.forward(ids, logits_to_keep=n)
                seconds = time.perf_counter() - started
            cache.keep(live)
            return seconds

        times = {(v, n): [] for v in caches for n in args.tokens}
        with torch.inference_mode():
            for i in range(args.repeats + 2):
                for n in args.tokens:
                    for variant in caches:
                        seconds = step_time(variant, n)
                        if i >= 2:
                            times[(variant, n)].append(seconds)
        print(f"{args.model}, {args.threads} thread(s), linear {linear}, {cached} cached tokens"
              f"{f', a source of {args.source}' if seq2seq else ''}, options {options}, "
              f"medians of {args.repeats}, load {os.getloadavg()[0]:.1f}")
        for n in args.tokens:
            eager, fast = (statistics.median(times[(v, n)]) * 1e3 for v in ("eager", "compiled"))
            print(f"  {n} token(s): eager {eager:.2f} ms, compiled {fast:.2f} ms ({fast / eager:.2f})",
                  flush=True)
    assert step.calls["eager"] == 0, f"a compiled step fell back to eager: {step.calls}"


if __name__ == "__main__":
    main()
