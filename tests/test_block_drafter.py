"""The block drafter model (SpecDec, causal cached prefix) and its training, on tiny random configs.

Checked against independent references: the attention pattern against a rule written as loops,
the cached/ragged forward against each row run alone without a cache, the packed training layout
against one-block forwards, the hidden-state alignment against a direct target forward.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import build_tiny, char_tokenizer
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import AutoConfig, AutoModel, DynamicCache

import specdec
from specdec.drafters.block_model import BlockDrafterConfig, BlockDrafterModel, BlockLayout
from specdec.train.block import build_block_drafter, lr_at, make_optimizer, train_block_drafter
from specdec.train.block_data import (
    HIDDEN_SPAN,
    IGNORE,
    Record,
    batch_at,
    glance,
    glancing_loss,
    load_records,
    pack_blocks,
    step_generator,
    target_hidden_states,
)
from specdec.train.block_eval import block_acceptance
from specdec.train.presets import BlockTrainConfig

V = 40  # vocabulary of the tiny models


def tiny_drafter(seed: int = 0, **kw) -> BlockDrafterModel:
    settings = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4,
                    "max_position_embeddings": 128, "pad_token_id": 0, "max_block_size": 6, "tie_word_embeddings": True,
                    "initializer_range": 0.3}
    settings.update(kw)
    torch.manual_seed(seed)
    return BlockDrafterModel(BlockDrafterConfig(**settings)).eval()


def reference_pattern(live: list[list[int]], past: int, n: int, k: int) -> torch.Tensor:
    """The rule, written as loops: a prefix query sees live prefix slots up to itself; a block query
    sees every live prefix slot (cached or input) and every live slot of the block; each query sees
    itself. [B, 1, n, past + n]"""
    out = torch.zeros(len(live), 1, n, past + n, dtype=torch.bool)
    first_block = past + n - k
    for b, row in enumerate(live):
        for i in range(n):
            q = past + i
            for s in range(past + n):
                if s == q:
                    out[b, 0, i, s] = True
                elif not row[s]:
                    continue
                elif q < first_block:
                    out[b, 0, i, s] = s <= q
                else:
                    out[b, 0, i, s] = True  # every prefix slot precedes the block; block slots are its own
    return out


def test_attention_pattern_causal_prefix_bidirectional_block_dead_slots_excluded():
    past, n, k = 5, 6, 3
    live = [[1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1],  # a hole in the cached slots
            [0, 0, 1, 1, 0, 1, 0, 1, 1, 1, 1]]  # left padding, a hole, a dead input slot
    layout = BlockLayout.trailing(2, n, k, past)
    got = layout.allowed(torch.tensor(live))
    assert torch.equal(got, reference_pattern(live, past, n, k))
    # spot checks of the rule itself
    assert not got[0, 0, 0, past + 1]  # the first input does not see the second (causal)
    assert got[0, 0, n - k, past + n - 1]  # the block's first position sees its last (bidirectional)
    assert not got[0, 0, n - 1, 1] and not got[1, 0, n - 1, 4]  # dead slots are never seen


def test_bidirectional_prefix_rule_sees_all_live_prefix_slots():
    layout = BlockLayout.trailing(1, 5, 2, 0)
    got = layout.allowed(torch.tensor([[1, 1, 0, 1, 1]]), "bidirectional")[0, 0]
    assert got[0, 1] and not got[0, 2] and not got[0, 3]  # prefix sees later prefix slots, never the block
    assert got[3, 0] and got[3, 4] and not got[3, 2]


def test_block_outputs_depend_on_the_right_inputs():
    model = tiny_drafter()
    ids = torch.randint(1, V, (1, 10))
    k = 4
    revealed = torch.zeros(1, 10, dtype=torch.bool)
    revealed[0, 7] = True  # read the token at block position 1 (glancing's input)
    base = model(ids, block_size=k, revealed=revealed, output_hidden_states=True)
    changed = ids.clone()
    changed[0, 7] = (ids[0, 7] % (V - 1)) + 1
    other = model(changed, block_size=k, revealed=revealed, output_hidden_states=True)
    diff = (base.logits - other.logits).abs().amax(-1)[0]  # [n]
    assert diff[6] > 1e-4 and diff[9] > 1e-4  # block positions before and after it see it
    assert diff[:6].max() == 0  # the prefix never sees the block
    masked = ids.clone()
    masked[0, 8] = (ids[0, 8] % (V - 1)) + 1  # not revealed: its id is ignored
    assert torch.equal(model(masked, block_size=k, revealed=revealed).logits, base.logits)
    later = ids.clone()
    later[0, 5] = (ids[0, 5] % (V - 1)) + 1
    diff = (model(later, block_size=k).logits - model(ids, block_size=k).logits).abs().amax(-1)[0]
    assert diff[:5].max() == 0 and diff[5:].min() > 1e-4  # causal prefix; the block sees the whole prefix


def _alone(model: BlockDrafterModel, tokens: list[int], k: int) -> torch.Tensor:
    """Block logits of one row fed whole, without a cache. [k, V]"""
    ids = torch.tensor([tokens + [model.config.mask_token_id] * k])
    return model(ids, block_size=k, logits_to_keep=k).logits[0]


def test_cached_ragged_rows_equal_each_row_alone():
    """Rows with holes in their cache slots and left padding draft as they would alone."""
    model = tiny_drafter(seed=1)
    k = 3
    rows = [torch.randint(1, V, (9,)).tolist(), torch.randint(1, V, (6,)).tolist()]
    cache = DynamicCache(config=model.config)
    # slots: row 0 = its first 5 tokens, then 2 dead slots (rejected drafts), then 2 more tokens;
    # row 1 = 2 dead slots (left padding), then its first 5 tokens, then 2 dead slots
    first = torch.tensor([rows[0][:5] + [7, 8], [0, 0] + rows[1][:5]])
    live0 = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]])
    pos0 = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4]])
    model(first, attention_mask=live0, position_ids=pos0, past_key_values=cache, use_cache=True)
    live0 = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]])  # row 0 rejected its 2 drafts
    second = torch.tensor([rows[0][5:7] + [0] * k, [0, rows[1][5]] + [0] * k])  # row 1: one token, padded
    live1 = torch.tensor([[1, 1] + [1] * k, [0, 1] + [1] * k])
    pos1 = torch.tensor([[5, 6, 7, 8, 9], [5, 5, 6, 7, 8]])
    out = model(second, attention_mask=torch.cat([live0, live1], 1), position_ids=pos1, past_key_values=cache,
                use_cache=True, block_size=k, logits_to_keep=k)
    assert cache.get_seq_length() == 7 + 2 + k  # the block's slots are in the cache: the caller crops them
    torch.testing.assert_close(out.logits[0], _alone(model, rows[0][:7], k), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[1], _alone(model, rows[1][:6], k), atol=1e-5, rtol=1e-5)
    cache.crop(-k)
    third = torch.tensor([[rows[0][7]] + [0] * k, [rows[1][0]] + [0] * k])  # row 1 re-reads a token: a new sequence
    out = model(third, attention_mask=torch.cat([live0, live1[:, :2], torch.ones(2, 1 + k, dtype=torch.long)], 1),
                position_ids=torch.tensor([[7, 8, 9, 10], [6, 7, 8, 9]]), past_key_values=cache, use_cache=True,
                block_size=k, logits_to_keep=k)
    torch.testing.assert_close(out.logits[0], _alone(model, rows[0][:8], k), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[1], _alone(model, rows[1][:6] + [rows[1][0]], k), atol=1e-5, rtol=1e-5)


def test_packed_training_layout_equals_one_block_forwards():
    model = tiny_drafter(seed=2, target_hidden_size=8)
    records = [Record(torch.randint(1, V, (14,)), 5), Record(torch.randint(1, V, (11,)), 4)]
    anchors = [torch.tensor([4, 9, 6]), torch.tensor([3, 3, 8])]
    hidden = [torch.randn(3, 8), torch.randn(3, 8)]
    k = 4
    batch = pack_blocks(records, anchors, k, seq_len=64, hidden=hidden)
    n_block = 3 * k
    logits = model(batch.input_ids, attention_mask=batch.live.long(), position_ids=batch.position_ids,
                   layout=batch.layout, target_hidden=batch.target_hidden, logits_to_keep=n_block).logits
    for b, (r, a) in enumerate(zip(records, anchors)):
        for c, anchor in enumerate(a.tolist()):
            ids = torch.cat([r.ids[: anchor + 1], torch.zeros(k, dtype=torch.long)])[None]
            alone = model(ids, block_size=k, logits_to_keep=k, target_hidden=hidden[b][c : c + 1]).logits[0]
            torch.testing.assert_close(logits[b, c * k : (c + 1) * k], alone, atol=1e-5, rtol=1e-5)
            known = [t for t in r.ids[anchor + 1 : anchor + 1 + k].tolist()]
            labels = batch.labels[b, -n_block:][c * k : (c + 1) * k].tolist()
            assert labels == known + [IGNORE] * (k - len(known))  # nothing past the record's end


def test_save_load_round_trip_through_auto_classes(tmp_path):
    model = tiny_drafter(seed=3, draft_vocab_size=16, tie_word_embeddings=False, target_hidden_size=8)
    with torch.no_grad():
        model.draft_vocab.copy_(torch.randperm(V)[:16].sort().values)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.bin"))
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, BlockDrafterConfig) and config.model_type == "specdec-block-drafter"
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, BlockDrafterModel)
    assert isinstance(specdec.load_model(str(tmp_path), device="cpu"), BlockDrafterModel)  # AutoModelForCausalLM
    assert torch.equal(loaded.draft_vocab, model.draft_vocab)
    ids = torch.randint(1, V, (2, 9))
    h = torch.randn(2, 8)
    a = model(ids, block_size=5, logits_to_keep=5, target_hidden=h).logits
    b = loaded(ids, block_size=5, logits_to_keep=5, target_hidden=h).logits
    assert torch.equal(a, b)
    # tokens outside the drafting head are never drafted
    outside = torch.ones(V, dtype=torch.bool)
    outside[model.draft_vocab] = False
    assert (a[..., outside] == torch.finfo(a.dtype).min).all()
    assert outside.logical_not()[a.argmax(-1)].all()


def test_bad_block_sizes_and_configs_are_refused():
    model = tiny_drafter()
    ids = torch.randint(1, V, (1, 10))
    with pytest.raises(ValueError, match="outside 0..6"):
        model(ids, block_size=7)
    with pytest.raises(ValueError, match="append 5 mask tokens"):
        model(ids[:, :4], block_size=5)
    with pytest.raises(ValueError, match="target_hidden"):
        model(ids, block_size=3, target_hidden=torch.randn(1, 8))
    # transformers' strict configs wrap a validator's ValueError in StrictDataclassClassValidationError
    with pytest.raises(StrictDataclassClassValidationError, match="tie_word_embeddings=False"):
        BlockDrafterConfig(vocab_size=V, draft_vocab_size=8, tie_word_embeddings=True)
    with pytest.raises(StrictDataclassClassValidationError, match="prefix_attention"):
        BlockDrafterConfig(vocab_size=V, prefix_attention="sideways")


def _records(n: int, seed: int = 0) -> list[Record]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(3, 10, (1,), generator=gen))
        cont = torch.randint(3, V, (int(torch.randint(6, 16, (1,), generator=gen)),), generator=gen)
        cont[3:] = cont[:3].repeat(5)[: len(cont) - 3]  # learnable: the continuation repeats with period 3
        out.append(Record(torch.cat([torch.randint(3, V, (p,), generator=gen), cont]), p))
    return out


def test_glancing_reveals_floor_of_wrong_times_ratio_labelled_positions():
    records = _records(4)
    cfg = BlockTrainConfig(batch_size=4, block_tokens=12, max_block_size=5, seq_len=64)
    gen = step_generator(0, 0)
    batch = batch_at(records, 0, cfg, gen=gen)
    n_block = int((batch.layout.block >= 0).sum(1).max())
    k = batch.block_size
    predictions = torch.full_like(batch.labels, IGNORE)
    predictions[:, -n_block:] = torch.randint(0, V, (4, n_block), generator=gen)
    labels = batch.labels[:, -n_block:].view(4, -1, k)
    wrong = ((predictions[:, -n_block:].view(4, -1, k) != labels) & (labels != IGNORE)).sum(-1)
    for ratio in (0.0, 0.3, 0.5, 1.0):
        revealed = glance(batch, predictions, ratio, torch.Generator().manual_seed(1))
        assert not revealed[:, :-n_block].any()  # prefix positions are never "revealed"
        per_block = revealed[:, -n_block:].view(4, -1, k)
        assert torch.equal(per_block.sum(-1), torch.floor(wrong * ratio).long())
        assert not (per_block & (labels == IGNORE)).any()  # only positions with a real token


def test_training_steps_lower_the_loss_on_a_fixed_batch():
    model = tiny_drafter(seed=4).train()
    records = _records(6)
    cfg = BlockTrainConfig(batch_size=6, block_tokens=12, max_block_size=4, seq_len=64, lr=3e-3, warmup_steps=1)
    batch = batch_at(records, 0, cfg)
    opt = make_optimizer(model, cfg)
    losses = []
    for _ in range(15):
        loss, _ = glancing_loss(model, batch, 0.0, torch.Generator().manual_seed(0), 0.1, autocast=False,
                                prefix_weight=0.5)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


@pytest.fixture(scope="module")
def tiny_target_run(tmp_path_factory):
    """A tiny Llama target with a tokenizer, and a `specdec train outputs`-style file of records."""
    root = tmp_path_factory.mktemp("block")
    tok = char_tokenizer()
    target = build_tiny("llama", vocab_size=len(tok), hidden=32, layers=1, eos_token_id=tok.eos_token_id)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    lines = []
    for i, r in enumerate(_records(24, seed=5)):
        ids = (r.ids % len(tok)).tolist()
        lines.append({"id": f"r{i}", "prompt_ids": ids[: r.prompt_len], "ids": ids[r.prompt_len :],
                      "temperature": 1.0 if i % 4 == 3 else 0.0})
    (root / "outputs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root, target


def _tiny_cfg(root, **kw) -> BlockTrainConfig:
    return BlockTrainConfig(target=str(root / "target"), init_from=None, outputs=str(root / "outputs.jsonl"),
                            valid=str(root / "outputs.jsonl"), valid_records=4, hidden_size=16,
                            num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, max_block_size=4,
                            draft_vocab_size=20, condition_on_target=True, block_tokens=8, seq_len=32,
                            batch_size=3, max_steps=6, warmup_steps=2, eval_every=3, save_every=2, **kw)


def test_resume_gives_the_same_state_as_an_uninterrupted_run(tiny_target_run, tmp_path):
    root, _ = tiny_target_run
    cfg = _tiny_cfg(root)
    whole = train_block_drafter(cfg, tmp_path / "whole", log=lambda *_: None, progress=False)
    assert train_block_drafter(cfg, tmp_path / "split", stop_at_step=3, log=lambda *_: None, progress=False) is None
    split = train_block_drafter(cfg, tmp_path / "split", log=lambda *_: None, progress=False)
    a, b = AutoModel.from_pretrained(whole), AutoModel.from_pretrained(split)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    history = json.loads((split / "training.json").read_text())["state"]["history"]
    assert [h["step"] for h in history if "tau_k4" in h] == [3, 6]
    assert a.config.target_hidden_size == 32 and a.config.draft_vocab_size == 20


def test_init_from_a_causal_lm_copies_its_layers_and_head_rows(tiny_target_run):
    root, target = tiny_target_run
    init = build_tiny("llama", vocab_size=target.config.vocab_size, hidden=16, layers=1, seed=7)
    draft_vocab = torch.tensor([0, 2, 5, 9])
    model = build_block_drafter(_tiny_cfg(root), target, draft_vocab, init)
    assert model.config.hidden_size == 16 and model.config.num_key_value_heads == 2
    for name, p in init.model.state_dict().items():
        assert torch.equal(model.model.state_dict()[name], p), name
    assert torch.equal(model.lm_head.weight, init.lm_head.weight[draft_vocab])
    # the prefix is the initial model's causal stack: its last state is the initial model's
    ids = torch.randint(1, target.config.vocab_size, (1, 7))
    with torch.no_grad():
        ours = model(ids, output_hidden_states=True).hidden_states[-1]
        theirs = init(ids, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(ours, theirs)
    with pytest.raises(ValueError, match="vocabulary"):
        build_block_drafter(_tiny_cfg(root), target, None, build_tiny("llama", vocab_size=50, hidden=16, layers=1))


def test_records_are_greedy_only_and_hidden_states_align_with_the_target(tiny_target_run):
    root, target = tiny_target_run
    records = load_records(root / "outputs.jsonl")
    assert len(records) == 18  # every 4th of 24 was sampled
    hidden = target_hidden_states(target, records[:3], batch_size=2)  # [3, HIDDEN_SPAN, H]
    for i, r in enumerate(records[:3]):
        with torch.no_grad():
            direct = target(r.ids[None], output_hidden_states=True).hidden_states[-1][0]  # [T, H]
        p = r.prompt_len
        for a in (p - 1, len(r.ids) - 2):  # the block after ids[a] reads the state that produced ids[a]
            torch.testing.assert_close(hidden[i, a - p + 1].float(), direct[a - 1], atol=2e-2, rtol=2e-2)
        assert hidden[i, len(r.ids) - p :].abs().sum() == 0 and HIDDEN_SPAN > len(r.ids) - p


def test_acceptance_counts_the_longest_correct_prefix():
    """A drafter whose head always says token 5: tau is 1 + the mean run of 5s after each anchor."""
    model = tiny_drafter(seed=6)
    bias = torch.zeros(V)
    bias[5] = 1.0
    model.lm_head.forward = lambda h: torch.zeros(*h.shape[:-1], V) + bias  # type: ignore[method-assign]
    r = Record(torch.tensor([9, 9, 9, 5, 5, 5, 9, 5, 5, 9, 9, 9, 9, 9]), 3)
    acc = block_acceptance(model, [r], [2, 4], horizon=4)[4]
    anchors = range(2, len(r.ids) - 4)  # anchors whose next 4 tokens are known
    runs = []
    for a in anchors:
        n = 0
        while n < 4 and r.ids[a + 1 + n] == 5:
            n += 1
        runs.append(n)
    assert acc.blocks == len(runs)
    assert acc.tau == pytest.approx(1 + sum(runs) / len(runs))
    assert acc.position_acceptance[0] == pytest.approx(sum(n >= 1 for n in runs) / len(runs))


def test_reschedule_ends_a_resumed_run_at_the_new_max_steps(tiny_target_run, tmp_path):
    root, _ = tiny_target_run
    cfg = _tiny_cfg(root)
    quiet = {"log": lambda *_: None, "progress": False}
    with pytest.raises(ValueError, match="resumed run"):
        train_block_drafter(cfg, tmp_path / "fresh", reschedule_to=4, **quiet)
    assert train_block_drafter(cfg, tmp_path / "run", stop_at_step=2, **quiet) is None
    final = train_block_drafter(cfg, tmp_path / "run", reschedule_to=4, **quiet)
    record = json.loads((final / "training.json").read_text())
    assert record["config"]["max_steps"] == 4 and record["state"]["step"] == 4
    # the last step ran at the new schedule's lr (the old one's at step 3 of 6 would be higher)
    assert record["state"]["history"][-1]["lr"] == pytest.approx(lr_at(3, replace(cfg, max_steps=4)), abs=1e-6)
    assert lr_at(3, replace(cfg, max_steps=4)) < lr_at(3, cfg)
