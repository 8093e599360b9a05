"""The compiled, static-shape decode path (specdec.compiled): exact against eager decoding and generate.

Compiling costs seconds per shape, so the models are tiny and each module fixture compiles a few
buckets once; the static cache's bookkeeping (rollback, select, merge, compaction) is checked
against ``RaggedCache`` forward by forward with nothing compiled (the same step, run eagerly).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from conftest import assert_same_greedy, build_tiny, drive_alike, hf_greedy

import specdec
from specdec.batch import PromptBatch, prefill_groups
from specdec.cache import RaggedCache
from specdec.cli import main as cli_main
from specdec.compiled import (
    SLOT_STEP,
    CompiledModel,
    Shape,
    StaticRaggedCache,
    cache_folder,
    check_mode,
    compile_refusal,
    compiled_for,
    compiles,
    graph_file,
    prepare,
    row_buckets,
    saves_graphs,
    set_compiled,
    token_buckets,
)
from specdec.config import NgramConfig
from specdec.drafters.ngram import NgramDrafter
from specdec.seq2seq import prefill_into, prefilled_cache

GAMMA = 3
NEW = 20
# the compile cache's own tests: a torch without aot_compile (2.11 and older; 2.12's source has it) saves no step,
# which test_a_torch_without_aot_compile_compiles_with_guards_and_saves_nothing checks on every torch
saved_steps = pytest.mark.skipif(not saves_graphs(), reason=f"torch {torch.__version__} has no aot_compile: no "
                                 "compiled step is saved, so none is loaded (its own test checks that path)")
PROMPTS = [[1, 5, 9, 33, 7], [1, 40, 41, 42, 43, 44, 45, 46, 12], [1, 60, 3, 3, 70, 71, 72, 8, 9, 10, 11, 50, 51]]


def spec(target, drafter, prompts, **kw):
    return specdec.speculative_generate(target, drafter, prompts, gamma=kw.pop("gamma", GAMMA),
                                        max_new_tokens=kw.pop("max_new_tokens", NEW), **kw)


@pytest.fixture(scope="module", params=("llama", "gpt2"))
def pair(request):
    """A tiny target and drafter of one architecture, the eager results first, then both compiled
    (target: rows 1 and 4 x gamma + 1 tokens; drafter: rows 1 and 4 x 1 and 2 tokens)."""
    target, drafter = build_tiny(request.param, seed=0, layers=2), build_tiny(request.param, seed=1, layers=1)
    eager = {
        "single": [spec(target, drafter, p).tokens for p in PROMPTS],
        "batch": [r.tokens for r in spec(target, drafter, PROMPTS, batch_size=4)],
        "sampled": [spec(target, drafter, p, temperature=1.0, seed=7).tokens for p in PROMPTS],
        "gamma5": spec(target, drafter, PROMPTS[0], gamma=5).tokens,
        "gamma2": [spec(target, drafter, p, gamma=2).tokens for p in PROMPTS],
        "ngram": [spec(target, NgramDrafter(NgramConfig(min_ngram=1, num_tokens=GAMMA)), p).tokens for p in PROMPTS],
        "long": spec(target, drafter, PROMPTS[2], max_new_tokens=90).tokens,
    }
    assert prepare(target, "on", tokens=(GAMMA + 1,), rows=(1, 4)).compiled
    assert prepare(drafter, "on", tokens=(1, 2), rows=(1, 4), last=True).compiled  # as a run compiles a drafter
    return target, drafter, eager


def calls(model) -> dict[str, int]:
    return dict(compiled_for(model).calls)


def test_compiled_single_prompt_is_exact(pair):
    target, drafter, eager = pair
    before = calls(target), calls(drafter)
    for prompt, reference in zip(PROMPTS, eager["single"]):
        ours = spec(target, drafter, prompt).tokens
        assert ours == reference
        assert_same_greedy(target, prompt, ours, hf_greedy(target, prompt, NEW, [2]))
    after = calls(target), calls(drafter)
    for old, new in zip(before, after):  # every forward ran compiled: no shape fell outside the buckets
        assert new["compiled"] > old["compiled"] and new["eager"] == old["eager"]


def test_compiled_ragged_batch_is_exact(pair):
    target, drafter, eager = pair
    before = calls(target)["compiled"]
    results = spec(target, drafter, PROMPTS, batch_size=4)
    assert [r.tokens for r in results] == eager["batch"]
    for prompt, result in zip(PROMPTS, results):
        assert_same_greedy(target, prompt, result.tokens, hf_greedy(target, prompt, NEW, [2]))
    assert sum(r.stats.accepted for r in results) < sum(r.stats.drafted for r in results)  # rollbacks
    assert calls(target)["compiled"] > before


def test_compiled_sampling_draws_the_same_tokens(pair):
    """Same seed, same logits up to rounding: the same draws, so the same (lossless) distribution."""
    target, drafter, eager = pair
    assert [spec(target, drafter, p, temperature=1.0, seed=7).tokens for p in PROMPTS] == eager["sampled"]


def test_a_shape_outside_the_buckets_runs_eagerly_and_exactly(pair):
    target, drafter, eager = pair
    with pytest.warns(UserWarning, match="no compiled bucket: it runs eagerly"):
        ours = spec(target, drafter, PROMPTS[0], gamma=5).tokens  # verifies 6 tokens: above the bucket of 4
    assert ours == eager["gamma5"]
    assert calls(target)["eager"] > 0


def test_a_draft_padded_to_a_token_bucket_equals_the_eager_result(pair):
    """Verifications shorter than the bucket (gamma 2: 3 tokens; prompt lookup: 1 to 4) run compiled, padded
    with dead tokens on the right (their slots freed at once, their logits dropped): the same tokens."""
    target, drafter, eager = pair
    before = calls(target)
    assert [spec(target, drafter, p, gamma=2).tokens for p in PROMPTS] == eager["gamma2"]
    lookup = NgramDrafter(NgramConfig(min_ngram=1, num_tokens=GAMMA))  # copies of 1..GAMMA tokens
    assert [spec(target, lookup, p).tokens for p in PROMPTS] == eager["ngram"]
    after = calls(target)
    assert after["eager"] == before["eager"] and after["compiled"] > before["compiled"]


def test_a_context_crossing_slot_widths_runs_in_one_graph(pair):
    """A forward attends the live slots rounded up to SLOT_STEP: a generation whose cache grows across several
    widths gives the eager tokens and generate's, with no new compilation (the slot dimension is dynamic)."""
    from torch._dynamo.utils import counters

    target, drafter, eager = pair
    graphs = counters["stats"]["unique_graphs"]
    before = calls(target)
    ours = spec(target, drafter, PROMPTS[2], max_new_tokens=90).tokens
    assert ours == eager["long"]
    assert_same_greedy(target, PROMPTS[2], ours, hf_greedy(target, PROMPTS[2], 90, [2]))
    assert len(PROMPTS[2]) < SLOT_STEP and len(PROMPTS[2]) + len(ours) > 3 * SLOT_STEP  # widths 32 .. 128
    assert calls(target)["eager"] == before["eager"]
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_kernels_formulation_traced_into_the_graph_is_exact(monkeypatch):
    """With specdec's linear kernels installed (SPECDEC_LINEAR=on), the compiled step traces the linears as the
    kernels compute them (W @ x.T for 1-2 rows, oneDNN on the prepacked weight for more): greedy output equals
    generate's, plain (1 row) and speculative (gamma + 1 rows)."""
    from specdec import kernels

    if not kernels.available():
        pytest.skip("this torch has no oneDNN linear op (specdec's kernels never install)")
    monkeypatch.setenv("SPECDEC_LINEAR", "on")
    target = build_tiny("llama", seed=11, layers=2)
    assert prepare(target, "on", tokens=(1, GAMMA + 1)).compiled and compiled_for(target).kernels
    lookup = NgramDrafter(NgramConfig(min_ngram=1, num_tokens=GAMMA))
    for prompt in PROMPTS:
        reference = hf_greedy(target, prompt, NEW, [2])
        assert_same_greedy(target, prompt, specdec.autoregressive_generate(target, prompt, max_new_tokens=NEW,
                                                                           stop_token_ids=[2]).tokens, reference)
        assert_same_greedy(target, prompt, spec(target, lookup, prompt, stop_token_ids=[2]).tokens, reference)
    assert compiled_for(target).calls["eager"] == 0


def test_a_bucket_graph_serves_every_slot_width_and_other_shapes_run_eagerly():
    """A step runs without guards: ``run`` picks the bucket's graph. One graph serves every slot width (the slot
    dimension is dynamic) and equals the eager step; a shape that was not warmed runs the eager step, counted."""
    model = build_tiny("llama", seed=4)
    assert prepare(model, "on", tokens=(1,)).compiled
    step = compiled_for(model)

    def inputs(n=1, width=SLOT_STEP, rows=1):
        cache = step.new_cache(rows, "cpu")
        cache.layers[0].cumulative_length.fill_(3)  # every layer's write pointer
        live = torch.zeros(rows, step.slots + 1, dtype=torch.bool)[:, :width]
        live[:, :3 + n] = True
        return torch.full((rows, n), 7), live, cache

    with torch.inference_mode():
        for width in (SLOT_STEP, 3 * SLOT_STEP):
            compiled = step.run(Shape(1, 1), *inputs(width=width))[0]
            assert torch.allclose(compiled, step._step(*inputs(width=width), False)[0], atol=1e-5)
        assert step.calls == {"compiled": 2, "eager": 0}
        with pytest.warns(UserWarning, match="no compiled bucket"):
            step.run(Shape(1, 3), *inputs(n=3))
    assert step.calls["eager"] == 1 and list(step.graphs) == [Shape(1, 1)]


def test_models_of_the_same_shapes_keep_graphs_of_their_own():
    """Without guards, a graph could not tell two models of the same shapes apart (here a norm epsilon, a constant
    in the graph, set outside the config the compile cache is keyed by): each model keeps graphs of its own (one
    loaded from the cache is checked against the model's eager step), so each decodes its own eager tokens."""
    a, b = build_tiny("llama", seed=6), build_tiny("llama", seed=6)
    for module in b.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 0.5
    prompt = PROMPTS[1]
    eager = [specdec.autoregressive_generate(m, prompt, max_new_tokens=NEW).tokens for m in (a, b)]
    assert eager[0] != eager[1]
    for model in (a, b):
        assert prepare(model, "on", tokens=(1,)).compiled
    assert [specdec.autoregressive_generate(m, prompt, max_new_tokens=NEW).tokens for m in (a, b)] == eager
    assert [compiled_for(m).calls["eager"] for m in (a, b)] == [0, 0]
    assert compiled_for(a).graphs[Shape(1, 1)] is not compiled_for(b).graphs[Shape(1, 1)]


def test_the_bench_times_a_compiled_model_on_its_compiled_step():
    """``bench.measure.step_times`` times the path a run decodes with: a compiled model's static cache step."""
    from specdec.bench.measure import Clock, step_path, step_times

    model, eager = build_tiny("llama", seed=8), build_tiny("llama", seed=9)
    assert prepare(model, "on", tokens=(1,)).compiled
    before = compiled_for(model).calls["compiled"]
    times = step_times([model, eager], torch.tensor([PROMPTS[1]]), 6, Clock(torch.device("cpu")), run=3)
    assert all(t > 0 for t in times) and [step_path(m) for m in (model, eager)] == ["compiled", "eager"]
    assert compiled_for(model).calls["compiled"] - before == 6


def test_token_buckets_cover_the_lookup_copies():
    """The shapes a run compiles: the target's gamma + 1 and a lookup copy + 1, a drafter's 1, 2 and copy + 2."""
    from specdec.drafters.hybrid import LOOKUP_NGRAM

    copy = LOOKUP_NGRAM.num_tokens
    assert token_buckets(4, "lookup+code-drafter", True, False, copy) == ((5, copy + 1), (1, 2, copy + 2))
    assert token_buckets(4, "code-drafter", True, False, copy) == ((5,), (1, 2))
    assert token_buckets(4, "code-drafter", False, True, copy) == ((1,), (1, 2))


def test_a_catch_up_computes_the_logits_of_its_last_real_token_only():
    """``prepare(..., last=True)`` (a drafter's buckets): a forward of more than one token that keeps one logit (a
    drafter's catch-up) runs a graph that projects only its last real token's hidden state onto the vocabulary,
    whether its bucket is padded or not, with valid columns or without: the same last logits and hidden states as
    the eager cache; a forward that keeps them all has no such bucket and runs eagerly, exactly."""
    model = build_tiny("llama", seed=3)
    assert prepare(model, "on", tokens=(1, 4), rows=(2,), hidden=True, last=True).compiled
    step = compiled_for(model)
    assert step.shapes == {Shape(2, n, hidden, n > 1) for n in (1, 4) for hidden in (False, True)}
    assert graph_file(model, step.slots, Shape(2, 4, last=True)).name.endswith("-r2-n4-last.bin")
    static, ragged = StaticRaggedCache(model, step), RaggedCache(model, 0)
    batch = PromptBatch.from_lists([[1, 4, 5, 6, 7], [1, 9, 10]], "cpu")
    static.merge(prefilled_cache(model, batch, "cpu")[0])
    ragged.merge(prefilled_cache(model, batch, "cpu")[0])
    with torch.no_grad():
        for n, valid, hidden in ((4, None, True), (3, None, False),
                                 (2, torch.tensor([[False, True], [True, True]]), True), (1, None, False)):
            ids = torch.randint(3, 96, (2, n))
            before = dict(step.calls)
            a = static.forward(ids, valid, output_hidden_states=hidden)
            b = ragged.forward(ids, valid, output_hidden_states=hidden)
            assert a.logits.shape == b.logits.shape == (2, 1, model.config.vocab_size)
            assert torch.allclose(a.logits, b.logits, atol=1e-5), n
            if hidden:
                assert torch.allclose(a.hidden_states[-1], b.hidden_states[-1][:, -1:], atol=1e-5), n
            assert step.calls == {"compiled": before["compiled"] + 1, "eager": before["eager"]}, n
        ids = torch.randint(3, 96, (2, 3))
        with pytest.warns(UserWarning, match="no compiled bucket"):
            a = static.forward(ids, logits_to_keep=3)
        assert torch.allclose(a.logits, ragged.forward(ids, logits_to_keep=3).logits, atol=1e-5)


def test_static_cache_follows_the_ragged_rule():
    """Random forwards (left and right padding), rollbacks, selects, merges and compactions: the static
    cache's logits equal RaggedCache's at every step (nothing compiled: the static step runs eagerly)."""
    model = build_tiny("llama", seed=3)
    compiled = CompiledModel(model, slots=40)
    compiled.rows, compiled.tokens = (4,), (1, 3)
    static, ragged = StaticRaggedCache(model, compiled), RaggedCache(model, 0)

    def join(prompts):
        batch = PromptBatch.from_lists(prompts, "cpu")
        static.merge(prefilled_cache(model, batch, "cpu")[0])
        ragged.merge(prefilled_cache(model, batch, "cpu")[0])

    def join_random(rng):
        join([[1] + [rng.randint(3, 95) for _ in range(rng.randint(1, 8))]])

    join([[1, 4, 5, 6, 7], [1, 9, 10]])
    compactions = drive_alike(static, ragged, compiled.slots, join_random, hidden=True)
    assert compactions > 0


def test_rows_prefilled_in_groups_join_as_one_cache_would():
    """Joining rows of unlike lengths are fed in groups (``prefill_groups``); ``prefill_into`` hands a static cache each
    group's cache in turn and an eager one the groups merged pairwise: both hold what one merged cache holds (the
    next forward's logits equal, the rows' live counts too), before and after rows that were already running."""
    model = build_tiny("llama", seed=3)
    compiled = CompiledModel(model, slots=80)
    compiled.rows, compiled.tokens = (8,), (1,)
    running = [[1, 4, 5, 6, 7], [1, 9, 10]]
    joining = [[1, 5, 5], [1, *range(3, 40)], [1, 7, 8], [1, *range(10, 45)], [1, 4], [1, *range(50, 60)]]
    assert len(prefill_groups(PromptBatch.from_lists(joining, "cpu").widths())) > 2
    static, ragged, reference = StaticRaggedCache(model, compiled), RaggedCache(model, 0), RaggedCache(model, 0)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the static step runs eagerly here (nothing warmed)
        for prompts in (running, joining):
            batch = PromptBatch.from_lists(prompts, "cpu")
            assert prefill_into(static, model, batch, "cpu") == prefill_into(ragged, model, batch, "cpu")
            reference.merge(prefilled_cache(model, batch, "cpu")[0])
            assert static.live.tolist() == ragged.live.tolist() == reference.live.tolist()
            ids = torch.randint(3, 96, (reference.rows, 1))
            expected = reference.forward(ids).logits
            for handle in (static, ragged):
                assert torch.allclose(handle.forward(ids).logits, expected, atol=1e-5)


def test_a_dropped_static_cache_lends_its_buffers_to_the_next_one():
    """Every generate call builds a new cache handle: its buffers are the last dropped handle's, zeroed (a fresh
    allocation cost milliseconds a call), never those of a handle still alive; a handle that grows to a larger
    row bucket lets its old buffers go too."""
    model = build_tiny("llama", seed=3)
    compiled = CompiledModel(model, slots=40)
    compiled.rows, compiled.tokens = (1, 4), (1,)

    def filled(prompts):
        handle = StaticRaggedCache(model, compiled)
        handle.merge(prefilled_cache(model, PromptBatch.from_lists(prompts, "cpu"), "cpu")[0])
        return handle

    first = filled([[1, 4, 5, 6, 7]])
    keys = first.cache.layers[0].keys  # [1, heads, 41, dim]
    assert bool(keys.any()) and int(first.cache.layers[0].cumulative_length) == 4
    second = filled([[1, 9, 10]])
    assert second.cache.layers[0].keys.data_ptr() != keys.data_ptr()  # the first handle still holds its own
    del first
    third = StaticRaggedCache(model, compiled)
    with torch.inference_mode():
        third._reserve(1)
    assert third.cache.layers[0].keys is keys and not bool(keys.any())  # the dropped one's, zeroed
    assert int(third.cache.layers[0].cumulative_length) == 0 and third.used == 0
    second.merge(prefilled_cache(model, PromptBatch.from_lists([[1, 2, 3]], "cpu"), "cpu")[0])  # 2 rows: bucket 4
    assert second.capacity == 4 and compiled.spare[(1, torch.device("cpu"))]  # its 1-row buffers were let go
    with torch.inference_mode():  # the grown handle kept its rows: the same logits as a fresh eager cache's
        ragged = RaggedCache(model, 0)
        ragged.merge(prefilled_cache(model, PromptBatch.from_lists([[1, 9, 10], [1, 2, 3]], "cpu"), "cpu")[0])
        ids = torch.tensor([[11], [12]])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nothing warmed: the static step runs eagerly
            ours = second.forward(ids).logits
        assert torch.allclose(ours, ragged.forward(ids).logits, atol=1e-5)


def test_row_buckets_step_by_four_up_to_the_batch_size():
    assert [row_buckets(b) for b in (1, 2, 4, 5, 8, 16, 17, 64)] == [
        (1,), (1, 2), (1, 4), (1, 4, 5), (1, 4, 8), (1, 4, 16), (1, 4, 16, 17), (1, 4, 16, 64)]


def test_rows_leaving_shrink_the_buffers_to_their_row_bucket():
    """When rows leave and the rest fit a smaller row bucket, the handle moves to that bucket (its later forwards
    are that bucket's step, not the former batch's with dead rows), keeping every row's cache: its logits stay
    those of an eager cache driven alike. The larger buffers go back to the model for the next growth."""
    model = build_tiny("llama", seed=4)
    compiled = CompiledModel(model, slots=40)
    compiled.rows, compiled.tokens = (1, 4), (1,)
    prompts = [[1, 4, 5, 6, 7], [1, 9, 10], [1, 2, 3, 8]]
    static = StaticRaggedCache(model, compiled)
    ragged = RaggedCache(model, 0)
    with torch.inference_mode():
        static.merge(prefilled_cache(model, PromptBatch.from_lists(prompts, "cpu"), "cpu")[0])
        ragged.merge(prefilled_cache(model, PromptBatch.from_lists(prompts, "cpu"), "cpu")[0])
    assert static.capacity == 4
    shapes = []
    real_run = compiled.run
    compiled.run = lambda shape, *args: shapes.append(shape) or real_run(shape, *args)

    def step(ids):
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nothing warmed: the static step runs eagerly
            ours, theirs = static.forward(torch.tensor(ids)).logits, ragged.forward(torch.tensor(ids)).logits
        assert torch.allclose(ours, theirs, atol=1e-5)

    step([[11], [12], [13]])
    for keep, capacity in (([0, 2], 4), ([1], 1)):  # 2 rows still need the 4-row bucket; 1 row fits the 1-row one
        with torch.inference_mode():
            static.select(torch.tensor(keep))
            ragged.select(torch.tensor(keep))
        assert static.capacity == capacity and static.rows == len(keep)
        step([[14 + i] for i in range(len(keep))])
    assert [s.rows for s in shapes] == [4, 4, 1]
    assert compiled.spare[(4, torch.device("cpu"))]  # the 4-row buffers were let go
    spare = compiled.spare[(4, torch.device("cpu"))][-1].layers[0].keys
    with torch.inference_mode():  # a row joins: back to the 4-row bucket, in the buffers let go
        static.merge(prefilled_cache(model, PromptBatch.from_lists([[1, 7]], "cpu"), "cpu")[0])
        ragged.merge(prefilled_cache(model, PromptBatch.from_lists([[1, 7]], "cpu"), "cpu")[0])
    assert static.capacity == 4 and static.cache.layers[0].keys is spare
    step([[20], [21]])


def test_compile_modes_and_refusals(monkeypatch, capsys):
    with pytest.raises(ValueError, match="compile must be one of auto, on, off, got 'fast'"):
        check_mode("fast")
    assert cli_main(["generate", "--compile", "fast", "def f():"]) == 2
    assert "compile must be one of auto, on, off, got 'fast'" in capsys.readouterr().err
    assert [compiles(mode) for mode in ("auto", "on", "off")] == [False, True, False]  # auto: off, as measured
    assert [compiles("auto", device) for device in ("cpu", torch.device("cpu"), "cuda", "cuda:1")] == [
        False, False, True, True]  # auto: on for CUDA (CUDA graphs), off on a CPU
    model = build_tiny("llama", seed=5)
    assert not prepare(model, "off").compiled and compiled_for(model) is None
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found .*apt-get install g\\+\\+"):
        prepare(model, "on")
    auto = prepare(model, "auto")  # no compiler needed: auto does not compile
    assert not auto.compiled and "auto" in auto.reason and compiled_for(model) is None


def test_a_model_that_cannot_compile_decodes_eagerly_said_once():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                             num_decoder_layers=1, num_heads=2, decoder_start_token_id=0)).eval()
    assert "relative position bias" in compile_refusal(t5)  # encoder-decoder models: specdec.compiled.seq2seq_refusal
    with pytest.warns(UserWarning, match="relative position bias.* it decodes eagerly"):
        choice = prepare(t5, "on")
    assert not choice.compiled and compiled_for(t5) is None


def test_the_eager_step_on_the_static_cache_is_exact_and_meters_each_forward_once():
    """What CUDA captures by default (``inductor`` False: the eager step over the static cache), run here uncaptured:
    the eager tokens, and a forward hook (the bench's meter) heard once per forward, not again inside the step (which
    ``run`` calls the hooks around, as around a compiled step)."""
    from specdec.bench.measure import Clock, ForwardMeter

    target, drafter = build_tiny("llama", seed=10, layers=2), build_tiny("llama", seed=11, layers=1)
    expected = [spec(target, drafter, p).tokens for p in PROMPTS]
    for model in (target, drafter):
        compiled = CompiledModel(model, 128)
        compiled.inductor = False
        set_compiled(model, compiled)
        for tokens in ((GAMMA + 1,) if model is target else (1, 2)):
            compiled.warm(Shape(1, tokens))
        compiled.rows, compiled.tokens = (1,), ((GAMMA + 1,) if model is target else (1, 2))
        assert set(compiled.graphs.values()) == {None}  # nothing traced
    with ForwardMeter(target, Clock(torch.device("cpu"))) as meter:
        ours = [spec(target, drafter, p).tokens for p in PROMPTS]
    assert ours == expected
    calls = compiled_for(target).calls
    assert calls["eager"] == 0 and meter.calls == calls["compiled"] + len(PROMPTS)  # and one eager prefill each


def test_a_torch_without_aot_compile_compiles_with_guards_and_saves_nothing(monkeypatch, tmp_path):
    """A torch without ``aot_compile`` (2.11, on the lent GPU): the step is ``torch.compile``'s, with its
    guards (``Unsaved``), exact, and nothing is written to the compile cache."""
    import specdec.compiled as compiled_module
    from specdec.compiled import graphs

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(graphs, "saves_graphs", lambda: False)  # where CompiledModel looks it up
    target, drafter = build_tiny("llama", seed=12, layers=1), build_tiny("llama", seed=13, layers=1)
    expected = spec(target, drafter, PROMPTS[0]).tokens
    assert prepare(target, "on", tokens=(GAMMA + 1,)).compiled and prepare(drafter, "on", tokens=(1, 2)).compiled
    assert all(isinstance(g, compiled_module.Unsaved) for g in compiled_for(target).graphs.values())
    assert spec(target, drafter, PROMPTS[0]).tokens == expected
    assert compiled_for(target).calls["eager"] == 0 and compiled_for(target).calls["compiled"] > 0
    assert not list(cache_folder("graphs").glob("*.bin"))


def test_the_compile_cache_is_per_torch_version(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_folder() == tmp_path / "specdec" / "inductor" / f"torch-{torch.__version__}"


SECOND_START = """
import json, sys
import specdec
from transformers import AutoModelForCausalLM
from specdec.compiled import compiled_for, prepare
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
choice = prepare(model, "on", tokens=(1,))
tokens = specdec.autoregressive_generate(model, [1, 5, 9, 33, 7], max_new_tokens=16, stop_token_ids=[2]).tokens
print(json.dumps({"reason": choice.reason, "loaded": compiled_for(model).loaded, "calls": compiled_for(model).calls,
                  "tokens": tokens}))
"""


@saved_steps
def test_a_second_start_loads_the_compiled_step_from_disk(tmp_path):
    """A fresh process compiles the 1-token step and saves it; a second fresh process, on a model of the same
    configuration and other weights, loads it instead of tracing (the weights are read at every call, not
    built into the graph) and decodes generate's greedy tokens with it."""
    import json
    import os
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "SPECDEC_LINEAR": "off"}  # the same traced linears in both processes (the kernels' choice is timed)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    runs = []
    for seed in (0, 1):
        folder = tmp_path / f"model-{seed}"
        build_tiny("llama", seed=seed, layers=1).save_pretrained(folder)
        done = subprocess.run([sys.executable, "-c", SECOND_START, str(folder)], env=env, capture_output=True,
                              text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.splitlines()[-1]))
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        prompt = [1, 5, 9, 33, 7]
        assert_same_greedy(model, prompt, runs[-1]["tokens"], hf_greedy(model, prompt, 16, [2]))
        assert runs[-1]["calls"]["eager"] == 0 and runs[-1]["calls"]["compiled"] > 0
    assert [run["loaded"] for run in runs] == [0, 1]
    assert "(1 from the compile cache" in runs[1]["reason"]
    assert len(list((tmp_path / "cache" / "specdec" / "graphs").rglob("*.bin"))) == 1


@saved_steps
def test_an_unusable_compile_cache_file_is_compiled_again(monkeypatch, tmp_path):
    """A graph file written by another torch version, or corrupted, or one that fails to run, is not used: the step is
    compiled again (said once), the file overwritten, and the next start loads it; the tokens stay generate's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("SPECDEC_LINEAR", "off")  # the same traced linears in every model below
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    shape = Shape(1, 1)
    with monkeypatch.context() as foreign:
        foreign.setattr(torch, "__version__", "2.0.0-another")  # its folder, and the version inside its files
        model = build_tiny("llama", seed=7, layers=1)
        assert prepare(model, "on", tokens=(1,)).compiled
        slots = compiled_for(model).slots
        written = graph_file(model, slots, shape)
    assert "torch-2.0.0-another" in str(written) and written.is_file()
    path = graph_file(model, slots, shape)  # this torch's file for the same model and bucket
    for content, reason in ((written.read_bytes(), "different PyTorch version"), (b"not a graph", "Error")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        model = build_tiny("llama", seed=7, layers=1)
        with pytest.warns(UserWarning, match=f"compile cache's {path.name} was not used .*{reason}"):
            choice = prepare(model, "on", tokens=(1,))
        assert choice.compiled and compiled_for(model).loaded == 0 and path.read_bytes() != content
    model = build_tiny("llama", seed=7, layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "(1 from the compile cache" in prepare(model, "on", tokens=(1,)).reason
    prompt = PROMPTS[1]
    ours = specdec.autoregressive_generate(model, prompt, max_new_tokens=NEW, stop_token_ids=[2]).tokens
    assert_same_greedy(model, prompt, ours, hf_greedy(model, prompt, NEW, [2]))
    assert compiled_for(model).calls["eager"] == 0 and compiled_for(model).calls["compiled"] > 0

    def stale(*args):  # a file that loads but cannot run here (a graph bound to another process's objects)
        raise KeyError(140163756335952)

    monkeypatch.setattr(CompiledModel, "_load", lambda self, path: stale)
    model = build_tiny("llama", seed=7, layers=1)
    with pytest.warns(UserWarning, match=f"compile cache's {path.name} failed to run .*KeyError"):
        choice = prepare(model, "on", tokens=(1,))
    assert choice.compiled and compiled_for(model).loaded == 0 and compiled_for(model).graphs[shape] is not stale


def test_the_vector_instruction_probe_is_kept_and_trusted_only_on_the_same_cpu(monkeypatch, tmp_path):
    """A start records the vector instruction sets inductor's probe accepted; a later one trusts the CPU's
    flags instead of probing only where they name the same sets (another machine's record: probed again)."""
    import json

    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    from specdec.compiled import probed_isa

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with config.patch({"cpp.vec_isa_ok": None}):  # restored after (a monkeypatch undo deletes the option)
        assert not probed_isa()  # nothing recorded yet
        probed = sorted(str(isa) for isa in valid_vec_isa_list())
        assert not probed_isa(record=True)
        record = cache_folder("graphs") / "vec-isa.json"
        assert json.loads(record.read_text()) == probed
        assert probed_isa() and config.cpp.vec_isa_ok is True
        assert sorted(str(isa) for isa in valid_vec_isa_list()) == probed
        config.cpp.vec_isa_ok = None
        record.write_text(json.dumps(["another machine's"]))
        assert not probed_isa() and config.cpp.vec_isa_ok is None
        assert sorted(str(isa) for isa in valid_vec_isa_list()) == probed
    valid_vec_isa_list.cache_clear()


@saved_steps
def test_a_cached_graph_traced_from_changed_code_is_not_used():
    """A loaded graph names the code it was traced from (module, lines, checksum): any change is found."""
    import types as pytypes

    from torch._dynamo.package import InlinedSource, SourceInfo, _hash_sourcelines

    from specdec.compiled import graphs

    def graph(checksum):
        source = InlinedSource(module="specdec.compiled.graphs", firstlineno=1, lastlineno=5, checksum=checksum,
                               content="")
        return pytypes.SimpleNamespace(source_info=lambda: SourceInfo(inlined_sources={source}))

    assert graphs._changed_source(graph(_hash_sourcelines(graphs, 1, 5))) is None
    assert graphs._changed_source(graph("0" * 64)) == "specdec.compiled.graphs lines 1-5 changed"


def test_the_command_line_compiles_for_its_settings_and_decodes_the_same(tmp_path, capsys):
    """`specdec generate --compile on` (a batch of two prompts, the default drafter with prompt lookup)
    prints what `--compile off` prints, having compiled the target for gamma + 1 tokens and a lookup copy + 1,
    the drafter for 1, 2 and the copy + 2 (rows of 1 and the batch size: 4 and 6 buckets), said on stderr."""
    import json

    from tiny_models import save_tiny_pair

    pair = save_tiny_pair(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nclass Point:\n")
    args = ["generate", "--target", str(pair.target), "--drafter", f"lookup+{pair.drafter}", "--prompts-file",
            str(prompts), "--batch-size", "2", "--max-new-tokens", "16", "--gamma", "3", "--json"]
    outputs, errors = {}, {}
    for mode in ("off", "on"):
        assert cli_main([*args, "--compile", mode]) == 0
        captured = capsys.readouterr()
        outputs[mode] = [json.loads(line) for line in captured.out.splitlines()]
        errors[mode] = captured.err
    assert [o["tokens"] for o in outputs["on"]] == [o["tokens"] for o in outputs["off"]]
    assert [o["compile"] for o in outputs["on"] + outputs["off"]] == ["on"] * 2 + ["off"] * 2
    assert "compile" not in errors["off"]
    assert f"{pair.target}: compile on: 4 shapes warmed" in errors["on"]  # gamma + 1, the lookup copy + 1
    assert f"{pair.drafter}: compile on: 6 shapes warmed" in errors["on"]  # 1, 2, the copy + 2
    one = ["generate", "--target", str(pair.target), "--drafter", f"lookup+{pair.drafter}", "def add(a, b):",
           "--batch-size", "2", "--max-new-tokens", "8", "--gamma", "3", "--compile", "on"]
    assert cli_main(one) == 0
    error = capsys.readouterr().err  # one prompt: rows of 1 only, none of the batch size's shapes
    assert f"{pair.target}: compile on: 2 shapes warmed" in error
    assert f"{pair.drafter}: compile on: 3 shapes warmed" in error


def test_the_bench_times_a_compiled_run_beside_the_eager_methods(tmp_path):
    """`specdec bench --compile on`: the target and the drafter model are compiled before timing (said in the
    environment line), and the greedy output of every method of ours equals generate's."""
    import json

    from tiny_models import save_tiny_pair

    from specdec.bench.config import BenchConfig
    from specdec.bench.harness import run_benchmark
    from specdec.bench.report import build_report

    pair = save_tiny_pair(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(["def add(a, b):", "class Point:\n    def"])))
    run = run_benchmark(BenchConfig(target=str(pair.target), drafter=str(pair.drafter), prompts=str(prompts),
                                    num_prompts=2, max_new_tokens=8, repeats=1, warmup=0, device="cpu",
                                    progress=False, methods=("plain", "spec-lookup"), compile="on"))
    assert run.environment.compile.startswith("target on: ") and "drafter on: " in run.environment.compile
    # the drafter that spec drafts with is compiled: auto keeps it float32 (an int8 copy would decode eagerly)
    assert run.step_paths == {"target": "compiled", "drafter": "compiled"}
    rows = {r.method: r for r in build_report(run).rows}
    for method in ("plain", "spec-lookup"):
        assert (rows[method].greedy_equal, rows[method].greedy_total) == (2, 2)
    with pytest.raises(ValueError, match="compile must be one of auto, on, off"):
        BenchConfig(compile="fast")


def test_the_linears_are_traced_as_the_blocked_operator():
    """Where the blocked operator builds, every linear of a compiled float32 CPU model is traced as it, on a copy of
    its weight kept out of the state dict; greedy stays equal to ``generate``, eagerly and compiled, and a weight
    changed in place is read by the next decoding call. With ``SPECDEC_LINEAR=off`` the copies are not made (and
    the compile cache keys the two apart)."""
    from specdec import kernels

    model = build_tiny("llama", seed=11, layers=2)
    reference = [hf_greedy(model, p, NEW, [2]) for p in PROMPTS]
    keys = set(model.state_dict())
    choice = prepare(model, "on", tokens=(1, GAMMA + 1))
    assert choice.compiled and "linears traced as specdec::blocked_linear" in choice.reason  # said in reports
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert kernels.blocked_op() and all(hasattr(m, "_specdec_blocked") for m in linears)
    assert set(model.state_dict()) == keys
    drafter = NgramDrafter(NgramConfig(min_ngram=1, num_tokens=GAMMA))
    for prompt, expected in zip(PROMPTS, reference):
        assert_same_greedy(model, prompt, specdec.autoregressive_generate(model, prompt, max_new_tokens=NEW).tokens,
                           expected)
        assert_same_greedy(model, prompt, spec(model, drafter, prompt).tokens, expected)
    assert calls(model)["eager"] == 0
    with torch.no_grad():
        for m in linears:
            m.weight.mul_(1.5)
    changed = hf_greedy(model, PROMPTS[1], NEW, [2])
    assert changed != reference[1]  # the change shows in the model's own output
    assert_same_greedy(model, PROMPTS[1], specdec.autoregressive_generate(model, PROMPTS[1], max_new_tokens=NEW).tokens,
                       changed)


def test_eager_forwards_of_a_compiled_model_run_the_blocked_operator_while_its_copy_is_current(monkeypatch):
    """Eagerly (a prefill, an encoder, a step outside the buckets) a layer holding a blocked copy runs the operator
    while specdec decodes, on up to ``EAGER_BLOCKED_ROWS`` rows, and only while the copy is its weight's: the same
    products as ``F.linear`` either way; outside decoding, on more rows, or after an in-place change of the weight
    (until the next refresh), ``F.linear``."""
    from specdec import kernels
    from specdec.compiled import ops as compiled

    model = build_tiny("llama", seed=13, layers=1)
    assert prepare(model, "on", tokens=(1,)).compiled
    layer = next(m for m in model.modules() if isinstance(m, torch.nn.Linear) and hasattr(m, "_specdec_blocked"))
    used, operator = [], compiled.blocked_traced
    # ops' own name, which _traced_forward looks up
    monkeypatch.setattr(compiled, "blocked_traced", lambda x, *rest: used.append(x.numel() // x.shape[-1]) or
                        operator(x, *rest))

    def product(rows: int, active: bool = True) -> None:
        x = torch.randn(1, rows, layer.in_features)
        with torch.no_grad(), kernels.active() if active else contextlib.nullcontext():
            out = layer(x)
        assert torch.allclose(out, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)

    for rows in (1, 5, compiled.EAGER_BLOCKED_ROWS):
        product(rows)
    assert used == [1, 5, compiled.EAGER_BLOCKED_ROWS]
    product(compiled.EAGER_BLOCKED_ROWS + 1)
    product(5, active=False)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    product(5)  # the copy is stale: torch's product of the new weight
    assert used == [1, 5, compiled.EAGER_BLOCKED_ROWS]
    compiled.refresh_blocked([layer])
    product(5)
    assert used[-1] == 5


def test_without_the_blocked_operator_the_step_traces_the_kernels_of_before(monkeypatch):
    from specdec import kernels

    monkeypatch.setattr(kernels, "_BUILT", {**kernels._BUILT, "op": False})
    model = build_tiny("llama", seed=12, layers=2)
    reference = [hf_greedy(model, p, NEW, [2]) for p in PROMPTS]
    choice = prepare(model, "on", tokens=(1,))
    assert choice.compiled and "blocked_linear" not in choice.reason
    assert not any(hasattr(m, "_specdec_blocked") for m in model.modules())
    for prompt, expected in zip(PROMPTS, reference):
        assert_same_greedy(model, prompt, specdec.autoregressive_generate(model, prompt, max_new_tokens=NEW).tokens,
                           expected)
    assert calls(model)["eager"] == 0
