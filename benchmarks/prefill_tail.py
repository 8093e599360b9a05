"""A join's prefill with its last layer whole or as keys and values only: ``python benchmarks/prefill_tail.py``.

Times ``ModelTarget.prefill`` of one of the bench's code prompts (the first of ``--tokens`` to ``--tokens`` + 15
tokens) joining a batch of 3 rows, as a server's join runs it: ``--model`` compiled with the shipped pair's buckets
(the prefill itself is eager), specdec's kernels active (the helper where it is on). The two ways take turns
(``specdec.tail.last_layer`` made to cover nothing for the whole layer), ``--repeats`` each, medians; then the
cache of both ways compared float for float. Findings: docs/journal/2026-12-06-http-front-process.md, "The HTTP front
in a process of its own".

    OMP_NUM_THREADS=1 python benchmarks/prefill_tail.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import kernels, tail
from specdec.batch import PromptBatch
from specdec.bench.prompts import load_prompts
from specdec.compiled import prepare, row_buckets, token_buckets
from specdec.drafters.hybrid import LOOKUP_NGRAM
from specdec.loading import load_model, load_tokenizer
from specdec.target import make_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="code-target")
    parser.add_argument("--tokens", type=int, default=130)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model)
    verify, _ = token_buckets(4, "lookup+code-drafter", True, True, LOOKUP_NGRAM.copy_length(4))
    print(prepare(model, "on", tokens=verify, rows=row_buckets(16)).reason, "| helper", kernels.helper_on())
    target = make_target(model)
    prompts = [p.input_ids.tolist() for p in load_prompts(None, 12, 0, tokenizer)]
    prompt = next(p for p in prompts if args.tokens <= len(p) <= args.tokens + 15)
    covered = tail.last_layer

    def joined(whole: bool) -> tuple[float, list[torch.Tensor]]:
        tail.last_layer = (lambda model: None) if whole else covered
        with torch.inference_mode(), kernels.active():
            start = time.perf_counter()
            target.prefill(PromptBatch.from_lists([prompt], "cpu"))
            seconds = time.perf_counter() - start
            keys = [t[3].clone() for layer in target.cache.cache.layers for t in (layer.keys, layer.values)]
            target.select(torch.arange(3))
        return seconds, keys

    try:
        with torch.inference_mode(), kernels.active():
            target.prefill(PromptBatch.from_lists(prompts[:3], "cpu"))
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for whole in (True, False):
                times[whole].append(joined(whole)[0])
        same = all(torch.equal(a, b) for a, b in zip(joined(True)[1], joined(False)[1]))
    finally:
        tail.last_layer = covered
    print(f"{args.model}, a {len(prompt)}-token prompt joining 3 rows, {torch.get_num_threads()} thread(s): "
          f"the last layer whole {1000 * statistics.median(times[True]):.2f} ms, keys and values only "
          f"{1000 * statistics.median(times[False]):.2f} ms; the joining row's cache the same floats: {same}")


if __name__ == "__main__":
    main()
