"""Weight-only int4/int8 matmul kernels for decode-sized inputs (Triton), and when the layers use
them (``choose``). **Off by default** (``INT4_MAX_M = INT8_MAX_M = 0``): measured slower than what the
layers run otherwise (torch's int4 kernel, tinygemm; the tiled Triton int8 kernel) -- the
tensor-core int4 kernel on the H200 (2026-12-02) at 0.087-0.357 of the copy rate at batch 1 by
default, 0.086-0.409 at its sweep's best, against tinygemm's 0.117-0.416, faster only at 8 rows on
14336 x 4096; its own loads alone reach no more on this grid (docs/benchmarks.md).
``bench/gemv.py`` measures them against those and the copy rate in one run. One row of int4 on
the tile layout takes the CUDA C++ kernel of ``quant.cuda_gemv`` instead where it runs.

* ``_int4_tiles_mma`` (1..8 rows of x; ``int4_config``'s choice there): the tensor cores straight
  from the tile layout of torch's CUDA int4 kernel (``int4pack.cuda_layout``, ``inner_k_tiles``
  8; the host tier's ``int4_cuda_tiles``), whose 16 bytes per lane and (8 rows x 128 columns)
  are, nibble for nibble, the B fragments of ``mma.m16n8k16``. Each warp's step is one inline
  PTX block (``gemv_asm._mma_asm``, which says how): 16-byte loads, two nibbles into a bfloat16x2
  register with one shift and one ``lop3`` (``128 + q`` exactly), two ``mma`` per weight word,
  the ``-8`` folded into each group's accumulator start (``-136 * sum(x)``), float32 sums, one
  float32 FMA per group applying the scale. The block finds its lane and warp itself, so Triton's
  register layout cannot change what it computes. Inline asm does not run in Triton's
  interpreter: the CPU tests execute the asm text lane by lane (``tests/quant/ptx_warp.py``) and
  check ``mma_reference`` (the same arithmetic in torch); the GPU tests run the kernel.
* ``_int4_tiles_gemv_rows`` (one row of x; the CUDA-core kernel of 2026-12-01): the same layout.
  For each 8 output rows and 128 input columns 512 contiguous bytes, each row's share 64
  contiguous bytes (16 int32 words). Word ``j = 4r + i`` of a row's share holds, in nibble
  ``p = 4b + a`` (bits ``4p..4p+3``), the code of column ``32i + 2r + 8a + b`` of the 128
  (int4pack derives this). A program owns a slice of K -- its activations gathered once into
  registers in the nibbles' order, so the weight is never permuted -- and streams the rows of a
  row group through it in 16-byte loads.
* ``_int4_tiles_dot`` (2..16 rows of x): the same layout through the tensor cores, one
  ``tl.dot`` per nibble position (what ``int4_config`` picks for 9..16 rows).
* ``_int8_rows_gemv`` (one row of x): the stored ``[N, K]`` int8 codes, 16 bytes a load.

The CUDA-core kernels turn nibbles and bytes into floats without integer-to-float conversions: a
code placed in the low mantissa bits of the float 2^23 (``(w & mask) | 0x4B000000``, the constant
a kernel argument so it stays in a register) is ``2^23 + c * 16^pos`` exactly; one subtraction
leaves ``(c - 8) * 16^pos`` and the activation is pre-scaled by ``16^-pos`` (exact: a power of
two). Everything accumulates in float32, a group's scale multiplies the group's partial sum (the
dot kernel at groups 32/64: each weight, rounded to bf16 as the reference does) and the result is
rounded once to the activation dtype: within half a bfloat16 unit in the last place of the exact
product, plus float32 summation order.

Split-K: the programs of one output tile write float32 partials to a workspace and bump a
per-tile counter; the last to arrive adds the partials in a fixed order, writes the output and
zeroes the counter -- one launch, the same bits every run, no atomics on data, capturable in a
CUDA graph (the workspace is allocated at the first, eager call; decode warms up eagerly before
it captures). Tile shapes are a pure function of the problem shape, never autotuned.
"""
from __future__ import annotations

import torch

from .gemv_asm import _mma_asm  # noqa: F401  (the tensor-core kernel's PTX)

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs: the dispatch below never picks these kernels
    triton = None

# Rows (tokens x batch) up to which the layers use these kernels on CUDA (``choose``); 0: off,
# the layers keep torch's int4 kernel / the tiled Triton kernel (quant.kernels). Off: measured
# slower (module docstring).
INT4_MAX_M = 0
INT8_MAX_M = 0


if triton is not None:
    @triton.jit
    def _finish(y_ptr, ws_ptr, cnt_ptr, acc, offs_m, offs_n, M, N, pid_n, pid_k,
                SPLIT: tl.constexpr):
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if SPLIT == 1:
            tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(ws_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if done == SPLIT - 1:
                tl.debug_barrier()
                tot = tl.zeros(acc.shape, dtype=tl.float32)
                for s in tl.static_range(SPLIT):
                    tot += tl.load(ws_ptr + s * M * N + offs_m[:, None] * N + offs_n[None, :],
                                   mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :],
                         tot.to(y_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)

    @triton.jit
    def _int4_tiles_gemv_rows(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                              chunks_per_split, magic, rows_per_group,
                              GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_C: tl.constexpr, SPLIT: tl.constexpr,
                              STAGES: tl.constexpr):
        # One row of x; a program owns BLOCK_C chunks of K (its activations loaded once, kept in
        # registers) and walks rows_per_group rows BLOCK_N at a time, streaming their weights.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        KO = K // 128
        c0 = pid_k * chunks_per_split
        q3 = tl.arange(0, 4 * BLOCK_C)[None, :, None]
        i3 = tl.arange(0, 4)[None, None, :]
        colq = (c0 + q3 // 4) * 128 + 32 * i3 + 2 * (q3 % 4)         # [1, 4C, 4]
        xs0 = tl.load(x_ptr + colq).to(tl.float32)
        xs1 = tl.load(x_ptr + colq + 8).to(tl.float32) * (1.0 / 16)
        xs2 = tl.load(x_ptr + colq + 16).to(tl.float32) * (1.0 / 256)
        xs3 = tl.load(x_ptr + colq + 24).to(tl.float32) * (1.0 / 4096)
        xs4 = tl.load(x_ptr + colq + 1).to(tl.float32)
        xs5 = tl.load(x_ptr + colq + 9).to(tl.float32) * (1.0 / 16)
        xs6 = tl.load(x_ptr + colq + 17).to(tl.float32) * (1.0 / 256)
        xs7 = tl.load(x_ptr + colq + 25).to(tl.float32) * (1.0 / 4096)
        wq = (q3 % 4) * 4 + i3 + (c0 + q3 // 4) * 128                 # [1, 4C, 4]
        r0 = pid_n * rows_per_group
        for n0 in tl.range(r0, r0 + rows_per_group, BLOCK_N, num_stages=STAGES):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n3 = offs_n[:, None, None]
            mask_n = n3 < N
            w = tl.load(w_ptr + (n3 // 8) * (KO * 128) + (n3 % 8) * 16 + wq, mask=mask_n,
                        other=0)
            w_hi = (w.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
            part = (((w & 15) | magic).to(tl.float32, bitcast=True) - 8388616.0) * xs0
            part += (((w & 240) | magic).to(tl.float32, bitcast=True) - 8388736.0) * xs1
            part += (((w & 3840) | magic).to(tl.float32, bitcast=True) - 8390656.0) * xs2
            part += (((w & 61440) | magic).to(tl.float32, bitcast=True) - 8421376.0) * xs3
            part += (((w_hi & 15) | magic).to(tl.float32, bitcast=True) - 8388616.0) * xs4
            part += (((w_hi & 240) | magic).to(tl.float32, bitcast=True) - 8388736.0) * xs5
            part += (((w_hi & 3840) | magic).to(tl.float32, bitcast=True) - 8390656.0) * xs6
            part += (((w_hi & 61440) | magic).to(tl.float32, bitcast=True) - 8421376.0) * xs7
            if GROUP == 128:
                s = tl.load(s_ptr + ((c0 + q3 // 4) * N + n3) * 2, mask=mask_n,
                            other=0.0).to(tl.float32)                 # [BN, 4C, 1]
                part = tl.sum(part, axis=2, keep_dims=True) * s
            else:
                g = (colq - 2 * (q3 % 4)) // GROUP
                s = tl.load(s_ptr + (g * N + n3) * 2, mask=mask_n, other=0.0).to(tl.float32)
                part = part * s
            out = tl.sum(tl.sum(part, axis=2), axis=1)                # [BN]
            if SPLIT == 1:
                tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=offs_n < N)
            else:
                tl.store(ws_ptr + pid_k * N + offs_n, out, mask=offs_n < N)
        if SPLIT > 1:
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if done == SPLIT - 1:
                tl.debug_barrier()
                for n0 in range(r0, r0 + rows_per_group, 1024):
                    offs = n0 + tl.arange(0, 1024)
                    m = (offs < N) & (offs < r0 + rows_per_group)
                    tot = tl.zeros((1024,), dtype=tl.float32)
                    for k in tl.static_range(SPLIT):
                        tot += tl.load(ws_ptr + k * N + offs, mask=m, other=0.0,
                                       cache_modifier=".cg")
                    tl.store(y_ptr + offs, tot.to(y_ptr.dtype.element_ty), mask=m)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)

    @triton.jit
    def _int4_tiles_dot(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                        chunks_per_split, magic,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_C: tl.constexpr, SPLIT: tl.constexpr):
        # Tensor cores for several rows of x: y^T tile [BN, 16] = sum over chunks and nibble
        # positions p of W_p [BN, 16] @ X_p [16, 16], W_p the codes - 8 of nibble p (exact in
        # bf16); group 128: the chunk's scale multiplies the chunk's float32 sums, else the
        # scale is applied per weight and the product rounded to bf16 as the reference does.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        KO = K // 128
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, 16)
        jj = tl.arange(0, 16)
        mask_n = offs_n[:, None] < N
        row = (offs_n[:, None] // 8) * (KO * 128) + (offs_n[:, None] % 8) * 16 + jj[None, :]
        colj = 32 * (jj % 4) + 2 * (jj // 4)                           # [16]
        mask_x = offs_m[None, :] < M
        acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        c_start = pid_k * chunks_per_split
        for c0 in range(c_start, c_start + chunks_per_split):
            w = tl.load(w_ptr + row + c0 * 128, mask=mask_n, other=0)
            w_hi = (w.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
            xbase = x_ptr + offs_m[None, :] * stride_xm + (c0 * 128 + colj)[:, None]   # [16, 16]
            if GROUP == 128:
                part = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
            else:
                g = (c0 * 128 + 32 * (jj % 4)) // GROUP
                s = tl.load(s_ptr + (g[None, :] * N + offs_n[:, None]) * 2, mask=mask_n,
                            other=0.0).to(tl.float32)
            for p in tl.static_range(8):
                a = p % 4
                if p < 4:
                    src = w
                else:
                    src = w_hi
                f = ((src & (15 << (4 * a))) | magic).to(tl.float32, bitcast=True)
                # one FMA, exact: f / 16^a - (2^23 / 16^a + 8) = code - 8
                q = f * (1.0 / (1 << (4 * a))) - (8388608.0 / (1 << (4 * a)) + 8.0)
                xv = tl.load(xbase + (8 * a + p // 4), mask=mask_x, other=0.0)
                if GROUP == 128:
                    part = tl.dot(q.to(xv.dtype), xv, part)
                else:
                    acc = tl.dot((q * s).to(xv.dtype), xv, acc)
            if GROUP == 128:
                sc = tl.load(s_ptr + (c0 * N + offs_n) * 2, mask=offs_n < N,
                             other=0.0).to(tl.float32)
                acc += part * sc[:, None]
        out = tl.trans(acc)                                           # [16, BN]
        _finish(y_ptr, ws_ptr, cnt_ptr, out, offs_m, offs_n, M, N, pid_n, pid_k, SPLIT)

    @triton.jit
    def _int8_rows_gemv(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                        words_per_split, magic,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_W: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr = 3):
        # One row of x. Tile [BN, BW/4, 4]: row, 16-byte vector, word in it; byte b of word w is
        # column 4w + b; the activations of byte b are a [1, BW/4, 4] gather.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        KW = tl.multiple_of(K // 4, 32)       # K % 128 == 0 (choose)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n3 = offs_n[:, None, None]
        v3 = tl.arange(0, BLOCK_W // 4)[None, :, None]
        i3 = tl.arange(0, 4)[None, None, :]
        mask_n = n3 < N
        wq = 4 * v3 + i3                                              # [1, BW/4, 4]
        acc = tl.zeros((BLOCK_N, BLOCK_W // 4, 1), dtype=tl.float32)
        w_start = pid_k * words_per_split
        if GROUP == 0:
            s_t = tl.load(s_ptr).to(tl.float32)
        for w0 in tl.range(w_start, w_start + words_per_split, BLOCK_W, num_stages=STAGES):
            w = tl.load(w_ptr + n3 * KW + w0 + wq, mask=mask_n, other=0) ^ -2139062144
            w_hi = (w.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
            xbase = x_ptr + 4 * (w0 + wq)
            part = tl.zeros((BLOCK_N, BLOCK_W // 4, 4), dtype=tl.float32)
            for b in tl.static_range(4):
                a = b % 2
                if b < 2:
                    src = w
                else:
                    src = w_hi
                f = ((src & (255 << (8 * a))) | magic).to(tl.float32, bitcast=True)
                f = f - (8388608.0 + 128.0 * (1 << (8 * a)))
                xv = tl.load(xbase + b).to(tl.float32) * (1.0 / (1 << (8 * a)))
                part += f * xv
            part = tl.sum(part, axis=2, keep_dims=True)               # 16 columns: one group
            if GROUP == 0:
                acc += part
            else:
                s = tl.load(s_ptr + n3 * (K // GROUP) + (4 * (w0 + 4 * v3)) // GROUP,
                            mask=mask_n, other=0.0).to(tl.float32)
                acc += part * s
        out = tl.sum(tl.sum(acc, axis=2), axis=1)
        if GROUP == 0:
            out = out * s_t
        _finish(y_ptr, ws_ptr, cnt_ptr, out[None, :], tl.arange(0, 1), offs_n, M, N, pid_n,
                pid_k, SPLIT)


if triton is not None:
    @triton.jit
    def _int4_tiles_mma(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                        rows_per_group, split, ASM: tl.constexpr, NT: tl.constexpr,
                        BC: tl.constexpr, GROUP: tl.constexpr, WARPS: tl.constexpr,
                        SP2: tl.constexpr, RB: tl.constexpr, S: tl.constexpr):
        # Program (row group, K slice): steps of WARPS * NT n-tiles, each warp's step one PTX block
        # (_mma_asm) writing float32 partial sums; the last program of a row group to arrive adds
        # the SPLIT partials in a fixed order and writes y. Every value the asm block takes is the
        # same in all threads (it finds its lane and warp itself), so its layout cannot matter.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        KO = K // 128
        c0 = pid_k * BC
        r0 = pid_n * rows_per_group
        r1 = tl.minimum(r0 + rows_per_group, N)
        for n0 in range(r0, r1, WARPS * NT * 8 * S):
            wb = (w_ptr + (n0 // 8) * (KO * 128) + c0 * 128).to(tl.int64, bitcast=True)
            sb = (s_ptr + (c0 * (128 // GROUP) * N + n0) * 2).to(tl.int64, bitcast=True)
            xb = (x_ptr + c0 * 128).to(tl.int64, bitcast=True)
            ob = (ws_ptr + pid_k * M * N + n0).to(tl.int64, bitcast=True)
            tl.inline_asm_elementwise(ASM, "=r,l,l,l,l,r,r,r,r,r,r",
                                      [wb, sb, xb, ob, (r1 - n0) // 8, KO * 512, N * 4, M,
                                       stride_xm * 2, WARPS * NT],
                                      dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == split - 1:
            tl.debug_barrier()
            ks = tl.arange(0, SP2)[:, None]
            for m in range(M):
                for n1 in range(r0, r1, RB):
                    offs = n1 + tl.arange(0, RB)[None, :]
                    part = tl.load(ws_ptr + (ks * M + m) * N + offs,
                                   mask=(ks < split) & (offs < r1), other=0.0,
                                   cache_modifier=".cg")
                    tot = tl.sum(part, axis=0)
                    o = n1 + tl.arange(0, RB)
                    tl.store(y_ptr + m * N + o, tot.to(y_ptr.dtype.element_ty), mask=o < r1)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_SPLIT_WS: dict = {}


def _workspace(device, split: int, M: int, N: int, tiles: int):
    """(partials, counters) for a split-K launch: kept per device and size (the counters must
    start at zero, and every launch leaves them at zero)."""
    key = (device, split * M * N, tiles)
    ws = _SPLIT_WS.get(key)
    if ws is None:
        ws = (torch.empty(split * M * N, dtype=torch.float32, device=device),
              torch.zeros(tiles, dtype=torch.int32, device=device))
        _SPLIT_WS[key] = ws
    return ws


def rows_config(N: int, K: int, block_n: int = 16, block_c: int = 4, ctas: int = 528,
                stages: int = 1, num_warps: int = 4) -> dict | None:
    """The batch-1 kernel's shape: K cut into slices of ``block_c`` chunks of 128 (a power of two
    dividing K / 128), rows into groups of a multiple of ``block_n`` such that about ``ctas``
    programs run; None when no power-of-two slice divides K."""
    chunks = K // 128
    while block_c > 1 and chunks % block_c:
        block_c //= 2
    split = chunks // block_c
    groups = max(1, min(_cdiv(N, block_n), _cdiv(ctas, split)))
    rows = _cdiv(_cdiv(N, groups), block_n) * block_n
    return dict(kernel="rows", BLOCK_N=block_n, BLOCK_C=block_c, SPLIT=split, ROWS=rows,
                stages=stages, num_warps=num_warps)


def mma_config(N: int, K: int, nt: int | None = None, bc: int = 2, warps: int | None = None,
               ctas: int = 528, pf: int = 0, steps: int = 1, sms: int = 132) -> dict:
    """The tensor-core kernel's shape: K cut into slices of ``bc`` chunks of 128 (``bc`` halved
    until it divides K / 128), each warp's step ``nt`` n-tiles of 8 rows, ``warps`` warps a
    program; rows into groups of whole steps such that about ``ctas`` programs run. Unless given,
    ``warps`` then ``nt`` are halved (from 4 and 4) until the steps number at least ``2 * sms``."""
    chunks = K // 128
    while bc > 1 and chunks % bc:
        bc //= 2
    split = chunks // bc
    w, n = warps or 4, nt or 4
    while _cdiv(N, w * n * 8) * split < 2 * sms:
        if warps is None and w > 1:
            w //= 2
        elif nt is None and n > 1:
            n //= 2
        else:
            break
    step = w * n * 8 * steps
    blocks = _cdiv(N, step)
    groups = max(1, min(blocks, _cdiv(ctas, split)))
    rows = _cdiv(blocks, groups) * step
    return dict(kernel="mma", NT=n, BC=bc, WARPS=w, SPLIT=split, ROWS=rows, PF=pf, S=steps)


def int4_config(M: int, N: int, K: int, sms: int = 132) -> dict:
    """Tile shape for the int4 kernel: a pure function of the problem shape (the tensor-core
    kernel up to 8 rows of x)."""
    if M <= 8:
        return mma_config(N, K)
    kernel, block_n, block_c, stages = "dot", 128, 1, 3
    chunks = K // 128
    split = 1
    while (_cdiv(N, block_n) * split < 2 * sms and chunks % (split * 2 * block_c) == 0
           and chunks // (split * 2) >= 4):
        split *= 2
    return dict(kernel=kernel, BLOCK_N=block_n, BLOCK_C=block_c, SPLIT=split, num_warps=4,
                stages=stages)


def int8_config(M: int, N: int, K: int, sms: int = 132) -> dict:
    """Tile shape for the int8 kernel (one row of x): a pure function of the problem shape."""
    block_n, block_w = 8, 64
    words = K // 4
    while block_w > 8 and words % block_w:
        block_w //= 2
    split = 1
    while (_cdiv(N, block_n) * split < 2 * sms and words % (split * 2 * block_w) == 0
           and words // (split * 2) >= 4 * block_w):
        split *= 2
    return dict(BLOCK_N=block_n, BLOCK_W=block_w, SPLIT=split, num_warps=4, stages=4)


def int4_tiles_matmul(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group: int,
                      N: int, K: int, cfg: dict | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T`` -> ``[M, N]`` in ``x.dtype``, ``W`` held as torch's CUDA int4 tile layout
    (``inner_k_tiles`` 8) with its ``[K/group, N, 2]`` scales."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M = x.shape[0]
    cfg = cfg or int4_config(M, N, K)
    if cfg["kernel"] == "mma":
        return _mma_matmul(x, words, sz, group, N, K, cfg)
    bn, bc, split = cfg["BLOCK_N"], cfg["BLOCK_C"], cfg["SPLIT"]
    chunks = K // 128
    assert chunks % (split * bc) == 0, (K, cfg)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if cfg["kernel"] == "rows":
        # grid: row groups x K slices, BLOCK_C the chunks of one slice
        assert M == 1 and bc * split == chunks, (M, K, cfg)
        groups = _cdiv(N, cfg["ROWS"])
        ws, cnt = _workspace(x.device, split, 1, N, groups) if split > 1 else (y, y)
        _int4_tiles_gemv_rows[(groups, split)](
            x, words, sz, y, ws, cnt, M, N, K, x.stride(0), bc, 0x4B000000, cfg["ROWS"],
            GROUP=group, BLOCK_M=1, BLOCK_N=bn, BLOCK_C=bc, SPLIT=split,
            STAGES=cfg.get("stages", 3), num_warps=cfg.get("num_warps", 4))
        return y
    assert cfg["kernel"] == "dot", cfg
    tiles = _cdiv(N, bn)
    ws, cnt = _workspace(x.device, split, M, N, tiles) if split > 1 else (y, y)
    _int4_tiles_dot[(tiles, split)](x, words, sz, y, ws, cnt, M, N, K, x.stride(0), chunks // split,
                                    0x4B000000, GROUP=group, BLOCK_M=16, BLOCK_N=bn, BLOCK_C=1,
                                    SPLIT=split, num_warps=cfg.get("num_warps", 4),
                                    num_stages=cfg.get("stages", 3))
    return y


_ASM: dict = {}


def _tinygemm(x, words, group, sz):
    return torch.ops.aten._weight_int4pack_mm(x.contiguous(), words, group, sz)


def _mma_matmul(x, words, sz, group, N, K, cfg):
    if words.data_ptr() % 16 or sz.data_ptr() % 8:
        # The asm's 16- and 8-byte loads need aligned operands (a fresh or arena-slot tensor is);
        # torch's int4 kernel reads the same layout -- with the same need, so from aligned copies.
        return _tinygemm(x, words.clone() if words.data_ptr() % 16 else words, group,
                         sz.clone() if sz.data_ptr() % 8 else sz)
    if x.data_ptr() % 4 or x.stride(0) % 2:
        # 4-byte loads of column pairs: a fresh copy (``contiguous()`` keeps a one-row view where
        # it is -- the device run of 2026-12-02 04:52 faulted on exactly that)
        x = x.clone(memory_format=torch.contiguous_format)
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        with torch.cuda.device(x.device):
            return _mma_matmul(x, words, sz, group, N, K, cfg)
    M = x.shape[0]
    nt, bc, warps, split, rows = cfg["NT"], cfg["BC"], cfg["WARPS"], cfg["SPLIT"], cfg["ROWS"]
    key = (nt, bc, group, cfg.get("PF", 0), cfg.get("S", 1), cfg.get("LO", 0))
    steps = key[4]
    assert 1 <= M <= 8 and N % 8 == 0 and K % 128 == 0 and group in (32, 64, 128), (M, N, K)
    assert bc * split == K // 128 and rows % (warps * nt * 8 * steps) == 0, (K, cfg)
    asm = _ASM.get(key)
    if asm is None:
        asm = _ASM[key] = _mma_asm(*key)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    groups = _cdiv(N, rows)
    ws, cnt = _workspace(x.device, split, M, N, groups)
    sp2 = 1 << (split - 1).bit_length()
    _int4_tiles_mma[(groups, split)](
        x, words, sz, y, ws, cnt, M, N, K, x.stride(0), rows, split, ASM=asm, NT=nt, BC=bc,
        GROUP=group, WARPS=warps, SP2=sp2, RB=max(16, min(256, 4096 // sp2)), S=steps,
        num_warps=warps)
    return y


def mma_reference(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, group: int, N: int,
                  K: int, split: int = 1) -> torch.Tensor:
    """The arithmetic of ``_int4_tiles_mma`` in torch (any device, float32): each weight taken
    from the tile layout's words by the asm's shifts, masks and lane mapping as the bfloat16
    ``128 + q``, each scale group's sum started at ``-136 * sum(x)``, scaled in float32, the
    ``split`` K slices added in order, rounded once to ``x.dtype``. CPU tests hold it to the
    dequantize + matmul allowance; the kernel's own sums differ only in float32 order."""
    M = x.shape[0]
    KO = K // 128
    w = words.reshape(N // 8, KO, 32, 4).to(torch.int64) & 0xFFFFFFFF
    lane = torch.arange(32, device=words.device)
    g, r = lane // 4, lane % 4
    B = torch.empty(N // 8, 8, KO, 128, dtype=torch.float32, device=words.device)
    for i in range(4):
        for a in range(4):
            v = ((w[..., i] >> (4 * a)) & 0x000F000F) | 0x43004300          # [N/8, KO, 32]
            for half in range(2):
                bits = ((v >> (16 * half)) & 0xFFFF) << 16
                val = bits.to(torch.int32).view(torch.float32)
                col = 32 * i + 8 * a + 2 * r + half                           # [32]
                B[:, g, :, col] = val.permute(2, 0, 1)      # indexed dims first
    B = B.reshape(N, K)
    xf = x.float()
    s = sz[..., 0].float()                                                    # [K/group, N]
    parts = []
    per = K // split
    for k in range(split):
        acc = torch.zeros(M, N, dtype=torch.float32, device=x.device)
        for k0 in range(k * per, (k + 1) * per, group):
            xs = xf[:, k0:k0 + group]
            d = xs @ B[:, k0:k0 + group].t() + (-136.0 * xs).sum(dim=1, keepdim=True)
            acc = acc + d * s[k0 // group]
        parts.append(acc)
    tot = parts[0]
    for p in parts[1:]:
        tot = tot + p
    return tot.to(x.dtype)


def int8_rows_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int,
                     N: int, K: int, cfg: dict | None = None) -> torch.Tensor:
    """``x [1, K] @ W.T`` with ``W`` int8 codes ``[N, K]`` and float16 scales ``[N, K/group]``
    (``group`` 0: one scale)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M = x.shape[0]
    assert M == 1, M
    cfg = cfg or int8_config(M, N, K)
    bn, bw, split = cfg["BLOCK_N"], cfg["BLOCK_W"], cfg["SPLIT"]
    words = K // 4
    assert words % (split * bw) == 0, (K, cfg)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    tiles = _cdiv(N, bn)
    ws, cnt = _workspace(x.device, split, M, N, tiles) if split > 1 else (y, y)
    _int8_rows_gemv[(tiles, split)](x, codes.view(torch.int32), scales, y, ws, cnt, M, N, K,
                                    x.stride(0), words // split, 0x4B000000, GROUP=group,
                                    BLOCK_M=1, BLOCK_N=bn, BLOCK_W=bw, SPLIT=split,
                                    STAGES=cfg.get("stages", 3),
                                    num_warps=cfg.get("num_warps", 4))
    return y


def choose(device_type: str, dtype, bits: int, M: int, N: int, K: int, group: int,
           inner_k_tiles: int | None = None) -> str | None:
    """Whether a decode-sized matmul takes these kernels: None if it does, else why not.

    ``group``: the scale group over K (int8: 0 for one scale per tensor); ``inner_k_tiles``:
    int4's tile layout (these kernels read 8). A pure function of its arguments, so the choice is
    testable without a GPU."""
    limit = INT4_MAX_M if bits == 4 else INT8_MAX_M
    if device_type != "cuda":
        return f"device type {device_type}"
    if triton is None:
        return "triton is not installed"
    if M > limit:
        return f"M = {M} rows > {limit}" if limit else "off (slower than the default kernels)"
    if dtype != torch.bfloat16 and (bits == 4 or dtype != torch.float16):
        return f"{dtype} activations"
    if bits == 4:
        if inner_k_tiles != 8:
            return f"int4 tile layout with inner_k_tiles {inner_k_tiles} (the kernel reads 8)"
        if K % 128:
            return f"K = {K} input features, not a multiple of 128"
        if group not in (32, 64, 128):
            return f"scale group {group}"
        return None
    if M != 1:
        return f"M = {M} rows (the int8 kernel takes one)"
    if K % 128:
        return f"K = {K} input features, not a multiple of 128"
    if group and group not in (32, 64, 128):
        return f"scale group {group}"
    return None
