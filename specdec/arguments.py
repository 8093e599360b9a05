"""Command-line flags generated from the config dataclasses, and the settings they validate into.

Each field of a config dataclass (``specdec.config``) becomes ``--field-name`` (plus
``--field_name``), typed from its annotation, its help taken from its comment; so the command line
and the Python API cannot disagree on a default (docs/design.md rule 5). LMFlow's
``speculative_inference.py`` flags are aliases (``--model --draft_model --temperature --gamma
--max_new_tokens --gpu``).

``generate``/``translate`` (``specdec.cli``), ``chat`` (``specdec.console``) and ``serve`` share
these flags; they live here, below all of them, so none of those modules imports another to get
them. Nothing here imports torch or transformers: ``specdec --help`` and a bad flag stay fast.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specdec.config import (
    BLOCK,
    LOOKUP,
    NGRAM,
    SHIPPED_DRAFTERS,
    SHIPPED_TARGETS,
    ModelConfig,
    SamplingConfig,
    ScheduleConfig,
    SpecConfig,
    VerifyConfig,
)

T = typing.TypeVar("T")

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
COMPARE = "compare"  # the chat mode that runs the target alone, then speculative decoding
# Help appended to a field's comment: the names a flag accepts, from the constants that define them.
NAMES_HELP: Mapping[str, str] = {
    "target": f"shipped: {', '.join(SHIPPED_TARGETS)}",
    "drafter": (f"one of: {NGRAM}, {LOOKUP}NAME, {BLOCK} (the shipped block drafter for the target's kind), "
                f"{BLOCK}:PATH (a block drafter folder), a shipped drafter ({', '.join(SHIPPED_DRAFTERS)}) or a "
                "model folder"),
}
DEFAULT_VERIFY = VerifyConfig()  # the rule that fits the temperature
DEFAULT_SCHEDULE = ScheduleConfig()  # constant gamma


class UsageError(Exception):
    """Input the command line refuses; reported as one line on stderr with exit status 2."""


@dataclass(frozen=True)
class Settings:
    """Everything that decides one generation besides the models."""

    sampling: SamplingConfig  # temperature, top-k, top-p, seed
    spec: SpecConfig  # gamma, max_new_tokens, batch_size, speculate
    mode: str  # one of MODES (or COMPARE in chat)
    verify: VerifyConfig = DEFAULT_VERIFY  # the verification rule
    schedule: ScheduleConfig = DEFAULT_SCHEDULE  # how far each row drafts
    stop_strings: tuple[str, ...] = ()  # stop once the decoded text ends with one of these
    chat_template: bool = False  # wrap the prompt in the tokenizer's chat template
    show_acceptance: bool = False  # colour tokens by kind
    from_model: frozenset[str] = frozenset()  # sampling fields left to the target's generation config


def field_comments(cls: type) -> dict[str, str]:
    """The ``# comment`` after each field of a config dataclass, read from its source; a comment wrapped onto the
    lines below it, each a comment alone starting in the same column, goes on.

    Only the class body's own annotated fields count, so a comment inside a method
    (``for t in self.temperature:  # ...``) is never taken for a field's help."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0].body
    field_at = {node.lineno: node.target.id for node in body
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    comments: dict[str, str] = {}
    field, at = None, (0, 0)  # the field whose comment goes on, and where its next line would start
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string.lstrip("#").strip()
        if tok.start[0] in field_at:
            field = field_at[tok.start[0]]
            comments[field] = text
        elif field is not None and tok.start == at and not tok.line[: tok.start[1]].strip():
            comments[field] += " " + text  # a comment wrapped onto the lines below, in the same column
        else:
            field = None
        at = (tok.start[0] + 1, tok.start[1])
    return comments


def _scalar_type(hint: object) -> type:
    """``int``, ``float`` or ``str`` from a field's annotation (``X | None`` -> X)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint  # type: ignore[return-value]


def add_config_arguments(
    parser: argparse.ArgumentParser, cls: type, aliases: Mapping[str, Sequence[str]] = ALIASES,
    notes: Mapping[str, str] = NAMES_HELP, from_model: Sequence[str] = (),
) -> None:
    """One flag per field of the dataclass ``cls``, with its default, type and comment (and its ``notes``); a
    bool field is a switch; the fields ``from_model`` default to None (the target's generation config decides)."""
    comments = field_comments(cls)
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip())
    for f in dataclasses.fields(cls):
        flags = [f"--{f.name.replace('_', '-')}"]
        if "_" in f.name:
            flags.append(f"--{f.name}")
        flags.extend(aliases.get(f.name, ()))
        help_text = "; ".join(filter(None, (comments.get(f.name, ""), notes.get(f.name)))).replace("%", "%%")
        fixed = next((h for h in (hints[f.name], *typing.get_args(hints[f.name])) if typing.get_origin(h) is tuple),
                     None)  # tuple[...] or tuple[...] | None
        if fixed is not None:  # a fixed number of values, e.g. --bound MIN MAX
            args = typing.get_args(fixed)
            shown = "see above" if f.default is None else " ".join(map(str, f.default))
            group.add_argument(
                *flags, dest=f.name, type=args[0], nargs=len(args), default=f.default,
                metavar=tuple(n.upper() for n in ("min", "max")) if len(args) == 2 else None,
                help=f"{help_text} (default: {shown})",
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
    """Validate the shared flags into a ``ModelConfig`` and ``Settings``."""
    if args.gpu is not None:
        if args.device is not None:
            raise UsageError("give --device or --gpu, not both")
        args.device = f"cuda:{args.gpu}"
    models = config_from(args, ModelConfig)
    models.drafter_config  # noqa: B018  (parse the drafter's name now: a bad one is refused before any loading)
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
    if settings.spec.tree is not None:  # token trees decode on the eager path (specdec.tree)
        if models.compile == "on":
            raise UsageError("--tree decodes on the eager path: drop --compile on (or --tree)")
        models = dataclasses.replace(models, compile="off")
    return models, settings
