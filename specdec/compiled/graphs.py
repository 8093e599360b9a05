"""One model's compiled decode step per bucket: ``CompiledModel``, its graph files and its CUDA graphs.

Contract: a ``CompiledModel`` holds a model's step ``(ids [R, n], live slots [R, S], static cache) -> logits``
compiled for each warmed ``Shape`` (rows, tokens per row; the slot width S is one dynamic dimension), checked
against the eager step at warm-up (``CHECK_TOLERANCE``). ``run`` takes the bucket's graph, or runs the same
step eagerly for a shape that was not warmed (exact, slower, said once). Each step is compiled ahead of time
without dynamo's guards (``run`` picks the bucket; every input's layout follows from it and the model) and kept
in the compile cache (``graph_file``, keyed by everything the code depends on), so a second start loads it; on
a CUDA device each step is replayed as a CUDA graph (``CudaStep``). The graph keeps what it traced of the model's
structure: a parameter of another shape, a swapped module, a changed config after ``prepare`` is not seen (the
parameters themselves are inputs, read at every call). A ``CompiledModel`` holds its model weakly, so the tables
that map a model to it (``specdec.compiled.prepare``) do not keep the model alive.

Why and how fast (guards, the graph files, CUDA graphs): docs/journal/compiled-path.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import json
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from specdec import kernels
from specdec.cache import RaggedCache
from specdec.compat import cache_keyword
from specdec.compiled.ops import _traced, blocked_layers, trace_kernels, traced_attention
from specdec.compiled.policy import (
    CHECK_TOLERANCE,
    GRAPH_FORMAT,
    INDUCTOR,
    SLOT_STEP,
    SPARE_CACHES,
    cache_folder,
    first_line,
)
from specdec.loading import input_device
from specdec.positions import positions_for


def model_digest(model: PreTrainedModel, slots: int) -> str:
    """What a compiled step of ``model`` depends on besides its bucket: the versions, the machine's vector
    instructions and threads (inductor's C++ is generated for them), inductor's options, the model's class,
    configuration, the names, shapes and dtypes of its weights (not their values: a graph reads the weights
    at every call), which linears are traced in the kernels' formulation (and which kernels each takes), and the
    slots per row."""
    import transformers

    traced = sorted((name, *((m._specdec_packed.few, m._specdec_packed.many) if hasattr(m, "_specdec_packed") else ()),
                     hasattr(m, "_specdec_blocked")) for name, m in model.named_modules() if _traced(m))
    tensors = [(name, tuple(t.shape), str(t.dtype), str(t.device))
               for name, t in [*model.named_parameters(), *model.named_buffers()]]
    config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}  # not where it was read
    parts = [GRAPH_FORMAT, sys.version, torch.__version__, transformers.__version__,
             torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), sorted(INDUCTOR.items()),
             type(model).__module__, type(model).__qualname__, json.dumps(config, sort_keys=True, default=str),
             traced_attention(model), tensors, traced, slots]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]

def graph_file(model: PreTrainedModel, slots: int, shape: Shape) -> Path:
    """Where the compiled step of ``model`` for ``shape`` is kept between runs (``cache_folder("graphs")``)."""
    states = ("" if not shape.hidden else "-hidden" if shape.hidden is True
              else f"-layers{'_'.join(map(str, shape.hidden))}")
    name = (f"{model_digest(model, slots)}-r{shape.rows}-n{shape.tokens}{states}"
            f"{'-last' if shape.last else ''}.bin")
    return cache_folder("graphs") / name


def _changed_source(graph: object) -> str | None:
    """The first source a loaded graph was traced from that has changed since (module and lines), or None."""
    for code in graph.source_info().inlined_sources:
        lines = inspect.getsourcelines(importlib.import_module(code.module))[0][code.firstlineno - 1:
                                                                                code.lastlineno - 1]
        if hashlib.sha256("".join(lines).encode()).hexdigest() != code.checksum:
            return f"{code.module} lines {code.firstlineno}-{code.lastlineno} changed"
    return None


class WindowLayer(StaticLayer):
    """A ``StaticLayer`` whose forwards attend only its first ``window`` slots (the write pointer plus the new
    tokens, rounded up: ``attended``); the slots beyond hold nothing live. Its buffers keep one slot more
    than a forward ever attends, so every window is a proper slice and one graph serves every width.

    Every layer of a cache shares one write pointer (``cumulative_length``, a 0-d tensor), which an update
    reads but does not advance: the cache handle moves it once per forward (``StaticRaggedCache._point``),
    not once per layer."""

    window: int

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.cumulative_length + torch.arange(key_states.shape[-2], device=key_states.device)  # [n]
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        return self.keys[:, :, : self.window], self.values[:, :, : self.window]  # [R, heads, S, dim]


def attended(end: int, slots: int) -> int:
    """S, the slots a forward attends when its last new token is written at slot ``end - 1``: ``end`` rounded up
    to ``SLOT_STEP`` (so the graph sees few distinct widths), at most ``slots``; at least 2 (dynamo specializes
    a size of 1)."""
    return max(2, min(slots, math.ceil(end / SLOT_STEP) * SLOT_STEP))


@dataclass(frozen=True)
class Shape:
    """One bucket: rows, new tokens per row, which hidden states are returned (every slot width shares it: the slot
    dimension is dynamic): False none, True the last, a tuple of layer indices (``hidden_key``) those layers'
    concatenated (a target's features, ``specdec.features``), and whether only the last real token's logits are
    (``last``: a drafter's catch-up, ``prepare(..., last=True)``)."""

    rows: int
    tokens: int
    hidden: bool | tuple[int, ...] = False
    last: bool = False


def hidden_key(hidden: object) -> bool | tuple[int, ...]:
    """``Shape.hidden`` for a forward's ``output_hidden_states``: a flag as it is, indices once each, in order (the
    layers a target's features read: ``features.selection``)."""
    return tuple(sorted(set(hidden))) if isinstance(hidden, (list, tuple)) else bool(hidden)


def buckets(tokens: tuple[int, ...], rows: tuple[int, ...], hidden: bool | tuple[int, ...] = False,
            last: bool = False, bare: bool = True) -> list[Shape]:
    """The shapes ``prepare`` warms for these buckets: every rows x tokens, without the hidden states (unless not
    ``bare``: every forward asks for them, as a target's verify does once a drafter reads its features) and, where
    ``hidden`` (True: the last; layer indices: those layers', ``hidden_key``), with them; where ``last``, the
    forwards of more than one token keep the logits of their last real token only."""
    kinds = dict.fromkeys(([False] if bare or not hidden else []) + [hidden_key(hidden)])  # each once, in order
    return [Shape(r, n, h, last and n > 1) for r in rows for n in tokens for h in kinds]


ENCODER = Shape(1, 0)  # the graph file of an encoder-decoder model's compiled
                       # encoder (``CompiledSeq2Seq.warm_encoder``)


def step_inputs(ids: torch.Tensor, live: torch.Tensor, cache: StaticCache,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What a compiled step gives the model for ``ids`` [R, n] written at the cache's write pointer, ``live``
    [R, S] marking the slots each row attends (its new real tokens included): the positions [R, n] (live slots
    before each token's own: RaggedCache's rule) and the additive 4D mask [R, 1, n, S] (the live slots, causal
    over the new ones; a padding token sees itself, so no row of the mask is empty). Sets the layers' window
    to S, the slots attended."""
    n, slots = ids.shape[1], live.shape[1]
    for layer in cache.layers:
        layer.window = slots  # attend the first S slots
    start = cache.layers[0].cumulative_length  # the write pointer (every layer shares it)
    query = start + torch.arange(n, device=ids.device)  # [n] slots of the new tokens
    positions = (live.cumsum(dim=1).gather(1, query[None].expand(ids.shape[0], n)) - 1).clamp_min(0)  # [R, n]
    key = torch.arange(slots, device=ids.device)  # [S]
    allowed = live[:, None, :] & (key[None, None, :] <= query[None, :, None])  # [R, n, S]
    allowed = allowed | (key[None, None, :] == query[None, :, None])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[:, None]  # [R, 1, n, S]
    return positions, mask

def _bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= value, or None."""
    return next((b for b in sorted(buckets) if b >= value), None)

@functools.cache
def saves_graphs() -> bool:
    """Whether this torch compiles a step ahead of time, to be saved (``aot_compile``: torch 2.13 here; 2.11 has
    ``load_compiled_function`` but no ``aot_compile``)."""
    return hasattr(torch.compiler, "load_compiled_function") and hasattr(torch.compile(lambda: None), "aot_compile")


class Unsaved:
    """A step compiled by ``torch.compile`` where torch has no ``aot_compile`` (``CompiledModel._trace``): called as
    a saved one is, with its owner first; never written to the compile cache."""

    def __init__(self, step: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        self.step = step

    def __call__(self, _owner: object, *args: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.step(*args)


@contextlib.contextmanager
def no_hooks(model: torch.nn.Module) -> Iterator[None]:
    """``model``'s own forward hooks set aside while ``run``'s step runs (``run`` calls them around it): eagerly, or
    compiled with guards (``Unsaved``: a hook added later would be traced), or captured as a CUDA graph (a hook may
    read or wait for the device, or record an event on another stream than the capture's)."""
    pre, post = model._forward_pre_hooks, model._forward_hooks
    if not pre and not post:  # the usual case: nothing to set aside
        yield
        return
    model._forward_pre_hooks, model._forward_hooks = type(pre)(), type(post)()
    try:
        yield
    finally:
        model._forward_pre_hooks, model._forward_hooks = pre, post


class CudaStep:
    """One bucket's step on one cache's buffers at one slot width, captured as a CUDA graph: the step's inputs are
    copied into the graph's own (token ids [R, n] and live slots [R, C + 1], of which it reads the first S, with the
    strides the step was traced for), the graph replayed (the whole step in one launch, none of transformers' Python
    or the kernels' launches), and its outputs copied out (the next replay overwrites them). The cache's buffers and
    write pointer are the graph's own by address: a cache's graphs die with it (``CompiledModel.captured``)."""

    __slots__ = ("graph", "hidden", "ids", "live", "logits", "slots")

    @classmethod
    @torch.inference_mode()
    def capture(cls, compiled: CompiledModel, ids: torch.Tensor, live: torch.Tensor, cache: StaticCache,
                hidden: bool) -> CudaStep:
        """Run the step once on a side stream (CUDA graphs capture warmed code), capture it, and check one replay
        against that run (a ValueError if they differ). Both write the same keys and values at the same slots."""
        step = cls.__new__(cls)
        step.slots = live.shape[1]
        step.ids = ids.clone(memory_format=torch.contiguous_format)
        step.live = torch.zeros(live.shape[0], compiled.slots + 1, dtype=torch.bool, device=live.device)
        step.live[:, : step.slots] = live
        view = step.live[:, : step.slots]
        if compiled.pool is None:
            compiled.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=ids.device)
        side.wait_stream(torch.cuda.current_stream(ids.device))
        mode = torch.cuda.get_sync_debug_mode()
        try:  # a step that waits for the device cannot be captured (and a failed capture can break the process)
            torch.cuda.set_sync_debug_mode("error")
            with torch.cuda.stream(side):  # ``_graph`` runs none of the model's hooks (``no_hooks``)
                expected = compiled._graph(step.ids, view, cache, hidden)[0].clone()
        finally:
            torch.cuda.set_sync_debug_mode(mode)
        torch.cuda.current_stream(ids.device).wait_stream(side)
        step.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a server's) do not break this capture; this thread's still do
        with torch.cuda.graph(step.graph, pool=compiled.pool, capture_error_mode="thread_local"):
            step.logits, step.hidden = compiled._graph(step.ids, view, cache, hidden)
        step.graph.replay()
        error = float((step.logits - expected).abs().max())
        scale = float(expected.abs().max()) + 1.0
        if not error <= CHECK_TOLERANCE * scale:
            raise ValueError(f"the replayed graph's logits differ from the step's by {error:.3g} (scale {scale:.3g})")
        return step

    def __call__(self, ids: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.ids.copy_(ids)
        self.live[:, : self.slots].copy_(live)
        if self.ids.device.index in (None, torch.cuda.current_device()):
            self.graph.replay()
        else:  # replayed on its own device's stream
            with torch.cuda.device(self.ids.device):
                self.graph.replay()
        return self.logits.clone(), self.hidden.clone() if self.hidden is not None else None


class CompiledModel:
    """A model's compiled decode step and the shapes it was warmed for (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, slots: int) -> None:
        self._model = weakref.ref(model)  # weakly: the tables that map the model to this must not keep it alive
        self.keyword = cache_keyword(model)  # read here, not inside the traced step
        self.positions = positions_for(model)  # read through ``self`` in the traced step: a saved graph's input
        self.slots = slots  # C: slots per row a forward may use (the buffers hold C + 1: ``WindowLayer``)
        self.shapes: set[Shape] = set()  # compiled and warmed
        self.rows: tuple[int, ...] = ()
        self.tokens: tuple[int, ...] = ()
        self.eager_shapes: set[Shape] = set()  # shapes run eagerly (told once each)
        self.calls = {"compiled": 0, "eager": 0}  # decode forwards run each way
        self.kernels = trace_kernels(model)  # the linears traced in specdec's kernels' formulation
        self.blocked = blocked_layers(model)  # those traced as the blocked operator (``refresh_blocked``)
        self.graphs: dict[Shape, Callable[..., tuple[torch.Tensor, torch.Tensor | None]]] = {}  # warm's
        self.loaded = 0  # shapes whose compiled step came from the on-disk cache (``graph_file``)
        self.layout = self._layout()
        self.spare: dict[tuple[int, torch.device], list[StaticCache]] = {}  # released buffers (``new_cache``)
        self.inductor = True  # the steps are inductor's (False: the eager step, captured as CUDA graphs)
        # CUDA: each step replayed as a CUDA graph (``_replay``), per cache buffers, bucket and slot width
        self.replays = input_device(model).type == "cuda"
        self.captured: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {(shape, S): CudaStep}
        self.pool = None  # the CUDA graphs' memory pool, shared by this model's graphs (``CudaStep``)
        self.cached_only = False  # warm loads graphs from the compile cache only: a missing one raises ``NotCached``

    @property
    def model(self) -> PreTrainedModel:
        """The model compiled (alive while anyone uses it: its handles and its caller hold it)."""
        return self._model()

    def _graph(self, ids: torch.Tensor, live: torch.Tensor, cache: StaticCache, hidden: bool,
               last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step compiled for the bucket of these inputs (``run`` calls it for warmed shapes only); the eager
        step where inductor was not used (``inductor`` False: a CUDA model whose graphs capture the eager step)."""
        graph = self.graphs[Shape(ids.shape[0], ids.shape[1], hidden, last is not None)]
        args = (ids, live, cache, hidden) if last is None else (ids, live, cache, hidden, last)
        if graph is not None and not isinstance(graph, Unsaved):  # traced ahead of time: it calls no module's hooks
            return graph(self, *args)
        with no_hooks(self.model):  # the model's own hooks run around the step (``run``), not inside it
            return self._step(*args) if graph is None else graph(self, *args)

    def _replay(self, shape: Shape, ids: torch.Tensor, live: torch.Tensor,
                cache: StaticCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step as a CUDA graph (``CudaStep``): captured at the first call for this cache's buffers, bucket and
        slot width, replayed after that; its outputs copied out. A capture that fails, or whose replay differs from
        the step it captured, ends the graphs for this model (said once): the step runs as before."""
        steps = self.captured.get(cache)
        if steps is None:
            steps = self.captured[cache] = {}
        key = (shape, live.shape[1])
        step = steps.get(key)
        if step is None:
            try:
                with torch.cuda.device(ids.device):  # the model's device, whichever is current (cuda:1, ...)
                    step = steps[key] = CudaStep.capture(self, ids, live, cache, shape.hidden)
            except Exception as error:  # noqa: BLE001 - any capture failure runs the step uncaptured, said once
                self.replays = False
                self.captured.clear()
                warnings.warn(f"{type(self.model).__name__}: its decode step could not be captured as a CUDA graph "
                              f"({type(error).__name__}: {first_line(error)}); it runs without graphs", stacklevel=4)
                return self._graph(ids, live, cache, shape.hidden)
        return step(ids, live)

    def _trace(self, args: tuple[object, ...], step: Callable[..., object] | None = None,
               attention: str | None = None) -> Callable[..., object]:
        """The step (or ``step``) compiled ahead of time for ``args``' shapes (the slot width dynamic), with the
        ``attention`` implementation (else ``traced_attention``'s), as a function that
        can be saved: dynamo's ``aot_compile``, without guards. ``run`` picks the bucket before the call and
        every input's layout follows from the bucket and the model (``graph_file``'s key), so guards would
        only re-check that at every call (and dynamo's identity guards on the model cannot be saved).
        Where torch has no ``aot_compile`` (2.11, say: ``Unsaved``), the step is compiled as usual, with its
        guards, and not saved (traced at its first call, with the model's own attention); CUDA graphs replay it
        without its Python, guards included."""
        cpu = input_device(self.model).type == "cpu"  # the C++ wrapper is for CPU graphs; CUDA ones are replayed
        options = {**(INDUCTOR if cpu else {})}
        step = step or self._step
        config = self.model.config
        kept = config._attn_implementation
        config._attn_implementation = attention or traced_attention(self.model)  # only the trace sees it
        try:
            if not saves_graphs():
                return Unsaved(torch.compile(step, dynamic=None, fullgraph=True, options=options))
            options["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe
            with kernels.active(), torch._dynamo.config.patch(automatic_dynamic_shapes=False):  # dynamic: S only
                graph = torch.compile(step, dynamic=None, fullgraph=True, options=options).aot_compile((args, {}))
        finally:
            config._attn_implementation = kept
        graph.disable_guard_check()
        return graph

    def _load(self, path: Path) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None:
        """The compiled step saved at ``path``, or None when there is none or it cannot be used (unreadable,
        written by another Python or torch, or traced from code that has changed since), told once."""
        if not path.is_file() or not saves_graphs():
            return None
        try:
            with path.open("rb") as file:
                graph = torch.compiler.load_compiled_function(file)
            if (changed := _changed_source(graph)) is not None:
                raise ValueError(changed)
        except Exception as error:  # noqa: BLE001 - any unusable file is compiled again and overwritten
            warnings.warn(f"the compile cache's {path.name} was not used ({type(error).__name__}: "
                          f"{first_line(error)}); compiling it again", stacklevel=4)
            return None
        graph.disable_guard_check()
        return graph

    def _layout(self) -> list[tuple[int, int, int, torch.dtype]]:
        """Per layer: (kv heads, key dim, value dim, dtype), read from one eager forward of one token."""
        probe = RaggedCache(self.model, 1, input_device(self.model))
        with torch.no_grad():
            probe.forward(torch.zeros(1, 1, dtype=torch.long, device=probe.mask.device))
        return [(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1], layer.keys.dtype)
                for layer in probe.cache.layers]

    @torch.inference_mode()
    def new_cache(self, rows: int, device: torch.device | str) -> StaticCache:
        """A ``StaticCache`` of ``rows`` rows and ``self.slots`` (+ 1) slots, zeroed: a released one (``release``)
        if there is one, else allocated now (a fresh allocation of the buffers cost 4-11 ms of every
        ``generate`` call for code-target, most of it the first touch of new pages, against 0.2 ms to zero kept
        ones)."""
        device = torch.device(device)
        spare = self.spare.get((rows, device))
        if spare:
            cache = spare.pop()
            for layer in cache.layers:
                layer.keys.zero_()
                layer.values.zero_()
                layer.window = self.slots
            cache.layers[0].cumulative_length.zero_()
            return cache
        width = self.slots + 1
        cache = StaticCache(config=self.model.config, max_cache_len=width)
        cache.layers = [WindowLayer(width) for _ in cache.layers]
        pointer = torch.tensor(0, dtype=torch.long, device=device)  # the first free slot, shared by every layer
        for layer, (heads, key_dim, value_dim, dtype) in zip(cache.layers, self.layout):
            # what StaticLayer.lazy_initialization sets, without marking static addresses (a CUDA-graph need):
            # the buffers are plain inputs of the compiled step, so every cache of this shape reuses its code
            layer.dtype, layer.device, layer.batch_size, layer.num_heads = dtype, torch.device(device), rows, heads
            layer.k_head_dim, layer.v_head_dim = key_dim, value_dim
            layer.keys = torch.zeros(rows, heads, width, key_dim, dtype=dtype, device=device)
            layer.values = torch.zeros(rows, heads, width, value_dim, dtype=dtype, device=device)
            layer.cumulative_length = pointer
            layer.is_initialized, layer.window = True, self.slots
        return cache

    def release(self, cache: StaticCache) -> None:
        """Keep the buffers of ``cache`` (from ``new_cache``, no longer used by anyone) for a later ``new_cache``
        of the same rows and device (at most ``SPARE_CACHES`` each)."""
        layer = cache.layers[0]
        spare = self.spare.setdefault((layer.keys.shape[0], layer.device), [])  # the device new_cache was asked for
        if len(spare) < SPARE_CACHES:
            spare.append(cache)

    def _step(self, ids: torch.Tensor, live: torch.Tensor, cache: StaticCache, hidden: bool | tuple[int, ...],
              last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [R, n, V] (and, ``hidden`` True, the last hidden states [R, n, H]; layer indices, those layers'
        hidden states concatenated [R, n, k H], the rest of them never leaving the graph) of ``ids`` [R, n] written at
        slots
        ``start + 0..n-1`` (``start``: the cache's write pointer); ``live`` [R, S] marks the slots each row
        attends (its new real tokens included), the first S of the cache's. A token's position is the number
        of live slots before its own (RaggedCache's rule: live tokens before it), counted here in the graph.
        ``last`` [1]: the logits of that column only, [R, 1, V] (the head's product for one token a row)."""
        n = ids.shape[1]
        positions, mask = step_inputs(ids, live, cache, self.layout[0][3])
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **{self.keyword: cache},
                         use_cache=True, logits_to_keep=n if last is None else last, output_hidden_states=bool(hidden))
        if not hidden:
            return out.logits, None
        if hidden is True:
            return out.logits, out.hidden_states[-1]
        return out.logits, torch.cat([out.hidden_states[i] for i in hidden], dim=-1)

    @torch.inference_mode()
    def run(self, shape: Shape, ids: torch.Tensor, live: torch.Tensor, cache: StaticCache,
            last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step over the first S slots (``live`` [R, S]), compiled when ``shape`` was warmed, else eager
        (told once per shape); ``last`` where ``shape.last`` (``_step``)."""
        if shape in self.shapes:
            self.calls["compiled"] += 1
            model = self.model  # its forward hooks (the bench's meters) run around the graph, traced without them
            if model._forward_pre_hooks:
                for hook in list(model._forward_pre_hooks.values()):
                    hook(model, ())
            if self.replays:
                out = self._replay(shape, ids, live, cache)
            else:
                out = self._graph(ids, live, cache, shape.hidden, last)
            if model._forward_hooks:
                for hook in list(model._forward_hooks.values()):
                    hook(model, (), out)
            return out
        self.calls["eager"] += 1
        if shape not in self.eager_shapes:
            self.eager_shapes.add(shape)
            warnings.warn(f"{type(self.model).__name__}: a forward of {shape.rows} rows x {shape.tokens} tokens"
                          f"{' (hidden states)' if shape.hidden else ''} has no compiled bucket: it runs eagerly",
                          stacklevel=4)
        return self._step(ids, live, cache, shape.hidden, last)

    @torch.inference_mode()
    def warm(self, shape: Shape) -> None:
        """Compile ``shape`` (or load it from the on-disk cache, ``graph_file``) and check it against the eager
        step on random tokens (a ValueError if a fresh compile differs; a cached one is compiled again)."""
        if not self.inductor:  # CUDA graphs of the eager step: nothing to compile (captured at first use)
            self.graphs[shape] = None
            self.shapes.add(shape)
            return
        device = input_device(self.model)
        ids = torch.randint(0, self.model.config.get_text_config().vocab_size, (shape.rows, shape.tokens),
                            device=device)
        span = attended(3 + shape.tokens, self.slots)

        def inputs() -> tuple[object, ...]:  # a fresh cache each time: the step writes into it
            cache = self.new_cache(shape.rows, device)
            live = torch.zeros(shape.rows, self.slots + 1, dtype=torch.bool, device=device)[:, :span]  # as forward's
            live[:, 3: 3 + shape.tokens] = True
            cache.layers[0].cumulative_length.fill_(3)  # every layer's pointer
            torch._dynamo.mark_dynamic(live, 1)
            tail = (torch.tensor([shape.tokens - 1], device=device),) if shape.last else ()  # ``_step``'s ``last``
            return (ids, live, cache, shape.hidden, *tail)

        with kernels.active():
            expected = self._step(*inputs())[0]
        self.graphs[shape] = self._checked(graph_file(self.model, self.slots, shape), lambda: self._trace(inputs()),
                                           lambda graph: graph(self, *inputs())[0], expected, "logits")
        self.shapes.add(shape)

    def _checked(self, path: Path, trace: Callable[[], Callable[..., object]],
                 run: Callable[[Callable[..., object]], torch.Tensor], expected: torch.Tensor,
                 what: str) -> Callable[..., object]:
        """The graph saved at ``path`` (``_load``), else ``trace()``'s, checked by ``run(graph)`` against the eager
        ``expected`` (``CHECK_TOLERANCE`` of its scale): a cached graph that fails to run or differs is compiled again
        (said), a fresh one that differs is a ValueError naming ``what`` it computed. A fresh graph is saved."""
        with warnings.catch_warnings():
            if self.cached_only:  # an unusable file is not compiled again here: whoever compiles says so
                warnings.simplefilter("ignore")
            graph = self._load(path)
        for cached in (True, False) if graph is not None else (False,):
            if not cached:
                if self.cached_only:
                    raise NotCached(path.name)
                graph = trace()
            try:
                with kernels.active():
                    out = run(graph)
            except Exception as failure:  # a cached graph that cannot run here is compiled again (a fresh one raises)
                if not cached:
                    raise
                warnings.warn(f"the compile cache's {path.name} failed to run ({type(failure).__name__}: "
                              f"{first_line(failure)}); compiling it again", stacklevel=4)
                continue
            error = float((out - expected).abs().max())
            scale = float(expected.abs().max()) + 1.0
            if error <= CHECK_TOLERANCE * scale:
                break
            if not cached:
                raise ValueError(f"compiled {what} differ from eager by {error:.3g} (scale {scale:.3g})")
            warnings.warn(f"the compile cache's {path.name} differs from eager by {error:.3g} (scale {scale:.3g}); "
                          "compiling it again", stacklevel=4)
        if cached:
            self.loaded += 1
        elif not isinstance(graph, Unsaved):
            path.parent.mkdir(parents=True, exist_ok=True)
            graph.save_compiled_function(str(path))  # written to a temporary file, then renamed
        return graph


class NotCached(Exception):
    """A shape whose compiled step is not in the compile cache (or cannot be used from it), under ``prepare``'s
    ``cached_only``: nothing is compiled then."""

