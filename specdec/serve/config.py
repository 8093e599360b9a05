"""Settings of ``specdec serve``: the one source of the server's own defaults.

The decoding settings (models, sampling, the round loop, the verification rule) are the core's
config classes (``specdec.config``), given as flags exactly as to ``specdec generate``; a request's
own ``max_tokens``, ``temperature``, ``top_p``, ``seed`` and ``stop`` override them for that request.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from specdec.config import switch

API_KEY_ENV = "SPECDEC_API_KEY"  # the environment variable read when --api-key is not given
# The server's --speculate default (generate's is SpecConfig's "on"): a server's batch grows with its clients, and
# verifying a batch costs its longest draft in every row, so per batch size it keeps the draft width measured
# fastest, plain decoding included (docs/benchmarks.md, the server).
SPECULATE = "auto"
# Where the HTTP app runs (specdec.serve.front): a process of its own takes its Python off the engine's GIL
FRONTS = ("process", "thread")


@dataclass(frozen=True)
class ServeConfig:
    """Where the server listens and what it lets in."""

    host: str = "127.0.0.1"  # address to bind; 0.0.0.0 or :: serves every interface (set an API key then)
    port: int = 8000  # TCP port; 0 = any free port
    api_key: str | None = None  # require "Authorization: Bearer KEY" on the API, /metrics and /stats
                                # (not /health, nor the page's files); None = $SPECDEC_API_KEY, else none
    model_name: str | None = None  # the model id clients name; None = the target's shipped name or folder name
    max_body_bytes: int = 1 << 20  # larger request bodies are refused with 413
    log_level: str = "warning"  # uvicorn's log level: critical, error, warning, info, debug, trace
    allowed_origins: str | None = None  # comma-separated origins (http://host:port) whose pages may call
                                        # the API from a browser, "*" any; None = the server's own page only
    allowed_hosts: str | None = None  # comma-separated Host names answered besides loopback's when bound to
                                      # loopback (a proxy's); None = localhost and loopback addresses only
    drain_s: float = 30.0  # on Ctrl-C or SIGTERM: seconds the requests in flight have to
                           # finish; those still running then get 503 (and the exit status is 1)
    front: str = "process"  # where the HTTP app runs: process (one of its own, beside
                            # the engine's) or thread (in the engine's process)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int in 0..65535 (0 = any free port), got {self.port!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be an int >= 1024, got {self.max_body_bytes!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty: give a non-empty key or leave it out")
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(f"log_level must be one of critical, error, warning, info, debug, trace, "
                             f"got {self.log_level!r}")
        if not isinstance(self.drain_s, (int, float)) or not 0 < self.drain_s < float("inf"):
            raise ValueError(f"drain_s must be a number of seconds > 0, got {self.drain_s!r}")
        if self.front not in FRONTS:
            raise ValueError(f"front must be one of {', '.join(FRONTS)}, got {self.front!r}")

    def key(self) -> str | None:
        """The API key in force: ``api_key``, else ``$SPECDEC_API_KEY``, else None (no key)."""
        return self.api_key or switch(API_KEY_ENV) or None

    @property
    def all_interfaces(self) -> bool:
        """Whether ``host`` binds every interface (0.0.0.0, ::, or the empty string)."""
        if self.host in ("", "*"):
            return True
        try:
            return ipaddress.ip_address(self.host).is_unspecified
        except ValueError:
            return False

    @property
    def loopback(self) -> bool:
        """Whether ``host`` is a loopback address (or localhost): reachable from this machine only."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
