"""The ``specdec`` command line: ``generate``, ``translate``, ``chat``, ``train``, ``bench``, ``serve`` and ``data``.

Flags and defaults are generated from the config dataclasses (``specdec.config``): each field
becomes ``--field-name`` (plus ``--field_name``), typed from its annotation, its help taken from
its comment; so the command line and the Python API cannot disagree on a default (DESIGN.md rule
5). LMFlow's ``speculative_inference.py`` flags are aliases (``--model --draft_model --temperature
--gamma --max_new_tokens --gpu``).

Subcommands plug in through ``SUBCOMMANDS``: a name and the module whose ``register(subparsers)``
adds its parser and sets ``func`` (``args -> exit status``) as its default.

Bad input (a missing model, an out-of-range value, an incompatible pair) is one line on stderr
and exit status 2, never a traceback; Ctrl-C stops a generation and keeps what it produced.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import io
import json
import sys
import textwrap
import time
import tokenize
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path

from specdec.config import ModelConfig, SamplingConfig, ScheduleConfig, SpecConfig, VerifyConfig

if typing.TYPE_CHECKING:
    from specdec.console import Settings
    from specdec.stats import GenerationResult

T = typing.TypeVar("T")

# Subcommand -> the module whose register(subparsers) adds it. Only the module of the command being
# run is imported (bench's plotting stack stays out of `specdec generate`); --help imports them all.
SUBCOMMANDS: Mapping[str, str] = {
    "generate": "specdec.cli",
    "translate": "specdec.cli",
    "chat": "specdec.console",
    "train": "specdec.train.cli",
    "bench": "specdec.bench.cli",
    "serve": "specdec.serve.cli",
    "data": "specdec.data.cli",
}
EXIT_USAGE = 2  # bad input: what argparse uses too
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention

# LMFlow's speculative_inference.py spellings, accepted beside ours.
ALIASES: Mapping[str, Sequence[str]] = {
    "target": ("--model",),
    "drafter": ("--draft-model", "--draft_model"),
    "rule": ("--verify",),
    # transformers' names for the schedule and its number of drafted tokens
    "schedule": ("--num-assistant-tokens-schedule", "--num_assistant_tokens_schedule"),
    "gamma": ("--num-assistant-tokens", "--num_assistant_tokens"),
}
FROM_MODEL = ("temperature", "top_k", "top_p")  # sampling flags that default to the target's generation config
MODES = ("speculative", "target", "drafter")  # what decodes: draft + verify, the target or the drafter alone


class UsageError(Exception):
    """Input the command line refuses; reported as one line on stderr with exit status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit status 2), not the usage block."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def field_comments(cls: type) -> dict[str, str]:
    """The ``# comment`` after each field of a config dataclass, read from its source.

    Only the class body's own annotated fields count, so a comment inside a method
    (``for t in self.temperature:  # ...``) is never taken for a field's help."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0].body
    field_at = {node.lineno: node.target.id for node in body
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    return {
        field_at[tok.start[0]]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and tok.start[0] in field_at
    }


def _scalar_type(hint: object) -> type:
    """``int``, ``float`` or ``str`` from a field's annotation (``X | None`` -> X)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint  # type: ignore[return-value]


def add_config_arguments(
    parser: argparse.ArgumentParser, cls: type, aliases: Mapping[str, Sequence[str]] = ALIASES,
    from_model: Sequence[str] = (),
) -> None:
    """One flag per field of the dataclass ``cls``, with its default, type and comment; a bool field is a
    switch; the fields ``from_model`` default to None (the target's generation config decides)."""
    comments = field_comments(cls)
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip())
    for f in dataclasses.fields(cls):
        flags = [f"--{f.name.replace('_', '-')}"]
        if "_" in f.name:
            flags.append(f"--{f.name}")
        flags.extend(aliases.get(f.name, ()))
        help_text = comments.get(f.name, "").replace("%", "%%")
        if typing.get_origin(hints[f.name]) is tuple:  # a fixed number of values, e.g. --bound MIN MAX
            args = typing.get_args(hints[f.name])
            group.add_argument(
                *flags, dest=f.name, type=args[0], nargs=len(args), default=f.default,
                metavar=tuple(n.upper() for n in ("min", "max")) if len(args) == 2 else None,
                help=f"{help_text} (default: {' '.join(map(str, f.default))})",
            )
            continue
        kind = _scalar_type(hints[f.name])
        if kind is bool:
            group.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
            continue
        default = None if f.name in from_model else f.default
        shown = f"the target's generation config, else {f.default}" if f.name in from_model else "%(default)s"
        group.add_argument(
            *flags, dest=f.name, type=kind, default=default, metavar=kind.__name__.upper(),
            help=f"{help_text} (default: {shown})",
        )


def config_from(args: argparse.Namespace, cls: type[T]) -> T:
    """Build (and so validate) a config dataclass from the parsed flags of its fields."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def add_decoding_arguments(parser: argparse.ArgumentParser, modes: Sequence[str] = MODES) -> None:
    """The flags ``generate`` and ``chat`` share: models, sampling, the round loop, stops, display."""
    for cls in (ModelConfig, SpecConfig, SamplingConfig, VerifyConfig, ScheduleConfig):
        add_config_arguments(parser, cls, from_model=FROM_MODEL if cls is SamplingConfig else ())
    parser.add_argument("--gpu", metavar="ID", help="LMFlow's flag: the same as --device cuda:ID")
    parser.add_argument("--mode", choices=modes, default=modes[0],
                        help="decode with draft + verify (speculative), the target alone or the drafter "
                        "alone (default: %(default)s)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop once the decoded text ends with TEXT (repeatable)")
    parser.add_argument("--chat-template", action="store_true",
                        help="wrap the prompt in the tokenizer's chat template (instruction-tuned models)")
    parser.add_argument("--show-acceptance", action="store_true",
                        help="colour accepted, recovered and bonus tokens, with a legend")


def settings_from(args: argparse.Namespace) -> tuple[ModelConfig, Settings]:
    """Validate the shared flags into a ``ModelConfig`` and a ``console.Settings``."""
    from specdec.console import Settings

    if args.gpu is not None:
        if args.device is not None:
            raise UsageError("give --device or --gpu, not both")
        args.device = f"cuda:{args.gpu}"
    models = config_from(args, ModelConfig)
    from_model = frozenset(name for name in FROM_MODEL if getattr(args, name) is None)
    for name in from_model:
        setattr(args, name, getattr(SamplingConfig, name))
    settings = Settings(
        sampling=config_from(args, SamplingConfig),
        from_model=from_model,
        spec=config_from(args, SpecConfig),
        verify=config_from(args, VerifyConfig),
        schedule=config_from(args, ScheduleConfig),
        mode=args.mode,
        stop_strings=tuple(args.stop),
        chat_template=args.chat_template,
        show_acceptance=args.show_acceptance,
    )
    return models, settings


# ---------------------------------------------------------------------------------------- generate


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("give the prompt as an argument or with --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as err:
            raise UsageError(f"cannot read --prompt-file {args.prompt_file!r}: {err.strerror}") from err
    if args.prompt is not None:
        return args.prompt
    if sys.stdin.isatty():
        raise UsageError("no prompt: give it as an argument, with --prompt-file FILE, or on standard input")
    return sys.stdin.read()


def read_prompts_file(path: str) -> list[str]:
    """The prompts of a file: one per line (plain text; blank lines skipped), or, for ``.jsonl``, the
    ``prompt`` of each line's JSON object. Every line is checked before anything runs."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot read --prompts-file {path!r}: {err.strerror}") from err
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
    }


def _run_generate(args: argparse.Namespace) -> int:
    if args.prompts_file is not None:
        if args.prompt is not None or args.prompt_file is not None:
            raise UsageError("give --prompts-file alone: not with a prompt argument or --prompt-file")
        return _run_batch(args, read_prompts_file(args.prompts_file))
    from specdec.console import Session, TokenStream, print_legend, summary_line

    prompt = _read_prompt(args)
    models, settings = settings_from(args)
    session = Session(models)
    prompt_ids = session.encode(prompt, settings)
    stream = TokenStream(session.tokenizer(settings.mode), prompt_ids,
                         show_acceptance=settings.show_acceptance, echo=not args.json)
    if settings.show_acceptance and not args.json:
        print_legend(settings.mode)
    start = time.perf_counter()
    try:
        result = session.generate(prompt_ids, settings, on_round=stream.add)
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
    if args.json:
        print(json.dumps(_result_json(result, stream.text, prompt_ids, models, settings)))
    else:
        print(summary_line(result, settings.mode), file=sys.stderr)
    return 0


def _run_batch(args: argparse.Namespace, prompts: list[str]) -> int:
    """Decode a prompts file in batches of --batch-size; print each result in input order as soon as
    the ones before it are done (JSON lines with --json)."""
    from specdec.console import Session, batch_line, result_block, summary_line

    models, settings = settings_from(args)
    session = Session(models)
    encoded = [session.encode(p, settings) for p in prompts]
    tokenizer = session.tokenizer(settings.mode)
    done: dict[int, GenerationResult] = {}
    printed = 0

    def emit(result: GenerationResult) -> None:
        nonlocal printed
        done[result.index] = result
        while printed in done:
            ready = done.pop(printed)
            text = tokenizer.decode(ready.tokens, skip_special_tokens=True)
            if args.json:
                line = _result_json(ready, text, encoded[printed], models, settings)
                print(json.dumps({"index": printed, "prompt": prompts[printed], **line}), flush=True)
            else:
                result_block(printed, prompts[printed], text, ready, settings)
                print(summary_line(ready, settings.mode), file=sys.stderr)
            printed += 1

    try:
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
        "generate", help="complete prompts (one streaming, or a file of many in batches) with the figures of speculation",
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


def _run_translate(args: argparse.Namespace) -> int:
    """``generate`` for an encoder-decoder target: the prompt is the source text."""
    from transformers import AutoConfig

    from specdec.loading import resolve_model_path

    path = resolve_model_path(args.target)
    if not getattr(AutoConfig.from_pretrained(str(path)), "is_encoder_decoder", False):
        raise UsageError(f"specdec translate needs an encoder-decoder target (Marian, BART, T5), and {args.target} is "
                         "decoder-only: use `specdec generate` for it")
    return _run_generate(args)


def _register_translate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "translate", help="translate sources with an encoder-decoder target (SpecDec's setting)",
        description="Translate SOURCE (or --prompt-file, or standard input) with an encoder-decoder target: "
        "`generate` with the source as the prompt. Defaults: the shipped translate-target and source-copy "
        "lookup drafting (exact); --mode target decodes with the target alone.",
    )
    add_prompt_arguments(parser, "source", "the text to translate")
    parser.set_defaults(func=_run_translate, target=TRANSLATE_TARGET, drafter=TRANSLATE_DRAFTER)


# -------------------------------------------------------------------------------------------- main


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``specdec`` parser with ``command`` registered, or every subcommand when it is not one."""
    parser = ArgumentParser(
        prog="specdec", description="Speculative decoding for Hugging Face transformers models."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [SUBCOMMANDS[command]] if command in SUBCOMMANDS else dict.fromkeys(SUBCOMMANDS.values())
    for name in modules:
        importlib.import_module(name).register(subparsers)
    return parser


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``specdec`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, ValueError, OSError) as err:
        print(f"specdec {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED

