"""The serving process's memory as the operator needs it to tell a leak from the allocator's keeping (issue 67).

``usage()`` reads ``/proc/self/status`` (resident set now and at its peak) and, under glibc, ``mallinfo2``: the bytes
malloc's heap hands out now (``in_use``: live objects, tensors on the CPU included), the bytes it holds free inside
its arenas (``free``: what a ``malloc_trim`` may give back) and those in separate mmaps. Resident memory that grows
while ``in_use`` stays flat is the allocator keeping freed pages, not a leak. ``trim()`` gives the heap's free pages
back to the system (glibc's ``malloc_trim(0)``); the engine's worker calls it between steps, at most every
``TRIM_EVERY_S`` (it walks every arena; figures: docs/journal/2026-12-07-soak-and-faults.md, "Soak and faults").

Both answer None where the platform does not say (not Linux, not glibc): they never raise.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import time
import tracemalloc

MB = 1 << 20
TRIM_EVERY_S = 10.0  # the engine trims between steps at most this often


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> ctypes.CDLL | None:
    with contextlib.suppress(OSError, TypeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if hasattr(libc, "mallinfo2") and hasattr(libc, "malloc_trim"):
            libc.mallinfo2.restype = _Mallinfo2
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
            return libc
    return None


_LIBC = _libc()
_last_trim = 0.0


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def usage() -> dict[str, float | None]:
    """This process's memory in MB: ``rss`` and ``rss_peak`` (``/proc``), ``heap_in_use``, ``heap_free`` and
    ``heap_mmap`` (glibc's ``mallinfo2``), ``python_traced`` (what Python's objects hold, where ``tracemalloc`` runs:
    ``PYTHONTRACEMALLOC=1``); None for what the platform does not say."""
    info = _LIBC.mallinfo2() if _LIBC is not None else None
    return {"rss": _status_mb("VmRSS"), "rss_peak": _status_mb("VmHWM"),
            "heap_in_use": info.uordblks / MB if info else None, "heap_free": info.fordblks / MB if info else None,
            "heap_mmap": info.hblkhd / MB if info else None,
            "python_traced": tracemalloc.get_traced_memory()[0] / MB if tracemalloc.is_tracing() else None}


def trim(every_s: float = TRIM_EVERY_S) -> bool:
    """Give malloc's free pages back to the system, unless the last trim was less than ``every_s`` ago; whether it
    trimmed (False where glibc is not there)."""
    global _last_trim
    now = time.monotonic()
    if _LIBC is None or now - _last_trim < every_s:
        return False
    _last_trim = now
    _LIBC.malloc_trim(0)
    return True
