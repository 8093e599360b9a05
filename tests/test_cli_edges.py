"""The command line's rough edges a first hour hits (issue 27), each driven as a user drives it.

`--help` names every drafter and says what `bench` does; `--speculate auto` says what it chose;
a model folder without a tokenizer, a binary prompts file and an encoder-decoder target given to
`generate` are each refused in one line that names the problem; library calls print no progress
bar unless asked; Ctrl-C at any moment of a run is one line and exit status 130.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import TinyPair, save_tiny_pair
from transformers import MarianConfig

import specdec
from specdec import cli
from specdec.config import BLOCK, LOOKUP, SHIPPED_DRAFTERS, SHIPPED_TARGETS
from specdec.drafters import DRAFTERS
from specdec.loading import SHIPPED_MODELS, models_dir
from specdec.report import auto_text
from specdec.schedules import PLAIN_MARGIN
from specdec.stats import AutoChoice

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "2000"}
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    return save_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))  # built on one thread


def pair_args(pair: TinyPair) -> list[str]:
    return ["--target", str(pair.target), "--drafter", str(pair.drafter)]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec", *args], capture_output=True, text=True, env=ENV,
                          cwd=REPO, timeout=timeout, check=False)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def help_of(argv: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "2000")  # one line per flag: names are not broken at hyphens
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


# ------------------------------------------------------------------------------------------- help


def flag_help(text: str, flag: str) -> str:
    """The help of one flag in argparse's output: from its line to the next flag's."""
    start = text.index(f"\n  {flag} ")
    end = text.find("\n  -", start + 1)
    return text[start:end]


def test_generate_help_names_every_drafter_and_shipped_model(capsys, monkeypatch) -> None:
    text = help_of(["generate", "--help"], capsys, monkeypatch)
    drafter = flag_help(text, "--drafter")
    names = [*DRAFTERS, BLOCK, f"{BLOCK}:PATH", f"{LOOKUP}NAME", *SHIPPED_DRAFTERS]
    assert [name for name in names if name not in drafter] == []
    assert all(name in flag_help(text, "--target") for name in SHIPPED_TARGETS)
    shipped = {p.name for p in models_dir().iterdir()
               if (p / "config.json").is_file()} if models_dir().is_dir() else set()
    assert shipped <= set(SHIPPED_MODELS)  # every shipped model folder is one the help names


def test_every_command_has_its_help_line_and_bench_a_sentence(capsys, monkeypatch) -> None:
    top = help_of(["--help"], capsys, monkeypatch)
    for name, sub in cli.SUBCOMMANDS.items():
        assert re.search(rf"^ +{name}\s+{re.escape(sub.help)}$", top, re.MULTILINE), name
    bench = help_of(["bench", "--help"], capsys, monkeypatch)
    description = bench.split("\n\n")[1]  # after the usage block
    assert "BenchConfig" not in description and "flags generated" not in description
    assert description[0].isupper() and description.rstrip().endswith(".") and len(description.split()) > 8


# ------------------------------------------------------------------------------------ speculate auto


def test_auto_reports_its_choice_per_batch_size(pair: TinyPair) -> None:
    target, drafter = specdec.load_model(pair.target), specdec.load_model(pair.drafter)
    tokenizer = specdec.load_tokenizer(pair.target)
    ids = tokenizer(PROMPT).input_ids
    result = specdec.speculative_generate(target, drafter, ids, max_new_tokens=150, speculate="auto",
                                          stop_token_ids=[])
    [choice] = result.batch.auto
    assert choice.rows == (1, 1) and choice.draft_tokens_per_s > 0 and choice.plain_tokens_per_s > 0
    drafting_paid = choice.draft_tokens_per_s >= PLAIN_MARGIN * choice.plain_tokens_per_s  # the margin plain gets
    assert choice.speculate == ("on" if drafting_paid else "off")
    short = specdec.speculative_generate(target, drafter, ids, max_new_tokens=3, speculate="auto")
    assert short.batch.auto[0].speculate == "measuring"  # too few rounds to decide
    on = specdec.speculative_generate(target, drafter, ids, max_new_tokens=20)
    assert on.batch.auto == []  # speculate="on" measures nothing

    proc = run_cli("generate", PROMPT, *pair_args(pair), "--speculate", "auto", "--max-new-tokens", "150", "--json")
    assert proc.returncode == 0, proc.stderr
    [reported] = json.loads(proc.stdout)["auto"]
    assert AutoChoice(**{**reported, "rows": tuple(reported["rows"])}).speculate in ("on", "off")
    proc = run_cli("generate", PROMPT, *pair_args(pair), "--speculate", "auto", "--max-new-tokens", "150")
    assert proc.returncode == 0, proc.stderr
    summary = proc.stderr.strip().splitlines()[-1]
    assert "speculate auto: 1 row: o" in summary and "tokens/s)" in summary


def test_auto_says_a_speed_not_yet_measured_rather_than_zero() -> None:
    """A batch size still measuring may have timed no plain round yet (its speed 0): said so, not "0 tokens/s"."""
    text = auto_text([AutoChoice((1, 1), "on", 289.4, 65.2, 4), AutoChoice((5, 8), "measuring", 132.0, 0.0, 4)])
    assert text == ("speculate auto: 1 row: on (drafting <= 4: 289 tokens/s, plain: 65 tokens/s); "
                    "5-8 rows: measuring (drafting <= 4: 132 tokens/s, plain: not yet measured)")


def test_auto_in_a_prompts_file_is_said_once_per_batch_size(pair: TinyPair, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\nclass Point:\nfor i in range(10):\n")
    proc = run_cli("generate", "--prompts-file", str(prompts), *pair_args(pair), "--speculate", "auto",
                   "--batch-size", "2", "--max-new-tokens", "40")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert [i for i, line in enumerate(lines) if "speculate auto:" in line] == [len(lines) - 1]  # the batch line
    assert "2 rows:" in lines[-1]  # two prompts decoded together at first


# ------------------------------------------------------------------------------ time to first token


def test_generate_says_its_time_to_first_token(pair: TinyPair) -> None:
    proc = run_cli("generate", PROMPT, *pair_args(pair), "--max-new-tokens", "40", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert 0 < out["time_to_first_token_s"] < out["stats"]["wall_time_s"]  # the first round, not the whole run
    assert out["load_time_s"] > 0
    proc = run_cli("generate", PROMPT, *pair_args(pair), "--max-new-tokens", "40")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"\| first token in [\d.]+ s, models loaded in [\d.]+ s$", proc.stderr.strip()), proc.stderr


# ---------------------------------------------------------------------------------------- bad input


def test_another_target_without_a_drafter_is_told_the_default_drafter_and_ngram(pair: TinyPair, capsys) -> None:
    """--target of another vocabulary and no --drafter: the default code-drafter cannot draft for it; the one line
    says the drafter was the default and names --drafter ngram (issue 67)."""
    assert cli.main(["generate", PROMPT, "--target", str(pair.target), "--max-new-tokens", "2"]) == 2
    err = one_line(capsys.readouterr().err)
    assert ("vocabulary" in err and "the drafter was the default, lookup+code-drafter" in err
            and "--drafter ngram" in err)
    assert cli.main(["generate", PROMPT, "--target", str(pair.target), "--drafter", "ngram", "--max-new-tokens",
                     "2"]) == 0
    capsys.readouterr()  # plain decoding drafts nothing: the default drafter is neither loaded nor refused
    assert cli.main(["generate", PROMPT, "--target", str(pair.target), "--speculate", "off", "--max-new-tokens",
                     "2", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["stats"]["rounds"] == 2 and "vocabulary" not in out.err


def test_a_model_folder_without_a_tokenizer_is_named(pair: TinyPair, tmp_path: Path, capsys) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for path in pair.target.iterdir():
        if not path.name.startswith("tokenizer"):
            shutil.copy(path, bare / path.name)
    with pytest.raises(ValueError, match="has no tokenizer"):
        specdec.load_tokenizer(bare)
    assert cli.main(["generate", PROMPT, "--target", str(bare), "--drafter", "ngram"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"model folder {str(bare)!r} has no tokenizer" in err and "prompt is empty" not in err


def test_a_binary_prompts_file_is_named(pair: TinyPair, tmp_path: Path, capsys) -> None:
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"import os\n\xc1\xff\x00\x81 binary\n")
    for flag in ("--prompts-file", "--prompt-file"):
        assert cli.main(["generate", flag, str(binary), *pair_args(pair)]) == 2
        err = one_line(capsys.readouterr().err)
        assert f"{flag} {str(binary)!r} is not UTF-8 text (byte 0xc1 at offset 10)" in err


def test_an_encoder_decoder_target_in_generate_points_to_translate(tmp_path: Path, capsys) -> None:
    marian = tmp_path / "marian"
    MarianConfig(vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16).save_pretrained(marian)
    assert cli.main(["generate", "Hello", "--target", str(marian), "--drafter", "ngram"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"use `specdec translate --target {marian}`" in err and "drafter" not in err


@pytest.mark.parametrize("flag", ["--max-new-tokens", "--max_new_tokens"])
def test_max_new_tokens_zero_is_refused_everywhere(pair: TinyPair, capsys, flag: str) -> None:
    assert cli.main(["generate", PROMPT, *pair_args(pair), flag, "0"]) == 2
    assert "max_new_tokens must be an int >= 1" in one_line(capsys.readouterr().err)
    target = specdec.load_model(pair.target)
    for call in (lambda: specdec.autoregressive_generate(target, [1, 2], max_new_tokens=0),
                 lambda: specdec.speculative_generate(target, "ngram", [1, 2], max_new_tokens=0)):
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
            call()


# ------------------------------------------------------------------------------------ progress bars


def test_library_calls_print_no_progress_bar_unless_asked(pair: TinyPair) -> None:
    code = ("import sys, specdec\n"
            "from transformers.utils import logging\n"
            f"specdec.load_model({str(pair.target)!r})\n"
            "print('--asked--', file=sys.stderr, flush=True)\n"
            f"specdec.load_model({str(pair.target)!r}, progress=True)\n"
            "print(logging.is_progress_bar_enabled())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=REPO,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    unasked, asked = proc.stderr.split("--asked--")
    assert "Loading weights" not in unasked and "Loading weights" in asked
    assert proc.stdout.strip() == "True"  # the caller's setting is left as it was


# ------------------------------------------------------------------------------------------ Ctrl-C

# `python -m specdec ARGS`, saying "started" first: delays count from there, after the interpreter's
# own start-up and runpy's search for the package (a signal then is Python's to report, not ours). A shell that runs
# the suite in the background makes SIGINT ignored, and children inherit that: Python's own handler
# is put back, as in a user's terminal.
LAUNCH = ("import runpy, signal, sys, specdec; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "print('started', flush=True); runpy.run_module('specdec', run_name='__main__', alter_sys=True)")


def interrupt(argv: list[str], delay: float | None) -> tuple[int, str, str]:
    """Run specdec, send SIGINT ``delay`` seconds after it starts (None: once the first text is out)."""
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=ENV, cwd=REPO)
    try:
        assert proc.stdout.readline() == b"started\n"
        if delay is None:
            first = proc.stdout.read(1)  # blocks until the stream prints its first character
            assert first, proc.stderr.read().decode()
        else:
            time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


class _FinalizerInterrupted:
    """An object whose finalizer is hit by Ctrl-C: Python prints and ignores the KeyboardInterrupt."""

    def __del__(self) -> None:
        raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["loading", "generating"])
def test_ctrl_c_swallowed_by_a_finalizer_still_interrupts(pair: TinyPair, where: str, monkeypatch, capsys) -> None:
    """A Ctrl-C landing in a finalizer (a fresh-clone run of the test below once sent it while the garbage collector
    ran a ``regex`` Group's ``__del__`` during the imports) used to be printed as a traceback and lost: the command
    decoded its 8000 tokens and exited 0. Now it interrupts at the next round, with the usual one line and 130."""
    from specdec.session import Session

    real_load, real_generate = Session.load, Session.generate

    def load(self, *args, **kwargs):
        if where == "loading":
            _FinalizerInterrupted()  # dropped at once: its __del__ raises into Python's "Exception ignored"
        return real_load(self, *args, **kwargs)

    def generate(self, prompt_ids, settings, on_round=None, **kwargs):
        def round_(event):
            on_round(event)
            if where == "generating":
                _FinalizerInterrupted()
        return real_generate(self, prompt_ids, settings, on_round=round_, **kwargs)

    monkeypatch.setattr(Session, "load", load)
    monkeypatch.setattr(Session, "generate", generate)
    assert cli.main(["generate", PROMPT, *pair_args(pair), "--max-new-tokens", "400"]) == cli.EXIT_INTERRUPTED
    err = capsys.readouterr().err
    line = one_line(err)
    assert re.fullmatch(r"\[interrupted: \d+ new tokens in [\d.]+ s\]", line), line
    assert "Exception ignored" not in err
    tokens = int(line.split()[1])
    assert tokens == 0 if where == "loading" else 0 < tokens < 400  # stopped at the round after the interrupt


@pytest.mark.parametrize("delay", [0.02, 0.1, 0.3, 1.0, 2.5, None])
def test_ctrl_c_at_any_moment_is_one_line_and_130(pair: TinyPair, delay: float | None) -> None:
    status, _, err = interrupt(["generate", PROMPT, *pair_args(pair), "--max-new-tokens", "8000"], delay)
    # 130 = 128 + SIGINT; a process that re-raises SIGINT to die of it reads as 130 in the shell too
    assert status in (130, -signal.SIGINT), err
    line = one_line(err)
    assert "interrupted" in line, err
    if delay is None:  # mid-generation: what was produced is kept and counted
        assert re.fullmatch(r"\[interrupted: \d+ new tokens in [\d.]+ s\]", line), line


def test_version_names_specdec_and_the_releases_it_runs_on(capsys) -> None:
    """``specdec --version`` and ``specdec.__version__`` come from the installed package's metadata, and the line
    names the transformers and torch releases found, so a bug report carries them."""
    import importlib.metadata

    import torch
    import transformers

    assert specdec.__version__ == importlib.metadata.version("specdec")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"specdec {specdec.__version__} (transformers {transformers.__version__}, ")
    assert f"torch {torch.__version__}" in line
