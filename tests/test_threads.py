"""The torch thread count: chosen for the run (specdec.threads), reported, and refused when impossible.

The decision is a pure function of the count asked for, OMP_NUM_THREADS, the target's size and the
machine's cores; these tests vary each. A busy sibling process must not change it (the default never
reads the load). The command line reports the count and its source in ``--json`` and the summary line,
and refuses 0, negative and too many threads with one line and exit status 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_models import TinyPair, save_tiny_pair

import specdec
from specdec import cli, threads
from specdec.bench.config import BenchConfig
from specdec.config import ModelConfig
from specdec.threads import SMALL_MODEL_PARAMETERS, ThreadChoice, choose_threads, helped

REPO = Path(__file__).resolve().parent.parent
SMALL = SMALL_MODEL_PARAMETERS // 10  # a target well below the threshold
LARGE = SMALL_MODEL_PARAMETERS * 10  # one well above it
NO_ENV: dict[str, str] = {}


def choose(requested: int | None = None, parameters: int | None = SMALL, usable: int = 16, physical: int = 8,
           environ: dict[str, str] = NO_ENV, flag: str = "--threads", helped: bool = False) -> ThreadChoice:
    return choose_threads(requested, parameters=parameters, usable=usable, physical=physical, environ=environ,
                          flag=flag, helped=helped)


# ------------------------------------------------------------------------------------ the decision


def test_a_small_target_gets_one_thread_however_many_cores() -> None:
    for usable, physical in ((1, 1), (2, 2), (16, 8), (128, 64)):
        choice = choose(usable=usable, physical=physical)
        assert choice == ThreadChoice(1, f"default: target < {SMALL_MODEL_PARAMETERS / 1e6:g}M params")
    assert choose(parameters=SMALL_MODEL_PARAMETERS - 1).threads == 1  # the threshold is exclusive


def test_a_large_target_gets_the_physical_cores_it_may_use() -> None:
    assert choose(parameters=LARGE, usable=16, physical=8) == ThreadChoice(
        8, f"default: target >= {SMALL_MODEL_PARAMETERS / 1e6:g}M params, 8 physical cores")
    assert choose(parameters=SMALL_MODEL_PARAMETERS, usable=16, physical=8).threads == 8
    assert choose(parameters=LARGE, usable=4, physical=8).threads == 4  # never more than the affinity allows
    assert choose(parameters=LARGE, usable=1, physical=1) == ThreadChoice(
        1, f"default: target >= {SMALL_MODEL_PARAMETERS / 1e6:g}M params, 1 physical core")
    assert choose(parameters=None, usable=6, physical=3) == ThreadChoice(
        3, "default: model size unknown, 3 physical cores")


def test_a_large_target_on_specdecs_operator_gets_one_thread_and_helpers_on_the_other_cores() -> None:
    assert choose(parameters=LARGE, usable=16, physical=8, helped=True) == ThreadChoice(
        1, f"default: target >= {SMALL_MODEL_PARAMETERS / 1e6:g}M params, helpers on the other 15 cores")
    assert choose(parameters=None, usable=2, physical=2, helped=True) == ThreadChoice(
        1, "default: model size unknown, a helper on the other core")
    assert choose(parameters=LARGE, usable=1, physical=1, helped=True).threads == 1
    assert choose(2, parameters=LARGE, helped=True) == ThreadChoice(2, "--threads")  # asked for: as asked
    assert choose(parameters=LARGE, environ={"OMP_NUM_THREADS": "4"}, helped=True).threads == 4


def test_helped_reads_the_switches_and_the_compiler(monkeypatch) -> None:
    from specdec import config

    monkeypatch.setattr(config, "c_compiler", lambda: "/usr/bin/cc")
    assert helped({}) is sys.platform.startswith("linux")
    assert not helped({"SPECDEC_LINEAR": "off"}) and not helped({"SPECDEC_HELPER": " OFF"})
    monkeypatch.setattr(config, "c_compiler", lambda: None)
    assert not helped({})


def test_a_count_asked_for_wins_then_omp_num_threads() -> None:
    env = {"OMP_NUM_THREADS": "3"}
    assert choose(2, environ=env) == ThreadChoice(2, "--threads")
    assert choose(5, parameters=LARGE, environ=env, flag="threads=") == ThreadChoice(5, "threads=")
    assert choose(environ=env) == ThreadChoice(3, "OMP_NUM_THREADS")  # over the small default's 1
    assert choose(parameters=LARGE, environ=env) == ThreadChoice(3, "OMP_NUM_THREADS")  # over the physical cores
    assert choose(environ={"OMP_NUM_THREADS": "4,2"}) == ThreadChoice(4, "OMP_NUM_THREADS")  # nested: outer level
    assert choose(environ={"OMP_NUM_THREADS": " "}).source.startswith("default:")  # set but empty: not set


@pytest.mark.parametrize("bad", [0, -1, 17, True, 2.0, "2"])
def test_a_bad_count_asked_for_is_refused_naming_the_flag_and_the_fix(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^--threads .* give (a whole number from )?1 to 16.*leave it out") as err:
        choose(bad, usable=16)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("bad", ["0", "-2", "17", "abc", "2.5"])
def test_a_bad_omp_num_threads_is_refused_naming_it(bad: str) -> None:
    with pytest.raises(ValueError, match=r"^OMP_NUM_THREADS .* give (a whole number from )?1 to 16.*unset it"):
        choose(environ={"OMP_NUM_THREADS": bad}, usable=16)


def test_the_configs_refuse_a_count_below_one() -> None:
    for bad in (0, -3, True, 1.5):
        with pytest.raises(ValueError, match="threads must be a whole number >= 1"):
            ModelConfig(threads=bad)
        with pytest.raises(ValueError, match="threads must be a whole number >= 1"):
            BenchConfig(threads=bad)
    assert ModelConfig(threads=2).threads == 2 and ModelConfig().threads is None


# -------------------------------------------------------------------------------------- the machine


def test_the_machine_figures() -> None:
    usable = threads.usable_cores()
    assert 1 <= threads.physical_cores() <= usable <= os.cpu_count()
    if hasattr(os, "sched_getaffinity"):
        assert usable <= len(os.sched_getaffinity(0))


def test_a_cgroup_quota_caps_the_usable_cores(tmp_path: Path) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")
    assert threads._cgroup_limit(cpu_max) == 2  # 1.5 CPUs of quota: 2 threads may run
    cpu_max.write_text("max 100000\n")
    assert threads._cgroup_limit(cpu_max) is None
    assert threads._cgroup_limit(tmp_path / "absent") is None


def test_parameters_are_counted_from_the_safetensors_headers_as_loaded() -> None:
    shipped = "code-target"  # four safetensors shards, tied embeddings
    counted = threads.model_parameters(shipped)
    model = specdec.load_model(shipped, device="cpu")
    assert counted == sum(p.numel() for p in model.parameters()) == threads.model_parameters(model)
    assert threads.model_parameters(None) is None


def test_use_threads_applies_the_choice_and_current_says_where_it_came_from() -> None:
    before = torch.get_num_threads()
    try:
        choice = threads.use_threads(1, model="code-drafter")
        assert choice == ThreadChoice(1, "threads=")
        assert torch.get_num_threads() == 1 and threads.current() == choice
        if threads.usable_cores() > 1:
            torch.set_num_threads(2)
            assert threads.current() == ThreadChoice(2, "set outside specdec")
        with pytest.raises(ValueError, match="^threads= 0 is not a thread count"):
            threads.use_threads(0)
        with pytest.raises(ValueError, match="is more than the"):
            threads.use_threads(threads.usable_cores() + 1)
    finally:
        torch.set_num_threads(before)


BUSY = "while True: pass"
DECIDE = """
from specdec.threads import choose_threads, physical_cores, usable_cores, use_threads
small = use_threads(model="code-target")
large = choose_threads(None, parameters=10**12, usable=usable_cores(), physical=physical_cores(), environ={})
print(small.threads, large.threads)
print(small.source)
"""


def _decide() -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", DECIDE], capture_output=True, text=True, env=env, timeout=120,
                          check=True)
    return proc.stdout.splitlines()


def test_a_busy_sibling_process_does_not_change_the_choice() -> None:
    quiet = _decide()
    sibling = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(1.0)  # the sibling is spinning on a core
        busy = _decide()
        assert sibling.poll() is None  # still running while the choice was made
    finally:
        sibling.kill()
        sibling.wait()
    expected_large = min(threads.physical_cores(), threads.usable_cores())
    assert quiet == busy == [f"1 {expected_large}", f"default: target < {SMALL_MODEL_PARAMETERS / 1e6:g}M params"]


# ---------------------------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    return save_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))  # built on one thread


def run_cli(*args: str, omp: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    return subprocess.run([sys.executable, "-m", "specdec", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120, check=False)


def generate_args(pair: TinyPair) -> list[str]:
    return ["generate", "def add(a, b):", "--target", str(pair.target), "--drafter", str(pair.drafter),
            "--max-new-tokens", "6"]


def test_json_reports_threads_asked_for_over_the_environment(pair: TinyPair) -> None:
    proc = run_cli(*generate_args(pair), "--threads", "1", "--json", omp="2")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["threads"], out["threads_source"]) == (1, "--threads")


def test_json_reports_omp_num_threads_as_the_source(pair: TinyPair) -> None:
    proc = run_cli(*generate_args(pair), "--json", omp="1")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["threads"], out["threads_source"]) == (1, "OMP_NUM_THREADS")


def test_the_summary_line_reports_the_default(pair: TinyPair) -> None:
    proc = run_cli(*generate_args(pair), omp=None)
    assert proc.returncode == 0, proc.stderr
    summary = proc.stderr.strip().splitlines()[-1]
    assert f"1 thread (default: target < {SMALL_MODEL_PARAMETERS / 1e6:g}M params)" in summary.split(" | "), summary


@pytest.mark.parametrize("bad, message", [
    ("0", "threads must be a whole number >= 1"),
    ("-2", "threads must be a whole number >= 1"),
    ("999", "--threads 999 is more than the"),
])
def test_bad_thread_counts_are_one_line_and_exit_2(pair: TinyPair, bad: str, message: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    assert cli.main([*generate_args(pair), f"--threads={bad}"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("specdec generate: error: ") and message in err and err.count("\n") == 1, err
    assert "leave it out for the default" in err


def test_a_bad_omp_num_threads_is_one_line_and_exit_2(pair: TinyPair) -> None:
    proc = run_cli(*generate_args(pair), omp="abc")
    assert proc.returncode == cli.EXIT_USAGE
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "specdec generate: error: OMP_NUM_THREADS 'abc' is not a thread count"), proc.stderr


def test_the_bench_applies_threads_and_states_them_in_its_environment(pair: TinyPair, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    from specdec.bench.cli import main as bench_main

    before = torch.get_num_threads()
    try:
        status = bench_main(["--target", str(pair.target), "--drafter", str(pair.drafter), "--quick",
                             "--methods", "plain", "--num-prompts", "1", "--max-new-tokens", "4", "--warmup", "0",
                             "--no-plots", "--no-progress", "--output", str(tmp_path), "--threads", "1"])
    finally:
        torch.set_num_threads(before)
    assert status == 0
    env = json.loads((tmp_path / "summary.json").read_text())["environment"]
    assert (env["torch_threads"], env["threads_source"]) == (1, "--threads")
    assert ", 1 thread (--threads)" in " ".join(capsys.readouterr().out.split())  # the environment line
    assert bench_main(["--threads", "0", "--no-progress"]) == cli.EXIT_USAGE


def test_narrow_weights_reads_the_stored_dtypes(tmp_path) -> None:
    """A large target gets one thread and the helpers only where its weights are stored narrower than float32 (the
    forms specdec's kernels read at fewer bytes): read from the safetensors headers, or a loaded model's dtypes."""
    from safetensors.torch import save_file

    from specdec.threads import narrow_weights

    for name, dtype, narrow in (("f32", torch.float32, False), ("bf16", torch.bfloat16, True),
                                ("int8", torch.int8, True)):
        folder = tmp_path / name
        folder.mkdir()
        save_file({"w": torch.zeros(4, 4, dtype=dtype), "norm": torch.ones(4)}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text("{}")
        assert threads.narrow_weights(folder) is narrow
    (tmp_path / "config.json").write_text("{}")
    assert not narrow_weights(None) and not narrow_weights(tmp_path)  # unknown: no safetensors files
    model = torch.nn.Linear(4, 4)
    model.config = type("Config", (), {})()
    assert not narrow_weights(model) and narrow_weights(model.to(torch.bfloat16))
