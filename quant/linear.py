"""``QuantLinear``: the module a quantized weight is bound to, swapped in for ``nn.Linear`` when the
model is bound (gpt-fast's handler style), so the model code never branches on precision.

Its codes and scales are the views ``store.views.block_tensors`` gives (host arena, GPU arena or a
streaming slot): nothing is copied at bind time. The matmul is chosen per call by the number of
rows ``M`` of the input (tokens x batch), the same way for every layer wherever its bytes live:

* decode rows on CUDA when ``gemv.choose`` says so (M <= ``gemv.INT4_MAX_M`` / ``INT8_MAX_M``;
  both 0, off, by default: measured slower than the kernels below): our Triton GEMV kernels
  (``quant.gemv``) -- int4 on the tile layout (as bound, or derived as below), int8 on the stored
  rows; everything below is for the other cases;
* one row of int4 in the tile layout on CUDA with bfloat16 activations and group 128, when
  ``cuda_gemv.ENABLED``: the CUDA C++ GEMV (``quant.cuda_gemv``; compiled at the first call, torch's
  int4 kernel below where it cannot be, logged once);
* int4 that the host tier holds in torch's CUDA tile layout (``quant.host_tier.TiledStore``;
  ``layout`` ``int4_cuda_tiles``): on CUDA with bfloat16 activations, every M runs
  ``_weight_int4pack_mm`` on the bound bytes -- nothing derived, kept or synced, so the call is
  capturable in a CUDA graph; elsewhere it dequantizes from the tiles and multiplies;
* int4 and ``M <= SMALL_M`` (decode): torch's own int4 kernel (``int4pack``; CUDA with bfloat16
  activations, CPU with any float dtype), over its tile layout derived from the stored codes. A
  layer bound to fixed bytes (resident: host or GPU arena) derives it at its first such call and
  keeps it (plus the int4 bytes of the layer again, on the layer's device; ``derived_nbytes``); a
  layer bound to a streaming slot, whose bytes change every pass, derives it on every call.
  Shapes or dtypes the kernel refuses (``int4pack.plan``) take the path below, logged once each;
* otherwise: CUDA -> the fused Triton kernel (``kernels.quant_matmul``), measured faster than
  torch's at M = 128 on the H200; CPU (and CUDA shapes Triton refuses) -> dequantize to the compute
  dtype and multiply, bit-identical to plain transformers on the dequantized weights.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from . import cuda_gemv, gemv, int4pack, kernels
from .codec import QuantizedTensor, dequantize

log = logging.getLogger(__name__)

# Rows up to which int4 layers use torch's int4 kernel: on the H200 it beat bf16 and our Triton
# kernel 2-7x at M = 1 and 8 and lost 2x to Triton at M = 128 (docs/benchmarks.md); its tiles
# are 16 rows high.
SMALL_M = 16
_logged: set = set()


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as int8/int4 codes and float16 scales."""

    def __init__(self, in_features: int, out_features: int, quantized: QuantizedTensor,
                 bias: nn.Parameter | None = None, fixed: bool = True):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_parameter("bias", bias)
        self.bind(quantized, fixed)

    def bind(self, quantized: QuantizedTensor, fixed: bool = True) -> None:
        """Point the layer at (new) codes and scales; they are views, never copied. ``fixed``:
        the bytes under them stay the same while bound (resident), so a kernel layout derived
        from them may be kept; False for a streaming slot."""
        if tuple(quantized.shape) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight of shape {list(quantized.shape)} bound to a "
                             f"{self.in_features}->{self.out_features} linear layer")
        self.spec = quantized.spec
        self.compute_dtype = quantized.dtype
        self.layout, self.kernel = quantized.layout, quantized.kernel
        # Tile layout: (inner_k_tiles, group) of torch's CUDA int4 kernel, whose operands the
        # codes and scales already are.
        self._tiles_group = quantized.kernel[1] if quantized.layout != "rows" else 0
        # inner_k_tiles of the tile layout ([N/8, K/(16 inner), 32, inner/2] int32)
        self.layout_inner = quantized.data.shape[-1] * 2 if self._tiles_group else None
        self.register_buffer("codes", quantized.data, persistent=False)
        self.register_buffer("scales", quantized.scales, persistent=False)
        self.fixed = fixed
        self._int4 = {}         # (device, dtype) -> plan, and its derived layout when fixed

    @property
    def derived_nbytes(self) -> int:
        """Bytes of the kernel layouts this layer keeps (fixed bytes only)."""
        return sum(t.numel() * t.element_size() for entry in self._int4.values()
                   if isinstance(entry, tuple) for t in entry[2:])

    @property
    def weight_nbytes(self) -> int:
        return (self.codes.numel() * self.codes.element_size() +
                self.scales.numel() * self.scales.element_size())

    def dequantized_weight(self, dtype=None) -> torch.Tensor:
        """The weight as the CPU path computes it (a new tensor; tests and references)."""
        shape = (self.out_features, self.in_features)
        if self.layout != "rows":
            return QuantizedTensor(self.spec, shape, self.codes, self.scales, self.compute_dtype,
                                   self.layout, self.kernel).dequantize(dtype)
        return dequantize(self.codes, self.scales, self.spec, shape, dtype or self.compute_dtype)

    def _int4_kernel(self, x: torch.Tensor):
        """(packed, scales_and_zeros, group) for torch's int4 kernel, or None when it cannot
        take this layer (logged once per reason)."""
        key = (x.device, x.dtype)
        entry = self._int4.get(key)
        if entry is None:
            K, N = self.in_features, self.out_features
            entry = int4pack.plan(x.device.type, x.dtype, self.spec, N, K)
            if isinstance(entry, str):
                if entry not in _logged:
                    _logged.add(entry)
                    log.info("torch's int4 kernel not used for %s: %s", self.extra_repr(), entry)
            elif self.fixed:
                entry = entry + self._derive(x, entry)
            self._int4[key] = entry
        if isinstance(entry, str):
            return None
        packed, sz = entry[2:] if self.fixed else self._derive(x, entry)
        return packed, sz, entry[1]

    def _derive(self, x, plan) -> tuple:
        inner, group = plan
        shape = (self.out_features, self.in_features)
        return (int4pack.layout(self.codes, inner),
                int4pack.scales_and_zeros(self.scales, self.spec, shape, group, x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        K, N = self.in_features, self.out_features
        M = x.numel() // K if K else 0
        if self._tiles_group:
            if gemv.choose(x.device.type, x.dtype, 4, M, N, K, self._tiles_group,
                           self.layout_inner) is None:
                # Decode rows: our kernel on the bound tiles (capturable, nothing derived).
                y = gemv.int4_tiles_matmul(x.reshape(-1, K), self.codes, self.scales,
                                           self._tiles_group, N, K).view(*x.shape[:-1], N)
                return y if self.bias is None else y + self.bias
            if (cuda_gemv.ENABLED and self.bias is None
                    and cuda_gemv.supports(x, N, K, self._tiles_group) is None):
                # One row: the CUDA C++ GEMV on the bound tiles (capturable, nothing derived).
                y = cuda_gemv.layer_matmul(x.reshape(1, K), self.codes, self.scales, N, K)
                if y is not None:
                    return y.view(*x.shape[:-1], N)
            if x.is_cuda and x.dtype == torch.bfloat16:
                # The host tier's tile layout: the kernel's operands as bound, nothing derived, no
                # host sync, output shaped by x alone (capturable in a CUDA graph).
                y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, K).contiguous(), self.codes,
                                                       self._tiles_group, self.scales)
                y = y.view(*x.shape[:-1], N)
                return y if self.bias is None else y + self.bias
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        if self.spec.bits == 4 and x.numel() <= SMALL_M * K:
            kernel = self._int4_kernel(x)
            if kernel is not None:
                packed, sz, group = kernel
                if gemv.choose(x.device.type, x.dtype, 4, M, N, K, group,
                               packed.shape[-1] * 2 if x.is_cuda else None) is None:
                    y = gemv.int4_tiles_matmul(x.reshape(-1, K), packed, sz, group, N, K)
                else:
                    y = int4pack.matmul(x.reshape(-1, K).contiguous(), packed, sz, group)
                y = y.view(*x.shape[:-1], N)
                return y if self.bias is None else y + self.bias
        if self.spec.bits == 8 and gemv.choose(x.device.type, x.dtype, 8, M, N, K,
                                               self.spec.group_size) is None:
            y = gemv.int8_rows_matmul(x.reshape(-1, K), self.codes, self.scales,
                                      self.spec.group_size, N, K).view(*x.shape[:-1], N)
            return y if self.bias is None else y + self.bias
        if kernels.supports(x, K, self.spec.group_size):
            y = kernels.quant_matmul(x.reshape(-1, K), self.codes, self.scales, self.spec.bits,
                                     self.spec.group_size, N, K).view(*x.shape[:-1], N)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.spec.label()}")


def merge_tiles(modules) -> QuantLinear | str:
    """One ``QuantLinear`` computing the layers ``modules`` (same input) at once, their outputs side
    by side in order -- or why not (a string). Each must be int4 in the tile layout on fixed bytes,
    all alike (input size, spec, kernel tiles, dtype, device), their codes back to back in one
    storage (``quant.host_tier.tiled_block`` lays a block's codes out so): the merged codes are a
    view of them, nothing copied; the scales, ``[K/group, N, 2]`` each, are concatenated along N
    into a new tensor (about 1/16 of the codes' bytes; ``merged.scales`` is it), and so are the
    biases (all or none). Each output column is the same arithmetic as in its own layer's call (every
    kernel of ``forward`` computes a column from that column's codes and scales alone)."""
    first = modules[0] if modules else None
    if not modules or not all(type(m) is QuantLinear for m in modules):
        return "not all quantized layers"
    if not all(m._tiles_group and m.fixed for m in modules):
        return "not all in the tile layout on fixed bytes"
    key = (first.in_features, first.spec, first.kernel, first.compute_dtype, first.codes.device,
           first.codes.dtype, first.scales.dtype, first.codes.shape[1:], first.scales.shape[0])
    if any((m.in_features, m.spec, m.kernel, m.compute_dtype, m.codes.device, m.codes.dtype,
            m.scales.dtype, m.codes.shape[1:], m.scales.shape[0]) != key for m in modules):
        return "layers of different shapes or kinds"
    biases = [m.bias for m in modules]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return "biases on some layers only"
    ptr = first.codes.data_ptr()
    storage = first.codes.untyped_storage().data_ptr()
    for m in modules:
        if (not m.codes.is_contiguous() or m.codes.data_ptr() != ptr
                or m.codes.untyped_storage().data_ptr() != storage):
            return "codes not back to back"
        ptr += m.codes.numel() * m.codes.element_size()
    N = sum(m.out_features for m in modules)
    codes = first.codes.as_strided((N // 8, *first.codes.shape[1:]), first.codes.stride())
    scales = torch.cat([m.scales for m in modules], dim=1)
    merged = QuantizedTensor(first.spec, (N, first.in_features), codes, scales, first.compute_dtype,
                             first.layout, first.kernel)
    bias = None if biases[0] is None else nn.Parameter(
        torch.cat([b.detach() for b in biases]), requires_grad=False)
    return QuantLinear(first.in_features, N, merged, bias)


def bind_quantized(model: nn.Module, module_name: str, quantized: QuantizedTensor,
                   fixed: bool = True) -> QuantLinear:
    """Bind ``quantized`` as the weight of the linear layer ``module_name``: the first time, the
    ``nn.Linear`` is replaced by a ``QuantLinear`` keeping its bias; later, the codes are rebound.
    ``fixed``: as ``QuantLinear.bind``."""
    module = model.get_submodule(module_name)
    if isinstance(module, QuantLinear):
        module.bind(quantized, fixed)
        return module
    if not isinstance(module, nn.Linear):
        raise TypeError(f"{module_name}: a quantized weight needs an nn.Linear, found "
                        f"{type(module).__name__}")
    layer = QuantLinear(module.in_features, module.out_features, quantized,
                        module._parameters.get("bias"), fixed)
    parent_name, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    return layer


def derived_nbytes(model: nn.Module) -> int:
    """Bytes of the int4 kernel layouts the quantized layers of ``model`` keep beside the codes."""
    return sum(m.derived_nbytes for m in model.modules() if isinstance(m, QuantLinear))
