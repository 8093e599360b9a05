"""specdec.bench: speed, acceptance, memory and exactness of speculative decoding, side by side.

Methods (``RUNNERS``): plain-hf (the target's ``generate``, the baseline), plain (ours), spec,
ngram and spec-lookup (our speculative decoding with the drafter model / prompt lookup / lookup
first and the model otherwise), hf-assisted (transformers' assisted generation with the same
drafter: our gamma, and its defaults) and hf-prompt-lookup, all run in one process on the same
prompts. Sweeps beside that comparison, each its own module: ``batched`` (``--batch-sizes``),
``serve`` (``--serve``), ``block`` (``--block``: SpecDec's block drafter and top-β/τ), ``pareto``
(``--pareto``: SpecDec++'s draft-length schedules) and ``translate`` (``--task translate``: an
encoder-decoder target). Re-exports only; see the modules for the contracts.
"""

from specdec.bench.cli import register
from specdec.bench.config import BenchConfig, quick
from specdec.bench.harness import BenchRun, Block, run_benchmark
from specdec.bench.records import Record, read_records
from specdec.bench.report import BenchReport, build_report, print_report, write_outputs
from specdec.bench.runners import BASELINE, RUNNERS, Runner, RunOutput, Setting
from specdec.bench.summary import Row, leviathan_speedup

__all__ = [
    "BASELINE",
    "RUNNERS",
    "BenchConfig",
    "BenchReport",
    "BenchRun",
    "Block",
    "Record",
    "Row",
    "RunOutput",
    "Runner",
    "Setting",
    "build_report",
    "leviathan_speedup",
    "print_report",
    "quick",
    "read_records",
    "register",
    "run_benchmark",
    "write_outputs",
]
