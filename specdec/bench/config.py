"""Benchmark settings: the one source of the `bench` command's defaults.

A frozen dataclass, one comment per field, in the style of :mod:`specdec.config`; the command line
of :mod:`specdec.bench.cli` is built from it. Defaults shared with generation (gamma, the number of
new tokens, the models, the sampling knobs) are read from the core config classes, so they cannot
drift. ``quick()`` is the setting that finishes in under a minute on a 2-core CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specdec.config import (
    DRAFTER_DTYPES,
    SPECULATE,
    ModelConfig,
    SamplingConfig,
    ScheduleConfig,
    SpecConfig,
    VerifyConfig,
)

_MODELS = ModelConfig()
_SAMPLING = SamplingConfig()
_SPEC = SpecConfig()
TASKS = ("code", "translate")  # what --task benchmarks
ORDERS = ("method", "prompt")  # the timing orders of --order (see specdec.bench.harness)
SCHEDULED = ("heuristic", "confidence", "ada")  # the schedules --schedules runs as spec-<name> (specdec.schedules)


@dataclass(frozen=True)
class BenchConfig:
    """What to benchmark, on which prompts, and how to time it."""

    task: str = "code"  # code: the stdlib code prompts and a decoder-only pair; translate: held-out
                        # gettext pairs and an encoder-decoder pair (specdec.bench.translate)
    data: str | None = None  # --task translate: a `specdec data gettext` folder (its test split is sampled)
    target: str = _MODELS.target  # target model: a shipped name or a folder with config + safetensors
    drafter: str = _MODELS.drafter_model  # drafter model used by `spec` and `hf-assisted` (a name or a folder)
    drafter_dtype: tuple[str, ...] = (_MODELS.drafter_dtype,)  # the forms the drafter model runs in (auto, float32,
                                                               # bf16, int8); each form after the first runs spec and
                                                               # spec-lookup again as spec:FORM, spec-lookup:FORM
    peers: tuple[str, ...] = ()  # other engines run beside ours on the same model and prompts, greedy
                                 # (specdec.bench.peers): ctranslate2, llamacpp (= llamacpp-f32, llamacpp-q8_0 and each
                                 # with -lookup); optional extras (pip install 'specdec[peers]'); vllm (= vllm-plain,
                                 # vllm-ngram, vllm-draft: vLLM's CPU build from the venv SPECDEC_VLLM_PYTHON names;
                                 # with --serve the only peers taken, as servers driven by the same clients, greedy)
    peer_source: str | None = None  # the folder the converting peers (llama.cpp, CTranslate2) convert; None = the
                                    # target's own (give a quantized target's float source: llama.cpp quantizes it)
    compare: tuple[str, ...] = ()  # more drafter models, each run as spec@<folder name> (and spec-lookup@<folder name>)
    schedules: tuple[str, ...] = ()  # spec again with each of these schedules (heuristic, confidence, ada)
                                     # as method spec-<name>; spec itself is the constant schedule (--gamma)
    trees: tuple[int, ...] = ()  # spec again drafting a token tree of each of these node counts, gamma deep, as
                                 # method spec-tree<N> (specdec.tree: the drafter alone, eager caches)
    tokenizer: str | None = None  # folder of the tokenizer; None = the target's own folder
    methods: tuple[str, ...] = ()  # methods to run, by name or group (see --list); empty = all
    prompts: str | None = None  # a JSONL file with {"id", "prompt"} per line; None = built-in code prompts
    num_prompts: int = 20  # prompts taken from the set (the first N of a file; N drawn for the built-in set)
    max_new_tokens: int = 64  # tokens generated per prompt (stop tokens may end a run earlier)
    gamma: tuple[int, ...] = (_SPEC.gamma,)  # tokens drafted per round; several values sweep it
    temperature: tuple[float, ...] = (_SAMPLING.temperature,)  # 0 = greedy; several values sweep it
    top_k: int = _SAMPLING.top_k  # top-k filter for sampled runs; 0 = off
    top_p: float = _SAMPLING.top_p  # nucleus filter for sampled runs; 1.0 = off
    repeats: int = 3  # timed runs per prompt and method; the median time is reported
    order: str = "prompt"  # prompt: every method on a prompt in turn; method: each method over all prompts in turn
    warmup: int = 2  # untimed runs per method and setting before timing (first prompts of the set)
    device: str | None = _MODELS.device  # None = cuda if available else cpu; also "cpu", "cuda:N"
    dtype: str | None = _MODELS.dtype  # None = fp32 on CPU, bf16 on CUDA; also "bf16", "fp16", "fp32"
    compile: str = "off"  # torch.compile our decode forwards (specdec.compiled): on compiles the
                          # target and drafter model for every method of ours before timing (the
                          # compile time is not timed); off (default) and auto decode eagerly
    threads: int | None = _MODELS.threads  # torch CPU threads; None = $OMP_NUM_THREADS if set,
                                           # else chosen from the target's size (specdec.threads)
    seed: int = 0  # seeds prompt selection and sampling (the same seed for every method)
    output: str = "bench-out"  # directory for records.jsonl, summary.json and the plots
    plots: bool = True  # write the PNG plots
    progress: bool = True  # show a progress bar over prompts
    batch_sizes: tuple[int, ...] = ()  # run the batch sweep at these batch sizes (e.g.
                                       # 1,2,4,8,16) instead of the per-prompt comparison
    speculate: tuple[str, ...] = SPECULATE  # batch sweep and --serve: our loop with speculation
                                            # off (plain), on (spec-lookup) and auto
    serve: bool = False  # drive `specdec serve` (one server per --speculate
                         # mode) with --clients concurrent clients instead
    clients: tuple[int, ...] = (1, 4, 16)  # --serve: concurrent clients, each sending
                                           # its next prompt when its reply ends
    block: str | None = None  # a block drafter ("block" = code-block-drafter, or a
                              # folder): run its sweep (specdec.bench.block) instead
    block_k: tuple[int, ...] = (4, 8, 12, 16, 25)  # --block: block sizes k swept (alone and behind prompt lookup)
    lookup_block_k: tuple[int, ...] = ()  # --block: the k values also run behind prompt
                                          # lookup (lookup+block); empty = every block_k
    beta: tuple[int, ...] = (1, 3, 5)  # --block: top-beta values of SpecDec's topk_tau rule (1 = exact)
    tau: tuple[float, ...] = (1.0, 3.0)  # --block: logit gaps tau of the topk_tau rule
    relaxed_k: int = 8  # --block: the block size k the beta x tau grid runs at
    pareto: bool = False  # run SpecDec++'s sweep of draft-length schedules
                          # (specdec.bench.pareto) at each --temperature instead
    pareto_gamma: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)  # --pareto: the constant schedule's K values
    pareto_confidence: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8)  # --pareto: the confidence schedule's thresholds
    pareto_ada: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)  # --pareto: the ada schedule's stop thresholds
    pareto_bound: tuple[int, ...] = (1, 16)  # --pareto: MIN MAX drafted per round by heuristic, confidence and ada
    head: str | None = None  # --pareto: the acceptance head's folder for ada; None = the one beside the drafter model

    def __post_init__(self) -> None:
        """Check every field; sampling knobs by the core's own rules (SamplingConfig, SpecConfig)."""
        for name in ("num_prompts", "max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not self.gamma or any(g < 1 for g in self.gamma):
            raise ValueError(f"gamma must be one or more ints >= 1, got {self.gamma}")
        if not self.temperature:
            raise ValueError("temperature needs at least one value (0 = greedy)")
        for t in self.temperature:
            SamplingConfig(temperature=t, top_k=self.top_k, top_p=self.top_p)
        SpecConfig(gamma=self.gamma[0], max_new_tokens=self.max_new_tokens)
        bad = [s for s in self.schedules if s not in SCHEDULED]
        if bad:
            raise ValueError(f"schedules must be among {', '.join(SCHEDULED)} (constant is spec with --gamma), got "
                             f"{bad}")
        if any(n < 1 for n in self.trees):
            raise ValueError(f"trees must be node counts >= 1, got {self.trees}")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes must be ints >= 1, got {self.batch_sizes}")
        if not self.clients or any(c < 1 for c in self.clients):
            raise ValueError(f"clients must be one or more ints >= 1, got {self.clients}")
        if any(k < 1 for k in self.block_k) or self.relaxed_k < 1:
            raise ValueError(f"block_k and relaxed_k must be ints >= 1, got {self.block_k} and {self.relaxed_k}")
        for beta in self.beta:
            for tau in self.tau:
                VerifyConfig(rule="topk_tau", beta=beta, tau=tau)  # the core's own checks of beta and tau
        if not self.pareto_gamma or any(k < 1 for k in self.pareto_gamma):
            raise ValueError(f"pareto_gamma must be one or more ints >= 1, got {self.pareto_gamma}")
        ScheduleConfig(bound=self.pareto_bound)  # the core's own check of MIN MAX
        for t in (*self.pareto_confidence, *self.pareto_ada):
            ScheduleConfig(stop_threshold=t)  # ...and of the thresholds
        ModelConfig(threads=self.threads, compile=self.compile)  # the core's own checks of threads and compile
        if not self.drafter_dtype or any(d not in DRAFTER_DTYPES for d in self.drafter_dtype):
            raise ValueError(f"drafter_dtype must be one or more of {', '.join(DRAFTER_DTYPES)}, got "
                             f"{self.drafter_dtype}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.task == "translate" and self.data is None:
            raise ValueError("--task translate needs --data, a `specdec data gettext` folder (build one with "
                             "`specdec data gettext --out FOLDER`)")
        if not self.speculate or any(s not in SPECULATE for s in self.speculate):
            raise ValueError(f"speculate must be one or more of {', '.join(SPECULATE)}, got {self.speculate}")


def quick(config: BenchConfig) -> BenchConfig:
    """The `--quick` setting: few prompts, short outputs, one timed repeat (< 1 minute on 2 CPU cores)."""
    return dataclasses.replace(
        config,
        num_prompts=4,
        max_new_tokens=32,
        repeats=1,
        warmup=1,
    )
