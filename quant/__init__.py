"""Quantized weights: the scheme, the on-disk codec, the scale search, the runtime linear layer.

``docs/format.md`` ("Quantized tensors") is the byte-level spec of what ``codec`` writes; the
store's packer calls ``quantize``, the model binder swaps ``nn.Linear`` for ``QuantLinear``.

The codec's names are imported on first use (PEP 562): ``codec`` imports torch, and the daemon
reaches this package through ``quant.scheme`` at start -- importing torch there held its socket
and status tree back by ~1 s on the CI box and ~3.4 s on the GPU machines.
"""
from .scheme import GRANULARITIES, GROUP_SIZES, SCHEMES, QuantSpec

_CODEC = ("QuantizedTensor", "dequantize", "pack_int4", "quantize", "unpack_int4")

__all__ = ["GRANULARITIES", "GROUP_SIZES", "SCHEMES", "QuantSpec", *_CODEC]


def __getattr__(name):
    if name in _CODEC:
        from . import codec

        return getattr(codec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
