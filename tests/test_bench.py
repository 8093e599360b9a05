"""The benchmark harness on a tiny random-weight pair: records, figures, outputs, and its checks.

One full run of every registered method is shared by several tests (module fixture); the rest use
a registry with only the baseline and an injected runner, so the whole file stays within seconds.
The greedy-equality check must be able to fail: a runner whose output differs is reported.
"""

from __future__ import annotations

import argparse
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tiny_models import save_tiny_pair

from specdec.bench import (
    BASELINE,
    RUNNERS,
    BenchConfig,
    RunOutput,
    build_report,
    leviathan_speedup,
    read_records,
    run_benchmark,
    write_outputs,
)
from specdec.bench.cli import config_from_args, main, register
from specdec.bench.environment import cpu_description
from specdec.bench.measure import MemoryMeter
from specdec.bench.prompts import read_jsonl
from specdec.bench.report import print_report
from specdec.bench.runners import BenchModels, DrafterCost, Meters, Setting, compare_labels, select_runners
from specdec.bench.summary import is_degenerate_loop, peer_row
from specdec.loading import load_model

PROMPTS = ["def add(a, b):", "class Point:\n    def", "for i in range(10):"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(target, drafter, prompts.jsonl) on disk."""
    root = tmp_path_factory.mktemp("bench")
    tiny = save_tiny_pair(root)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return tiny.target, tiny.drafter, prompts


def _config(pair: tuple[Path, Path, Path], **overrides: object) -> BenchConfig:
    target, drafter, prompts = pair
    base = BenchConfig(
        target=str(target), drafter=str(drafter), prompts=str(prompts), num_prompts=2, max_new_tokens=8,
        repeats=1, warmup=0, device="cpu", progress=False,
    )
    return replace(base, **overrides)


@pytest.fixture(scope="module")
def full_report(pair: tuple[Path, Path, Path]):
    """Every registered method, a gamma sweep of two values, two repeats."""
    return build_report(run_benchmark(_config(pair, gamma=(1, 3), repeats=2, warmup=1)))


class _Changed:
    """Plain decoding with its output changed by `edit`: a method the greedy check must catch."""

    group = "changed"
    description = "test runner"
    uses_gamma = speculative = needs_drafter_model = False
    cost = DrafterCost.NONE

    def __init__(self, name: str, edit) -> None:
        self.name = name
        self.edit = edit

    def run(self, models: BenchModels, input_ids: torch.Tensor, setting: Setting, meters: Meters) -> RunOutput:
        out = RUNNERS["plain"].run(models, input_ids, setting, meters)
        return replace(out, tokens=self.edit(out.tokens))


class _Broken:
    """A method that always raises."""

    name = group = "broken"
    description = "test runner"
    uses_gamma = speculative = needs_drafter_model = False
    cost = DrafterCost.NONE

    def run(self, models: BenchModels, input_ids: torch.Tensor, setting: Setting, meters: Meters) -> RunOutput:
        raise RuntimeError("this method is broken")


def test_leviathan_formula() -> None:
    assert leviathan_speedup(0.0, 4, 0.5) == pytest.approx(1 / 3)
    assert leviathan_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    alpha, gamma, c = 0.8, 3, 0.1
    assert leviathan_speedup(alpha, gamma, c) == pytest.approx((1 - alpha**4) / ((1 - alpha) * (gamma * c + 1)))


def test_method_selection() -> None:
    names = [r.name for r in select_runners(("spec", "hf-assisted"))]
    assert names == [BASELINE, "spec", "hf-assisted", "hf-assisted-default"]  # baseline always, groups expand
    assert len(select_runners(())) == len(RUNNERS)
    with pytest.raises(ValueError, match="unknown method"):
        select_runners(("fast",))


def test_command_line_quick_and_overrides() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bench", "--quick", "--gamma", "2", "8", "--temperature", "0,0.7", "--methods", "spec,plain", "--no-plots"]
    )
    config = config_from_args(args)
    assert (config.num_prompts, config.repeats, config.max_new_tokens) == (4, 1, 32)  # from --quick
    assert (config.gamma, config.temperature, config.plots) == ((2, 8), (0.0, 0.7), False)  # given flags win
    assert config.methods == ("spec", "plain")
    assert callable(args.func)
    with pytest.raises(ValueError, match="gamma"):
        BenchConfig(gamma=(0,))
    args = parser.parse_args(["bench", "--order", "method", "--compare", "a/d1", "b/d1"])
    assert (config_from_args(args).order, config_from_args(args).compare) == ("method", ("a/d1", "b/d1"))
    assert compare_labels(("a/d1", "b/d1", "code-drafter")) == ["d1", "d1#2", "code-drafter"]
    with pytest.raises(ValueError, match="order must be one of method, prompt"):
        BenchConfig(order="random")


def test_step_times_measure_each_drafter_right_after_the_target() -> None:
    """c is measured as in a round: every drafter's steps follow the target's, whatever its place."""
    from types import SimpleNamespace

    from specdec.bench.measure import Clock, step_times

    calls: list[str] = []

    class Fake(torch.nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def forward(self, input_ids, past_key_values=None, use_cache=True):
            calls.append(self.name)
            return SimpleNamespace(logits=torch.zeros(1, input_ids.shape[1], 5), past_key_values=None)

    models = [Fake("t"), Fake("d1"), Fake("d2")]
    assert len(step_times(models, torch.zeros(1, 3, dtype=torch.long), 8, Clock(torch.device("cpu")), run=2)) == 3
    timed = calls[3:]  # after one prefill per model
    assert timed == ["t", "t", "d1", "d1", "t", "t", "d2", "d2"] * 2


def test_prompt_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "x"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_jsonl(bad)
    bad.write_text('{"id": "a", "text": "x"}\n')
    with pytest.raises(TypeError, match="prompt"):
        read_jsonl(bad)


def test_memory_meter_sees_an_allocation() -> None:
    with MemoryMeter(torch.device("cpu")) as meter:
        block = torch.ones(16 * 2**20)  # 64 MiB, touched
        del block
    assert meter.reading is not None and meter.reading.growth_mib > 48


def test_full_run_records_and_figures(full_report) -> None:
    run, rows = full_report.run, full_report.rows
    by_name = {(r.method, r.gamma): r for r in rows}
    assert all(r.error is None for r in rows), [r.error for r in rows]
    # one record per (prompt, method, setting, repeat), with SpecDec++'s fields where they apply
    for block in run.blocks:
        assert len(block.records) == 2 * 2
    spec_record = next(r for b in run.blocks if b.runner.name == "spec" for r in b.records)
    assert spec_record.spec_time == spec_record.wall_time_s and spec_record.target_time is None
    assert spec_record.num_mismatched_tokens == spec_record.drafted - spec_record.accepted
    plain_record = run.blocks[0].records[0]
    assert (plain_record.target_time is not None
            and plain_record.generated_length_target == plain_record.generated_length)
    assert plain_record.num_LM_call == plain_record.generated_length  # plain-hf: one forward per token
    # greedy: every method reproduces plain-hf token for token, on every prompt
    assert all(r.greedy_equal == r.greedy_total == 2 for r in rows)
    assert full_report.ok
    # figures
    assert by_name[(BASELINE, None)].speedup == pytest.approx(1.0)
    assert by_name[("plain", None)].tau == pytest.approx(1.0)
    spec = by_name[("spec", 3)]
    assert 0.0 <= spec.alpha <= 1.0 and 1.0 <= spec.tau <= 4.0
    assert spec.forward_speedup > 1.0 and spec.cost_ratio > 0 and spec.theoretical_speedup > 0
    assert spec.efficiency == pytest.approx(spec.speedup / spec.theoretical_speedup)
    assert len(spec.acceptance_by_position) == 3
    assert spec.extra_mib is not None and spec.peak_mib > 0
    # the peer: the faster hf-assisted member at each gamma, flagged in the table
    for gamma in (1, 3):
        members = [r for r in rows if r.group == "hf-assisted" and r.gamma in (gamma, None)]
        peer = peer_row(rows, "hf-assisted", 0.0, gamma)
        assert len(members) == 2 and peer is max(members, key=lambda r: r.mean_tokens_per_s) and peer.peer
    assert {c.gamma for c in full_report.sweep} == {1, 3}
    assert {c.goal.method for c in full_report.goals} == {"spec", "plain"}


def test_outputs_written(full_report, tmp_path: Path) -> None:
    paths = write_outputs(full_report, tmp_path)
    assert {p.name for p in paths} == {
        "records.jsonl", "summary.json", "speedup_vs_gamma.png", "acceptance_by_position.png", "time_split.png",
    }
    records = read_records(tmp_path / "records.jsonl")
    assert len(records) == sum(len(b.records) for b in full_report.run.blocks)
    summary = json.loads((tmp_path / "summary.json").read_text())
    env = summary["environment"]
    assert env["torch_threads"] >= 1 and env["target"]["parameters"] > env["drafter"]["parameters"]
    assert {"torch_version", "transformers_version", "dtype", "device"} <= set(env)
    assert len(summary["rows"]) == len(full_report.rows) and summary["failures"] == []
    assert all((tmp_path / name).read_bytes()[:4] == b"\x89PNG" for name in ("time_split.png",))


def test_greedy_check_reports_a_changed_output(pair: tuple[Path, Path, Path]) -> None:
    def flip(tokens: list[int]) -> list[int]:
        return tokens[:2] + [(tokens[2] + 1) % 300] + tokens[3:]

    registry = {
        BASELINE: RUNNERS[BASELINE],
        "flipped": _Changed("flipped", flip),
        "truncated": _Changed("truncated", lambda tokens: tokens[:-1]),  # a prefix is not equal either
    }
    report = build_report(run_benchmark(_config(pair), registry=registry))
    rows = {r.method: r for r in report.rows}
    assert (rows[BASELINE].greedy_equal, rows[BASELINE].greedy_total) == (2, 2)
    assert (rows["flipped"].greedy_equal, rows["flipped"].greedy_total) == (0, 2)
    assert [m.split()[0] for m in rows["flipped"].greedy_mismatches] == ["p0@2", "p1@2"]
    assert rows["flipped"].greedy_near_ties == 0  # a real difference, not a floating-point tie
    assert rows["truncated"].greedy_equal == 0
    assert not report.ok


@pytest.mark.parametrize("order", ["method", "prompt"])
def test_timing_orders(pair: tuple[Path, Path, Path], order: str) -> None:
    """--order method: each method over all prompts in turn, repeats interleaving the methods;
    --order prompt: every method on a prompt (its repeats back to back) before the next prompt,
    the methods' order rotated per prompt."""
    log: list[tuple[str, int]] = []

    class Logged(_Changed):
        def run(self, models, input_ids, setting, meters):
            log.append((self.name, len(input_ids)))
            return super().run(models, input_ids, setting, meters)

    registry = {BASELINE: RUNNERS[BASELINE], "a": Logged("a", list), "b": Logged("b", list)}
    report = build_report(run_benchmark(_config(pair, num_prompts=3, repeats=2, order=order), registry=registry))
    n = [len(p.input_ids) for p in report.run.prompts]
    assert len(set(n)) == 3  # the prompts can be told apart by their length
    # warm-up (memory): one untimed run per block on the longest prompt, before any timed run
    assert log[:2] == [("a", max(n)), ("b", max(n))]
    if order == "method":
        expected = [("a", x) for x in n] + [("b", x) for x in n]
        expected *= 2  # the second repeat
    else:  # plain-hf is not logged; blocks rotate: [plain-hf, a, b], [a, b, plain-hf], [b, plain-hf, a]
        expected = [
            ("a", n[0]), ("a", n[0]), ("b", n[0]), ("b", n[0]),
            ("a", n[1]), ("a", n[1]), ("b", n[1]), ("b", n[1]),
            ("b", n[2]), ("b", n[2]), ("a", n[2]), ("a", n[2]),
        ]
    assert log[2:] == expected
    assert all(r.greedy_equal == 3 for r in report.rows)


def test_compared_drafters_run_beside_spec(pair: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """--compare: each extra drafter runs as spec@<folder>, with its own forwards, cost ratio and memory."""
    drafter = pair[1]
    other = tmp_path / "noisy"  # the drafter with perturbed weights: other drafts
    model = load_model(str(drafter), device="cpu")
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5 * param.std() * torch.randn(param.shape, generator=generator))
    model.save_pretrained(other)
    same = tmp_path / "same"  # the run's own drafter under a second name: the same figures as spec
    same.mkdir()
    for f in drafter.iterdir():
        (same / f.name).write_bytes(f.read_bytes())
    config = _config(pair, methods=("plain-hf", "spec"), compare=(str(same), str(other)), gamma=(3,))
    report = build_report(run_benchmark(config))
    rows = {r.method: r for r in report.rows}
    assert set(rows) == {BASELINE, "spec", "spec@same", f"spec@{other.name}"}
    spec, twin, rival = rows["spec"], rows["spec@same"], rows[f"spec@{other.name}"]
    assert (twin.tau, twin.alpha) == (spec.tau, spec.alpha)
    assert rival.alpha != spec.alpha  # its own drafts, counted by its own meter
    assert all(r.greedy_equal == r.greedy_total == 2 for r in rows.values())
    assert twin.cost_ratio is not None and rival.cost_ratio is not None and rival.extra_mib is not None
    assert set(report.run.environment.compared) == {"same", other.name}
    rival_record = next(r for b in report.run.blocks if b.runner.name == rival.method for r in b.records)
    assert rival_record.drafter_calls > 0


def test_drafters_reading_the_targets_features_run_as_spec_and_compared(pair: tuple[Path, Path, Path],
                                                                        tmp_path: Path) -> None:
    """A feature drafter and a parallel drafter (no step of their own: they read the target's features) run as
    --drafter and as --compare (behind prompt lookup too), their cost ratio from the drafting time the runs measure,
    every output exact."""
    from specdec.drafters.feature_model import new_feature_drafter
    from specdec.drafters.parallel_model import new_parallel_drafter

    target = load_model(str(pair[0]), device="cpu")
    new_feature_drafter(target).save_pretrained(tmp_path / "feature")
    new_parallel_drafter(target, block_size=3).save_pretrained(tmp_path / "parallel")
    config = _config(pair, methods=("plain-hf", "spec", "spec-lookup"), drafter=str(tmp_path / "feature"),
                     compare=(str(tmp_path / "parallel"),), gamma=(3,))
    report = build_report(run_benchmark(config))
    rows = {r.method: r for r in report.rows}
    assert set(rows) == {BASELINE, "spec", "spec-lookup", "spec@parallel", "spec-lookup@parallel"}
    assert all(r.greedy_equal == r.greedy_total == 2 for r in rows.values())
    assert rows["spec"].cost_ratio is not None and rows["spec@parallel"].cost_ratio is not None
    assert report.run.drafter_step_s is None and report.run.compared_step_s == {}
    text = io.StringIO()
    print_report(report, Console(file=text, width=300))
    assert "drafts from the target's features" in text.getvalue()


def test_a_compared_drafter_behind_lookup_takes_autos_form_there(pair: tuple[Path, Path, Path]) -> None:
    """spec@LABEL drafts with the compared drafter in the run's form (auto: int8 on a CPU with int8 kernels), and
    spec-lookup@LABEL with the form auto gives behind prompt lookup (the model as loaded), as for the run's own."""
    from specdec.bench.runners import compared_runners
    from specdec.drafters.model import drafter_in, int8_available

    if not int8_available():
        pytest.skip("this torch build has no int8 CPU kernels")
    model = load_model(str(pair[1]), device="cpu")
    spec, lookup = compared_runners(["x"], select_runners(("spec", "spec-lookup")))
    models = BenchModels(target=model, drafter=None, stop_token_ids=[], compared={"x": drafter_in(model, "auto")},
                         forms={"x": "auto"}, compared_sources={"x": model})
    assert (spec.name, lookup.name) == ("spec@x", "spec-lookup@x")
    assert models.drafter_for(spec) is models.compared["x"] is not model and models.drafter_for(lookup) is model


def test_trees_run_beside_spec(pair: tuple[Path, Path, Path]) -> None:
    """--trees: spec again with a token tree of each size, as spec-tree<N>, every greedy output equal."""
    config = _config(pair, methods=("plain-hf", "spec"), trees=(1, 6), gamma=(3,))
    rows = {r.method: r for r in build_report(run_benchmark(config)).rows}
    assert set(rows) == {BASELINE, "spec", "spec-tree1", "spec-tree6"}
    assert all(r.greedy_equal == r.greedy_total == 2 for r in rows.values())
    with pytest.raises(ValueError, match="trees must be node counts >= 1"):
        _config(pair, trees=(0,))


def test_a_failing_method_is_reported_not_fatal(pair: tuple[Path, Path, Path], capsys) -> None:
    registry = {BASELINE: RUNNERS[BASELINE], "broken": _Broken(), "plain": RUNNERS["plain"]}
    report = build_report(run_benchmark(_config(pair, warmup=1), registry=registry))
    rows = {r.method: r for r in report.rows}
    assert rows["broken"].error == "RuntimeError: this method is broken" and rows["broken"].runs == 0
    assert rows["plain"].error is None and rows["plain"].runs == 2 and rows["plain"].greedy_equal == 2
    assert not report.ok
    from rich.console import Console

    print_report(report, Console(width=200))
    assert "broken T=0 failed" in capsys.readouterr().out


def test_degenerate_loop_detection() -> None:
    assert is_degenerate_loop([7] * 24) and is_degenerate_loop(list(range(10)) + [3, 4, 5] * 10)
    assert not is_degenerate_loop(list(range(64)))
    assert not is_degenerate_loop([7] * 23)  # too short to call a loop
    assert not is_degenerate_loop([7] * 40 + [1, 2])  # a loop that was left is not the output's end
    assert not is_degenerate_loop(list(range(17)) * 3)  # period 17: longer than max_period


def test_speedup_without_loops_leaves_out_the_looping_prompts(pair: tuple[Path, Path, Path]) -> None:
    run = run_benchmark(_config(pair), registry={BASELINE: RUNNERS[BASELINE], "plain": RUNNERS["plain"]})
    loop, fresh = [7, 8] * 16, list(range(32))
    speed = {(BASELINE, "p0"): 10.0, (BASELINE, "p1"): 10.0, ("plain", "p0"): 40.0, ("plain", "p1"): 15.0}
    for block in run.blocks:  # p0's plain-hf output loops; plain is fast there, less so on p1
        block.records = [
            replace(r, tokens=loop if r.prompt_id == "p0" else fresh,
                    tokens_per_s=speed[block.runner.name, r.prompt_id])
            for r in block.records
        ]
    report = build_report(run)
    rows = {r.method: r for r in report.rows}
    assert rows["plain"].speedup == pytest.approx((40 + 15) / 2 / 10)
    assert rows["plain"].speedup_non_loop == pytest.approx(1.5)
    assert rows["plain"].loop_prompts == rows[BASELINE].loop_prompts == 1
    assert rows[BASELINE].speedup_non_loop == pytest.approx(1.0)
    (goal,) = [c for c in report.goals if c.goal.method == "plain"]
    assert goal.ratio == pytest.approx(2.75) and goal.ratio_non_loop == pytest.approx(1.5)


def test_sampling_is_not_compared_token_for_token(pair: tuple[Path, Path, Path]) -> None:
    report = build_report(run_benchmark(_config(pair, methods=("spec",), temperature=(1.0,), num_prompts=1)))
    assert [r.method for r in report.rows] == [BASELINE, "spec"]
    assert all(r.greedy_total is None and r.runs == 1 for r in report.rows)
    assert report.goals == []  # the goals are greedy figures


def test_command_writes_outputs(pair: tuple[Path, Path, Path], tmp_path: Path) -> None:
    target, drafter, prompts = pair
    status = main([
        "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts), "--quick",
        "--methods", "ngram", "--num-prompts", "1", "--max-new-tokens", "4", "--warmup", "0",
        "--no-plots", "--no-progress", "--output", str(tmp_path),
    ])
    assert status == 0
    assert (tmp_path / "records.jsonl").exists() and (tmp_path / "summary.json").exists()
    assert main(["--target", str(tmp_path / "missing"), "--no-progress"]) == 2


def test_matmul_probe_layouts_compute_the_same_product(pair: tuple[Path, Path, Path], capsys) -> None:
    from specdec.bench import matmul

    target, _, _ = pair
    w, x = torch.randn(48, 32), torch.randn(5, 32)
    torch.testing.assert_close(torch.nn.functional.linear(x, w), (w @ x.T).T)
    model = load_model(str(target), dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        stock = model(ids).logits
        with matmul.gemm_layout(model):
            gemm = model(ids).logits
            single = model(ids[:, :1]).logits  # one row: padded to two inside
            assert all("forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear))
        torch.testing.assert_close(gemm, stock, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(single, stock[:, :1], rtol=1e-4, atol=1e-4)
        assert not any("forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear))
        head = model.get_output_embeddings()
        head.forward = hooked = head.forward  # an instance-level forward, as accelerate's hooks set
        with matmul.gemm_layout(model):
            assert head.forward is not hooked
        assert vars(head)["forward"] is hooked  # put back, not deleted
    rows = matmul.probe(model, (1, 3), repeats=2, context=4)
    assert set(rows) == {1, 3}
    assert all(ms > 0 for row in rows.values() for ms in row.values())
    matmul.main(["--model", str(target), "--lengths", "1", "2", "--repeats", "1"])
    assert "linear / W @ x.T" in capsys.readouterr().out


def test_batch_sweep_runs_every_method_at_every_batch_size(pair: tuple[Path, Path, Path], tmp_path: Path) -> None:
    from specdec.bench.batched import BASELINE as HF
    from specdec.bench.batched import print_sweep, run_sweep, sweep_goals, write_sweep

    config = _config(pair, num_prompts=3, batch_sizes=(1, 2), output=str(tmp_path), repeats=2)
    run = run_sweep(config)
    assert {(c.method, c.batch) for c in run.cells} == {
        (m, b) for m in (HF, "spec", "plain", "spec-lookup", "auto") for b in (1, 2)}
    for cell in run.cells:
        assert len(cell.wall_s) == 2 and cell.tokens == 3 * 8 and cell.compared == 3
        assert cell.equal + cell.ties == 3  # greedy: every row equals the target alone (or a near tie)
        assert 0 <= cell.bookkeeping < 1
        if cell.method in (HF, "plain"):
            assert cell.tau == 1.0 and cell.alpha is None
        if cell.method == "spec":
            assert cell.tau > 1.0 and cell.alpha is not None
    assert set(run.crossover) <= {1, 2}  # auto measured at the batch sizes it saw (rows leave: 1 too)
    names = [g.name for g in sweep_goals(run)]
    assert "spec-lookup / hf at B=1" in names and "auto / best of plain, spec-lookup at B=2" in names
    paths = write_sweep(run, tmp_path)
    assert json.loads(paths[0].read_text())["cells"][0]["method"] == run.cells[0].method
    assert paths[1].stat().st_size > 1000
    console = Console(record=True, width=200)
    print_sweep(run, console)
    assert "goal spec-lookup / hf at B=1" in console.export_text()
    only_on = run_sweep(replace(config, speculate=("on",), batch_sizes=(2,), repeats=1))
    assert {c.method for c in only_on.cells} == {HF, "spec", "spec-lookup"}


def test_the_cpu_is_described_by_the_features_that_decide_its_kernels() -> None:
    block = ("processor\t: {n}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: {model}\n"
             "model name\t: Intel(R) Xeon(R) Processor @ 2.50GHz\nstepping\t: {stepping}\nflags\t\t: {flags}\n\n")
    cascade = "fpu sse2 avx2 avx512f avx512_vnni"
    sapphire = "fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8"
    one = (block.format(n=0, model=85, stepping=7, flags=cascade)
           + block.format(n=1, model=85, stepping=7, flags=cascade))
    other = block.format(n=0, model=143, stepping=8, flags=sapphire)
    assert cpu_description(one) == "Intel(R) Xeon(R) Processor @ 2.50GHz; 6/85/7; avx2 avx512f avx512_vnni"
    assert cpu_description(other) == ("Intel(R) Xeon(R) Processor @ 2.50GHz; 6/143/8; avx2 avx512f avx512_vnni "
                                      "avx512_bf16 amx_int8 amx_bf16")
    assert cpu_description("processor\t: 0\nBogoMIPS\t: 50.00\n") is None  # no model name: the caller's fallback
