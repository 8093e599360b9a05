"""The target's features (``ModelTarget.want_features`` / ``take_features``, ``specdec.features``): the chosen layers'
hidden states at every position the target keeps, from its own prefill and verify forwards, equal to a plain forward
of each row's whole committed sequence with ``output_hidden_states=True`` (the independent reference), through
rounds with partial acceptance, ragged rows, rows leaving and joining; nothing passed to the model when nobody asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from conftest import build_tiny, hf_greedy
from test_architectures import build as build_architecture
from test_recurrent import build_recurrent
from test_seq2seq import build as build_seq2seq
from transformers.modeling_outputs import CausalLMOutputWithPast

import specdec
from specdec.batch import PromptBatch
from specdec.cache import joined
from specdec.compiled import CompiledModel, Shape, buckets, compiled_for, set_compiled
from specdec.config import SamplingConfig, SpecConfig
from specdec.decode import Decoder, Request
from specdec.drafters import Drafter, Proposal
from specdec.features import FeatureLog, eagle3_layers, resolve_layers
from specdec.schedules import make_schedule
from specdec.target import ModelTarget

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-4  # a ragged or multi-token forward and a plain one differ in float rounding only


def reference(model, sequence: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """[N - 1, F]: the chosen layers' hidden states at every position but the newest, from one plain forward of the
    committed ``sequence`` with every hidden state returned (transformers' flag, no selection)."""
    with torch.no_grad():
        states = model(input_ids=torch.tensor([sequence[:-1]]), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], dim=-1)


@dataclass
class Record:
    """One row as the drafter follows it: its committed sequence and the features taken for it, in order."""

    prompt: tuple[int, ...]
    sequence: list[int]
    features: list[torch.Tensor] = field(default_factory=list)


class OracleDrafter(Drafter):
    """Drafts each row's greedy continuation (the target's own ``generate``) with, round by round, its first, second,
    third or no draft changed, so rounds accept none, some or all of their drafts; takes the target's features in
    ``prefill`` and ``commit``, as a feature drafter would, and keeps them with the row they belong to."""

    def __init__(self, target: ModelTarget, continuations: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.target, self.continuations, self.vocab = target, continuations, vocab
        self.round = 0
        self.rows: list[Record] = []
        self.records: list[Record] = []
        self.last: list[list[int]] = []
        self.outcomes: set[str] = set()  # "all", "some", "none" accepted, over the rounds

    def _take(self) -> None:
        features, lengths = self.target.take_features()
        assert features.shape[:1] == lengths.shape == (len(self.rows),)
        for record, row, n in zip(self.rows, features, lengths.tolist()):
            assert not bool(row[n:].any()), "padding is zeros"
            record.features.append(row[:n].clone())

    def prefill(self, prompts: PromptBatch) -> int:
        for ids in prompts.rows():
            record = Record(tuple(ids), list(ids))
            self.rows.append(record)
            self.records.append(record)
        self._take()
        return 0

    def propose(self, limit, sampler, stop=None) -> Proposal:
        drafts = []
        for record, n in zip(self.rows, limit.tolist()):
            done = len(record.sequence) - len(record.prompt)
            guess = self.continuations[record.prompt][done: done + n]
            drafts.append([(t + 1) % self.vocab if i == self.round % 4 else t for i, t in enumerate(guess)])
        self.round += 1
        self.last = drafts
        return Proposal.from_lists(drafts, "cpu")

    def commit(self, accepted, next_token) -> None:
        for record, draft, a, token in zip(self.rows, self.last, accepted.tolist(), next_token.tolist()):
            record.sequence += draft[:a] + [token]
            if draft:
                self.outcomes.add("all" if a == len(draft) else "some" if a else "none")
        self._take()

    def select(self, rows) -> None:
        self.rows = [self.rows[i] for i in rows.tolist()]

    def reset(self) -> None:
        self.rows = []


def decode_with_features(model, prompts: list[list[int]], news: list[int], layers, batch_size: int,
                         beside: bool = False) -> OracleDrafter:
    """Decode ``prompts`` (``news[i]`` new tokens each) greedily with the oracle drafter, ``batch_size`` rows at a
    time (the others join as rows finish), the target capturing ``layers``; returns the drafter and its records."""
    target = ModelTarget(model, kernels=False)
    target.want_features(layers)
    continuations = {tuple(p): hf_greedy(model, p, n + 4, []) for p, n in zip(prompts, news)}
    drafter = OracleDrafter(target, continuations, model.config.vocab_size)
    schedule = make_schedule(SpecConfig(gamma=3, batch_size=batch_size))
    decoder = Decoder(target, drafter, schedule, batch_size=batch_size, prefill_beside=beside)
    for i, (prompt, n) in enumerate(zip(prompts, news)):
        decoder.submit(Request(prompt, n, SamplingConfig(), index=i))
    with torch.inference_mode():
        decoder.run()
    return drafter


def assert_features_match(model, drafter: OracleDrafter, layers: tuple[int, ...], count: int) -> None:
    assert len(drafter.records) == count
    for record in drafter.records:
        ours = torch.cat(record.features)
        expected = reference(model, record.sequence, layers)
        assert ours.shape == expected.shape, (record.prompt, ours.shape, expected.shape)
        assert torch.allclose(ours, expected, atol=TOL), float((ours - expected).abs().max())


PROMPTS = [[1, 5, 9, 14, 3, 22, 7], [1, 40], [1, 8, 8, 30, 31, 12, 50, 61, 4, 17, 9], [1, 70, 71, 3]]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_features_of_one_row_equal_a_forward_of_its_committed_sequence(arch):
    model = build_tiny(arch, layers=4)
    layers = resolve_layers(model, "eagle3")
    drafter = decode_with_features(model, PROMPTS[:1], [24], "eagle3", batch_size=1)
    assert drafter.outcomes == {"all", "some", "none"}, drafter.outcomes
    assert_features_match(model, drafter, layers, 1)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_features_of_a_ragged_batch_with_rows_leaving_and_joining(arch):
    """Four prompts of 2-11 tokens, two rows at a time, each with its own budget: rows finish at different rounds,
    leave (``select``), and the waiting ones join a batch that holds features of the others."""
    model = build_tiny(arch, layers=4)
    layers = (0, 2, 4)  # the embeddings, a middle layer, the last layer's output (after the final norm)
    drafter = decode_with_features(model, PROMPTS, [9, 20, 5, 14], layers, batch_size=2)
    assert "some" in drafter.outcomes, drafter.outcomes
    assert_features_match(model, drafter, layers, len(PROMPTS))


def test_features_of_rows_prefilled_beside_the_batch():
    """Rows joining a decoding batch are prefilled on another thread (``prefill_beside``); their features join the
    log when they join the batch."""
    model = build_tiny("llama", layers=4, seed=3)
    layers = resolve_layers(model, (1, 3))
    drafter = decode_with_features(model, PROMPTS, [6, 12, 8, 5], layers, batch_size=3, beside=True)
    assert_features_match(model, drafter, layers, len(PROMPTS))


@pytest.mark.parametrize("arch", ["mamba2", "lfm2", "rwkv"])
def test_features_of_recurrent_and_hybrid_targets(arch):
    """Targets with recurrent layers (``specdec.recurrent``: checkpoints, replays, left-padded rows fed in groups;
    state passed as an argument, RWKV) log the same features by the same rules."""
    model = build_recurrent(arch)
    layers = resolve_layers(model, "eagle3")
    drafter = decode_with_features(model, PROMPTS, [6, 9, 5, 7], layers, batch_size=2)
    assert_features_match(model, drafter, layers, len(PROMPTS))


@pytest.mark.parametrize("name", ["mistral", "gemma2", "llama4_text", "deepseek_v3"])
def test_features_of_windowed_chunked_and_latent_attention_targets(name):
    """Sliding windows (Mistral, Gemma-2: rows re-packed before a dead slot enters a window), Llama 4's attention
    chunks and DeepSeek-V3's latent attention: the same features, by the same rules."""
    model = build_architecture(name)
    layers = resolve_layers(model, (0, 1, 2))
    prompts = [[1, 5, 9, 14, 3, 22, 7, 8, 30, 31, 12], [1, 40], [1, 8, 8, 30, 31, 12, 50], [1, 70, 71, 3]]
    drafter = decode_with_features(model, prompts, [6, 9, 5, 7], layers, batch_size=2)
    assert_features_match(model, drafter, layers, len(prompts))


def test_a_target_whose_layers_pass_several_hidden_states_is_refused_by_name():
    """Gemma 3n's layers pass AltUp's stacked predictions [4, B, n, H], not one hidden state per position."""
    target = ModelTarget(build_architecture("gemma3n_text"), kernels=False)
    target.want_features("eagle3")
    with pytest.raises(TypeError, match=r"Gemma3nForCausalLM's hidden state 1 has shape \(4, 1, 3, 32\)"), \
            torch.inference_mode():
        target.prefill(PromptBatch.from_lists([[1, 5, 6, 7]], "cpu"))


def test_a_one_token_prompt_joins_with_no_features():
    """A one-token prompt caches nothing at its prefill (its token is the first verify's input): it joins with no
    features, beside a longer row prefilled in the same call, and gains them round by round."""
    model = build_tiny("qwen2", layers=4, seed=4)
    layers = resolve_layers(model, "eagle3")
    drafter = decode_with_features(model, [[1], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]], [8, 8], layers,
                                   batch_size=2)
    assert [r.features[0].shape[0] for r in drafter.records] == [0, 12]
    assert_features_match(model, drafter, layers, 2)
    target = ModelTarget(model, kernels=False)
    target.want_features(layers)
    with torch.inference_mode():
        target.prefill(PromptBatch.from_lists([[1]], "cpu"))  # alone: no forward at all
    features, lengths = target.take_features()
    assert features.shape == (1, 0, 3 * 32) and lengths.tolist() == [0]


def test_single_column_forwards_join_selected_hidden_states():
    """A model fed one token at a time (``RaggedCache.one_at_a_time``: sparse attention) joins its forwards'
    hidden states; the layers a selection left out stay None."""
    outputs = [CausalLMOutputWithPast(logits=torch.full((1, 1, 3), float(j)),
                                      hidden_states=(None, torch.full((1, 1, 2), float(j)), None)) for j in range(3)]
    out = joined(outputs, 3)
    assert out.hidden_states[0] is None and out.hidden_states[2] is None
    assert out.hidden_states[1][0, :, 0].tolist() == [0, 1, 2]


def test_shipped_code_target_features():
    """The shipped Llama (6 layers, H 512): EAGLE-3's layers (2, 3, 3), F = 1536, two rows of unlike lengths."""
    model = specdec.load_model("code-target")
    layers = resolve_layers(model, "eagle3")
    assert layers == (2, 3, 3)
    drafter = decode_with_features(model, [[0, 101, 102, 103, 104, 105], [0, 200, 201]], [10, 12], layers,
                                   batch_size=2)
    assert_features_match(model, drafter, layers, 2)
    assert drafter.records[0].features[0].shape[1] == 3 * 512


@pytest.mark.parametrize("step", ["inductor", "eager step"])
def test_compiled_features_equal_eager(step):
    """A compiled target (``specdec.compiled``: the static cache, its verify bucket warmed for the feature layers) logs
    the features the eager target logs, to float32 rounding, and each equals the plain forward's. "eager step": the
    step CUDA graphs capture by default, run uncaptured over the static cache."""
    model = build_tiny("llama", layers=4, seed=7)
    layers = (1, 2, 2, 4)  # a repeat, and the last layer's output
    prompts, news = PROMPTS[:3], [10, 12, 7]
    eager = decode_with_features(model, prompts, news, layers, batch_size=2)
    compiled = CompiledModel(model, 128)
    compiled.inductor = step == "inductor"
    set_compiled(model, compiled)
    try:
        compiled.warm(Shape(2, 4, (1, 2, 4)))  # the verify bucket: 2 rows x gamma + 1 tokens, each layer once
        compiled.rows, compiled.tokens = (2,), (4,)
        ours = decode_with_features(model, prompts, news, layers, batch_size=2)
        assert compiled_for(model).calls["compiled"] > 0 and compiled_for(model).calls["eager"] == 0
    finally:
        set_compiled(model, None)
    assert_features_match(model, ours, layers, len(prompts))
    for mine, theirs in zip(ours.records, eager.records):
        assert mine.sequence == theirs.sequence
        assert torch.allclose(torch.cat(mine.features), torch.cat(theirs.features), atol=1e-5)


def test_feature_buckets_name_each_layer_once_in_order():
    """``prepare(..., hidden=layers)`` warms the shape the target's verify asks for: its layers once each, sorted."""
    assert {s.hidden for s in buckets((4,), (1,), hidden=(3, 2, 3))} == {False, (2, 3)}
    assert {s.hidden for s in buckets((4,), (1,), hidden=True)} == {False, True}
    # a target whose every verify asks for a drafter's features: those buckets only (``specdec.plan``'s bare=False)
    assert {s.hidden for s in buckets((1, 4), (1, 2), hidden=(3, 2, 3), bare=False)} == {(2, 3)}
    assert {s.hidden for s in buckets((4,), (1,), bare=False)} == {False}  # no hidden states asked: the plain ones


def test_eagle3_rule():
    """(2, L // 2, L - 3), clamped into 0..L-1 and sorted: always three layers, each a layer's input."""
    assert eagle3_layers(32) == (2, 16, 29)
    assert eagle3_layers(80) == (2, 40, 77)
    assert eagle3_layers(8) == (2, 4, 5)
    assert eagle3_layers(6) == (2, 3, 3)
    assert eagle3_layers(4) == (1, 2, 2)
    assert eagle3_layers(2) == (0, 1, 1)
    assert eagle3_layers(1) == (0, 0, 0)
    for count in range(1, 50):
        chosen = eagle3_layers(count)
        assert len(chosen) == 3 and list(chosen) == sorted(chosen) and all(0 <= i < count for i in chosen)


def test_bad_layers_are_refused_in_one_line():
    model = build_tiny("llama", layers=4)
    target = ModelTarget(model, kernels=False)
    with pytest.raises(ValueError, match=r"must be indices in 0\.\.4 for LlamaForCausalLM"):
        target.want_features((1, 5))
    with pytest.raises(ValueError, match="'eagle3' or a tuple"):
        target.want_features("eagle")
    assert target.want_features((3, 1)) == (1, 3)  # layer order
    with torch.inference_mode():
        target.prefill(PromptBatch.from_lists([[1, 2, 3]], "cpu"))
    with pytest.raises(ValueError, match="reset"):
        target.want_features((2,))
    with pytest.raises(TypeError, match="MarianMTModel is an encoder-decoder model"):
        ModelTarget(build_seq2seq("marian"), kernels=False).want_features("eagle3")


def test_nothing_is_passed_when_nobody_asks():
    """A target nobody asked gives its model no ``output_hidden_states`` and transformers installs no capturing hook;
    asked and then told None, it is back to that."""
    model = build_tiny("llama", layers=4, seed=5)
    calls = []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    target = ModelTarget(model, kernels=False)

    def one_round() -> None:
        with torch.inference_mode():
            target.prefill(PromptBatch.from_lists([[1, 5, 6, 7], [1, 8]], "cpu"))
            target.verify(torch.tensor([[7, 3, 4], [8, 9, 0]]), torch.tensor([3, 2]))
            target.rollback(torch.tensor([2, 1]))
        target.reset()

    one_round()
    assert calls and all(not c.get("output_hidden_states") for c in calls)
    assert not getattr(model.model, "_output_capturing_hooks_installed", False)
    assert all(not layer._forward_hooks for layer in model.model.layers)
    target.want_features("eagle3")
    calls.clear()
    one_round()
    assert [c.get("output_hidden_states") for c in calls] == [[1, 2], [1, 2]]  # the selection, each layer once
    target.want_features(None)
    calls.clear()
    one_round()
    assert calls and all(not c.get("output_hidden_states") for c in calls)
    with pytest.raises(ValueError, match="want_features"):
        target.take_features()


def test_the_last_hidden_state_beside_the_features():
    """A verify that also asks for the last hidden state (an acceptance head's) gets it, and the features alike."""
    model = build_tiny("gpt2", layers=4, seed=6)
    plain, featured = ModelTarget(model, kernels=False), ModelTarget(model, kernels=False)
    featured.want_features((1, 3))
    tokens, lengths = torch.tensor([[7, 3, 4], [8, 9, 0]]), torch.tensor([3, 2])
    with torch.inference_mode():
        for target in (plain, featured):
            target.prefill(PromptBatch.from_lists([[1, 5, 6, 7], [1, 8]], "cpu"))
        expected, ours = plain.verify(tokens, lengths, hidden=True), featured.verify(tokens, lengths, hidden=True)
        featured.rollback(torch.tensor([3, 2]))
    assert torch.allclose(ours.hidden, expected.hidden, atol=1e-6)
    features, lengths = featured.take_features()
    assert lengths.tolist() == [6, 3]
    assert torch.allclose(features[0, 3:], reference(model, [1, 5, 6, 7, 3, 4, 0], (1, 3))[3:], atol=TOL)


def test_feature_log_follows_rows():
    """``FeatureLog`` on its own: rows join, extend by what each keeps, leave in a new order, and are taken."""
    log = FeatureLog(2, torch.float32, "cpu")
    log.add_rows(torch.tensor([[[1.0, 1], [2, 2]], [[3, 3], [0, 0]]]), torch.tensor([2, 1]))
    log.extend(torch.tensor([[[4.0, 4], [5, 5]], [[6, 6], [7, 7]]]), torch.tensor([1, 2]))
    log.add_rows(torch.zeros(1, 0, 2), torch.tensor([0]))
    log.select(torch.tensor([1, 2, 0]))
    features, lengths = log.take()
    assert lengths.tolist() == [3, 0, 3]
    assert features[0].tolist() == [[3, 3], [6, 6], [7, 7]] and features[2].tolist() == [[1, 1], [2, 2], [4, 4]]
    assert not bool(features[1].any())
    log.extend(torch.tensor([[[8.0, 8], [9, 9]], [[1, 2], [3, 4]], [[5, 6], [7, 8]]]), torch.tensor([1, 2, 0]))
    features, lengths = log.take()  # taken every round: the round's own features, rejected positions zeroed
    assert lengths.tolist() == [1, 2, 0] and features.tolist() == [[[8, 8], [0, 0]], [[1, 2], [3, 4]],
                                                                   [[0, 0], [0, 0]]]
    assert log.take()[1].tolist() == [0, 0, 0]
