"""specdec.bench: speed, acceptance, memory and exactness of speculative decoding, side by side.

Methods (``RUNNERS``): plain-hf (the target's ``generate``, the baseline), plain (ours), spec,
ngram and spec-lookup (our speculative decoding with the drafter model / prompt lookup / lookup
first and the model otherwise), hf-assisted (transformers' assisted generation with the same
drafter: our gamma, and its defaults) and hf-prompt-lookup, all run in one process on the same
prompts. Sweeps beside that comparison, each its own module: ``batched`` (``--batch-sizes``),
``serve`` (``--serve``), ``block`` (``--block``: SpecDec's block drafter and top-β/τ), ``pareto``
(``--pareto``: SpecDec++'s draft-length schedules) and ``translate`` (``--task translate``: an
encoder-decoder target). Re-exports only; see the modules for the contracts. The names load on first use (PEP
562), as ``specdec``'s do, so the command line's ``specdec bench --help`` and argument errors import no torch.
"""

from __future__ import annotations

import typing

from specdec.lazy import lazy_names

if typing.TYPE_CHECKING:
    from specdec.bench.cli import register
    from specdec.bench.config import BenchConfig, quick
    from specdec.bench.harness import BenchRun, Block, run_benchmark
    from specdec.bench.records import Record, read_records
    from specdec.bench.report import BenchReport, build_report, print_report, write_outputs
    from specdec.bench.runners import BASELINE, RUNNERS, Runner, RunOutput, Setting
    from specdec.bench.summary import Row, leviathan_speedup

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "BASELINE": "specdec.bench.runners",
    "BenchConfig": "specdec.bench.config",
    "BenchReport": "specdec.bench.report",
    "BenchRun": "specdec.bench.harness",
    "Block": "specdec.bench.harness",
    "RUNNERS": "specdec.bench.runners",
    "Record": "specdec.bench.records",
    "Row": "specdec.bench.summary",
    "RunOutput": "specdec.bench.runners",
    "Runner": "specdec.bench.runners",
    "Setting": "specdec.bench.runners",
    "build_report": "specdec.bench.report",
    "leviathan_speedup": "specdec.bench.summary",
    "print_report": "specdec.bench.report",
    "quick": "specdec.bench.config",
    "read_records": "specdec.bench.records",
    "register": "specdec.bench.cli",
    "run_benchmark": "specdec.bench.harness",
    "write_outputs": "specdec.bench.report",
}

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


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
