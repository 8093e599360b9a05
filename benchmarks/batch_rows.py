"""A batch whose rows join and leave apart: ``python benchmarks/batch_rows.py --speculate on``.

Decodes the bench's built-in code prompts (``--num-prompts``, each ``--copies`` times) with the shipped pair in
batches of ``--batch-size`` rows (``speculative_generate``: a row that finishes leaves and the next prompt joins,
as in the server), compiled (``--compile on``: buckets for rows of 1, 4 and the batch size) or eagerly (``off``),
greedy, 64 new tokens, ``--repeats`` times, and prints per run the tokens/s, the target's forwards with more than
half the batch and, over those, the mean slots its cache had in use (what every row attends) against the mean
live tokens of its longest row. Speculation makes rows accept different numbers of drafts and finish in
different rounds; the gap between the two means is attention paid on dead slots. ``--drafter model`` drafts
with code-drafter alone (verifications of gamma + 1 tokens), ``lookup`` (default) with prompt lookup first (a
lookup copy's bucket of 13 tokens). ``--steps`` times instead the compiled target forward of the batch's rows
with 1, 5 and 13 tokens each over 60, 200 and 480 slots in use (medians of 6, each rolled back), and a forward of 5
tokens over 360 and 480 slots of which each row holds 230 live (the others dead at random places), before and
after a re-pack, and the re-pack, and a row leaving (``select``, the last, one in the middle, the first; medians of
5). Findings: docs/journal/server.md, "Rows leaving apart, and the holes
of ragged acceptance".

    OMP_NUM_THREADS=1 python benchmarks/batch_rows.py --speculate on
    OMP_NUM_THREADS=1 python benchmarks/batch_rows.py --steps
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import Counter

import torch

import specdec
from specdec import cache as cache_module
from specdec import kernels
from specdec.batch import PromptBatch, kept_order
from specdec.bench.prompts import load_prompts
from specdec.cache import RaggedCache
from specdec.compiled import StaticRaggedCache, compiled_for, prepare, row_buckets, token_buckets
from specdec.drafters import model_drafter
from specdec.drafters.hybrid import LOOKUP_NGRAM
from specdec.loading import load_model, load_tokenizer
from specdec.seq2seq import prefilled_cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speculate", choices=("on", "off", "auto"), default="on")
    parser.add_argument("--drafter", choices=("lookup", "model"), default="lookup")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compile", choices=("on", "off"), default="on")
    parser.add_argument("--steps", action="store_true", help="time the compiled steps and a re-pack instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.steps:
        time_steps(args.batch_size)
        return
    target, drafter_model = load_model("code-target"), load_model("code-drafter")
    name = "lookup+code-drafter" if args.drafter == "lookup" else "code-drafter"
    verify, steps = token_buckets(4, name, args.speculate != "off", args.speculate != "on",
                                  LOOKUP_NGRAM.copy_length(4))
    rows = row_buckets(args.batch_size)
    if args.compile == "on":
        print("target", prepare(target, "on", tokens=verify, rows=rows).reason, "| drafter",
              prepare(drafter_model, "on", tokens=steps, rows=rows).reason)
    prompts = [p.input_ids.tolist() for p in load_prompts(None, args.num_prompts, 0, load_tokenizer("code-target"))]
    prompts *= args.copies
    seen: list[tuple[int, int, int, int]] = []  # per target forward: rows, tokens per row, slots in use, longest row

    def recording(kind: type) -> None:
        forward = kind.forward

        def recorded(cache: RaggedCache | StaticRaggedCache, input_ids: torch.Tensor, *rest: object, **options: object):
            if cache.model is target and cache.rows:
                seen.append((*input_ids.shape, cache.slots, int(cache.live.max())))
            return forward(cache, input_ids, *rest, **options)

        kind.forward = recorded

    recording(StaticRaggedCache if args.compile == "on" else RaggedCache)
    drafter = model_drafter(drafter_model)
    if args.drafter == "lookup":
        drafter = specdec.LookupDrafter(drafter)
    with torch.inference_mode():
        for _ in range(args.repeats):
            seen.clear()
            start = time.perf_counter()
            results = specdec.speculative_generate(target, drafter, prompts, max_new_tokens=64, stop_token_ids=[],
                                                   batch_size=args.batch_size, speculate=args.speculate)
            seconds = time.perf_counter() - start
            tokens = sum(len(r.tokens) for r in results)
            wide = [s for s in seen if s[0] > args.batch_size // 2]
            print(f"{args.speculate} ({args.drafter}): {tokens / seconds:.1f} tokens/s; {len(seen)} target forwards, "
                  f"{len(wide)} of more than {args.batch_size // 2} rows: slots in use "
                  f"{statistics.mean(s[2] for s in wide):.0f} "
                  f"on average, longest row {statistics.mean(s[3] for s in wide):.0f}; tokens per row "
                  f"{dict(sorted(Counter(s[1] for s in wide).items()))}", flush=True)


def time_steps(rows: int) -> None:
    """``--steps``: the compiled forwards of ``rows`` rows by slots in use, and a re-pack (see the module doc)."""
    model = load_model("code-target")
    kernels.install(model)
    print(prepare(model, "on", tokens=(1, 5, 13), rows=(rows,)).reason)
    compiled = compiled_for(model)

    def filled(length: int) -> StaticRaggedCache:
        cache = StaticRaggedCache(model, compiled)
        ids = [[5 + (i * 7 + j) % 900 for j in range(length)] for i in range(rows)]
        cache.merge(prefilled_cache(model, PromptBatch.from_lists(ids, "cpu"), "cpu")[0])
        return cache

    def timed(cache: StaticRaggedCache, n: int) -> float:
        live = cache.live.clone()
        start = time.perf_counter()
        cache.forward(torch.full((rows, n), 7))
        seconds = time.perf_counter() - start
        cache.keep(live)
        return seconds

    with torch.inference_mode(), kernels.active():
        for length in (60, 200, 480):
            cache = filled(length)
            times = {n: statistics.median([timed(cache, n) for _ in range(7)][1:]) for n in (1, 5, 13)}
            print(f"{rows} rows, {cache.used} slots in use: ms per forward of n tokens a row "
                  f"{ {n: round(1000 * t, 1) for n, t in times.items()} }", flush=True)
        repack_waste = cache_module.REPACK_WASTE
        for used in (360, 480):
            before, packing, after = [], [], []
            for _ in range(5):
                cache = filled(used)
                for row in range(rows):  # each row keeps 230 live slots, the others dead at random places
                    cache.slots_live[row, torch.randperm(used - 1)[: used - 230]] = False
                cache.live = cache.slots_live[:rows, : cache.used].sum(dim=1)
                cache_module.REPACK_WASTE = math.inf  # this forward over the holes, not re-packed first
                before.append(timed(cache, 5))
                cache_module.REPACK_WASTE = repack_waste
                start = time.perf_counter()
                cache.compact()
                packing.append(time.perf_counter() - start)
                after.append(timed(cache, 5))
            print(f"{rows} rows of 230 live tokens over {used} slots: 5 tokens a row "
                  f"{1000 * statistics.median(before):.1f} ms, "
                  f"re-pack {1000 * statistics.median(packing):.1f} ms, then {1000 * statistics.median(after):.1f} ms "
                  f"over {cache.used} slots", flush=True)
        for gone in (rows - 1, rows // 2, 0):  # one row leaves (the last, one in the middle, the first)
            leaving = []
            for _ in range(5):
                cache = filled(200)
                start = time.perf_counter()
                cache.select(torch.tensor(kept_order([row == gone for row in range(rows)]), dtype=torch.long))
                leaving.append(time.perf_counter() - start)
            print(f"{rows} rows over {cache.used} slots, row {gone} leaves: {1000 * statistics.median(leaving):.2f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
