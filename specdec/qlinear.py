"""Weight-only int8 and int4 products at the memory floor for decoding on the CPU (issue 71, item 3).

torchao's weight-only tensors (what ``specdec quantize`` writes and ``from_pretrained`` loads back) have no fast eager
CPU kernel: an ``Int8Tensor`` product converts the whole weight to float before ``torch.mm``, an
``IntxUnpackedToInt8Tensor`` product dequantises it; torch's own ``_weight_int8pack_mm`` and
``_weight_int4pack_mm_for_cpu`` are slow with float32 activations (the measurements:
docs/journal/2026-12-07-quantized-kernels.md). So specdec reads the quantized values itself: ``install(model)``
gives each torchao-quantized ``nn.Linear`` whose form the kernel knows (``form``) a forward that, inside
``kernels.active()`` (``Decoder.step``), calls the operator ``specdec::quantized_linear`` (``csrc/quantized_linear.c``,
built with the other kernels: ``kernels.blocked_op``) on a copy of ITS OWN quantized data re-laid for the kernel
(``pack``); outside ``active()`` the layer's own torchao forward runs (``generate``, the reference). A compiled
step (``specdec.compiled.ops``) traces the same layers as the same operator on the same packed copy, held there as
the layer's buffers, so the graph reads the packed bytes and never torchao's tensor.

- int8 (``Int8Tensor``, one scale per output channel, zero points all zero): the copy holds the same int8 values
  (the same bytes) and float32 scales;
- int4 (``IntxUnpackedToInt8Tensor`` with ``target_dtype=torch.int4``, groups of an even size, int8 zero points):
  the stored form keeps one value a byte (torchao 0.18's only int4 the CPU writes and reads back), the copy packs two
  a byte (eight a 32-bit word), so the kernel reads half the stored bytes; the layer then holds both (RAM: the stored
  tensor + the packed copy).

Contract: activations stay float32 (the model is unchanged); the products are those of the dequantised weights
(int8: ``x @ q.T * s``, as torchao's product; int4: ``(q - z) * s`` in float32, as torchao's ``dequantize_affine``)
up to float summation order, so greedy decoding equals the quantized model's own ``generate`` up to near ties and
sampling keeps its distribution (tests/test_quantized_kernels.py against float64). On a CPU with AVX-512 VNNI, int4
sums each group in integers: the group's activations rounded to fixed point (each moved by at most 2^-23 of the
group's largest, the size of float32's own rounding of the products and sums), the products and sums then exact
(``int4_pass``). ``SPECDEC_LINEAR=off`` installs nothing; another form keeps torchao's forward (``quantized.note``
says once where that is slow).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

LANES = 16  # output columns per block of the re-laid weight (``csrc/quantized_linear.c``'s QL)
PACK_ROWS = 64 * LANES  # output rows packed at once (multiple of LANES): bounds the temporaries
MAGIC = 2.0**23  # int4: the kernel reads a nibble v as the float 2^23 + v and subtracts 2^23 + z + 8 (exact)
_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> layers given the kernels
_ACTIVE: list[Callable[[], bool]] = [lambda: False]  # kernels' own test of ``active()`` (``install`` sets it)


def form(weight: object) -> str | None:
    """"int8" or "int4" where ``weight`` is a torchao weight-only tensor of a form the kernel computes exactly (float32
    results on the CPU, no activation quantisation, a 2-D weight), else None."""
    name = type(weight).__name__
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    if weight.dtype != torch.float32 or getattr(weight, "qdata", None) is None or weight.qdata.dtype != torch.int8:
        return None
    if name == "Int8Tensor":
        zero = weight.zero_point
        plain = all(getattr(weight, a, None) is None for a in ("act_quant_kwargs", "act_pre_scale"))
        per_row = list(weight.block_size) == [1, weight.shape[1]] and weight.scale.numel() == weight.shape[0]
        return "int8" if plain and per_row and (zero is None or not bool(zero.any())) else None
    if name == "IntxUnpackedToInt8Tensor":
        group = weight.block_size[-1]
        ok = (weight.target_dtype == torch.int4 and weight.activation_quantization is None
              and weight.block_size[0] == 1 and group % 8 == 0 and weight.shape[1] % group == 0
              and weight.zero_point.dtype == torch.int8)
        return "int4" if ok else None
    return None


def _columns(values: torch.Tensor, fill: float) -> torch.Tensor:
    """[N, ...] padded with ``fill`` to a whole number of blocks of ``LANES`` rows."""
    pad = -values.shape[0] % LANES
    return torch.cat((values, values.new_full((pad, *values.shape[1:]), fill))) if pad else values


class Packed:
    """A torchao weight's quantized data re-laid for ``specdec::quantized_linear`` (see ``csrc/quantized_linear.c``):
    ``weight`` (int8 [blocks, K, 16], or int4 eight a 32-bit word, int32 [blocks, K / 8, 16]), ``scales`` and (int4,
    where a zero point is not zero) ``zeros`` as float32, ``group`` (int4's group size, else 0), ``out_features``;
    read off the tensor's own ``qdata``, ``scale`` and ``zero_point``, never quantized again from float."""

    def __init__(self, weight: torch.Tensor) -> None:
        kind = form(weight)
        if kind is None:
            raise ValueError(f"{type(weight).__name__} is not a weight-only int8/int4 form the kernel takes")
        q, out_features, width = weight.qdata.detach(), weight.shape[0], weight.shape[1]
        self.out_features, self.bits = out_features, int(kind[3])
        if kind == "int8":
            self.group = 0
            self.zeros = None
            self.scales = _columns(weight.scale.detach().reshape(-1).float(), 0.0).contiguous()
            self.weight = _columns(q, 0).reshape(-1, LANES, width).transpose(1, 2).contiguous()  # [B, K, 16]
        else:
            self.group = int(weight.block_size[-1])
            shifts = torch.arange(0, 32, 4, dtype=torch.int32)
            self.weight = torch.empty(-(-out_features // LANES), width // 8, LANES, dtype=torch.int32)  # words
            for start in range(0, out_features, PACK_ROWS):  # a slice at a time: int32 temporaries of a whole head
                shifted = q[start:start + PACK_ROWS].to(torch.int32).add_(8)  # 0 .. 15
                nibbles = _columns(shifted, 8).reshape(-1, LANES, width // 8, 8).bitwise_left_shift_(shifts)
                block = start // LANES
                self.weight[block:block + nibbles.shape[0]] = nibbles.sum(-1, dtype=torch.int32).transpose(1, 2)
            self.scales = _columns(weight.scale.detach().float(), 0.0).t().contiguous()  # [K / G, 16 B]
            zero = weight.zero_point.detach()  # all zero (torchao's symmetric int4): none, a table lookup
            self.zeros = (_columns(zero.float(), 0.0) + (8 + MAGIC)).t().contiguous() if zero.any() else None

    @property
    def nbytes(self) -> int:
        """The bytes one product reads: the re-laid weight, its scales and zero points."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales, self.zeros) if t is not None)

    def __call__(self, rows: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``rows`` [n, K] float32 times the dequantised weight, transposed (+ bias): [n, out_features]."""
        return torch.ops.specdec.quantized_linear(rows, self.weight, self.scales, self.zeros, bias,
                                                  self.out_features, self.group)


def int4_pass(integer: bool) -> bool:
    """Choose int4's pass for this process: ``True`` the integer one (where the CPU has AVX-512 VNNI; elsewhere the
    float one runs either way), ``False`` the float one (nibbles converted to floats); returns the previous choice.
    For tests and benchmarks, which compare the two; the operators must be loaded (``kernels.blocked_op()``)."""
    import ctypes

    library = next(path for path in torch.ops.loaded_libraries if Path(path).name.startswith("blocked_op-"))
    flag = ctypes.c_int.in_dll(ctypes.CDLL(library), "specdec_q4_integer")
    previous, flag.value = bool(flag.value), int(integer)
    return previous


def _key(weight: torch.Tensor) -> tuple:
    return tuple((t.data_ptr(), t._version) for t in (weight.qdata, weight.scale))


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An installed layer's forward: the quantized kernel inside ``kernels.active()``, else torchao's (``F.linear``)."""
    weight, bias = self.weight, self.bias
    if (_ACTIVE[0]() and x.dtype is torch.float32 and x.is_cpu and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and x.requires_grad) and (bias is None or bias.dtype is torch.float32)):
        packed = vars(self).get("_specdec_qpacked")
        if packed is None or packed[0] != _key(weight):  # a new weight (loaded again, or written in place)
            packed = (_key(weight), Packed(weight))
            self._specdec_qpacked = packed
        rows = x.reshape(-1, x.shape[-1])
        return packed[1](rows, bias).reshape(*x.shape[:-1], packed[1].out_features)
    return F.linear(x, weight, bias)


def _ours(module: torch.nn.Module) -> bool:
    return getattr(vars(module).get("forward"), "__func__", None) is _forward


def eligible(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.Linear`` (its own forward, or ours) whose weight has a ``form``."""
    return (isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward
            and ("forward" not in vars(module) or _ours(module)) and form(module.weight) is not None)


def install(model: torch.nn.Module, mode: str, built: Callable[[], bool], active: Callable[[], bool]) -> int:
    """Give ``model``'s eligible layers the quantized kernel (``kernels.install`` calls it with ``SPECDEC_LINEAR``'s
    ``mode``, its ``blocked_op``, which builds the operators, and its test of ``active()``), unless the mode is off or
    the operators cannot be built here; the number of layers that have it. The copies are packed at the first product
    inside ``active()``. Layers of another quantized form keep torchao's forward, said once (``quantized.note``)."""
    from specdec import quantized

    _ACTIVE[0] = active
    layers = [m for m in model.modules() if eligible(m)] if mode != "off" and built() else []
    for m in layers:
        if not _ours(m):
            m.forward = types.MethodType(_forward, m)
    _INSTALLED[model] = len(layers)
    if not layers or any(form(w) is None for w in quantized._weights(model)):
        quantized.note(model)
    return len(layers)


def installed(model: torch.nn.Module) -> int:
    """How many of ``model``'s layers ``install`` gave the quantized kernel (0 where none, or not installed)."""
    return _INSTALLED.get(model, 0)


def any_installed() -> bool:
    """Whether a live model of this process has layers on the quantized kernel."""
    return any(count > 0 for count in _INSTALLED.values())


def bytes_read(module: torch.nn.Module) -> int | None:
    """The bytes an installed layer's kernel reads a product (its packed copy), None where it has none."""
    packed = vars(module).get("_specdec_qpacked")
    if packed is None and _ours(module):
        packed = (_key(module.weight), Packed(module.weight))
        module._specdec_qpacked = packed
    return None if packed is None else packed[1].nbytes
