"""The operators a compiled step is traced with: specdec's attention and linear kernels inside a graph.

Contract: ``traced_attention(model)`` names the attention implementation a step of ``model`` is traced with
("specdec": ``specdec_attention``, the ``specdec::decode_attention`` operator that reads only the slots some
query of a row sees, where it loads for a float32 CPU model; else the model's own). ``trace_kernels(model)``
gives the model's linear layers the forward a graph traces (``_traced_forward``: a specdec operator on the layer's
copy of its weight in that operator's layout, held as the non-persistent buffer ``_specdec_blocked``:
``specdec::blocked_linear`` for a float32 weight, ``specdec::quantized_linear`` for a torchao int8 / int4
weight-only one (``specdec.qlinear``'s packed copy, its scales and zero points beside it); else the kernels'
formulation of ``specdec.kernels``); ``refresh_blocked`` re-lays those copies when a weight changed. Eagerly,
while specdec decodes, the same layers run their operator (the blocked one on up to ``EAGER_BLOCKED_ROWS`` rows).

Why: inductor's own linears (MKL's packed kernel after freezing) and SDPA's CPU kernel were the slow parts of
a compiled step on this project's CPU; the figures are in docs/journal/compiled-path.md and docs/benchmarks.md.
"""

from __future__ import annotations

import types
import weakref

import torch
from transformers import AttentionInterface, PreTrainedModel

from specdec import attention, kernels, qlinear
from specdec.loading import input_device


def specdec_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' attention function "specdec" (``traced_attention``): in a compiled step, ``softmax(q k^T * scaling
    + mask) v`` by ``specdec::decode_attention`` (``csrc/attention.c``), which reads the keys and values of the slots
    some query of the row sees and skips the others (a shorter row's padding, the holes of ragged acceptance, a
    dead row); else, or for a call it does not cover (another head layout, a mask that is not additive per row,
    dropout, a relative bias, soft-capping, sinks), transformers' ``sdpa`` attention on the same inputs. 16 rows of code
    prompts, 6 layers of 288 slots (36% of them padding): 8.3 ms against SDPA's 13.8
    (docs/journal/2026-11-28-attention-live-slots.md, "Attention
    over the live slots")."""
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
    with SDPA for the translation pair; docs/journal/linear-kernels.md, "The blocked kernel as a torch operator").
    A compiled encoder-decoder model's encoder is traced with ``eager`` (``CompiledSeq2Seq.warm_encoder``). Only the
    trace sees it: the eager step and the prefill keep the model's own."""
    kept = getattr(model.config, "_attn_implementation", None)
    seq2seq = getattr(model.config, "is_encoder_decoder", False)
    if (kept in (("sdpa", "eager") if seq2seq else ("sdpa",)) and getattr(model, "_supports_sdpa", False)
            and model.dtype == torch.float32 and input_device(model).type == "cpu"
            and kernels.mode() != "off" and kernels.blocked_op()):
        return "specdec"
    return "eager" if seq2seq else kept


_PACKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # an installed weight's data_ptr -> its pack


@torch.library.custom_op("specdec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [n, in] @ ``weight``.T (+ bias) by oneDNN on the installed layer's prepacked weight
    (``specdec.kernels``)."""
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
# (docs/journal/2026-11-28-translation-join.md, "The translation pair's join").
EAGER_BLOCKED_ROWS = 32


def quantized_traced(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """A torchao int8 / int4 weight-only ``layer`` of ``x`` [..., in] traced as ``specdec::quantized_linear`` on the
    layer's packed copy (``_specdec_blocked``, ``_specdec_scales``, ``_specdec_zeros``: ``qlinear.Packed``'s tensors):
    the graph reads the packed bytes, never torchao's tensor (whose product would dequantise the weight)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.specdec.quantized_linear(rows, layer._specdec_blocked, layer._specdec_scales, layer._specdec_zeros,
                                             layer.bias, layer.out_features, layer._specdec_group)
    return out.reshape(*x.shape[:-1], layer.out_features)


def _quantized(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds a packed copy of a torchao weight for ``specdec::quantized_linear``."""
    return getattr(module, "_specdec_group", None) is not None


def _traced_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A compiled model's linear layer: traced as its operator where the layer holds its copy (``_specdec_blocked``:
    ``quantized_traced`` for a torchao weight, whose tensor the trace never reads, else ``blocked_traced``), else as
    ``traced_linear``; run eagerly by that operator too while specdec decodes (``kernels.active``): a quantized layer
    by ``qlinear``'s forward (its packed copy is the buffers', re-packed there if the weight changed), a float one on
    up to ``EAGER_BLOCKED_ROWS`` rows while the copy is the weight's (``refresh_blocked`` re-lays it as each decoding
    call starts: a weight changed since then falls back), else as ``specdec.kernels`` says."""
    blocked = getattr(self, "_specdec_blocked", None)
    quantized = _quantized(self)
    if torch.compiler.is_compiling() and x.dtype == torch.float32 and x.device.type == "cpu":
        if quantized:
            return quantized_traced(x, self)
        if self.weight.dtype == torch.float32:
            if blocked is not None:
                return blocked_traced(x, blocked, self.bias, self.out_features)
            return traced_linear(x, self.weight, self.bias, self._specdec_packed)
    if quantized:
        return qlinear._forward(self, x)
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
    held as a non-persistent buffer (``_specdec_blocked``: not in the state dict, refreshed by ``refresh_blocked``),
    and every torchao int8 / int4 weight-only linear that ``specdec.qlinear`` installed on is traced as
    ``specdec::quantized_linear`` on its packed copy, held the same way (its scales and zero points beside it); else
    the layers that ``specdec.kernels`` installs on are traced in the kernels' formulation (``traced_linear``)."""
    ours = kernels.install(model)
    blocked = (kernels.mode() != "off" and kernels.available()
               and any(kernels._eligible(module) for module in model.modules())  # no build for a GPU or bf16 model
               and kernels.blocked_op())
    found = False
    for module in model.modules():
        traced = _traced(module)  # e.g. a deep copy's
        if not traced and qlinear._ours(module):  # installed only where the operators load (qlinear.install)
            _relay(module, kernel_key(module))
            traced = True
        elif blocked and not traced and kernels._eligible(module):
            _relay(module, kernel_key(module))
            packed = getattr(module, "_specdec_packed", None)
            if packed is not None and packed.many == "blocked":  # the eager kernel of many rows shares the copy
                packed.weight, packed.key = module._specdec_blocked, (*kernels.weight_key(module.weight), "blocked")
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
    """The layers of ``model`` that hold a copy of their weight in their operator's layout (``trace_kernels``)."""
    return [m for m in model.modules() if "_specdec_blocked" in m._buffers]


def traced_operators(layers: list[torch.nn.Linear]) -> list[str]:
    """The operators ``layers`` (``blocked_layers``) are traced as, each named once, for the reports."""
    return sorted({"specdec::quantized_linear" if _quantized(m) else "specdec::blocked_linear" for m in layers})


def kernel_key(module: torch.nn.Linear) -> tuple:
    """What a layer's copy of its weight is kept current by: its torchao tensor's data (``qlinear``) or its weight's
    storage and version (``kernels.weight_key``)."""
    if qlinear.form(module.weight) is not None:
        return qlinear._key(module.weight)
    return kernels.weight_key(module.weight)


def _relay(module: torch.nn.Linear, key: tuple) -> None:
    """Lay ``module``'s weight out for its operator into its buffers: in place where the layout is the one the
    compiled graphs were traced for (they keep their inputs), else as new buffers (no longer, or now, bfloat16 pairs:
    another layout, which the graphs are traced again for); int4 zero points that were all zero when traced and are
    not now raise (the graphs do not read them). A quantized layer's eager forward then reads the same packed copy
    (``qlinear``'s ``_specdec_qpacked``)."""
    if qlinear.form(module.weight) is not None:
        packed = qlinear.Packed(module.weight)  # its own data, detached (not the subclass: inference mode)
        copies = {"_specdec_blocked": packed.weight, "_specdec_scales": packed.scales, "_specdec_zeros": packed.zeros}
        module._specdec_group = packed.group
    else:
        packed = None
        copies = {"_specdec_blocked": kernels.blocked_copy(module.weight.detach(), kernels.blocked().lanes)}
    for name, copy in copies.items():
        kept = module._buffers.get(name)
        if name == "_specdec_zeros" and kept is None and copy is not None and name in module._buffers:
            raise RuntimeError("an int4 weight's zero points are no longer all zero since its model was compiled, "
                               "and its compiled steps were traced without them: load and compile it again")
        if name not in module._buffers:
            module.register_buffer(name, copy, persistent=False)
        elif kept is not None and copy is not None and kept.shape == copy.shape and kept.dtype == copy.dtype:
            kept.copy_(copy)
        else:
            setattr(module, name, copy)
    if packed is not None:
        packed.weight, packed.scales, packed.zeros = (module._buffers[n] for n in copies)
        module._specdec_qpacked = (key, packed)
    module._specdec_blocked_key = key


@torch.inference_mode()
def refresh_blocked(layers: list[torch.nn.Linear]) -> None:
    """Re-lay the copy of every layer of ``layers`` whose weight changed since (a new tensor or an in-place write):
    called as each decoding call's static cache is made, so a call reads the weights as they are when it starts."""
    for module in layers:
        if module._specdec_blocked_key != (key := kernel_key(module)):
            _relay(module, key)
