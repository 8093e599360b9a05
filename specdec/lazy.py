"""Packages whose public names load on first use (PEP 562): ``specdec``, ``specdec.bench``, ``specdec.heads``.

``import specdec`` and the command line's ``--help`` and argument errors then import no torch or transformers
(tests/test_imports.py); ``specdec.load_model`` and ``from specdec.bench import run_benchmark`` work as usual.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_names(package: str, exports: Mapping[str, str], *, together: bool = False
               ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """(``__getattr__``, ``__dir__``) for ``package``: a name of ``exports`` (name -> the module that defines it) is
    imported on first use and kept, all of them at once when ``together`` (so every module's registrations are
    made, as an eager import would); any other name is a submodule, else an AttributeError."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> object:
        if name in exports:
            wanted = exports if together else {name: exports[name]}
            namespace.update({n: getattr(importlib.import_module(m), n) for n, m in wanted.items()})
            return namespace[name]
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{package}.{name}":
                raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
