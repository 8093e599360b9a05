"""What the per-position logits processors cost (issue 25's goal: at most 10% at batch 1 with a repetition penalty).

The shipped pair (``models/code-target`` with ``models/code-drafter``), greedy, batch 1, γ 4, one torch
thread. Three settings, run interleaved (A B C A B C ...) so the machine's load drifts across all of them:

- ``none``: no processor (the shipped generation config has none);
- ``penalty 1.00001``: a ``RepetitionPenaltyLogitsProcessor`` too weak to change any token, so the same
  tokens and the same accepted drafts: the difference is the processing itself, at every verified position
  of p and of the drafter's q;
- ``penalty 1.2``: a real penalty (other tokens, other acceptance: the cost of the output, not only of the
  processing).

Per setting: CPU seconds (``time.process_time``) per generated token over all prompts, the median of the
repetitions, its ratio to ``none``, and the median of the paired ratios (each repetition's run against the
``none`` run beside it). The difference of two totals is noisy on a loaded machine, so the processing is
also clocked directly, in one more run of ``penalty 1.00001`` per repetition: CPU time inside
``specdec.decode``'s ``apply`` and ``round_rows`` and inside ``DraftSampler.draft`` less the plain
``Sampler.draft`` it ends with, per generated token, as a share of ``none``.

    python benchmarks/processor_cost.py --repeats 3 --prompts 5 --new 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Self

import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

import specdec
import specdec.decode
from specdec import load_model, load_tokenizer
from specdec.processors import DraftSampler
from specdec.sampling import Sampler

PROMPTS = [
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(",
    "class Cache:\n    def __init__(self, size):\n",
    "import os\n\ndef walk(root):\n    for dirpath, dirnames, filenames in os.walk(",
    "def read_config(path):\n    with open(path) as f:\n",
    "    def __repr__(self):\n        return ",
    "def fibonacci(n):\n    if n < 2:\n",
    "for key, value in sorted(items.items()):\n",
    "try:\n    import json\nexcept ImportError:\n",
]
SETTINGS = {"none": None, "penalty 1.00001": 1.00001, "penalty 1.2": 1.2}


def run(target, drafter, prompts: list[list[int]], penalty: float | None, new: int,
        gamma: int) -> tuple[float, int, list]:
    processors = None if penalty is None else LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty)])
    start = time.process_time()
    results = [specdec.speculative_generate(target, drafter, p, max_new_tokens=new, gamma=gamma, stop_token_ids=[],
                                            logits_processor=processors) for p in prompts]
    seconds = time.process_time() - start
    return seconds, sum(len(r.tokens) for r in results), [r.tokens for r in results]


class ProcessingClock:
    """CPU seconds spent processing while active (see the module docstring); works on trees without
    ``round_rows`` too (the commit before it built each row's prefix inside ``apply``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.inner = 0  # > 0 while DraftSampler.draft runs: the plain Sampler.draft inside it is not counted

    def _timed(self, fn, sign: float = 1.0):
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += sign * (time.process_time() - start)
        return timed

    def __enter__(self) -> Self:
        self.saved = {(specdec.decode, name): getattr(specdec.decode, name)
                      for name in ("apply", "round_rows") if hasattr(specdec.decode, name)}
        self.saved[(DraftSampler, "draft")] = DraftSampler.draft
        self.saved[(Sampler, "draft")] = Sampler.draft
        for (owner, name), fn in self.saved.items():
            if owner is not Sampler:
                setattr(owner, name, self._timed(fn))
        plain, timed_plain = Sampler.draft, self._timed(Sampler.draft, -1.0)
        Sampler.draft = lambda sampler, *a, **k: (timed_plain if isinstance(sampler, DraftSampler) else plain)(
            sampler, *a, **k)
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), fn in self.saved.items():
            setattr(owner, name, fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, drafter = load_model("code-target"), load_model("code-drafter")
    tokenizer = load_tokenizer("code-target")
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS[: args.prompts]]
    run(target, drafter, prompts[:1], None, 8, args.gamma)  # warm-up
    per_token: dict[str, list[float]] = {name: [] for name in SETTINGS}
    tokens: dict[str, list] = {}
    processing: list[float] = []  # ms CPU per token inside the processing (penalty 1.00001)
    for _ in range(args.repeats):
        for name, penalty in SETTINGS.items():
            seconds, count, out = run(target, drafter, prompts, penalty, args.new, args.gamma)
            per_token[name].append(seconds / count * 1e3)
            tokens[name] = out
        with ProcessingClock() as clock:
            _, count, _ = run(target, drafter, prompts, SETTINGS["penalty 1.00001"], args.new, args.gamma)
        processing.append(clock.seconds / count * 1e3)
    base = statistics.median(per_token["none"])
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"shipped pair, batch 1, greedy, gamma {args.gamma}, {args.prompts} prompts x {args.new} tokens, "
          f"1 thread, {args.repeats} interleaved repeats, load average {' '.join(load)}")
    for name, values in per_token.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:.2f}" for v in values)
        paired = statistics.median(v / b for v, b in zip(values, per_token["none"]))
        print(f"{name:16} {median:6.2f} ms CPU/token  ({runs})  ratio {median / base:.3f}  paired {paired:.3f}")
    inside = statistics.median(processing)
    print(f"processing itself (penalty 1.00001, clocked): {inside:.3f} ms CPU/token "
          f"({', '.join(f'{v:.3f}' for v in processing)}) = {inside / base:.1%} of none")
    print("same tokens with penalty 1.00001 as with none:", tokens["penalty 1.00001"] == tokens["none"])


if __name__ == "__main__":
    main()
