"""``specdec train head`` and ``specdec train head-eval``: build the head's data, train it, evaluate it.

    specdec train head --outputs runs/code-target-outputs.jsonl --valid-outputs runs/valid-outputs.jsonl \
        --out runs/acceptance-head            # data in runs/acceptance-head/data, head in .../final
    specdec train head --target MODEL --drafter DRAFTER --data runs/outputs.jsonl --out runs/my-head
                        # any pair (decoder-only or encoder-decoder), on `specdec data outputs`; ada's threshold
                        # and MAX tuned on half the held-out prompts, measured on the rest (specdec/heads/own.py)
    torchrun --nproc_per_node 2 -m specdec train head ...   # the same, data parallel (or accelerate launch)
    specdec train head-eval --head runs/acceptance-head/final --valid-outputs runs/valid-outputs.jsonl \
        --out runs/acceptance-head/eval       # calibration plot, Brier, stop-rule simulation

Run ``head`` again with the same ``--out`` to resume (data shards, then training). Flags are the
fields of ``HeadDataConfig``, ``HeadTrainConfig`` and ``HeadTuneConfig``, with their defaults and comments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path

from specdec.heads.config import LABEL_KINDS, HeadDataConfig, HeadTrainConfig, HeadTuneConfig

_SET_BY_CLI = {"outputs", "data", "valid", "labels"}  # fields the command fills from its own flags


def _add_fields(parser: argparse.ArgumentParser, cls: type, skip: set[str]) -> None:
    """One flag per field of ``cls`` (not in ``skip``), typed from its annotation, help from its comment."""
    from specdec.arguments import field_comments

    comments = field_comments(cls)
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip())
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        many = typing.get_origin(hints[f.name]) is tuple  # tuple[X, ...]: one or more values
        kind = next((a for a in typing.get_args(hints[f.name]) if a is not type(None)), hints[f.name])
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=f.default,
                           type=kind, nargs="+" if many else None,
                           help=comments.get(f.name, "").replace("%", "%%") + " (default: %(default)s)")


def _fields(args: argparse.Namespace, cls: type, **extra) -> dict:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return {**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}, **extra}


def _cmd_head(args: argparse.Namespace) -> int:
    import torch

    from specdec.heads.data import build_head_data
    from specdec.heads.train import train_head

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    own = None
    if args.data is not None and (Path(args.data).is_file() or args.data.endswith(".jsonl")):  # any pair
        from specdec.heads.own import check_pair
        from specdec.train.outputs import valid_path

        if args.outputs or args.valid_outputs or args.valid_data:
            raise ValueError("--data FILE (a `specdec data outputs` file) replaces --outputs, --valid-outputs and "
                             "--valid-data: its held-out share is read from beside it")
        tune = HeadTuneConfig(**_fields(args, HeadTuneConfig))  # its checks before any work
        own = check_pair(args.target, args.drafter, args.data)  # refuses another target's data or vocabulary
        args.outputs, args.data = args.data, None
        args.valid_outputs = str(valid_path(args.outputs)) if own.valid else None
    data_dir = Path(args.data or out / "data")
    valid_dir = Path(args.valid_data or out / "valid-data") if (args.valid_outputs or args.valid_data) else None
    labels = tuple(args.labels)
    rank, world = _process()
    builds = []
    if args.outputs:
        builds.append((HeadDataConfig(**_fields(args, HeadDataConfig, outputs=args.outputs, labels=labels)), data_dir))
    elif not data_dir.exists():
        raise ValueError(f"no head data at {data_dir}: give --outputs (a `specdec train outputs` file) to build it")
    if args.valid_outputs:
        builds.append((HeadDataConfig(**_fields(args, HeadDataConfig, outputs=args.valid_outputs, labels=labels,
                                                records=args.valid_records)), valid_dir))
    for cfg, folder in builds:
        build_head_data(cfg, folder, device=args.device, rank=rank, world=world,
                        log=print if rank == 0 else (lambda _msg: None), progress=_progress_printer(folder, rank))
    _barrier(world)
    if args.data_only:
        return 0
    cfg = HeadTrainConfig(**_fields(args, HeadTrainConfig, data=str(data_dir),
                                    valid=None if valid_dir is None else str(valid_dir), labels=labels))
    final = train_head(cfg, out, stop_at_step=args.stop_at_step)
    if rank == 0 and final is not None and own is not None:
        from specdec.heads.own import finish

        finish(final, args.target, args.drafter, args.outputs, own, not args.no_measure, tune)
    if rank == 0:
        print(f"final head: {final}" if final else "stopped early; run the same command to resume")
    return 0


def _process() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment (torchrun / accelerate launch), else (0, 1)."""
    import os

    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _barrier(world: int) -> None:
    """Wait for every process (the data shards of all of them are written) before training."""
    if world > 1:
        from accelerate import PartialState

        PartialState(cpu=True).wait_for_everyone()


def _progress_printer(folder: Path, rank: int):
    """A line every 10% of a data build (rank 0 only; logs stay readable under nohup)."""
    if rank != 0:
        return None
    marks: set[int] = set()

    def report(done: int, total: int) -> None:
        tenth = 10 * done // max(1, total)
        if tenth not in marks:
            marks.add(tenth)
            print(f"{folder.name}: {done}/{total} records", flush=True)

    return report


def _cmd_head_eval(args: argparse.Namespace) -> int:
    import torch

    from specdec.heads.report import evaluate_head

    torch.set_num_threads(args.threads)
    summary = evaluate_head(args.head, args.valid_outputs, args.out, target=args.target, drafter=args.drafter,
                            valid_data=args.valid_data, thresholds=tuple(args.thresholds),
                            bound=tuple(args.bound), device=args.device, records=args.records)
    print(json.dumps(summary["chosen"], indent=1))
    return 0


def register(sub) -> None:
    """Add ``head`` and ``head-eval`` to the ``specdec train`` subparsers ``sub``."""
    head = sub.add_parser("head", help="build the acceptance head's data and train it (resumable; data parallel "
                                       "under torchrun / accelerate launch)",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    head.add_argument("--out", required=True, help="run folder: checkpoint/ (resume), final/ (the head)")
    head.add_argument("--outputs", help="the target's continuations of train prompts (`specdec train outputs`)")
    head.add_argument("--valid-outputs", help="the same for validation prompts (validation loss)")
    head.add_argument("--data", help="a `specdec data outputs` file of --target (any pair: replaces "
                                     "--outputs and --valid-outputs; the head is measured at the end), or a head "
                                     "data folder to build or read (default: OUT/data)")
    head.add_argument("--valid-data", help="validation head data folder (default: OUT/valid-data)")
    head.add_argument("--valid-records", type=int, default=None, help="use only the first N validation records")
    head.add_argument("--labels", nargs="+", choices=LABEL_KINDS, default=list(LABEL_KINDS),
                      help="label kinds to build and train on (default: both: one head for greedy and sampling)")
    head.add_argument("--device", default="cpu", help="where the models run while building data")
    head.add_argument("--threads", type=int, default=1, help="torch threads per process")
    head.add_argument("--stop-at-step", type=int, default=None, help="checkpoint and stop at this step")
    head.add_argument("--data-only", action="store_true", help="build the data folders and stop")
    head.add_argument("--no-measure", action="store_true",
                      help="with --data FILE: skip ada's tuning and the held-out speed measurement at the end")
    _add_fields(head, HeadDataConfig, _SET_BY_CLI | {"seed"})
    _add_fields(head, HeadTrainConfig, _SET_BY_CLI)
    _add_fields(head, HeadTuneConfig, set())
    head.set_defaults(func=_cmd_head)

    ev = sub.add_parser("head-eval", help="calibration and stop-rule simulation of an acceptance head on "
                                          "held-out prompts")
    ev.add_argument("--head", default=None, help="head folder (default: the shipped head)")
    ev.add_argument("--valid-outputs", required=True, help="the target's continuations of validation prompts")
    ev.add_argument("--valid-data", default=None, help="teacher-forced validation head data (for its calibration)")
    ev.add_argument("--out", required=True, help="folder for rounds-*.safetensors (reused), plots and summary.json")
    ev.add_argument("--target", default="code-target")
    ev.add_argument("--drafter", default="code-drafter")
    ev.add_argument("--records", type=int, default=None, help="only the first N records of --valid-outputs")
    ev.add_argument("--thresholds", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    ev.add_argument("--bound", type=int, nargs=2, default=[1, 16], metavar=("MIN", "MAX"))
    ev.add_argument("--device", default="cpu")
    ev.add_argument("--threads", type=int, default=1, help="torch threads")
    ev.set_defaults(func=_cmd_head_eval)
