"""Building specdec's C and C++ kernels on the user's machine, once: ``cached_library`` compiles sources with the
machine's compilers into ``~/.cache/specdec/kernels`` under a key of the sources, the compilers and the CPU's flags,
so a build is done once per machine and another process loads the file (``specdec.kernels`` builds its operators
with it)."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from specdec.folders import cache_root

BUILD_SECONDS = 25  # about how long the build takes (a C and a C++ compile; 23 s on a loaded 2-core AMD EPYC)
BUILDING = f"specdec: building specdec's CPU kernels for this machine into {{root}} (once, ~{BUILD_SECONDS} s)"
_SAID: list[bool] = []  # whether this process has said that it builds the kernels (one line, the first time)


def cxx() -> str | None:
    """The C++ compiler: ``CXX``, else ``c++``, ``g++`` or ``clang++`` on the PATH; None."""
    return os.environ.get("CXX") or next(filter(None, map(shutil.which, ("c++", "g++", "clang++"))), None)


def cpu_flags() -> str:
    """The CPU's flags line (/proc/cpuinfo), else its processor name: part of every build's and plan's key."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def cached_library(stem: str, parts: list[str], compilers: list[str],
                    commands: Callable[[Path, Path], list[list[tuple[list[str], int]]]]) -> Path:
    """The library ``~/.cache/specdec/kernels/STEM-KEY.so``, built unless it is there: ``commands(folder, built)``, a
    list of stages, are run in a temporary folder, stage by stage, the commands of a stage at once (each with its
    timeout, s; the compiles of the sources side by side), the last writing ``built``, which is then renamed
    into place (atomic: another process building the same file is harmless). KEY hashes ``parts`` (the sources, ...),
    each compiler's name and version and the CPU's flags; a build is said on a terminal's stderr, once a process. Raises
    OSError or SubprocessError where it cannot be built."""
    named = []
    for compiler in compilers:
        named += [compiler, subprocess.run([compiler, "--version"], check=False, capture_output=True, text=True,
                                           timeout=30).stdout]
    key = hashlib.sha256("\n".join([*parts, *named, cpu_flags()]).encode())
    root = cache_root() / "kernels"
    path = root / f"{stem}-{key.hexdigest()[:16]}.so"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        if not _SAID and sys.stderr.isatty():  # a first run at a terminal pauses here: said, not a hang
            print(BUILDING.format(root=root), file=sys.stderr, flush=True)
            _SAID.append(True)
        with tempfile.TemporaryDirectory(dir=root) as folder:
            built = Path(folder) / path.name
            for stage in commands(Path(folder), built):
                run_together(stage)
            os.replace(built, path)
    return path


def run_together(commands: list[tuple[list[str], int]]) -> None:
    """Run ``commands`` (each with its timeout, s, from their start) at once and wait for all; a CalledProcessError
    (with its output) or a TimeoutExpired for the first that fails, once none is left running."""
    with ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile()) for _ in commands]  # not pipes: none waits on a reader
        started = time.monotonic()
        running = [subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
                   for (command, _), log in zip(commands, logs)]
        failed: subprocess.SubprocessError | None = None
        try:
            for process, (command, timeout), log in zip(running, commands, logs):
                try:
                    process.wait(timeout=max(0.0, started + timeout - time.monotonic()))
                except subprocess.TimeoutExpired as expired:
                    failed = failed or expired
                if process.returncode and failed is None:
                    log.seek(0)
                    failed = subprocess.CalledProcessError(process.returncode, command, log.read())
        finally:  # none left running: timed out, or this process interrupted (Ctrl-C at the first command's pause)
            for process in running:
                if process.poll() is None:
                    process.kill()
                    process.wait()
    if failed is not None:
        raise failed
