"""`specdec serve --compile auto` on a CPU (specdec.serve.background): the server answers at once, eagerly, while a
child process compiles its buckets into the compile cache; then it finishes the rows in flight, loads the graphs and
serves compiled, every output still the target's own greedy decoding; a second start loads them all at once.

The suite's other servers keep ``SPECDEC_COMPILE_BESIDE=off`` (conftest.py): here it is switched on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from conftest import assert_same_greedy
from tiny_models import save_tiny_pair
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.compiled import compiled_for, compiler_missing, prepare, saves_graphs
from specdec.config import ModelConfig, SamplingConfig, ScheduleConfig, SpecConfig, VerifyConfig
from specdec.serve import background
from specdec.serve.background import ENV, Beside
from specdec.serve.config import ServeConfig
from specdec.serve.server import ServerThread, build_app
from specdec.session import Session

GAMMA = 3
NEW = 16
SWITCH_TIMEOUT = 600  # seconds for the child to compile two tiny buckets on a loaded 2-core machine
PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self, x, y):", "for i in range(10):"]
compiles_here = pytest.mark.skipif(compiler_missing() is not None or not saves_graphs(),
                                   reason="torch.compile cannot build or save graphs here (no C++ compiler, or a torch "
                                          "without aot_compile): the server never compiles beside serving")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("background-pair"))


def configs(pair, **spec):
    """The server's settings: the tiny target drafted for by prompt lookup (only the target compiles: its
    gamma + 1 tokens in rows of 1 and 2), one thread, --compile auto (the default)."""
    models = ModelConfig(target=str(pair.target), drafter="ngram", device="cpu", threads=1)
    return models, SpecConfig(gamma=GAMMA, batch_size=2, max_new_tokens=NEW, **{"speculate": "on", **spec})


def complete(url: str, prompt: str) -> list[int]:
    body = json.dumps({"model": "target", "prompt": prompt, "max_tokens": NEW, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)["specdec"]["token_ids"]


def stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/stats", timeout=30) as reply:
        return json.load(reply)["models"][0]


def reference(pair, prompt: str) -> tuple[list[int], list[int]]:
    """The prompt's ids and the target's own greedy continuation (``generate``)."""
    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    model = AutoModelForCausalLM.from_pretrained(pair.target).eval()
    ids = tokenizer(prompt).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW, pad_token_id=tokenizer.eos_token_id)
    return ids, out[0, len(ids):].tolist()


def test_the_rule(monkeypatch):
    monkeypatch.setenv(ENV, "auto")
    here = compiler_missing() is None and saves_graphs()
    assert background.wanted(ModelConfig(compile="auto", device="cpu")) is here
    for mode in ("on", "off"):  # on compiles at start, off never
        assert background.wanted(ModelConfig(compile=mode, device="cpu")) is False
    monkeypatch.setenv(ENV, "off")
    assert background.wanted(ModelConfig(compile="auto", device="cpu")) is False
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match=r"SPECDEC_COMPILE_BESIDE='sometimes': use one of auto, off"):
        background.wanted(ModelConfig(compile="auto", device="cpu"))


@compiles_here
def test_cached_only_compiles_nothing_and_loads_everything_or_nothing(pair):
    """``prepare(cached_only=True)``: nothing in the cache -> the model stays eager and no graph is written; once a
    normal prepare saved the buckets, another load of the model takes them all from the cache."""
    from specdec.compiled import cache_folder

    def load():
        return AutoModelForCausalLM.from_pretrained(pair.target).eval()

    graphs = cache_folder("graphs")
    before = set(graphs.glob("*")) if graphs.is_dir() else set()
    model = load()
    choice = prepare(model, "on", tokens=(2,), rows=(3,), cached_only=True)
    assert not choice.compiled and "not in the compile cache yet" in choice.reason and compiled_for(model) is None
    assert (set(graphs.glob("*")) if graphs.is_dir() else set()) == before  # nothing compiled, nothing saved
    assert prepare(load(), "on", tokens=(2,), rows=(3,)).compiled  # compiles and saves the bucket
    again = load()
    choice = prepare(again, "on", tokens=(2,), rows=(3,), cached_only=True)
    assert choice.compiled and "1 from the compile cache" in choice.reason and compiled_for(again).loaded == 1
    # one bucket missing: none is taken, the model stays as it was
    third = load()
    assert not prepare(third, "on", tokens=(2, 5), rows=(3,), cached_only=True).compiled
    assert compiled_for(third) is None


@compiles_here
def test_the_server_serves_at_once_then_compiled_and_a_second_start_is_compiled(pair, monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, "auto")
    # a graph cache of its own, empty: an earlier test of the session may have compiled this pair's buckets (the
    # command-line test of tests/test_compiled.py compiles the same tiny target for rows of 1 and 2), and a server
    # that finds them compiles at once, not beside serving
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    expected = {p: reference(pair, p) for p in PROMPTS}
    models, spec = configs(pair)
    session = Session(models)
    app = build_app(ServeConfig(port=0, model_name="target"), models, spec, SamplingConfig(), VerifyConfig(),
                    session=session)
    target = session.model(models.target)
    with ServerThread(app) as server:
        engine = app.state.models["target"].engine
        first = stats(server.url)
        assert first["compile"] == "auto: compiling beside serving (eager until then)"
        assert compiled_for(target) is None
        # served eagerly while the child compiles (a request or two, as many as the compile leaves time for)
        served_before = 0
        deadline = time.monotonic() + SWITCH_TIMEOUT
        while stats(server.url)["compile"].startswith("auto: compiling") and time.monotonic() < deadline:
            prompt = PROMPTS[served_before % len(PROMPTS)]
            ids, greedy = expected[prompt]
            assert_same_greedy(target, ids, complete(server.url, prompt), greedy)
            served_before += 1
            time.sleep(0.5)
        after = stats(server.url)["compile"]
        assert after.startswith("auto: compiled beside serving; "), after
        assert served_before >= 1
        compiled = compiled_for(target)
        assert compiled is not None
        calls = compiled.calls["compiled"]
        for prompt in PROMPTS:  # compiled now, and still the target's own greedy decoding
            ids, greedy = expected[prompt]
            assert_same_greedy(target, ids, complete(server.url, prompt), greedy)
        assert compiled.calls["compiled"] > calls
        assert engine.beside is None and not engine._held  # the switch is done
    # a second start finds every bucket in the compile cache: compiled at once, nothing beside
    second = Session(models)
    beside, said = Beside.start(second, spec, ScheduleConfig())
    assert beside is None and said.startswith("auto: ") and "from the compile cache" in said
    assert compiled_for(second.model(models.target)) is not None


def child(session, spec, schedule, command: list[str], tmp_path) -> Beside:
    """A ``Beside`` whose child is any command: the engine's switch without a compile."""
    beside = object.__new__(Beside)
    beside.session, beside.spec, beside.schedule, beside.description = session, spec, schedule, {}
    beside.log = tmp_path / "child.log"
    with beside.log.open("wb") as log:
        beside.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    beside.started = time.perf_counter()
    return beside


def test_a_failed_compile_leaves_the_server_eager_and_says_why(pair, tmp_path, capsys):
    """The engine holds nothing back for long: when the child fails, requests go on eagerly and the failure is said
    once, with the child's last line."""
    from specdec.drafters import make_drafter
    from specdec.schedules import make_schedule
    from specdec.serve.engine import Engine
    from specdec.target import make_target

    models, spec = configs(pair)
    session = Session(models)
    target = make_target(session.model(models.target))
    drafter = make_drafter(models.drafter_config, target, session.tokenizer("speculative"))
    failing = [sys.executable, "-c", "import sys; print('inductor: no C++ compiler found'); sys.exit(3)"]
    beside = child(session, spec, ScheduleConfig(), failing, tmp_path)
    engine = Engine(target, drafter, make_schedule(spec, None, drafter), batch_size=2, beside=beside)
    beside.process.wait(30)
    assert engine._switching()
    engine._switch()  # as the worker does with no row in flight
    assert engine.beside is None and not engine._switching() and compiled_for(target.model) is None
    assert beside.description["compile"] == ("auto: the compile beside serving failed "
                                             "(inductor: no C++ compiler found); eager")
    assert "the compile beside serving failed after" in capsys.readouterr().err
    assert not beside.log.exists()


def test_requests_wait_for_the_rows_in_flight_then_go_on(pair, tmp_path):
    """While the switch is due, new requests are held (counted as waiting) until the batch has emptied; then they
    are decoded, and each one's output is the target's own."""
    import asyncio

    from specdec.decode import prompt_request
    from specdec.drafters import make_drafter
    from specdec.schedules import make_schedule
    from specdec.serve.engine import Engine, Finished
    from specdec.target import make_target

    models, spec = configs(pair)
    session = Session(models)
    tokenizer = session.tokenizer("speculative")
    target = make_target(session.model(models.target))
    drafter = make_drafter(models.drafter_config, target, tokenizer)
    gate = tmp_path / "go"
    waiting = [sys.executable, "-c", f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)"]
    beside = child(session, spec, ScheduleConfig(), waiting, tmp_path)
    engine = Engine(target, drafter, make_schedule(spec, None, drafter), batch_size=2, tokenizer=tokenizer,
                    beside=beside)

    def request(prompt: str):
        ids = tokenizer(prompt).input_ids
        return prompt_request(target, ids, NEW, SamplingConfig(), frozenset(target.stop_token_ids()))

    async def run() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        engine.start()
        try:
            first = engine.submit(request(PROMPTS[0]), loop)  # decoded before the switch is due
            while not first.finished and engine.running == 0:
                await asyncio.sleep(0.01)
            gate.touch()
            beside.process.wait(30)
            later = [engine.submit(request(p), loop) for p in PROMPTS[1:]]
            results = []
            for job in (first, *later):
                while True:
                    item = await asyncio.wait_for(job.next(), 120)
                    if isinstance(item, Finished):
                        results.append(item.result.tokens)
                        break
            return results
        finally:
            engine.stop()

    results = asyncio.run(run())
    assert engine.beside is None and engine._held == []
    for prompt, tokens in zip(PROMPTS, results):
        ids, greedy = reference(pair, prompt)
        assert_same_greedy(target.model, ids, tokens, greedy)


def test_stopping_the_engine_ends_the_child(pair, tmp_path):
    from specdec.drafters import NoDrafter
    from specdec.schedules import make_schedule
    from specdec.serve.engine import Engine
    from specdec.target import make_target

    models, spec = configs(pair, speculate="off")
    session = Session(models)
    target = make_target(session.model(models.target))
    beside = child(session, spec, ScheduleConfig(), [sys.executable, "-c", "import time; time.sleep(120)"],
                         tmp_path)
    engine = Engine(target, NoDrafter(), make_schedule(spec, None, None), batch_size=2, beside=beside)
    engine.start()
    engine.stop()
    assert beside.process.poll() is not None and not beside.log.exists()


def test_the_child_imports_this_specdec_whatever_the_current_folder(tmp_path):
    """Started from a folder that holds a ``specdec/`` of its own (a clone's parent holds the clone), the compile child
    still imports the ``specdec`` the server runs: ``python -m`` would import the folder's (issue 67)."""
    decoy = tmp_path / "specdec"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("import sys\nprint('DECOY')\nsys.exit(3)\n")
    payload = json.dumps({"parent": 1})  # not this test's pid: the real child's guard exits 1 at once
    shadowed = subprocess.run([sys.executable, "-m", "specdec.serve.background", payload], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, check=False)
    assert (shadowed.returncode, shadowed.stdout.strip()) == (3, "DECOY")  # the shape of the fault
    child = subprocess.run(background.child_command(payload), cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, check=False)
    assert child.returncode == 1 and "DECOY" not in child.stdout, child.stdout + child.stderr
