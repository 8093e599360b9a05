"""The compiled, static-shape decoding path (``--compile auto|on|off``), beside the eager core.

Eager decoding pays transformers' Python around every forward; here a prepared model's decode forwards run a
``torch.compile``d step (inductor's C++ on a CPU, CUDA graphs on a GPU) over preallocated buffers, for a few
bucketed shapes, exactly as the eager forward computes them (to float rounding: greedy tokens match ``generate``
up to near ties, and the verification rule is unchanged, so sampling stays lossless). The eager core imports
nothing from here: ``prepare`` registers the model's cache factory with ``specdec.cache.register_cache`` (and
returns it), and the core's ``specdec.seq2seq.decoding_cache`` asks that registry. Modules:

- ``policy``: whether a model is compiled (``compiles``, ``compile_refusal``), the compile cache's folders;
- ``ops``: the attention and linear operators a step is traced with;
- ``graphs``: ``CompiledModel`` (one model's step per bucket, graph files, ``CudaStep``), ``Shape``;
- ``static_cache``: ``StaticRaggedCache``, the cache handle over static buffers;
- ``seq2seq``: the encoder-decoder variants (``CompiledSeq2Seq``, ``StaticSeq2SeqCache``);
- ``prepare``: ``prepare``, the buckets a run compiles, ``compiled_for``, the ``StaticCaches`` factory.

The design notes and measurements that were this module's docstring: docs/journal/compiled-path.md.
"""

from specdec.compiled.graphs import (
    ENCODER,
    CompiledModel,
    CudaStep,
    NotCached,
    Shape,
    Unsaved,
    WindowLayer,
    attended,
    buckets,
    graph_file,
    model_digest,
    no_hooks,
    saves_graphs,
    step_inputs,
)
from specdec.compiled.ops import (
    EAGER_BLOCKED_ROWS,
    blocked_layers,
    blocked_traced,
    packed_linear,
    quantized_traced,
    refresh_blocked,
    specdec_attention,
    trace_kernels,
    traced_attention,
    traced_linear,
    traced_operators,
)
from specdec.compiled.policy import (
    CHECK_TOLERANCE,
    GRAPH_FORMAT,
    INDUCTOR,
    INSTALL,
    RECOMPILE_LIMIT,
    SLOT_SLACK,
    SLOT_STEP,
    SLOTS,
    SPARE_CACHES,
    cache_folder,
    check_mode,
    compile_refusal,
    compiler_missing,
    compiles,
    cross_attentions,
    first_line,
    probed_isa,
    seq2seq_refusal,
    use_cache_folder,
)
from specdec.compiled.prepare import (
    ROW_STEP,
    CompileChoice,
    StaticCaches,
    compiled_for,
    prepare,
    row_buckets,
    set_compiled,
    token_buckets,
)
from specdec.compiled.seq2seq import (
    CompiledSeq2Seq,
    StaticEncoderDecoderCache,
    StaticSeq2SeqCache,
    cross_states,
)
from specdec.compiled.static_cache import StaticRaggedCache, StepOutput, moved_rows
from specdec.seq2seq import decoding_cache

__all__ = [
    "CHECK_TOLERANCE", "EAGER_BLOCKED_ROWS", "ENCODER", "GRAPH_FORMAT", "INDUCTOR", "INSTALL", "RECOMPILE_LIMIT",
    "ROW_STEP", "SLOTS", "SLOT_SLACK", "SLOT_STEP", "SPARE_CACHES", "CompileChoice", "CompiledModel", "CompiledSeq2Seq",
    "CudaStep", "NotCached", "Shape", "StaticCaches", "StaticEncoderDecoderCache", "StaticRaggedCache",
    "StaticSeq2SeqCache", "StepOutput", "Unsaved", "WindowLayer", "attended", "blocked_layers", "blocked_traced",
    "buckets", "cache_folder", "check_mode", "compile_refusal", "compiled_for", "compiler_missing", "compiles",
    "cross_attentions", "cross_states", "decoding_cache", "first_line", "graph_file", "model_digest", "moved_rows",
    "no_hooks", "packed_linear", "prepare", "probed_isa", "quantized_traced", "refresh_blocked", "row_buckets",
    "saves_graphs", "seq2seq_refusal", "set_compiled", "specdec_attention", "step_inputs", "token_buckets",
    "trace_kernels", "traced_attention", "traced_linear", "traced_operators", "use_cache_folder",
]
