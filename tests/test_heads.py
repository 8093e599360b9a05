"""The SpecDec++ acceptance head (issue 18): model, data labels, training, data parallelism, stop rule.

- The head: each residual block has its own weights; save/load round trip; clear errors.
- Labels: on a pair of bigram tables (logits depend on the last token only), every draft token and
  label is checked against numbers computed by hand in the test; the mixed inputs and the hidden
  state each example reads are checked too. On a tiny Llama pair, the batched, padded build equals
  a per-record computation from scratch.
- Training: steps lower the loss on a learnable synthetic task; stop + resume ends in the same
  weights as an uninterrupted run; two processes on gloo (torchrun) end in the weights of one.
- The stop rule (one rule: ``specdec.schedules.Ada``; the offline ``draft_lengths`` drives it with
  precomputed values): product with a_1 := 1, bounds, per-row decisions, against a plain Python loop,
  and the ada schedule with a real head drafts the lengths ``draft_lengths`` predicts.
- Rounds for the offline simulation: drafts, labels and hidden states of every start equal a
  recomputation from scratch; the expected accepted length and the greedy walk on hand examples.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from specdec.heads.data import (
    LABEL_KINDS,
    HeadDataConfig,
    Record,
    build_head_data,
    draft_and_label,
    examples_of_batch,
    load_head_data,
    record_generator,
    write_meta,
    write_shard,
)
from specdec.heads.evaluate import RoundData, draft_lengths, expected_accepted, record_rounds, walk
from specdec.heads.model import AcceptanceHead, HeadConfig
from specdec.heads.train import HeadTrainConfig, train_head, weighted_soft_ce

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- the head


def test_blocks_have_distinct_weights():
    head = AcceptanceHead(HeadConfig(hidden_size=12, num_blocks=3))
    weights = [b.linear.weight for b in head.blocks]
    assert len({w.data_ptr() for w in weights}) == 3
    assert not torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])
    assert sum(p.numel() for p in head.parameters()) == 3 * (12 * 12 + 12) + 12 * 2 + 2
    with torch.no_grad():  # changing one block leaves the others as they were
        before = weights[2].clone()
        weights[0].add_(1.0)
    assert torch.equal(weights[2], before)
    keys = [k for k in head.state_dict() if k.startswith("blocks.")]
    assert len(keys) == 6  # weight + bias of three blocks, each stored


def test_forward_is_residual_blocks_then_linear():
    head = AcceptanceHead(HeadConfig(hidden_size=5, num_blocks=2))
    x = torch.randn(4, 5)
    h = x
    for block in head.blocks:
        h = h + torch.nn.functional.silu(h @ block.linear.weight.T + block.linear.bias)
    expected = h @ head.out.weight.T + head.out.bias
    assert torch.allclose(head(x), expected, atol=1e-6)
    assert torch.allclose(head.accept_probability(x), expected.softmax(-1)[:, 1], atol=1e-6)


def test_save_and_load_round_trip_and_errors(tmp_path):
    head = AcceptanceHead(HeadConfig(hidden_size=8, num_blocks=3, labels="greedy"))
    head.save_pretrained(tmp_path / "h")
    assert json.loads((tmp_path / "h" / "config.json").read_text())["num_blocks"] == 3
    loaded = AcceptanceHead.from_pretrained(tmp_path / "h", hidden_size=8)
    x = torch.randn(3, 8)
    assert torch.equal(loaded(x), head(x)) and loaded.config == head.config
    with pytest.raises(FileNotFoundError, match="no acceptance head at"):
        AcceptanceHead.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="reads hidden states of size 8, but the drafter has hidden size 16"):
        AcceptanceHead.from_pretrained(tmp_path / "h", hidden_size=16)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not an acceptance head's config"):
        AcceptanceHead.from_pretrained(tmp_path / "model")


# ---------------------------------------------------------------- labels on bigram tables


class BigramConfig(PretrainedConfig):
    model_type = "specdec-test-bigram"

    def __init__(self, vocab_size: int = 4, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = vocab_size
        self.max_position_embeddings = 1024
        super().__init__(**kwargs)


class BigramLM(PreTrainedModel):
    """logits = log(table[last token]); the hidden state is the one-hot of the input token."""

    config_class = BigramConfig

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__(BigramConfig(vocab_size=table.shape[0]))
        self.log_table = nn.Parameter(table.log(), requires_grad=False)

    def forward(self, input_ids, output_hidden_states=False, logits_to_keep=0, **kwargs):
        hidden = nn.functional.one_hot(input_ids, self.config.vocab_size).float()  # [B, T, V]
        logits = self.log_table[input_ids]  # [B, T, V]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=logits, hidden_states=(hidden,) if output_hidden_states else None)


# p(next | last) of the target and q(next | last) of the drafter, on tokens 0..3
P = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.5, 0.1, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25], [0.1, 0.1, 0.1, 0.7]])
Q = torch.tensor([[0.1, 0.3, 0.5, 0.1], [0.6, 0.2, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4], [0.05, 0.05, 0.1, 0.8]])


def test_greedy_labels_by_hand():
    target, drafter = BigramLM(P), BigramLM(Q)
    record = Record(0, prompt=[3, 0], response=[1, 0, 2, 3])  # contexts of the 4 response tokens: 0, 1, 0, 2
    out = examples_of_batch(target, drafter, [record], ("greedy",), mixing=0.0, seed=0)
    # argmax Q per context 0, 1, 0, 2 -> drafts 2, 0, 2, 3; argmax P -> 1, 0, 1, (0..3 tie: first, 0)
    assert out["label"].tolist() == [0.0, 1.0, 0.0, 0.0]
    # every position was fed its draft (no mixing): the state at position j reads draft j (one-hot)
    assert out["hidden"].float().argmax(-1).tolist() == [2, 0, 2, 3]
    assert out["position"].tolist() == [0, 1, 2, 3] and out["kind"].tolist() == [0] * 4


def test_sampling_labels_by_hand():
    target, drafter = BigramLM(P), BigramLM(Q)
    record = Record(5, prompt=[3, 0], response=[1, 0, 2, 3])
    out = examples_of_batch(target, drafter, [record], ("sampling",), mixing=0.0, seed=0)
    drafts = out["hidden"].float().argmax(-1).tolist()  # the drafted tokens, read back from the one-hot states
    contexts = [0, 1, 0, 2]
    # min(1, p/q) of each (context, draft), written out: the table of all 16 values
    table = {(0, 0): 1.0, (0, 1): 1.0, (0, 2): 0.4, (0, 3): 1.0,
             (1, 0): 5 / 6, (1, 1): 0.5, (1, 2): 1.0, (1, 3): 1.0,
             (2, 0): 1.0, (2, 1): 1.0, (2, 2): 0.25 / 0.3, (2, 3): 0.625}
    expected = [table[(c, d)] for c, d in zip(contexts, drafts)]
    assert out["label"].tolist() == pytest.approx(expected, abs=1e-6)
    # the drafts are q's draws with the record's own generator, position by position
    g = record_generator(0, 5, "sampling")
    assert drafts == torch.multinomial(Q[contexts].log().softmax(-1), 1, generator=g)[:, 0].tolist()


def test_sampling_drafts_follow_q_and_labels_average_to_alpha():
    p_logits, q_logits = P.log().repeat(4000, 1), Q.log().repeat(4000, 1)  # [16000, V]: 4000 x each context
    draft, label = draft_and_label(p_logits, q_logits, "sampling", torch.Generator().manual_seed(1))
    freq = torch.stack([torch.bincount(draft.view(4000, 4)[:, c], minlength=4) / 4000 for c in range(4)])  # [4, V]
    assert torch.allclose(freq, Q, atol=0.025)  # drafts are draws from q
    alpha = torch.minimum(P, Q).sum(-1)  # E_{d~q}[min(1, p/q)] = sum min(p, q)
    assert torch.allclose(label.view(4000, 4).mean(0), alpha, atol=0.02)


def test_mixing_keeps_target_tokens_and_drops_their_examples():
    target, drafter = BigramLM(P), BigramLM(Q)
    record = Record(3, prompt=[2], response=[0, 1, 2, 3, 0, 1, 2, 3] * 25)  # 200 positions
    out = examples_of_batch(target, drafter, [record], ("greedy",), mixing=0.3, seed=4)
    n = len(record.response)
    kept = sorted(set(range(n)) - set(out["position"].tolist()))
    assert 0.2 * n < len(kept) < 0.4 * n
    contexts = [record.prompt[-1]] + record.response[:-1]
    drafts = Q[contexts].argmax(-1)  # [n] greedy drafts of the teacher-forced contexts
    # each example's state reads the draft at its position; its label is that draft's greedy acceptance
    pos = out["position"].long()
    assert torch.equal(out["hidden"].float().argmax(-1), drafts[pos])
    assert torch.equal(out["label"], (drafts == P[contexts].argmax(-1)).float()[pos])


def test_response_inputs_read_the_state_behind_each_draft():
    target, drafter = BigramLM(P), BigramLM(Q)
    record = Record(0, prompt=[3, 0], response=[1, 0, 2, 3])  # contexts of the 4 response tokens: 0, 1, 0, 2
    out = examples_of_batch(target, drafter, [record], ("greedy", "sampling"), mixing=0.5, seed=0,
                            inputs="response")
    # no mixing: every position is an example, for each kind; the state is the one whose logits give
    # q_j (one-hot of its input: the context token), not the draft's
    assert out["position"].tolist() == [0, 1, 2, 3] * 2 and out["kind"].tolist() == [0] * 4 + [1] * 4
    assert out["hidden"].float().argmax(-1).tolist() == [0, 1, 0, 2] * 2
    assert out["label"][:4].tolist() == [0.0, 1.0, 0.0, 0.0]  # as in test_greedy_labels_by_hand
    mixed = examples_of_batch(target, drafter, [record], ("sampling",), mixing=0.0, seed=0)
    assert torch.equal(out["label"][4:], mixed["label"])  # the same draws and labels as the mixed build
    with pytest.raises(ValueError, match="inputs must be one of mixed, response"):
        HeadDataConfig(outputs="x.jsonl", inputs="teacher")


# ---------------------------------------------------------------- labels on a tiny Llama pair


def tiny_llama(hidden: int, layers: int, seed: int, vocab: int = 48) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama_pair():
    return tiny_llama(32, 2, seed=0), tiny_llama(16, 1, seed=1)


def random_records(n: int, seed: int = 0) -> list[Record]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        m, k = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
        ids = torch.randint(3, 48, (m + k,), generator=g).tolist()
        out.append(Record(i, ids[:m], ids[m:], 0.0))
    return out


@pytest.mark.parametrize("kind", LABEL_KINDS)
def test_batched_build_equals_each_record_from_scratch(llama_pair, kind):
    target, drafter = llama_pair
    records = random_records(5)
    out = examples_of_batch(target, drafter, records, (kind,), mixing=0.25, seed=3)
    at = 0
    for r in records:
        with torch.no_grad():
            seq = torch.tensor([r.prompt + r.response])
            p = target(seq).logits[0, len(r.prompt) - 1 : -1].softmax(-1)  # [n, V]
            q = drafter(seq).logits[0, len(r.prompt) - 1 : -1].softmax(-1)
        g = record_generator(3, r.index, kind)
        d = q.argmax(-1) if kind == "greedy" else torch.multinomial(q, 1, generator=g)[:, 0]
        kept = torch.rand(len(r.response), generator=g) < 0.25
        z = torch.where(kept, torch.tensor(r.response), d)
        for j in range(len(r.response)):
            if kept[j]:
                continue
            label = float(d[j] == p[j].argmax()) if kind == "greedy" else min(1.0, float(p[j, d[j]] / q[j, d[j]]))
            with torch.no_grad():  # the state at z_j, computed on the prefix alone
                h = drafter(torch.tensor([r.prompt + z[: j + 1].tolist()]),
                            output_hidden_states=True).hidden_states[-1][0, -1]
            assert int(out["record"][at]) == r.index and int(out["position"][at]) == j
            assert float(out["label"][at]) == pytest.approx(label, abs=1e-5)
            assert torch.allclose(out["hidden"][at].float(), h, atol=2e-3)
            at += 1
    assert at == len(out["label"])


# ---------------------------------------------------------------- training


def synthetic_data(folder: Path, n: int = 3000, hidden: int = 8, seed: int = 0) -> Path:
    """A head data folder whose labels are a logistic function of the hidden state (learnable)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    label = torch.sigmoid(3 * h[:, 0] - 2 * h[:, 1] + 1.0)
    kind = (torch.arange(n) % 2).to(torch.uint8)
    label = torch.where(kind == 0, (label > 0.5).float(), label)  # greedy examples get 0/1 labels
    folder.mkdir(parents=True)
    write_meta(folder, {"drafter": "synthetic"}, hidden)
    for i, lo in enumerate(range(0, n, 1000)):
        sl = slice(lo, lo + 1000)
        write_shard(folder, i, 10, {"hidden": h[sl].half(), "label": label[sl], "kind": kind[sl],
                                    "record": torch.arange(n, dtype=torch.int32)[sl],
                                    "position": torch.zeros(n, dtype=torch.int16)[sl]})
    return folder


def test_weighted_loss_matches_specdecpp_formula():
    logits, label = torch.randn(6, 2), torch.rand(6)
    num, den = weighted_soft_ce(logits, label, 6.0)
    logp = logits.log_softmax(-1)
    expected = sum(-(6 * (1 - label[i]) * logp[i, 0] + label[i] * logp[i, 1]) for i in range(6))
    assert float(num) == pytest.approx(float(expected), rel=1e-5)
    assert float(den) == pytest.approx(float((6 * (1 - label) + label).sum()), rel=1e-6)


def test_training_lowers_the_loss(tmp_path):
    data = synthetic_data(tmp_path / "data")
    cfg = HeadTrainConfig(data=str(data), valid=str(data), batch_size=256, max_steps=60, warmup_steps=5,
                          eval_every=60, save_every=60, lr=3e-3)
    from specdec.heads.train import evaluate_loss

    torch.manual_seed(cfg.seed)
    before = evaluate_loss(AcceptanceHead(HeadConfig(hidden_size=8)), load_head_data(data), 6.0)["loss"]
    final = train_head(cfg, tmp_path / "run", show_progress=False, log=lambda _m: None)
    after = evaluate_loss(AcceptanceHead.from_pretrained(final), load_head_data(data), 6.0)["loss"]
    assert after < 0.6 * before, (before, after)
    history = json.loads((final / "training.json").read_text())["history"]
    assert set(history[-1]["valid"]) == {"greedy", "sampling"} and history[-1]["step"] == 60


def test_resume_ends_where_an_uninterrupted_run_ends(tmp_path):
    data = synthetic_data(tmp_path / "data")
    cfg = HeadTrainConfig(data=str(data), batch_size=128, max_steps=20, warmup_steps=3, save_every=7)
    quiet = {"show_progress": False, "log": lambda _m: None}
    assert train_head(cfg, tmp_path / "split", stop_at_step=10, **quiet) is None
    assert json.loads((tmp_path / "split" / "checkpoint" / "state.json").read_text())["state"]["step"] == 10
    split = train_head(cfg, tmp_path / "split", **quiet)
    whole = train_head(cfg, tmp_path / "whole", **quiet)
    a, b = load_file(str(split / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_gloo_processes_agree_with_one(tmp_path):
    data = synthetic_data(tmp_path / "data")
    flags = ["--data", str(data), "--batch-size", "200", "--max-steps", "8", "--warmup-steps", "2", "--lr", "0.01"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "-m", "specdec", "train", "head", "--out", str(tmp_path / "two"), *flags],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = HeadTrainConfig(data=str(data), batch_size=200, max_steps=8, warmup_steps=2, lr=0.01)
    one = train_head(cfg, tmp_path / "one", show_progress=False, log=lambda _m: None)
    two = json.loads((tmp_path / "two" / "final" / "training.json").read_text())
    assert two["processes"] == 2
    a, b = load_file(str(one / "model.safetensors")), load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    for k in a:
        assert torch.allclose(a[k], b[k], atol=2e-5), (k, (a[k] - b[k]).abs().max())
    losses_one = [r["train_loss"] for r in json.loads((one / "training.json").read_text())["history"]]
    assert losses_one == pytest.approx([r["train_loss"] for r in two["history"]], abs=1e-4)


def test_cli_builds_data_and_trains_on_a_tiny_pair(tmp_path, llama_pair):
    target, drafter = llama_pair
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    lines = [json.dumps({"id": str(r.index), "prompt_ids": r.prompt, "ids": r.response, "temperature": float(i % 2)})
             for i, r in enumerate(random_records(12, seed=1))]
    (tmp_path / "out.jsonl").write_text("\n".join(lines) + "\n")
    from specdec.cli import main

    args = ["train", "head", "--out", str(tmp_path / "run"), "--outputs", str(tmp_path / "out.jsonl"),
            "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--shard-records", "5",
            "--max-steps", "3", "--batch-size", "32", "--warmup-steps", "1"]
    assert main(args) == 0
    data = load_head_data(tmp_path / "run" / "data")
    assert set(data.record.tolist()) == set(range(12)) and set(data.kind.tolist()) == {0, 1}
    assert len(list((tmp_path / "run" / "data").glob("shard-*"))) == 3
    head = AcceptanceHead.from_pretrained(tmp_path / "run" / "final", hidden_size=16)
    assert head.config.labels == "greedy+sampling"
    # a second build with other settings into the same folder is refused, naming the problem
    with pytest.raises(ValueError, match="another build"):
        build_head_data(HeadDataConfig(outputs=str(tmp_path / "out.jsonl"), target=str(tmp_path / "target"),
                                       drafter=str(tmp_path / "drafter"), mixing=0.5, shard_records=5),
                        tmp_path / "run" / "data")


def test_cli_errors_are_one_line(tmp_path, capsys):
    from specdec.cli import main

    assert main(["train", "head", "--out", str(tmp_path / "run")]) == 2
    assert "give --outputs" in capsys.readouterr().err
    assert main(["train", "head", "--out", str(tmp_path / "run"), "--outputs", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "no generated outputs" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- the stop rule


def reference_length(a: list[float], threshold: float, lo: int, hi: int) -> int:
    """The rule written as a loop: draft, update the product (a_1 := 1), stop if allowed."""
    product = 1.0
    for i, value in enumerate(a, start=1):
        product *= 1.0 if i == 1 else value
        if i >= hi or (i >= lo and 1 - product > threshold):
            return i
    return len(a)


def test_first_token_always_drafted_and_bounds_hold():
    zero = torch.zeros(3, 10)  # the head sees only rejections
    assert draft_lengths(zero, 0.01, (1, 10)).tolist() == [2, 2, 2]  # 1 - a_1 = 0: never stops after token 1
    assert draft_lengths(zero, 0.01, (4, 10)).tolist() == [4, 4, 4]  # MIN
    one = torch.ones(2, 12)
    assert draft_lengths(one, 0.5, (1, 7)).tolist() == [7, 7]  # MAX
    assert draft_lengths(one, 0.5, (1, 30)).tolist() == [12, 12]  # out of values
    assert draft_lengths(zero, 0.5, (1, 1)).tolist() == [1, 1, 1]


def test_rows_decide_for_themselves():
    a = torch.tensor([[1.0, 0.9, 0.9, 0.9, 0.9], [1.0, 0.2, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    # row 0: products 1, .9, .81, .729, .6561: 1 - P > 0.3 first after token 5; row 1: after 2; row 2: never
    assert draft_lengths(a, 0.3, (1, 16)).tolist() == [5, 2, 5]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 12).flatmap(lambda k: st.lists(st.lists(st.floats(0, 1), min_size=k, max_size=k),
                                                     min_size=1, max_size=5)),
       st.floats(0.01, 0.99), st.integers(1, 6), st.integers(0, 8))
def test_draft_lengths_equal_the_loop(rows, threshold, lo, extra):
    hi = lo + extra
    got = draft_lengths(torch.tensor(rows), threshold, (lo, hi)).tolist()
    assert got == [reference_length(r, threshold, lo, hi) for r in rows]


def test_rule_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"stop_threshold must be in \(0, 1\]"):
        draft_lengths(torch.ones(1, 4), 1.5, (1, 4))
    with pytest.raises(ValueError, match="1 <= MIN <= MAX"):
        draft_lengths(torch.ones(1, 4), 0.5, (0, 4))
    with pytest.raises(ValueError, match="1 <= MIN <= MAX"):
        draft_lengths(torch.ones(1, 4), 0.5, (5, 4))


# ---------------------------------------------------------------- rounds for the offline simulation


@pytest.mark.parametrize("kind", LABEL_KINDS)
def test_rounds_equal_drafting_from_scratch(llama_pair, kind):
    target, drafter = llama_pair
    record = random_records(1, seed=7)[0]
    record = Record(0, record.prompt, record.response + [5, 9, 11, 30], 0.0)
    rounds = record_rounds(target, drafter, record, kind, depth=5, chunk=4, generator=torch.Generator().manual_seed(0))
    n = len(record.response)
    assert rounds.start.tolist() == list(range(n)) and rounds.room.tolist() == [n - s for s in range(n)]
    for s in range(n):
        seq = record.prompt + record.response[:s] + rounds.drafts[s].tolist()
        with torch.no_grad():
            out = drafter(torch.tensor([seq]), output_hidden_states=True)
            p = target(torch.tensor([seq])).logits[0].softmax(-1)
        at = len(record.prompt) + s - 1  # the position behind draft 1
        q = out.logits[0].softmax(-1)
        for i in range(5):
            d = rounds.drafts[s, i]
            if kind == "greedy":
                assert d == q[at + i].argmax()
                label = float(d == p[at + i].argmax())
            else:
                label = min(1.0, float(p[at + i, d] / q[at + i, d]))
            assert float(rounds.labels[s, i]) == pytest.approx(label, abs=1e-5)
            assert torch.allclose(rounds.hidden[s, i].float(), out.hidden_states[-1][0, at + i], atol=2e-3)
            assert float(rounds.q_max[s, i]) == pytest.approx(float(q[at + i].max()), abs=1e-5)


def test_expected_accepted_and_walk_by_hand():
    labels = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.5, 0.5, 1.0, 1.0]])
    # row 0: accepted 1, 2, 2, 2 for lengths 1..4; row 1: 0.5, 0.75, 1.0, 1.25
    for length, expected in ((1, [1.0, 0.5]), (2, [2.0, 0.75]), (3, [2.0, 1.0]), (4, [2.0, 1.25])):
        got = expected_accepted(labels, torch.tensor([length, length]))
        assert got.tolist() == pytest.approx(expected)
    # greedy walk over one 6-token response: starts 0..5, first rejection at 2, 0, 1, 3, 3, 3 drafts in
    first = [2, 0, 1, 3, 3, 3]
    lab = torch.tensor([[1.0] * f + [0.0] * (4 - f) for f in first])
    rounds = RoundData(lab, torch.zeros(6, 4, 1), torch.zeros(6, 4), torch.zeros(6, 4, dtype=torch.long),
                       torch.zeros(6, dtype=torch.long), torch.arange(6), 6 - torch.arange(6))
    # K = 3: start 0 keeps 2 (+1) -> start 3: keeps min(3, room 3 - 1 = 2) = 2 drafts, +1 -> done: 2 rounds
    drafted, tau, n = walk(rounds, torch.full((6,), 3))
    assert (drafted, tau, n) == (2.5, 3.0, 2)
