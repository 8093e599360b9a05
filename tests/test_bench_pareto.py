"""SpecDec++'s schedule sweep (``specdec/bench/pareto.py``, `specdec bench --pareto`).

- The calibration pairs: the head's value behind each draft against the draft's verdict, by hand
  for a "response" and a "mixed" head; and end to end, the pairs ``Recorded`` keeps while an ada
  schedule decodes count exactly the drafts the rounds verified (from the rounds' own records).
- The goals against hand-made figures.
- The whole sweep on a saved tiny pair (greedy and T=1): every schedule setting runs, greedy
  outputs equal plain decoding's, the figures are consistent with each other, the outputs are written.
- The sweep's settings are checked by the core's own rules.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_same_greedy, build_tiny, hf_greedy, truncated_copy
from rich.console import Console
from tiny_models import save_tiny_pair_with_head

import specdec
from specdec.bench.config import BenchConfig
from specdec.bench.pareto import Recorded, calibration_pairs, goals, run_and_report
from specdec.config import ScheduleConfig, SpecConfig
from specdec.drafters import ModelDrafter
from specdec.heads import AcceptanceHead, HeadConfig
from specdec.schedules import make_schedule


def test_calibration_pairs_by_hand():
    values = torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, 0.3, 0.2]])
    # row 0 drafted 3 and kept 2 (draft 2 rejected, position 3 not drafted); row 1 drafted 2, kept both
    outcome = torch.tensor([[1, 1, 0, -1], [1, 1, -1, -1]])
    predicted, observed = calibration_pairs([(values, outcome)], "response")  # value i estimates draft i
    assert predicted.tolist() == pytest.approx([0.9, 0.8, 0.7, 0.5, 0.4])
    assert observed.tolist() == [1, 1, 0, 1, 1]
    predicted, observed = calibration_pairs([(values, outcome)], "mixed")  # value i + 1 estimates draft i
    assert predicted.tolist() == pytest.approx([0.8, 0.7, 0.6, 0.4, 0.3])
    assert observed.tolist() == [1, 1, 0, 1, 1]


def test_recorded_ada_keeps_one_pair_per_verified_draft_and_greedy_output(tmp_path):
    target = build_tiny("llama", seed=0)
    drafter = ModelDrafter(truncated_copy(target, 1))
    torch.manual_seed(3)
    head = AcceptanceHead(HeadConfig(hidden_size=32, num_blocks=2, inputs="response"))
    with torch.no_grad():
        head.out.weight.mul_(4.0)
        head.out.bias.copy_(torch.tensor([0.0, 1.5]))
    folder = head.save_pretrained(tmp_path / "head")
    schedule = Recorded(make_schedule(SpecConfig(), ScheduleConfig("ada", stop_threshold=0.5, bound=(1, 6),
                                                                   head=str(folder)), drafter))
    prompts = [[5, 17, 33, 5, 17], [9, 8, 7, 6, 5], [40, 41]]
    results = specdec.speculative_generate(target, drafter, prompts, max_new_tokens=24, stop_token_ids=[],
                                           batch_size=3, schedule=schedule)
    for prompt, result in zip(prompts, results):
        assert_same_greedy(target, prompt, result.tokens, hf_greedy(target, prompt, 24, []))
    records = [r for result in results for r in result.stats.records if r.drafted]
    predicted, observed = calibration_pairs(schedule.pairs, "response")
    verified = sum(r.accepted + (r.accepted < r.drafted) for r in records)
    assert len(predicted) == verified and int(observed.sum()) == sum(r.accepted for r in records)
    assert ((predicted > 0) & (predicted < 1)).all()


def _method(name, family, value, speed, temperature=0.0):
    return {"name": name, "family": family, "value": value, "temperature": temperature, "speed_vs_plain": speed}


def test_goals_against_hand_made_figures():
    methods = [_method("plain", "plain", None, 1.0), _method("constant 3", "constant", 3, 1.40),
               _method("constant 6", "constant", 6, 1.50), _method("heuristic", "heuristic", None, 1.20),
               _method("confidence 0.4", "confidence", 0.4, 1.56), _method("ada 0.3", "ada", 0.3, 1.60),
               _method("ada 0.5", "ada", 0.5, 1.58), _method("ada 0.3", "ada", 0.3, 0.9, temperature=1.0),
               _method("constant 2", "constant", 2, 1.0, temperature=1.0)]
    found = goals({"methods": methods, "head": {"default_threshold": 0.5}})
    greedy = [(g["text"].split(":")[0], g["met"]) for g in found if g["temperature"] == 0]
    assert greedy == [("ada 0.3 (1.60x plain) vs constant 6 (1.50x)", True),  # 1.067 >= 1.05
                      ("ada 0.3 (1.60x plain) vs heuristic (1.20x)", True),
                      ("ada 0.3 (1.60x plain) vs confidence 0.4 (1.56x)", True),
                      ("default threshold 0.5 (1.58x) vs the best, ada 0.3", True)]  # 0.9875 >= 0.98
    sampling = [(g["text"].split(":")[0], g["met"]) for g in found if g["temperature"] == 1]
    assert sampling == [("ada 0.3 (0.90x plain) vs constant 2 (1.00x)", False)]  # no default threshold swept


def test_the_sweep_on_a_tiny_pair(tmp_path):
    pair, prompts = save_tiny_pair_with_head(tmp_path, threshold=0.3)
    config = BenchConfig(target=str(pair.target), drafter=str(pair.drafter), prompts=str(prompts), num_prompts=2,
                         max_new_tokens=10, repeats=2, warmup=0, device="cpu", progress=False, pareto=True,
                         temperature=(0.0, 1.0), pareto_gamma=(1, 3), pareto_confidence=(0.4,),
                         pareto_ada=(0.3, 0.7), pareto_bound=(1, 5), output=str(tmp_path / "out"))
    assert run_and_report(config, Console(width=200, record=True)) == 0  # 0: greedy outputs equal plain's
    summary = json.loads((tmp_path / "out" / "pareto-summary.json").read_text())
    names = ["plain", "constant 1", "constant 3", "heuristic", "confidence 0.4", "ada 0.3", "ada 0.7"]
    for temperature in (0.0, 1.0):
        ms = {m["name"]: m for m in summary["methods"] if m["temperature"] == temperature}
        assert list(ms) == names
        for m in ms.values():
            assert m["seconds"] > 0 and m["tokens_per_s"] > 0
            assert m["speed_vs_plain"] == pytest.approx(ms["plain"]["seconds"] / m["seconds"], rel=1e-2)
        assert ms["plain"]["mean_drafted"] == 0 and ms["plain"]["tokens_per_round"] == 1
        assert 0 < ms["constant 1"]["mean_drafted"] <= 1 and 1 < ms["constant 3"]["mean_drafted"] <= 3
        assert all(1 <= ms[n]["mean_drafted"] <= 5 for n in ("heuristic", "confidence 0.4", "ada 0.3", "ada 0.7"))
        if temperature == 0:
            assert all(m["identical_share"] == 1 for m in ms.values())
    kinds = {g["temperature"]: [] for g in summary["goals"]}
    for g in summary["goals"]:
        kinds[g["temperature"]].append(g["text"])
    assert set(kinds) == {0.0, 1.0} and all(len(texts) == 4 for texts in kinds.values())  # the default 0.3 swept
    assert set(summary["calibration"]) == {"greedy", "sampling T=1"}
    assert all(sum(c["counts"]) > 0 and 0 <= c["brier"] <= 1 for c in summary["calibration"].values())
    for name in ("pareto-summary.md", "pareto.png", "pareto-calibration.png"):
        assert (tmp_path / "out" / name).stat().st_size > 100


def test_sweep_settings_are_checked():
    with pytest.raises(ValueError, match="bound must be MIN MAX"):
        BenchConfig(pareto=True, pareto_bound=(0, 4))
    with pytest.raises(ValueError, match="bound must be MIN MAX"):
        BenchConfig(pareto=True, pareto_bound=(4,))
    with pytest.raises(ValueError, match="pareto_gamma must be one or more ints >= 1"):
        BenchConfig(pareto=True, pareto_gamma=(0, 2))
    with pytest.raises(ValueError, match=r"stop_threshold must be in \(0, 1\]"):
        BenchConfig(pareto=True, pareto_ada=(0.5, 1.5))
