"""The ada schedule end to end (issue 18): a real acceptance head, loaded from a folder, drafting.

- On a tiny pair, ``speculative_generate(..., schedule="ada")`` with a saved head is token-identical
  to the target's greedy decoding, and every round drafts exactly the length an independent
  reference gives: the drafter's greedy chain recomputed without a cache, the head's P(accept) on
  the hidden state behind each draft, SpecDec++'s rule written as a loop. The lengths vary with
  the head's values (several lengths, some rounds stopped by the threshold, others by the bound).
- Bad input: a head whose hidden size is not the drafter's, a missing head folder: clear errors,
  and one line on stderr with exit 2 from the CLI.
- ``specdec bench --schedules heuristic confidence ada`` runs spec-<schedule> on a saved tiny pair
  (the head saved beside the drafter, where ada finds it), each greedy output equal to plain-hf's.
- The shipped head (models/code-drafter/acceptance_head) loads by default through
  ``specdec generate --drafter code-drafter --schedule ada`` and keeps the shipped pair's greedy text.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from conftest import assert_same_greedy, build_tiny, hf_greedy, truncated_copy
from tiny_models import save_tiny_pair_with_head

import specdec
from specdec.bench import BenchConfig, run_benchmark
from specdec.cli import main
from specdec.config import ScheduleConfig
from specdec.heads import AcceptanceHead, HeadConfig, load_head
from specdec.loading import default_model_path

PROMPTS = [[5, 17, 33, 5, 17], [9, 8, 7, 6, 5, 4, 3, 2, 11, 12], [40, 41]]
THRESHOLD, BOUND = 0.5, (2, 7)


@pytest.fixture(scope="module")
def pair():
    target = build_tiny("llama", seed=0)
    return target, truncated_copy(target, 1)


@pytest.fixture(scope="module")
def head_folder(tmp_path_factory):
    """A head of the tiny drafter's width whose P(accept) is spread over (0, 1)."""
    torch.manual_seed(3)
    head = AcceptanceHead(HeadConfig(hidden_size=32, num_blocks=2, threshold=THRESHOLD))
    with torch.no_grad():
        head.out.weight.mul_(4.0)
        head.out.bias.copy_(torch.tensor([0.0, 1.5]))  # leaning to acceptance, so rounds run past MIN
    return head.save_pretrained(tmp_path_factory.mktemp("heads") / "acceptance_head")


@torch.no_grad()
def reference_length(drafter, head: AcceptanceHead, context: list[int]) -> int:
    """The draft length SpecDec++'s rule gives from ``context``, everything recomputed from scratch."""
    product, drafts = 1.0, []
    for i in range(BOUND[1]):
        out = drafter(torch.tensor([context + drafts]), output_hidden_states=True)
        drafts.append(int(out.logits[0, -1].argmax()))
        if i > 0:  # a_1 := 1; later drafts: the head on the state whose logits produced the draft
            product *= float(head.accept_probability(out.hidden_states[-1][0, -1]))
        if i + 1 >= BOUND[0] and 1 - product > THRESHOLD:
            return i + 1
    return BOUND[1]


def test_ada_with_a_saved_head_is_greedy_exact_and_drafts_what_the_head_says(pair, head_folder):
    target, drafter = pair
    head = load_head(head_folder, 32)
    assert head.default_threshold == THRESHOLD
    config = ScheduleConfig("ada", bound=BOUND, head=str(head_folder))  # the head's own threshold
    results = specdec.speculative_generate(target, drafter, PROMPTS, max_new_tokens=30, stop_token_ids=[],
                                           batch_size=3, schedule=config)
    lengths, reasons = [], set()
    for prompt, result in zip(PROMPTS, results):
        assert_same_greedy(target, prompt, result.tokens, hf_greedy(target, prompt, 30, []))
        done = 0
        for record in result.stats.records:
            if record.ended in ("threshold", "bound"):
                room = 30 - done - 1  # the round also emits one verified token within max_new_tokens
                want = min(reference_length(drafter, head, prompt + result.tokens[:done]), room)
                assert record.drafted == want, (prompt, done)
                lengths.append(record.drafted)
                reasons.add(record.ended)
            done += record.emitted
        assert done == len(result.tokens)
    assert reasons == {"threshold", "bound"} and len(set(lengths)) >= 3, lengths


def test_head_of_another_width_or_missing_is_a_clear_error(pair, tmp_path):
    target, drafter = pair
    narrow = AcceptanceHead(HeadConfig(hidden_size=16)).save_pretrained(tmp_path / "narrow")
    with pytest.raises(ValueError, match="reads hidden states of size 16, but the drafter has hidden size 32"):
        specdec.speculative_generate(target, drafter, [1, 2], max_new_tokens=3,
                                     schedule=ScheduleConfig("ada", head=str(narrow)))
    with pytest.raises(FileNotFoundError, match="no acceptance head at .*missing"):
        specdec.speculative_generate(target, drafter, [1, 2], max_new_tokens=3,
                                     schedule=ScheduleConfig("ada", head=str(tmp_path / "missing")))


def test_bench_schedules_run_beside_spec_and_keep_greedy_output(tmp_path):
    pair, prompts = save_tiny_pair_with_head(tmp_path, threshold=0.4)
    config = BenchConfig(target=str(pair.target), drafter=str(pair.drafter), prompts=str(prompts), num_prompts=2,
                         max_new_tokens=12, repeats=1, warmup=0, device="cpu", progress=False, plots=False,
                         methods=("spec",), gamma=(2,), schedules=("heuristic", "confidence", "ada"))
    run = run_benchmark(config)
    blocks = {b.runner.name: b for b in run.blocks}
    assert set(blocks) == {"plain-hf", "spec", "spec-heuristic", "spec-confidence", "spec-ada"}
    for name in ("spec-heuristic", "spec-confidence", "spec-ada"):
        block = blocks[name]
        assert block.error is None and block.setting.gamma is None
        assert block.compared == 2 and not block.mismatches, (name, block.mismatches)
        assert all(r.drafted and r.rounds for r in block.records)
    with pytest.raises(ValueError, match="schedules must be among heuristic, confidence, ada"):
        BenchConfig(schedules=("constant",))


SHIPPED = default_model_path("code-drafter") / "acceptance_head"


def test_shipped_head_is_small_and_loads(pair):
    weights = SHIPPED / "model.safetensors"
    assert weights.is_file() and weights.stat().st_size <= 2 * 2**20
    head = load_head(SHIPPED, 160)
    assert head.config.num_blocks == 3 and 0 < head.default_threshold < 1
    blocks = [b.linear.weight for b in head.blocks]
    assert not any(torch.equal(a, b) for a, b in itertools.pairwise(blocks))  # not SpecDec++'s shared block


def test_cli_ada_with_the_shipped_head_keeps_greedy_text(capsys):
    prompt = "def fibonacci(n):\n"
    runs = {}
    for mode in ("ada", "target"):
        args = ["generate", prompt, "--drafter", "code-drafter", "--max-new-tokens", "40", "--json", "--device", "cpu"]
        args += ["--schedule", "ada"] if mode == "ada" else ["--mode", "target"]
        assert main(args) == 0
        runs[mode] = json.loads(capsys.readouterr().out)
    assert runs["ada"]["schedule"] == "ada" and runs["ada"]["head"] is None  # the default: the shipped head
    assert runs["ada"]["tokens"] == runs["target"]["tokens"]
    per_position = runs["ada"]["stats"]["drafted_per_position"]  # [i]: rounds that drafted a token at i
    assert len(set(per_position)) >= 2, per_position  # rounds of different lengths: the head decided


def test_cli_missing_head_is_one_line_exit_2(tmp_path, capsys):
    code = main(["generate", "x = 1", "--drafter", "code-drafter", "--schedule", "ada", "--head",
                 str(tmp_path / "nowhere"), "--max-new-tokens", "4", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "no acceptance head at" in err and "\n" not in err and "Traceback" not in err
