"""``specdec serve --compile auto`` on a CPU: serve at once, compile beside, serve compiled once it is done.

The compiled decode step pays in the server (the shipped pair on the AMD EPYC, 1 thread a forward,
``benchmarks/serve_process.py``: median latency 0.095-0.117 s compiled against 0.152-0.184 s eager at 1 client,
0.277-0.309 against 0.369-0.394 at 4; docs/journal/2026-12-06-background-compile.md, "The server compiles beside
serving"), but compiling
every bucket afresh took 150 s, where loading them all from the compile cache took 1-2 s. So with ``--compile
auto`` (the default) on a CPU that compiles (a C++ compiler, a torch that saves its graphs):

- every bucket found in the compile cache (``compiled.prepare``'s ``cached_only``): the server starts compiled;
- else it starts eager at once, and a child process (``specdec.serve.background``'s ``main``, at the lowest CPU
  priority, ended with the server) compiles the same buckets with the same threads into the compile cache. Once
  it has ended, the engine holds new requests, lets the rows it is decoding finish, loads the graphs (seconds),
  and from then on serves compiled (``Engine``'s switch; said on stderr and in ``/stats``'s ``compile``).
  A child that failed leaves the server eager, said once with its last line.

Every request is decoded either eagerly or compiled, start to end, and both are exact (tests/test_background.py).
``SPECDEC_COMPILE_BESIDE=off`` keeps a server with ``--compile auto`` eager (as before; the test suite's servers).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec.config import ModelConfig, ScheduleConfig, SpecConfig, switch

ENV = "SPECDEC_COMPILE_BESIDE"  # auto (default) | off (``config.SWITCHES``)
MODE = "speculative"  # what the server decodes (``Session.compile``'s mode)


def wanted(models: ModelConfig) -> bool:
    """Whether a server of ``models`` compiles beside its serving: ``--compile auto`` on a CPU whose torch compiles
    and saves its graphs, unless ``SPECDEC_COMPILE_BESIDE=off``."""
    from specdec.compiled import compiler_missing, compiles, saves_graphs
    from specdec.loading import resolve_device

    mode = switch(ENV)
    if mode == "off" or models.compile != "auto":
        return False
    device = resolve_device(models.device)
    return (device == "cpu" and not compiles("auto", device) and compiler_missing() is None
            and saves_graphs())


def _compiled(session, plan) -> bool:
    """Whether every model of ``plan`` (``Session.compile_plan``) has every bucket compiled."""
    from specdec.compiled import buckets, compiled_for

    for name, *shapes in plan:
        compiled = compiled_for(session.model(name))
        if compiled is None or not set(buckets(*shapes)) <= compiled.shapes:
            return False
    return True


def _plan(session, spec: SpecConfig, schedule: ScheduleConfig):
    """The server's compile plan less the models that cannot be compiled (they decode eagerly whatever)."""
    from specdec.compiled import compile_refusal

    return [entry for entry in session.compile_plan(MODE, spec, schedule)
            if compile_refusal(session.model(entry[0])) is None]


def child_command(payload: str) -> list[str]:
    """The child's command line: this Python, importing the ``specdec`` this process runs, whatever the current folder.

    ``python -m specdec.serve.background`` would put the current folder first on the child's ``sys.path``, and a
    folder holding a ``specdec/`` (a clone's parent: the clone) would be imported as ``specdec`` in its stead
    (``module 'specdec' has no attribute 'load_model'``). So the child starts with ``-P`` (no such folder first) and
    puts the folder this ``specdec`` came from first."""
    root = str(Path(__file__).resolve().parents[2])
    boot = ("import sys; sys.path.insert(0, sys.argv[1]); from specdec.serve.background import main; "
            "sys.exit(main(sys.argv[2:]))")
    return [sys.executable, "-P", "-c", boot, root, payload]


class Beside:
    """The compile of a server's models in a child process, and the graphs loaded here once it has ended."""

    def __init__(self, session, spec: SpecConfig, schedule: ScheduleConfig) -> None:
        self.session, self.spec, self.schedule = session, spec, schedule
        self.description: dict = {}  # the served model's (``/stats``): its "compile" is updated
        models = dataclasses.replace(session.models, compile="on", threads=torch.get_num_threads())
        payload = {"models": dataclasses.asdict(models), "spec": dataclasses.asdict(spec),
                   "schedule": dataclasses.asdict(schedule), "parent": os.getpid()}
        self.log = Path(tempfile.mkstemp(prefix="specdec-compile-", suffix=".log")[1])
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(child_command(json.dumps(payload)), stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT)
        self.started = time.perf_counter()

    @classmethod
    def start(cls, session, spec: SpecConfig, schedule: ScheduleConfig) -> tuple[Beside | None, str]:
        """Load every bucket of the server's models from the compile cache if all are there, else start their
        compile beside serving (the ``Beside``); with what to say of it ("" where nothing compiles)."""
        from specdec.compiled import cache_folder

        plan = _plan(session, spec, schedule)
        if not plan:
            return None, ""
        # a first start (no graph saved yet) does not look: looking builds specdec's operators first (the traced
        # step's kernels, a C++ build of 15-20 s), which the child builds anyway
        if any(cache_folder("graphs").glob("*.bin")):
            decided = session.compile(MODE, spec, schedule, how="on", cached_only=True)
            if _compiled(session, plan):
                return None, "auto: " + "; ".join(decided)
        return cls(session, spec, schedule), "auto: compiling beside serving (eager until then)"

    def ended(self) -> bool:
        """Whether the child has ended (the engine then calls ``apply`` between batches)."""
        return self.process.poll() is not None

    def apply(self) -> bool:
        """Load the compiled graphs into this process's models (on the engine's worker thread, no row in flight);
        whether every model is compiled now. Said on stderr either way."""
        seconds = time.perf_counter() - self.started
        lines = self.log.read_text(errors="replace").strip().splitlines() if self.log.is_file() else []
        self.log.unlink(missing_ok=True)
        compiled = False
        if self.process.returncode == 0:
            decided = self.session.compile(MODE, self.spec, self.schedule, how="on", cached_only=True)
            compiled = _compiled(self.session, _plan(self.session, self.spec, self.schedule))
        if compiled:
            self.description["compile"] = "auto: compiled beside serving; " + "; ".join(decided)
            print(f"specdec serve: compiled beside serving in {seconds:.0f} s: serving compiled from now on",
                  file=sys.stderr, flush=True)
        else:
            why = lines[-1] if lines else f"exit status {self.process.returncode}"
            self.description["compile"] = f"auto: the compile beside serving failed ({why}); eager"
            print(f"specdec serve: the compile beside serving failed after {seconds:.0f} s ({why}): serving stays "
                  "eager", file=sys.stderr, flush=True)
        return compiled

    def stop(self) -> None:
        """End the child if it still runs (the server stops)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.unlink(missing_ok=True)


def _orphan_guard(parent: int) -> None:
    """This child ends with its parent (Linux: the parent-death signal), and yields the CPU to everything else."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent ended before the signal was asked for
        sys.exit(1)
    os.nice(19)


def main(argv: list[str]) -> int:
    """The child: compile the server's buckets into the compile cache (``Session.compile`` with ``--compile on``)."""
    payload = json.loads(argv[0])
    _orphan_guard(payload["parent"])
    from specdec.session import Session

    schedule = payload["schedule"]
    if schedule.get("bound") is not None:
        schedule["bound"] = tuple(schedule["bound"])
    session = Session(ModelConfig(**payload["models"]))
    session.compile(MODE, SpecConfig(**payload["spec"]), ScheduleConfig(**schedule))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
