"""The soak's short form (issue 67): benchmarks/serve_soak.py's mixed load against ``specdec serve`` (the shipped
pair, ``--compile off``) for 30 s at 4 clients: streaming and not, greedy and sampled, 10% of clients disconnecting
at random moments, 5% fuzz cases. No good request fails (each greedy one equals the same request sent alone before
the load), no 5xx at all, every kind of request was sent, and the engine's memory was sampled from outside
(``/proc``) and inside (``/stats``' ``memory``). The long form and its figures:
docs/journal/2026-12-07-soak-and-faults.md, "Soak and
faults"."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.serve import memory

pytest.importorskip("uvicorn")


def load_soak():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_soak.py"
    spec = importlib.util.spec_from_file_location("serve_soak", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_soak"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_short_soak_fails_no_good_request_and_answers_no_5xx():
    soak = load_soak()
    report = soak.soak(clients=4, duration_s=30, requests=2000, seed=1, rss_every_s=10, plateau_part=0.5,
                       flags=["--batch-size", "4"], log=lambda _: None)
    assert report.good_failed == 0, report.failed
    assert not report.failed, report.failed  # fuzz and disconnecting clients included: no 5xx, no hang
    assert not any(status.startswith("5") for status in report.statuses), report.statuses
    assert set(report.sent) == {"good", "fuzz", "disconnect"}, report.sent
    assert report.ok["good"] >= 20 and report.latency_p99_s >= report.latency_p50_s > 0
    assert len(report.memory) >= 3 and all(row["engine_rss_mb"] and row["front_rss_mb"] for row in report.memory)
    if memory.usage()["heap_in_use"] is not None:  # glibc's mallinfo2, from /stats
        assert all(row.get("engine_heap_in_use_mb") for row in report.memory)
    assert report.engine_exit == 0


CHECK_TRIM = """
import sys
from specdec.serve import memory
before = memory.usage()
if before["rss"] is None or before["heap_in_use"] is None:
    sys.exit(3)  # not Linux with glibc: nothing to read
assert before["rss"] > 0 and before["heap_in_use"] > 0 and before["rss_peak"] >= before["rss"], before
blocks = [bytearray(64 << 10) for _ in range(400)]  # 25 MB of small-enough blocks: on malloc's heap, not mmaps
del blocks[:-1]  # the last one pins the heap's top: the freed pages below it stay with malloc unless trimmed
freed = memory.usage()
assert freed["heap_free"] > before["heap_free"] + 16, (before, freed)  # MB
assert memory.trim(every_s=0.0)
trimmed = memory.usage()
assert trimmed["rss"] < freed["rss"] - 16, (freed, trimmed)
assert not memory.trim(every_s=3600.0)  # the last trim was just now
"""


def test_memory_reports_the_heap_and_trims_at_most_every_so_often():
    """``specdec.serve.memory``: the resident set from /proc and, under glibc, malloc's heap; a trim gives freed heap
    pages back to the system (the resident set drops; malloc still counts them free: ``madvise``'d, not unmapped) and
    runs at most every ``every_s``. In a fresh interpreter: after a long suite the heap already holds gigabytes free,
    and new blocks reuse them instead of growing it."""
    done = subprocess.run([sys.executable, "-c", CHECK_TRIM], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode == 3:
        pytest.skip("not Linux with glibc: nothing to read")
    assert done.returncode == 0, done.stderr
