"""Quantize a linear weight into the on-disk layout, and back.

Layout (docs/format.md, "Quantized tensors"): for a weight of shape [N, K] (out, in)

* int8_symmetric: ``data`` int8 [N, K], row-major, two's complement;
* int4_symmetric: ``data`` uint8 [N, K/2], row-major; byte j of a row holds column 2j in its low
  nibble and column 2j+1 in its high nibble, each stored as code + 8 (0..15 for codes -8..7);
* ``scales`` float16, [N, K/group_size] (per_block: group = group_size consecutive columns of a
  row) or [1] (per_tensor);
* value = code x scale (the scale may be negative), computed in float32 and rounded once to the tensor's compute dtype.

The scale of each group is searched, not taken from the absolute maximum: round-to-nearest with
``absmax / qmax`` wastes code points on one outlier and never uses the code -8 (-128). ``quantize``
tries a grid of clipped scales -- ratios of ``absmax / qmax``, and ratios of ``absmax / -qmin``
signed so that the group's extreme lands on the most negative code (a negative scale when the
extreme is positive) -- each rounded to float16 first, so the scale chosen is the scale stored,
and keeps per group the one with the smallest squared reconstruction error; then refines it with
least squares on the chosen codes (scale = <w, q> / <q, q>), kept only where the error drops.
No calibration data; ratio 1.0 of ``absmax / qmax`` (plain round-to-nearest) is a candidate, so a
group never ends worse than round-to-nearest. Rounding is half-to-even (``torch.round``); it is a
packing choice, not part of the format.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .scheme import QuantSpec

_F16_TINY = float(torch.finfo(torch.float16).tiny)
_F16_MAX = float(torch.finfo(torch.float16).max)
# Clip ratios tried per group (fractions of absmax / qmax). int8 has 255 levels: clipping costs
# more on the outliers than it gains on the rest (measured: +0.16 % perplexity per_tensor with a
# 0.9..1.0 grid, +0.01 % without), so int8 only tries the unclipped scales.
_RATIOS = {4: [1.0 - 0.025 * i for i in range(21)], 8: [1.0]}
_LS_STEPS = 2
_CHUNK_ELEMENTS = 1 << 24   # groups are searched in chunks of about this many weights


@dataclass
class QuantizedTensor:
    """A quantized [N, K] weight: ``data`` and ``scales`` in the on-disk layout (often views into a
    block payload), and ``dtype``, the dtype it is computed in."""

    spec: QuantSpec
    shape: tuple
    data: torch.Tensor      # int8 [N, K] or uint8 [N, K/2]; int32 tiles (layout below)
    scales: torch.Tensor    # float16 [N, K/g] or [1]; bfloat16 [K/g', N, 2] (layout below)
    dtype: torch.dtype = torch.float32
    # "rows": the stored layout above. "int4_cuda_tiles": int4 held by the host tier in torch's
    # CUDA int4 kernel's layout (``int4pack.cuda_layout``, scales as its bfloat16 (scale, 0)
    # pairs over groups of g'); ``kernel`` is then that kernel's (inner_k_tiles, g').
    layout: str = "rows"
    kernel: tuple | None = None

    def dequantize(self, dtype=None) -> torch.Tensor:
        data, scales, spec = self.rows()
        return dequantize(data, scales, spec, self.shape, dtype or self.dtype)

    def rows(self) -> tuple:
        """(codes, scales, spec) in the stored row layout; for the tile layout, new tensors with
        the scales as the kernel holds them (bfloat16 values) and the kernel's groups."""
        if self.layout == "rows":
            return self.data, self.scales, self.spec
        from . import int4pack

        N, K = self.shape
        data = int4pack.codes_from_cuda_layout(self.data, N, K)
        group = self.kernel[1]
        return data, self.scales[..., 0].t(), QuantSpec(self.spec.scheme, "per_block", group)

    @property
    def nbytes(self) -> int:
        return (self.data.numel() * self.data.element_size() +
                self.scales.numel() * self.scales.element_size())


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int codes in -8..7, [N, K] -> uint8 [N, K/2] (low nibble: even column)."""
    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int8 codes [N, K]."""
    lo = (packed & 15).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def codes(data: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The int8 codes [N, K] of ``data`` in either layout."""
    return unpack_int4(data) if spec.bits == 4 else data.view(torch.int8)


def dequantize(data: torch.Tensor, scales: torch.Tensor, spec: QuantSpec, shape,
               dtype=torch.float32) -> torch.Tensor:
    """The [N, K] weight in ``dtype``: code x scale in float32, rounded once to ``dtype``."""
    rows, cols = shape
    q = codes(data, spec).to(torch.float32)
    s = scales.to(torch.float32)
    if spec.granularity == "per_tensor":
        w = q * s.reshape(())
    else:
        w = (q.view(rows, cols // spec.group_size, spec.group_size) * s.unsqueeze(-1)).view(rows, cols)
    return w.to(dtype)


def _as_f16(s: torch.Tensor) -> torch.Tensor:
    """Scales rounded to the float16 values they will be stored as (kept in float32); the
    magnitude kept within float16's normal range, the sign kept."""
    mag = s.abs().clamp(_F16_TINY, _F16_MAX)
    return torch.where(s < 0, -mag, mag).to(torch.float16).to(torch.float32)


def _error(x: torch.Tensor, s: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    q = torch.round(x / s[:, None]).clamp_(qmin, qmax)
    return q.mul_(s[:, None]).sub_(x).square_().sum(1)


def search_scales(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """float32 scales (float16-representable), one per row of ``x`` [G, g] (float32)."""
    qmin, qmax = spec.qmin, spec.qmax
    amax, where = x.abs().max(1)
    best = _as_f16(amax / qmax)
    best_err = _error(x, best, qmin, qmax)
    # The extreme of the group on the code of larger magnitude (-qmin > qmax): a negative scale
    # when the extreme is positive.
    sign = -torch.sign(x.gather(1, where[:, None])[:, 0])
    sign[sign == 0] = 1
    ratios = _RATIOS[spec.bits]
    candidates = ([amax * (r / qmax) for r in ratios[1:]] +
                  [sign * amax * (r / -qmin) for r in ratios])
    for c in candidates:
        s = _as_f16(c)
        err = _error(x, s, qmin, qmax)
        better = err < best_err
        best = torch.where(better, s, best)
        best_err = torch.where(better, err, best_err)
    for _ in range(_LS_STEPS):
        q = torch.round(x / best[:, None]).clamp_(qmin, qmax)
        qq = (q * q).sum(1)
        s = _as_f16(torch.where(qq > 0, (q * x).sum(1) / qq.clamp(min=1), best))
        err = _error(x, s, qmin, qmax)
        better = err < best_err
        best = torch.where(better, s, best)
        best_err = torch.where(better, err, best_err)
    return best


def quantize(weight: torch.Tensor, spec: QuantSpec, name: str = "tensor",
             search: bool = True) -> QuantizedTensor:
    """Quantize a 2-D weight (any float dtype, any device) into the on-disk layout (on CPU).

    ``search=False`` gives plain round-to-nearest with the absmax scale (the baseline the
    accuracy bench compares against)."""
    spec.check_shape(tuple(weight.shape), name)
    rows, cols = weight.shape
    w = weight.detach().to(torch.float32)
    if spec.granularity == "per_tensor":
        groups = w.reshape(1, -1)
    else:
        groups = w.reshape(-1, spec.group_size)
    if search:
        step = max(1, _CHUNK_ELEMENTS // groups.shape[1])
        scales = torch.cat([search_scales(groups[i:i + step], spec)
                            for i in range(0, groups.shape[0], step)])
    else:
        scales = _as_f16(groups.abs().amax(1) / spec.qmax)
    q = torch.round(groups / scales[:, None]).clamp_(spec.qmin, spec.qmax).to(torch.int8)
    q = q.reshape(rows, cols)
    data = pack_int4(q) if spec.bits == 4 else q
    scales16 = scales.to(torch.float16)
    scales16 = scales16.reshape(1) if spec.granularity == "per_tensor" else scales16.reshape(
        rows, cols // spec.group_size)
    return QuantizedTensor(spec=spec, shape=(rows, cols), data=data.contiguous().cpu(),
                           scales=scales16.contiguous().cpu(), dtype=weight.dtype)


def quantized_bytes(t, source, device="cpu") -> tuple[bytes, bytes]:
    """(codes, scales) of a stored tensor map ``t`` (with its ``quant`` map) quantized from
    ``source``, the tensor's bytes in its source dtype: the bytes docs/format.md lays out, as the
    packer writes them (and the host tier, for a store quantized as it is loaded)."""
    from ..store.views import TORCH_DTYPES

    weight = torch.frombuffer(source, dtype=TORCH_DTYPES[t.quant["dtype"]]).view(tuple(t.shape))
    qt = quantize(weight.to(device), QuantSpec.from_dict(t.quant), t.name)
    return qt.data.numpy().tobytes(), qt.scales.numpy().astype("<f2").tobytes()
