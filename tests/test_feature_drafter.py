"""The EAGLE-3-style feature drafter (specdec.drafters.feature_model) and its trainer (specdec.train.feature_drafter).

The training-time-test unroll is checked against the drafter run step by step as it drafts at inference (a cache of
the context's step-0 slots, then one slot per drafting step reading its own previous output); the trainer on a tiny
random Llama: the loss falls, and a run stopped and resumed ends with the uninterrupted run's weights and losses."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import target_with_outputs
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specdec.drafters.feature_model import (
    FeatureDrafterModel,
    features_of,
    load_feature_drafter,
    new_feature_drafter,
)
from specdec.train.feature_drafter import target_pass, ttt_pattern, unroll


def _llama(layers: int = 4, hidden: int = 64, vocab: int = 96, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.2, pad_token_id=0, bos_token_id=0,
                         eos_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module", params=["proj", "eagle3"])
def pair(request):
    target = _llama()
    drafter = new_feature_drafter(target, fingerprint="0123abcd", name="tiny-llama", seed=1,
                                  layout=request.param).eval()
    with torch.no_grad():  # a drafter whose layer matters: larger weights than the init's
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return target, drafter


def test_shapes_and_the_saved_folder_holds_the_drafters_own_weights_only(pair, tmp_path):
    target, drafter = pair
    ids = torch.randint(1, 96, (2, 9))
    features, _ = target_pass(target, drafter.config.feature_layers, ids, torch.ones_like(ids))
    assert features.shape == (2, 9, 3 * 64)
    out = drafter(ids, drafter.fuse_features(features))
    assert out.logits.shape == (2, 9, 96) and out.hidden.shape == (2, 9, 64)
    drafter.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "model.safetensors"))
    assert not any("embed_tokens" in k or "lm_head" in k for k in saved), sorted(saved)
    assert sum(v.numel() for v in saved.values()) == sum(p.numel() for p in drafter.parameters())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "specdec-feature-drafter" and config["feature_layers"] == [0, 1, 2]
    again = load_feature_drafter(str(tmp_path), target).eval()
    with torch.no_grad():
        assert torch.equal(again(ids, again.fuse_features(features)).logits, out.logits)


def test_a_target_of_another_shape_is_refused_in_one_line_naming_both(pair, tmp_path):
    target, drafter = pair
    drafter.save_pretrained(tmp_path)
    other = _llama(layers=5, hidden=32)
    with pytest.raises(ValueError) as err:
        load_feature_drafter(str(tmp_path), other, name="other-llama")
    message = str(err.value)
    assert "\n" not in message and "tiny-llama" in message and "other-llama" in message
    assert "hidden 64, 4 layers" in message and "hidden 32, 5 layers" in message
    for folder, needle in ((tmp_path / "none", "no feature drafter at"), ("models/code-drafter", "not a feature")):
        with pytest.raises(ValueError, match=needle):
            load_feature_drafter(str(folder), target)
    with pytest.raises(ValueError, match="fingerprint"):
        FeatureDrafterModel.from_pretrained(tmp_path).bind(target, fingerprint="not-the-same")


def _step_by_step(drafter, ids, features, anchor: int, steps: int) -> list[torch.Tensor]:
    """The logits of each drafting step of a round anchored at slot ``anchor`` of row 0, drafting the window's own
    tokens: as the drafter runs at inference (one cached forward of the context, then one slot per step)."""
    cache = DynamicCache()
    n = anchor + 1
    out = drafter(ids[:1, 1: n + 1], drafter.fuse_features(features[:1, :n]), past_key_values=cache, use_cache=True)
    logits, hidden = [out.logits[0, -1]], out.hidden[:, -1:]
    for k in range(1, steps):
        out = drafter(ids[:1, anchor + k + 1: anchor + k + 2], hidden, past_key_values=cache, use_cache=True,
                      position_ids=torch.tensor([[anchor + k]]))
        logits.append(out.logits[0, -1])
        hidden = out.hidden
    return logits


def test_the_training_time_test_unroll_equals_drafting_step_by_step(pair):
    target, drafter = pair
    torch.manual_seed(3)
    ids = torch.randint(1, 96, (2, 12))
    live = torch.ones_like(ids)
    live[1, 8:] = 0  # a right-padded row beside it changes nothing of row 0
    steps = 4
    with torch.no_grad():
        features, _ = target_pass(target, drafter.config.feature_layers, ids, live)
        unrolled = [logits for _, logits in unroll(drafter, ids, features, live, steps)]
        for anchor in (0, 3, 7):
            for k, expected in enumerate(_step_by_step(drafter, ids, features, anchor, steps)):
                assert torch.allclose(unrolled[k][0, anchor], expected, atol=1e-5), (anchor, k)
        # the padded row's live slots are row 1 alone, unpadded
        alone = [logits for _, logits in unroll(drafter, ids[1:, :8], features[1:, :8], live[1:, :8], steps)]
        for k in range(steps):
            assert torch.allclose(unrolled[k][1, : 7 - k], alone[k][0, : 7 - k], atol=1e-5), k


def test_the_mask_pattern_by_brute_force():
    live = torch.tensor([[1, 1, 1, 0]])
    pattern = ttt_pattern(live, 2)[0, 0]  # [4, 12]
    for q in range(4):
        for step in range(3):
            for j in range(4):
                want = (j <= q and bool(live[0, j])) or j == q if step == 0 else j == q
                assert bool(pattern[q, step * 4 + j]) == want, (q, step, j)


# ------------------------------------------------------------------------------------------ the trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from specdec.train.presets import FeatureDrafterTrainConfig

    root = target_with_outputs(tmp_path_factory.mktemp("feature"), lambda vocab: _llama(vocab=vocab))
    cfg = FeatureDrafterTrainConfig(target=str(root / "target"), data=str(root / "data.jsonl"), steps=8,
                                    batch_size=4, save_every=2, eval_every=4, ttt_steps=3, lr=3e-3, warmup_steps=1)
    return {"root": root, "cfg": cfg}


def _train(cfg, out, **kw):
    from specdec.train.feature_drafter import train_feature_drafter

    return train_feature_drafter(cfg, out, progress=False, log=lambda m: None, **kw)


def _losses(final) -> list[float]:
    return [h["train_loss"] for h in json.loads((final / "training.json").read_text())["state"]["history"]
            if "train_loss" in h]


def test_the_loss_falls_and_a_resumed_run_equals_the_uninterrupted_one(run, tmp_path):
    from dataclasses import replace

    from safetensors.torch import load_file

    cfg = replace(run["cfg"], steps=40, eval_every=20, save_every=10)
    whole = _train(cfg, tmp_path / "whole")
    history = json.loads((whole / "training.json").read_text())["state"]["history"]
    losses = [h["train_loss"] for h in history if "train_loss" in h]
    assert losses[-1] < 0.8 * losses[0], losses
    assert (whole / "README.md").read_text().count("| 3 |") == 1  # the card's per-depth table
    assert _train(cfg, tmp_path / "split", stop_at_step=13) is None
    torch.manual_seed(99)
    random.random()
    split = _train(cfg, tmp_path / "split")
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the record after the resume averages steps 21-40 in both runs (the one at 20 only the resumed steps 14-20)
    assert _losses(split)[-1] == losses[-1]


def test_bad_input_is_one_line(run, tmp_path):
    from dataclasses import replace

    from specdec.train.feature_drafter import train_feature_drafter

    cfg = run["cfg"]
    for bad, needle in ((replace(cfg, data=str(tmp_path / "none.jsonl")), "no data at"),
                        (replace(cfg, feature_layers="1,2"), "--feature-layers"),
                        (replace(cfg, ttt_steps=0), "--ttt-steps"),
                        (replace(cfg, layout="medusa"), "--layout")):
        with pytest.raises(ValueError, match=needle) as err:
            train_feature_drafter(bad, tmp_path / "out", progress=False, log=lambda m: None)
        assert "\n" not in str(err.value)


def test_the_eagle3_layout_trains_and_exports(run, tmp_path):
    """`--layout eagle3` end to end: trained (the held-out KL falls), then exported (its target found by its config)."""
    from dataclasses import replace

    from specdec import cli

    final = _train(replace(run["cfg"], steps=16, eval_every=4, layout="eagle3"), tmp_path / "run")
    assert json.loads((final / "config.json").read_text())["layout"] == "eagle3"
    kl = [h["val_kl"][0] for h in json.loads((final / "training.json").read_text())["state"]["history"]
          if "val_kl" in h]  # the held-out KL at depth 1, every 4 steps
    assert len(kl) == 4 and kl[-1] < kl[0], kl
    assert cli.main(["export", str(final), "--format", "eagle3", "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_features_of_reads_the_chosen_layers_outputs(pair):
    target, _ = pair
    ids = torch.randint(1, 96, (1, 5))
    seen = {}
    hooks = [layer.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[0] if isinstance(out, tuple)
                                                                                  else out))
             for i, layer in enumerate(target.model.layers)]
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    got = features_of(out.hidden_states, [0, 1, 2])
    assert torch.equal(got, torch.cat([seen[0], seen[1], seen[2]], dim=-1))


def _rounds(accepted: list[tuple[int, int]], depth: int) -> list[float | None]:
    """Acceptance per depth from (drafts accepted, depths scorable) per round."""
    out = []
    for d in range(1, depth + 1):
        reached = sum(1 for n, room in accepted if n >= d - 1 and room >= d)
        hits = sum(1 for n, room in accepted if n >= d and room >= d)
        out.append(round(hits / reached, 4) if reached else None)
    return out


def test_acceptance_per_depth_equals_greedy_rounds_drafted_one_by_one():
    """``measure`` (feature drafter) and ``lm_depths`` (a drafter model), teacher-forced in one pass, against rounds
    drafted token by token from each anchor of the target's greedy continuation, each draft checked against the
    target's greedy next token (a vocabulary of 5, so that random models agree often enough to reach depth 4)."""
    from specdec.train.feature_drafter import measure
    from specdec.train.feature_eval import lm_depths

    target = _llama(vocab=5, seed=3)
    drafter = new_feature_drafter(target, seed=10).eval()
    lm = _llama(layers=1, vocab=5, seed=5)
    depth, prompt = 4, torch.tensor([[1, 3, 4, 2, 1]])
    with torch.no_grad():
        ids = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
        row = ids[0].tolist()
        nxt = target(ids).logits[0].argmax(-1).tolist()  # the target's greedy token after each position
        features, _ = target_pass(target, drafter.config.feature_layers, ids, torch.ones_like(ids))
        rounds, lm_rounds = [], []
        for anchor in range(prompt.shape[1] - 1, len(row) - 1):
            room = len(row) - 1 - anchor  # depths d whose target token (after position anchor + d) is known
            cache = DynamicCache()
            out = drafter(ids[:, 1: anchor + 2], drafter.fuse_features(features[:, : anchor + 1]),
                          past_key_values=cache, use_cache=True)
            n = 0
            for k in range(min(depth, room)):
                draft = int(out.logits[0, -1].argmax())
                if draft != nxt[anchor + k + 1]:
                    break
                n += 1
                out = drafter(torch.tensor([[draft]]), out.hidden[:, -1:], past_key_values=cache, use_cache=True,
                              position_ids=torch.tensor([[anchor + k + 1]]))
            rounds.append((n, room))
            seq, m = row[: anchor + 2], 0
            for k in range(min(depth, room)):
                draft = int(lm(torch.tensor([seq])).logits[0, -1].argmax())
                if draft != nxt[anchor + k + 1]:
                    break
                seq, m = seq + [draft], m + 1
            lm_rounds.append((m, room))
    expected, lm_expected = _rounds(rounds, depth), _rounds(lm_rounds, depth)
    assert all(a is not None and 0 < a < 1 for a in expected + lm_expected), (expected, lm_expected)
    assert measure(drafter, target, [(row, prompt.shape[1])], depth)["acceptance"] == expected
    assert lm_depths(lm, target, [(row, prompt.shape[1])], depth)["acceptance"] == lm_expected


def test_init_from_starts_a_stage_from_an_earlier_drafter(run, tmp_path):
    from dataclasses import replace

    from safetensors.torch import load_file

    first = _train(replace(run["cfg"], steps=3), tmp_path / "one")
    second = _train(replace(run["cfg"], steps=1, lr=0.0, init_from=str(first)), tmp_path / "two")  # lr 0: unchanged
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "Continued from" in (second / "README.md").read_text()
    with pytest.raises(ValueError, match="--feature-layers"):
        _train(replace(run["cfg"], steps=1, init_from=str(first), feature_layers="0,1,3"), tmp_path / "three")
