"""What the terminal shows, and the interactive ``specdec chat`` console.

- ``Session`` loads the models once (target, drafter model or "ngram", tokenizers) and runs one
  decoding mode on a prompt; switching the drafter loads the new one once and keeps it.
- ``TokenStream`` turns the ``RoundEvent``s of ``on_round`` into text as each round commits, with
  incremental detokenisation (a window of earlier tokens gives context, and text that ends in an
  incomplete character waits for the next token), coloured by kind with rich when asked.
- ``Chat`` is the console, in the spirit of the Speculative-Decoding reference project's
  ``infer.py``: a prompt streams its output, then its figures; ``/commands`` change the settings.
  In a terminal it reads lines with prompt_toolkit (editing, history); from a pipe, one prompt
  per line.

Figures use the docs/design.md vocabulary: acceptance rate alpha = accepted / drafted, mean accepted
length tau = tokens per round including the recovered or bonus token; tokens/s counts tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

import specdec
from specdec.arguments import MODES, Settings, UsageError, add_decoding_arguments, settings_from
from specdec.config import BLOCK, LOOKUP, DrafterConfig, ModelConfig, ScheduleConfig, SpecConfig
from specdec.stats import (
    ACCEPTED,
    BONUS,
    RECOVERED,
    TARGET,
    AutoChoice,
    BatchStats,
    GenerationResult,
    RoundEvent,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from specdec.drafters import Drafter
from specdec.threads import current as current_threads
from specdec.threads import helper_note, use_threads

COMPARE = "compare"  # the chat mode that runs the target alone, then speculative decoding
STYLES = {ACCEPTED: "green", RECOVERED: "bold red", BONUS: "bold cyan", TARGET: ""}  # kind -> rich style
LEGEND = ((ACCEPTED, "accepted draft token"), (RECOVERED, "recovered: the target's token at a rejection"),
          (BONUS, "bonus: the target's extra token after a full acceptance"))
DETOKENIZE_CONTEXT = 5  # prompt tokens decoded before the first new one (as vLLM's incremental detokenizer)


# ------------------------------------------------------------------------------------------ models


class Session:
    """The models of one process, loaded on first use and kept: the console never reloads them."""

    def __init__(self, models: ModelConfig) -> None:
        from transformers.utils import logging

        logging.disable_progress_bar()
        logging.set_verbosity_error()
        self.threads = use_threads(models.threads, model=models.target, flag="--threads")  # before any model runs
        self.models = models
        self._models: dict[str, PreTrainedModel] = {}
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {}

    def _name(self, mode: str) -> str:
        """The model whose tokenizer and vocabulary a mode uses."""
        if mode == "drafter":
            if self.models.drafter_model is None:
                raise UsageError("mode 'drafter' decodes with a drafter model; the ngram drafter has none")
            return self.models.drafter_model
        return self.models.target

    def model(self, name: str) -> PreTrainedModel:
        """The causal LM at ``name`` (a shipped name or a folder), loaded once and warmed up."""
        if name not in self._models:
            model = specdec.load_model(name, device=self.models.device, dtype=self.models.dtype)
            specdec.autoregressive_generate(model, [0], max_new_tokens=1, stop_token_ids=[],
                                            kernels=self.models.kernels)  # warm-up
            self._models[name] = model
        return self._models[name]

    def compile(self, mode: str, spec: SpecConfig, schedule: ScheduleConfig, prompts: int | None = None, *,
                how: str | None = None, cached_only: bool = False) -> list[str]:
        """Compile the decode forwards of the models ``mode`` decodes with, for its shapes, as ``--compile``
        says (``specdec.compiled``; nothing when off or auto, as measured; shapes already compiled are kept):
        the target verifies gamma + 1 tokens (and a prompt-lookup copy, and steps 1 when it may decode alone), a
        drafter model steps 1 token and catches up (``compiled.token_buckets``), in rows of 1, 4, 16, ... below the
        batch size and the batch size (``compiled.row_buckets``; at most ``prompts``, where the caller knows how
        many it decodes: one prompt compiles rows of 1 only). ``how`` overrides ``--compile``; ``cached_only``
        takes each model's buckets from the compile cache only, all or none (``compiled.prepare``), saying nothing.
        Returns what was decided, per model."""
        from specdec.compiled import compiled_for, compiles, prepare
        from specdec.loading import resolve_device

        how = how or self.models.compile
        if not compiles(how, resolve_device(self.models.device)):
            return []
        decided = []
        for name, tokens, rows, hidden, last in self.compile_plan(mode, spec, schedule, prompts):
            model = self.model(name)
            known = compiled_for(model)
            before = set(known.shapes) if known is not None else set()
            choice = prepare(model, how, tokens=tokens, rows=rows, hidden=hidden, last=last, cached_only=cached_only)
            decided.append(f"{name}: {choice.describe()}")
            new = choice.compiled and bool(compiled_for(model).shapes - before)
            if not cached_only and (not choice.compiled or new):  # said when something new was done
                stderr_console().print(f"specdec: {decided[-1]}")
        return decided

    def compile_plan(self, mode: str, spec: SpecConfig, schedule: ScheduleConfig,
                     prompts: int | None = None) -> list[tuple[str, tuple[int, ...], tuple[int, ...], bool, bool]]:
        """What ``compile`` compiles: (model name, tokens buckets, rows buckets, hidden states, the last logits only)
        per model: a drafter model's catch-ups read their last token's logits only (``compiled.prepare``'s ``last``)."""
        from specdec.compiled import row_buckets, token_buckets
        from specdec.drafters.hybrid import LOOKUP_NGRAM

        rows = row_buckets(min(spec.batch_size, prompts or spec.batch_size))
        speculating = mode in ("speculative", COMPARE) and spec.speculate != "off"
        plain = mode != "speculative" or spec.speculate != "on"
        verify, steps = token_buckets(spec.gamma, self.models.drafter, speculating, plain,
                                      LOOKUP_NGRAM.copy_length(spec.gamma))
        plan = [(self._name(mode) if mode == "drafter" else self.models.target, verify, rows, False, False)]
        drafter = self.models.drafter_model
        if speculating and drafter is not None and drafter != BLOCK and not drafter.startswith(BLOCK + ":"):
            plan.append((drafter, steps, rows, schedule.schedule == "ada", True))
        return plan

    def tokenizer(self, mode: str) -> PreTrainedTokenizerBase:
        """The tokenizer of the model that decodes in ``mode``."""
        name = self._name(mode)
        if name not in self._tokenizers:
            self._tokenizers[name] = specdec.load_tokenizer(name)
        return self._tokenizers[name]

    def drafter(self) -> Drafter:
        """The drafter, built by the one drafter factory from the loaded models (loaded once)."""
        from specdec.drafters import make_drafter
        from specdec.target import make_target

        target = make_target(self.model(self.models.target), self.models.kernels == "auto")
        try:
            return make_drafter(self.models.drafter_config, target, self.tokenizer("speculative"), loader=self.model,
                                kernels=self.models.kernels == "auto")
        except ValueError as err:
            default = DrafterConfig.name
            if self.models.drafter != default or not re.search("vocabulary|tokenizer", str(err)):
                raise
            # the drafter nobody named: say it was the default, and what drafts for any target
            raise ValueError(f"{err} (the drafter was the default, {default}, drafting for code-target: give "
                             f"--drafter ngram, prompt lookup, which drafts for any target, or --drafter FOLDER of a "
                             "drafter trained with the target's tokenizer)") from None

    def set_drafter(self, name: str) -> None:
        """Switch the drafter (a model name/folder or "ngram"), loading a new model now."""
        previous = self.models
        self.models = dataclasses.replace(self.models, drafter=name)
        try:
            self.drafter()
        except Exception:
            self.models = previous
            raise

    def load(self, mode: str) -> None:
        """Load what ``mode`` needs now rather than at the first prompt."""
        self.tokenizer(mode)
        if mode in ("target", "speculative", COMPARE):
            self.model(self.models.target)
        if mode in ("drafter", "speculative", COMPARE):
            self.drafter()

    def encode(self, prompt: str, settings: Settings) -> list[int]:
        """Prompt text -> token ids, through the chat template when asked."""
        tokenizer = self.tokenizer(settings.mode)
        if not settings.chat_template:
            return list(tokenizer(prompt).input_ids)
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError(f"the tokenizer of {self._name(settings.mode)!r} has no chat template")
        messages = [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
                    ["input_ids"])

    def generate(self, prompt_ids: list[int] | list[list[int]], settings: Settings,
                 on_round: Callable[[RoundEvent], None] | None = None,
                 on_result: Callable[[GenerationResult], None] | None = None) -> GenerationResult | list[GenerationResult]:
        """Decode one prompt's ids (or a list of them) in ``settings.mode`` (speculative, target or drafter)."""
        batch = bool(prompt_ids) and isinstance(prompt_ids[0], list)
        self.compile(settings.mode, settings.spec, settings.schedule, prompts=len(prompt_ids) if batch else 1)
        sampling = {k: None if k in settings.from_model else v for k, v in dataclasses.asdict(settings.sampling).items()}
        kwargs = dict(
            max_new_tokens=settings.spec.max_new_tokens,
            **sampling,
            stop_strings=list(settings.stop_strings) or None,
            tokenizer=self.tokenizer(settings.mode),
            on_round=on_round,
            on_result=on_result,
            batch_size=settings.spec.batch_size,
            kernels=self.models.kernels,
        )
        if settings.mode == "speculative":
            return specdec.speculative_generate(self.model(self.models.target), self.drafter(), prompt_ids,
                                                gamma=settings.spec.gamma, speculate=settings.spec.speculate,
                                                verify=settings.verify, schedule=settings.schedule, **kwargs)
        return specdec.autoregressive_generate(self.model(self._name(settings.mode)), prompt_ids, **kwargs)


# ------------------------------------------------------------------------------------------ output


def stdout_console() -> Console:
    """A rich console on stdout that writes text as given (no markup, highlighting or wrapping)."""
    return Console(file=sys.stdout, highlight=False, markup=False, emoji=False, soft_wrap=True)


def stderr_console() -> Console:
    """The same on stderr."""
    return Console(file=sys.stderr, highlight=False, markup=False, emoji=False, soft_wrap=True)


class TokenStream:
    """Text of the committed tokens, printed as each round commits (``add`` is an ``on_round``)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], *,
                 show_acceptance: bool = False, echo: bool = True, console: Console | None = None) -> None:
        self.tokenizer = tokenizer
        self.show_acceptance = show_acceptance
        self.echo = echo
        self.console = console or stdout_console()
        self.ids: list[int] = []  # new tokens so far
        self.kinds: list[str] = []  # their kinds
        self.text = ""  # text printed so far
        self._window = list(prompt_ids[-DETOKENIZE_CONTEXT:])  # context, then tokens not yet printed
        self._read = len(self._window)  # window[:_read] is context (already printed)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _emit(self, piece: str, kind: str) -> None:
        self.text += piece
        if self.echo and piece:
            style = STYLES.get(kind, "") if self.show_acceptance else ""
            self.console.print(Text(piece, style=style), end="")

    def add(self, event: RoundEvent) -> None:
        """Print the text of one round's tokens, each piece in the colour of its kind."""
        for token, kind in zip(event.tokens, event.kinds):
            self.ids.append(token)
            self.kinds.append(kind)
            self._window.append(token)
            piece = self._pending()
            if piece and not piece.endswith("\ufffd"):  # an incomplete character waits for more bytes
                self._emit(piece, kind)
                self._window = self._window[self._read:]  # the printed piece is the next context
                self._read = len(self._window)

    def _pending(self) -> str:
        """Text of the tokens after the context, decoded with the context in front."""
        before = self._decode(self._window[: self._read])
        after = self._decode(self._window)
        return after[len(before):]

    def finish(self) -> None:
        """Print what a trailing incomplete character held back, then end the line."""
        piece = self._pending()
        if piece:
            self._emit(piece, self.kinds[-1])
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
        stream = TokenStream(self.session.tokenizer(settings.mode), prompt_ids,
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
    session.load(settings.mode)
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
