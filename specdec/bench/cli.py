"""`specdec bench` (and `python -m specdec.bench`): flags generated from ``BenchConfig``.

Each field of :class:`specdec.bench.config.BenchConfig` becomes ``--field-name`` with the field's
comment as help; tuple fields take several values, spaced or comma-separated (``--gamma 1 2 4 8``
or ``--gamma 1,2,4,8`` sweeps), booleans have a ``--no-`` form. ``--quick`` starts from
:func:`specdec.bench.config.quick`; flags given explicitly win over it. Exit status: 0 when every method ran and every
greedy output equals plain-hf's, 1 otherwise (the report says which), 2 for bad input. The parser and the settings'
checks import no torch: the harness, the peers and the report are imported once the settings hold (``--help`` and an
argument error take a fraction of a second, not the seconds torch and transformers take to import).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path

from specdec.arguments import field_comments
from specdec.bench.config import BenchConfig, quick
from specdec.folders import resolve_model_path
from specdec.threads import machine_choice, use_threads

EXIT_USAGE = 2
DESCRIPTION = ("Measure speculative decoding against plain decoding and transformers' generate on the same prompts: "
               "tokens/s, acceptance (alpha, tau), memory, and whether every greedy output equals plain-hf's. "
               "Exit status 0 when every method ran and matched, 1 otherwise, 2 for bad input.")


def _element_type(hint: object) -> tuple[type, bool]:
    """(scalar type, takes several values) of a field annotation like ``tuple[int, ...]`` or ``str | None``."""
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return (args[0] if args else hint), False  # type: ignore[return-value]


def _comma_list(kind: type) -> Callable[[str], list]:
    """An argparse type reading "a,b,c" as [kind(a), kind(b), kind(c)]."""

    def parse(text: str) -> list:
        return [kind(part) for part in text.split(",") if part]

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per BenchConfig field (default None: "not given", so --quick can tell), plus --quick/--list."""
    comments = field_comments(BenchConfig)
    hints = typing.get_type_hints(BenchConfig)
    for f in dataclasses.fields(BenchConfig):
        kind, several = _element_type(hints[f.name])
        shown = (" ".join(map(str, f.default)) or ("all" if f.name == "methods" else "none")) if several else f.default
        default = f" (default: {shown})"
        help_text = (comments.get(f.name, "") + default).replace("%", "%%")
        flag = f"--{f.name.replace('_', '-')}"
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(
                flag, dest=f.name, type=_comma_list(kind) if several else kind, nargs="+" if several else None,
                default=None, metavar=kind.__name__.upper(), help=help_text,
            )
    parser.add_argument("--quick", action="store_true",
                        help="few prompts, short outputs, one repeat: < 1 minute on a CPU")
    parser.add_argument("--list", action="store_true", help="list the methods and exit")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The defaults (or --quick's), overridden by every flag given."""
    base = quick(BenchConfig()) if args.quick else BenchConfig()
    given = {}
    for f in dataclasses.fields(BenchConfig):
        value = getattr(args, f.name)
        if value is not None:
            given[f.name] = tuple(x for part in value for x in part) if isinstance(value, list) else value
    return dataclasses.replace(base, **given)


def _check_settings(config: BenchConfig) -> None:
    """What can be checked before torch is imported: ``--threads`` (or OMP_NUM_THREADS), as ``use_threads`` will
    apply it, the ``--target`` folder (the translate task's default stands for translate-target), and ``--peers``
    (known and installed)."""
    from specdec.bench.peers import check_peers  # imports no torch

    machine_choice(config.threads, flag="--threads")
    if config.target != BenchConfig.target:
        resolve_model_path(config.target)
    check_peers(config.peers)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the flags describe; print the report and write the outputs."""
    if not args.list:  # bad settings are refused before torch is imported
        config = config_from_args(args)
        _check_settings(config)
    from rich.console import Console

    from specdec.bench.peers import PEER_GROUPS, PEERS
    from specdec.bench.runners import RUNNERS

    console = Console()
    if not console.is_terminal:  # a file or pipe: do not fold the wide table to 80 columns
        console = Console(width=200)
    if args.list:
        for name, runner in RUNNERS.items():
            console.print(f"{name:<20} (group {runner.group}): {runner.description}")
        for name, peer in PEERS.items():
            console.print(f"{name:<20} (--peers {name}): {peer.description}")
        for name, members in PEER_GROUPS.items():
            console.print(f"{name:<20} (--peers {name}): {', '.join(members)}")
        return 0
    if config.task == "translate" and not config.serve:  # the translate pair stands for the code pair's names
        from specdec.bench.translate import config_from_bench
        from specdec.bench.translate import run_and_report as translate_and_report

        use_threads(config.threads, model=config_from_bench(config).target, flag="--threads")
        return translate_and_report(config, console)
    use_threads(config.threads, model=config.target, flag="--threads")  # before any model runs
    if config.serve:
        from specdec.bench.serve import run_and_report as serve_and_report

        return serve_and_report(config, console)
    if config.pareto:
        from specdec.bench.pareto import run_and_report as pareto_and_report

        return pareto_and_report(config, console)
    if config.block:
        from specdec.bench.block import run_and_report as block_and_report

        return block_and_report(config, console)
    if config.batch_sizes:
        from specdec.bench.batched import run_and_report

        return run_and_report(config, console)
    from specdec.bench.harness import run_benchmark
    from specdec.bench.report import build_report, print_report, write_outputs

    report = build_report(run_benchmark(config))
    paths = write_outputs(report, Path(config.output), plots=config.plots)
    print_report(report, console)
    console.print(f"wrote {', '.join(str(p) for p in paths)}", style="dim")
    return 0 if report.ok else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `specdec bench` to the `specdec` command line."""
    parser = subparsers.add_parser(
        "bench",
        description=DESCRIPTION,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m specdec.bench`: the same command without the `specdec` front end."""
    parser = argparse.ArgumentParser(prog="python -m specdec.bench", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, TypeError, OSError) as err:
        print(f"specdec bench: error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_USAGE
