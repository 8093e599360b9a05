"""What the command line prints with rich: text as given on stdout or stderr, the colour key of
``--show-acceptance``, generated text as it streams (coloured by kind) and a prompts file's result blocks.

Shared by ``specdec generate``/``translate`` (``specdec.cli``) and the chat console (``specdec.console``); the
figures' one-line summaries are plain text in ``specdec.report``. The server, its background compiler and the
bench import neither this nor the console.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from specdec.arguments import COMPARE
from specdec.detokenize import TokenStream
from specdec.stats import ACCEPTED, BONUS, RECOVERED, TARGET

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from specdec.arguments import Settings
    from specdec.stats import GenerationResult

STYLES = {ACCEPTED: "green", RECOVERED: "bold red", BONUS: "bold cyan", TARGET: ""}  # kind -> rich style
LEGEND = ((ACCEPTED, "accepted draft token"), (RECOVERED, "recovered: the target's token at a rejection"),
          (BONUS, "bonus: the target's extra token after a full acceptance"))


def stdout_console() -> Console:
    """A rich console on stdout that writes text as given (no markup, highlighting or wrapping)."""
    return Console(file=sys.stdout, highlight=False, markup=False, emoji=False, soft_wrap=True)


def stderr_console() -> Console:
    """The same on stderr."""
    return Console(file=sys.stderr, highlight=False, markup=False, emoji=False, soft_wrap=True)


class ShownStream(TokenStream):
    """A ``TokenStream`` that prints each piece as it comes (in the colour of its kind with ``show_acceptance``)
    and ends the line at ``finish``; ``echo`` False prints nothing (``--json`` collects the text only)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], *,
                 show_acceptance: bool = False, echo: bool = True, console: Console | None = None) -> None:
        super().__init__(tokenizer, prompt_ids, on_piece=self._print if echo else None)
        self.show_acceptance = show_acceptance
        self.echo = echo
        self.console = console or stdout_console()

    def _print(self, piece: str, kind: str) -> None:
        style = STYLES.get(kind, "") if self.show_acceptance else ""
        self.console.print(Text(piece, style=style), end="")

    def finish(self) -> None:
        """Print what a trailing incomplete character held back, then end the line."""
        super().finish()
        if self.echo:
            self.console.print()


def print_legend(mode: str, console: Console | None = None) -> None:
    """The colour key of ``--show-acceptance`` (speculative mode only: plain decoding has no kinds)."""
    if mode not in ("speculative", COMPARE):
        return
    console = console or stderr_console()
    legend = Text("colours: ")
    for i, (kind, label) in enumerate(LEGEND):
        legend.append(("  " if i else "") + label, style=STYLES[kind])
    console.print(legend)


def result_block(index: int, prompt: str, text: str, result: GenerationResult, settings: Settings,
                 console: Console | None = None) -> None:
    """One result of a prompts file: a dim header with the prompt's number and first line, then the text."""
    console = console or stdout_console()
    first = prompt.strip().splitlines()[0] if prompt.strip() else ""
    console.print(Text(f"### prompt {index}: {first[:60]}", style="dim"))
    console.print(Text(text))
