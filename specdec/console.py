"""The interactive ``specdec chat`` console.

``Chat`` is the console, in the spirit of the Speculative-Decoding reference project's ``infer.py``: a prompt streams
its output (``specdec.terminal``), then its figures (``specdec.report``); ``/commands`` change the settings. In a
terminal it reads lines with prompt_toolkit (editing, history); from a pipe, one prompt per line. The models, their
compilation and threads are the ``specdec.session.Session``'s, as for every front end; no other front end imports
this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TextIO

from rich.table import Table
from rich.text import Text

from specdec.arguments import COMPARE, MODES, Settings, UsageError, add_decoding_arguments, settings_from
from specdec.config import LOOKUP, ModelConfig
from specdec.report import summary_line
from specdec.session import Session
from specdec.stats import GenerationResult
from specdec.terminal import ShownStream, print_legend, stdout_console

# ------------------------------------------------------------------------------------------- chat


@dataclass(frozen=True)
class Command:
    """One ``/command`` of the console."""

    run: Callable[[Chat, str], None]  # (console, argument text) -> None; raises ValueError on bad input
    usage: str  # argument syntax shown by /help
    help: str  # one line shown by /help


class Chat:
    """The interactive console: prompts stream their output; ``/commands`` change the settings."""

    def __init__(self, session: Session, settings: Settings, *, drafter_model: str = ModelConfig().drafter_model,
                 echo_input: bool = False) -> None:
        self.session = session
        self.settings = settings
        self.drafter_model = drafter_model  # what "/drafter model" loads
        self.echo_input = echo_input  # print "> line" for input that did not come from a terminal
        self.out = stdout_console()
        self.last: GenerationResult | None = None
        self.running = True

    def say(self, message: str, style: str = "dim") -> None:
        """A line of the console's own (not model output)."""
        self.out.print(Text(message, style=style))

    def banner(self) -> None:
        """What is loaded and how to get help."""
        m = self.session.models
        self.say(f"specdec chat: target {m.target}, drafter {m.drafter}, mode {self.settings.mode}. "
                 "Type a prompt, /help for commands, /quit or Ctrl-D to leave.")

    def run(self, lines: Iterable[str]) -> None:
        """Handle lines until /quit or the end of input."""
        for line in lines:
            if self.echo_input:
                self.out.print(Text(f"> {line}", style="bold"))
            self.handle(line)
            if not self.running:
                return

    def handle(self, line: str) -> None:
        """One line: a /command or a prompt. Bad input is reported and the console goes on."""
        try:
            if line.startswith("/"):
                name, _, argument = line[1:].strip().partition(" ")
                if name not in COMMANDS:
                    raise ValueError(f"unknown command /{name}: /help lists the commands")
                COMMANDS[name].run(self, argument.strip())
            elif line.strip():
                self.prompt(line)
        except (UsageError, ValueError, OSError) as err:
            self.out.print(Text(f"error: {' '.join(str(err).split())}", style="bold red"))

    def _generate(self, prompt_ids: list[int], settings: Settings) -> GenerationResult | None:
        """Stream one generation; None when Ctrl-C stopped it (what came out stays on screen)."""
        stream = ShownStream(self.session.tokenizer(settings.mode), prompt_ids,
                             show_acceptance=settings.show_acceptance, console=self.out)
        start = time.perf_counter()
        try:
            result = self.session.generate(prompt_ids, settings, on_round=stream.add)
        except KeyboardInterrupt:
            stream.finish()
            self.say(f"[interrupted: {len(stream.ids)} new tokens in {time.perf_counter() - start:.2f} s]")
            return None
        stream.finish()
        self.say(summary_line(result, settings.mode))
        self.last = result
        return result

    def prompt(self, text: str) -> None:
        """Generate for one prompt in the current mode."""
        prompt_ids = self.session.encode(text, self.settings)
        if self.settings.mode != COMPARE:
            self._generate(prompt_ids, self.settings)
            return
        runs = {}
        for mode in ("target", "speculative"):
            self.say(f"[{mode}]", style="bold")
            runs[mode] = self._generate(prompt_ids, dataclasses.replace(self.settings, mode=mode))
            if runs[mode] is None:
                return
        plain, spec = runs["target"].stats, runs["speculative"].stats
        speedup = spec.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else float("nan")
        same = "same tokens" if runs["target"].tokens == runs["speculative"].tokens else "different tokens"
        self.say(f"target {plain.tokens_per_s:.1f} tokens/s, speculative {spec.tokens_per_s:.1f} tokens/s: "
                 f"speedup {speedup:.2f}x ({same})", style="bold")

    # ------------------------------------------------------------------------------- commands

    def _set(self, part: str | None = None, **changes) -> None:
        """Replace settings fields, or fields of the config ``part`` ("spec" or "sampling", which
        validates them); say what changed."""
        replacing = changes
        if part is not None:
            replacing = {part: dataclasses.replace(getattr(self.settings, part), **changes),
                         "from_model": self.settings.from_model - set(changes)}
        self.settings = dataclasses.replace(self.settings, **replacing)
        self.say(", ".join(f"{k} = {v}" for k, v in changes.items()))

    def cmd_help(self, _: str) -> None:
        table = Table(show_header=False, box=None, padding=(0, 2))
        for name, command in COMMANDS.items():
            table.add_row(f"/{name} {command.usage}".rstrip(), command.help)
        self.out.print(table)

    def cmd_quit(self, _: str) -> None:
        self.running = False

    def cmd_mode(self, argument: str) -> None:
        if argument not in (*MODES, COMPARE):
            raise ValueError(f"unknown mode {argument!r}: use one of {', '.join((*MODES, COMPARE))}")
        self.session.load(argument)
        self._set(mode=argument)

    def cmd_drafter(self, argument: str) -> None:
        if not argument:
            raise ValueError("usage: /drafter model|ngram|lookup+model|PATH")
        name = {"model": self.drafter_model, "lookup+model": LOOKUP + self.drafter_model}.get(argument, argument)
        self.session.set_drafter(name)
        self.drafter_model = self.session.models.drafter_model or self.drafter_model
        self.say(f"drafter = {name}")

    def cmd_stats(self, _: str) -> None:
        if self.last is None:
            self.say("no generation yet")
            return
        table = Table(show_header=False, box=None, padding=(0, 2))
        for key, value in self.last.stats.to_dict().items():
            table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
        table.add_row("stop_reason", self.last.stop_reason)
        self.out.print(table)

    def cmd_show(self, argument: str) -> None:
        if argument not in ("on", "off"):
            raise ValueError("usage: /show on|off")
        self._set(show_acceptance=argument == "on")
        if argument == "on":
            print_legend(self.settings.mode, self.out)


def _number(kind: type[int | float], argument: str) -> int | float:
    try:
        return kind(argument)
    except ValueError:
        expected = "an integer" if kind is int else "a number"
        raise ValueError(f"expected {expected}, got {argument!r}") from None


def _seed(argument: str) -> int | None:
    return None if argument.lower() == "none" else _number(int, argument)


COMMANDS: dict[str, Command] = {
    "help": Command(Chat.cmd_help, "", "this list"),
    "quit": Command(Chat.cmd_quit, "", "leave (also Ctrl-D)"),
    "mode": Command(Chat.cmd_mode, "MODE", "speculative (draft + verify), target or drafter (alone), "
                    "compare (target, then speculative, and the speedup)"),
    "drafter": Command(Chat.cmd_drafter, "model|ngram|lookup+model|PATH",
                       "draft with the drafter model, prompt lookup, lookup then the model, or another model folder"),
    "gamma": Command(lambda c, a: c._set("spec", gamma=_number(int, a)), "N", "tokens drafted per round"),
    "length": Command(lambda c, a: c._set("spec", max_new_tokens=_number(int, a)), "N", "max new tokens"),
    "temperature": Command(lambda c, a: c._set("sampling", temperature=_number(float, a)), "X", "0 = greedy"),
    "top_k": Command(lambda c, a: c._set("sampling", top_k=_number(int, a)), "N",
                     "keep the N most probable tokens; 0 = off"),
    "top_p": Command(lambda c, a: c._set("sampling", top_p=_number(float, a)), "X",
                     "nucleus mass; 1.0 = off"),
    "seed": Command(lambda c, a: c._set("sampling", seed=_seed(a)), "N|none", "seed of the sampler"),
    "stats": Command(Chat.cmd_stats, "", "all figures of the last generation"),
    "show": Command(Chat.cmd_show, "on|off", "colour accepted, recovered and bonus tokens"),
}


def _terminal_lines() -> Iterator[str]:
    """Lines typed in a terminal, with line editing and history; Ctrl-C clears, Ctrl-D ends."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import InMemoryHistory

    session: PromptSession[str] = PromptSession(history=InMemoryHistory())
    while True:
        try:
            yield session.prompt("> ")
        except KeyboardInterrupt:
            continue
        except EOFError:
            return


def _stream_lines(stream: TextIO) -> Iterator[str]:
    """One prompt or command per line of a pipe."""
    for line in stream:
        yield line.rstrip("\r\n")


def _run_chat(args: argparse.Namespace) -> int:
    models, settings = settings_from(args)
    session = Session(models)
    session.load(settings.mode, settings.spec.speculate)
    drafter_model = models.drafter_model or ModelConfig().drafter_model
    chat = Chat(session, settings, drafter_model=drafter_model, echo_input=not sys.stdin.isatty())
    chat.banner()
    if settings.show_acceptance:
        print_legend(settings.mode, chat.out)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    chat.run(_terminal_lines() if interactive else _stream_lines(sys.stdin))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``specdec chat``."""
    parser = subparsers.add_parser(
        "chat",
        description="An interactive console. Type a prompt to see its output stream, then its figures; "
        "/help lists the commands. Reads one prompt per line from a pipe.",
    )
    add_decoding_arguments(parser, modes=(*MODES, COMPARE))
    parser.set_defaults(func=_run_chat)
