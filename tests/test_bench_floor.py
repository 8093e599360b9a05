"""The bench against the floor and the peers (issue 28, item 6), on tiny random-weight models.

1. ``weight_pass`` applies every linear layer once per pass (counted by hooks: nn.Linear, GPT-2's
   Conv1D, an int8 drafter's quantised layers) and counts exactly their weight bytes.
2. ``floor_rows``: each method's ms per token is the median over prompts of its per-prompt median,
   divided by the weight pass and by the fastest exact plain engine; a method whose output differs
   is not exact and is not the fastest.
3. Peers: a registered peer runs as a method (greedy only), checked against generate like ours; a
   peer that is unknown or not installed is refused before anything loads, naming what to install;
   CTranslate2, where installed, converts the tiny target and gives generate's tokens (else its
   refusal is what is tested).
4. llama.cpp: ``--peers llamacpp`` runs its six configurations (f32, q8_0, each with and without
   its prompt lookup, the lookups speculative; q4_0 and q4_k_m quantized by llama.cpp), refused with every
   missing package named; the GGUF driver lets through exactly GPT-2's pre-tokenizer; where llama-cpp-python
   is installed its f32 configurations give generate's tokens on the tiny target (else its refusal is what is tested); a
   lossy peer (q8_0: other weights) that differs is counted and reported without failing the run.
5. The floor gives each plain form the bytes it reads (the target's pass, a peer's own GGUF weights) and its time
   over reading them; a GGUF file's bytes leave out the token embedding's gather unless the head is tied to it.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import build_tiny
from tiny_models import save_tiny_pair

from specdec import compiled, kernels
from specdec.bench import BenchConfig, build_report, peers, run_benchmark
from specdec.bench.cli import main
from specdec.bench.floor import PassMeter, floor_rows, linear_layers, pass_over, weight_pass
from specdec.bench.gguf_driver import gpt2_pre_tokenizer
from specdec.bench.peers import (
    LLAMA_CPP_SOURCE_ENV,
    PEER_GROUPS,
    PEERS,
    Peer,
    check_peers,
    llama_cpp_source,
)
from specdec.bench.report import floor_table, summary_dict
from specdec.bench.runners import peer_runners
from specdec.drafters.model import drafter_in, int8_available

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("floor")
    tiny = save_tiny_pair(root)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(["def add(a, b):", "for i in range(10):", "class Point:"])))
    return tiny, prompts


def _config(pair, **overrides) -> BenchConfig:
    tiny, prompts = pair
    base = BenchConfig(target=str(tiny.target), drafter=str(tiny.drafter), prompts=str(prompts), num_prompts=3,
                       max_new_tokens=8, repeats=2, warmup=1, device="cpu", progress=False, gamma=(3,),
                       methods=("plain-hf", "plain", "spec"))
    return replace(base, **overrides)


def _counted_pass(model: torch.nn.Module, passes: int) -> tuple[int, int]:
    """(calls of the layers linear_layers finds during weight_pass, those layers)."""
    layers = [m for m, _ in linear_layers(model)]
    calls = []
    handles = [m.register_forward_hook(lambda *_: calls.append(1)) for m in layers]
    try:
        weight_pass(model, passes=passes)
    finally:
        for h in handles:
            h.remove()
    return len(calls), len(layers)


@pytest.mark.skipif(kernels.blocked() is None, reason="the blocked kernel needs a C compiler (Linux)")
def test_the_weight_pass_counts_the_copies_the_kernels_read(monkeypatch) -> None:
    """A model whose layers take the blocked kernel reads its copies, in bfloat16 pairs where every weight is a
    bfloat16 number: the pass counts those bytes (about half the float32 weights'), not the weights'."""
    monkeypatch.setenv(kernels.ENV, "on")
    model = build_tiny("llama", seed=0, layers=2)
    float32_bytes = weight_pass(model, passes=1).bytes
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    assert kernels.install(model) and kernels.describe(model) == "specdec blocked, every row count"
    reading = weight_pass(model, passes=1)
    copies = [m._specdec_packed.weight for m, _ in linear_layers(model)]
    assert all(c is not None and c.dtype == torch.bfloat16 for c in copies)
    assert reading.bytes == sum(c.numel() * c.element_size() for c in copies)
    assert float32_bytes / 2 <= reading.bytes < 0.6 * float32_bytes  # pairs of blocks, an odd one padded
    if compiled.trace_kernels(model) and kernels.blocked_op():  # compiled: the operator's copies, eager rows too
        assert weight_pass(model, passes=1).bytes == sum(m._specdec_blocked.nbytes for m, _ in linear_layers(model))


@pytest.mark.parametrize("arch, per_layer", [("llama", 7), ("gpt2", 4)])
def test_weight_pass_reads_every_linear_weight_once(arch: str, per_layer: int) -> None:
    model = build_tiny(arch, seed=0, layers=2)
    calls, layers = _counted_pass(model, passes=3)
    assert layers == 2 * per_layer + 1  # every block's projections and the head
    assert calls == layers * (3 + 2)  # each once per pass, two untimed passes first
    reading = weight_pass(model, passes=3)
    head = model.get_output_embeddings().weight
    projections = [p for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n and "wpe" not in n
                   and "embed" not in n and "lm_head" not in n]
    assert reading.bytes == 4 * (head.numel() + sum(p.numel() for p in projections))
    assert reading.layers == layers and reading.seconds > 0 and reading.gb_per_s > 0
    meter = PassMeter(model, passes=2)
    assert meter.reading().bytes == reading.bytes and len(meter.readings) == 1  # one sample when none was taken
    meter.sample()
    meter.sample()
    assert meter.reading().seconds == statistics.median(r.seconds for r in meter.readings)


@pytest.mark.skipif(not int8_available(), reason="this torch build has no int8 CPU kernels")
def test_weight_pass_of_an_int8_drafter_reads_its_int8_weights() -> None:
    model = build_tiny("llama", seed=0, layers=1)
    int8 = drafter_in(model, "int8")
    calls, layers = _counted_pass(int8, passes=2)
    assert layers == 8 and calls == 8 * 4
    assert weight_pass(int8, passes=2).bytes * 4 == weight_pass(model, passes=2).bytes  # 1 byte a weight, not 4


@pytest.mark.parametrize("to", ["int8", "int4"])
def test_weight_pass_of_a_torchao_model_counts_its_stored_bytes(to: str) -> None:
    from torchao.quantization import quantize_

    from specdec.quantized import torchao_config

    model = build_tiny("llama", seed=0, layers=1).float()
    plain = weight_pass(model, passes=1).bytes
    quantize_(model, torchao_config(to, 32 if to == "int4" else None))
    rows_and_columns = sum(m.weight.numel() for m, _ in linear_layers(model))  # one integer a weight, in a byte
    scales = sum(m.weight.shape[0] * (m.weight.shape[1] // 32 if to == "int4" else 1) for m, _ in linear_layers(model))
    read = weight_pass(model, passes=1).bytes
    assert rows_and_columns == plain // 4  # float32 before
    assert rows_and_columns + 4 * scales <= read <= rows_and_columns + 5 * scales  # + float32 scales (+ int8 zeros)


class _HFGreedy:
    """A peer engine built on the model's own generate (the plumbing without a third-party engine)."""

    def __init__(self, target, threads: int, edit=lambda tokens: tokens) -> None:
        self.target, self.edit = target, edit
        self.threads = threads

    def generate(self, ids, max_new_tokens, stop):
        out = self.target.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                   eos_token_id=list(stop) or None, pad_token_id=0,
                                   attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        return self.edit(out[0, len(ids):].tolist())


@pytest.fixture
def fake_peers(monkeypatch):
    monkeypatch.setitem(PEERS, "same", Peer("same", "torch", "torch", "generate again", _HFGreedy))
    monkeypatch.setitem(PEERS, "off", Peer("off", "torch", "torch", "generate, last token changed",
                                           lambda t, n: _HFGreedy(t, n, lambda x: x[:-1] + [(x[-1] + 1) % 50])))
    monkeypatch.setitem(PEERS, "lossy", Peer("lossy", "torch", "torch", "other weights, last token changed",
                                             lambda t, n: _HFGreedy(t, n, lambda x: x[:-1] + [(x[-1] + 1) % 50]),
                                             lossy=True))
    monkeypatch.setitem(PEERS, "absent", Peer("absent", "specdec_no_such_engine", "no-such-engine", "missing",
                                              _HFGreedy))


def test_floor_rows_and_peers_in_a_run(pair, fake_peers) -> None:
    report = build_report(run_benchmark(_config(pair, peers=("same", "off"), temperature=(0.0, 1.0))))
    run = report.run
    assert run.target_pass is not None and run.drafter_pass is not None
    blocks = {(b.runner.name, b.setting.temperature): b for b in run.blocks}
    assert ("same", 1.0) not in blocks and ("same", 0.0) in blocks  # peers run greedy only
    rows = {r.method: r for r in report.rows if r.temperature == 0.0}
    assert rows["same"].greedy_equal == rows["same"].greedy_total == 3
    assert rows["off"].greedy_equal == 0  # the check catches a peer that differs
    floor = {r.method: r for r in floor_rows(run.blocks, run.target_pass)}
    assert set(floor) == {"plain-hf", "plain", "spec γ=3", "same", "off"}
    for name, block in (("plain", blocks[("plain", 0.0)]), ("same", blocks[("same", 0.0)])):
        per_prompt = {}
        for r in block.records:
            per_prompt.setdefault(r.prompt_id, []).append(r.wall_time_s / r.generated_length)
        expected = 1e3 * statistics.median(statistics.median(v) for v in per_prompt.values())
        assert floor[name].ms_per_token == pytest.approx(expected)
        assert floor[name].over_weight_pass == pytest.approx(expected / (1e3 * run.target_pass.seconds))
    assert floor["spec γ=3"].speculative and not floor["plain"].speculative
    assert not floor["off"].exact and floor["same"].exact
    fastest = min(r.ms_per_token for r in floor.values() if r.exact and not r.speculative)
    assert min(r.over_fastest for r in floor.values() if r.exact and not r.speculative) == pytest.approx(1.0)
    assert floor["off"].over_fastest == pytest.approx(floor["off"].ms_per_token / fastest)
    summary = summary_dict(report)["floor"]
    assert summary["target_pass"]["bytes"] == run.target_pass.bytes
    assert {r["method"] for r in summary["rows"]} == set(floor)
    assert floor_table(run) is not None and not report.ok  # "off" differs


def test_a_lossy_peer_that_differs_is_reported_not_failed(pair, fake_peers) -> None:
    report = build_report(run_benchmark(_config(pair, methods=("plain-hf",), peers=("lossy",), repeats=1)))
    row = next(r for r in report.rows if r.method == "lossy")
    assert row.greedy_equal == 0 and row.greedy_total == 3  # the difference is counted
    assert not next(r for r in floor_rows(report.run.blocks, report.run.target_pass) if r.method == "lossy").exact
    assert report.ok  # but does not fail the run, as the "off" peer (not lossy) does above


def test_a_peer_not_installed_or_unknown_is_refused_before_loading(pair, fake_peers, tmp_path: Path, capsys) -> None:
    with pytest.raises(ValueError, match=r"peer 'absent' needs the package no-such-engine, which is not installed: "
                                         r"pip install no-such-engine \(or pip install 'specdec\[peers\]'\)"):
        check_peers(["absent"])
    with pytest.raises(ValueError, match="unknown peer 'tgi': choose from "):
        check_peers(["tgi"])
    missing = _config(pair, target=str(tmp_path / "no-model"), peers=("absent",))
    with pytest.raises(ValueError, match="peer 'absent' needs"):  # before the missing target is loaded
        run_benchmark(missing)
    tiny, prompts = pair  # the command line: refused before the models load (they would run a bench otherwise)
    assert main(["--target", str(tiny.target), "--drafter", str(tiny.drafter), "--prompts", str(prompts),
                 "--peers", "absent", "--no-progress", "--no-plots", "--output", str(tmp_path / "out")]) == 2
    assert "peer 'absent' needs the package no-such-engine" in capsys.readouterr().err
    # a --target that is not there is said first, before torch is imported (tests/test_imports.py)
    assert main(["--target", str(tmp_path / "no-model"), "--peers", "absent", "--no-progress"]) == 2
    assert "model path" in capsys.readouterr().err


def test_ctranslate2_gives_generates_tokens_or_is_refused(pair) -> None:
    config = _config(pair, methods=("plain-hf",), peers=("ctranslate2",), repeats=1)
    if importlib.util.find_spec("ctranslate2") is None:
        with pytest.raises(ValueError, match="pip install ctranslate2"):
            run_benchmark(config)
        return
    report = build_report(run_benchmark(config))
    row = next(r for r in report.rows if r.method == "ctranslate2")
    assert row.error is None and row.greedy_equal == row.greedy_total == 3


def test_llamacpp_runs_its_six_configurations(pair, monkeypatch) -> None:
    members = PEER_GROUPS["llamacpp"]
    assert set(members) == {"llamacpp-f32", "llamacpp-q8_0", "llamacpp-f32-lookup", "llamacpp-q8_0-lookup",
                            "llamacpp-q4_0", "llamacpp-q4_k_m"}
    for name in members:  # the registered ones: llama_cpp and the converter's packages, lookup speculative
        peer = PEERS[name]
        assert peer.module == "llama_cpp" and peer.package == "llama-cpp-python"
        assert {p for _, p in peer.needs} == {"gguf", "sentencepiece"}
        assert peer.speculative == name.endswith("-lookup") and peer.lossy == (name != "llamacpp-f32"
                                                                                and "f32-" not in name)
    for name in members:  # the same plumbing with generate as the engine
        monkeypatch.setitem(PEERS, name, replace(PEERS[name], module="torch", needs=(), build=_HFGreedy,
                                                 converts=False))
    assert [r.name for r in peer_runners(["llamacpp", "llamacpp-f32"])] == list(members)  # each once
    report = build_report(run_benchmark(_config(pair, methods=("plain-hf", "plain"), peers=("llamacpp",))))
    rows = {r.method: r for r in report.rows}
    for name in members:
        assert rows[name].error is None and rows[name].greedy_equal == rows[name].greedy_total == 3
    floor = {r.method: r for r in floor_rows(report.run.blocks, report.run.target_pass)}
    assert {name: floor[name].speculative for name in members} == {name: name.endswith("-lookup") for name in members}
    plain = [r.ms_per_token for r in floor.values() if not r.speculative]
    assert min(r.over_fastest for r in floor.values() if not r.speculative) == pytest.approx(1.0)
    lookup = floor["llamacpp-f32-lookup"]
    assert lookup.over_fastest == pytest.approx(lookup.ms_per_token / min(plain))  # against plain engines only
    assert lookup.bytes_per_token is None and lookup.over_own_bytes is None  # a speculative step reads more


class _Quantized(_HFGreedy):
    bytes_read = 1000  # a peer whose form reads fewer bytes than the target's weights (a quantized GGUF file)


def test_the_floor_gives_each_plain_form_its_own_bytes(pair, monkeypatch) -> None:
    monkeypatch.setitem(PEERS, "small", Peer("small", "torch", "torch", "reads 1000 bytes", _Quantized, lossy=True))
    report = build_report(run_benchmark(_config(pair, methods=("plain", "spec"), peers=("small",), repeats=1)))
    run = report.run
    floor = {r.method: r for r in floor_rows(run.blocks, run.target_pass)}
    assert floor["plain"].bytes_per_token == run.target_pass.bytes  # our plain step reads the target's weights
    assert floor["plain"].over_own_bytes == pytest.approx(floor["plain"].over_weight_pass)
    assert floor["small"].bytes_per_token == 1000  # the peer's own form, not the target's
    seconds_a_byte = run.target_pass.seconds / run.target_pass.bytes
    assert floor["small"].over_own_bytes == pytest.approx(floor["small"].ms_per_token / (1e3 * 1000 * seconds_a_byte))
    assert floor["spec γ=3"].bytes_per_token is None
    table = floor_table(run)
    assert table is not None and [c.header for c in table.columns][-2:] == ["MiB read", "× its own bytes"]


def test_converting_peers_read_the_peer_source(pair, monkeypatch, tmp_path: Path) -> None:
    tiny, _ = pair
    seen = []

    def build(target, threads, source=None):
        seen.append(peers.converted_folder(target, source))
        return _HFGreedy(target, threads)

    monkeypatch.setitem(PEERS, "conv", Peer("conv", "torch", "torch", "converts", build, converts=True))
    run_benchmark(_config(pair, methods=("plain-hf",), peers=("conv",), repeats=1))
    run_benchmark(_config(pair, methods=("plain-hf",), peers=("conv",), repeats=1, peer_source=str(tiny.drafter)))
    assert seen == [str(tiny.target), str(tiny.drafter)]  # the target's own folder, else --peer-source
    quantized = build_tiny("llama", seed=0, layers=1)
    quantized.config.quantization_config = {"quant_method": "torchao"}
    with pytest.raises(ValueError, match="the target is quantized, .* give its float source with --peer-source DIR"):
        peers.converted_folder(quantized, None)


def test_a_gguf_files_bytes_a_step_reads(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    if importlib.util.find_spec("gguf") is None:  # the floor then leaves a peer's bytes unknown
        path.write_bytes(b"GGUF")
        assert peers.gguf_bytes_read(path) is None
        return
    import numpy as np
    from gguf import GGUFWriter

    def write(names: list[str]) -> int:
        writer = GGUFWriter(str(path), "llama")
        for name in names:
            writer.add_tensor(name, np.ones((16, 32), dtype=np.float32))
        writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))  # a norm: one dimension
        for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
            step()
        writer.close()
        return peers.gguf_bytes_read(path)

    matrix = 16 * 32 * 4
    assert write(["token_embd.weight", "blk.0.attn_q.weight", "output.weight"]) == 2 * matrix  # the gather left out
    assert write(["token_embd.weight", "blk.0.attn_q.weight"]) == 2 * matrix  # tied: the head reads the embedding


def test_a_peer_names_every_package_it_misses(monkeypatch) -> None:
    monkeypatch.setitem(PEERS, "conv", Peer("conv", "torch", "torch", "a converter missing", _HFGreedy,
                                            needs=(("specdec_no_such_a", "no-such-a"),)))
    monkeypatch.setitem(PEERS, "both", Peer("both", "specdec_no_such_engine", "no-such-engine", "both missing",
                                            _HFGreedy, needs=(("torch", "torch"), ("specdec_no_such_b", "no-such-b"))))
    with pytest.raises(ValueError, match=r"peer 'conv' needs the package no-such-a, which is not installed: "
                                         r"pip install no-such-a \(or"):
        check_peers(["conv"])
    with pytest.raises(ValueError, match=r"peer 'both' needs the packages no-such-engine, no-such-b, which are not "
                                         r"installed: pip install no-such-engine no-such-b \(or"):
        check_peers(["both"])


def test_the_gguf_driver_lets_through_gpt2s_pre_tokenizer_only(pair, tmp_path: Path) -> None:
    tiny, _ = pair
    assert gpt2_pre_tokenizer(tiny.target)  # our trainer's byte-level BPE: GPT-2's pre-tokenization
    spec = json.loads((tiny.target / "tokenizer.json").read_text())
    for name, edit in [("normalizer", {"normalizer": {"type": "NFC"}}),
                       ("metaspace", {"pre_tokenizer": {"type": "Metaspace", "replacement": "▁"}}),
                       ("prefix", {"pre_tokenizer": {**spec["pre_tokenizer"], "add_prefix_space": True}}),
                       ("no-regex", {"pre_tokenizer": {**spec["pre_tokenizer"], "use_regex": False}})]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(json.dumps({**spec, **edit}))
        assert not gpt2_pre_tokenizer(tmp_path / name), name
    assert not gpt2_pre_tokenizer(tmp_path)  # no tokenizer.json


def test_llama_cpp_source_from_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(LLAMA_CPP_SOURCE_ENV, str(tmp_path))
    with pytest.raises(ValueError, match=f"{LLAMA_CPP_SOURCE_ENV}=.* has no convert_hf_to_gguf.py"):
        llama_cpp_source()
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    assert llama_cpp_source() == tmp_path


def test_a_llama_cpp_crash_is_caught_in_a_child_and_its_extra_buffers_left_out(tmp_path: Path, monkeypatch) -> None:
    """llama.cpp's crash (a signal, not an exception) is caught in a child process before the bench's own process
    loads the file: where it crashes with its extra buffer types (AMX int8 repacking, on an Intel Xeon of this
    project) and not without, the peer runs without them; where it crashes either way, its block fails."""
    import subprocess


    runs: list[list[str]] = []
    crash_with = {"1"}  # the extra-buffer flags a fake llama.cpp crashes with

    def fake_run(command, **kwargs):
        runs.append(command)
        return subprocess.CompletedProcess(command, -11 if command[-1] in crash_with else 0, "", "")

    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    monkeypatch.setattr(peers, "_EXTRA_BUFFERS", {})
    path = tmp_path / "model.gguf"
    assert peers.extra_buffers(path, "q8_0") is False
    assert [r[-2:] for r in runs] == [[str(path), "1"], [str(path), "0"]]
    assert runs[0][1] == str(Path(peers.__file__).with_name("llama_params.py"))  # the check's own process
    assert peers.extra_buffers(path, "q8_0") is False and len(runs) == 2  # checked once per file
    crash_with.clear()
    assert peers.extra_buffers(tmp_path / "f32.gguf", "f32") is True and len(runs) == 3
    crash_with.update({"0", "1"})
    with pytest.raises(RuntimeError, match=r"llama.cpp crashed \(SIGSEGV\) decoding the q8_0 model without its extra"):
        peers.extra_buffers(tmp_path / "other.gguf", "q8_0")
    monkeypatch.setattr(peers.subprocess, "run",
                        lambda command, **kw: subprocess.CompletedProcess(command, 1, "", "ValueError: Failed to load"))
    with pytest.raises(RuntimeError, match="llama.cpp failed decoding the f32 model: ValueError: Failed to load"):
        peers.extra_buffers(tmp_path / "broken.gguf", "f32")


def test_llamacpp_gives_generates_tokens_or_is_refused(pair) -> None:
    config = _config(pair, methods=("plain-hf",), peers=("llamacpp",), repeats=1)
    if any(importlib.util.find_spec(m) is None for m in ("llama_cpp", "gguf", "sentencepiece")):
        with pytest.raises(ValueError, match=r"peer 'llamacpp' needs .*pip install .*\(or pip install "
                                             r"'specdec\[peers\]'\)"):
            run_benchmark(config)
        return
    report = build_report(run_benchmark(config))
    rows = {r.method: r for r in report.rows}
    for name in PEER_GROUPS["llamacpp"]:
        assert rows[name].error is None and rows[name].greedy_total == 3, name  # converted, loaded, compared
    for name in ("llamacpp-f32", "llamacpp-f32-lookup"):  # float32 as ours: the same tokens
        assert rows[name].greedy_equal == 3, name
    for block in report.run.blocks:  # rounds counted as the engine's forwards: one a token unless it drafts
        for r in block.records if block.runner.name.startswith("llamacpp") else ():
            assert (r.rounds <= r.generated_length) if block.runner.speculative else (r.rounds == r.generated_length)
    from specdec.bench.peers import LlamaCppEngine
    from specdec.loading import load_model

    target = load_model(str(pair[0].target), device="cpu")
    engine = LlamaCppEngine(target, 1, "f32", lookup=True)
    ids = torch.randint(3, target.config.vocab_size, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    tokens = engine.generate(ids, 12, [])  # past llama-cpp-python's 512-row batch: its logits kept for all
    assert tokens == _HFGreedy(target, 1).generate(ids, 12, [])
    with pytest.raises(ValueError, match="exceed the llama.cpp peer's context of .* --max-new-tokens"):
        engine.generate(ids, engine.context, [])


def test_the_drafter_pass_is_also_timed_after_the_target_steps(pair) -> None:
    """The drafter's pass in a round: runs of passes right after runs of the target's steps, as its step is timed;
    reported beside the warm pass, with the step over each."""
    from specdec.bench import measure
    from specdec.loading import load_model

    order: list[str] = []
    target = load_model(str(pair[0].target))
    drafter = load_model(str(pair[0].drafter))
    target.register_forward_pre_hook(lambda module, args: order.append("target"))
    one_pass, read, _layers = pass_over(drafter)
    clock = measure.Clock(torch.device("cpu"))
    times = measure.step_times([target], torch.tensor([[3, 4, 5]]), 8, clock, run=4,
                               passes=[lambda: (order.append("pass"), one_pass())])
    assert len(times) == 2 and all(t > 0 for t in times)  # the target's step, then the pass
    assert order == ["target"] + (["target"] * 8 + ["pass"] * 4) * 2  # the prefill; each pass run after 4 steps
    assert read == weight_pass(drafter).bytes
    assert len(measure.step_times([target], torch.tensor([[3]]), 8, clock)) == 1  # no passes: the steps alone
    report = build_report(run_benchmark(_config(pair, methods=("plain-hf", "spec"), repeats=1)))
    run = report.run
    assert run.drafter_round_pass_s is not None and run.drafter_round_pass_s > 0
    floor = summary_dict(report)["floor"]
    assert floor["drafter_step_over_round_pass"] == pytest.approx(run.drafter_step_s / run.drafter_round_pass_s)
    table = floor_table(run)
    assert any("after the target's steps" in str(cell) for cell in table.columns[0]._cells)
