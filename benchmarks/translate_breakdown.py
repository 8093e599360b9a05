"""Where the translation pair's time goes (issue 28): our loop, transformers' forward, the encoder, the weights.

The shipped ``translate-target`` (and ``translate-drafter``), greedy, batch 1, a seeded sample of held-out
sources of ``specdec data gettext``'s test split, one thread, every job once per repeat in one process, in
the same order (medians over repeats). Printed, per token of the target's greedy output (per source for
the encoders):

- ``hf generate``: transformers' ``generate`` (greedy), one source at a time;
- ``specdec plain``: ``autoregressive_generate`` (our loop drafting nothing);
- ``raw transformers loop``: the least any loop around transformers' forward can cost: the encoder, then
  ``model(...)`` on one token at a time with an ``EncoderDecoderCache`` and an argmax, with specdec's linear
  kernels active as our loop has them (``specdec.kernels``): our loop's overhead is the difference;
- ``drafter alone``: ``autoregressive_generate`` on ``translate-drafter`` over the same sources, per token of
  its own outputs: over ``specdec plain`` it is about the cost ratio c of a drafter step;
- ``encoder only`` (target, drafter): one encoder pass per source;
- ``ctranslate2`` (when installed): CTranslate2's ``Translator`` on the target, float32, greedy, converted
  by ``specdec.bench.ctranslate2_seq2seq`` (its outputs are checked equal to ``generate``'s);
- the weight pass of a decoder step: the linear layers one step applies (self-attention, the cross-attention's
  query and output, the feed-forward, the output projection; not the cross-attention's keys and values,
  computed once per source) on a one-token input, with the kernels (``specdec.bench.floor.weight_pass``).
- ``--compile``: ``specdec plain`` and ``drafter alone`` also with their decode steps compiled
  (``specdec.compiled.CompiledSeq2Seq``, rows of 1, the buckets of ``compiled.token_buckets``), and prompt lookup
  (``ngram``, the default) and the drafter model (γ 4) each way, in the same process, interleaved with
  the eager jobs (every output checked equal to ``generate``'s).
- ``--float32-copy`` (with ``--compile``): a second copy of the target compiled with its linears' blocked copies in
  float32 (``kernels.block_weight``), not in the bfloat16 pairs ``kernels.blocked_copy`` makes for a model stored in
  bfloat16, timed beside the first (``specdec plain`` and ``ngram``, compiled): what reading half the bytes gives.

    python benchmarks/translate_breakdown.py --data data/gettext-de --sources 40 --repeats 5
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DynamicCache,
    EncoderDecoderCache,
    GenerationConfig,
    PreTrainedModel,
)

import specdec
from specdec import kernels
from specdec.bench.floor import weight_pass
from specdec.bench.translate import encode_sources, sample_pairs
from specdec.compat import cache_kwargs

MODELS = Path(__file__).resolve().parent.parent / "models"


class DecoderStep(torch.nn.Module):
    """The linear layers one decoder step of ``model`` applies (see the module doc), for ``weight_pass``."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        once = ("encoder_attn.k_proj", "encoder_attn.v_proj")  # once per source, not per step
        self.layers = torch.nn.ModuleList(
            [m for name, m in model.get_decoder().named_modules()
             if isinstance(m, torch.nn.Linear) and not name.endswith(once)] + [model.get_output_embeddings()])


def raw_loop(model: PreTrainedModel, sources: list[list[int]], max_new_tokens: int, eos: int) -> list[list[int]]:
    """Greedy by transformers' forward alone: the encoder, then one token at a time on its own cache."""
    start = model.config.decoder_start_token_id
    outputs = []
    with kernels.active():
        for ids in sources:
            encoded = model.get_encoder()(input_ids=torch.tensor([ids])).last_hidden_state
            cache, token, tokens = EncoderDecoderCache(DynamicCache(), DynamicCache()), torch.tensor([[start]]), []
            for _ in range(max_new_tokens):
                out = model(encoder_outputs=(encoded,), decoder_input_ids=token, **cache_kwargs(model, cache),
                            use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                tokens.append(int(token))
                if tokens[-1] == eos:
                    break
            outputs.append(tokens)
    return outputs


def encoder_only(model: PreTrainedModel, sources: list[list[int]]) -> None:
    with kernels.active():
        for ids in sources:
            model.get_encoder()(input_ids=torch.tensor([ids]))


@contextmanager
def eager(*models: PreTrainedModel) -> Iterator[None]:
    """Within the block, ``models`` decode eagerly even where ``--compile`` compiled them."""
    from specdec.compiled import compiled_for, set_compiled

    held = [compiled_for(m) for m in models]
    for model in models:
        set_compiled(model, None)
    try:
        yield
    finally:
        for model, compiled in zip(models, held):
            set_compiled(model, compiled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="data/gettext-de", help="a `specdec data gettext` folder")
    parser.add_argument("--target", default=str(MODELS / "translate-target"))
    parser.add_argument("--drafter", default=str(MODELS / "translate-drafter"))
    parser.add_argument("--sources", type=int, default=40, help="test sources sampled (seed 19)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also time plain decoding with compiled decode steps")
    parser.add_argument("--float32-copy", action="store_true",
                        help="with --compile: also a target compiled on float32 copies of its weights "
                             "(not bfloat16 pairs)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForSeq2SeqLM.from_pretrained(args.target, dtype=torch.float32).eval()
    drafter = AutoModelForSeq2SeqLM.from_pretrained(args.drafter, dtype=torch.float32).eval()
    sources = encode_sources(tokenizer, target, [p["src"] for p in sample_pairs(args.data, "test", args.sources, 19)])
    eos, n = target.config.eos_token_id, args.max_new_tokens
    for model in (target, drafter):
        kernels.install(model)  # as specdec's handles install them (SPECDEC_LINEAR)
    config = GenerationConfig(max_new_tokens=n, num_beams=1, do_sample=False, eos_token_id=eos,
                              pad_token_id=target.config.pad_token_id,
                              decoder_start_token_id=target.config.decoder_start_token_id)
    common = {"max_new_tokens": n, "stop_token_ids": [eos], "batch_size": 1}
    if args.compile:
        from specdec.compiled import prepare, token_buckets

        verify, steps = token_buckets(4, "lookup+", True, True, 4)
        print("compile:", prepare(target, "on", tokens=verify).reason, "(target);",
              prepare(drafter, "on", tokens=steps).reason, "(drafter)")
    full = None
    if args.compile and args.float32_copy:
        full = AutoModelForSeq2SeqLM.from_pretrained(args.target, dtype=torch.float32).eval()
        kernels.install(full)
        exact, kernels.bf16_exact = kernels.bf16_exact, lambda weight: False  # every copy in float32
        try:
            print("compile:", prepare(full, "on", tokens=verify).reason, "(target, float32 copies)")
        finally:
            kernels.bf16_exact = exact

    def plain(model: PreTrainedModel, compiled: bool = False) -> list:
        if compiled:
            return specdec.autoregressive_generate(model, sources, **common)
        with eager(target, drafter):
            return specdec.autoregressive_generate(model, sources, **common)

    def speculative(chosen: object, compiled: bool) -> list:
        if compiled:
            return specdec.speculative_generate(target, chosen, sources, gamma=4, **common)
        with eager(target, drafter):
            return specdec.speculative_generate(target, chosen, sources, gamma=4, **common)

    def hf() -> list[list[int]]:
        return [target.generate(torch.tensor([ids]), generation_config=config)[0, 1:].tolist() for ids in sources]

    with torch.inference_mode():
        reference = hf()
        drafter_tokens = sum(len(r.tokens) for r in plain(drafter))
        jobs: dict[str, Callable[[], object]] = {
            "hf generate": hf,
            "specdec plain": lambda: plain(target),
            "raw transformers loop": lambda: raw_loop(target, sources, n, eos),
            "drafter alone (specdec plain)": lambda: plain(drafter),
            "encoder only": lambda: encoder_only(target, sources),
            "drafter encoder only": lambda: encoder_only(drafter, sources),
        }
        checks = {"specdec plain": lambda: [r.tokens for r in jobs["specdec plain"]()],
                  "raw transformers loop": jobs["raw transformers loop"]}
        if args.compile:
            jobs["specdec plain compiled"] = lambda: plain(target, compiled=True)
            jobs["drafter alone compiled"] = lambda: plain(drafter, compiled=True)
            checks["specdec plain compiled"] = lambda: [r.tokens for r in jobs["specdec plain compiled"]()]
            if full is not None:
                for label, job in (("plain", specdec.autoregressive_generate),
                                   ("ngram",
                                    lambda m, s, **c: specdec.speculative_generate(m, "ngram", s, gamma=4, **c))):
                    name = f"specdec {label} compiled, float32 copy"
                    jobs[name] = lambda job=job: job(full, sources, **common)
                    checks[name] = lambda name=name: [r.tokens for r in jobs[name]()]
            for label, chosen in (("ngram", "ngram"), ("drafter model", drafter)):
                for compiled in (False, True):
                    name = f"specdec {label}{' compiled' if compiled else ''}"
                    jobs[name] = lambda chosen=chosen, compiled=compiled: speculative(chosen, compiled)
                    checks[name] = lambda name=name: [r.tokens for r in jobs[name]()]
        if importlib.util.find_spec("ctranslate2") is not None:
            from specdec.bench.ctranslate2_seq2seq import CTranslate2Translator

            translator = CTranslate2Translator(target, tokenizer, threads=1)
            jobs["ctranslate2"] = checks["ctranslate2"] = lambda: [translator.translate(s, n, eos) for s in sources]
        for name, check in checks.items():
            equal = sum(a == b for a, b in zip(check(), reference))
            print(f"{name}: {equal}/{len(sources)} outputs equal to generate's")
        times: dict[str, list[float]] = {name: [] for name in jobs}
        for _ in range(args.repeats):
            for name, job in jobs.items():
                start = time.perf_counter()
                job()
                times[name].append(time.perf_counter() - start)
        step, drafter_step = weight_pass(DecoderStep(target)), weight_pass(DecoderStep(drafter))
    tokens = sum(map(len, reference))
    print(f"{len(sources)} sources ({statistics.mean(map(len, sources)):.1f} tokens on average), {tokens} new tokens "
          f"(the target's greedy), 1 thread, medians of {args.repeats}")
    for name, seconds in times.items():
        per, count = ("source", len(sources)) if "encoder" in name else ("token", tokens)
        count = drafter_tokens if name.startswith("drafter alone") else count
        print(f"{name:32s} {statistics.median(seconds) * 1e3 / count:7.3f} ms per {per} "
              f"(min {min(seconds) * 1e3 / count:.3f})")
    print(f"decoder step's weight pass: target {step.seconds * 1e3:.3f} ms ({step.bytes / 2**20:.1f} MiB, "
          f"{step.layers} layers), drafter {drafter_step.seconds * 1e3:.3f} ms ({drafter_step.bytes / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
