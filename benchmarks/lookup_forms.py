"""Today's default (``lookup+code-drafter``) beside ``lookup+code-feature-drafter`` in float32 and in int8, and the
feature drafter alone, on held-out prompts (the form a drafter takes behind prompt lookup: ``drafters.model``).

Greedy, batch 1, 1 thread, gamma 4; per prompt, plain decoding then every method in a rotating order, each output
checked against plain decoding; prints, per method, the median over (prompt, repeat) of plain decoding's time over
the method's, and the mean tau.

    python benchmarks/lookup_forms.py --prompts 20 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import specdec
from specdec.config import DrafterConfig
from specdec.data.prompts import code_completion_prompts
from specdec.drafters import make_drafter
from specdec.loading import load_model, load_tokenizer
from specdec.target import make_target

METHODS = {"lookup+code-drafter auto": ("lookup+code-drafter", "auto"),
           "lookup+feature float32": ("lookup+code-feature-drafter", "float32"),
           "lookup+feature int8": ("lookup+code-feature-drafter", "int8"),
           "feature alone (auto)": ("code-feature-drafter", "auto")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_model("code-target", dtype=torch.float32)
    tok = load_tokenizer("code-target")
    models = {n: load_model(n, dtype=torch.float32) for n in ("code-drafter", "code-feature-drafter")}
    prompts = [p["prompt"] for p in code_completion_prompts(args.prompts, "test")]
    names, plain, results = list(METHODS), {}, {m: [] for m in METHODS}
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            start = time.perf_counter()
            plain.setdefault(i, specdec.autoregressive_generate(target, prompt, tokenizer=tok,
                                                                max_new_tokens=args.max_new_tokens).tokens)
            plain_s = time.perf_counter() - start
            turn = (i + repeat) % len(names)
            for method in names[turn:] + names[:turn]:
                name, dtype = METHODS[method]
                drafter = make_drafter(DrafterConfig(name, dtype=dtype), make_target(target), tok,
                                       loader=lambda path: models[path])
                start = time.perf_counter()
                out = specdec.speculative_generate(target, drafter, prompt, tokenizer=tok,
                                                   max_new_tokens=args.max_new_tokens, gamma=4)
                seconds = time.perf_counter() - start
                assert out.tokens == plain[i], (method, i)
                results[method].append((plain_s / seconds, out.stats.mean_accepted_length))
    for method, values in results.items():
        print(f"{method:26s} x plain {statistics.median(v[0] for v in values):.3f}  "
              f"tau {statistics.mean(v[1] for v in values):.2f}")
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
