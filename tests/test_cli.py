"""The ``specdec`` command line, driven as a user drives it: subprocesses, a pipe and a terminal.

Most tests run ``python -m specdec`` on a tiny pair saved to a temporary folder (tests/tiny_models.py)
and compare what it prints with the Python API on the same settings. Error paths that need no
subprocess call ``specdec.cli.main`` in-process. Subprocesses use one thread each so the suite
stays fast on a shared 2-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
import torch
from tiny_models import TinyPair, save_tiny_pair

import specdec
from specdec import cli, session
from specdec.bench import BenchConfig
from specdec.config import ModelConfig
from specdec.detokenize import TokenStream
from specdec.stats import RoundEvent

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PROMPT_TOOLKIT_NO_CPR": "1", "NO_COLOR": "1"}
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    return save_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))  # built on one thread


@pytest.fixture(scope="module")
def models(pair: TinyPair) -> dict:
    return {"target": specdec.load_model(pair.target), "drafter": specdec.load_model(pair.drafter),
            "tokenizer": specdec.load_tokenizer(pair.target)}


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec", *args], input=stdin, capture_output=True,
                          text=True, env=ENV, cwd=REPO, timeout=120, check=False)


def pair_args(pair: TinyPair) -> list[str]:
    return ["--target", str(pair.target), "--drafter", str(pair.drafter)]


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_json_equals_the_api_sampled(pair: TinyPair, models: dict) -> None:
    proc = run_cli("generate", PROMPT, *pair_args(pair), "--json", "--temperature", "0.8", "--top-k", "50",
                   "--top-p", "0.95", "--seed", "7", "--gamma", "3", "--max-new-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # the whole of stdout is one JSON object
    ids = models["tokenizer"](PROMPT).input_ids
    api = specdec.speculative_generate(models["target"], models["drafter"], ids, max_new_tokens=24, gamma=3,
                                       temperature=0.8, top_k=50, top_p=0.95, seed=7)
    assert out["prompt_ids"] == ids
    assert out["tokens"] == api.tokens
    assert out["text"] == models["tokenizer"].decode(api.tokens, skip_special_tokens=True)
    assert out["stats"]["new_tokens"] == len(api.tokens)
    assert out["stats"]["rounds"] == api.stats.rounds
    assert {"acceptance_rate", "mean_accepted_length", "accepted_per_position", "target_calls",
            "drafter_calls", "wall_time_s", "tokens_per_s"} <= out["stats"].keys()


def test_lmflow_flags_and_prompt_file(pair: TinyPair, models: dict, tmp_path: Path) -> None:
    prompt_file = tmp_path / "prompt.py"
    prompt_file.write_text("class Point:\n")
    proc = run_cli("generate", "--prompt-file", str(prompt_file), "--model", str(pair.target),
                   "--draft_model", str(pair.drafter), "--temperature", "0", "--gamma", "2",
                   "--max_new_tokens", "20", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    ids = models["tokenizer"]("class Point:\n").input_ids
    plain = models["target"].generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    assert out["tokens"] == plain[0, len(ids):].tolist()
    assert (out["gamma"], out["max_new_tokens"], out["temperature"]) == (2, 20, 0.0)


def test_stop_cuts_the_streamed_output(pair: TinyPair, models: dict) -> None:
    tok = models["tokenizer"]
    ids = tok(PROMPT).input_ids
    full = specdec.autoregressive_generate(models["target"], ids, max_new_tokens=40)
    full_text = tok.decode(full.tokens)
    assert "parser" in full_text  # the tiny target has memorised its corpus
    proc = run_cli("generate", PROMPT, *pair_args(pair), "--max-new-tokens", "40", "--stop", "parser",
                   "--stop", "never-there", "--show-acceptance")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout.rstrip("\n")
    assert "parser" in text and full_text.startswith(text)
    assert len(text) < full_text.index("parser") + len("parser") + 8  # cut at the token that completed it
    assert "colours: accepted" in proc.stderr and "stop: stop_string" in proc.stderr
    assert "tokens/s" in proc.stderr and "acceptance rate" in proc.stderr


def test_drafter_mode_and_ngram_from_stdin(pair: TinyPair, models: dict) -> None:
    ids = models["tokenizer"](PROMPT).input_ids
    proc = run_cli("generate", *pair_args(pair), "--mode", "drafter", "--max-new-tokens", "16", "--json",
                   stdin=PROMPT)
    assert proc.returncode == 0, proc.stderr
    drafter_alone = specdec.autoregressive_generate(models["drafter"], ids, max_new_tokens=16)
    assert json.loads(proc.stdout)["tokens"] == drafter_alone.tokens

    proc = run_cli("generate", PROMPT, "--target", str(pair.target), "--drafter", "ngram",
                   "--max-new-tokens", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["drafter"] == "ngram" and out["stats"]["drafter_calls"] == 0
    assert out["tokens"] == specdec.autoregressive_generate(models["target"], ids, max_new_tokens=16).tokens

    proc = run_cli("generate", PROMPT, "--target", str(pair.target), "--drafter", f"lookup+{pair.drafter}",
                   "--max-new-tokens", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["stats"]["drafter_calls"] > 0  # the model drafted where lookup found nothing
    assert out["tokens"] == specdec.autoregressive_generate(models["target"], ids, max_new_tokens=16).tokens


def test_bad_model_path_is_one_line_exit_2(pair: TinyPair, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    proc = run_cli("generate", PROMPT, "--target", str(missing), "--drafter", str(pair.drafter))
    assert proc.returncode == 2
    assert str(missing) in one_line(proc.stderr)
    assert proc.stdout == ""


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--top-p", "2", PROMPT], "top_p"),
    (["generate", "--mode", "fast", PROMPT], "invalid choice"),
    (["generate", "--gamma", "two", PROMPT], "invalid int value"),
    (["chat", "--temperature", "-1"], "temperature"),
])
def test_bad_values_are_one_line_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture) -> None:
    try:
        status = cli.main(argv)
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    assert status == 2
    assert needle in one_line(capsys.readouterr().err)


def test_incompatible_flags_and_modes(pair: TinyPair, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["generate", PROMPT, "--device", "cpu", "--gpu", "0", *pair_args(pair)]) == 2
    assert "--gpu" in one_line(capsys.readouterr().err)
    assert cli.main(["generate", PROMPT, "--target", str(pair.target), "--drafter", "ngram",
                     "--mode", "drafter"]) == 2
    assert "ngram" in one_line(capsys.readouterr().err)
    assert cli.main(["generate", PROMPT, *pair_args(pair), "--chat-template"]) == 2
    assert "chat template" in one_line(capsys.readouterr().err)


def test_ctrl_c_keeps_what_was_generated(pair: TinyPair, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture) -> None:
    tok = specdec.load_tokenizer(pair.target)
    words = tok("    return a").input_ids

    def interrupted(self, prompt_ids, settings, on_round=None):
        on_round(RoundEvent(tokens=words, kinds=["accepted"] * len(words)))
        raise KeyboardInterrupt

    monkeypatch.setattr(session.Session, "generate", interrupted)
    assert cli.main(["generate", PROMPT, *pair_args(pair)]) == cli.EXIT_INTERRUPTED
    captured = capsys.readouterr()
    assert captured.out.rstrip("\n") == "    return a"
    assert f"interrupted: {len(words)} new tokens" in captured.err
    assert cli.main(["generate", PROMPT, *pair_args(pair), "--json"]) == cli.EXIT_INTERRUPTED
    out = json.loads(capsys.readouterr().out)
    assert (out["text"], out["tokens"], out["stop_reason"]) == ("    return a", words, "interrupted")


def test_stream_holds_back_incomplete_characters(pair: TinyPair) -> None:
    tok = specdec.load_tokenizer(pair.target)
    text = "naïve → 漢字 ok"
    ids = tok(text).input_ids  # byte-level BPE: the non-ASCII characters span several tokens
    stream = TokenStream(tok, tok(PROMPT).input_ids)
    for token in ids:
        stream.add(RoundEvent(tokens=[token], kinds=["accepted"]))
        assert "\ufffd" not in stream.text
    stream.finish()
    assert stream.text == text


def test_chat_through_a_pipe(pair: TinyPair) -> None:
    lines = [PROMPT, "/gamma 2", "/temperature -1", "/drafter ngram", "class Point:", "/stats", "/nope",
             "/mode drafter", "/quit", "not reached"]
    proc = run_cli("chat", *pair_args(pair), "--max-new-tokens", "12", stdin="\n".join(lines) + "\n")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("tokens/s") == 2 and "> class Point:" in out
    assert "gamma = 2" in out and "drafter = ngram" in out
    assert "error: temperature must be" in out and "error: unknown command /nope" in out
    assert "error: mode 'drafter'" in out  # ngram has no model to decode with
    assert "drafter_calls" in out  # /stats
    assert "not reached" not in out


def test_chat_in_a_terminal(pair: TinyPair) -> None:
    argv = ["-m", "specdec", "chat", *pair_args(pair), "--max-new-tokens", "16"]
    # A shell that runs the suite in the background makes SIGINT ignored, and children inherit
    # that: give the console the default disposition, as in a user's terminal.
    child = pexpect.spawn(sys.executable, argv, env=ENV, cwd=str(REPO), encoding="utf-8", timeout=60,
                          dimensions=(40, 200), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        child.expect("specdec chat: target")
        child.expect(">")
        child.sendline(PROMPT)
        child.expect(r"16 new tokens in [\d.]+ s \([\d.]+ tokens/s\) \| \d+ rounds \| acceptance rate")
        child.expect(">")
        child.sendline("/mode compare")
        child.expect("mode = compare")
        child.expect(">")
        child.sendline("import os")
        child.expect(r"\[target\]")
        child.expect(r"\[speculative\]")
        child.expect(r"speedup [\d.]+x \(same tokens\)")
        child.expect(">")
        child.send("\x1b[A")  # history: up arrow recalls "import os"
        child.sendline("")
        child.expect(r"speedup [\d.]+x")
        child.expect(">")
        child.sendline("/mode target")  # one long phase (several seconds) that Ctrl-C can interrupt
        child.expect(">")
        child.sendline("/length 8000")
        child.expect(">")
        child.sendline(PROMPT)
        child.expect(r"\[target\]|return")  # the first tokens are on screen: Ctrl-C stops the rest
        child.sendintr()
        child.expect(r"\[interrupted: \d+ new tokens")
        child.expect(">")
        child.sendcontrol("d")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_default_drafter_is_lookup_then_the_shipped_drafter_model() -> None:
    assert (ModelConfig().drafter, ModelConfig().drafter_model) == ("lookup+code-drafter", "code-drafter")
    assert ModelConfig(drafter="ngram").drafter_model is None
    assert ModelConfig(drafter="runs/my-drafter").drafter_model == "runs/my-drafter"
    assert BenchConfig().drafter == "code-drafter"  # the bench's `spec` drafts with the model alone


@pytest.mark.skipif(not (REPO / "models" / "code-target" / "config.json").is_file()
                    or not (REPO / "models" / "code-drafter" / "config.json").is_file(),
                    reason="the shipped models are not in models/")
def test_default_pair() -> None:
    proc = run_cli("generate", "def parse_args(argv):", "--max-new-tokens", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["target"], out["drafter"]) == ("code-target", "lookup+code-drafter")
    assert out["stats"]["new_tokens"] > 0 and out["stats"]["drafted"] > 0
    assert out["stats"]["drafter_calls"] > 0  # the drafter model drafted where prompt lookup found nothing


def test_prompts_file_prints_every_result_in_input_order(pair: TinyPair, models: dict, tmp_path: Path) -> None:
    prompts = [PROMPT, "class Point:", "import os", "for i in range(10):", "def parse_args(argv):"]
    plain = tmp_path / "prompts.txt"
    plain.write_text("\n".join(prompts[:2]) + "\n\n" + "\n".join(prompts[2:]) + "\n")  # a blank line is skipped
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts)))
    tok = models["tokenizer"]
    expected = [specdec.autoregressive_generate(models["target"], tok(p).input_ids, max_new_tokens=12).tokens
                for p in prompts]
    for path in (plain, jsonl):
        proc = run_cli("generate", "--prompts-file", str(path), *pair_args(pair), "--max-new-tokens", "12",
                       "--batch-size", "2", "--json")
        assert proc.returncode == 0, proc.stderr
        lines = [json.loads(line) for line in proc.stdout.splitlines()]
        assert [line["index"] for line in lines] == list(range(len(prompts)))
        assert [line["prompt"] for line in lines] == prompts
        assert [line["tokens"] for line in lines] == expected  # greedy: each equals the target alone
        assert all(line["lossless"] and line["batch_size"] == 2 for line in lines)
    proc = run_cli("generate", "--prompts-file", str(plain), *pair_args(pair), "--max-new-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    headers = [line for line in proc.stdout.splitlines() if line.startswith("### prompt")]
    assert headers == [f"### prompt {i}: {p}" for i, p in enumerate(prompts)]
    assert "5 prompts, 60 new tokens" in proc.stderr and "bookkeeping" in proc.stderr


@pytest.mark.parametrize("content, needle", [
    (None, "cannot read --prompts-file"),
    ("", "holds no prompt"),
    ('{"prompt": "a"}\nnot json\n', "line 2: not JSON"),
    ('{"prompt": "a"}\n{"text": "b"}\n', 'line 2: no "prompt" string'),
])
def test_bad_prompts_files(pair: TinyPair, tmp_path: Path, capsys: pytest.CaptureFixture, content, needle) -> None:
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    assert cli.main(["generate", "--prompts-file", str(path), *pair_args(pair)]) == 2
    captured = capsys.readouterr()
    assert needle in one_line(captured.err) and captured.out == ""


def test_bad_batches_are_refused_before_any_output(pair: TinyPair, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "p.txt"
    path.write_text("import os\n" + "x = 1 + " * 2000 + "\n")  # the second prompt outgrows the context
    assert cli.main(["generate", "--prompts-file", str(path), *pair_args(pair), "--json"]) == 2
    captured = capsys.readouterr()
    assert "prompt 1 has" in one_line(captured.err) and "context holds 8192" in captured.err
    assert captured.out == ""
    for size in ("0", "-2"):
        assert cli.main(["generate", "--prompts-file", str(path), *pair_args(pair), "--batch-size", size]) == 2
        assert "batch_size must be an int >= 1" in one_line(capsys.readouterr().err)
