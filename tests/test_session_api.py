"""The Python API's ``compile=`` and ``threads=`` (``specdec.session``), and the one compile plan (``specdec.plan``).

``specdec.speculative_generate`` prepares as a ``Session`` does (threads, then the plan's buckets compiled) and then
calls the core: compiled, it must still give the target's own ``generate`` tokens, and the models must be compiled
for the plan's shapes; ``threads=`` must leave torch with the count the command line would choose.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_greedy, build_tiny, hf_greedy

import specdec
from specdec import threads as threads_module
from specdec.compiled import buckets, compiled_for, row_buckets, token_buckets
from specdec.config import ModelConfig, ScheduleConfig, SpecConfig
from specdec.drafters.hybrid import LOOKUP_NGRAM
from specdec.plan import Plan, Shapes, decode_plan, mode_plan
from specdec.session import Session

PROMPT = [1, 5, 9, 33, 7, 5, 9, 33]
GAMMA = 3
NEW = 24


@pytest.fixture
def restore_threads():
    """torch's thread count and specdec's last choice, as they were before the test."""
    count, applied = torch.get_num_threads(), threads_module._applied
    yield
    torch.set_num_threads(count)
    threads_module._applied = applied


def test_compile_on_gives_the_target_s_own_tokens_and_compiles_both_models(restore_threads):
    target, drafter = build_tiny("llama", seed=0, layers=2), build_tiny("llama", seed=1, layers=1)
    reference = hf_greedy(target, PROMPT, NEW, [])
    assert compiled_for(target) is None and compiled_for(drafter) is None
    out = specdec.speculative_generate(target, drafter, PROMPT, max_new_tokens=NEW, gamma=GAMMA, stop_token_ids=[],
                                       compile="on")
    assert_same_greedy(target, PROMPT, out.tokens, reference)
    plan = decode_plan(GAMMA, lookup=False, drafter_model=True, speculating=True, plain=False)
    for model, shapes in ((target, plan.target), (drafter, plan.drafter)):
        compiled = compiled_for(model)
        assert compiled is not None
        assert set(buckets(shapes.tokens, shapes.rows, shapes.hidden, shapes.last)) <= compiled.shapes
    assert sum(compiled_for(target).calls.values()) > 0  # the rounds ran the compiled step
    plain = specdec.autoregressive_generate(target, PROMPT, max_new_tokens=NEW, stop_token_ids=[], compile="on")
    assert_same_greedy(target, PROMPT, plain.tokens, reference)
    assert set(buckets((1,), (1,))) <= compiled_for(target).shapes  # plain decoding's step added


def test_compile_off_is_the_default_and_compiles_nothing(restore_threads):
    target = build_tiny("llama", seed=0, layers=1)
    out = specdec.speculative_generate(target, "ngram", PROMPT, max_new_tokens=8, stop_token_ids=[])
    assert compiled_for(target) is None
    assert out.tokens == hf_greedy(target, PROMPT, 8, [])
    with pytest.raises(ValueError, match="compile"):
        specdec.speculative_generate(target, "ngram", PROMPT, max_new_tokens=8, compile="sometimes")


def test_threads_sets_torch_s_count_as_the_command_line_would(monkeypatch, restore_threads):
    target = build_tiny("llama", seed=0, layers=1)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads_module._applied = None  # no choice made in this process yet
    torch.set_num_threads(2)
    cli = threads_module.machine_choice(None, model=target, flag="--threads")  # what Session (the CLI) applies
    specdec.speculative_generate(target, "ngram", PROMPT, max_new_tokens=4)
    assert torch.get_num_threads() == cli.threads == 1  # a tiny target: one thread, not torch's 2
    assert threads_module.current().source == cli.source
    torch.set_num_threads(2)  # the caller's own count after specdec's choice is kept
    specdec.speculative_generate(target, "ngram", PROMPT, max_new_tokens=4)
    assert torch.get_num_threads() == 2
    specdec.autoregressive_generate(target, PROMPT, max_new_tokens=4, threads=1)  # asked for: applied
    assert (torch.get_num_threads(), threads_module.current().source) == (1, "threads=")
    with pytest.raises(ValueError, match="threads= 0"):
        specdec.speculative_generate(target, "ngram", PROMPT, max_new_tokens=4, threads=0)


def test_the_plan_follows_the_drafter_and_the_mode():
    copy = LOOKUP_NGRAM.copy_length(4)
    rows = row_buckets(16)
    assert mode_plan("speculative", 4, "on", "lookup+code-drafter", batch=16, schedule="ada") == Plan(
        Shapes((5, copy + 1), rows), Shapes((1, 2, copy + 2), rows, hidden=True, last=True))
    assert mode_plan("speculative", 4, "on", "code-drafter") == Plan(Shapes((5,), (1,)), Shapes((1, 2), (1,),
                                                                                                last=True))
    assert mode_plan("speculative", 4, "on", "ngram") == Plan(Shapes((5,), (1,)), None)  # no model to compile
    assert mode_plan("speculative", 4, "on", "lookup+block").drafter is None  # the block drafter runs eagerly
    assert mode_plan("speculative", 4, "auto", "code-drafter").target.tokens == (1, 5)  # it may decode plainly
    assert mode_plan("target", 4, "on", "code-drafter") == Plan(Shapes((1,), (1,)), None)
    assert mode_plan("speculative", 4, "off", "code-drafter") == Plan(Shapes((1,), (1,)), None)
    # the buckets are compiled.token_buckets', whatever asks
    verify, steps = token_buckets(4, "lookup+code-drafter", True, False, copy)
    assert (mode_plan("speculative", 4, "on", "lookup+code-drafter").target.tokens,
            mode_plan("speculative", 4, "on", "lookup+code-drafter").drafter.tokens) == (verify, steps)


def test_the_session_compiles_the_plan_of_its_models(restore_threads):
    session = Session(ModelConfig(target="code-target", drafter="lookup+code-drafter", compile="on"))
    entries = session.compile_plan("speculative", SpecConfig(gamma=4, batch_size=8), ScheduleConfig(), prompts=2)
    plan = mode_plan("speculative", 4, "on", "lookup+code-drafter", batch=2)
    assert entries == [("code-target", *plan.target.__dict__.values()),
                       ("code-drafter", *plan.drafter.__dict__.values())]
