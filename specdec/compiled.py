"""The compiled, static-shape decoding path (``--compile auto|on|off``).

Eager decoding pays transformers' Python around every forward (module dispatch, mask building,
``torch.cat`` into a growing ``DynamicCache``). Here a model's decode forwards run through
``torch.compile`` (inductor: generated C++ on CPU) over a preallocated cache:

- ``StaticRaggedCache``: the cache handle of a compiled model, with ``RaggedCache``'s interface and
  rule (each row's live slots ``mask``, positions = live tokens before each token, ``keep`` per row,
  ``select``, ``merge``, ``compact``), its keys and values in transformers' ``StaticCache`` layers
  ``[R, heads, C + 1, dim]``: ``R`` rows (the smallest row bucket >= the batch's rows, grown as rows join and
  shrunk as they leave; spare rows are dead), ``C`` slots.
  The layers' write pointer (``cumulative_length``) is the first unused slot; a rollback moves it
  back (the rejected slots are overwritten later and never attended meanwhile). The rows are re-packed
  (``compact``) when the next forward would not fit.
- Slot widths: a forward attends only the first ``S`` slots (``attended``: the pointer plus its new
  tokens, rounded up to ``SLOT_STEP``), through ``WindowLayer``, a ``StaticLayer`` whose update returns
  that slice, and a mask of ``S`` columns; short contexts pay short attention. ``S`` is one dynamic
  dimension of the graph (``mark_dynamic``), not one graph per width: the buffers keep one slot more
  than a forward ever attends, so every slice has the same strides and no width recompiles.
- ``CompiledModel``: one model's compiled step, ``torch.compile(..., fullgraph=True)`` of a forward
  taking ``(ids [R, n], live slots [R, S], cache)`` that builds the positions and the 4D mask (the live
  slots, causal over the new ones) inside the graph. Shapes are bucketed by rows (``row_buckets``:
  1, 4, 16, ... and the batch size) and tokens per row (``token_buckets``: the target's ``gamma + 1`` verification and a
  prompt-lookup copy + 1, a drafter's 1-token step, its 2-token catch-up and a catch-up after a lookup
  copy); a forward of fewer tokens is padded on the right to its bucket with dead tokens (masked out,
  their slots freed at once like a rejected draft's, their logits dropped). A drafter's buckets of more than one
  token (its catch-ups, which read one logit) project only their last real token onto the vocabulary
  (``Shape.last``, ``prepare(..., last=True)``: code-drafter's head is two thirds of its work a token; a 4-row
  catch-up in the 14-token bucket took 0.88-0.92 ms against 1.43-1.52). Every bucket is compiled and
  warmed when the model is prepared (``prepare``) and checked against the eager forward. A forward of
  another shape (a longer copy, a batch grown past its bucket) runs the same step eagerly on the same
  cache: exact, only slower, said once. Prefill stays eager (a ``RaggedCache``, merged in).
- The linear layers: where the blocked kernel builds as a torch operator (``kernels.blocked_op``:
  ``specdec::blocked_linear``, C++, called by inductor's C++ wrapper through the dispatcher), the graph traces
  every float32 CPU linear as it, for any number of rows, on a copy of the weight in the kernel's layout (a
  non-persistent buffer ``_specdec_blocked``, re-laid by ``refresh_blocked`` when the weight changed, as each
  decoding call's static cache is made). The compiled step then took 0.64-0.95 of its time with torch's products (four shipped
  models, 1 and 5 tokens, 10 and 200 cached; docs/benchmarks.md, "The blocked kernel as a torch operator"). A
  weight whose every value is a bfloat16 number (a model stored in bfloat16, as the shipped ones) is copied in
  bfloat16 pairs (``kernels.blocked_copy``), which the kernel widens back exactly as it reads them: the same results
  from half the bytes (docs/benchmarks.md, "Weights read at their stored width").
  Without it (no C++ compiler, ``SPECDEC_LINEAR=off``), where ``specdec.kernels`` installs its kernels on the
  model, the graph traces them in the kernels' formulation (``traced_linear``: ``W @ x.T`` for 1-2 rows, oneDNN
  on the prepacked weight through the ``specdec::packed_linear`` op for more, each where the probe chose it), not
  inductor's (freezing turns ``F.linear`` into MKL's packed kernel, the slow one on this CPU).
- The attention: where the operators load, a float32 CPU model with sdpa attention is traced with transformers'
  attention function "specdec" (``specdec_attention``: ``specdec::decode_attention``, ``csrc/attention.c``), which
  reads only the slots some query of a row sees. The rows share the write pointer, so a row shorter than the
  longest (a shorter prompt, a row that joined later) has dead slots before its own; 16 rows of code prompts
  attended about twice their live slots, and reading them was half of code-target's 16-row step (26 -> 21 ms a
  step with it; docs/benchmarks.md, "Attention over the live slots"). A call it does not cover runs sdpa.

Guards: a step runs without dynamo's guards (``CompiledModel._trace``). With all of them, the check before
every call took 0.08 ms for code-drafter and 0.12 ms for code-target (one thread, ``guard_manager.check`` timed
alone), as long as a drafter step's linears take. ``run`` picks the bucket's graph itself, and every input's
layout follows from the bucket and the model (``graph_file``'s key). The parameters are inputs of the graph, read
at every call (an in-place weight update is seen), but the graph keeps what it traced of the model's structure:
replacing a parameter by one of another shape, dtype or device, swapping a module, adding a hook to a
submodule, changing the config (attention implementation, output flags), or patching a function of torch or
transformers after ``prepare`` would be ignored or fail; specdec does none of these after loading. Each
``CompiledModel`` keeps its graphs to itself (a norm epsilon, say, is a constant of the graph).

Exactness: the compiled step computes what the eager forward computes (same cache contents, same
positions, same mask), to float rounding; greedy tokens match ``generate`` up to near ties, as the
eager batched path does, and the verification rule is unchanged, so sampling stays lossless.

Which models: decoder-only models whose forward takes ``position_ids`` and a 4D mask, with
full-attention layers only, and encoder-decoder models with BART-style cross-attention and table
positions (Marian, BART, ...: the end of this module, the same static cache, buckets and rule, each
row's source in static buffers, the encoder compiled; the prefill stays eager); ``compile_refusal`` says why another
one decodes eagerly, once.
The compile cache: each bucket's step is compiled ahead of time (dynamo's ``aot_compile``: Dynamo's trace,
AOT autograd and inductor's code in one object, without guards, since ``run`` picks the bucket) and saved
under ``~/.cache/specdec/graphs/torch-VERSION`` (``graph_file``: keyed by the versions, the CPU's vector
instructions, threads, inductor's options, the model's class, configuration and weight layout, its traced
linears and slots), inductor's C++ builds under ``~/.cache/specdec/inductor/torch-VERSION``. A second start
loads the step instead of tracing it (code-target's 1- and 5-token steps in a fresh process, checked: 5 s
against 15-23 s), and checks it against the eager step as a fresh compile is. A file that cannot be
used (corrupt, another Python or torch, traced from code that has changed since) is compiled again and
overwritten, said once. Inductor's freezing stays off: a frozen graph bypasses AOT autograd's cache, which
``aot_compile`` needs, and the step is as fast without it (the linears are traced as specdec's kernels).

On a CUDA device each warmed step is also replayed as a CUDA graph (``CudaStep``; ``CompiledModel._replay``): captured
at its first call for one cache's buffers, bucket and slot width (a CUDA graph's shapes and addresses are fixed: the
width is one graph each, the buffers are the graph's by address, and a cache's graphs die with it), after a run on a
side stream with torch's sync debug mode raising (a step that waits for the device cannot be captured, and a capture
that fails can leave the process's CUDA generator unusable), and checked by one replay against that run. A call copies
the ids and the live slots into the graph's own buffers, replays, and copies the logits out. The step captured is the
eager one (``inductor`` False) unless ``SPECDEC_CUDA_STEP=inductor``; torch without ``aot_compile`` (2.11 on the lent
H100) compiles it with guards (``Unsaved``), which the replay never runs. ``auto`` is on there: on an H100 (torch 2.11,
code-target float32, 12 prompts x 64 tokens, every output equal) the target's step took 0.78 ms replayed against 5.38
eager, plain decoding 3.84x ``generate`` (eager 0.97x) and the default speculation 6.01x (eager 2.08x), warmed in 1.7 s
(docs/benchmarks.md, "On a GPU: CUDA graphs").

``on`` compiles; ``off`` never does; ``auto`` is on for CUDA (above) and off on a CPU, as measured on this project's 2-core CPU at one thread
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
decoding and long runs whose start is paid once. The server is such a run: with ``auto`` it loads every bucket
from the compile cache where all are there, else serves eagerly while a child process compiles them, and switches
(``specdec.serve.background``; ``compiles`` answers for the other runs). With the guards and bookkeeping cut (above; docs/benchmarks.md,
"Compiled decoding: per-call overhead"), three alternated pairs of ``specdec bench --methods plain-hf plain spec-lookup --peers
llamacpp --num-prompts 12 --repeats 3 --drafter-dtype float32 --compile off|on`` (1 thread, load 4-7, every
output equal) put compiled plain decoding at 1.43-1.71x llama.cpp float32's time per token (eager 1.90-2.08x).
The target's step came to 1.04-1.29x its weight pass and the drafter's to 1.77-3.97x. The default speculation
ran at 2.98-3.29x ``generate`` (eager 2.88-3.07x).

Encoder-decoder models (the end of this module): the same machinery, extended by what a decoder step
also reads, each row's source.

- ``StaticSeq2SeqCache``: ``StaticRaggedCache`` (the same static self-attention layers, token buckets,
  slot widths, dead-token padding, rollback, ``compact``, ``select`` and ``merge`` rule) whose buffers also
  hold, per row, the encoder's output ``encoded`` [R, W, H], the cross-attention keys and values
  [R, heads, W, dim] of every decoder layer and the live source tokens ``source_live`` [R, W]. ``W``, the
  source width, is the longest source of the batch rounded up to ``SLOT_STEP`` (grown when a longer one
  joins, narrowed when the longest leaves: every step's cross-attention reads the whole width); it is a
  dynamic dimension of the graph (``mark_dynamic``), so no source length recompiles, and the padding beyond
  a row's source is masked.
- The encoder is compiled too (``CompiledSeq2Seq.warm_encoder``: one source, its length dynamic, in the
  compile cache beside the steps), and ``Seq2SeqCache.encode`` runs it for each joining row at its own
  length (``CompiledSeq2Seq.encode``); the prefill stays eager (``seq2seq.prefilled_cache``'s
  ``Seq2SeqCache``, merged in), its linears of up to ``EAGER_BLOCKED_ROWS`` rows by the blocked operator. The
  joining rows' cross-attention keys and values are computed then, once per row, by the decoder's own
  cross-attention modules, each stopped where it caches them (``cross_states``), as the eager cache computes
  them at its first forward.
- ``CompiledSeq2Seq``: ``CompiledModel`` whose step calls the model with the encoder's output, the source
  mask and the self-attention mask as 4D additive masks built inside the graph, and an
  ``EncoderDecoderCache`` whose cross-attention layers are marked computed (``is_updated``) so every
  layer reads its keys and values from the static buffers.
- Positions: the decoders of this family (BART, Marian, ...) add ``embed_positions`` computed from the cache
  length; ``positions.Positions`` replaces them with each row's own positions (live tokens before each
  token) by its forward hook on that table, which the graph traces as it runs eagerly.

Which models: encoder-decoder models whose decoder reads positions from a table (``Positions``' table
hook or a ``decoder_position_ids`` argument) and whose decoder layers have a BART-style cross-attention
(``encoder_attn``, reading ``EncoderDecoderCache.is_updated``); ``seq2seq_refusal`` names why another one (T5's
relative position bias, ...) decodes eagerly, said once.

Measured (docs/benchmarks.md, "The translation pair compiled"; 1 thread, a busy 2-core CPU): the decoder
step of ``translate-target`` 0.85-0.88 of eager (``benchmarks/compiled_buckets.py --model translate-target``),
``translate-drafter``'s 0.77-0.91; end to end (``specdec bench --task translate --compile off|on``,
``benchmarks/translate_breakdown.py --compile``) within the machine's noise: per source the encoder and the
row's set-up, per round the loop is most of a token's time at this model size.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import json
import math
import os
import shutil
import sys
import sysconfig
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AttentionInterface, DynamicCache, EncoderDecoderCache, PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from specdec import attention, kernels
from specdec.architectures import attention_chunk, local_window
from specdec.cache import RaggedCache, gather_slots, repack_pays
from specdec.compat import cache_keyword, cache_kwargs
from specdec.config import COMPILE_MODES, ModelConfig
from specdec.folders import cache_root
from specdec.loading import context_limit, input_device
from specdec.positions import positions_for
from specdec.seq2seq import Seq2SeqCache, cache_for

SLOTS = 512  # slots per row of a static cache (at most the model's context): attention cost vs room
SLOT_STEP = 32  # a forward attends the first S slots: the pointer plus its new tokens, rounded up to this
RECOMPILE_LIMIT = 256  # compiled (model, bucket) pairs allowed in one process
SLOT_SLACK = 16  # slots beyond the context for dead padding before a re-pack is needed
SPARE_CACHES = 2  # released static caches a CompiledModel keeps per (rows, device) for the next handle
# inductor's options for the step (freezing off: its graphs cannot be cached). Its C++ wrapper (the graph's calls
# in C++, not Python): on the Intel Xeon of docs/benchmarks.md the drafter's step 0.52 -> 0.47 ms and the default
# speculation 2.79x -> 2.97x generate (three alternated bench runs), its compiles no slower.
INDUCTOR: dict[str, object] = {"cpp_wrapper": True}
GRAPH_FORMAT = 1  # the layout of a graph file (``graph_file``): another is compiled again, never read
CHECK_TOLERANCE = 1e-3  # largest |compiled - eager| logit difference (relative to the logits' scale) at warm-up
INSTALL = ("torch.compile on CPU needs a C++ compiler and Python's headers: install them (Debian/Ubuntu: "
           "apt-get install g++ python3-dev; or set CXX to a compiler), or use --compile off")


def check_mode(mode: object) -> str:
    """``mode`` if it is one of ``COMPILE_MODES``, else a ValueError naming them."""
    if mode not in COMPILE_MODES:
        ModelConfig(compile=mode)  # raises the one message
    return str(mode)


def compiles(mode: str, device: torch.device | str | None = None) -> bool:
    """Whether a run on ``device`` compiles under ``--compile mode``: on; auto on a CUDA device (each step a CUDA
    graph: measured to pay there, with a start of seconds) and off elsewhere, as measured (module docstring)."""
    mode = check_mode(mode)
    return mode == "on" or (mode == "auto" and device is not None and str(device).startswith("cuda"))


def compiler_missing() -> str | None:
    """What torch.compile's CPU backend lacks here (a C++ compiler, Python's headers), or None."""
    compilers = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    if not any(shutil.which(c) for c in compilers):
        return f"no C++ compiler found ({', '.join(compilers)})"
    include = sysconfig.get_paths().get("include")
    if not include or not (Path(include) / "Python.h").is_file():
        return f"Python's headers are missing (no Python.h in {include})"
    return None


def cache_folder(kind: str = "inductor") -> Path:
    """specdec's on-disk compile cache for this torch version (another version's folder is never read):
    ``inductor`` (inductor's generated code and its C++ builds) or ``graphs`` (``graph_file``)."""
    return cache_root() / kind / f"torch-{torch.__version__}"


def use_cache_folder() -> None:
    """Point inductor at ``cache_folder()`` unless the user chose a folder (``TORCHINDUCTOR_CACHE_DIR``).
    Importing torch._dynamo already sets that variable to inductor's default (under /tmp), so a
    ``setdefault`` would never apply."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_folder())


def probed_isa(record: bool = False) -> bool:
    """Skip inductor's probe of the CPU's vector instruction sets (it builds and loads a test library for each
    in a child process: 2-3 s of every start; the AVX-512 variants' own probes, about half of it, still run)
    where an earlier start probed them here: the sets the probe accepted are kept in ``cache_folder("graphs")
    / "vec-isa.json"``, and trusted only when they are the ones the CPU's flags name (else probed again).
    ``record``: keep this process's probe. Whether the probe was skipped."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    file = cache_folder("graphs") / "vec-isa.json"
    if record:
        if config.cpp.vec_isa_ok is None:  # probed in this process
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(json.dumps(sorted(str(isa) for isa in valid_vec_isa_list())))
        return False
    if config.cpp.vec_isa_ok is not None or not file.is_file():  # the user's choice, or never probed here
        return False
    try:
        probed = json.loads(file.read_text())
    except ValueError:
        probed = None
    config.cpp.vec_isa_ok = True  # the sets the CPU's flags name, unprobed
    valid_vec_isa_list.cache_clear()
    if sorted(str(isa) for isa in valid_vec_isa_list()) == probed:
        return True
    config.cpp.vec_isa_ok = None  # another machine's record: probe
    valid_vec_isa_list.cache_clear()
    return False


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message ('' if it has none)."""
    return str(error).splitlines()[0] if str(error) else ""


def model_digest(model: PreTrainedModel, slots: int) -> str:
    """What a compiled step of ``model`` depends on besides its bucket: the versions, the machine's vector
    instructions and threads (inductor's C++ is generated for them), inductor's options, the model's class,
    configuration, the names, shapes and dtypes of its weights (not their values: a graph reads the weights
    at every call), which linears are traced in the kernels' formulation (and which kernels each takes), and the slots per row."""
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


def specdec_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' attention function "specdec" (``traced_attention``): in a compiled step, ``softmax(q k^T * scaling
    + mask) v`` by ``specdec::decode_attention`` (``csrc/attention.c``), which reads the keys and values of the slots
    some query of the row sees and skips the others (a shorter row's padding, the holes of ragged acceptance, a
    dead row); else, or for a call it does not cover (another head layout, a mask that is not additive per row,
    dropout, a relative bias, soft-capping, sinks), transformers' ``sdpa`` attention on the same inputs. 16 rows of code prompts, 6 layers
    of 288 slots (36% of them padding): 8.3 ms against SDPA's 13.8 (docs/benchmarks.md, "Attention over the live
    slots")."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (torch.compiler.is_compiling() and attention_mask is not None and not dropout and _covered(query, key, value,
                                                                                                    attention_mask)
            and all(kwargs.get(name) is None for name in attention.OTHER)):
        rows, _, tokens, dim = query.shape
        slots = key.shape[2]
        mask = attention_mask[:, :, :, :slots]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~mask, torch.finfo(query.dtype).min)
        mask = mask.expand(rows, 1, tokens, slots)[:, 0].contiguous()  # [R, n, S]
        scale = scaling if scaling is not None else dim ** -0.5
        return torch.ops.specdec.decode_attention(query.contiguous(), key, value, mask, scale), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register("specdec", specdec_attention)


def _covered(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether ``specdec::decode_attention`` computes this call: inputs it takes (``attention.covers``, a row's new
    tokens its queries), a 4D mask with one head."""
    rows, _, tokens, _ = query.shape
    return (mask.dim() == 4 and mask.shape[0] in (1, rows) and mask.shape[1] == 1 and mask.shape[2] in (1, tokens)
            and mask.shape[-1] >= key.shape[2] and mask.dtype in (torch.bool, torch.float32)
            and attention.covers(query, key, value, tokens))


def traced_attention(model: PreTrainedModel) -> str | None:
    """The attention implementation a compiled step of ``model`` is traced with: "specdec" (``specdec_attention``)
    where its operator loads (``kernels.blocked_op``) for a float32 CPU model that has sdpa attention (a decoder-only
    model configured with sdpa, an encoder-decoder model configured with either); else the model's own, but
    ``eager`` for an encoder-decoder model: SDPA's CPU kernel makes 20-30 tensor calls around each of the step's self-
    and cross-attentions, which the eager formulation, fused by inductor, does not (the step took 0.87-0.97 of its time
    with SDPA for the translation pair; docs/benchmarks.md, "The blocked kernel as a torch operator"). A compiled
    encoder-decoder model's encoder is traced with ``eager`` (``CompiledSeq2Seq.warm_encoder``). Only the trace sees
    it: the eager step and the prefill keep the model's own."""
    kept = getattr(model.config, "_attn_implementation", None)
    seq2seq = getattr(model.config, "is_encoder_decoder", False)
    if (kept in (("sdpa", "eager") if seq2seq else ("sdpa",)) and getattr(model, "_supports_sdpa", False)
            and model.dtype == torch.float32 and input_device(model).type == "cpu"
            and kernels.mode() != "off" and kernels.blocked_op()):
        return "specdec"
    return "eager" if seq2seq else kept


def graph_file(model: PreTrainedModel, slots: int, shape: Shape) -> Path:
    """Where the compiled step of ``model`` for ``shape`` is kept between runs (``cache_folder("graphs")``)."""
    name = (f"{model_digest(model, slots)}-r{shape.rows}-n{shape.tokens}{'-hidden' if shape.hidden else ''}"
            f"{'-last' if shape.last else ''}.bin")
    return cache_folder("graphs") / name


def _changed_source(graph: object) -> str | None:
    """The first source a loaded graph was traced from that has changed since (module and lines), or None."""
    for code in graph.source_info().inlined_sources:
        lines = inspect.getsourcelines(importlib.import_module(code.module))[0][code.firstlineno - 1: code.lastlineno - 1]
        if hashlib.sha256("".join(lines).encode()).hexdigest() != code.checksum:
            return f"{code.module} lines {code.firstlineno}-{code.lastlineno} changed"
    return None


def compile_refusal(model: PreTrainedModel) -> str | None:
    """Why ``model`` decodes eagerly whatever ``--compile`` says, or None when it can be compiled."""
    name = type(model).__name__
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        if (reason := seq2seq_refusal(model)) is not None:
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
    return packed(x, weight, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def traced_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  kernel: kernels._Packed) -> torch.Tensor:
    """``kernels.fast_linear`` traced, with the kernels ``kernel`` (the layer's) takes: ``W @ x.T`` for 1-2 rows (an
    extern ``mm`` that freezing's MKL packing leaves alone), its layout left to inductor; oneDNN on the prepacked
    weight for more, through the ``specdec::packed_linear`` op (a packed oneDNN tensor has no fake form for a
    trace); ``F.linear`` for the row counts the layer keeps torch's kernel for."""
    return kernels.fast_linear(x, weight, bias, kernel, packed_linear, traced=True)


def blocked_traced(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, out: int) -> torch.Tensor:
    """``F.linear`` of ``x`` [..., in] traced as ``specdec::blocked_linear`` on the layer's blocked copy of its weight
    (``kernels.blocked_op``): one call of the C++ operator, for any number of rows."""
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.specdec.blocked_linear(rows, blocked, bias, out).reshape(*x.shape[:-1], out)


# Eagerly, while specdec decodes, a layer holding a blocked copy of its weight runs the blocked operator on inputs of
# up to this many rows (an encoder's source, the cross-attention's keys and values, a short prefill, a step outside
# the buckets): measured against torch's and oneDNN's kernels on translate-target's and code-target's shapes (one
# thread, weights warm), it took 0.47-1.0 of the faster one's time at 3-30 rows and 0.97-1.38 at 64-150
# (docs/benchmarks.md, "The translation pair's join").
EAGER_BLOCKED_ROWS = 32


def _traced_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A compiled model's linear layer: traced as the blocked operator where the layer holds its copy
    (``_specdec_blocked``), else as ``traced_linear``; run eagerly by that operator too while specdec decodes
    (``kernels.active``) on up to ``EAGER_BLOCKED_ROWS`` rows while the copy is the weight's (``refresh_blocked``
    re-lays it as each decoding call starts: a weight changed since then falls back), else as ``specdec.kernels``
    says."""
    blocked = getattr(self, "_specdec_blocked", None)
    if torch.compiler.is_compiling() and self.weight.dtype == x.dtype == torch.float32 and x.device.type == "cpu":
        if blocked is not None:
            return blocked_traced(x, blocked, self.bias, self.out_features)
        return traced_linear(x, self.weight, self.bias, self._specdec_packed)
    if (blocked is not None and kernels._active() and x.dtype is torch.float32 and x.is_cpu
            and x.numel() <= EAGER_BLOCKED_ROWS * x.shape[-1] and x.numel() > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
            and self._specdec_blocked_key == kernels.weight_key(self.weight)):
        return blocked_traced(x.contiguous(), blocked, self.bias, self.out_features)
    if hasattr(self, "_specdec_packed"):
        return kernels._forward(self, x)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def _traced(module: torch.nn.Module) -> bool:
    return getattr(vars(module).get("forward"), "__func__", None) is _traced_forward


def trace_kernels(model: PreTrainedModel) -> bool:
    """Give ``model``'s linear layers the kernels its compiled step traces; whether any has one. Where the blocked
    operator loads (``kernels.blocked_op``; not with ``SPECDEC_LINEAR=off``), every eligible float32 CPU linear
    (``kernels._eligible``) is traced as it, for any number of rows, on a copy of its weight in the kernel's layout,
    held as a non-persistent buffer (``_specdec_blocked``: not in the state dict, refreshed by ``refresh_blocked``);
    else the layers that ``specdec.kernels`` installs on are traced in the kernels' formulation (``traced_linear``)."""
    ours = kernels.install(model)
    blocked = (kernels.mode() != "off" and kernels.available()
               and any(kernels._eligible(module) for module in model.modules())  # no build for a GPU or bf16 model
               and kernels.blocked_op())
    found = False
    for module in model.modules():
        traced = _traced(module)  # e.g. a deep copy's
        if blocked and not traced and kernels._eligible(module):
            copy = kernels.blocked_copy(module.weight.detach(), kernels.blocked().lanes)
            module.register_buffer("_specdec_blocked", copy, persistent=False)
            module._specdec_blocked_key = kernels.weight_key(module.weight)
            packed = getattr(module, "_specdec_packed", None)
            if packed is not None and packed.many == "blocked":  # the eager kernel of many rows shares the copy
                packed.weight, packed.key = copy, (*kernels.weight_key(module.weight), "blocked")
            traced = True
        elif (ours and kernels._ours(module)) or traced:
            traced = True
        if traced:
            if hasattr(module, "_specdec_packed"):
                _PACKS[module.weight.data_ptr()] = module._specdec_packed
            module.forward = types.MethodType(_traced_forward, module)
            found = True
    return found


def blocked_layers(model: PreTrainedModel) -> list[torch.nn.Linear]:
    """The layers of ``model`` that hold a blocked copy of their weight (``trace_kernels``)."""
    return [m for m in model.modules() if "_specdec_blocked" in m._buffers]


@torch.inference_mode()
def refresh_blocked(layers: list[torch.nn.Linear]) -> None:
    """Re-lay the blocked copy of every layer of ``layers`` whose weight changed since (a new tensor or an in-place
    write): called as each decoding call's static cache is made, so a call reads the weights as they are when it
    starts."""
    for module in layers:
        if module._specdec_blocked_key != (key := kernels.weight_key(module.weight)):
            copy = kernels.blocked_copy(module.weight.detach(), module._specdec_blocked.shape[2])
            if copy.shape == module._specdec_blocked.shape and copy.dtype == module._specdec_blocked.dtype:
                module._specdec_blocked.copy_(copy)  # in place: the compiled graphs keep their input
            else:  # no longer (or now) bfloat16 numbers: another layout, which the graphs are traced again for
                module._specdec_blocked = copy
            module._specdec_blocked_key = key


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
    """One bucket: rows, new tokens per row, whether the last hidden state is returned (every slot width
    shares it: the slot dimension is dynamic), and whether only the last real token's logits are (``last``: a
    drafter's catch-up, ``prepare(..., last=True)``)."""

    rows: int
    tokens: int
    hidden: bool = False
    last: bool = False


def buckets(tokens: tuple[int, ...], rows: tuple[int, ...], hidden: bool = False, last: bool = False) -> list[Shape]:
    """The shapes ``prepare`` warms for these buckets: every rows x tokens, without the hidden states and, where
    ``hidden``, with them too; where ``last``, the forwards of more than one token keep the logits of their last real
    token only."""
    return [Shape(r, n, h, last and n > 1) for r in rows for n in tokens for h in sorted({False, hidden})]


ENCODER = Shape(1, 0)  # the graph file of an encoder-decoder model's compiled encoder (``CompiledSeq2Seq.warm_encoder``)


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


def moved_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a ``select`` keeping ``rows`` [B'] in that order: (the places whose row changes, the rows that go there),
    or None when every kept row stays where it is."""
    order = rows.tolist()
    places = [i for i, row in enumerate(order) if row != i]
    if not places:
        return None
    return torch.tensor(places, dtype=torch.long, device=rows.device), rows[places]


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
        self.model = model
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

    def _step(self, ids: torch.Tensor, live: torch.Tensor, cache: StaticCache, hidden: bool,
              last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [R, n, V] (and the last hidden states [R, n, H]) of ``ids`` [R, n] written at slots
        ``start + 0..n-1`` (``start``: the cache's write pointer); ``live`` [R, S] marks the slots each row
        attends (its new real tokens included), the first S of the cache's. A token's position is the number
        of live slots before its own (RaggedCache's rule: live tokens before it), counted here in the graph.
        ``last`` [1]: the logits of that column only, [R, 1, V] (the head's product for one token a row)."""
        n = ids.shape[1]
        positions, mask = step_inputs(ids, live, cache, self.layout[0][3])
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **{self.keyword: cache},
                         use_cache=True, logits_to_keep=n if last is None else last, output_hidden_states=hidden)
        return out.logits, out.hidden_states[-1] if hidden else None

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


@dataclass(frozen=True)
class CompileChoice:
    """Whether a model's decode forwards are compiled, and why."""

    compiled: bool
    reason: str  # e.g. "on: 3 shapes warmed in 41.2 s" or "off (auto: ...)"

    def describe(self) -> str:
        return f"compile {self.reason}"


def prepare(model: PreTrainedModel, mode: str = "on", *, tokens: tuple[int, ...] = (1,), rows: tuple[int, ...] = (1,),
            hidden: bool = False, last: bool = False, slots: int | None = None,
            cached_only: bool = False) -> CompileChoice:
    """Compile and warm ``model``'s decode step for every (rows, tokens) bucket (``mode`` on), or leave it
    eager (off, and auto: ``compiles``). Later caches of the model (``decoding_cache``) are then static. A
    second call adds buckets. A model that cannot be compiled decodes eagerly, told once by a warning; a
    missing compiler is a RuntimeError saying what to install. ``cached_only``: every bucket from the compile
    cache (each checked as usual) or none: where one is not there, nothing is compiled and the model stays as it
    was (eager, or with the buckets it had), silently (``specdec.serve.background`` compiles it elsewhere).
    ``last``: the buckets of more than one token keep the logits of their last real token only (a drafter's
    catch-up, which reads no other: code-drafter's head is two thirds of its work a token; not on CUDA, whose graphs
    replay the buckets as they are); a forward that wants them all runs eagerly there."""
    import time

    device = input_device(model)
    cuda = device.type == "cuda"
    if not compiles(mode, device):
        model._specdec_compiled = None
        return CompileChoice(False, "off" if mode == "off" else "off (auto: as measured, it does not pay here)")
    missing = compiler_missing()
    if missing is not None and not cuda:
        raise RuntimeError(f"--compile on: {missing}. {INSTALL}")
    if (reason := compile_refusal(model)) is not None:
        warnings.warn(f"--compile on: {reason}; it decodes eagerly", stacklevel=2)
        model._specdec_compiled = None
        return CompileChoice(False, f"off ({reason})")
    use_cache_folder()
    isa = probed_isa()
    # one code object (the step) compiled per model and bucket: dynamo's default limit of 8 is too few
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    started = time.perf_counter()
    compiled = getattr(model, "_specdec_compiled", None)
    if compiled is None:
        limit = context_limit(model)
        width = slots or (SLOTS if limit is None else min(SLOTS, limit)) + SLOT_SLACK
        compiled = _compiled_class(model)(model, width)
        if cuda and (missing is not None or os.environ.get("SPECDEC_CUDA_STEP", "eager") != "inductor"):
            compiled.inductor = False  # CUDA graphs of the eager step (inductor's: SPECDEC_CUDA_STEP=inductor)
    loaded = compiled.loaded
    wanted = buckets(tokens, rows, hidden, last and not cuda)

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
            model._specdec_compiled = None
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
    model._specdec_compiled = compiled
    how = "" if not cuda else ", CUDA graphs of the eager step" if not compiled.inductor else ", CUDA graphs"
    if getattr(compiled, "encoder", None) is not None:
        how += "; the encoder compiled"
    if compiled.blocked:
        how += "; linears traced as specdec::blocked_linear"
    return CompileChoice(True, f"on: {len(compiled.shapes)} shapes warmed in {time.perf_counter() - started:.1f} s "
                               f"({compiled.loaded - loaded} from the compile cache{how})")


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
    """``CompiledModel``, or its encoder-decoder form (``CompiledSeq2Seq``)."""
    return CompiledSeq2Seq if getattr(model.config, "is_encoder_decoder", False) else CompiledModel


def decoding_cache(model: PreTrainedModel, device: torch.device | str) -> object:
    """The cache handle a target or drafter decodes with: static when ``prepare`` compiled the model
    (``StaticRaggedCache``, or ``StaticSeq2SeqCache`` for an encoder-decoder model), else ``cache_for``'s
    (prefills stay eager, merged in)."""
    compiled = compiled_for(model)
    if compiled is None:
        return cache_for(model, 0, device)
    handle = StaticSeq2SeqCache if isinstance(compiled, CompiledSeq2Seq) else StaticRaggedCache
    return handle(model, compiled, device)


class StepOutput(NamedTuple):
    """A static cache forward's output: what callers read of ``RaggedCache.forward``'s ``CausalLMOutputWithPast``,
    without its construction (about 10-40 us a step, measured: as much as the rest of the bookkeeping)."""

    logits: torch.Tensor  # [B, k, V]
    hidden_states: tuple[torch.Tensor] | None  # (the last hidden states [B, k, H],) when asked for


class _Lease:
    """A static cache's buffers held by one handle: released to their ``CompiledModel`` when it is dropped."""

    __slots__ = ("cache", "compiled")

    def __init__(self, compiled: CompiledModel, cache: StaticCache) -> None:
        self.compiled, self.cache = compiled, cache

    def __del__(self) -> None:
        self.compiled.release(self.cache)


class StaticRaggedCache:
    """``RaggedCache``'s interface and rule over a preallocated static cache (see the module docstring)."""

    recurrent = False
    merges_rows = True  # ``merge`` copies only the new rows into the buffers (``seq2seq.prefill_into``)

    @torch.inference_mode()
    def __init__(self, model: PreTrainedModel, compiled: CompiledModel, device: torch.device | str = "cpu") -> None:
        self.model, self.compiled, self.device = model, compiled, torch.device(device)
        refresh_blocked(compiled.blocked)  # the blocked copies of weights changed since the last call
        self.capacity = 0  # R: rows of the buffers
        self.cache: StaticCache | None = None
        self._lease: _Lease | None = None  # the buffers' lease (``_reserve``)
        self.slots_live = torch.zeros(0, compiled.slots + 1, dtype=torch.bool, device=self.device)  # [R, C + 1]
        self.live = torch.zeros(0, dtype=torch.long, device=self.device)  # [B]
        self.used = 0  # slots in use: the write pointer (every row writes at the same slots)
        self._buckets, self._widths = compiled.tokens, {}  # tokens per row -> its token bucket (or itself)
        self._lasts: dict[int, torch.Tensor] = {}  # tokens per row -> [1] its last column (``Shape.last``)

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
        """Move the write pointer (shared by every layer: ``WindowLayer``) to ``used``."""
        self.used = used
        if self.cache is not None:
            self.cache.layers[0].cumulative_length.fill_(used)

    def _reserve(self, rows: int) -> None:
        """Buffers of at least ``rows`` rows (the next row bucket; spare rows dead), contents kept."""
        if rows <= self.capacity and self.cache is not None:
            return
        self._resize(_bucket(rows, self.compiled.rows) or rows)

    def _resize(self, bucket: int) -> None:
        """Buffers of ``bucket`` rows holding the first ``min(bucket, capacity)`` rows' contents (the slots in use:
        the others are zero in new buffers, as dead slots may be), the old buffers given back to the model."""
        fresh = self._buffers(bucket)
        kept, used = min(bucket, self.capacity), self.used
        for old, new in zip(self._layers(), fresh.layers):
            new.keys[:kept, :, :used].copy_(old.keys[:kept, :, :used])
            new.values[:kept, :, :used].copy_(old.values[:kept, :, :used])
        live = torch.zeros(bucket, self.compiled.slots + 1, dtype=torch.bool, device=self.device)
        live[:kept] = self.slots_live[:kept]
        self.cache, self.slots_live, self.capacity = fresh, live, bucket
        # the buffers go back to the model's spares when this handle lets them go (resized, or dropped)
        self._lease = _Lease(self.compiled, getattr(fresh, "self_attention_cache", fresh))
        self._point(self.used)

    def _buffers(self, rows: int) -> StaticCache:
        """New buffers of ``rows`` rows for ``_reserve`` (which copies the self-attention contents into them)."""
        return self.compiled.new_cache(rows, self.device)

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
                output_hidden_states: bool = False, **kwargs: object) -> StepOutput:
        """Run the model on ``input_ids`` [B, n] (``valid`` [B, n] marks the real ones), as ``RaggedCache.forward``."""
        if kwargs:
            raise TypeError(f"the compiled path takes no {', '.join(kwargs)}")
        rows, n = input_ids.shape
        if rows > self.capacity or self.cache is None:
            self._reserve(rows)
        if self._buckets is not self.compiled.tokens:  # prepare added buckets since
            self._buckets, self._widths = self.compiled.tokens, {}
        width = self._widths.get(n) or self._widths.setdefault(n, _bucket(n, self._buckets) or n)
        if self.used + width > self.compiled.slots:  # tokens per row: n real columns, then dead padding
            self._room(width)
        span = attended(self.used + width, self.compiled.slots)  # S: the slots this forward attends
        keep = min(logits_to_keep, n) if logits_to_keep else n
        shape, last = Shape(self.capacity, width, bool(output_hidden_states)), None
        if keep == 1 and width > 1 and (tail := Shape(shape.rows, width, shape.hidden, True)) in self.compiled.shapes:
            shape, last = tail, self._lasts.get(n)  # the head's product for the last real token only
            if last is None:
                last = self._lasts[n] = torch.tensor([n - 1], device=self.device)
        ids = input_ids
        if rows != self.capacity or n != width or input_ids.stride() != (n, 1):  # the strides the graph was traced for
            ids = input_ids.new_zeros(self.capacity, width)  # [R, w]: dead rows and columns of token 0
            ids[:rows, :n] = input_ids
        # the new real tokens' slots go live (slots from the pointer on are all dead: the padding stays so)
        self.slots_live[:rows, self.used: self.used + n] = True if valid is None else valid
        logits, hidden = self.compiled.run(shape, ids, self.slots_live[:, :span], self.cache, last)
        self._point(self.used + n)  # the dead columns' slots are free again, as a rejected draft's
        self.live = self.live + (n if valid is None else valid.sum(dim=1))
        if rows == self.capacity and keep == n == width:  # the whole output: no slicing (a torch call each)
            return StepOutput(logits, (hidden,) if hidden is not None else None)
        states = (hidden[:rows, n - keep: n],) if hidden is not None else None
        if last is not None:  # [R, 1, V] already
            return StepOutput(logits if rows == self.capacity else logits[:rows], states)
        return StepOutput(logits[:rows, n - keep: n], states)

    # ----------------------------------------------------------------------- rows and rollback

    @torch.inference_mode()
    def keep(self, n: torch.Tensor) -> None:
        """Keep the first ``n[b]`` live tokens of each row ``b`` (``n <= live``); drop the rest. Keeping every
        token (plain decoding, a fully accepted draft) changes nothing, the pointer included."""
        if torch.equal(n, self.live):
            return
        if bool((n > self.live).any()):
            raise ValueError(f"cannot keep {n.tolist()} tokens of rows holding {self.live.tolist()}")
        mask = self.mask
        self.slots_live[: self.rows, : self.used] = mask & (mask.long().cumsum(dim=1) <= n[:, None])
        self.live = n.clone()
        self._trim()

    def _trim(self) -> None:
        """Pull the pointer back to after the last slot a row still uses (later slots are free again), and re-pack
        the rows when the slots in use past the longest row's live ones call for it (``cache.repack_pays``). Checked
        here, after a rollback or rows leaving (which read the host already), as the eager cache does: not before
        each forward, where it cost a host sync every drafter step."""
        used = self.slots_live[:, : self.used].any(dim=0).nonzero()  # [S', 1]
        self._point(int(used[-1]) + 1 if len(used) else 0)
        if self.rows and repack_pays(self.used, int(self.live.max())):
            self.compact()

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
        """Keep the rows ``rows`` [B'] (in that order). When they fit a smaller row bucket, the buffers shrink to it:
        every later forward then runs that bucket's step, not one of the batch's former size with dead rows (a
        server that once held 16 requests decoded a lone one in the 16-row step, 2.8x slower: 1.43 s against 0.50 s
        for 64 tokens of code-target).
        Only the rows that move are copied, and only their slots in use (``moved_rows``): a row left in place keeps its
        buffers, and the slots past the pointer are dead. Copying every row's every slot took 75 ms at 16 rows of
        code-target (528 slots), paid each time a row finished apart from the others."""
        kept = len(rows)
        if (moved := moved_rows(rows)) is not None:
            places, sources = moved
            for layer in self._layers():
                for t in (layer.keys, layer.values):
                    t[places, :, : self.used] = t[sources, :, : self.used]
        live = self.slots_live[rows].clone()
        self.slots_live[:] = False
        self.slots_live[:kept] = live
        self.live = self.live[rows]
        self._trim()
        bucket = _bucket(max(kept, 1), self.compiled.rows)
        if self.cache is not None and bucket is not None and bucket < self.capacity:
            self._resize(bucket)

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


# ------------------------------------------------------------------ encoder-decoder models

def cross_attentions(model: PreTrainedModel) -> list[torch.nn.Module] | None:
    """The decoder layers' cross-attention modules (BART-style ``encoder_attn``), or None."""
    try:
        layers = getattr(model.get_decoder(), "layers", None)
    except (AttributeError, NotImplementedError, ValueError):
        return None
    modules = [getattr(layer, "encoder_attn", None) for layer in layers or ()]
    return modules if modules and all(hasattr(m, "layer_idx") for m in modules) else None


def seq2seq_refusal(model: PreTrainedModel) -> str | None:
    """Why the encoder-decoder ``model`` cannot take the static cache (``compile_refusal``), or None."""
    name = type(model).__name__
    positions = positions_for(model)
    if not positions.supported or positions.needs_keys:
        how = "a relative position bias" if positions.needs_keys else "positions of its own"
        return f"{name}'s decoder computes {how} (the compiled path gives positions from a table)"
    if cross_attentions(model) is None:
        return f"{name}'s decoder layers have no BART-style cross-attention (encoder_attn) reading a cache"
    return None


class _Cached(Exception):
    """Raised by ``_Capture`` with what a cross-attention module hands its cache."""


class _Capture(DynamicCache):
    """A cross-attention cache that stops the module at its update: the keys and values it would cache are all that
    ``cross_states`` wants, not the attention and output projection after them."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise _Cached(key_states, value_states)


@torch.inference_mode()
def cross_states(model: PreTrainedModel, encoded: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per decoder layer, the cross-attention keys and values [B, heads, S, dim] of ``encoded`` [B, S, H],
    computed by the layer's own module (its key and value projections), as the eager cache's first forward does;
    each module stopped where it caches them (``_Capture``: 0.4 of the time of running it whole, translate-target)."""
    states = []
    query = encoded[:, :1]  # [B, 1, H]: the query is not used, only what the module caches
    for module in cross_attentions(model):
        scratch = EncoderDecoderCache(DynamicCache(), _Capture())
        try:
            module(query, key_value_states=encoded, **cache_kwargs(module, scratch))
        except _Cached as cached:
            states.append(cached.args)
        else:
            raise TypeError(f"{type(module).__name__} cached no cross-attention keys and values")
    return states


class StaticEncoderDecoderCache(EncoderDecoderCache):
    """What the compiled step takes: the static self-attention cache (``layers`` are its layers, as
    ``StaticRaggedCache`` reads them), the cross-attention keys and values, marked computed, and each
    row's encoder output and live source tokens."""

    def __init__(self, self_attention: StaticCache, cross: DynamicCache, encoded: torch.Tensor,
                 source_live: torch.Tensor) -> None:
        super().__init__(self_attention, cross)
        self.is_updated = dict.fromkeys(range(len(cross.layers)), True)  # every layer reads the buffers
        self.encoded, self.source_live = encoded, source_live  # [R, W, H], [R, W]

    @property
    def layers(self) -> list:
        return self.self_attention_cache.layers


class CompiledSeq2Seq(CompiledModel):
    """An encoder-decoder model's compiled decode step (see the module docstring)."""

    encoder: Callable[..., torch.Tensor] | None = None  # the encoder compiled (``warm_encoder``)

    def _encoder_step(self, ids: torch.Tensor) -> torch.Tensor:
        """The encoder's output [1, S, H] for one source ``ids`` [1, S] (no padding)."""
        return self.model.get_encoder()(input_ids=ids).last_hidden_state

    def warm_encoder(self) -> None:
        """Compile the encoder for one source of any length (the length dynamic; loaded from the compile cache where
        it was saved, ``graph_file`` of ``ENCODER``) and check it against the eager encoder (a ValueError if a fresh
        compile differs; a cached one is compiled again). Eagerly, transformers' Python around translate-target's
        three encoder layers took about half of the encoder's 5.4-5.8 ms a source (one thread)."""
        device = input_device(self.model)
        ids = torch.randint(0, self.model.config.get_text_config().vocab_size, (1, SLOT_STEP + 3), device=device)
        torch._dynamo.mark_dynamic(ids, 1)
        with torch.inference_mode(), kernels.active():
            expected = self._encoder_step(ids)

        def trace() -> Callable[..., object]:
            with torch.no_grad():  # traced for inference: no autograd graph around the operator
                return self._trace((ids,), self._encoder_step, attention="eager")  # a source's own length: all live

        def run(graph: Callable[..., object]) -> torch.Tensor:
            with torch.inference_mode():
                return graph(self, ids)

        self.encoder = self._checked(graph_file(self.model, self.slots, ENCODER), trace, run, expected,
                                     "encoder outputs")

    @torch.inference_mode()
    def encode(self, source: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
        """The encoder's output [B, S, H] of the rows' sources ``source`` [B, S] (``valid`` marks real tokens) by the
        compiled encoder, each row alone at its own length (as ``generate`` encodes a source; the padding's columns
        are zeros, masked everywhere they are read); None where it was not compiled or a source has one token (the
        length the graph was not traced for), and the eager encoder runs."""
        counts = valid.sum(dim=1).tolist()
        if self.encoder is None or min(counts) < 2:
            return None
        if len(counts) == 1 and counts[0] == source.shape[1]:
            return self.encoder(self, source.contiguous())
        encoded = torch.zeros(*source.shape, self.hidden_size, dtype=self.layout[0][3], device=source.device)
        for row, real in enumerate(valid):
            encoded[row, real] = self.encoder(self, source[row, real][None])[0]
        return encoded

    def _layout(self) -> list[tuple[int, int, int, torch.dtype]]:
        """Per decoder layer: (kv heads, key dim, value dim, dtype) of the self-attention, and ``cross_layout``,
        read from one eager forward of one token on a one-token source."""
        device = input_device(self.model)
        probe = Seq2SeqCache(self.model, 1, device)
        one = torch.zeros(1, 1, dtype=torch.long, device=device)
        with torch.no_grad():
            probe.encode(one, torch.ones_like(one, dtype=torch.bool))
            probe.forward(one)
        self.hidden_size = probe.encoded.shape[-1]
        self.cross_layout = [(k.shape[1], k.shape[-1], v.shape[-1]) for k, v in cross_states(self.model, probe.encoded)]
        return [(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1], layer.keys.dtype)
                for layer in probe.cache.layers]

    @torch.inference_mode()
    def new_cache(self, rows: int, device: torch.device | str, width: int = 0) -> StaticEncoderDecoderCache:
        """``CompiledModel.new_cache``'s self-attention buffers and source buffers of ``width`` (0: the warm-up's
        width, one ``SLOT_STEP`` more than any self-attention width it attends, so that the two dynamic
        dimensions never share a size there and keep their own symbols)."""
        width = width or attended(self.slots, self.slots) + SLOT_STEP
        return self.with_sources(super().new_cache(rows, device), width, device)

    def with_sources(self, self_attention: StaticCache, width: int,
                     device: torch.device | str) -> StaticEncoderDecoderCache:
        """``self_attention``'s rows with zeroed source buffers of ``width``: the cross-attention keys and values,
        the encoder output [rows, width, hidden] and the source mask [rows, width], their width dimension dynamic
        in the graph."""
        rows, dtype = self_attention.layers[0].keys.shape[0], self.layout[0][3]
        cross = DynamicCache()
        for index, (heads, key_dim, value_dim) in enumerate(self.cross_layout):
            keys = torch.zeros(rows, heads, width, key_dim, dtype=dtype, device=device)
            values = torch.zeros(rows, heads, width, value_dim, dtype=dtype, device=device)
            cross.update(keys, values, index)
        encoded = torch.zeros(rows, width, self.hidden_size, dtype=dtype, device=device)
        source_live = torch.zeros(rows, width, dtype=torch.bool, device=device)
        for layer in cross.layers:
            torch._dynamo.mark_dynamic(layer.keys, 2)
            torch._dynamo.mark_dynamic(layer.values, 2)
        torch._dynamo.mark_dynamic(encoded, 1)
        torch._dynamo.mark_dynamic(source_live, 1)
        return StaticEncoderDecoderCache(self_attention, cross, encoded, source_live)

    def _step(self, ids: torch.Tensor, live: torch.Tensor, cache: StaticEncoderDecoderCache, hidden: bool,
              last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``CompiledModel._step`` of the decoder: logits [R, n, V] (and the last hidden states [R, n, H]) of
        ``ids`` [R, n] written at the cache's write pointer, each row attending its live slots ``live`` [R, S]
        and its source (``cache.source_live`` [R, W]); ``last`` [1]: that column's logits only (sliced: these
        models' forwards compute the head for every token)."""
        n, slots = ids.shape[1], live.shape[1]
        dtype = self.layout[0][3]
        positions, mask = step_inputs(ids, live, cache, dtype)
        source = cache.source_live[:, None, None, :].expand(-1, 1, n, -1)  # [R, 1, n, W]
        source_mask = torch.zeros(source.shape, dtype=dtype, device=ids.device).masked_fill(
            ~source, torch.finfo(dtype).min)  # [R, 1, n, W] (a dead row attends nothing: uniform, dropped)
        kwargs: dict = {}
        with self.positions.applied(kwargs, positions, None, slots):
            out = self.model(encoder_outputs=(cache.encoded,), attention_mask=source_mask, decoder_input_ids=ids,
                             decoder_attention_mask=mask, **{self.keyword: cache}, use_cache=True,
                             output_hidden_states=hidden, **kwargs)
        logits = out.logits[:, -n:]
        return logits if last is None else logits[:, last], out.decoder_hidden_states[-1] if hidden else None


class StaticSeq2SeqCache(StaticRaggedCache):
    """``StaticRaggedCache`` whose rows also hold their sources (see the module docstring)."""

    cache: StaticEncoderDecoderCache | None
    compiled: CompiledSeq2Seq

    @property
    def source_width(self) -> int:
        return self.cache.source_live.shape[1] if self.cache is not None else 0

    def _sources(self, cache: StaticEncoderDecoderCache) -> StaticEncoderDecoderCache:
        """``cache`` (new source buffers) holding the current sources: as many rows and columns as fit."""
        if self.cache is not None:
            old = self.cache
            kept = min(cache.source_live.shape[0], old.source_live.shape[0])
            used = min(cache.source_live.shape[1], self.source_width)
            for mine, theirs in zip(cache.cross_attention_cache.layers, old.cross_attention_cache.layers):
                mine.keys[:kept, :, :used] = theirs.keys[:kept, :, :used]
                mine.values[:kept, :, :used] = theirs.values[:kept, :, :used]
            cache.encoded[:kept, :used] = old.encoded[:kept, :used]
            cache.source_live[:kept, :used] = old.source_live[:kept, :used]
        return cache

    def _buffers(self, rows: int) -> StaticEncoderDecoderCache:
        """New self-attention buffers and source buffers of the current source width, holding the sources."""
        return self._sources(self.compiled.new_cache(rows, self.device, self.source_width or SLOT_STEP))

    def _widen(self, width: int) -> None:
        """Source buffers at least ``width`` wide (rounded up to ``SLOT_STEP``), contents kept."""
        width = -(-width // SLOT_STEP) * SLOT_STEP
        if width > self.source_width:
            self.cache = self._sources(self.compiled.with_sources(self.cache.self_attention_cache, width, self.device))

    @torch.inference_mode()
    def select(self, rows: torch.Tensor) -> None:
        if self.cache is not None:
            kept = len(rows)
            if (moved := moved_rows(rows)) is not None:  # the rows that move, as the self-attention's (``select``)
                places, sources = moved
                for layer in self.cache.cross_attention_cache.layers:
                    for t in (layer.keys, layer.values):
                        t[places] = t[sources]
            for t in (self.cache.encoded, self.cache.source_live):
                picked = t[rows].clone()
                t[kept:] = 0
                t[:kept] = picked
        super().select(rows)
        self._narrow()

    def _narrow(self) -> None:
        """Source buffers only as wide as the widest kept source (rounded up to ``SLOT_STEP``; contents kept): every
        step's cross-attention reads the whole width, so one long source that has left would otherwise cost each
        later row its width (a 335-token source among 40 of 4-25 kept the translation bench's steps at 352 columns
        for the 39 after it)."""
        if self.cache is None:
            return
        columns = self.cache.source_live.any(dim=0).nonzero()  # [k, 1]: the columns some kept row attends
        width = max(SLOT_STEP, -(-(int(columns.max()) + 1 if len(columns) else 0) // SLOT_STEP) * SLOT_STEP)
        if width < self.source_width:
            self.cache = self._sources(self.compiled.with_sources(self.cache.self_attention_cache, width, self.device))

    @torch.inference_mode()
    def merge(self, other: Seq2SeqCache) -> None:
        """Append the rows of ``other`` (the eager prefill of new rows): their self-attention as
        ``StaticRaggedCache.merge``, their sources and cross-attention keys and values into the source buffers."""
        if other.rows == 0:
            return
        if not isinstance(other, Seq2SeqCache) or other.encoded is None:
            raise TypeError("a static encoder-decoder cache merges the Seq2SeqCache of encoded rows")
        rows = self.rows
        super().merge(other)
        width = other.encoded.shape[1]
        self._widen(width)
        new = slice(rows, rows + other.rows)
        for layer, (keys, values) in zip(self.cache.cross_attention_cache.layers, cross_states(self.model, other.encoded)):
            layer.keys[new, :, :width] = keys
            layer.values[new, :, :width] = values
        self.cache.encoded[new, :width] = other.encoded
        self.cache.source_live[new] = False
        self.cache.source_live[new, :width] = other.source_mask.to(self.device)

