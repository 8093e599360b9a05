"""A run's figures as one line of plain text: ``summary_line`` for one result, ``batch_line`` for a batched run,
``auto_text`` for what ``--speculate auto`` chose. Printed by the command line and the chat console, read by the
bench; no terminal imports (``specdec.terminal`` prints).

Figures use the docs/design.md vocabulary: acceptance rate alpha = accepted / drafted, mean accepted length tau =
tokens per round including the recovered or bonus token; tokens/s counts tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdec.threads import current as current_threads
from specdec.threads import helper_note

if TYPE_CHECKING:
    from specdec.stats import AutoChoice, BatchStats, GenerationResult


def batch_line(batch: BatchStats, mode: str) -> str:
    """The figures of a batched run on one line: prompts, tokens/s, rounds, rows per round, alpha, the time split."""
    parts = [(f"{batch.rows} prompts, {batch.new_tokens} new tokens in {batch.wall_time_s:.2f} s "
              f"({batch.tokens_per_s:.1f} tokens/s)"),
             f"{batch.rounds} rounds of {batch.mean_rows:.1f} rows on average (at most {batch.max_rows})"]
    if mode == "speculative":
        parts.append(f"acceptance rate α {batch.acceptance_rate:.2f}")
    wall = batch.wall_time_s or 1.0
    parts.append(f"time: verify {batch.verify_time_s / wall:.0%}, propose {batch.propose_time_s / wall:.0%}, "
                 f"prefill {batch.prefill_time_s / wall:.0%}, bookkeeping {batch.bookkeeping_s / wall:.0%}")
    if batch.auto:
        parts.append(auto_text(batch.auto))
    parts.append(current_threads().describe() + helper_note())
    return " | ".join(parts)


def auto_text(choices: list[AutoChoice]) -> str:
    """What ``--speculate auto`` kept at each batch size, with the speeds it measured."""
    def rows_text(rows: tuple[int, int]) -> str:  # a batch-size bucket: "1 row", "2 rows", "3-4 rows"
        sizes = f"{rows[0]}" if rows[0] == rows[1] else f"{rows[0]}-{rows[1]}"
        return f"{sizes} row{'s' if rows[1] > 1 else ''}"

    parts = []
    for c in choices:
        if c.like is not None:  # plain, unmeasured: a smaller batch measured plain faster
            parts.append(f"{rows_text(c.rows)}: {c.speculate} (as at {rows_text(c.like)})")
            continue
        drafting = "drafting" if c.width is None else f"drafting <= {c.width}"
        draft, plain = (f"{v:.0f} tokens/s" if v > 0 else "not yet measured"  # 0: no round of it timed yet
                        for v in (c.draft_tokens_per_s, c.plain_tokens_per_s))
        speeds = f"{drafting}: {draft}, plain: {plain}"
        parts.append(f"{rows_text(c.rows)}: {c.speculate} ({speeds})")
    return "speculate auto: " + "; ".join(parts)


def summary_line(result: GenerationResult, mode: str, *, auto: bool = True) -> str:
    """New tokens, tokens/s, rounds, alpha, tau and why it stopped, on one line (and, with ``auto``, what
    ``--speculate auto`` chose: a prompts file says it once, on its batch line)."""
    s = result.stats
    parts = [f"{s.new_tokens} new tokens in {s.wall_time_s:.2f} s ({s.tokens_per_s:.1f} tokens/s)",
             f"{s.rounds} rounds"]
    if mode == "speculative":
        parts += [f"acceptance rate α {s.acceptance_rate:.2f}",
                  f"mean accepted length τ {s.mean_accepted_length:.2f}"]
    else:
        parts += [f"{mode} alone: nothing drafted, τ {s.mean_accepted_length:.2f}"]
    parts.append(f"stop: {result.stop_reason}")
    if auto and result.batch is not None and result.batch.auto:
        parts.append(auto_text(result.batch.auto))
    if result.settings is not None:
        parts.append(result.settings.line())
    if not s.lossless:
        parts.append("relaxed verification: may differ from the target's own output")
    parts.append(current_threads().describe() + helper_note())
    return " | ".join(parts)
