"""``QuantLinear``: the module a quantized weight is bound to, swapped in for ``nn.Linear`` when the
model is bound (gpt-fast's handler style), so the model code never branches on precision.

Its codes and scales are the views ``store.views.block_tensors`` gives (host arena, GPU arena or a
streaming slot): nothing is copied at bind time. CUDA inputs go through the fused Triton kernel
(``kernels.quant_matmul``); CPU inputs dequantize to the compute dtype and multiply.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .codec import QuantizedTensor, dequantize


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as int8/int4 codes and float16 scales."""

    def __init__(self, in_features: int, out_features: int, quantized: QuantizedTensor,
                 bias: nn.Parameter | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_parameter("bias", bias)
        self.bind(quantized)

    def bind(self, quantized: QuantizedTensor) -> None:
        """Point the layer at (new) codes and scales; they are views, never copied."""
        if tuple(quantized.shape) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight of shape {list(quantized.shape)} bound to a "
                             f"{self.in_features}->{self.out_features} linear layer")
        self.spec = quantized.spec
        self.compute_dtype = quantized.dtype
        self.register_buffer("codes", quantized.data, persistent=False)
        self.register_buffer("scales", quantized.scales, persistent=False)

    @property
    def weight_nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 2

    def dequantized_weight(self, dtype=None) -> torch.Tensor:
        """The weight as the CPU path computes it (a new tensor; tests and references)."""
        return dequantize(self.codes, self.scales, self.spec, (self.out_features, self.in_features),
                          dtype or self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        K, N = self.in_features, self.out_features
        if kernels.supports(x, K, self.spec.group_size):
            y = kernels.quant_matmul(x.reshape(-1, K), self.codes, self.scales, self.spec.bits,
                                     self.spec.group_size, N, K).view(*x.shape[:-1], N)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.spec.label()}")


def bind_quantized(model: nn.Module, module_name: str, quantized: QuantizedTensor) -> QuantLinear:
    """Bind ``quantized`` as the weight of the linear layer ``module_name``: the first time, the
    ``nn.Linear`` is replaced by a ``QuantLinear`` keeping its bias; later, the codes are rebound."""
    module = model.get_submodule(module_name)
    if isinstance(module, QuantLinear):
        module.bind(quantized)
        return module
    if not isinstance(module, nn.Linear):
        raise TypeError(f"{module_name}: a quantized weight needs an nn.Linear, found "
                        f"{type(module).__name__}")
    layer = QuantLinear(module.in_features, module.out_features, quantized,
                        module._parameters.get("bias"))
    parent_name, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    return layer
