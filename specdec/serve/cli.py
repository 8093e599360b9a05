"""``specdec serve``: the OpenAI-compatible server, with the flags of ``specdec generate``.

Flags come from ``ServeConfig`` (host, port, API key, model id, body limit) and from the core's
config classes, exactly as for ``generate`` (``--target``, ``--drafter``, ``--gamma``,
``--batch-size``, ``--speculate``, ``--schedule``, ``--temperature``...): the decoding flags are the defaults of
requests that do not set their own. One default differs: ``--speculate auto`` (``serve.config.SPECULATE``). FastAPI and
uvicorn are the optional extra ``pip install -e ".[serve]"``; without them the command says so in one line.
"""

from __future__ import annotations

import argparse
import sys

from specdec.arguments import UsageError, add_config_arguments, config_from
from specdec.config import ModelConfig, SamplingConfig, ScheduleConfig, SpecConfig, VerifyConfig
from specdec.serve.config import API_KEY_ENV, SPECULATE, ServeConfig
from specdec.threads import current as current_threads
from specdec.threads import helper_note

EXTRA = 'pip install -e ".[serve]"'  # how to install what the server needs


def exposure_warning(config: ServeConfig) -> str | None:
    """What to warn of when the server listens beyond this machine without a key (None: nothing)."""
    if config.key() is not None or config.loopback:
        return None
    where = "every interface" if config.all_interfaces else config.host
    return (f"listening on {where} without an API key: anyone who can reach this machine can use the model; "
            f"set --api-key or ${API_KEY_ENV}")


def _run_serve(args: argparse.Namespace) -> int:
    if args.gpu is not None:
        if args.device is not None:
            raise UsageError("give --device or --gpu, not both")
        args.device = f"cuda:{args.gpu}"
    config = config_from(args, ServeConfig)
    models, spec = config_from(args, ModelConfig), config_from(args, SpecConfig)
    sampling, verify = config_from(args, SamplingConfig), config_from(args, VerifyConfig)
    schedule = config_from(args, ScheduleConfig)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise UsageError(f"specdec serve needs {err.name}: install the server's extra with {EXTRA}") from None
    from specdec.serve.app import create_app
    from specdec.serve.front import Front
    from specdec.serve.server import (  # torch: only once the settings hold
        bind,
        make_server,
        served_models,
        url_of,
    )

    warning = exposure_warning(config)
    if warning:
        print(f"specdec serve: warning: {warning}", file=sys.stderr)
    sock = bind(config.host, config.port)
    front = Front(sock, config) if config.front == "process" else None  # it starts while the models load
    try:
        served, metrics = served_models(config, models, spec, sampling, verify, schedule=schedule)
    except BaseException:
        if front is not None:
            front.stop()
        raise
    drafter = "none" if spec.speculate == "off" else models.drafter
    beside = any(m.engine.beside is not None for m in served)
    compiling = "; compiling beside serving, eager until then" if beside else ""
    http = "HTTP in a process of its own" if front is not None else "HTTP on a thread of this process"
    print(f"specdec serve: {models.target} (drafter {drafter}, speculate {spec.speculate}, schedule "
          f"{schedule.schedule}, batch size {spec.batch_size}, {current_threads().describe()}{helper_note()}"
          f"{compiling}; {http}) on "
          f"{url_of(sock)}: the page at /, the API at /v1",
          file=sys.stderr, flush=True)
    if front is not None:
        return front.serve(served, metrics, config.drain_s)
    server = make_server(create_app(served, config, metrics), config.log_level, config.drain_s)
    server.run(sockets=[sock])
    if server.was_cut:
        print(f"specdec serve: the requests still running after {config.drain_s:g} s of draining were answered 503",
              file=sys.stderr, flush=True)
        return 1
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``specdec serve``."""
    parser = subparsers.add_parser(
        "serve",
        description="Serve the target over OpenAI's API (/v1/completions, /v1/chat/completions, streaming "
        "included), batching requests continuously, with Prometheus metrics at /metrics and a live page at /. "
        f"Needs the extra: {EXTRA}.",
    )
    for cls in (ServeConfig, ModelConfig, SpecConfig, SamplingConfig, VerifyConfig, ScheduleConfig):
        add_config_arguments(parser, cls)
    parser.add_argument("--gpu", metavar="ID", help="LMFlow's flag: the same as --device cuda:ID")
    parser.set_defaults(func=_run_serve, speculate=SPECULATE)
