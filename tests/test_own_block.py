"""A block drafter and an acceptance head for the user's own target, on the user's own prompts:
``specdec data outputs`` then ``specdec train block-drafter --data`` / ``specdec train head --data``, end to
end on the tiny random targets of ``test_own_model`` (a Llama, a GPT-2, a Marian encoder-decoder), each
saved to a folder with a tokenizer as a user's model would be.

Checked: decoding with the block drafter made for each target is exact (greedy equal to transformers'
``generate`` and to plain decoding), and so is decoding with ``--schedule ada`` and the head made for a
(target, drafter) pair; each trainer measures what it made on the held-out prompts and writes it into
``training.json`` and a card; each bad input (another target's data, a drafter of another vocabulary, a
missing file, a flag that does not apply) is one line on stderr, exit status 2, nothing written.
"""

from __future__ import annotations

import argparse
import json
import statistics

import pytest
import torch
from test_own_model import NEW, _data, _hf_greedy, _run, targets  # noqa: F401 (targets: the fixture)
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import specdec
from specdec.cli import main
from specdec.train.drafter import DrafterTrainConfig, train_drafter
from specdec.train.outputs import read_records, valid_path

QUIET = {"progress": False, "log": lambda m: None}


@pytest.fixture(scope="module")
def data(targets, tmp_path_factory) -> dict[str, tuple]:  # noqa: F811
    """arch -> (target folder, its `specdec data outputs` file), all greedy, a quarter held out."""
    root = tmp_path_factory.mktemp("own-block-data")
    out = {}
    for arch, (target, prompts) in targets.items():
        _data(target, prompts, root / f"{arch}.jsonl", sampled_share=0.0)
        out[arch] = (target, root / f"{arch}.jsonl")
    return out


def _block_flags(arch: str) -> list[str]:
    shape = [] if arch == "marian" else ["--hidden-size", "32", "--num-attention-heads", "4",
                                          "--intermediate-size", "64"]
    return [*shape, "--num-hidden-layers", "1", "--max-block-size", "4", "--batch-size", "4", "--max-steps", "3",
            "--warmup-steps", "1", "--save-every", "2", "--eval-every", "2", "--measure-prompts", "3",
            "--measure-tokens", str(NEW)]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "marian"])
def test_block_drafter_for_any_target_decodes_exactly(arch, data, tmp_path, capsys):
    """data -> `specdec train block-drafter --target --data` -> a block drafter whose greedy decoding on the
    held-out prompts equals transformers' generate and plain decoding; its figures are in the card."""
    target_dir, data_file = data[arch]
    run = tmp_path / "run"
    assert main(["train", "block-drafter", "--target", str(target_dir), "--data", str(data_file), "--out", str(run),
                 *_block_flags(arch)]) == 0
    printed = capsys.readouterr().out
    final = run / "final"
    target = specdec.load_model(str(target_dir))
    drafter = specdec.load_model(str(final))
    if arch == "marian":  # a plain Marian with the target's encoder: it loads without specdec
        assert type(AutoModelForSeq2SeqLM.from_pretrained(final)) is type(target)
        assert drafter.config.decoder_layers == 1 and drafter.config.block_drafter["max_block_size"] == 4
    else:
        assert type(drafter).__name__ == "BlockDrafterModel" and drafter.config.hidden_size == 32
    held = read_records(valid_path(data_file))
    prompts = [r["prompt_ids"] for r in held]
    plain = specdec.autoregressive_generate(target, prompts, max_new_tokens=NEW)
    for gamma in (1, 4):
        spec = specdec.speculative_generate(target, drafter, prompts, max_new_tokens=NEW, gamma=gamma)
        assert [r.tokens for r in spec] == [r.tokens for r in plain]
        assert sum(r.stats.drafted for r in spec) > 0
    for p, r in zip(prompts, plain):
        assert r.tokens == _hf_greedy(target, p)
    record = json.loads((final / "training.json").read_text())
    figures = record["figures"]
    assert figures["greedy_equal"] == figures["prompts"] == min(3, len(held)) and figures["gamma"] == 4
    assert record["data"] == {"file": str(data_file), "target": held[0]["target"]}
    card = (final / "README.md").read_text()
    assert f"| acceptance rate α | {figures['greedy_alpha']:.3f} |" in card and str(data_file) in card
    assert f"speedup {figures['speedup']:.2f}x" in printed
    assert ("It pays." in card) == (figures["speedup"] >= 1)
    assert ("does not pay" in card) == (figures["speedup"] < 1)


def test_block_drafter_resumes_to_an_uninterrupted_run(data, tmp_path):
    """Stopped at a step, the same command resumes to the weights of one uninterrupted run."""
    from specdec.train.block import train_own_block_drafter

    target_dir, data_file = data["gpt2"]
    settings = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "num_hidden_layers": 1,
                "max_block_size": 4, "batch_size": 3, "max_steps": 4, "save_every": 2}
    kw = {"measure": False, **QUIET}
    whole = train_own_block_drafter(str(target_dir), data_file, tmp_path / "whole", settings, **kw)
    assert train_own_block_drafter(str(target_dir), data_file, tmp_path / "cut", settings, stop_at_step=3,
                                   **kw) is None
    resumed = train_own_block_drafter(str(target_dir), data_file, tmp_path / "cut", settings, **kw)
    a, b = specdec.load_model(str(whole)).state_dict(), specdec.load_model(str(resumed)).state_dict()
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, rtol=0, atol=1e-6, msg=name)


def test_block_drafter_bad_inputs_are_one_line_errors_and_write_nothing(data, tmp_path, capsys):
    llama, llama_data = data["llama"]
    gpt2, _ = data["gpt2"]
    marian, marian_data = data["marian"]
    out = tmp_path / "run"
    train = ["train", "block-drafter", "--out", str(out), "--max-steps", "2", "--no-measure"]
    assert "written for another target" in _run(capsys, *train, "--target", str(gpt2), "--data", str(llama_data))
    assert "no data at" in _run(capsys, *train, "--target", str(llama), "--data", str(tmp_path / "missing.jsonl"))
    assert "needs --target" in _run(capsys, *train, "--data", str(llama_data))
    assert "does not go with --data" in _run(capsys, *train, "--target", str(llama), "--data", str(llama_data),
                                             "--outputs", str(llama_data))
    err = _run(capsys, *train, "--target", str(marian), "--data", str(marian_data), "--hidden-size", "32")
    assert "--hidden-size does not apply to an encoder-decoder target" in err
    for layers in ("0", "3"):  # the tiny Marian has 2 decoder layers
        assert "give 1..2" in _run(capsys, *train, "--target", str(marian), "--data", str(marian_data),
                                   "--num-hidden-layers", layers)
    assert "num_hidden_layers must be >= 1" in _run(capsys, *train, "--target", str(llama), "--data",
                                                    str(llama_data), "--num-hidden-layers", "0")
    assert not out.exists()


def _drafter(target_dir, data_file, out) -> str:
    """A tiny drafter for the target (`specdec train drafter`, a few steps)."""
    cfg = DrafterTrainConfig(target=str(target_dir), data=str(data_file), layers=1, hidden=16, steps=4, batch_size=4)
    return str(train_drafter(cfg, out, measure=False, **QUIET))


HEAD_FLAGS = ["--max-steps", "6", "--batch-size", "64", "--warmup-steps", "1", "--eval-every", "3", "--save-every",
              "3", "--measure-prompts", "3", "--measure-tokens", str(NEW), "--measure-repeats", "2",
              "--tune-thresholds", "0.5", "1", "--tune-max-draft", "2", "3", "--tune-tokens", str(NEW),
              "--tune-repeats", "1"]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "marian"])
def test_head_for_any_pair_decodes_exactly_with_ada(arch, data, tmp_path, capsys):
    """data -> drafter -> `specdec train head --target --drafter --data` -> a head for that pair, ada's threshold
    and MAX tuned on the first held-out prompts and stored with it, so that `--schedule ada --head` uses them
    by default (flags override) and decodes the held-out prompts exactly; measured on the other held-out
    prompts against plain decoding and every constant gamma of the grid, the figures in training.json and
    the card."""
    from specdec.arguments import add_decoding_arguments, config_from
    from specdec.config import ScheduleConfig, SpecConfig
    from specdec.drafters.model import ModelDrafter
    from specdec.heads import load_head
    from specdec.schedules import Ada, make_schedule

    target_dir, data_file = data[arch]
    drafter_dir = _drafter(target_dir, data_file, tmp_path / "drafter")
    run = tmp_path / "head"
    assert main(["train", "head", "--target", str(target_dir), "--drafter", drafter_dir, "--data", str(data_file),
                 "--out", str(run), *HEAD_FLAGS]) == 0
    printed = capsys.readouterr().out
    final = run / "final"
    head = load_head(final, hidden_size=16)
    assert head.config.hidden_size == 16
    held = read_records(valid_path(data_file))
    assert len(held) >= 2 and (run / "data").is_dir() and (run / "valid-data").is_dir()
    record = json.loads((final / "training.json").read_text())
    figures = record["figures"]
    tuning = figures["tuning"]
    # tuned on the first half of the held-out prompts: the probes timed, the costs fitted to them, every
    # (threshold, MAX) of the grid counted exactly on the probes' greedy text and priced, the fastest stored
    assert tuning["prompts"] == len(held) // 2
    # constant gamma at the smallest and largest MAX, and ada's rule all but never stopping at the largest
    assert tuning["probes"] == ["constant 2", "constant 3", "ada 0.999999 max 3"]
    assert [(r["threshold"], r["max_draft"]) for r in tuning["grid"]] == [(0.5, 2), (1.0, 2), (0.5, 3), (1.0, 3)]
    grid = {(r["threshold"], r["max_draft"]): r for r in tuning["grid"]}
    for name in ("constant 2", "constant 3"):  # the offline replay is the decoding's own trace
        assert tuning["replay"][name]["rounds"][0] == tuning["replay"][name]["rounds"][1], name
        assert tuning["replay"][name]["drafted"][0] == tuning["replay"][name]["drafted"][1], name
    assert tuning["replay"]["constant 3"]["drafted"][1] == grid[(1.0, 3)]["drafted"]
    # the never-stopping probe drafts at most constant gamma 3's tokens (a tiny head predicting ~0 can stop it)
    assert tuning["replay"]["ada 0.999999 max 3"]["drafted"][0] <= grid[(1.0, 3)]["drafted"]
    costs = tuning["costs"]
    assert all(c >= 0 for c in costs.values()) and sum(costs.values()) > 0
    for r in tuning["grid"]:
        assert r["ada_drafted"] == (0 if r["threshold"] == 1 else r["drafted"])  # what pays for ada's stop rule
        seconds = sum(costs[k] * r[k] for k in ("calls", "rounds", "drafted", "ada_drafted"))
        assert r["modelled_tokens_per_s"] == pytest.approx(r["emitted"] / seconds, abs=0.006)
    best = max(tuning["grid"], key=lambda r: (r["modelled_tokens_per_s"], r["threshold"] >= 1, -r["max_draft"]))
    # `--schedule ada --head DIR` takes them by default (no --bound on the command line); flags override them
    parser = argparse.ArgumentParser()
    add_decoding_arguments(parser)
    default = config_from(parser.parse_args(["--schedule", "ada", "--head", str(final)]), ScheduleConfig)
    drafter = specdec.load_model(drafter_dir)
    schedule = make_schedule(SpecConfig(), default, ModelDrafter(drafter))
    assert isinstance(schedule, Ada) and (schedule.threshold, schedule.high) == (best["threshold"], best["max_draft"])
    given = config_from(parser.parse_args(["--schedule", "ada", "--head", str(final), "--stop-threshold", "0.25",
                                           "--bound", "1", "5"]), ScheduleConfig)
    schedule = make_schedule(SpecConfig(), given, ModelDrafter(drafter))
    assert (schedule.threshold, schedule.high) == (0.25, 5)
    # decoding with the tuned defaults is exact: equal to plain decoding and to transformers' generate
    target = specdec.load_model(str(target_dir))
    prompts = [r["prompt_ids"] for r in held]
    plain = specdec.autoregressive_generate(target, prompts, max_new_tokens=NEW)
    for config in (default, ScheduleConfig("ada", head=str(final), stop_threshold=0.5)):
        ada = specdec.speculative_generate(target, drafter, prompts, max_new_tokens=NEW, schedule=config)
        assert [r.tokens for r in ada] == [r.tokens for r in plain]
        assert sum(r.stats.drafted for r in ada) > 0
    ada = specdec.speculative_generate(target, drafter, prompts, max_new_tokens=NEW, schedule=default)
    assert max(r.drafted for a in ada for r in a.stats.records) <= best["max_draft"]
    assert [r.tokens for r in plain] == [_hf_greedy(target, p) for p in prompts]
    # measured on the other held-out prompts: ada (tuned) and every constant gamma of the grid
    measured = min(3, len(held) - tuning["prompts"])
    assert set(figures["constants"]) == {"constant 2", "constant 3"}
    assert figures["ada"]["schedule"] == "ada" and figures["ada"]["repeats"] == 2
    for f in (figures["ada"], *figures["constants"].values()):
        assert f["greedy_equal"] == f["prompts"] == measured and len(f["spec_tokens_per_s_runs"]) == 2
    # the best constant: the fastest by its exact counts priced by costs fitted to this measurement's timings, a tie
    # (the same modelled figure, as when the fitted drafting cost is 0 and both take the same rounds) going to the
    # faster measured one
    modelled = figures["modelled_tokens_per_s"]
    assert set(modelled) == {"ada", "constant 2", "constant 3"} and all(v > 0 for v in modelled.values())
    best_name = max(("constant 2", "constant 3"),
                    key=lambda n: (modelled[n], figures["constants"][n]["spec_tokens_per_s"]))
    assert figures["best_constant"] == int(best_name.split()[1])
    assert figures["modelled_ada_over_best_constant"] == pytest.approx(
        modelled["ada"] / modelled[f"constant {figures['best_constant']}"], abs=2e-3)
    # ada against the best constant: the median of the paired per-prompt, per-pass time ratios, with their spread
    fastest = figures["constants"][f"constant {figures['best_constant']}"]
    ratios = sorted(c / a for ada_pass, best_pass in zip(figures["ada"]["prompt_seconds_runs"],
                                                         fastest["prompt_seconds_runs"])
                    for a, c in zip(ada_pass, best_pass))
    assert len(ratios) == 2 * measured
    spread = figures["ada_over_best_constant_spread"]
    assert spread[0] == round(ratios[0], 3) and spread[-1] == round(ratios[-1], 3)
    assert figures["ada_over_best_constant"] == spread[2] == round(statistics.median(ratios), 3)
    assert record["target_fingerprint"] == held[0]["target"] and record["drafter"] == drafter_dir
    card = (final / "README.md").read_text()
    assert f"| acceptance rate α | {figures['ada']['greedy_alpha']:.3f} |" in card
    assert f"stop threshold **{best['threshold']:g}**, MAX **{best['max_draft']}**" in card
    assert f"**{figures['ada_over_best_constant']:.2f}x** the speed of the best constant γ" in card
    assert ("does not pay over the best constant" in card) == (spread[3] < 1)
    assert ("faster than the best constant" in card) == (spread[1] > 1)
    assert f"speedup {figures['ada']['speedup']:.2f}x" in printed and "<- chosen" in printed


def test_head_data_of_an_encoder_decoder_pair_reads_what_decoding_reads(data, tmp_path):
    """The head's data for a Marian pair: the target's teacher-forced argmax is its own greedy output (the
    records'), the padded batch equals each record alone (sources of other lengths are masked), and a drafter
    equal to the target has every greedy draft accepted."""
    from specdec.heads.data import Record, examples_of_batch, response_states, teacher_forced_logits

    target_dir, data_file = data["marian"]
    target = specdec.load_model(str(target_dir))
    drafter = specdec.load_model(_drafter(target_dir, data_file, tmp_path / "drafter"))
    records = [Record(i, r["prompt_ids"], r["ids"][: len(r["ids"]) - i % 3])  # decoder texts of other lengths too
               for i, r in enumerate(read_records(data_file)[:6])]
    assert len({len(r.prompt) for r in records}) > 1 and len({len(r.response) for r in records}) > 1
    for r, p in zip(records, teacher_forced_logits(target, records)):
        assert p.argmax(-1).tolist() == r.response
    for r, q in zip(records, teacher_forced_logits(drafter, records)):
        torch.testing.assert_close(q, teacher_forced_logits(drafter, [r])[0], rtol=1e-4, atol=1e-4)
    inputs = [torch.tensor(r.response) for r in records]
    for r, z, h in zip(records, inputs, response_states(drafter, [r.prompt for r in records], inputs)):
        assert h.shape == (len(r.response) + 1, 16)
        torch.testing.assert_close(h, response_states(drafter, [r.prompt], [z])[0], rtol=1e-4, atol=1e-4)
    same = examples_of_batch(target, target, records, ("greedy",), 0.15, 0, "response")
    assert len(same["label"]) == sum(len(r.response) for r in records) and bool((same["label"] == 1).all())


def test_held_out_prompts_split_into_tuning_and_measurement():
    """The prompts that tune ada are never the ones measured; too few held out: nothing tunes."""
    from specdec.heads.own import split_held_out

    held = [{"id": str(i)} for i in range(7)]
    assert split_held_out(held, None) == (held[:3], held[3:])
    assert split_held_out(held, 5) == (held[:5], held[5:])
    assert split_held_out(held, 50) == (held[:6], held[6:])  # one is always left to measure
    assert split_held_out(held, 0) == ([], held)
    assert split_held_out(held[:1], None) == ([], held[:1])


def test_tuning_cost_model_recovers_known_costs():
    """``fit_costs`` on timed decodes made from known costs (a call, a round, a drafted token, a drafted token
    under ada's stop rule) gives them back; a cost the timings would make negative is left out (0) rather than
    fitted below zero."""
    from specdec.heads.own import fit_costs

    rows = []
    for rounds, drafted, ada in [(40, 70, 1), (40, 80, 0), (30, 80, 1), (28, 112, 0), (26, 90, 1), (25, 200, 0),
                                 (12, 30, 0), (14, 20, 1)]:
        seconds = 0.05 + 0.1 * rounds + 0.01 * drafted + 0.002 * drafted * ada
        rows.append({"calls": 1, "rounds": rounds, "drafted": drafted, "ada_drafted": drafted * ada,
                     "seconds": seconds})
    assert fit_costs(rows) == pytest.approx({"calls": 0.05, "rounds": 0.1, "drafted": 0.01, "ada_drafted": 0.002})
    for r in rows:  # a stop rule that makes decoding faster: not a cost, left out
        r["seconds"] = 0.1 * r["rounds"] + 0.01 * r["drafted"] - 0.005 * r["ada_drafted"]
    costs = fit_costs(rows)
    assert costs["ada_drafted"] == 0 and costs["rounds"] > 0 and costs["drafted"] >= 0
    # a cost given (ada's rule, from a paired probe) is kept and the others fitted to what it leaves
    for r in rows:
        r["seconds"] = 0.05 + 0.1 * r["rounds"] + 0.01 * r["drafted"] + 0.002 * r["ada_drafted"]
    assert fit_costs(rows, fixed={"ada_drafted": 0.002}) == pytest.approx(
        {"calls": 0.05, "rounds": 0.1, "drafted": 0.01, "ada_drafted": 0.002})


def test_stop_rule_cost_is_the_paired_time_over_the_same_constant():
    """``rule_cost``: the median, over prompt and pass, of the never-stopping ada probe's time less constant
    gamma MAX's on the same prompt in the same pass, per drafted token; never below 0."""
    from specdec.config import ScheduleConfig
    from specdec.heads.own import NEVER, rule_cost

    probes = {"constant 2": None, "constant 8": None, f"ada {NEVER:g} max 8": ScheduleConfig(
        "ada", stop_threshold=NEVER, bound=(1, 8), head="h")}
    constant = [{"rounds": 30, "drafted": 100, "seconds": s} for s in (1.0, 2.0, 1.5, 1.0)]  # (prompt, pass) rows
    ada = [{"rounds": 30, "drafted": 100, "seconds": s} for s in (1.2, 2.1, 1.9)]  # +0.2, +0.1, +0.4 s / 100 drafts
    ada.append({"rounds": 40, "drafted": 60, "seconds": 0.1})  # the rule stopped there: not a paired row
    rows = {"constant 2": [], "constant 8": constant, f"ada {NEVER:g} max 8": ada}
    assert rule_cost(rows, probes) == pytest.approx(0.002)
    rows[f"ada {NEVER:g} max 8"] = [{"rounds": 30, "drafted": 100, "seconds": s - 0.5} for s in (1.0, 2.0, 1.5)]
    assert rule_cost(rows, probes) == 0.0
    assert rule_cost(rows, {"constant 2": None, "constant 8": None}) == 0.0


def test_head_resumes_to_an_uninterrupted_run(data, tmp_path, capsys):
    """`specdec train head --data` stopped at a step, then run again, ends with the head of one uninterrupted run."""
    from safetensors.torch import load_file

    target_dir, data_file = data["llama"]
    drafter_dir = _drafter(target_dir, data_file, tmp_path / "drafter")
    head = ["train", "head", "--target", str(target_dir), "--drafter", drafter_dir, "--data", str(data_file),
            *HEAD_FLAGS, "--no-measure"]
    assert main([*head, "--out", str(tmp_path / "whole")]) == 0
    assert main([*head, "--out", str(tmp_path / "cut"), "--stop-at-step", "4"]) == 0
    assert not (tmp_path / "cut" / "final").exists()
    assert main([*head, "--out", str(tmp_path / "cut")]) == 0
    capsys.readouterr()
    whole, cut = (load_file(str(tmp_path / run / "final" / "model.safetensors")) for run in ("whole", "cut"))
    for name, value in whole.items():
        torch.testing.assert_close(cut[name], value, rtol=0, atol=1e-6, msg=name)
    record = json.loads((tmp_path / "cut" / "final" / "training.json").read_text())
    assert record["figures"] is None and "Not measured" in (tmp_path / "cut" / "final" / "README.md").read_text()


def test_head_bad_inputs_are_one_line_errors_and_write_nothing(data, tmp_path, capsys):
    from tiny_models import build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    llama, llama_data = data["llama"]
    gpt2, _ = data["gpt2"]
    marian, marian_data = data["marian"]
    other = tmp_path / "other-vocabulary"  # a causal LM with a tokenizer of 257 tokens, not 320
    tok = build_tokenizer(200)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=128)).save_pretrained(other)
    tok.save_pretrained(other)
    out = tmp_path / "run"
    train = ["train", "head", "--out", str(out), *HEAD_FLAGS]
    err = _run(capsys, *train, "--target", str(llama), "--drafter", str(other), "--data", str(llama_data))
    assert "vocabulary" in err and "specdec train drafter" in err
    assert "written for another target" in _run(capsys, *train, "--target", str(gpt2), "--drafter", str(llama),
                                                "--data", str(llama_data))
    assert "no data at" in _run(capsys, *train, "--target", str(llama), "--drafter", str(gpt2), "--data",
                                str(tmp_path / "missing.jsonl"))
    assert "does not exist" in _run(capsys, *train, "--target", str(llama), "--drafter", str(tmp_path / "missing"),
                                    "--data", str(llama_data))
    causal = tmp_path / "causal-marian-vocabulary"  # a decoder-only drafter of the Marian target's vocabulary
    tok = AutoTokenizer.from_pretrained(marian)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(causal)
    tok.save_pretrained(causal)
    assert "must read what the target reads" in _run(capsys, *train, "--target", str(marian), "--drafter",
                                                     str(causal), "--data", str(marian_data))
    assert "replaces --outputs" in _run(capsys, *train, "--target", str(llama), "--drafter", str(gpt2), "--data",
                                        str(llama_data), "--outputs", str(llama_data))
    pair = ["--target", str(llama), "--drafter", str(gpt2), "--data", str(llama_data)]
    assert "tune_thresholds must be one or more numbers in (0, 1]" in _run(capsys, *train, *pair, "--tune-thresholds",
                                                                          "0.5", "1.5")
    assert "tune_max_draft must be one or more ints >= 1" in _run(capsys, *train, *pair, "--tune-max-draft", "0")
    assert not out.exists()


def test_cost_rows_are_corrected_for_the_load_of_their_pass():
    """A pass run under twice the load (its plain decoding of the prompt took twice as long) gives the same
    load-corrected seconds as the others, so the costs are not fitted to the machine's load."""
    from specdec.heads.own import timed_rows

    figures = {"plain_prompt_seconds_runs": [[1.0, 2.0], [2.0, 2.0], [1.0, 2.0]],
               "prompt_seconds_runs": [[3.0, 4.0], [6.0, 4.0], [3.0, 4.0]]}
    rows = timed_rows(figures, [{"calls": 1, "rounds": 5}, {"calls": 1, "rounds": 7}])
    assert [(r["rounds"], r["seconds"]) for r in rows] == [(5, 3.0), (7, 4.0)] * 3
