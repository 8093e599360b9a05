"""The compiled, static-shape decoding path (``--compile auto|on|off``).

Eager decoding pays transformers' Python around every forward (module dispatch, mask building,
``torch.cat`` into a growing ``DynamicCache``). Here a model's decode forwards run through
``torch.compile`` (inductor: generated C++ on CPU) over a preallocated cache:

- ``StaticRaggedCache``: the cache handle of a compiled model, with ``RaggedCache``'s interface and
  rule (each row's live slots ``mask``, positions = live tokens before each token, ``keep`` per row,
  ``select``, ``merge``, ``compact``), its keys and values in transformers' ``StaticCache`` layers
  ``[R, heads, C + 1, dim]``: ``R`` rows (a bucket >= the batch's rows; spare rows are dead), ``C`` slots.
  The layers' write pointer (``cumulative_length``) is the first unused slot; a rollback moves it
  back (the rejected slots are overwritten later and never attended meanwhile). The rows are re-packed
  (``compact``) when the next forward would not fit.
- Slot widths: a forward attends only the first ``S`` slots (``attended``: the pointer plus its new
  tokens, rounded up to ``SLOT_STEP``), through ``WindowLayer``, a ``StaticLayer`` whose update returns
  that slice, and a mask of ``S`` columns; short contexts pay short attention. ``S`` is one dynamic
  dimension of the graph (``mark_dynamic``), not one graph per width: the buffers keep one slot more
  than a forward ever attends, so every slice has the same strides and no width recompiles.
- ``CompiledModel``: one model's compiled step, ``torch.compile(..., fullgraph=True)`` of a forward
  taking ``(ids [R, n], live slots [R, S], positions [R, n], first new slot)`` that builds the 4D mask
  (the live slots, causal over the new ones) inside the graph. Shapes are bucketed by rows (``1`` and
  the batch size) and tokens per row (``token_buckets``: the target's ``gamma + 1`` verification and a
  prompt-lookup copy + 1, a drafter's 1-token step, its 2-token catch-up and a catch-up after a lookup
  copy); a forward of fewer tokens is padded on the right to its bucket with dead tokens (masked out,
  their slots freed at once like a rejected draft's, their logits dropped). Every bucket is compiled and
  warmed when the model is prepared (``prepare``) and checked against the eager forward. A forward of
  another shape (a longer copy, a batch grown past its bucket) runs the same step eagerly on the same
  cache: exact, only slower, said once. Prefill stays eager (a ``RaggedCache``, merged in).
- The linear layers: where ``specdec.kernels`` installs its kernels on the model, the graph traces
  them in the kernels' formulation (``traced_linear``: ``W @ x.T`` for 1-2 rows, oneDNN on the prepacked
  weight through the ``specdec::packed_linear`` op for more), not inductor's (freezing turns ``F.linear``
  into MKL's packed kernel, the slow one on this CPU).

Exactness: the compiled step computes what the eager forward computes (same cache contents, same
positions, same mask), to float rounding; greedy tokens match ``generate`` up to near ties, as the
eager batched path does, and the verification rule is unchanged, so sampling stays lossless.

Which models: decoder-only models whose forward takes ``position_ids`` and a 4D mask, with
full-attention layers only, and encoder-decoder models with BART-style cross-attention and table
positions (Marian, BART, ...: ``specdec.compiled_seq2seq``, the same static cache, buckets and rule, each
row's source in static buffers; the encoder and prefill stay eager); ``compile_refusal`` says why another
one decodes eagerly, once.
Inductor's on-disk FX graph cache lives under ``~/.cache/specdec/inductor/torch-VERSION``: a second
start reuses the compiled code, and another torch version gets its own folder (rebuilt, never read).

``on`` compiles; ``off`` never does; ``auto`` is off, as measured on this project's 2-core CPU at one thread
(docs/benchmarks.md, "Compiled decoding: slot widths and token buckets"; ``benchmarks/compiled_buckets.py``
for the steps). Per step, compiled against eager with specdec's linear kernels (code-target, load 8-10):
0.68-0.78 for 1 token, 0.69-0.89 for the verification of 5, 0.90-0.91 for a lookup copy's 13; the drafter's
step 0.75-1.00. End to end (``specdec bench --methods plain spec spec-lookup --num-prompts 12 --repeats 3
--compile off|on``, alternated, three pairs, load 2-10, every output equal): plain decoding 1.29-1.39x ->
1.49-1.57x (medians 1.32 -> 1.50) ``generate``, the default speculation (prompt lookup + code-drafter)
2.55-2.91x -> 2.65-2.94x (medians 2.82 -> 2.87), even where the path of before (all 528 slots attended, no
bucket for the lookup copies) made it 3x slower. The start pays for it: 24-53 s to trace and compile the six
buckets of a bench's default run with inductor's cache warm; ``specdec generate --compile on`` on one prompt
(5 buckets, rows of 1) printed its first token after 16.0-19.5 s at load 1.0-1.3 (63-146 s at load 7-9 when it
also compiled rows of 8; tracing, paid at every start, is most of it, whether inductor's disk cache is warm or
not), against the server's start-up goal of 20 s, for a gain
within the noise of a shared machine on the default speculation. So auto stays off: ``on`` pays for plain
decoding and long runs whose start is paid once.
"""

from __future__ import annotations

import math
import os
import shutil
import sysconfig
import types
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from specdec import kernels
from specdec.architectures import attention_chunk, local_window
from specdec.cache import RaggedCache, gather_slots
from specdec.config import COMPILE_MODES, ModelConfig
from specdec.loading import context_limit, input_device
from specdec.positions import positions_for

SLOTS = 512  # slots per row of a static cache (at most the model's context): attention cost vs room
SLOT_STEP = 32  # a forward attends the first S slots: the pointer plus its new tokens, rounded up to this
RECOMPILE_LIMIT = 256  # compiled (model, bucket) pairs allowed in one process
SLOT_SLACK = 16  # slots beyond the context for dead padding before a re-pack is needed
INDUCTOR = {"freezing": True}  # inductor's options for the step (measured: docs/benchmarks.md)
CHECK_TOLERANCE = 1e-3  # largest |compiled - eager| logit difference (relative to the logits' scale) at warm-up
INSTALL = ("torch.compile on CPU needs a C++ compiler and Python's headers: install them (Debian/Ubuntu: "
           "apt-get install g++ python3-dev; or set CXX to a compiler), or use --compile off")


def check_mode(mode: object) -> str:
    """``mode`` if it is one of ``COMPILE_MODES``, else a ValueError naming them."""
    if mode not in COMPILE_MODES:
        ModelConfig(compile=mode)  # raises the one message
    return str(mode)


def compiles(mode: str) -> bool:
    """Whether a run compiles under ``--compile mode``: on only; auto is off, as measured (module docstring)."""
    return check_mode(mode) == "on"


def compiler_missing() -> str | None:
    """What torch.compile's CPU backend lacks here (a C++ compiler, Python's headers), or None."""
    compilers = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    if not any(shutil.which(c) for c in compilers):
        return f"no C++ compiler found ({', '.join(compilers)})"
    include = sysconfig.get_paths().get("include")
    if not include or not (Path(include) / "Python.h").is_file():
        return f"Python's headers are missing (no Python.h in {include})"
    return None


def cache_folder() -> Path:
    """Inductor's on-disk cache for this torch version (another version's folder is never read)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "specdec" / "inductor" / f"torch-{torch.__version__}"


def compile_refusal(model: PreTrainedModel) -> str | None:
    """Why ``model`` decodes eagerly whatever ``--compile`` says, or None when it can be compiled."""
    name = type(model).__name__
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        from specdec.compiled_seq2seq import refusal

        if (reason := refusal(model)) is not None:
            return reason
    elif not positions_for(model).argument:
        return f"{name}'s forward takes no position_ids"
    if attention_chunk(config) or local_window(config):
        return f"{name} has local or chunked attention (windows over slots a static cache does not keep)"
    if any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in model.modules()):
        return f"{name} is dynamically quantised (int8 linears have no traceable form here)"
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return f"{name} uses the {config._attn_implementation!r} attention implementation (sdpa or eager only)"
    try:
        layers = StaticCache(config=config, max_cache_len=1).layers
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        return f"{name} has no transformers StaticCache ({error})"
    if not all(type(layer) is StaticLayer for layer in layers):
        return f"{name}'s cache layers are not all full attention"
    return None


_PACKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # an installed weight's data_ptr -> its pack


@torch.library.custom_op("specdec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [n, in] @ ``weight``.T (+ bias) by oneDNN on the installed layer's prepacked weight (``specdec.kernels``)."""
    packed = _PACKS.get(weight.data_ptr())
    if packed is None:
        raise KeyError("specdec::packed_linear: not the weight of a layer with specdec's linear kernels")
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.get(weight), bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def traced_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``kernels.fast_linear``'s formulation, traceable: ``W @ x.T`` for 1-2 rows (an extern ``mm`` that
    freezing's MKL packing leaves alone), oneDNN on the prepacked weight (a custom op: a packed oneDNN
    tensor has no fake form for a trace) for more."""
    rows = x.reshape(-1, x.shape[-1])  # [n, in]
    n = rows.shape[0]
    if n <= 2:
        pair = torch.cat([rows, rows]) if n == 1 else rows  # [2, in]
        out = (weight @ pair.T).T[:n]  # [n, out]
        out = out + bias if bias is not None else out
    else:
        out = packed_linear(rows, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _traced_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A compiled model's installed layer: traced as ``traced_linear``, run eagerly as ``specdec.kernels`` says."""
    if torch.compiler.is_compiling() and self.weight.dtype == x.dtype == torch.float32 and x.device.type == "cpu":
        return traced_linear(x, self.weight, self.bias)
    return kernels._forward(self, x)


def trace_kernels(model: PreTrainedModel) -> bool:
    """Give ``model``'s linear layers specdec's kernels where ``specdec.kernels`` installs them, traced in the
    kernels' formulation (``traced_linear``) by the compiled step; whether they have them."""
    if not kernels.install(model):
        return False
    for module in model.modules():
        traced = getattr(vars(module).get("forward"), "__func__", None) is _traced_forward  # e.g. a deep copy's
        if kernels._ours(module) or traced:
            _PACKS[module.weight.data_ptr()] = module._specdec_packed
            module.forward = types.MethodType(_traced_forward, module)
    return True


class WindowLayer(StaticLayer):
    """A ``StaticLayer`` whose forwards attend only its first ``window`` slots (the write pointer plus the new
    tokens, rounded up: ``attended``); the slots beyond hold nothing live. Its buffers keep one slot more
    than a forward ever attends, so every window is a proper slice and one graph serves every width."""

    window: int

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        return keys[:, :, : self.window], values[:, :, : self.window]  # [R, heads, S, dim]


def attended(end: int, slots: int) -> int:
    """S, the slots a forward attends when its last new token is written at slot ``end - 1``: ``end`` rounded up
    to ``SLOT_STEP`` (so the graph sees few distinct widths), at most ``slots``; at least 2 (dynamo specializes
    a size of 1)."""
    return max(2, min(slots, math.ceil(end / SLOT_STEP) * SLOT_STEP))


@dataclass(frozen=True)
class Shape:
    """One bucket: rows, new tokens per row, and whether the last hidden state is returned (every slot width
    shares it: the slot dimension is dynamic)."""

    rows: int
    tokens: int
    hidden: bool = False


def _bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= value, or None."""
    return next((b for b in sorted(buckets) if b >= value), None)


class CompiledModel:
    """A model's compiled decode step and the shapes it was warmed for (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, slots: int) -> None:
        self.model = model
        self.slots = slots  # C: slots per row a forward may use (the buffers hold C + 1: ``WindowLayer``)
        self.shapes: set[Shape] = set()  # compiled and warmed
        self.rows: tuple[int, ...] = ()
        self.tokens: tuple[int, ...] = ()
        self.eager_shapes: set[Shape] = set()  # shapes run eagerly (told once each)
        self.calls = {"compiled": 0, "eager": 0}  # decode forwards run each way
        self.kernels = trace_kernels(model)  # the linears traced in specdec's kernels' formulation
        self._compiled = torch.compile(self._step, dynamic=None, fullgraph=True, options=dict(INDUCTOR))
        self.layout = self._layout()

    def _layout(self) -> list[tuple[int, int, int, torch.dtype]]:
        """Per layer: (kv heads, key dim, value dim, dtype), read from one eager forward of one token."""
        probe = RaggedCache(self.model, 1, input_device(self.model))
        with torch.no_grad():
            probe.forward(torch.zeros(1, 1, dtype=torch.long, device=probe.mask.device))
        return [(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1], layer.keys.dtype)
                for layer in probe.cache.layers]

    @torch.inference_mode()
    def new_cache(self, rows: int, device: torch.device | str) -> StaticCache:
        """A ``StaticCache`` of ``rows`` rows and ``self.slots`` (+ 1) slots, allocated now."""
        width = self.slots + 1
        cache = StaticCache(config=self.model.config, max_cache_len=width)
        cache.layers = [WindowLayer(width) for _ in cache.layers]
        for layer, (heads, key_dim, value_dim, dtype) in zip(cache.layers, self.layout):
            # what StaticLayer.lazy_initialization sets, without marking static addresses (a CUDA-graph need):
            # the buffers are plain inputs of the compiled step, so every cache of this shape reuses its code
            layer.dtype, layer.device, layer.batch_size, layer.num_heads = dtype, torch.device(device), rows, heads
            layer.k_head_dim, layer.v_head_dim = key_dim, value_dim
            layer.keys = torch.zeros(rows, heads, width, key_dim, dtype=dtype, device=device)
            layer.values = torch.zeros(rows, heads, width, value_dim, dtype=dtype, device=device)
            layer.cumulative_length = torch.tensor(0, dtype=torch.long, device=device)
            layer.is_initialized, layer.window = True, self.slots
        return cache

    def _step(self, ids: torch.Tensor, live: torch.Tensor, positions: torch.Tensor, start: torch.Tensor,
              cache: StaticCache, hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [R, n, V] (and the last hidden states [R, n, H]) of ``ids`` [R, n] written at slots
        ``start + 0..n-1``; ``live`` [R, S] marks the slots each row attends (its new real tokens included),
        the first S of the cache's."""
        n, slots = ids.shape[1], live.shape[1]
        for layer in cache.layers:
            layer.window = slots  # attend the first S slots
        query = start + torch.arange(n, device=ids.device)  # [n] slots of the new tokens
        key = torch.arange(slots, device=ids.device)  # [S]
        allowed = live[:, None, :] & (key[None, None, :] <= query[None, :, None])  # [R, n, S]
        allowed = allowed | (key[None, None, :] == query[None, :, None])  # a padding query sees itself: no empty row
        dtype = self.layout[0][3]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)[:, None]  # [R, 1, n, S]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=n, output_hidden_states=hidden)
        return out.logits, out.hidden_states[-1] if hidden else None

    @torch.inference_mode()
    def run(self, shape: Shape, ids: torch.Tensor, live: torch.Tensor, positions: torch.Tensor, start: torch.Tensor,
            cache: StaticCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step over the first S slots (``live`` [R, S]), compiled when ``shape`` was warmed, else eager
        (told once per shape)."""
        if shape in self.shapes:
            self.calls["compiled"] += 1
            torch._dynamo.mark_dynamic(live, 1)  # as warmed
            model = self.model  # its forward hooks (the bench's meters) run around the graph, traced without them
            for hook in list(model._forward_pre_hooks.values()):
                hook(model, ())
            out = self._compiled(ids, live, positions, start, cache, shape.hidden)
            for hook in list(model._forward_hooks.values()):
                hook(model, (), out)
            return out
        self.calls["eager"] += 1
        if shape not in self.eager_shapes:
            self.eager_shapes.add(shape)
            warnings.warn(f"{type(self.model).__name__}: a forward of {shape.rows} rows x {shape.tokens} tokens"
                          f"{' (hidden states)' if shape.hidden else ''} has no compiled bucket: it runs eagerly",
                          stacklevel=4)
        return self._step(ids, live, positions, start, cache, shape.hidden)

    @torch.inference_mode()
    def warm(self, shape: Shape) -> None:
        """Compile ``shape`` and check it against the eager step on random tokens (a ValueError if they differ)."""
        device = input_device(self.model)
        ids = torch.randint(0, self.model.config.get_text_config().vocab_size, (shape.rows, shape.tokens),
                            device=device)
        span = attended(3 + shape.tokens, self.slots)
        results = []
        for compiled in (True, False):
            cache = self.new_cache(shape.rows, device)
            live = torch.zeros(shape.rows, self.slots + 1, dtype=torch.bool, device=device)[:, :span]  # as forward's
            live[:, 3: 3 + shape.tokens] = True
            for layer in cache.layers:
                layer.cumulative_length.fill_(3)
            positions = torch.arange(shape.tokens, device=device)[None].repeat(shape.rows, 1)  # contiguous, as forward's
            torch._dynamo.mark_dynamic(live, 1)
            args = (ids, live, positions, torch.tensor(3, device=device), cache, shape.hidden)
            with kernels.active(), torch._dynamo.config.patch(automatic_dynamic_shapes=False):  # dynamic: S only
                results.append((self._compiled if compiled else self._step)(*args)[0])
        error = float((results[0] - results[1]).abs().max())
        scale = float(results[1].abs().max()) + 1.0
        if not error <= CHECK_TOLERANCE * scale:
            raise ValueError(f"compiled logits differ from eager by {error:.3g} (scale {scale:.3g})")
        self.shapes.add(shape)


@dataclass(frozen=True)
class CompileChoice:
    """Whether a model's decode forwards are compiled, and why."""

    compiled: bool
    reason: str  # e.g. "on: 3 shapes warmed in 41.2 s" or "off (auto: ...)"

    def describe(self) -> str:
        return f"compile {self.reason}"


def prepare(model: PreTrainedModel, mode: str = "on", *, tokens: tuple[int, ...] = (1,), rows: tuple[int, ...] = (1,),
            hidden: bool = False, slots: int | None = None) -> CompileChoice:
    """Compile and warm ``model``'s decode step for every (rows, tokens) bucket (``mode`` on), or leave it
    eager (off, and auto: ``compiles``). Later caches of the model (``decoding_cache``) are then static. A
    second call adds buckets. A model that cannot be compiled decodes eagerly, told once by a warning; a
    missing compiler is a RuntimeError saying what to install."""
    import time

    if not compiles(mode):
        model._specdec_compiled = None
        return CompileChoice(False, "off" if mode == "off" else "off (auto: as measured, it does not pay here)")
    if (missing := compiler_missing()) is not None:
        raise RuntimeError(f"--compile on: {missing}. {INSTALL}")
    if (reason := compile_refusal(model)) is not None:
        warnings.warn(f"--compile on: {reason}; it decodes eagerly", stacklevel=2)
        model._specdec_compiled = None
        return CompileChoice(False, f"off ({reason})")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_folder()))
    # one code object (the step) compiled per model and bucket: dynamo's default limit of 8 is too few
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    started = time.perf_counter()
    compiled = getattr(model, "_specdec_compiled", None)
    if compiled is None:
        limit = context_limit(model)
        width = slots or (SLOTS if limit is None else min(SLOTS, limit)) + SLOT_SLACK
        compiled = _compiled_class(model)(model, width)
    wanted = [Shape(r, n, h) for r in rows for n in tokens for h in sorted({False, hidden})]
    try:
        for shape in wanted:
            if shape not in compiled.shapes:
                compiled.warm(shape)
    except Exception as error:  # noqa: BLE001 - any compile failure falls back to eager, said once
        warnings.warn(f"--compile on: {type(model).__name__} could not be compiled ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}); it decodes eagerly", stacklevel=2)
        model._specdec_compiled = None
        return CompileChoice(False, f"off ({type(model).__name__} failed to compile)")
    compiled.rows = tuple(sorted(set(compiled.rows) | set(rows)))
    compiled.tokens = tuple(sorted(set(compiled.tokens) | set(tokens)))
    model._specdec_compiled = compiled
    return CompileChoice(True, f"on: {len(compiled.shapes)} shapes warmed in {time.perf_counter() - started:.1f} s")


def token_buckets(gamma: int, drafter: str | None, speculating: bool, plain: bool,
                  copy: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tokens-per-row buckets (target, drafter model) a run compiles, measured on the shipped pair (12 code
    prompts, the default ``lookup+code-drafter``: the target verified 5 tokens 97 times, 13 tokens 69 times and
    1-12 tokens 15 times; the drafter stepped 1 token 339 times, caught up 2 tokens 16 times and 3-14 tokens 26
    times). The target verifies ``gamma + 1`` tokens, and with prompt lookup up to its copy + 1 (``copy``: the
    longest copy, ``drafters.hybrid.LOOKUP_NGRAM.num_tokens``); plain decoding steps 1; a drafter model steps 1, catches up 2, and
    after a lookup round up to the copy + 2. A forward pads up to the next bucket (dead tokens, dropped)."""
    from specdec.config import LOOKUP

    lookup = speculating and drafter is not None and drafter.startswith(LOOKUP)
    target = ({gamma + 1} if speculating else set()) | ({copy + 1} if lookup else set()) | ({1} if plain else set())
    model = {1, 2} | ({copy + 2} if lookup else set())
    return tuple(sorted(target)), tuple(sorted(model))


def compiled_for(model: PreTrainedModel) -> CompiledModel | None:
    """The model's ``CompiledModel`` once ``prepare`` compiled it, else None."""
    return getattr(model, "_specdec_compiled", None)


def _compiled_class(model: PreTrainedModel) -> type[CompiledModel]:
    """``CompiledModel``, or its encoder-decoder form (``specdec.compiled_seq2seq``)."""
    if getattr(model.config, "is_encoder_decoder", False):
        from specdec.compiled_seq2seq import CompiledSeq2Seq

        return CompiledSeq2Seq
    return CompiledModel


def decoding_cache(model: PreTrainedModel, device: torch.device | str) -> object:
    """The cache handle a target or drafter decodes with: static when ``prepare`` compiled the model (its
    compiled form's ``handle``: ``StaticRaggedCache``, or ``StaticSeq2SeqCache`` for an encoder-decoder model),
    else ``cache_for``'s (prefills stay eager, merged in)."""
    from specdec.seq2seq import cache_for

    compiled = compiled_for(model)
    if compiled is None:
        return cache_for(model, 0, device)
    return (getattr(compiled, "handle", None) or StaticRaggedCache)(model, compiled, device)


class StaticRaggedCache:
    """``RaggedCache``'s interface and rule over a preallocated static cache (see the module docstring)."""

    recurrent = False

    @torch.inference_mode()
    def __init__(self, model: PreTrainedModel, compiled: CompiledModel, device: torch.device | str = "cpu") -> None:
        self.model, self.compiled, self.device = model, compiled, torch.device(device)
        self.capacity = 0  # R: rows of the buffers
        self.cache: StaticCache | None = None
        self.slots_live = torch.zeros(0, compiled.slots + 1, dtype=torch.bool, device=self.device)  # [R, C + 1]
        self.live = torch.zeros(0, dtype=torch.long, device=self.device)  # [B]
        self.used = 0  # slots in use: the write pointer (every row writes at the same slots)

    # ------------------------------------------------------------------ RaggedCache's read-only view

    @property
    def rows(self) -> int:
        return self.live.shape[0]

    @property
    def slots(self) -> int:
        return self.used

    @property
    def mask(self) -> torch.Tensor:
        """[B, S] the live slots of the real rows."""
        return self.slots_live[: self.rows, : self.used]

    @property
    def holes(self) -> bool:
        return not bool(self.mask.all())

    # ------------------------------------------------------------------------------ storage

    def _layers(self) -> list[StaticLayer]:
        return list(self.cache.layers) if self.cache is not None else []

    def _point(self, used: int) -> None:
        """Move the write pointer of every layer to ``used``."""
        self.used = used
        for layer in self._layers():
            layer.cumulative_length.fill_(used)

    def _reserve(self, rows: int) -> None:
        """Buffers of at least ``rows`` rows (the next row bucket; spare rows dead), contents kept."""
        if rows <= self.capacity and self.cache is not None:
            return
        bucket = _bucket(rows, self.compiled.rows) or rows
        fresh = self.compiled.new_cache(bucket, self.device)
        for old, new in zip(self._layers(), fresh.layers):
            new.keys[: self.capacity].copy_(old.keys)
            new.values[: self.capacity].copy_(old.values)
        live = torch.zeros(bucket, self.compiled.slots + 1, dtype=torch.bool, device=self.device)
        live[: self.capacity] = self.slots_live
        self.cache, self.slots_live, self.capacity = fresh, live, bucket
        self._point(self.used)

    def _room(self, needed: int) -> None:
        """Make ``needed`` free slots after the pointer (re-packing the rows), or refuse."""
        if self.used + needed > self.compiled.slots:
            self.compact()
        if self.used + needed > self.compiled.slots:
            raise ValueError(f"{type(self.model).__name__}'s static cache holds {self.compiled.slots} slots per row; "
                             f"{self.used} are live and {needed} more were asked for: use --compile off for longer "
                             "sequences")

    # ------------------------------------------------------------------------------- forward

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None, logits_to_keep: int = 1,
                output_hidden_states: bool = False, **kwargs: object) -> CausalLMOutputWithPast:
        """Run the model on ``input_ids`` [B, n] (``valid`` [B, n] marks the real ones), as ``RaggedCache.forward``."""
        if kwargs:
            raise TypeError(f"the compiled path takes no {', '.join(kwargs)}")
        rows, n = input_ids.shape
        self._reserve(rows)
        width = _bucket(n, self.compiled.tokens) or n  # tokens per row: n real columns, then dead padding
        self._room(width)
        span = attended(self.used + width, self.compiled.slots)  # S: the slots this forward attends
        shape = Shape(self.capacity, width, bool(output_hidden_states))
        real = valid if valid is not None else torch.ones_like(input_ids, dtype=torch.bool)  # [B, n]
        ids = input_ids.new_zeros(self.capacity, width)
        ids[:rows, :n] = input_ids
        new = torch.zeros(self.capacity, width, dtype=torch.bool, device=self.device)
        new[:rows, :n] = real  # [R, w] real new tokens
        positions = torch.zeros(self.capacity, width, dtype=torch.long, device=self.device)
        positions[:rows] = (self.live[:, None] + new[:rows].long().cumsum(1) - 1).clamp_min(0)  # [B, w]
        self.slots_live[:, self.used: self.used + width] = new
        logits, hidden = self.compiled.run(shape, ids, self.slots_live[:, :span], positions,
                                           torch.tensor(self.used, device=self.device), self.cache)
        self.slots_live[:, self.used + n: self.used + width] = False
        self._point(self.used + n)  # the dead columns' slots are free again, as a rejected draft's
        self.live = self.live + real.sum(dim=1)
        keep = min(logits_to_keep, n) if logits_to_keep else n
        states = (hidden[:rows, n - keep: n],) if hidden is not None else None
        return CausalLMOutputWithPast(logits=logits[:rows, n - keep: n], hidden_states=states)

    # ----------------------------------------------------------------------- rows and rollback

    @torch.inference_mode()
    def keep(self, n: torch.Tensor) -> None:
        """Keep the first ``n[b]`` live tokens of each row ``b`` (``n <= live``); drop the rest."""
        if bool((n > self.live).any()):
            raise ValueError(f"cannot keep {n.tolist()} tokens of rows holding {self.live.tolist()}")
        mask = self.mask
        self.slots_live[: self.rows, : self.used] = mask & (mask.long().cumsum(dim=1) <= n[:, None])
        self.live = n.clone()
        self._trim()

    def _trim(self) -> None:
        """Pull the pointer back to after the last slot a row still uses (later slots are free again)."""
        used = self.slots_live[:, : self.used].any(dim=0).nonzero()  # [S', 1]
        self._point(int(used[-1]) + 1 if len(used) else 0)

    @torch.inference_mode()
    def compact(self) -> None:
        """Gather each row's live slots to the left, order kept; the pointer follows the longest row."""
        if self.rows == 0 or self.cache is None:
            self._point(0)
            return
        order = torch.argsort((~self.mask).to(torch.int8), dim=1, stable=True)  # [B, S] live slots first
        width = int(self.live.max())
        index = order[:, :width]  # [B, W]
        for layer in self._layers():
            for t in (layer.keys, layer.values):
                t[: self.rows, :, :width].copy_(gather_slots(t[: self.rows], index))
        packed = self.mask.gather(1, index)  # [B, W]
        self.slots_live[:, :] = False
        self.slots_live[: self.rows, :width] = packed
        self._point(width)

    @torch.inference_mode()
    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` [B'] (in that order); the buffers keep their row bucket."""
        kept = len(rows)
        for layer in self._layers():
            for t in (layer.keys, layer.values):
                t[:kept].copy_(t[rows])
        live = self.slots_live[rows].clone()
        self.slots_live[:] = False
        self.slots_live[:kept] = live
        self.live = self.live[rows]
        self._trim()

    @torch.inference_mode()
    def merge(self, other: RaggedCache) -> None:
        """Append the rows of ``other`` (an eager ``RaggedCache`` of the same model, e.g. a prefill)."""
        if other.rows == 0:
            return
        if other.window is not None or other.recurrent:
            raise TypeError("a static cache merges attention-only caches")
        rows = self.rows
        self._reserve(rows + other.rows)
        theirs = other.slots
        if theirs > self.used:  # shift the current rows right so both end at the same slot
            if theirs + 1 > self.compiled.slots:
                raise ValueError(f"a prompt of {theirs} cached tokens does not fit {type(self.model).__name__}'s "
                                 f"static cache of {self.compiled.slots} slots: use --compile off")
            self._room(theirs - self.used)
            shift, end = theirs - self.used, theirs
            for layer in self._layers():
                for t in (layer.keys, layer.values):
                    t[:rows, :, shift:end] = t[:rows, :, : self.used].clone()
            moved = self.slots_live[:rows, : self.used].clone()
            self.slots_live[:rows, : end] = False
            self.slots_live[:rows, shift:end] = moved
            self._point(end)
        start = self.used - theirs
        for mine, layer in zip(self._layers(), other.cache.layers):
            if theirs and layer.is_initialized and layer.keys is not None:
                mine.keys[rows: rows + other.rows, :, start: self.used] = layer.keys
                mine.values[rows: rows + other.rows, :, start: self.used] = layer.values
        self.slots_live[rows: rows + other.rows] = False
        self.slots_live[rows: rows + other.rows, start: self.used] = other.mask
        self.live = torch.cat([self.live, other.live.to(self.device)])
