"""Quantized weights: the scheme, the on-disk codec, the scale search, the runtime linear layer.

``docs/format.md`` ("Quantized tensors") is the byte-level spec of what ``codec`` writes; the
store's packer calls ``quantize``, the model binder swaps ``nn.Linear`` for ``QuantLinear``.
"""
from .codec import QuantizedTensor, dequantize, pack_int4, quantize, unpack_int4
from .scheme import GRANULARITIES, GROUP_SIZES, SCHEMES, QuantSpec

__all__ = ["GRANULARITIES", "GROUP_SIZES", "SCHEMES", "QuantSpec", "QuantizedTensor", "dequantize",
           "pack_int4", "quantize", "unpack_int4"]
