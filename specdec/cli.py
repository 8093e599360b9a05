"""The ``specdec`` command line: ``generate``, ``translate``, ``chat``, ``train``, ``bench``, ``serve`` and ``data``.

Flags and defaults are generated from the config dataclasses (``specdec.config``) by
``specdec.arguments``, which ``generate``, ``chat`` and ``serve`` share; so the command line and the
Python API cannot disagree on a default (docs/design.md rule 5).

Subcommands plug in through ``SUBCOMMANDS``: a name and the module whose ``register(subparsers)``
adds its parser and sets ``func`` (``args -> exit status``) as its default.

Bad input (a missing model, an out-of-range value, an incompatible pair) is one line on stderr
and exit status 2, never a traceback; Ctrl-C stops a generation and keeps what it produced, and at
any other moment (start-up, model loading) is one line and exit status 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec.arguments import Settings, UsageError, add_decoding_arguments, settings_from
from specdec.config import ModelConfig
from specdec.folders import is_encoder_decoder
from specdec.supported import version_line
from specdec.threads import current as current_threads

if typing.TYPE_CHECKING:
    from specdec.stats import GenerationResult, RoundEvent


@dataclass(frozen=True)
class Subcommand:
    """A ``specdec`` subcommand: where its parser comes from and its line in ``specdec --help``."""

    module: str  # the module whose register(subparsers) adds the command's parser
    help: str  # one line in `specdec --help`


# Only the module of the command being run is imported (bench's plotting stack stays out of `specdec
# generate`); the others are listed by their help line alone, so `specdec --help` imports none of them.
SUBCOMMANDS: Mapping[str, Subcommand] = {
    "generate": Subcommand("specdec.cli", "complete prompts (one streaming, or a file of many in batches) with "
                           "the figures of speculation"),
    "translate": Subcommand("specdec.cli", "translate sources with an encoder-decoder target (SpecDec's setting)"),
    "chat": Subcommand("specdec.console", "interactive console: prompts stream, /commands change the settings"),
    "train": Subcommand("specdec.train.cli", "train the tokenizer and models (resumable)"),
    "bench": Subcommand("specdec.bench.cli", "measure speed, acceptance, memory and exactness against plain "
                        "decoding and transformers"),
    "serve": Subcommand("specdec.serve.cli", "an OpenAI-compatible server with continuous batching and a live "
                        "page of speculation"),
    "data": Subcommand("specdec.data.cli", "build corpora from text on this machine"),
    "quantize": Subcommand("specdec.quantize_cli", "write an int8 or int4 weight-only copy of a model that "
                           "from_pretrained loads, with its size and greedy agreement"),
    "export": Subcommand("specdec.export", "write a feature drafter in the EAGLE-3 layout vLLM, SGLang and "
                         "speculators load"),
}
EXIT_USAGE = 2  # bad input: what argparse uses too
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention
_SWALLOWED: list[bool] = []  # a Ctrl-C that Python ignored in a finalizer, not yet raised again (``check_interrupted``)


def keep_swallowed_interrupts() -> None:
    """Python prints and ignores an exception raised in a finalizer (``__del__``), Ctrl-C's KeyboardInterrupt too:
    one landing while the garbage collector runs a finalizer (seen while transformers was importing: a ``regex``
    ``Group``'s) was lost, a traceback printed, and the command ran on to the end with status 0. Installed once,
    this ``sys.unraisablehook`` keeps such an interrupt, without the traceback, for ``check_interrupted``."""
    previous = sys.unraisablehook
    if getattr(previous, "keeps_interrupts", False):
        return

    def hook(unraisable: typing.Any) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            _SWALLOWED.append(True)
        else:
            previous(unraisable)

    hook.keeps_interrupts = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def check_interrupted() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C that a finalizer swallowed since the last check, if any."""
    if _SWALLOWED:
        _SWALLOWED.clear()
        raise KeyboardInterrupt


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit status 2), not the usage block."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---------------------------------------------------------------------------------------- generate


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("give the prompt as an argument or with --prompt-file, not both")
    if args.prompt_file is not None:
        return read_text(args.prompt_file, "--prompt-file")
    if args.prompt is not None:
        return args.prompt
    if sys.stdin.isatty():
        raise UsageError("no prompt: give it as an argument, with --prompt-file FILE, or on standard input")
    try:
        return sys.stdin.read()
    except UnicodeDecodeError as err:
        raise UsageError(f"standard input is not UTF-8 text ({_undecodable(err)}): pipe text in") from err


def _undecodable(err: UnicodeDecodeError) -> str:
    return f"byte 0x{err.object[err.start:err.start + 1].hex()} at offset {err.start}"


def read_text(path: str, flag: str) -> str:
    """The whole of a UTF-8 text file named by ``flag``; a missing or binary file is a UsageError naming it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot read {flag} {path!r}: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise UsageError(f"{flag} {path!r} is not UTF-8 text ({_undecodable(err)}): give a text file") from err


def read_prompts_file(path: str) -> list[str]:
    """The prompts of a file: one per line (plain text; blank lines skipped), or, for ``.jsonl``, the
    ``prompt`` of each line's JSON object. Every line is checked before anything runs."""
    text = read_text(path, "--prompts-file")
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if not path.endswith(".jsonl"):
            prompts.append(line)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"{path}, line {number}: not JSON ({err.msg}): each line must be an object "
                             'like {"prompt": "..."}') from err
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise UsageError(f'{path}, line {number}: no "prompt" string: each line must be an object like '
                             '{"prompt": "..."}')
        prompts.append(record["prompt"])
    if not prompts:
        raise UsageError(f"--prompts-file {path!r} holds no prompt: write one per line (or JSON lines with "
                         '"prompt" for .jsonl)')
    return prompts


def _result_json(result: GenerationResult, text: str, prompt_ids: list[int], models: ModelConfig,
                 settings: Settings) -> dict:
    """One generation as the JSON that --json prints (a line of JSONL for a prompts file)."""
    return {
        "text": text,
        "tokens": result.tokens,
        "prompt_ids": prompt_ids,
        "stop_reason": result.stop_reason,
        "mode": settings.mode,
        "target": models.target,
        "drafter": models.drafter,
        **dataclasses.asdict(settings.spec),
        **dataclasses.asdict(settings.sampling if result.settings is None else result.settings.sampling),
        "verify": settings.verify.rule,
        "beta": settings.verify.beta,
        "tau": settings.verify.tau,
        **dataclasses.asdict(settings.schedule),
        "lossless": result.stats.lossless,
        "generation": result.settings.to_dict() if result.settings is not None else None,
        "stop": list(settings.stop_strings),
        "stats": result.stats.to_dict(),
        **current_threads().to_dict(),
        "compile": models.compile,
        "auto": [dataclasses.asdict(c) for c in result.batch.auto] if result.batch is not None else [],
    }


def _check_target_kind(command: str, target: str) -> None:
    """``generate`` completes prompts with a decoder-only target, ``translate`` translates with an
    encoder-decoder one: a target of the other kind is pointed to the other command."""
    encoder_decoder = is_encoder_decoder(target)
    if command == "generate" and encoder_decoder:
        raise UsageError(f"{target} is an encoder-decoder model (it translates a source): use `specdec translate "
                         f"--target {target}`; `specdec generate` completes prompts with a decoder-only target")
    if command == "translate" and not encoder_decoder:
        raise UsageError(f"specdec translate needs an encoder-decoder target (Marian, BART, T5), and {target} is "
                         "decoder-only: use `specdec generate` for it")


def _run_generate(args: argparse.Namespace) -> int:
    """``generate`` and ``translate``: every input checked (flags, then the target's kind) before any loading."""
    if args.prompts_file is not None:
        if args.prompt is not None or args.prompt_file is not None:
            raise UsageError("give --prompts-file alone: not with a prompt argument or --prompt-file")
        prompts = read_prompts_file(args.prompts_file)
        models, settings = settings_from(args)
        _check_target_kind(args.command, models.target)
        return _run_batch(args, prompts, models, settings)
    prompt = _read_prompt(args)
    models, settings = settings_from(args)
    _check_target_kind(args.command, models.target)
    from specdec.report import summary_line  # torch and rich: after the checks
    from specdec.session import Session
    from specdec.terminal import ShownStream, print_legend

    loading = time.perf_counter()
    session = Session(models)
    prompt_ids = session.encode(prompt, settings)
    session.load(settings.mode, settings.spec.speculate)
    stream = ShownStream(session.tokenizer(settings.mode), prompt_ids,
                         show_acceptance=settings.show_acceptance, echo=not args.json)
    if settings.show_acceptance and not args.json:
        print_legend(settings.mode)
    start = time.perf_counter()
    first: list[float] = []  # when the first round committed its tokens

    def on_round(event: RoundEvent) -> None:
        check_interrupted()
        if not first:
            first.append(time.perf_counter())
        stream.add(event)

    try:
        check_interrupted()
        result = session.generate(prompt_ids, settings, on_round=on_round)
    except KeyboardInterrupt:
        stream.finish()
        elapsed = time.perf_counter() - start
        if args.json:
            print(json.dumps({"text": stream.text, "tokens": stream.ids, "prompt_ids": prompt_ids,
                              "stop_reason": "interrupted", "mode": settings.mode, "stats": None}))
        else:
            print(f"[interrupted: {len(stream.ids)} new tokens in {elapsed:.2f} s]", file=sys.stderr)
        return EXIT_INTERRUPTED
    stream.finish()
    timing = {"load_time_s": start - loading, "time_to_first_token_s": first[0] - start if first else None}
    if args.json:
        print(json.dumps({**_result_json(result, stream.text, prompt_ids, models, settings), **timing}))
    else:
        ttft = "" if not first else f"first token in {timing['time_to_first_token_s']:.3f} s, "
        print(f"{summary_line(result, settings.mode)} | {ttft}models loaded in {timing['load_time_s']:.1f} s",
              file=sys.stderr)
    return 0


def _run_batch(args: argparse.Namespace, prompts: list[str], models: ModelConfig, settings: Settings) -> int:
    """Decode a prompts file in batches of --batch-size; print each result in input order as soon as
    the ones before it are done (JSON lines with --json)."""
    from specdec.report import batch_line, summary_line
    from specdec.session import Session
    from specdec.terminal import result_block

    session = Session(models)
    encoded = [session.encode(p, settings) for p in prompts]
    tokenizer = session.tokenizer(settings.mode)
    done: dict[int, GenerationResult] = {}
    printed = 0

    def emit(result: GenerationResult) -> None:
        nonlocal printed
        check_interrupted()
        done[result.index] = result
        while printed in done:
            ready = done.pop(printed)
            text = tokenizer.decode(ready.tokens, skip_special_tokens=True)
            if args.json:
                line = _result_json(ready, text, encoded[printed], models, settings)
                print(json.dumps({"index": printed, "prompt": prompts[printed], **line}), flush=True)
            else:
                result_block(printed, prompts[printed], text, ready, settings)
                print(summary_line(ready, settings.mode, auto=False), file=sys.stderr)
            printed += 1

    try:
        check_interrupted()
        results = session.generate(encoded, settings, on_result=emit)
    except KeyboardInterrupt:
        print(f"[interrupted: {printed} of {len(prompts)} prompts done]", file=sys.stderr)
        return EXIT_INTERRUPTED
    if not args.json:
        print(batch_line(results[0].batch, settings.mode), file=sys.stderr)
    return 0


def add_prompt_arguments(parser: argparse.ArgumentParser, noun: str, what: str) -> None:
    """The input and output flags of ``generate`` and ``translate`` (``noun``: prompt or source), then
    the decoding flags."""
    parser.add_argument("prompt", nargs="?", metavar=noun.upper(), help=what)
    parser.add_argument("--prompt-file", metavar="FILE", help=f"read the {noun} from FILE (all of it, one {noun})")
    parser.add_argument("--prompts-file", metavar="FILE",
                        help=f"many {noun}s: one per line, or for .jsonl one JSON object per line with a \"prompt\"")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (text, token ids, settings, all stats) and nothing else; "
                        "one per line (JSONL) with --prompts-file")
    add_decoding_arguments(parser)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``specdec generate``."""
    parser = subparsers.add_parser(
        "generate",
        description="Complete PROMPT (or --prompt-file, or standard input): the text streams to stdout as each "
        "round commits; the summary line goes to stderr. With --prompts-file, complete every prompt of the file "
        "in batches of --batch-size, printing each result in input order.",
    )
    add_prompt_arguments(parser, "prompt", "the text to complete")
    parser.set_defaults(func=_run_generate)
    _register_translate(subparsers)


# --------------------------------------------------------------------------------------- translate

TRANSLATE_TARGET = "translate-target"  # translate's default target: the shipped English -> German Marian model
TRANSLATE_DRAFTER = "ngram"  # translate's default drafter: source-copy lookup, the fastest exact one measured


def _register_translate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "translate",
        description="Translate SOURCE (or --prompt-file, or standard input) with an encoder-decoder target: "
        "`generate` with the source as the prompt. Defaults: the shipped translate-target and source-copy "
        "lookup drafting (exact); --mode target decodes with the target alone.",
    )
    add_prompt_arguments(parser, "source", "the text to translate")
    parser.set_defaults(func=_run_generate, target=TRANSLATE_TARGET, drafter=TRANSLATE_DRAFTER)


# -------------------------------------------------------------------------------------------- main


class _Subcommands(argparse._SubParsersAction):
    """The subparsers of ``specdec``: each command's one-line help comes from ``SUBCOMMANDS``."""

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        kwargs.setdefault("help", SUBCOMMANDS[name].help)
        return super().add_parser(name, **kwargs)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``specdec`` parser with ``command``'s module registered; every other command is listed by its
    help line alone (its module is not imported)."""
    parser = ArgumentParser(
        prog="specdec", description="Speculative decoding for Hugging Face transformers models."
    )
    parser.add_argument("--version", action="version", version=version_line())
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", action=_Subcommands)
    if command in SUBCOMMANDS:
        importlib.import_module(SUBCOMMANDS[command].module).register(subparsers)
    for name in SUBCOMMANDS:
        if name not in subparsers.choices:
            subparsers.add_parser(name)
    return parser


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``specdec`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status. Ctrl-C at any
    moment (parsing, importing, loading models, generating) ends it with one line and status 130."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    name = "specdec" + (f" {command}" if command in SUBCOMMANDS else "")
    keep_swallowed_interrupts()
    try:
        args = build_parser(command).parse_args(argv)
        try:
            status = args.func(args)
            check_interrupted()  # one swallowed after the last check: the command ran to its end, but was interrupted
            return status
        except (UsageError, ValueError, OSError) as err:
            print(f"specdec {args.command}: error: {_one_line(err)}", file=sys.stderr)
            return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
