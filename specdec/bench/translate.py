"""Translation benchmark (issue 19): an encoder-decoder target, greedy, batch 1, on held-out sources.

SpecDec (Xia et al. 2023) measures speculative decoding on translation; this runs our loop on the
English→German pair of ``specdec data gettext`` (or any ``AutoModelForSeq2SeqLM`` with its
tokenizer and a JSONL file of ``{"src", "tgt"}`` pairs). Every method decodes the same sources one
at a time, greedy, up to ``max_new_tokens``:

- ``hf``: the target's own ``generate(num_beams=1, do_sample=False)``, one source at a time;
  ``hf beam5``: its beam search (not exact: a quality reference); ``hf assisted``: its assisted
  generation with the encoder-decoder drafter model as ``assistant_model`` (transformers' defaults);
- ``plain``: our loop drafting nothing (``speculate="off"``): the ratio's denominator;
- ``ngram``: prompt lookup, which also copies spans from the source (numbers, names, markers);
- ``model``: an encoder-decoder drafter model; ``lookup+model``: lookup first, the model when
  lookup finds nothing;
- ``block``: SpecDec's block drafter (k drafts in one forward), verified exactly (β = 1);
  ``block β5τ3``: the same verified by SpecDec's relaxed top-β/τ rule (β 5, τ 3: not exact, its
  BLEU is the point); ``lookup+block``: lookup first, the block drafter otherwise;
- ``ctranslate2`` (``peers``, an optional extra): CTranslate2's ``Translator`` on the target,
  float32, greedy, converted at start (untimed) by ``specdec.bench.ctranslate2_seq2seq``, which
  converts a Marian model as transformers runs it (CTranslate2's stock Marian converter assumes
  OPUS-MT's vocabulary layout); exact like ours: its outputs must equal plain greedy's.

The repeats run in one process; in each repeat every method runs once, in rotating order, so the
machine's noise falls on all of them alike. Reported per method: tokens/s of the median repeat,
its ratio over ``plain`` (and over ``hf``), τ = tokens per target forward per row (new tokens /
rounds), α (accepted / drafted), how many outputs differ from ``plain`` (must be 0: greedy is
exact) and how many ran into ``max_new_tokens``; then tokens/s (summed per-source wall times,
median repeat), its ratio and τ over the "uncapped" sources only, those whose plain output ended
before ``max_new_tokens`` (a weak target loops, and lookup drafts a loop easily). BLEU and chrF
(sacrebleu) of every method's outputs against the references come with them; the exact methods
must equal ``plain`` on every source (the exit status says when one does not).

Memory (``memory_batches``): for each batch size B, the same ``memory_sources`` sources decoded
with ``batch_size`` B by ``plain`` and by each drafter, one untimed run inside a ``MemoryMeter``
(peak RSS on CPU, allocated memory on CUDA) after a warm-up; the extra memory of speculation is the
drafter run's growth plus the drafter's weights minus plain's growth, set beside the drafter's
weights (the issue's bound: at most 110% of them).

    specdec bench --task translate --data data/gettext-de --target runs/translate-target/final \\
        --drafter runs/translate-drafter/final --num-prompts 200 --seed 19
    python -m specdec.bench.translate --target runs/translate-target/final \\
        --drafter runs/translate-drafter/final --data data/gettext-de --split test --limit 200
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import sacrebleu
import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

import specdec
from specdec.bench.config import BenchConfig
from specdec.bench.environment import weight_mib
from specdec.bench.measure import MemoryMeter
from specdec.bench.records import write_summary
from specdec.config import VerifyConfig
from specdec.drafters import model_drafter
from specdec.threads import current as current_threads


@dataclass(frozen=True)
class TranslateBenchConfig:
    """What the translation benchmark decodes and how often."""

    target: str  # the target's folder (an AutoModelForSeq2SeqLM with its tokenizer)
    data: str  # a `specdec data gettext` folder ({split}.jsonl with "src" and "tgt")
    drafter: str | None = None  # an encoder-decoder drafter's folder; None = lookup only
    block_drafter: str | None = None  # an encoder-decoder block drafter's folder (SpecDec); None = none
    split: str = "test"  # which file of ``data``
    limit: int = 200  # sources sampled from the split (seeded, uniform); 0 = all
    seed: int = 19  # the sample's seed
    max_new_tokens: int = 128  # per source, the same for every method
    gamma: int = 4  # tokens drafted per round
    repeats: int = 3  # runs of every method; the median is reported
    hf: bool = True  # also time transformers' own generate (greedy, beam search, assisted with the drafter)
    beams: int = 5  # transformers' beam search width timed beside greedy (0 = none)
    beta: int = 5  # the relaxed block method's top-beta (SpecDec: 5)
    tau: float = 3.0  # ...and its logit gap (SpecDec: 3)
    memory_batches: tuple[int, ...] = (1, 4, 8, 16)  # batch sizes of the memory measurement (empty = none)
    memory_sources: int = 16  # sources decoded at each of them (the sample's longest)
    threads: int = 1  # torch threads
    peers: tuple[str, ...] = ()  # other engines timed beside ours (TRANSLATE_PEERS): ctranslate2
    compile: str = "off"  # --compile: on compiles the target's and the drafter
                          # model's decode steps before timing (specdec.compiled)


@dataclass
class MethodRun:
    """One method's figures over all repeats."""

    name: str
    tokens: int = 0  # new tokens, all sources (the same every repeat)
    seconds: list[float] = field(default_factory=list)  # wall time of each repeat
    rounds: int = 0  # target forwards summed over sources (plain: one per token)
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    differ: int = 0  # outputs that differ from plain's
    at_cap: int = 0  # outputs that ran into max_new_tokens
    row_tokens: list[int] = field(default_factory=list)  # [source]: new tokens
    row_rounds: list[int] = field(default_factory=list)  # [source]: target forwards (hf: its tokens)
    row_seconds: list[list[float]] = field(default_factory=list)  # [repeat][source]: wall time of that source

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.median_s

    @property
    def tau(self) -> float:
        """Tokens per round: new tokens per target forward of a row."""
        return self.tokens / max(self.rounds, 1)

    @property
    def alpha(self) -> float:
        return self.accepted / max(self.drafted, 1)

    def subset(self, rows: Sequence[int]) -> dict:
        """tokens/s (median repeat of the rows' summed wall times) and tau over ``rows`` only."""
        tokens = sum(self.row_tokens[i] for i in rows)
        seconds = statistics.median(sum(times[i] for i in rows) for times in self.row_seconds)
        return {"tokens": tokens, "tokens_per_s": tokens / seconds,
                "tau": tokens / max(sum(self.row_rounds[i] for i in rows), 1)}


def sample_pairs(data: str | Path, split: str, limit: int, seed: int) -> list[dict]:
    """``limit`` pairs of ``{data}/{split}.jsonl`` drawn uniformly with ``seed`` (file order kept)."""
    path = Path(data) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: build the corpus with `specdec data gettext --out {data}`")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if 0 < limit < len(rows):
        keep = sorted(random.Random(seed).sample(range(len(rows)), limit))
        rows = [rows[i] for i in keep]
    return rows


def encode_sources(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel, texts: Sequence[str]) -> list[list[int]]:
    """Source ids (eos appended by the tokenizer), cut to the encoder's positions."""
    limit = model.config.max_position_embeddings
    return [tokenizer(t, truncation=True, max_length=limit)["input_ids"] for t in texts]


@dataclass(frozen=True)
class RowOutput:
    """One source's output under one method."""

    tokens: list[int]  # new tokens (the decoder start token left out)
    rounds: int  # target forwards
    seconds: float  # wall time of this source
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted


def hf_generate(model: PreTrainedModel, sources: Sequence[list[int]], max_new_tokens: int, eos: int,
                num_beams: int = 1, assistant: PreTrainedModel | None = None) -> list[RowOutput]:
    """transformers' ``generate`` of each source alone (new tokens, the start token left out): greedy,
    beam search (``num_beams`` > 1) or assisted by ``assistant``."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, num_beams=num_beams, do_sample=False, eos_token_id=eos,
                              pad_token_id=model.config.pad_token_id,
                              decoder_start_token_id=model.config.decoder_start_token_id)
    extra = {} if assistant is None else {"assistant_model": assistant}
    outs = []
    for ids in sources:
        start = time.perf_counter()
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             generation_config=config, **extra)
        tokens = out[0, 1:].tolist()
        outs.append(RowOutput(tokens, len(tokens), time.perf_counter() - start))
    return outs


def timed_rows(generate: Callable[..., list]) -> list[RowOutput]:
    """Run ``generate(on_result=...)`` (ours, batch 1: sources finish in order) and time each source
    from the previous one's end (or the call's start) to its own (a row's ``wall_time_s`` counts
    from its submission, when all were submitted at once)."""
    finished: list[tuple[float, list[int]]] = []
    start = time.perf_counter()
    results = generate(on_result=lambda r: finished.append((time.perf_counter(), list(r.tokens))))
    if [tokens for _, tokens in finished] != [r.tokens for r in results]:
        raise RuntimeError("sources finished out of order: the per-source times need batch size 1")
    ends = [end for end, _ in finished]
    return [RowOutput(r.tokens, r.stats.rounds, b - a, r.stats.drafted, r.stats.accepted)
            for r, a, b in zip(results, [start, *ends], ends)]


EXACT_OFF = ("hf beam", "block β")  # methods (by name prefix) that need not equal plain greedy


def is_exact(name: str) -> bool:
    """Whether the method ``name`` must give plain greedy's output."""
    return not name.startswith(EXACT_OFF)


def inexact(report: dict) -> list[str]:
    """The exact methods whose output differs from plain greedy somewhere (must be none)."""
    return [m["name"] for m in report["methods"] if m["differ"] and m["exact"]]


TRANSLATE_PEERS = ("ctranslate2",)  # the peers this bench runs (an encoder-decoder engine each)


def check_translate_peers(peers: Sequence[str]) -> None:
    """Refuse a peer this bench does not run (naming those it does), or one not installed (naming the package)."""
    from specdec.bench.peers import check_peers

    other = [p for p in peers if p not in TRANSLATE_PEERS]
    if other:
        raise ValueError(f"--task translate runs the peers {', '.join(TRANSLATE_PEERS)}, not {', '.join(other)} "
                         "(those decode decoder-only targets: drop them or use --task code)")
    check_peers(peers)


def ctranslate2_rows(translator, sources: Sequence[list[int]], max_new_tokens: int, eos: int) -> list[RowOutput]:
    """CTranslate2's greedy translation of each source alone (a ``CTranslate2Translator``), timed per source."""
    outs = []
    for ids in sources:
        start = time.perf_counter()
        tokens = translator.translate(ids, max_new_tokens, eos)
        outs.append(RowOutput(tokens, len(tokens), time.perf_counter() - start))
    return outs


def _load(folder: str | None) -> PreTrainedModel | None:
    return AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float32).eval() if folder else None


def run_bench(config: TranslateBenchConfig, log: Callable[[str], None] = print) -> dict:
    """Decode the sampled sources with every method ``config.repeats`` times; return the figures; a peer it does
    not run, or one not installed, is refused first (here only: both commands reach the bench through this)."""
    check_translate_peers(config.peers)
    torch.set_num_threads(config.threads)
    tokenizer = AutoTokenizer.from_pretrained(config.target)
    target = AutoModelForSeq2SeqLM.from_pretrained(config.target, dtype=torch.float32).eval()
    eos = target.config.eos_token_id
    pairs = sample_pairs(config.data, config.split, config.limit, config.seed)
    sources = encode_sources(tokenizer, target, [p["src"] for p in pairs])
    drafter_model, block_model = _load(config.drafter), _load(config.block_drafter)
    compiled = compile_models(config, target, drafter_model, log)
    common = {"max_new_tokens": config.max_new_tokens, "stop_token_ids": [eos], "batch_size": 1}

    def ours(drafter: object, **options: object) -> Callable[[], list[RowOutput]]:
        return lambda: timed_rows(lambda **kw: specdec.speculative_generate(target, drafter, sources,
                                                                            gamma=config.gamma, **common, **options,
                                                                            **kw))

    def hf(**options: object) -> Callable[[], list[RowOutput]]:
        return lambda: hf_generate(target, sources, config.max_new_tokens, eos, **options)

    methods: dict[str, Callable[[], list[RowOutput]]] = {
        "plain": lambda: timed_rows(lambda **kw: specdec.autoregressive_generate(target, sources, **common, **kw)),
        "ngram": ours("ngram"),
    }
    if drafter_model is not None:
        methods["model"] = ours(drafter_model)
        methods["lookup+model"] = ours(specdec.LookupDrafter(model_drafter(drafter_model)))
    if block_model is not None:
        methods["block"] = ours(block_model)
        methods[f"block β{config.beta}τ{config.tau:g}"] = ours(
            block_model, verify=VerifyConfig("topk_tau", beta=config.beta, tau=config.tau))
        methods["lookup+block"] = ours(specdec.LookupDrafter(model_drafter(block_model)))
    if config.hf:
        methods["hf"] = hf()
        if config.beams > 1:
            methods[f"hf beam{config.beams}"] = hf(num_beams=config.beams)
        if drafter_model is not None:
            methods["hf assisted"] = hf(assistant=drafter_model)
    if "ctranslate2" in config.peers:
        from specdec.bench.ctranslate2_seq2seq import CTranslate2Translator

        translator = CTranslate2Translator(target, tokenizer, config.threads)  # converted here: untimed
        methods["ctranslate2"] = lambda: ctranslate2_rows(translator, sources, config.max_new_tokens, eos)
    runs = {name: MethodRun(name) for name in methods}
    outputs: dict[str, list[list[int]]] = {}
    names = list(methods)
    with torch.inference_mode():
        for repeat in range(config.repeats):
            order = names[repeat % len(names):] + names[: repeat % len(names)]
            for name in order:
                start = time.perf_counter()
                results = methods[name]()
                seconds = time.perf_counter() - start
                run = runs[name]
                run.seconds.append(seconds)
                run.row_seconds.append([r.seconds for r in results])
                if repeat == 0:
                    outputs[name] = [r.tokens for r in results]
                    run.row_tokens = [len(r.tokens) for r in results]
                    run.row_rounds = [r.rounds for r in results]
                    run.rounds = sum(run.row_rounds)
                    run.drafted = sum(r.drafted for r in results)
                    run.accepted = sum(r.accepted for r in results)
                    run.tokens = sum(run.row_tokens)
                    run.at_cap = sum(n >= config.max_new_tokens for n in run.row_tokens)
                log(f"repeat {repeat + 1}/{config.repeats} {name}: {seconds:.2f} s")
    plain = outputs["plain"]
    for name, run in runs.items():
        run.differ = sum(a != b for a, b in zip(outputs[name], plain))
    references = [p["tgt"] for p in pairs]

    def quality(tokens: list[list[int]]) -> tuple[float, float]:
        hypotheses = tokenizer.batch_decode(tokens, skip_special_tokens=True)
        return (round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2),
                round(sacrebleu.corpus_chrf(hypotheses, [references]).score, 2))

    scores = {name: quality(tokens) for name, tokens in outputs.items()}  # (BLEU, chrF) per method
    bleu, chrf = scores["plain"]
    base = runs["plain"].tokens_per_s
    # a weak target loops until max_new_tokens, and lookup drafts loops well: the same figures over the
    # sources whose plain output ended before the cap
    uncapped = [i for i, t in enumerate(plain) if len(t) < config.max_new_tokens]
    base_uncapped = runs["plain"].subset(uncapped)["tokens_per_s"] if uncapped else float("nan")
    rows = []
    for name, run in runs.items():
        row = {**asdict(run), "exact": is_exact(name), "bleu": scores[name][0], "chrf": scores[name][1],
               "median_s": run.median_s, "tokens_per_s": run.tokens_per_s,
               "ratio_over_plain": run.tokens_per_s / base, "tau": run.tau, "alpha": run.alpha}
        if "hf" in runs:
            row["ratio_over_hf"] = run.tokens_per_s / runs["hf"].tokens_per_s
        if uncapped:
            sub = run.subset(uncapped)
            row["uncapped"] = {**sub, "ratio_over_plain": sub["tokens_per_s"] / base_uncapped}
        rows.append(row)
    drafters = {name: model for name, model in (("model", drafter_model), ("block", block_model)) if model is not None}
    longest = sorted(sources, key=len, reverse=True)[: config.memory_sources]
    memory = memory_sweep(target, drafters, longest, config.memory_batches, config.max_new_tokens, eos, log)
    return {"config": asdict(config), "compile": compiled, "sources": len(sources), "uncapped_sources": len(uncapped),
            "bleu": bleu, "chrf": chrf, "methods": rows, "memory": memory}


def compile_models(config: TranslateBenchConfig, target: PreTrainedModel, drafter: PreTrainedModel | None,
                   log: Callable[[str], None]) -> str:
    """``--compile on``: compile the target's and the drafter model's decode steps (rows of 1, the buckets of
    ``specdec.plan`` for plain decoding, the ``gamma`` verification and a lookup copy) before any timing; what was
    done. The block drafter decodes eagerly (its block forwards have no static form)."""
    from specdec.compiled import compiles
    from specdec.loading import input_device
    from specdec.plan import decode_plan

    if not compiles(config.compile, input_device(target)):
        return config.compile
    plan = decode_plan(config.gamma, lookup=True, drafter_model=True, speculating=True, plain=True)
    done = [f"target {plan.target.prepare(target).reason}"]
    if drafter is not None:
        done.append(f"drafter {plan.drafter.prepare(drafter).reason}")
    log("compile " + "; ".join(done))
    return "; ".join(done)


@torch.inference_mode()
def _decode(target: PreTrainedModel, drafter: PreTrainedModel | None, sources: Sequence[list[int]],
            options: dict) -> None:
    if drafter is None:
        specdec.autoregressive_generate(target, list(sources), **options)
    else:
        specdec.speculative_generate(target, drafter, list(sources), **options)


def memory_sweep(target: PreTrainedModel, drafters: dict[str, PreTrainedModel], sources: Sequence[list[int]],
                 batches: Sequence[int], max_new_tokens: int, eos: int,
                 log: Callable[[str], None] = print) -> list[dict]:
    """Per batch size: plain's peak memory growth, and each drafter's extra memory over plain."""
    rows = []
    device = next(target.parameters()).device
    for batch in batches:
        growth = {}
        options = {"max_new_tokens": max_new_tokens, "stop_token_ids": [eos], "batch_size": batch}
        for name, drafter in {"plain": None, **drafters}.items():
            _decode(target, drafter, sources, options)  # warm-up: one-time allocations are not charged
            meter = MemoryMeter(device)
            with meter:
                _decode(target, drafter, sources, options)
            assert meter.reading is not None
            growth[name] = meter.reading
        for name, model in drafters.items():
            weights = weight_mib(model)
            extra = growth[name].growth_mib + weights - growth["plain"].growth_mib
            rows.append({"batch": batch, "method": name, "plain_growth_mib": round(growth["plain"].growth_mib, 1),
                         "growth_mib": round(growth[name].growth_mib, 1), "drafter_weights_mib": round(weights, 1),
                         "extra_mib": round(extra, 1), "within_bound": extra <= 1.1 * weights,
                         "source": growth[name].source})
            log(f"memory at batch {batch}, {name}: extra {extra:.1f} MiB (drafter weights {weights:.1f} MiB)")
    return rows


def table(report: dict) -> str:
    """The figures as Markdown tables: methods, then memory."""
    lines = [("| method | BLEU | chrF | tokens/s | × plain | × hf | τ (tokens/round) | α | differ from plain | at cap "
              "| uncapped: tokens/s | × plain | τ |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in report["methods"]:
        drafts = m["name"] not in ("plain", *TRANSLATE_PEERS) and not m["name"].startswith("hf")
        tau = f"{m['tau']:.2f}" if drafts else "1" if m["name"] in ("plain", "hf", *TRANSLATE_PEERS) else ""
        alpha = f"{m['alpha']:.2f}" if drafts else ""
        differ = f"{m['differ']}/{report['sources']}" + ("" if m.get("exact", True) else " (not exact)")
        lines.append(f"| {m['name']} | {m['bleu']:.2f} | {m['chrf']:.2f} | {m['tokens_per_s']:.1f} | "
                     f"{m['ratio_over_plain']:.2f} | {m.get('ratio_over_hf', float('nan')):.2f} | {tau} | {alpha} | "
                     f"{differ} | {m['at_cap']} | {_sub(m, 'tokens_per_s', '.1f')} | "
                     f"{_sub(m, 'ratio_over_plain', '.2f')} | {_sub(m, 'tau', '.2f')} |")
    if report.get("memory"):
        lines += ["", ("| batch | drafter | plain's peak growth MiB | drafter run's growth MiB | drafter weights MiB "
                      "| extra over plain MiB | ≤ 110% of weights |"), "|---|---|---|---|---|---|---|"]
        for r in report["memory"]:
            lines.append(f"| {r['batch']} | {r['method']} | {r['plain_growth_mib']} | {r['growth_mib']} | "
                         f"{r['drafter_weights_mib']} | {r['extra_mib']} | {'yes' if r['within_bound'] else 'no'} |")
    return "\n".join(lines)


def _sub(method: dict, key: str, spec: str) -> str:
    return format(method["uncapped"][key], spec) if "uncapped" in method else ""


def check_model_folder(flag: str, folder: str | None) -> None:
    """Refuse a --target / --drafter that is not a model folder (None: no drafter, fine)."""
    if folder is not None and not (Path(folder) / "config.json").is_file():
        raise ValueError(f"--{flag} {folder} is not a model folder (no config.json)")


def headline(report: dict) -> str:
    """The report's first line: the sources and the plain output's quality."""
    return (f"{report['sources']} sources ({report['uncapped_sources']} whose plain output ended before "
            f"max_new_tokens), greedy BLEU {report['bleu']}, chrF {report['chrf']}, compile "
            f"{report.get('compile', 'off')}")


def config_from_bench(config: BenchConfig) -> TranslateBenchConfig:
    """``specdec bench --task translate``'s settings: the bench flags mapped onto this benchmark's.
    The code pair's default names stand for the translate pair: the shipped ``translate-target`` and,
    with it (the shipped drafters are distilled from it, for it alone), ``models/translate-drafter``
    and ``models/translate-block-drafter`` where shipped; another ``--target`` gets lookup only
    unless ``--drafter`` names one. ``--num-prompts`` is the number of test sources sampled (seeded
    by ``--seed``), ``--gamma`` its first value."""
    from specdec.loading import models_dir, resolve_model_path

    defaults = BenchConfig()
    shipped_target = config.target == defaults.target
    target = str(resolve_model_path("translate-target" if shipped_target else config.target))

    def shipped(name: str) -> str | None:
        folder = models_dir() / name
        return str(folder) if shipped_target and (folder / "config.json").is_file() else None

    drafter = shipped("translate-drafter") if config.drafter == defaults.drafter else config.drafter
    check_model_folder("drafter", drafter)  # the target's folder was checked as it was resolved
    return TranslateBenchConfig(target=target, data=str(config.data), drafter=drafter,
                                block_drafter=shipped("translate-block-drafter"),
                                limit=config.num_prompts, seed=config.seed, max_new_tokens=config.max_new_tokens,
                                gamma=config.gamma[0], repeats=config.repeats, threads=current_threads().threads,
                                peers=tuple(config.peers), compile=config.compile)


def run_and_report(config: BenchConfig, console) -> int:
    """``specdec bench --task translate``: run, print the table, write ``translate-summary.json`` and
    ``translate-summary.md`` in ``--output``. Exit status 1 when an output differs from plain greedy."""
    from specdec.bench.harness import _quiet_transformers

    with _quiet_transformers():  # generate's advice on max_length at every call of the hf methods (hundreds of lines)
        report = run_bench(config_from_bench(config), log=lambda line: console.print(line, style="dim"))
    head = headline(report)
    paths = write_summary(Path(config.output), "translate", report, head + "\n\n" + table(report) + "\n")
    console.print(head)
    console.print(table(report))
    console.print(f"wrote {', '.join(map(str, paths))}", style="dim")
    differ = inexact(report)
    if differ:
        console.print(f"outputs differ from plain greedy: {', '.join(differ)}", style="red")
    return 1 if differ else 0


def main(argv: Sequence[str] | None = None) -> int:
    defaults = TranslateBenchConfig(target="", data="")
    parser = argparse.ArgumentParser(prog="python -m specdec.bench.translate", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="the target's folder")
    parser.add_argument("--data", required=True, help="a `specdec data gettext` folder")
    parser.add_argument("--drafter", help="an encoder-decoder drafter's folder")
    parser.add_argument("--block-drafter", help="an encoder-decoder block drafter's folder (SpecDec)")
    parser.add_argument("--split", default=defaults.split, choices=["validation", "test"])
    parser.add_argument("--limit", type=int, default=defaults.limit, help="sources sampled from the split (0 = all)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--gamma", type=int, default=defaults.gamma)
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--no-hf", action="store_true", help="do not time transformers' generate")
    parser.add_argument("--beams", type=int, default=defaults.beams, help="transformers' beam width timed (0 = none)")
    parser.add_argument("--memory-batches", type=int, nargs="*", default=list(defaults.memory_batches),
                        help="batch sizes of the memory measurement (none: skip it)")
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--peers", nargs="*", default=[], choices=TRANSLATE_PEERS,
                        help="other engines timed beside ours (optional extras: pip install ctranslate2)")
    parser.add_argument("--compile", default=defaults.compile, choices=["auto", "on", "off"],
                        help="compile our decode steps before timing (specdec.compiled)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    try:
        check_model_folder("target", args.target or None)
        check_model_folder("drafter", args.drafter or None)
        check_model_folder("block-drafter", args.block_drafter or None)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.repeats < 1 or args.max_new_tokens < 1 or args.gamma < 1:
        print("error: --repeats, --max-new-tokens and --gamma must be >= 1", file=sys.stderr)
        return 2
    config = TranslateBenchConfig(target=args.target, data=args.data, drafter=args.drafter,
                                  block_drafter=args.block_drafter, split=args.split, limit=args.limit, seed=args.seed,
                                  max_new_tokens=args.max_new_tokens, gamma=args.gamma, repeats=args.repeats,
                                  hf=not args.no_hf, beams=args.beams, memory_batches=tuple(args.memory_batches),
                                  threads=args.threads, peers=tuple(args.peers), compile=args.compile)
    try:
        report = run_bench(config, log=lambda s: print(s, file=sys.stderr, flush=True))  # refuses a peer first
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(headline(report))
    print(table(report))
    return 1 if inexact(report) else 0


if __name__ == "__main__":
    raise SystemExit(main())
