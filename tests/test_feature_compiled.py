"""A feature drafter with ``--compile on``: the compiled target returns the drafter's features from its graph
(``specdec.plan``: the target's buckets are warmed with ``Shape.hidden`` = the layers the drafter reads), so a run
decodes on the compiled path end to end (the drafter's one layer eagerly), with greedy output equal to the target's
own ``generate``: one row, and a ragged batch whose rows finish at different rounds (a one-token prompt among them).
"The compiled path" is checked by the compiled step's own meter: every target forward of the runs ran a warmed
bucket, none fell back to the eager step. Compiling costs tens of seconds a shape here, so one module fixture
compiles once (the batch's row buckets 1 and 4, the verify's gamma + 1 tokens, returning the features only).
"""

from __future__ import annotations

import pytest
from conftest import assert_same_greedy, hf_greedy
from test_feature_drafter_decoding import PROMPTS, _drafter_model, _target
from test_session_api import restore_threads  # noqa: F401 - the fixture

import specdec
from specdec.compiled import Shape, compiled_for
from specdec.config import ScheduleConfig, SpecConfig
from specdec.drafters import FeatureDrafter, LookupDrafter
from specdec.features import drafter_layers
from specdec.plan import Plan, Shapes, decode_plan, drafter_features, mode_plan

pytestmark = pytest.mark.usefixtures("one_thread")
GAMMA, NEW = 3, 16


def _stop_that_ends_some_rows(target) -> tuple[int, list[list[int]]]:
    """A stop token at which some rows end early and others run to ``NEW`` tokens, and the references."""
    for stop in range(1, 6):
        references = [hf_greedy(target, p, NEW, [stop]) for p in PROMPTS]
        lengths = {len(r) for r in references}
        if min(lengths) < NEW and NEW in lengths:
            return stop, references
    raise AssertionError("no stop token ends some rows and not others: change the model's seed")


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    """The tiny target, its drafter's folder, the stop token, the references, and the batch's results with
    ``compile="on"`` (which compiles the target's buckets)."""
    target = _target()
    folder = tmp_path_factory.mktemp("fd") / "drafter"
    _drafter_model(target, seed=10).save_pretrained(folder)
    stop, references = _stop_that_ends_some_rows(target)
    results = specdec.speculative_generate(target, str(folder), PROMPTS, max_new_tokens=NEW, gamma=GAMMA,
                                           stop_token_ids=[stop], batch_size=4, compile="on")
    yield target, folder, stop, references, results
    from specdec.compiled import set_compiled

    set_compiled(target, None)


def test_the_compiled_target_returns_the_features_from_its_graph(compiled_run):
    target, folder, _, _, _ = compiled_run
    layers = drafter_features(str(folder))
    assert layers == (1, 2, 3)  # a 4-layer target's default: layers 0, 1, 2's outputs, hidden_states 1, 2, 3
    compiled = compiled_for(target)
    assert compiled is not None
    # returning the features only: the verify of a target whose drafter reads them always asks for them
    assert compiled.shapes == {Shape(rows, GAMMA + 1, layers) for rows in (1, 4)}
    assert compiled.calls["compiled"] > 0 and compiled.calls["eager"] == 0


def test_a_ragged_batch_with_rows_finishing_equals_generate(compiled_run):
    target, _, _, references, results = compiled_run
    for prompt, result, reference in zip(PROMPTS, results, references):
        assert_same_greedy(target, prompt, result.tokens, reference)
    assert len({len(r.tokens) for r in results}) > 1  # rows finished at different rounds
    drafted, accepted = sum(r.stats.drafted for r in results), sum(r.stats.accepted for r in results)
    assert 0 < accepted < drafted  # rollbacks on the static cache, with features of rejected positions dropped


@pytest.mark.parametrize("form", ["object", "lookup"])
def test_single_rows_decode_compiled_and_exactly(compiled_run, form):
    """One row at a time (the 1-row bucket), with the drafter given as a built ``FeatureDrafter`` or behind prompt
    lookup: ``compile="on"`` finds its shapes compiled (nothing new is warmed) and every forward runs them."""
    target, folder, stop, references, _ = compiled_run
    compiled = compiled_for(target)
    shapes, before = set(compiled.shapes), dict(compiled.calls)
    for prompt, reference in zip(PROMPTS, references):
        drafter = FeatureDrafter(_drafter_model(target, seed=10)) if form == "object" else f"lookup+{folder}"
        result = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=NEW, gamma=GAMMA,
                                              stop_token_ids=[stop], compile="on")
        assert_same_greedy(target, prompt, result.tokens, reference)
    after = compiled_for(target)
    if form == "lookup":  # prompt lookup copies longer than gamma: those verify buckets were added, with features
        assert all(s.hidden == (1, 2, 3) for s in after.shapes - shapes) and after.shapes > shapes
    else:
        assert after.shapes == shapes
    assert after.calls["compiled"] > before["compiled"] and after.calls["eager"] == before["eager"]


def test_the_plan_compiles_the_targets_features_and_no_drafter(tmp_path):
    """``mode_plan`` and ``drafter_features`` (no compiling): the target's buckets return the layers a feature
    drafter reads, by folder, ``lookup+folder``, object, model or a lookup drafter around one (a parallel drafter's
    too); the feature drafter gets no buckets; a model drafter's plan is unchanged; the chat's compare keeps the
    featureless buckets too."""
    target = _target()
    model = _drafter_model(target)
    model.save_pretrained(tmp_path / "fd")
    layers = drafter_layers(model.config)
    assert layers == tuple(i + 1 for i in model.config.feature_layers)
    for drafter in (str(tmp_path / "fd"), f"lookup+{tmp_path / 'fd'}", model, FeatureDrafter(model),
                    LookupDrafter(FeatureDrafter(model))):
        assert drafter_features(drafter) == layers, drafter
    from specdec.drafters.parallel_model import new_parallel_drafter

    new_parallel_drafter(target, feature_layers=[0, 2, 3]).save_pretrained(tmp_path / "pd")  # reads features too
    assert drafter_features(str(tmp_path / "pd")) == (1, 3, 4)
    for drafter in ("code-drafter", "lookup+code-drafter", "ngram", "lookup+block", str(tmp_path / "missing"),
                    None, target):
        assert drafter_features(drafter) is None, drafter
    plan = mode_plan("speculative", 3, "on", str(tmp_path / "fd"), batch=4)
    assert plan == Plan(Shapes((4,), (1, 4), layers, bare=False), None)
    assert mode_plan("speculative", 3, "auto", f"lookup+{tmp_path / 'fd'}").target.hidden == layers
    assert mode_plan("compare", 3, "on", str(tmp_path / "fd")).target.bare  # plain decoding beside: no features
    assert mode_plan("target", 3, "on", str(tmp_path / "fd")) == Plan(Shapes((1,), (1,)), None)
    assert decode_plan(3, lookup=False, drafter_model=True, speculating=True, plain=False) == Plan(
        Shapes((4,), (1,)), Shapes((1, 2), (1,), last=True))


def test_the_session_plans_the_targets_features(tmp_path, restore_threads):  # noqa: F811 - the fixture
    """``Session.compile_plan`` (what the command line, the chat and the server compile): the target only, with
    the feature drafter's layers."""
    from specdec.config import ModelConfig
    from specdec.session import Session

    target = specdec.load_model("code-target")
    from specdec.drafters.feature_model import new_feature_drafter

    new_feature_drafter(target).save_pretrained(tmp_path / "fd")
    session = Session(ModelConfig(target="code-target", drafter=str(tmp_path / "fd"), compile="on"))
    entries = session.compile_plan("speculative", SpecConfig(gamma=4, batch_size=8), ScheduleConfig(), prompts=2)
    layers = drafter_features(str(tmp_path / "fd"))
    assert entries == [("code-target", (5,), (1, 2), layers, False, False)]
