"""The compiled decode step of encoder-decoder models (specdec.compiled, its encoder-decoder part): exact against
``generate``.

Tiny random Marian and BART pairs (tests/test_seq2seq.py's: the drafter is the target with one decoder
layer) and the shipped translate pair, compiled for a few buckets once per module: greedy output equals
the target's own ``generate`` for one source and for ragged batches (rows accept different numbers of
tokens, leave and join with sources of other lengths, which widens the source buffers without a new
graph); a shape outside the buckets runs eagerly and exactly; T5 (relative position bias) is refused by
name and decodes eagerly. The static cache's bookkeeping is checked against ``Seq2SeqCache`` forward by
forward with nothing compiled.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import TRANSLATE_NEW, drive_alike
from test_compiled import saved_steps
from test_seq2seq import SOURCES, build, first_decoder_layer, generate

import specdec
from specdec.batch import PromptBatch
from specdec.compiled import CompiledSeq2Seq, StaticSeq2SeqCache, compile_refusal, compiled_for, prepare
from specdec.seq2seq import Seq2SeqCache, prefilled_cache

GAMMA = 4
NEW = 18


def spec(target, drafter, sources, **kw):
    return specdec.speculative_generate(target, drafter, sources, gamma=kw.pop("gamma", GAMMA),
                                        max_new_tokens=kw.pop("max_new_tokens", NEW), stop_token_ids=[], **kw)


def calls(model) -> dict[str, int]:
    return dict(compiled_for(model).calls)


@pytest.fixture(scope="module")
def marian():
    """A tiny Marian target and drafter, compiled: the target for rows 1 and 3 x 1 and gamma + 1 tokens, the
    drafter for rows 1 and 3 x 1 and 2 tokens; the references are the target's own greedy ``generate``."""
    target = build("marian")
    drafter = first_decoder_layer(target)
    references = [generate(target, s, NEW, []) for s in SOURCES]
    assert prepare(target, "on", tokens=(1, GAMMA + 1), rows=(1, 3)).compiled
    assert prepare(drafter, "on", tokens=(1, 2), rows=(1, 3)).compiled
    return target, drafter, references


def test_compiled_marian_is_exact_single_and_ragged(marian):
    from torch._dynamo.utils import counters

    target, drafter, references = marian
    graphs = counters["stats"]["unique_graphs"]
    before = calls(target), calls(drafter)
    assert spec(target, drafter, SOURCES[0]).tokens == references[0]
    assert calls(target)["eager"] == before[0]["eager"] and calls(drafter)["eager"] == before[1]["eager"]
    batch = spec(target, drafter, SOURCES, batch_size=3)  # rows leave and join; a source of 37 tokens widens
    assert [r.tokens for r in batch] == references
    assert sum(r.stats.accepted for r in batch) < sum(r.stats.drafted for r in batch)  # rollbacks
    assert len({round(r.stats.acceptance_rate, 2) for r in batch}) > 1  # ragged: rows accepted differently
    plain = specdec.autoregressive_generate(target, SOURCES, max_new_tokens=NEW, stop_token_ids=[], batch_size=3)
    assert [r.tokens for r in plain] == references
    lookup = [spec(target, "ngram", s).tokens for s in SOURCES]  # shorter verifications, padded to the bucket
    assert lookup == references
    after = calls(target), calls(drafter)
    for old, new in zip(before, after):  # every forward ran compiled, in the graphs compiled at prepare
        assert new["compiled"] > old["compiled"] and new["eager"] == old["eager"]
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_compiled_encoder_encodes_each_row_as_the_eager_encoder_does(marian):
    """``prepare`` compiles the encoder (said in its reason): a ragged batch of sources is encoded row by row at each
    row's own length, as the eager encoder encodes each source alone, the padding zeros; a one-token source is left
    to the eager encoder (None), as is a model that was not compiled."""
    target = marian[0]
    compiled = compiled_for(target)
    assert compiled.encoder is not None
    batch = PromptBatch.from_lists([[0], [0], [0]], "cpu", [SOURCES[2], SOURCES[0], SOURCES[1]])
    valid = batch.source_valid()
    with torch.inference_mode():
        encoded = compiled.encode(batch.source, valid)
        for row, source in enumerate((SOURCES[2], SOURCES[0], SOURCES[1])):
            alone = target.get_encoder()(input_ids=torch.tensor([source])).last_hidden_state[0]
            assert torch.allclose(encoded[row, valid[row]], alone, atol=1e-4)
            assert not encoded[row, ~valid[row]].any()
        assert compiled.encode(torch.tensor([SOURCES[4]]), torch.ones(1, 1, dtype=torch.bool)) is None
    assert "the encoder compiled" in prepare(target, "on", tokens=(1,)).reason


def test_a_shape_outside_the_buckets_runs_eagerly_and_exactly(marian):
    target, drafter, references = marian
    with pytest.warns(UserWarning, match="no compiled bucket: it runs eagerly"):
        ours = spec(target, drafter, SOURCES[2], gamma=6).tokens  # verifies 7 tokens: no bucket
    assert ours == references[2]
    assert calls(target)["eager"] > 0


def test_compiled_bart_is_exact():
    target = build("bart")
    references = [generate(target, s, NEW, []) for s in SOURCES[:3]]
    assert prepare(target, "on", tokens=(1, GAMMA + 1)).compiled
    assert [spec(target, "ngram", s).tokens for s in SOURCES[:3]] == references
    plain = [specdec.autoregressive_generate(target, s, max_new_tokens=NEW, stop_token_ids=[]).tokens
             for s in SOURCES[:3]]
    assert plain == references
    assert calls(target)["eager"] == 0 and calls(target)["compiled"] > 0


def test_t5_is_refused_by_name_and_decodes_eagerly_said_once():
    target = build("t5")
    reference = generate(target, SOURCES[0], NEW, [])
    assert "relative position bias" in compile_refusal(target)
    with pytest.warns(UserWarning, match="relative position bias.*it decodes eagerly"):
        choice = prepare(target, "on")
    assert not choice.compiled and compiled_for(target) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert spec(target, "ngram", SOURCES[0]).tokens == reference
    assert not [w for w in caught if "eager" in str(w.message)]  # said once, at prepare


def test_static_seq2seq_cache_follows_the_ragged_rule():
    """Random forwards (left and right padding), rollbacks, selects, joins with sources of other lengths (the
    source buffers widen) and compactions: the static cache's logits equal Seq2SeqCache's at every step
    (nothing compiled: the static step runs eagerly)."""
    model = build("marian", seed=3)
    compiled = CompiledSeq2Seq(model, slots=40)
    compiled.rows, compiled.tokens = (4,), (1, 3)
    static, eager = StaticSeq2SeqCache(model, compiled), Seq2SeqCache(model, 0)
    widths = []

    def join(prompts, sources):
        batch = PromptBatch.from_lists(prompts, "cpu", sources)
        static.merge(prefilled_cache(model, batch, "cpu")[0])
        eager.merge(prefilled_cache(model, batch, "cpu")[0])
        widths.append(static.source_width)

    def join_random(rng):
        join([[0] + [rng.randint(3, 95) for _ in range(rng.randint(1, 8))]],
             [[rng.randint(3, 95) for _ in range(rng.choice([2, 20, 45]))]])

    join([[0, 4, 5, 6, 7], [0, 9]], [[5, 6, 7], [8, 9, 10, 11, 2]])
    compactions = drive_alike(static, eager, compiled.slots, join_random)
    assert compactions > 0 and widths[0] < max(widths)  # re-packed, and a longer source widened the buffers


def test_the_source_buffers_narrow_when_the_long_source_leaves():
    """A row whose source widened the buffers leaves: the buffers narrow to the widest kept source (every step's
    cross-attention reads the whole width), and the kept row's logits still equal Seq2SeqCache's."""
    model = build("marian", seed=3)
    compiled = CompiledSeq2Seq(model, slots=40)
    compiled.rows, compiled.tokens = (4,), (1, 3)
    static, eager = StaticSeq2SeqCache(model, compiled), Seq2SeqCache(model, 0)
    batch = PromptBatch.from_lists([[0, 4, 5], [0, 9]], "cpu", [list(range(3, 48)), [5, 6, 7]])
    for cache in (static, eager):
        cache.merge(prefilled_cache(model, batch, "cpu")[0])
    assert static.source_width == 64
    for cache in (static, eager):
        cache.select(torch.tensor([1]))
    assert static.source_width == 32
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nothing compiled: the static step runs eagerly
        ids = torch.tensor([[11, 12]])
        assert torch.allclose(static.forward(ids, logits_to_keep=2).logits, eager.forward(ids, logits_to_keep=2).logits,
                              atol=1e-5)
    for cache in (static, eager):
        cache.select(torch.tensor([], dtype=torch.long))
    assert static.source_width in (0, 32)  # no row left: the narrowest buffers, or none


def test_cross_states_are_what_the_modules_cache():
    """``cross_states`` (each cross-attention module stopped where it caches) gives the keys and values that the
    eager cache holds after a first decoder forward."""
    from specdec.compiled import cross_states

    model = build("marian", seed=3)
    cache = Seq2SeqCache(model, 1)
    source = torch.tensor([list(range(3, 20))])
    with torch.no_grad():
        cache.encode(source, torch.ones_like(source, dtype=torch.bool))
        cache.forward(torch.tensor([[0]]))
        states = cross_states(model, cache.encoded)
    assert len(states) == len(cache.cross.layers) > 0
    for (keys, values), layer in zip(states, cache.cross.layers):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)


def test_the_shipped_translate_pair_compiled_equals_generate(shipped_translations):
    """translate-target and translate-drafter compiled (rows of 1 and 2 for the target's verification): the
    drafter model, lookup then the drafter, prompt lookup and plain decoding give the target's own greedy
    ``generate`` (its generation config), one source at a time and in a ragged batch of 2."""
    from transformers import AutoModelForSeq2SeqLM

    from specdec.loading import default_model_path

    target, tokenizer, sources, expected = shipped_translations
    drafter = AutoModelForSeq2SeqLM.from_pretrained(default_model_path("translate-drafter"),
                                                   dtype=torch.float32).eval()
    assert prepare(target, "on", tokens=(1, GAMMA + 1)).compiled
    assert prepare(target, "on", tokens=(GAMMA + 1,), rows=(2,)).compiled
    assert prepare(drafter, "on", tokens=(1, 2)).compiled
    common = {"tokenizer": tokenizer, "max_new_tokens": TRANSLATE_NEW, "gamma": GAMMA}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lookup's longer copies and the drafter's rows of 2 run eagerly, said
        for chosen in (drafter, specdec.LookupDrafter(specdec.drafters.model_drafter(drafter)), "ngram"):
            for batch_size in (1, 2):
                results = specdec.speculative_generate(target, chosen, sources, batch_size=batch_size, **common)
                assert [r.tokens for r in results] == expected, (chosen, batch_size)
        plain = specdec.autoregressive_generate(target, sources, tokenizer=tokenizer, max_new_tokens=TRANSLATE_NEW)
    assert [r.tokens for r in plain] == expected
    assert calls(target)["compiled"] > calls(target)["eager"] and calls(drafter)["compiled"] > 0


SECOND_START = """
import json, sys
import torch
for _ in range(int(sys.argv[1])):  # other forward hooks first: hook ids (and object ids) differ between the starts
    torch.nn.Linear(1, 1).register_forward_hook(lambda *args: None)
sys.path.insert(0, sys.argv[2])
from test_seq2seq import SOURCES, build
import specdec
from specdec.compiled import compiled_for, prepare
target = build("marian", seed=int(sys.argv[3]))
choice = prepare(target, "on", tokens=(1,), rows=(1, 3))
results = specdec.autoregressive_generate(target, SOURCES, max_new_tokens=18, stop_token_ids=[], batch_size=3)
print(json.dumps({"loaded": compiled_for(target).loaded, "calls": compiled_for(target).calls,
                  "tokens": [r.tokens for r in results]}))
"""


@saved_steps
def test_a_second_start_loads_the_compiled_decoder_step_from_disk(tmp_path):
    """A fresh process compiles Marian's decoder step (rows of 1 and 3) and its encoder and saves them; a second fresh
    process, with other forward hooks registered before and a model of other weights, loads the three graphs and decodes
    a ragged batch (rows join at position 0 beside rows further on: the positions hook matters) exactly as
    ``generate``. The saved graph reaches the model's ``Positions`` through its inputs, not through a table
    keyed by the first process's ``id(model)`` (a KeyError in the second start, which then decoded eagerly)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "SPECDEC_LINEAR": "off"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    runs = []
    for hooks, seed in ((0, 0), (7, 1)):
        done = subprocess.run([sys.executable, "-c", SECOND_START, str(hooks), str(Path(__file__).parent), str(seed)],
                              env=env, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("could not be compiled" not in done.stderr
                and "compiling it again" not in done.stderr), done.stderr[-3000:]
        runs.append(json.loads(done.stdout.splitlines()[-1]))
        target = build("marian", seed=seed)
        assert runs[-1]["tokens"] == [generate(target, s, NEW, []) for s in SOURCES]
        assert runs[-1]["calls"]["eager"] == 0 and runs[-1]["calls"]["compiled"] > 0
    assert [run["loaded"] for run in runs] == [0, 3]  # the steps of rows 1 and 3, and the encoder
