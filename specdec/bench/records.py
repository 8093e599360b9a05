"""The per-run record of the benchmark: one line of records.jsonl per (prompt, method, setting, repeat).

Field names follow the SpecDec++ evaluation script where they apply (``spec_time``,
``num_mismatched_tokens``, ``num_LM_call``, ``generated_length`` for speculative runs;
``target_time`` and ``generated_length_target`` for plain runs; a field that does not apply is
``null``), plus ours. SpecDec++'s ``draft_time`` (the drafter decoding alone) is not a method here,
so it is not written; the time spent drafting inside a speculative run is ``drafter_time_s``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Record:
    """One timed run."""

    prompt_id: str  # the prompt's id
    method: str  # the runner's name
    gamma: int | None  # tokens drafted per round (None: the method drafts nothing or chooses itself)
    temperature: float  # 0 = greedy
    repeat: int  # 0-based index of the timed repeat
    tokens: list[int]  # the new tokens (used for the greedy-equality check)
    generated_length: int  # new tokens (SpecDec++)
    wall_time_s: float  # seconds of the whole generate call, prompt prefill included
    tokens_per_s: float  # generated_length / wall_time_s
    num_LM_call: int  # target forward passes, counted by hooks (SpecDec++)
    drafter_calls: int  # drafter model forward passes, counted by hooks (0 without a drafter model)
    rounds: int  # rounds (plain decoding: one per token)
    target_time_s: float  # seconds inside target forwards
    drafter_time_s: float  # seconds spent drafting
    spec_time: float | None  # wall time of a speculative run (SpecDec++), else null
    target_time: float | None  # wall time of a plain run (SpecDec++), else null
    generated_length_target: int | None  # new tokens of a plain run (SpecDec++), else null
    num_mismatched_tokens: int | None  # drafted - accepted (SpecDec++), null when unknown
    drafted: int | None  # draft tokens proposed, null when the method does not report them
    accepted: int | None  # draft tokens accepted, null when unknown
    acceptance_rate: float | None  # alpha = accepted / drafted
    mean_accepted_length: float  # tau = tokens per round, including the recovered/bonus token
    accepted_per_position: list[int] | None  # [i]: rounds whose draft i was accepted
    drafted_per_position: list[int] | None  # [i]: rounds that drafted a token at position i


def write_records(records: list[Record], path: Path) -> None:
    """Write records as JSON lines."""
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(asdict(record)) + "\n")


def read_records(path: Path) -> list[Record]:
    """Read records written by `write_records`."""
    return [Record(**json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines() if line]


def write_summary(out_dir: Path, stem: str, summary: dict, markdown: str) -> list[Path]:
    """A sweep's figures as ``<stem>-summary.json`` and its tables as ``<stem>-summary.md`` in
    ``out_dir`` (created); returns the two paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}-summary.json", out_dir / f"{stem}-summary.md"]
    paths[0].write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(markdown, encoding="utf-8")
    return paths
