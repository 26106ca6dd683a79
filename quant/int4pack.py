"""torch's own int4 weight-only kernels (tinygemm) over our int4 codes: the small-M path.

``torch.ops.aten._weight_int4pack_mm`` (CUDA, bfloat16 activations) and
``_weight_int4pack_mm_for_cpu`` (CPU; bfloat16, float16 or float32) compute
``y = x @ W.T`` with ``W[n, k] = (q[n, k] - 8) * scale[k // g, n] + zero[k // g, n]``, ``q`` an
unsigned nibble 0..15 held in a kernel-specific tile layout. Our on-disk int4 (docs/format.md) is
symmetric and stores each code as the nibble ``code + 8``: so ``q`` *is* our nibble, ``scale`` our
float16 scale and ``zero`` 0 -- an exact mapping of the codes. The one rounding added: the kernel
takes its scales in the activation dtype, so a bfloat16 model's float16 scales are rounded to
bfloat16 (relative error <= 2^-9 per group, the size of the bfloat16 rounding the dequantized
weight itself gets); float16 and float32 activations keep the scales exact.

The kernels' layouts are *derived* from the stored codes, never stored:

* CUDA: ``[N/8, K/(inner_k_tiles*16), 32, inner_k_tiles/2]`` int32, the m16n8k16 tensor-core
  layout that ``_convert_weight_to_int4pack`` writes (aten/src/ATen/native/cuda/int4mm.cu,
  ``matrix_to_m16n8k16_Bint4_layout``). ``cuda_layout`` builds it with plain tensor ops, so it
  runs -- and is tested -- on the CPU too, and could run wherever the codes are;
* CPU: what ``_convert_weight_to_int4pack_for_cpu`` returns from the ``[N, K]`` int32 nibbles.

``plan`` says whether a layer's shape and dtype fit the kernels (N a multiple of 8 on CUDA, 16 on
the CPU; K a multiple of 32; group 32/64/128, or per_tensor with the one scale repeated over groups
of 128/64/32) and otherwise why not; the caller then keeps its other path.
"""
from __future__ import annotations

import torch

from .scheme import QuantSpec

# tinygemm's kernels take group sizes 32..256; our per_block groups are 32/64/128.
_KERNEL_GROUPS = (128, 64, 32)


def plan(device_type: str, dtype: torch.dtype, spec: QuantSpec, N: int, K: int):
    """``(inner_k_tiles, group)`` for the kernel on ``device_type``, or a str saying why it cannot
    take this layer (the caller uses its other path)."""
    if spec.bits != 4:
        return "int8 codes (torch's int4 kernels take int4 only)"
    if device_type == "cuda":
        if dtype != torch.bfloat16:
            return f"{dtype} activations (torch's CUDA int4 kernel takes bfloat16 only)"
        n_multiple = 8
    elif device_type == "cpu":
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"{dtype} activations"
        n_multiple = 16
    else:
        return f"device type {device_type}"
    if N % n_multiple:
        return f"N = {N} output features, not a multiple of {n_multiple}"
    inner = next((t for t in (8, 4, 2) if K % (t * 16) == 0), None)
    if inner is None:
        return f"K = {K} input features, not a multiple of 32"
    if spec.granularity == "per_block":
        group = spec.group_size
    else:
        group = next(g for g in _KERNEL_GROUPS if K % g == 0)
    return inner, group


def nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Stored int4 bytes uint8 [N, K/2] -> the nibbles ``code + 8`` as uint8 [N, K] (column order)."""
    return torch.stack((codes & 15, codes >> 4), dim=-1).reshape(codes.shape[0], -1)


def cuda_layout(codes: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """The int32 ``[N/8, K/(inner_k_tiles*16), 32, inner_k_tiles/2]`` tensor that
    ``torch.ops.aten._convert_weight_to_int4pack`` makes for the same weight, built from our
    stored bytes on their own device.

    Per int4mm.cu: lane ``t`` of n-tile ``nt`` holds row ``nt*8 + t//4``; the int32 at inner pair
    ``i`` of outer k-tile ``ko`` covers the 32 columns from ``c0 = (ko*inner_k_tiles + 2i) * 16``
    and holds, from bit 0 up, the nibbles of columns ``c0 + 2r + 8a + b`` (``r = t % 4``) in the
    order b = 0, a = 0..3, then b = 1, a = 0..3. Columns ``c0 + 2r + 8a`` and ``+ 1`` are the low
    and high nibble of our byte ``4a + r`` of the chunk, so the word's bytes are, low to high,
    ``lo(B0) | lo(B1) << 4``, ``lo(B2) | lo(B3) << 4``, ``hi(B0) | hi(B1) << 4``,
    ``hi(B2) | hi(B3) << 4`` with ``Ba`` = byte ``4a + r``: byte-wide operations, then one
    permutation of whole words.
    """
    N, K = codes.shape[0], codes.shape[1] * 2
    x = codes.reshape(N, K // 32, 2, 2, 4)          # row, chunk, a // 2, a % 2, r
    even, odd = x[:, :, :, 0], x[:, :, :, 1]         # B0, B2 | B1, B3
    out = torch.empty(N, K // 32, 4, 2, 2, dtype=torch.uint8, device=codes.device)
    torch.bitwise_or(even & 15, odd << 4, out=out[:, :, :, 0].permute(0, 1, 3, 2))
    torch.bitwise_or(even >> 4, odd & 0xF0, out=out[:, :, :, 1].permute(0, 1, 3, 2))
    words = out.view(N, K // 32, 16).view(torch.int32)          # row, chunk, r (little-endian)
    words = words.view(N // 8, 8, K // (inner_k_tiles * 16), inner_k_tiles // 2, 4)
    #                  nt      row ko                          i                   r
    return words.permute(0, 2, 1, 4, 3).reshape(N // 8, K // (inner_k_tiles * 16), 32,
                                                 inner_k_tiles // 2)


def codes_from_cuda_layout(words: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """The inverse of ``cuda_layout``: the stored int4 bytes uint8 [N, K/2] of a tile layout."""
    inner_k_tiles = words.shape[-1] * 2
    nib = words.contiguous().view(torch.uint8).reshape(*words.shape[:-1], inner_k_tiles // 2, 4)
    nib = torch.stack((nib & 15, nib >> 4), dim=-1)            # ..., i, byte, lo/hi -> p = 4b + a
    nib = nib.view(N // 8, K // (inner_k_tiles * 16), 8, 4, inner_k_tiles // 2, 2, 4)
    #               nt   ko                           row r  i                   b  a
    nib = nib.permute(0, 2, 1, 4, 6, 3, 5).reshape(N, K)      # nt, row, ko, i, a, r, b
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def cpu_layout(codes: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """What ``_weight_int4pack_mm_for_cpu`` takes for our stored bytes."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles(codes).to(torch.int32),
                                                               inner_k_tiles)


def layout(codes: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """The kernel layout of the codes' own device."""
    if codes.device.type == "cuda":
        return cuda_layout(codes, inner_k_tiles)
    return cpu_layout(codes, inner_k_tiles)


def scales_and_zeros(scales: torch.Tensor, spec: QuantSpec, shape, group: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """Our float16 scales [N, K/g] (or [1]) -> the kernels' ``[K/group, N, 2]`` (scale, zero 0) in
    ``dtype``; per_tensor repeats the one scale over every group."""
    N, K = shape
    s = scales.to(dtype)
    if spec.granularity == "per_tensor":
        s = s.reshape(1, 1).expand(K // group, N)
    else:
        s = s.t()
    return torch.stack((s, torch.zeros_like(s)), dim=-1).contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """``x [M, K] @ W.T`` through torch's int4 kernel of ``x``'s device."""
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, group, sz)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)

