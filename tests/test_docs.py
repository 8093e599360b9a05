"""The README and the docs site: the site builds strictly, the README stays a front door, and every
command and Python example they show runs, so none can go stale.

- The site: ``mkdocs build --strict`` (a broken link or anchor, a page missing from the navigation,
  a missing model card or a docstring mkdocstrings cannot render fails it).
- The README: at most 200 lines.
- The commands: every line of every ```bash block of README.md and docs/**/*.md. ``pip install``
  lines and ``python -m pytest`` are what CI itself runs and are not run again here; ``printf`` lines
  write the files the next commands read. Every ``specdec ...`` / ``python -m specdec...`` command
  runs in this process through the same entry points as the installed script (``specdec.cli.main``,
  ``runpy`` for a module) so that the commands share one import of torch and transformers; exit
  status 0 is required. ``specdec serve`` runs as a server process that must answer ``/health`` and
  one completion (and the page's Python example with OpenAI's client) before it is stopped.
  Training and benchmark commands take minutes to hours: each must be listed in ``SHORTENED``,
  which maps the documented command to the flags appended to shorten it (argparse keeps the last
  value of a flag), so a new long command cannot slip in unrun, and an entry whose command left the
  docs fails too. Placeholder paths of the docs (``path/to/your-model``) are a tiny saved pair.
- The Python examples: every ```python block of README.md and docs/**/*.md runs (placeholders
  replaced), the server's with the server above.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_pair

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 200

BENCH_SHORT = ["--num-prompts", "1", "--max-new-tokens", "4", "--repeats", "1", "--warmup", "0",
               "--no-plots", "--no-progress"]
BENCH_PROMPTS = "bench-prompts.jsonl"  # one prompt, written by the fixture: the built-in set parses the stdlib
CODE_SHORT = [*BENCH_SHORT, "--prompts", BENCH_PROMPTS]
# The documented command -> the flags appended to shorten it (fewer prompts, tokens, repeats, sizes).
SHORTENED: dict[str, list[str]] = {
    "specdec bench --quick": [*CODE_SHORT, "--methods", "plain-hf", "spec-lookup"],
    "specdec bench --output bench-out/full": [*CODE_SHORT, "--methods", "plain", "spec", "hf-assisted"],
    "specdec bench --gamma 1 2 4 8 --temperature 0 1": [*CODE_SHORT, "--gamma", "1", "2", "--methods", "spec"],
    "specdec bench --batch-sizes 1 2 4 8 16 --speculate off on auto --num-prompts 16 --max-new-tokens 48 "
    "--repeats 3": [*CODE_SHORT, "--batch-sizes", "1", "2"],
    "OMP_NUM_THREADS=1 specdec bench --serve --no-progress --output bench-out/serve":
        [*CODE_SHORT, "--clients", "1", "--speculate", "off", "on"],
    "python -m specdec.bench.matmul --threads 2": ["--lengths", "1", "--repeats", "3"],
    "specdec train drafter --target path/to/your-model --data runs/my-outputs.jsonl --out runs/my-drafter "
    "--layers 2 --hidden 256": ["--layers", "1", "--hidden", "32", "--steps", "2", "--batch-size", "2",
                                "--measure-prompts", "1", "--measure-tokens", "4"],
    "specdec train block-drafter --target path/to/your-model --data runs/my-outputs.jsonl --out "
    "runs/my-block-drafter": ["--hidden-size", "32", "--num-hidden-layers", "1", "--intermediate-size", "64",
                              "--max-steps", "2", "--batch-size", "2", "--measure-prompts", "1",
                              "--measure-tokens", "4"],
    "specdec train head --target path/to/your-model --drafter runs/my-drafter/final --data runs/my-outputs.jsonl "
    "--out runs/my-head": ["--max-steps", "2", "--batch-size", "64", "--warmup-steps", "1", "--measure-prompts", "1",
                           "--measure-tokens", "4", "--measure-repeats", "1", "--tune-thresholds", "0.5", "1",
                           "--tune-max-draft", "2", "--tune-tokens", "4", "--tune-repeats", "1"],
    "specdec quantize code-target --to int8 --out code-target-int8": ["--prompts", "1", "--tokens", "4"],
    "specdec quantize code-target --to int4 --group-size 64 --out code-target-int4": ["--prompts", "1",
                                                                                     "--tokens", "4"],
    "OMP_NUM_THREADS=1 specdec bench --task translate --data data/gettext-de --num-prompts 120 --seed 19 "
    "--max-new-tokens 64 --repeats 3": BENCH_SHORT,
}
# Commands that may take long and must therefore be in SHORTENED (their --help excepted).
LONG = re.compile(r"^(specdec (bench|train)\b|python -m specdec\.bench\b)")
# Lines CI runs itself (the README's two commands begin with them).
CI_ONLY = (["pip", "install"], ["python", "-m", "pytest"])
SERVER_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class Command:
    """One documented shell command: where it is shown and its words (comments dropped)."""

    source: str  # the file, relative to the repository
    words: tuple[str, ...]

    @property
    def text(self) -> str:
        return shlex.join(self.words)


def fenced(path: Path) -> list[tuple[str, str]]:
    """The fenced code blocks of a Markdown file: (language, body), in order."""
    found, language, body = [], None, []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("```"):
            if language is None:
                language, body = line[3:].strip(), []
            else:
                found.append((language, "".join(body)))
                language = None
        elif language is not None:
            body.append(line)
    return found


def blocks(path: Path, language: str) -> list[str]:
    """The bodies of the fenced code blocks of ``language`` in a Markdown file."""
    return [body for lang, body in fenced(path) if lang == language]


def shell_lines(body: str) -> list[list[str]]:
    """The words of each command line of a shell block (continuations joined, comments dropped)."""
    return [words for line in body.replace("\\\n", " ").splitlines() if (words := shlex.split(line, comments=True))]


def documented_commands() -> list[Command]:
    """Every command of every ```bash block, split at ``&&``, in document order (README first)."""
    commands = []
    for path in DOC_FILES:
        for body in blocks(path, "bash"):
            for line in shell_lines(body):
                words: list[str] = []
                for word in [*line, "&&"]:
                    if word != "&&":
                        words.append(word)
                    elif words:
                        commands.append(Command(str(path.relative_to(ROOT)), tuple(words)))
                        words = []
    return commands


def is_ci_only(words: tuple[str, ...]) -> bool:
    return any(list(words[:len(prefix)]) == prefix for prefix in CI_ONLY)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- site


def test_readme_is_a_short_front_door_with_working_links():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines; move detail into docs/ "
                                       f"(at most {README_MAX_LINES})")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links, "the README links into docs/"
    broken = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not broken, f"README.md links to missing files: {broken}"


def test_site_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          check=False, cwd=ROOT, capture_output=True, text=True, env={**os.environ,
                                                                                      "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    site = tmp_path / "site"
    reference = (site / "reference" / "index.html").read_text(encoding="utf-8")
    import specdec

    missing = [name for name in specdec.__all__ if f'id="specdec.{name}"' not in reference]
    assert not missing, f"the API reference lacks {missing}"
    for card in ("code-target", "code-drafter", "code-feature-drafter", "code-block-drafter", "translate-target",
                 "translate-drafter", "translate-block-drafter"):
        first_line = (ROOT / "models" / card / "README.md").read_text(encoding="utf-8").splitlines()[2]
        page = (site / "models" / card / "index.html").read_text(encoding="utf-8")
        assert first_line.split()[0] in page, f"the {card} page does not include its model card"


# ------------------------------------------------------------------------------------------ commands


def test_long_commands_are_shortened_and_the_table_is_current():
    texts = {c.text for c in documented_commands()}
    unlisted = sorted(t for t in texts if LONG.match(re.sub(r"^(\w+=\S+ )+", "", t)) and "--help" not in t
                      and t not in SHORTENED)
    assert not unlisted, f"long documented commands without shortening flags in SHORTENED: {unlisted}"
    stale = sorted(set(SHORTENED) - texts)
    assert not stale, f"SHORTENED lists commands the docs no longer show: {stale}"


def test_model_card_commands_parse():
    """The model cards (included in the site) record the commands that made each model: too long to
    run here, but every ``specdec`` command of theirs must still parse with the current flags."""
    from specdec.cli import build_parser

    failures, count = [], 0
    for path in sorted((ROOT / "models").rglob("README.md")):
        for language, body in fenced(path):
            if language not in ("bash", ""):
                continue
            for words in shell_lines(body):
                while words and re.fullmatch(r"\w+=\S*", words[0]):
                    words = words[1:]
                if words[:1] != ["specdec"]:
                    continue
                count += 1
                err = io.StringIO()
                try:
                    with contextlib.redirect_stderr(err):
                        build_parser(words[1]).parse_args(words[1:])
                except SystemExit:
                    failures.append(f"{path.relative_to(ROOT)}: {shlex.join(words)}\n  {err.getvalue().strip()[-500:]}")
    assert count >= 10, f"only {count} commands found in the model cards: is the extraction broken?"
    assert not failures, "model card commands the CLI no longer accepts:\n" + "\n".join(failures)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A scratch folder for the commands: the shipped models reachable as models/, and the tiny pair
    that stands for the docs' placeholder folders."""
    root = tmp_path_factory.mktemp("docs-commands")
    (root / "models").symlink_to(ROOT / "models", target_is_directory=True)
    (root / BENCH_PROMPTS).write_text(json.dumps({"id": "p0", "prompt": "def add(a, b):\n"}) + "\n")
    pair = save_tiny_pair(root / "tiny")
    placeholders = {"path/to/your-model": str(pair.target), "path/to/your-drafter": str(pair.drafter)}
    return root, placeholders


def substitute(text: str, placeholders: dict[str, str]) -> str:
    for placeholder, path in placeholders.items():
        text = text.replace(placeholder, path)
    return text


def run_in_process(words: list[str], stdin: str, stdout: io.TextIOBase) -> tuple[int, str]:
    """Run ``specdec ARGS`` or ``python -m MODULE ARGS`` here; return (exit status, stderr)."""
    err = io.StringIO()
    threads = torch.get_num_threads()
    saved_stdin, saved_argv = sys.stdin, sys.argv
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(err):
            try:
                if words[0] == "specdec":
                    from specdec.cli import main

                    status = main(words[1:])
                else:  # python -m MODULE ...
                    sys.argv = [words[2], *words[3:]]
                    runpy.run_module(words[2], run_name="__main__", alter_sys=True)
                    status = 0
            except SystemExit as exit_:
                status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.stdin, sys.argv = saved_stdin, saved_argv
        torch.set_num_threads(threads)
    return int(status or 0), err.getvalue()


def request(url: str, body: dict | None = None, key: str | None = None) -> dict:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as reply:
        return json.loads(reply.read())


def run_server(words: list[str], cwd: Path, examples: list[str]) -> str | None:
    """Start ``specdec serve ARGS`` on a free port, check it answers, run the page's examples against
    it; return a failure message or None."""
    port = free_port()
    key = words[words.index("--api-key") + 1] if "--api-key" in words else None
    proc = subprocess.Popen([sys.executable, "-m", "specdec", *words[1:], "--port", str(port)], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                return f"the server exited with status {proc.returncode}: {proc.stdout.read()[-2000:]}"
            try:
                if request(f"{url}/health") == {"status": "ok"}:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                return "the server did not answer /health within 180 s"
            time.sleep(0.5)
        reply = request(f"{url}/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0},
                        key=key)
        if not reply["choices"][0]["text"]:
            return f"an empty completion: {reply}"
        for example in examples if key is None else []:  # the examples send no key
            run_python(example.replace(SERVER_URL, url), cwd)
        return None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def chdir(path: Path):
    """contextlib.chdir of Python 3.11, for 3.10."""
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def run_python(source: str, cwd: Path) -> None:
    """Run a documented Python example as a script in ``cwd``."""
    script = cwd / "docs_example.py"
    script.write_text(source, encoding="utf-8")
    with chdir(cwd), contextlib.redirect_stdout(io.StringIO()):
        runpy.run_path(str(script), run_name="__main__")


def test_every_documented_command_runs(workdir):
    """Run every documented command once, in document order; report every failure together."""
    root, placeholders = workdir
    server_examples = [substitute(b, placeholders) for path in DOC_FILES for b in blocks(path, "python")
                       if SERVER_URL in b]
    failures, seen = [], set()
    for command in documented_commands():
        if is_ci_only(command.words) or command.text in seen:
            continue
        seen.add(command.text)
        words = [substitute(w, placeholders) for w in command.words]
        while re.fullmatch(r"\w+=\S*", words[0]):  # OMP_NUM_THREADS=1: this process's threads are set already
            words = words[1:]
        words += SHORTENED.get(command.text, [])
        where = f"{command.source}: {command.text}"
        stdin, stdout_file = "", None
        if words[0] == "printf":
            if "|" in words:  # printf ... | specdec ...
                bar = words.index("|")
                stdin = subprocess.run(words[:bar], capture_output=True, text=True, check=True).stdout
                words = words[bar + 1:]
            elif words[-2] == ">":
                (root / words[-1]).write_text(
                    subprocess.run(words[:-2], capture_output=True, text=True, check=True).stdout)
                continue
        if len(words) > 2 and words[-2] == ">":
            stdout_file, words = words[-1], words[:-2]
        if words[:2] == ["specdec", "serve"]:
            started = time.perf_counter()
            problem = run_server(words, root, server_examples)
            print(f"{time.perf_counter() - started:6.1f} s  {where} (a server process, and its page's examples)")
            if problem:
                failures.append(f"{where}\n  {problem}")
            continue
        if not (words[0] == "specdec" or (words[:2] == ["python", "-m"] and words[2].split(".")[0] == "specdec")):
            failures.append(f"{where}\n  not a command this test knows how to run (specdec, python -m specdec..., "
                            "printf, pip install, python -m pytest)")
            continue
        out = io.StringIO()
        with chdir(root):
            started = time.perf_counter()
            status, err = run_in_process(words, stdin, out)
            seconds = time.perf_counter() - started
        if stdout_file:
            (root / stdout_file).write_text(out.getvalue())
        print(f"{seconds:6.1f} s  {where}")
        if status != 0:
            failures.append(f"{where}\n  exit status {status}: {err.strip()[-1500:]}")
        elif command.words[1] in ("generate", "translate", "chat") and not out.getvalue().strip():
            failures.append(f"{where}\n  printed nothing on stdout")
    assert not failures, "documented commands that failed:\n" + "\n".join(failures)


def test_every_python_example_runs(workdir):
    """Every ```python block of the README and the docs, but the server's (run with the server)."""
    root, placeholders = workdir
    for path in DOC_FILES:
        for source in blocks(path, "python"):
            if SERVER_URL not in source:
                run_python(substitute(source, placeholders), root)
