"""A prefill's attention on both cores (``specdec.attention``) against SDPA's on one: ``python
benchmarks/prefill_attention.py --model code-target --tokens 173``.

An eager prefill of one ``--tokens``-token prompt (random ids, seeded) into an empty cache, as a server's join
runs it: specdec's linear kernels installed, its operators loaded, the helper as ``SPECDEC_HELPER`` says (auto: on
where a core is left beside torch's threads). The prefill with the model's own sdpa attention and inside
``attention.prefilling`` take turns, ``--repeats`` times each; printed: the medians of the prefill's wall time and
of its attention calls' time (summed over the layers), and the largest difference of the last position's logits.
Findings: docs/journal/2026-12-06-prefill-attention.md, "A prefill's attention on both cores".
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from transformers import AttentionInterface

from specdec import attention, kernels
from specdec.cache import RaggedCache
from specdec.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="code-target", help="a shipped model name or a folder")
    parser.add_argument("--tokens", type=int, default=173, help="the prompt's length (173: the bench's code prompts' "
                                                                "mean)")
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    kernels.blocked_op()
    model = load_model(args.model, dtype="float32")
    kernels.install(model)
    print(f"{args.model}, {args.tokens} tokens, {torch.get_num_threads()} thread(s), helper "
          f"{'on' if kernels.helper() else 'off'}; "
          f"shared attention wanted: {attention.wanted(model)}")
    prompt = torch.randint(3, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    spent = [0.0]

    def timed(*args, **kwargs):  # the attention function "sdpa" (``attention.prefill_attention``), timed
        start = time.perf_counter()
        try:
            return attention.prefill_attention(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
    AttentionInterface.register("sdpa", timed)

    def prefill(shared: bool) -> tuple[float, float, torch.Tensor]:
        cache = RaggedCache(model, 1)
        spent[0] = 0.0
        start = time.perf_counter()
        with attention.prefilling(model) if shared else contextlib.nullcontext():
            logits = cache.forward(prompt).logits
        return time.perf_counter() - start, spent[0], logits

    runs = {False: [], True: []}
    with torch.inference_mode(), kernels.active():
        for i in range(args.repeats + 3):
            for shared in (False, True):
                result = prefill(shared)
                if i >= 3:
                    runs[shared].append(result)
    for shared, label in ((False, "sdpa (one thread)"), (True, "shared (decode_attention in chunks)")):
        wall = statistics.median(r[0] for r in runs[shared]) * 1e3
        spent_ms = statistics.median(r[1] for r in runs[shared]) * 1e3
        print(f"{label}: prefill {wall:.2f} ms, its attention {spent_ms:.2f} ms")
    gap = (runs[True][-1][2] - runs[False][-1][2]).abs().max().item()
    print(f"last position's logits: largest difference {gap:.2e}")


if __name__ == "__main__":
    main()
