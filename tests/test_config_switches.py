"""The environment switches (``specdec.config.SWITCHES``, read by ``config.switch``): every ``SPECDEC_`` name in
specdec's sources is declared there, and a value a switch does not take is refused in one line naming it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import specdec
from specdec.config import SWITCHES, switch

SOURCES = Path(specdec.__file__).parent
NAME = re.compile(r"\bSPECDEC_[A-Z0-9_]+\b")


def _mentioned() -> dict[str, list[str]]:
    """Each SPECDEC_ name in specdec's text sources (Python, C, C++, the page's JavaScript and HTML) that is not a
    Python name bound in specdec (``SPECDEC_DEFAULT``, a constant), with the files that mention it."""
    found: dict[str, list[str]] = {}
    identifiers: set[str] = set()
    for path in sorted(SOURCES.rglob("*")):
        if path.suffix not in (".py", ".c", ".cpp", ".h", ".js", ".html") or "__pycache__" in path.parts:
            continue
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".py":
            identifiers |= {node.id for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Name)}
        for name in set(NAME.findall(text)):
            found.setdefault(name, []).append(str(path.relative_to(SOURCES)))
    return {name: files for name, files in found.items() if name not in identifiers}


def test_every_specdec_switch_in_the_sources_is_declared_in_config():
    mentioned = _mentioned()
    assert {"SPECDEC_LINEAR", "SPECDEC_HELPER", "SPECDEC_API_KEY"} <= mentioned.keys()  # the scan finds them
    missing = {name: files for name, files in mentioned.items() if name not in SWITCHES}
    assert not missing, f"declare these in specdec/config.py SWITCHES: {missing}"
    for declared in SWITCHES.values():
        assert declared.kind in ("choice", "text", "seconds") and declared.meaning
        assert (declared.default in declared.values) if declared.kind == "choice" else not declared.values


def test_a_switch_reads_its_value_its_default_and_refuses_a_bad_one_in_one_line(monkeypatch):
    monkeypatch.delenv("SPECDEC_LINEAR", raising=False)
    assert switch("SPECDEC_LINEAR") == "auto"
    monkeypatch.setenv("SPECDEC_LINEAR", " Off ")
    assert switch("SPECDEC_LINEAR") == "off"
    monkeypatch.setenv("SPECDEC_LINEAR", "  ")  # blank: as unset
    assert switch("SPECDEC_LINEAR") == "auto"
    monkeypatch.setenv("SPECDEC_COMPILE_BESIDE", "on")  # a value another switch takes, not this one
    with pytest.raises(ValueError) as refused:
        switch("SPECDEC_COMPILE_BESIDE")
    assert str(refused.value).startswith("SPECDEC_COMPILE_BESIDE='on': use one of auto, off (")
    assert "\n" not in str(refused.value)
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    assert switch("SPECDEC_API_KEY") is None
    monkeypatch.setenv("SPECDEC_API_KEY", "Secret Key")
    assert switch("SPECDEC_API_KEY") == "Secret Key"  # text: as given, case kept
    monkeypatch.delenv("SPECDEC_VLLM_START_TIMEOUT", raising=False)
    assert float(switch("SPECDEC_VLLM_START_TIMEOUT")) == 600
    for bad in ("soon", "0", "-5", "inf", "nan"):
        monkeypatch.setenv("SPECDEC_VLLM_START_TIMEOUT", bad)
        with pytest.raises(ValueError, match=rf"^SPECDEC_VLLM_START_TIMEOUT='{bad}': use a number of seconds > 0 \("):
            switch("SPECDEC_VLLM_START_TIMEOUT")
    with pytest.raises(KeyError):
        switch("SPECDEC_NOT_DECLARED")
