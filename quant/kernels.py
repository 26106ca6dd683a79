"""The GPU weight-only matmul: ``y = x @ dequantize(codes, scales).T`` in one Triton kernel that
reads the stored layout (docs/format.md) directly -- no per-call dequantized copy of the weight.

Each program computes a ``BLOCK_M x BLOCK_N`` tile of ``y`` over one ``1/SPLIT_K`` share of K;
per K step it loads the codes of ``BLOCK_N`` rows, turns them into ``code * scale`` in float32,
rounds that once to the activation dtype (the same values the CPU path's ``dequantize`` gives) and
feeds the tensor cores (``tl.dot``, float32 accumulation). int4 bytes are not interleaved in
registers: the even and odd columns of ``x`` are loaded apart and meet the low and high nibbles.
Split-K partial sums go to a float32 ``[SPLIT_K, M, N]`` buffer summed by torch afterwards --
never atomics -- so every run gives the same bits. Tile shapes are a fixed function of the
problem shape (no autotuning, whose timing-dependent choice would change the bits between runs).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs: QuantLinear dequantizes there instead
    triton = None

if triton is not None:
    @triton.jit
    def _qmm(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, stride_xm, k_per_split,
             BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * k_per_split
        groups = K // GROUP if GROUP > 0 else 1
        if GROUP == 0:
            scale_t = tl.load(s_ptr).to(tl.float32)
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            if GROUP > 0:
                s = tl.load(s_ptr + offs_n * groups + k0 // GROUP, mask=mask_n, other=0.0)
                s = s.to(tl.float32)[None, :]
            else:
                s = scale_t
            if BITS == 8:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                            mask=mask_m[:, None], other=0.0)
                q = tl.load(q_ptr + offs_n[None, :] * K + offs_k[:, None], mask=mask_n[None, :],
                            other=0)
                w = (q.to(tl.float32) * s).to(x.dtype)
                acc += tl.dot(x, w, input_precision=PRECISION)
            else:
                offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                b = tl.load(q_ptr + offs_n[None, :] * (K // 2) + offs_b[:, None],
                            mask=mask_n[None, :], other=0).to(tl.int32)
                x_even = tl.load(x_ptr + offs_m[:, None] * stride_xm + 2 * offs_b[None, :],
                                 mask=mask_m[:, None], other=0.0)
                x_odd = tl.load(x_ptr + offs_m[:, None] * stride_xm + 2 * offs_b[None, :] + 1,
                                mask=mask_m[:, None], other=0.0)
                w_lo = (((b & 15) - 8).to(tl.float32) * s).to(x_even.dtype)
                w_hi = (((b >> 4) - 8).to(tl.float32) * s).to(x_even.dtype)
                acc += tl.dot(x_even, w_lo, input_precision=PRECISION)
                acc += tl.dot(x_odd, w_hi, input_precision=PRECISION)
        y = y_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(y, acc, mask=mask_m[:, None] & mask_n[None, :])


def block_k_for(K: int, group: int) -> int | None:
    """The K step: one scale group (per_block), else the largest of 128/64/32 dividing K; None
    when the kernel cannot take this K (the caller dequantizes instead)."""
    if group:
        return group
    return next((b for b in (128, 64, 32) if K % b == 0), None)


def supports(x: torch.Tensor, K: int, group: int) -> bool:
    return (triton is not None and x.is_cuda and block_k_for(K, group) is not None
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def tiles(M: int, N: int, K: int, group: int, sms: int = 132) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) for a problem: a pure function of the shape."""
    block_k = block_k_for(K, group)
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    block_n = 32 if M <= 16 else 64
    tiles_mn = _cdiv(M, block_m) * _cdiv(N, block_n)
    steps = K // block_k
    split = 1
    # Enough programs to fill the GPU twice over while each still covers >= 4 K steps.
    while tiles_mn * split < 2 * sms and steps % (split * 2) == 0 and steps // (split * 2) >= 4:
        split *= 2
    return block_m, block_n, block_k, split


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quant_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int, group: int,
                 N: int, K: int) -> torch.Tensor:
    """``x [M, K] @ W.T`` -> ``[M, N]`` in ``x.dtype``; ``codes``/``scales`` in the stored layout."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M = x.shape[0]
    block_m, block_n, block_k, split = tiles(M, N, K, group)
    out = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    grid = (_cdiv(M, block_m), _cdiv(N, block_n), split)
    _qmm[grid](x, codes, scales, out, M, N, K, x.stride(0), K // split,
               BITS=bits, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
               PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    y = out[0] if split == 1 else out.sum(0)
    return y.to(x.dtype)
