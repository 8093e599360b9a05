"""``prepare``: compile and warm a model's decode step, and hand back the cache factory its handles decode with.

Contract: ``prepare(model, mode, tokens=, rows=, ...)`` compiles every (rows, tokens) bucket (``row_buckets``,
``token_buckets`` derive them from a run's settings), checks each against the eager step, and returns a
``CompileChoice`` whose ``caches`` is the model's ``StaticCaches`` factory (None when it stays eager). The factory
is also registered for the model (``specdec.cache.register_cache``), so the eager core's
``specdec.seq2seq.decoding_cache(model, device)`` finds it without importing this package; a caller may instead
hand it to the handles explicitly (``ModelTarget(..., caches=choice.caches)``). Nothing is set on the model:
a model's ``CompiledModel`` is kept in a table keyed weakly by the model (``compiled_for``).

Why auto is off on a CPU, and the measured gains: docs/journal/compiled-path.md.
"""

from __future__ import annotations

import time
import warnings
import weakref
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdec.cache import CacheHandle, register_cache, registered_cache
from specdec.compiled.graphs import CompiledModel, NotCached, buckets
from specdec.compiled.policy import (
    INSTALL,
    RECOMPILE_LIMIT,
    SLOT_SLACK,
    SLOTS,
    compile_refusal,
    compiler_missing,
    compiles,
    first_line,
    probed_isa,
    use_cache_folder,
)
from specdec.compiled.seq2seq import CompiledSeq2Seq, StaticSeq2SeqCache
from specdec.compiled.static_cache import StaticRaggedCache
from specdec.config import switch
from specdec.loading import context_limit, input_device


@dataclass(frozen=True)
class CompileChoice:
    """Whether a model's decode forwards are compiled, and why."""

    compiled: bool
    reason: str  # e.g. "on: 3 shapes warmed in 41.2 s" or "off (auto: ...)"
    caches: StaticCaches | None = None  # the model's cache factory when compiled (``ModelTarget(..., caches=)``)

    def describe(self) -> str:
        return f"compile {self.reason}"


def prepare(model: PreTrainedModel, mode: str = "on", *, tokens: tuple[int, ...] = (1,), rows: tuple[int, ...] = (1,),
            hidden: bool | tuple[int, ...] = False, last: bool = False, bare: bool = True, slots: int | None = None,
            cached_only: bool = False) -> CompileChoice:
    """Compile and warm ``model``'s decode step for every (rows, tokens) bucket (``mode`` on), or leave it
    eager (off, and auto: ``compiles``). Later caches of the model (``specdec.seq2seq.decoding_cache``, or the
    returned ``caches`` handed to a handle) are then static. A second call adds buckets. A model that cannot be
    compiled decodes eagerly, told once by a warning; a missing compiler is a RuntimeError saying what to install.
    ``cached_only``: every bucket from the compile cache (each checked as usual) or none: where one is not there,
    nothing is compiled and the model stays as it was (eager, or with the buckets it had), silently
    (``specdec.serve.background`` compiles it elsewhere).
    ``last``: the buckets of more than one token keep the logits of their last real token only (a drafter's
    catch-up, which reads no other: code-drafter's head is two thirds of its work a token; not on CUDA, whose graphs
    replay the buckets as they are); a forward that wants them all runs eagerly there.
    ``hidden``: the buckets are also warmed returning hidden states: True the last (an acceptance head's), a tuple of
    layer indices those layers' (a target's features: ``ModelTarget.feature_layers``, ``specdec.features``); ``bare``
    False: only so (``buckets``: a target whose every verify returns a drafter's features)."""
    device = input_device(model)
    cuda = device.type == "cuda"
    if not compiles(mode, device):
        set_compiled(model, None)
        return CompileChoice(False, "off" if mode == "off" else "off (auto: as measured, it does not pay here)")
    missing = compiler_missing()
    if missing is not None and not cuda:
        raise RuntimeError(f"--compile on: {missing}. {INSTALL}")
    if (reason := compile_refusal(model)) is not None:
        warnings.warn(f"--compile on: {reason}; it decodes eagerly", stacklevel=2)
        set_compiled(model, None)
        return CompileChoice(False, f"off ({reason})")
    use_cache_folder()
    isa = probed_isa()
    # one code object (the step) compiled per model and bucket: dynamo's default limit of 8 is too few
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    started = time.perf_counter()
    compiled = compiled_for(model)
    if compiled is None:
        limit = context_limit(model)
        width = slots or (SLOTS if limit is None else min(SLOTS, limit)) + SLOT_SLACK
        compiled = _compiled_class(model)(model, width)
        if cuda and (missing is not None or switch("SPECDEC_CUDA_STEP") != "inductor"):
            compiled.inductor = False  # CUDA graphs of the eager step (inductor's: SPECDEC_CUDA_STEP=inductor)
    loaded = compiled.loaded
    wanted = buckets(tokens, rows, hidden, last and not cuda, bare)

    def warm_wanted() -> None:
        for shape in wanted:
            if shape not in compiled.shapes:
                compiled.warm(shape)

    compiled.cached_only = cached_only
    try:
        warm_wanted()
        if cached_only and isinstance(compiled, CompiledSeq2Seq) and not cuda and compiled.encoder is None:
            compiled.warm_encoder()
    except NotCached as missing:
        return CompileChoice(False, f"off (not in the compile cache yet: {missing})")
    except Exception as error:  # noqa: BLE001 - any compile failure falls back to eager, said once
        if not (cuda and compiled.inductor):
            warnings.warn(f"--compile on: {type(model).__name__} could not be compiled ({type(error).__name__}: "
                          f"{first_line(error)}); it decodes eagerly", stacklevel=2)
            set_compiled(model, None)
            return CompileChoice(False, f"off ({type(model).__name__} failed to compile)")
        warnings.warn(f"--compile on: inductor could not compile {type(model).__name__} ({type(error).__name__}: "
                      f"{first_line(error)}); its eager step is captured as CUDA graphs", stacklevel=2)
        compiled.inductor = False
        warm_wanted()
    finally:
        compiled.cached_only = False
    if isinstance(compiled, CompiledSeq2Seq) and compiled.inductor and not cuda and compiled.encoder is None:
        try:
            compiled.warm_encoder()
        except Exception as error:  # noqa: BLE001 - the decoder's steps stay compiled, the encoder eager
            warnings.warn(f"--compile on: {type(model).__name__}'s encoder could not be compiled "
                          f"({type(error).__name__}: {first_line(error)}); it encodes eagerly", stacklevel=2)
    if not isa:
        probed_isa(record=True)
    compiled.rows = tuple(sorted(set(compiled.rows) | set(rows)))
    compiled.tokens = tuple(sorted(set(compiled.tokens) | set(tokens)))
    set_compiled(model, compiled)
    how = "" if not cuda else ", CUDA graphs of the eager step" if not compiled.inductor else ", CUDA graphs"
    if getattr(compiled, "encoder", None) is not None:
        how += "; the encoder compiled"
    if compiled.blocked:
        how += "; linears traced as specdec::blocked_linear"
    return CompileChoice(True, f"on: {len(compiled.shapes)} shapes warmed in {time.perf_counter() - started:.1f} s "
                               f"({compiled.loaded - loaded} from the compile cache{how})", registered_cache(model))


ROW_STEP = 4  # row buckets: 1, 4, 16, ... below the batch size, and the batch size (``row_buckets``)


def row_buckets(batch: int) -> tuple[int, ...]:
    """The row buckets a batch of up to ``batch`` rows compiles: 1, 4, 16, ... (``ROW_STEP``'s powers) below it and
    ``batch`` itself. A forward runs the smallest that holds its rows (the others dead rows, computed and dropped):
    with rows of 1 and 16 only, a server's 4 requests ran in the 16-row step (at 4 clients, median latency 1.94 s
    against 1.12 s in their own bucket for plain decoding, 2.35 s against 0.96 s drafting; docs/benchmarks.md,
    "The server compiled")."""
    buckets, rows = {batch}, 1
    while rows < batch:
        buckets.add(rows)
        rows *= ROW_STEP
    return tuple(sorted(buckets))


def token_buckets(gamma: int, drafter: str | None, speculating: bool, plain: bool,
                  copy: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tokens-per-row buckets (target, drafter model) a run compiles, measured on the shipped pair (12 code
    prompts, the default ``lookup+code-drafter``: the target verified 5 tokens 97 times, 13 tokens 69 times and
    1-12 tokens 15 times; the drafter stepped 1 token 339 times, caught up 2 tokens 16 times and 3-14 tokens 26
    times). The target verifies ``gamma + 1`` tokens, and with prompt lookup up to its copy + 1 (``copy``: the
    longest copy, ``drafters.hybrid.LOOKUP_NGRAM.num_tokens``); plain decoding steps 1; a drafter model steps 1, catches
    up 2, and after a lookup round up to the copy + 2. A forward pads up to the next bucket (dead tokens, dropped)."""
    from specdec.config import LOOKUP

    lookup = speculating and drafter is not None and drafter.startswith(LOOKUP)
    target = ({gamma + 1} if speculating else set()) | ({copy + 1} if lookup else set()) | ({1} if plain else set())
    model = {1, 2} | ({copy + 2} if lookup else set())
    return tuple(sorted(target)), tuple(sorted(model))


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its CompiledModel (``set_compiled``)


def compiled_for(model: PreTrainedModel) -> CompiledModel | None:
    """The model's ``CompiledModel`` once ``prepare`` compiled it, else None."""
    return _COMPILED.get(model)


def set_compiled(model: PreTrainedModel, compiled: CompiledModel | None) -> None:
    """Make ``compiled`` the model's compiled step (None: it decodes eagerly again) and register its cache factory
    (``specdec.cache.register_cache``): what ``prepare`` does once it has warmed the buckets, and what a caller
    that built a ``CompiledModel`` itself (a test, a benchmark) does to decode with it. Kept in tables keyed weakly
    by the model, nothing set on it (a ``CompiledModel`` holds its model weakly, so the entry dies with it)."""
    if compiled is None:
        _COMPILED.pop(model, None)
        register_cache(model, None)
    else:
        _COMPILED[model] = compiled
        register_cache(model, StaticCaches(compiled))


def _compiled_class(model: PreTrainedModel) -> type[CompiledModel]:
    """``CompiledModel``, or its encoder-decoder form (``CompiledSeq2Seq``)."""
    return CompiledSeq2Seq if getattr(model.config, "is_encoder_decoder", False) else CompiledModel


class StaticCaches:
    """A prepared model's cache factory (``specdec.cache.CacheFactory``): ``caches(device)`` is a new static cache
    handle of its ``CompiledModel`` (``StaticRaggedCache``, or ``StaticSeq2SeqCache`` for an encoder-decoder model;
    prefills stay eager, merged in), and ``encode`` runs its compiled encoder for ``seq2seq.Seq2SeqCache``."""

    __slots__ = ("compiled",)

    def __init__(self, compiled: CompiledModel) -> None:
        self.compiled = compiled

    def __call__(self, device: torch.device | str) -> CacheHandle:
        handle = StaticSeq2SeqCache if isinstance(self.compiled, CompiledSeq2Seq) else StaticRaggedCache
        return handle(self.compiled.model, self.compiled, device)

    def encode(self, source: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
        """The compiled encoder's output for the rows' sources (``CompiledSeq2Seq.encode``), or None: encode eagerly."""
        return self.compiled.encode(source, valid) if isinstance(self.compiled, CompiledSeq2Seq) else None
