"""The compiled path on a CUDA device: each bucket's step replayed as a CUDA graph (``specdec.compiled.CudaStep``),
exact against the eager decoding of the same models on the same device and against ``generate``.

Skipped without a CUDA device (CI has none); run where one is lent: ``python -m pytest -m gpu``. One pair per
form of the step: a Llama and a GPT-2 pair whose eager step is captured (the default), a Llama pair whose steps
inductor compiles (``SPECDEC_CUDA_STEP=inductor``; on the H100 of docs/benchmarks.md, torch 2.11, it has not run
yet); and a Marian pair (encoder-decoder: each row's source in the cache's buffers, a positions hook in the step).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_greedy, build_tiny, hf_greedy
from test_compiled import GAMMA, NEW, PROMPTS, spec  # the CPU tests' prompts and call

import specdec
from specdec.compiled import SLOT_STEP, compiled_for, prepare

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module", params=(("llama", "eager"), ("gpt2", "eager"), ("llama", "inductor")),
                ids=("llama-eager", "gpt2-eager", "llama-inductor"))
def pair(request):
    """A tiny float32 target and drafter on the GPU, the eager results first, then both compiled and replayed; and the
    target's copy on the CPU, for ``generate``'s reference."""
    arch, step = request.param
    on_cpu = build_tiny(arch, seed=0, layers=2)
    target = build_tiny(arch, seed=0, layers=2).to("cuda")
    drafter = build_tiny(arch, seed=1, layers=1).to("cuda")
    eager = {
        "single": [spec(target, drafter, p).tokens for p in PROMPTS],
        "batch": [r.tokens for r in spec(target, drafter, PROMPTS, batch_size=4)],
        "sampled": [spec(target, drafter, p, temperature=1.0, seed=7).tokens for p in PROMPTS],
        "long": spec(target, drafter, PROMPTS[2], max_new_tokens=90).tokens,
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_CUDA_STEP", step)
        for model, tokens in ((target, (GAMMA + 1,)), (drafter, (1, 2))):
            choice = prepare(model, "on", tokens=tokens, rows=(1, 4))
            assert choice.compiled and "CUDA graphs" in choice.reason, choice.reason
            assert compiled_for(model).inductor == (step == "inductor")
    return target, drafter, eager, on_cpu


def replayed(model) -> int:
    """How many CUDA graphs the model's compiled step holds (captured, alive)."""
    compiled = compiled_for(model)
    assert compiled.replays, "the graphs were given up (a capture failed)"
    return sum(len(steps) for steps in compiled.captured.values())


def reference(on_cpu, prompt, new):
    return hf_greedy(on_cpu, prompt, new, [2])


def test_replayed_single_prompt_is_exact(pair):
    target, drafter, eager, on_cpu = pair
    before = dict(compiled_for(target).calls)
    for prompt, expected in zip(PROMPTS, eager["single"]):
        ours = spec(target, drafter, prompt).tokens
        assert ours == expected
        assert_same_greedy(on_cpu, prompt, ours, reference(on_cpu, prompt, NEW))
    after = compiled_for(target).calls
    assert after["compiled"] > before["compiled"] and after["eager"] == before["eager"]
    assert replayed(target) > 0 and replayed(drafter) > 0


def test_replayed_ragged_batch_is_exact(pair):
    target, drafter, eager, on_cpu = pair
    results = spec(target, drafter, PROMPTS, batch_size=4)
    assert [r.tokens for r in results] == eager["batch"]
    for prompt, result in zip(PROMPTS, results):
        assert_same_greedy(on_cpu, prompt, result.tokens, reference(on_cpu, prompt, NEW))
    assert sum(r.stats.accepted for r in results) < sum(r.stats.drafted for r in results)  # rollbacks


def test_replayed_sampling_draws_the_same_tokens(pair):
    target, drafter, eager, _ = pair
    assert [spec(target, drafter, p, temperature=1.0, seed=7).tokens for p in PROMPTS] == eager["sampled"]


def test_a_context_crossing_slot_widths_is_exact(pair):
    """Each slot width is a graph of its own (a CUDA graph's shapes are fixed): a generation whose cache grows
    across several widths gives the eager tokens and generate's."""
    target, drafter, eager, on_cpu = pair
    ours = spec(target, drafter, PROMPTS[2], max_new_tokens=90).tokens
    assert ours == eager["long"]
    assert_same_greedy(on_cpu, PROMPTS[2], ours, reference(on_cpu, PROMPTS[2], 90))
    assert len(PROMPTS[2]) + len(ours) > 3 * SLOT_STEP
    widths = {width for steps in compiled_for(target).captured.values() for _, width in steps}
    assert len(widths) >= 3


def test_a_replayed_encoder_decoder_pair_decodes_as_it_does_eagerly():
    """Marian's decoder step captured (its source buffers are the graph's by address, its positions hook runs in the
    step): single sources and a ragged batch whose rows leave and join with sources of other lengths (the source
    buffers widen: new buffers, new graphs) give the tokens of the eager decoding on the same GPU."""
    from test_seq2seq import SOURCES, build, first_decoder_layer

    target = build("marian").to("cuda")
    drafter = first_decoder_layer(target)

    def run():
        return ([specdec.speculative_generate(target, drafter, s, gamma=GAMMA, max_new_tokens=NEW, stop_token_ids=[])
                 .tokens for s in SOURCES],
                [r.tokens for r in specdec.speculative_generate(target, drafter, SOURCES, gamma=GAMMA,
                                                               max_new_tokens=NEW, stop_token_ids=[], batch_size=3)])

    eager = run()
    for model, tokens in ((target, (1, GAMMA + 1)), (drafter, (1, 2))):
        assert "CUDA graphs" in prepare(model, "on", tokens=tokens, rows=(1, 3)).reason
    assert run() == eager
    for model in (target, drafter):  # every step replayed (a source's buffers, and so its graphs, die with its row)
        compiled = compiled_for(model)
        assert compiled.replays and compiled.calls["compiled"] > 0 and compiled.calls["eager"] == 0


def test_the_phase_clock_times_the_device_without_waiting_for_it():
    """On CUDA a phase is timed by events the device reaches (``specdec.events.Intervals``): marking a phase waits for
    nothing (sync debug mode "error" raises on any wait), and a phase that queued a long kernel is charged its time,
    read once the round is read."""
    from specdec.events import VERIFY, Events, PhaseClock

    clock = PhaseClock("cuda")
    events = Events([clock])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with events.phase(VERIFY):
            torch.cuda._sleep(200_000_000)  # a kernel that spins for 200M cycles: about 0.1 s at 2 GHz
    finally:
        torch.cuda.set_sync_debug_mode("default")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(200_000_000)
    end.record()
    end.synchronize()
    alone = start.elapsed_time(end) / 1e3
    assert clock.round[VERIFY] == pytest.approx(alone, rel=0.2)
