"""How the package imports: no import circle, a lazy public API, and a command line that starts without torch.

The circle test reads every module's imports with ``ast`` (at any depth: a function's own import
counts too; ``if TYPE_CHECKING:`` blocks do not), adds the imports made by name (``specdec.cli``'s
``SUBCOMMANDS`` and the package's re-exports), and looks for a cycle. The start-up tests run the
command line in a fresh interpreter and check that torch and transformers were never imported. One more
check of the source rides along: no line over pyproject's line length (ruff's E501, where ruff is installed).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import specdec
from specdec import cli

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "specdec"
HEAVY = ("torch", "transformers")  # what --help and an argument error must not import


def module_names() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (not under TYPE_CHECKING)."""
    found: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        if _type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            # "from a.b import c" imports the module a.b.c when there is one, else names of a.b
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    graph["specdec.cli"] |= {sub.module for sub in cli.SUBCOMMANDS.values()} - {"specdec.cli"}
    graph["specdec"] |= set(specdec._EXPORTS.values())
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (a list of nodes, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # node -> "open" while on the path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_imports_inside_functions_and_by_name() -> None:
    graph = import_graph()
    assert "specdec.console" in graph["specdec.cli"]  # _run_generate's import, and SUBCOMMANDS
    assert "specdec.arguments" in graph["specdec.console"]
    assert "specdec.bench.harness" in graph["specdec.bench.cli"]
    assert "specdec.decode" in graph["specdec"]  # the lazy re-exports


def test_the_package_has_no_import_circle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_public_api_is_lazy_and_complete() -> None:
    assert sorted(specdec.__all__) == sorted(specdec._EXPORTS)
    assert set(specdec.__all__) <= set(dir(specdec))
    for name, module in specdec._EXPORTS.items():
        assert getattr(specdec, name) is getattr(importlib.import_module(module), name), name
    namespace: dict = {}
    exec("from specdec import *", namespace)  # noqa: S102
    assert set(specdec.__all__) <= namespace.keys()
    assert specdec.cli is cli  # submodules stay reachable as attributes
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        specdec.no_such_name  # noqa: B018


# the eager core: the decoding loop and the handles it drives, which the compiled path sits beside, not under
EAGER_CORE = ("specdec.decode", "specdec.target", "specdec.cache", "specdec.seq2seq", "specdec.recurrent",
              "specdec.drafters")
COMPILED = "specdec.compiled"
COMPILED_LINES = 650  # the longest a module of specdec/compiled/ may be


def in_core(module: str) -> bool:
    return any(module == core or module.startswith(core + ".") for core in EAGER_CORE)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others (at any depth of their source)."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_eager_core_imports_nothing_of_the_compiled_path() -> None:
    """No module of the eager core imports ``specdec.compiled`` (or any of its modules), directly or through another
    module, anywhere in its source: the compiled path registers its caches with ``specdec.cache`` instead."""
    graph = import_graph()
    core = sorted(m for m in graph if in_core(m))
    assert "specdec.drafters.model" in core and "specdec.target" in core
    for module in core:
        found = sorted(m for m in reachable(graph, module) if m == COMPILED or m.startswith(COMPILED + "."))
        assert not found, f"{module} imports {found}"
    assert "specdec.cache" in graph["specdec.compiled.prepare"]  # the other way round: it registers its caches there


def test_importing_the_eager_core_leaves_the_compiled_path_unloaded() -> None:
    modules = sorted(m for m in import_graph() if in_core(m))
    out = run_python(f"import importlib, json, sys\n"
                     f"for name in {modules!r}:\n"
                     f"    importlib.import_module(name)\n"
                     f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({COMPILED!r}))))")
    assert out == []


def test_no_module_of_the_compiled_path_is_over_its_length() -> None:
    lengths = {path.name: len(path.read_text().splitlines()) for path in (PACKAGE / "compiled").glob("*.py")}
    assert len(lengths) >= 6  # the package's modules, found
    assert {name: n for name, n in lengths.items() if n > COMPILED_LINES} == {}


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is in the dev extra")
def test_no_line_is_over_the_line_length() -> None:
    """pyproject's ``line-length`` (E501), on the package, the tests and the benchmarks, as ruff reads it."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "E501", "--output-format", "concise",
                           "specdec", "tests", "benchmarks"], cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]


MODULE_LINES = 650  # the most lines a module of the package may hold: past it, it is split along its seams


def test_no_module_of_the_package_is_over_its_length() -> None:
    lengths = {str(path.relative_to(REPO)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert len(lengths) >= 100 and "specdec/train/block.py" in lengths  # every module, at any depth, found
    assert {name: n for name, n in lengths.items() if n > MODULE_LINES} == {}


def test_preparing_a_model_sets_nothing_on_it_and_keeps_it_alive_no_longer(tmp_path, monkeypatch) -> None:
    """``prepare`` compiles a model and decoding uses its static cache, with no ``_specdec_*`` attribute set on the
    model object (its state is in tables keyed weakly by the model), and the model dies when its user lets it go
    (those tables do not keep it alive)."""
    import gc
    import weakref

    from conftest import build_tiny

    from specdec.compiled import compiled_for, compiler_missing, prepare
    from specdec.compiled.static_cache import StaticRaggedCache
    from specdec.target import ModelTarget

    if compiler_missing():
        pytest.skip(f"torch.compile on CPU: {compiler_missing()}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = build_tiny("llama", seed=3, layers=1)
    before = set(vars(model))
    choice = prepare(model, "on", tokens=(1,))
    assert choice.compiled and compiled_for(model) is not None and choice.caches is not None
    out = specdec.speculative_generate(model, "ngram", [1, 5, 9, 33, 7], max_new_tokens=4, stop_token_ids=[])
    assert out.tokens and compiled_for(model).calls["compiled"] > 0  # decoded on the compiled step
    assert isinstance(ModelTarget(model).cache, StaticRaggedCache)  # found through the registry
    assert isinstance(ModelTarget(model, caches=choice.caches).cache, StaticRaggedCache)  # or handed over
    added = sorted(name for name in set(vars(model)) - before if name.startswith("_specdec_"))
    assert added == []
    assert not any(name.startswith("_specdec_") for name in vars(model))
    gone = weakref.ref(model)
    del model, choice, out
    gc.collect()
    assert gone() is None


def run_python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (the worktree first on the path); its last stdout line is JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("package", ["specdec", "specdec.bench", "specdec.heads", "specdec.train.presets",
                                     "specdec.heads.config", "specdec.bench.peers"])
def test_importing_a_package_or_a_settings_module_does_not_import_torch(package: str) -> None:
    out = run_python(f"import json, sys, {package}\n"
                     f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    assert out == []


def test_the_bench_package_s_names_load_on_first_use() -> None:
    import specdec.bench
    from specdec.bench import harness

    assert sorted(specdec.bench.__all__) == sorted(specdec.bench._EXPORTS)
    assert specdec.bench.run_benchmark is harness.run_benchmark
    assert specdec.bench.peers.__name__ == "specdec.bench.peers"  # submodules stay reachable as attributes
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        specdec.bench.no_such_name  # noqa: B018


def test_no_front_end_imports_the_chat_console() -> None:
    """The chat UI is ``specdec chat``'s alone: ``specdec.cli`` names it as a subcommand, nothing imports it."""
    graph = import_graph()
    assert {name for name, imports in graph.items() if "specdec.console" in imports} == {"specdec.cli"}
    graph["specdec.cli"].discard("specdec.console")  # by name only: ``specdec chat`` runs it
    for module in ("specdec.session", "specdec.detokenize", "specdec.plan", "specdec.report", "specdec.terminal",
                   "specdec.serve.app", "specdec.serve.background", "specdec.bench.harness", "specdec"):
        assert "specdec.console" not in reachable(graph, module), module


@pytest.mark.parametrize("module, terminal", [("specdec.session", False), ("specdec.serve.app", False),
                                              ("specdec.serve.background", False), ("specdec.bench.harness", True)])
def test_the_server_the_bench_and_the_session_do_not_import_the_terminal_ui(module: str, terminal: bool) -> None:
    """In a fresh interpreter: no ``specdec.console`` (nor rich, but for the bench, whose progress bars are rich's)."""
    out = run_python(f"import json, sys, {module}\n"
                     "print(json.dumps([m for m in ('specdec.console', 'specdec.terminal', 'rich', 'prompt_toolkit')"
                     " if m in sys.modules]))")
    assert out == (["rich"] if terminal else [])


@pytest.mark.parametrize("argv, status", [
    (["--help"], 0),
    (["generate", "--help"], 0),
    (["translate", "--help"], 0),
    (["chat", "--help"], 0),
    (["no-such-command"], 2),
    (["generate", "--gamma", "two", "x"], 2),  # argparse's error
    (["generate", "--gamma", "0", "x"], 2),  # the config's
    (["generate", "--max-new-tokens", "0", "x"], 2),
    (["generate", "--top-p", "2", "x"], 2),
    (["generate", "--device", "cpu", "--gpu", "0", "x"], 2),
    (["generate", "--drafter", "lookup+", "x"], 2),
    (["generate", "--prompts-file", "no-such-file.txt"], 2),
    (["generate", "--target", "no-such-model", "x"], 2),
    (["generate", "--target", "translate-target", "x"], 2),  # an encoder-decoder target: use translate
    (["translate", "--target", "code-target", "x"], 2),
    (["chat", "--temperature", "-1"], 2),
    (["bench", "--help"], 0),
    (["bench", "--threads", "0"], 2),
    (["bench", "--threads", "100000"], 2),  # more than the machine has: said before torch is imported
    (["bench", "--gamma", "0"], 2),
    (["bench", "--task", "poetry"], 2),
    (["bench", "--target", "no-such-model"], 2),
    (["bench", "--peers", "tgi"], 2),  # an unknown peer
    (["serve", "--help"], 0),
    (["serve", "--threads", "0"], 2),
    (["serve", "--temperature", "-1"], 2),
    (["train", "--help"], 0),
    (["train", "drafter", "--help"], 0),
    (["train", "head", "--help"], 0),
    (["train", "seq2seq", "--preset", "no-such-preset", "--out", "x"], 2),
    (["data", "--help"], 0),
])
def test_help_and_argument_errors_do_not_import_torch(argv: list[str], status: int) -> None:
    code = ("import contextlib, io, json, sys\n"
            "from specdec import cli\n"
            "out, err = io.StringIO(), io.StringIO()\n"
            "with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
            "    try:\n"
            f"        status = cli.main({argv!r})\n"
            "    except SystemExit as exit_:\n"
            "        status = exit_.code\n"
            f"print(json.dumps({{'status': status, 'out': out.getvalue(), 'err': err.getvalue(),\n"
            f"                  'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))")
    out = run_python(code)
    assert out["status"] == status, out
    assert out["heavy"] == [], out
    if status == 2:
        assert len(out["err"].strip().splitlines()) == 1 and "Traceback" not in out["err"], out["err"]
    else:
        assert "usage: specdec" in out["out"]
