"""The batch-1 int4 GEMV in CUDA C++ (compiled at run time through NVRTC, ``torch.cuda._compile_kernel``),
on the tile layout the host tier already stores (torch's CUDA int4 layout, ``inner_k_tiles`` 8;
``int4pack.cuda_layout``) and its ``[K/group, N, 2]`` bfloat16 (scale, zero) pairs, zero 0
(``int4pack.scales_and_zeros``): nothing repacked, nothing derived.

Why CUDA C++: a batch-1 int4 GEMV streams 1/4 byte a weight, so at the copy rate an H200 SM must
retire ~33 weights a cycle. Turning each nibble into a float32 and one FMA costs ~3 instructions a
weight (the Triton kernels of ``quant.gemv``: 33-38 SASS a 32-bit word), which is already the SM's
whole issue rate. Here the tensor cores do the multiply: per 32-bit word four ``lop3`` (plus three
shifts) give four bfloat16x2 registers ``128 + q`` that *are* the B fragments of
``mma.m16n8k16`` in this layout (``gemv_asm._mma_asm`` says how) -- and, two n-tiles side by
side, its A fragments (rows g and g + 8): with ``Config.A`` (``SWAP``, the default) the codes are
A and x is B (every column), one ``mma`` a 16 x 16 tile, half the ``mma`` of x as A (15 of its 16
rows padding): ~9 instructions a word.

Kernel shape (``Config``): a CTA of ``W`` warps owns ``NT`` n-tiles (8 output rows each) over all of
K; its warps split K evenly (``K/128/W`` chunks of 128 columns each), every warp streaming its
chunks of the ``NT`` n-tiles (512 contiguous bytes a chunk and n-tile: one 16-byte load a lane)
``U`` chunks at a time, all their loads issued before any arithmetic. x is staged once into shared
memory in the A-fragment order (each lane then reads a chunk's 16 registers as four 16-byte loads,
reused for the ``NT`` n-tiles) with each chunk's sum. Each chunk's float32 accumulator starts at
``-136 * sum(x over the chunk)`` (so it ends at ``sum x * (q - 8)``: the ``128 + q`` of the
conversion, minus 8) and one FMA applies the chunk's scale. The ``W`` warps' sums meet in shared
memory and are added in warp order: one launch, no workspace, no atomics, the same bits every run,
capturable in a CUDA graph. Group 128 (one scale per chunk) only; ``supports`` says what else.

The arithmetic is ``gemv.mma_reference`` (split 1, float32 sums in another order): the CPU tests
hold that to the dequantize + matmul allowance and run this module's launch path through
``cuda_gemv_emu.Emulated``, a stand-in that executes the kernel's index arithmetic and each ``mma``'s fragment
layout; the GPU tests run the kernel against the allowance and torch's int4 kernel.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# Whether ``QuantLinear`` runs one-row int4 tile-layout calls through this kernel (``supports``):
# on by default, measured faster than torch's int4 kernel at every 8B shape (docs/benchmarks.md).
ENABLED = True

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ u32 lop_pair(u32 w) {
    u32 v;
    asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;" : "=r"(v) : "r"(w));
    return v;
}

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ld_stream(u32* v, const u32* p) {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "l"(p));
}

__device__ __forceinline__ float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }

__device__ __forceinline__ u16 to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

#ifndef SILU
#define SILU 0
#endif
#ifndef SWAP
#define SWAP 0
#endif
#ifndef GLU
#define GLU 0
#endif
#ifndef RING
#define RING 0
#endif

// RING: each warp's codes and scales go through a ring of RING chunk slots in shared memory,
// filled by cp.async (no registers held while in flight): a warp's first RING chunks are all in
// flight at once, then one more as each is used.
__device__ __forceinline__ void cp16(u32* dst, const u32* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp4(u32* dst, const u32* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;"
                 :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int n> __device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(n) : "memory");
}

// silu(g) * u of two bfloat16 pairs, rounded as decode.kernels.silu_mul does: the activation in
// float32 (ex2.approx and div.full, the instructions Triton emits for it) rounded to bfloat16,
// times up in float32, rounded to bfloat16.
__device__ __forceinline__ float act(float g) {
    float e, q;
    asm("ex2.approx.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
    asm("div.full.f32 %0, %1, %2;" : "=f"(q) : "f"(g), "f"(1.f + e));
    return q;
}

__device__ __forceinline__ u32 silu_pair(u32 g, u32 u) {
    u16 a_lo = to_bf16(act(bf16_lo(g))), a_hi = to_bf16(act(bf16_hi(g)));
    u16 lo = to_bf16(__uint_as_float((u32)a_lo << 16) * bf16_lo(u));
    u16 hi = to_bf16(__uint_as_float((u32)a_hi << 16) * bf16_hi(u));
    return (u32)lo | ((u32)hi << 16);
}

struct Batch {                 // U chunks x NT n-tiles of one lane: codes and (scale, zero) pairs
    u32 w[U][NT][4];
#if SWAP
    u32 s[U][NT];              // row g of each n-tile
#else
    uint2 s[U][NT];            // rows 2r, 2r + 1 of each n-tile
#endif
};

// The n-tile j of block blk (ntl: the last n-tile). GLU: W is gate | up (N / 2 rows each) and a
// block is NT / 2 n-tiles of gate and the same NT / 2 of up.
__device__ __forceinline__ int tile(int blk, int j, int ntl) {
#if GLU
    const int half = (ntl + 1) >> 1, h = NT / 2;
    return (j < h ? 0 : half) + min(blk * h + (j % h), half - 1);
#else
    return min(blk * NT + j, ntl);
#endif
}

// Issue the loads of chunks c .. c + U - 1 (all before any use).
__device__ __forceinline__ void load(Batch& b, const u32* __restrict__ words,
                                     const u32* __restrict__ sz, int c, int blk, int ntl,
                                     int KO, int N, int lane) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int nt = tile(blk, j, ntl);
            ld_stream(b.w[u][j], words + ((size_t)(nt * KO + c + u) * 32 + lane) * 4);
#if SWAP
            b.s[u][j] = sz[(size_t)(c + u) * N + nt * 8 + (lane >> 2)];
#else
            b.s[u][j] = *(const uint2*)(sz + ((size_t)(c + u) * N + nt * 8 + 2 * (lane & 3)));
#endif
        }
    }
}

#if RING
// The copies of chunk c (one 16-byte piece a lane and n-tile, and the lane's scale of each n-tile,
// SWAP's row g) into ring slot ``slot`` of this warp: rw [RING][NT][32][4] words, rs [RING][NT][32].
__device__ __forceinline__ void issue(u32* rw, u32* rs, const u32* __restrict__ words,
                                      const u32* __restrict__ sz, int c, int slot, int blk, int ntl,
                                      int KO, int N, int lane) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int nt = tile(blk, j, ntl);
        cp16(rw + ((slot * NT + j) * 32 + lane) * 4, words + ((size_t)(nt * KO + c) * 32 + lane) * 4);
        cp4(rs + (slot * NT + j) * 32 + lane, sz + (size_t)c * N + nt * 8 + (lane >> 2));
    }
}

__device__ __forceinline__ void fetch(Batch& b, const u32* rw, const u32* rs, int slot, int lane) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const uint4 v = *(const uint4*)(rw + ((slot * NT + j) * 32 + lane) * 4);
        b.w[0][j][0] = v.x; b.w[0][j][1] = v.y; b.w[0][j][2] = v.z; b.w[0][j][3] = v.w;
        b.s[0][j] = rs[(slot * NT + j) * 32 + lane];
    }
}
#endif

__device__ __forceinline__ void compute(const Batch& b, float (&acc)[NT][2], const u32* xf,
                                        const float* xsum, int c, int r) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        u32 a[16];
        const uint4* xp = (const uint4*)(xf + ((c + u) * 4 + r) * 16);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            uint4 t = xp[q];
            a[4 * q] = t.x; a[4 * q + 1] = t.y; a[4 * q + 2] = t.z; a[4 * q + 3] = t.w;
        }
        const float bias = -136.f * xsum[c + u];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#ifdef LOADS_ONLY
            // a measurement aid (wrong results): the same loads and stores, no arithmetic
            acc[j][0] += __uint_as_float((b.w[u][j][0] ^ b.w[u][j][1] ^ b.w[u][j][2] ^ b.w[u][j][3]
                                          ^ *(const u32*)&b.s[u][j] ^ a[0]) & 0x3FFFFFFFu);
#elif SWAP
            // n-tiles j, j + 1 as the A operand (rows g, g + 8), x as B (every column): one mma
            // a 16 x 16 tile; k-tiles 2i and 2i + 1 in two chains
            if (j & 1) continue;
            float d[4] = {bias, bias, bias, bias}, e[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 w0 = b.w[u][j][i], w1 = b.w[u][j + 1][i];
                mma(d, lop_pair(w0), lop_pair(w1), lop_pair(w0 >> 4), lop_pair(w1 >> 4),
                    a[4 * i], a[4 * i + 1]);
                mma(e, lop_pair(w0 >> 8), lop_pair(w1 >> 8), lop_pair(w0 >> 12), lop_pair(w1 >> 12),
                    a[4 * i + 2], a[4 * i + 3]);
            }
            acc[j][0] = fmaf(d[0] + e[0], bf16_lo(b.s[u][j]), acc[j][0]);
            acc[j + 1][0] = fmaf(d[2] + e[2], bf16_lo(b.s[u][j + 1]), acc[j + 1][0]);
#else
            float d[4] = {bias, bias, 0.f, 0.f};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 w = b.w[u][j][i];
                mma(d, a[4 * i], 0u, a[4 * i + 1], 0u, lop_pair(w), lop_pair(w >> 4));
                mma(d, a[4 * i + 2], 0u, a[4 * i + 3], 0u, lop_pair(w >> 8), lop_pair(w >> 12));
            }
            acc[j][0] = fmaf(d[0], bf16_lo(b.s[u][j].x), acc[j][0]);
            acc[j][1] = fmaf(d[1], bf16_lo(b.s[u][j].y), acc[j][1]);
#endif
        }
    }
}

// x: bf16 [K] (16-byte aligned); words: int32 tile layout [N/8][K/128][32][4]; sz: bf16
// [K/128][N][2] (scale, zero 0; 8-byte aligned); y: bf16 [N]. Grid: N/8/NT CTAs of 32*W threads.
// Dynamic shared memory: K/128 * 256 bytes of x fragments + K/128 floats of chunk sums
// + W*NT*8 floats of partial sums. PIPE 1: a warp's first loads go out before x is staged, and
// each batch's loads before the previous batch's arithmetic (two register sets).
extern "C" __global__ void __launch_bounds__(32 * W)
int4_gemv_m1(const uint4* __restrict__ x, const u32* __restrict__ words,
             const u32* __restrict__ sz, u16* __restrict__ y, int N, int K) {
    extern __shared__ __align__(16) u32 smem[];
    const int KO = K >> 7;
    u32* xf = smem;                                   // [KO][4 r][8 kt][2 h]
    float* xsum = (float*)(smem + KO * 64);           // [KO]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#if RING
    float* part = xsum + ((KO + 3) & ~3);             // [W][NT*8]
    u32* rw = (u32*)(part + W * NT * 8) + warp * RING * NT * 128;                 // this warp's ring
    u32* rs = (u32*)(part + W * NT * 8) + W * RING * NT * 128 + warp * RING * NT * 32;
#else
    float* part = xsum + KO;                          // [W][NT*8]
#endif
    const int r = lane & 3;
    const int cpw = KO / W;                   // chunks a warp (KO % W == 0, cpw % U == 0)
    const int c0 = warp * cpw;
    const int ntl = (N >> 3) - 1;
#if GLU
    const int nblk = ((ntl + 1) / 2 + NT / 2 - 1) / (NT / 2);
#else
    const int nblk = (ntl + NT) / NT;         // blocks of NT n-tiles; a CTA takes blockIdx.x,
#endif
                                              // then every gridDim.x-th (a grid smaller than
                                              // nblk stages x once for several blocks)
    Batch A, B;
#if RING
#pragma unroll
    for (int i = 0; i < RING; ++i) {          // the first chunks in flight before x is staged
        if (i < cpw) issue(rw, rs, words, sz, c0 + i, i, blockIdx.x, ntl, KO, N, lane);
        cp_commit();
    }
#elif PIPE
    load(A, words, sz, c0, blockIdx.x, ntl, KO, N, lane);
#endif
    // Stage x: 8 columns 8 e .. 8 e + 7 of chunk c are pairs r = 0..3 of half h of k-tile kt.
    // SILU: x is gate | up ([2K]); what is staged is silu(gate) * up.
    for (int e = tid; e < (K >> 3); e += 32 * W) {
        uint4 v = x[e];
#if SILU
        const uint4 u = x[e + (K >> 3)];
        v.x = silu_pair(v.x, u.x); v.y = silu_pair(v.y, u.y);
        v.z = silu_pair(v.z, u.z); v.w = silu_pair(v.w, u.w);
#endif
        const int col = (e << 3) & 127, c = e >> 4;
        const int base = ((c * 4) * 8 + (col >> 4)) * 2 + ((col >> 3) & 1);
        xf[base] = v.x; xf[base + 16] = v.y; xf[base + 32] = v.z; xf[base + 48] = v.w;
    }
    __syncthreads();
    // Each chunk's sum, from what was staged: lane l adds words 2l, 2l + 1 of the chunk.
    for (int c = warp; c < KO; c += W) {
        const u32 p = xf[c * 64 + 2 * lane], q = xf[c * 64 + 2 * lane + 1];
        float s = (bf16_lo(p) + bf16_hi(p)) + (bf16_lo(q) + bf16_hi(q));
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) xsum[c] = s;
    }
    __syncthreads();
    for (int blk = blockIdx.x; blk < nblk; blk += gridDim.x) {
    float acc[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = 0.f;
#if RING
    if (blk != blockIdx.x) {
#pragma unroll
        for (int i = 0; i < RING; ++i) {
            if (i < cpw) issue(rw, rs, words, sz, c0 + i, i, blk, ntl, KO, N, lane);
            cp_commit();
        }
    }
    // one group committed an iteration (empty past the last chunk): chunk i's group is complete
    // once at most RING - 1 are pending; its slot is refilled after its values are used
    for (int i = 0; i < cpw; ++i) {
        cp_wait<RING - 1>();
        const int slot = i % RING;
        fetch(A, rw, rs, slot, lane);
        compute(A, acc, xf, xsum, c0 + i, r);
        if (i + RING < cpw) issue(rw, rs, words, sz, c0 + i + RING, slot, blk, ntl, KO, N, lane);
        cp_commit();
    }
#elif PIPE
    if (blk != blockIdx.x) load(A, words, sz, c0, blk, ntl, KO, N, lane);
    for (int cb = 0; cb < cpw; cb += 2 * U) {
        if (cb + U < cpw) load(B, words, sz, c0 + cb + U, blk, ntl, KO, N, lane);
        compute(A, acc, xf, xsum, c0 + cb, r);
        if (cb + 2 * U < cpw) load(A, words, sz, c0 + cb + 2 * U, blk, ntl, KO, N, lane);
        if (cb + U < cpw) compute(B, acc, xf, xsum, c0 + cb + U, r);
    }
#else
    for (int cb = 0; cb < cpw; cb += U) {
        load(A, words, sz, c0 + cb, blk, ntl, KO, N, lane);
        compute(A, acc, xf, xsum, c0 + cb, r);
    }
#endif
#if SWAP
    if (r == 0) {                             // lane 4 g: row g of each n-tile
#pragma unroll
        for (int j = 0; j < NT; ++j) part[warp * NT * 8 + j * 8 + (lane >> 2)] = acc[j][0];
    }
#else
    if (lane < 4) {                           // lane r: rows 2 r, 2 r + 1 of each n-tile
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            part[warp * NT * 8 + j * 8 + 2 * r] = acc[j][0];
            part[warp * NT * 8 + j * 8 + 2 * r + 1] = acc[j][1];
        }
    }
#endif
    __syncthreads();
#if GLU
    // y [N / 2]: silu(gate) * up of the block's rows, each rounded to bfloat16 first (as the
    // GEMV's output is) and then as decode.kernels.silu_mul rounds.
    if (tid < NT * 4) {
        float s = 0.f, t = 0.f;
#pragma unroll
        for (int w2 = 0; w2 < W; ++w2) {
            s += part[w2 * NT * 8 + tid];
            t += part[w2 * NT * 8 + NT * 4 + tid];
        }
        const int n = blk * NT * 4 + tid;
        if (n < (N >> 1)) y[n] = (u16)silu_pair(to_bf16(s), to_bf16(t));
    }
#else
    if (tid < NT * 8) {
        float s = 0.f;
#pragma unroll
        for (int w2 = 0; w2 < W; ++w2) s += part[w2 * NT * 8 + tid];
        const int n = blk * NT * 8 + tid;
        if (n < N) y[n] = to_bf16(s);
    }
#endif
    __syncthreads();                          // part is read before the next block writes it
    }
}
"""


@dataclass(frozen=True)
class Config:
    """``NT`` n-tiles (8 rows each) a CTA, ``W`` warps a CTA splitting K, ``U`` chunks of 128
    columns a batch of loads; ``P`` 1: each batch's loads issued before the previous batch's
    arithmetic (the first before x is staged)."""
    NT: int = 2
    W: int = 8
    U: int = 2
    P: int = 1
    LO: int = 0         # 1: loads and stores only, no arithmetic (wrong results; bench/gemv.py)
    S: int = 0          # 1: x is gate | up and the kernel multiplies silu(gate) * up (matmul's silu)
    A: int = 0          # 1: two n-tiles as the mma's A operand, x as B (half the mma of A = x)
    G: int = 0          # > 0: at most G CTAs an SM, each looping over blocks (x staged once a CTA)
    GLU: int = 0        # 1: W is gate | up and the output silu(gate) * up (N / 2 values; ``glu``)
    R: int = 0          # > 0: codes and scales through a ring of R chunks a warp in shared memory (cp.async)

    def fits(self, N: int, K: int) -> str | None:
        """None when this shape can run ``N x K``, else why not."""
        KO = K // 128
        if self.A and self.NT % 2:
            return f"NT = {self.NT} n-tiles with A = 1 (pairs of n-tiles)"
        if self.R and not (self.A and self.U == 1):
            return f"R = {self.R} (the ring) with A = {self.A}, U = {self.U} (it takes A = 1, U = 1)"
        if self.GLU and (N % 16 or self.NT % (4 if self.A else 2)):
            return (f"GLU over N = {N} rows with NT = {self.NT} (gate and up halves of whole n-tiles, "
                    f"NT / 2 of each a block{', in pairs' if self.A else ''})")
        if KO % self.W:
            return f"K / 128 = {KO} chunks not a multiple of W = {self.W} warps"
        if (KO // self.W) % self.U:
            return f"{KO // self.W} chunks a warp not a multiple of U = {self.U}"
        return None

    def smem(self, K: int) -> int:
        KO = K // 128
        ring = (-KO % 4) * 4 + self.W * self.R * self.NT * (512 + 128) if self.R else 0
        return KO * 256 + KO * 4 + self.W * self.NT * 8 * 4 + ring


# (NT, U, P, G) per (N, K) of the 8B llama's decode GEMVs: the H200 sweep's fastest (bench/gemv.py
# --cuda, 2026-12-02); other shapes take (2, 1, 1, 0). W, the warps splitting K, is a function of K
# alone (``warps``): it sets the order of a row's float32 sums, so a merged GEMV's outputs keep the
# bits of each projection's own call (``linear.merge_tiles``), whatever N.
PINNED = {(6144, 4096): (2, 1, 1, 0), (4096, 4096): (2, 1, 1, 0), (28672, 4096): (4, 1, 1, 0),
          (4096, 14336): (2, 1, 1, 0)}
WARPS_BY_K = {4096: 8, 14336: 16}
# Whether the default shapes put two n-tiles in the mma's A operand (``Config.A``): on, the step
# 7.6 % faster than with x as A on the H200 (379.4 vs 352.8 tok/s, 2026-12-02).
SWAP = 1
# Whether the fused decode step multiplies silu(gate) * up inside the down GEMV (``silu_down``):
# off, measured slower on the H200 (its prologue costs more than the launch it saves: 375.8 vs
# 379.4 tok/s with SWAP, 349.2 vs 352.8 without, 2026-12-02).
FUSE_SILU = False
# Whether the fused decode step takes silu(gate) * up straight from the merged gate|up GEMV
# (``glu``: the block's gate and up rows in one CTA, silu_mul in its epilogue -- one launch and the
# gate|up output's round trip less a layer, the same bits as the GEMV then ``silu_mul``).
FUSE_GLU = False


# Chunk slots a warp of the default shapes streams through shared memory (``Config.R``; 0: off,
# the codes go through registers). bench/decode.py's variant graphs_ring measures 4.
RING = 0


def warps(K: int) -> int:
    """The warps a CTA splitting K (each a whole number of 128-column chunks)."""
    if K in WARPS_BY_K:
        return WARPS_BY_K[K]
    return next(w for w in (8, 4, 2, 1) if (K // 128) % w == 0)


def default_config(N: int, K: int) -> Config:
    """The shape used when none is given: a pure function of ``N x K`` (and ``SWAP``)."""
    nt, u, p, g = PINNED.get((N, K), (2, 1, 1, 0))
    cfg = Config(nt, warps(K), u, p, A=SWAP, G=g, R=RING if SWAP and u == 1 else 0)
    return cfg if cfg.fits(N, K) is None else Config(2, warps(K), 1, 1, A=SWAP, R=RING if SWAP else 0)


def glu_config(N: int, K: int) -> Config:
    """``matmul``'s shape with ``glu``: the plain call's (``default_config``) where its NT fits, else
    NT 4 (two n-tiles of gate, two of up) -- the same W, so the same bits a row."""
    cfg = dataclasses.replace(default_config(N, K), GLU=1)
    return cfg if cfg.fits(N, K) is None else dataclasses.replace(cfg, NT=4)


def supports(x: torch.Tensor, N: int, K: int, group: int) -> str | None:
    """None when the kernel takes this call, else why not (the caller keeps its other kernel)."""
    if x.device.type != "cuda":
        return f"device type {x.device.type}"
    if x.dtype != torch.bfloat16:
        return f"{x.dtype} activations"
    if x.numel() != K:
        return f"{x.numel() // max(K, 1)} rows (the kernel takes one)"
    if group != 128:
        return f"scale group {group} (the kernel takes 128)"
    if N % 8 or K % 128:
        return f"shape {N} x {K} (N a multiple of 8, K of 128)"
    if K > 65536:
        return f"K = {K} input features (x is staged in shared memory: at most 65536)"
    return None


class Kernels:
    """The compiled kernels of one process, one per ``Config`` (``compile`` is
    ``torch.cuda._compile_kernel`` or, in tests, a stand-in with its signature)."""

    def __init__(self, compile=None):
        self._compile = compile
        self._cache: dict = {}

    def get(self, cfg: Config):
        cfg = dataclasses.replace(cfg, G=0)       # the grid is the launch's, not the source's
        k = self._cache.get(cfg)
        if k is None:
            compile = self._compile or torch.cuda._compile_kernel
            opts = [f"-DNT={cfg.NT}", f"-DW={cfg.W}", f"-DU={cfg.U}", f"-DPIPE={cfg.P}",
                    f"-DSILU={cfg.S}", f"-DSWAP={cfg.A}", f"-DGLU={cfg.GLU}", f"-DRING={cfg.R}", "-std=c++17"]
            k = compile(SOURCE, "int4_gemv_m1", nvcc_options=opts + ["-DLOADS_ONLY"] * cfg.LO)
            self._cache[cfg] = k
        return k


KERNELS = Kernels()


def matmul(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, N: int, K: int,
           cfg: Config | None = None, kernels: Kernels | None = None,
           out: torch.Tensor | None = None, silu: bool = False, glu: bool = False) -> torch.Tensor:
    """``x [1, K] @ W.T`` -> ``[1, N]`` bfloat16, ``W`` in the tile layout ``words`` with its
    ``[K/128, N, 2]`` scales ``sz`` (group 128). ``supports`` must have said yes. ``silu``: ``x``
    is ``[1, 2K]``, gate then up, and the product is taken with ``silu(gate) * up`` (rounded as
    ``decode.kernels.silu_mul`` rounds it) -- that kernel and this one's input in one launch.
    ``glu``: ``W`` is gate | up (``N / 2`` rows each) and the result ``silu(gate) * up``, ``[1, N / 2]``:
    each row's sum as the plain call rounds it, then ``silu_mul``'s rounding (``glu_config``)."""
    cfg = dataclasses.replace(cfg or (glu_config(N, K) if glu else default_config(N, K)), S=int(silu),
                              GLU=int(glu))
    if x.numel() != (2 * K if silu else K):
        raise ValueError(f"int4 GEMV input of {x.numel()} values for K = {K}"
                         + (" (silu: gate and up, 2K)" if silu else ""))
    why = cfg.fits(N, K)
    if why:
        raise ValueError(f"int4 GEMV config {cfg} for {N} x {K}: {why}")
    if x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)    # 16-byte loads of x
    if words.data_ptr() % 16 or sz.data_ptr() % 8 or not (words.is_contiguous()
                                                           and sz.is_contiguous()):
        raise ValueError("int4 GEMV operands must be contiguous, the codes 16-byte and the "
                         "scales 8-byte aligned")
    rows = N // 2 if glu else N
    y = out if out is not None else torch.empty((1, rows), dtype=torch.bfloat16, device=x.device)
    k = (kernels or KERNELS).get(cfg)
    smem = cfg.smem(K)
    if smem >= 48 * 1024 and getattr(k, "_max_shared_mem_bytes", 0) < smem:
        k.set_shared_memory_config(smem)
    blocks = -(-(N // 16) // (cfg.NT // 2)) if glu else -(-(N // 8) // cfg.NT)
    if cfg.G:
        blocks = min(blocks, cfg.G * _sms(x.device))
    k(grid=(blocks, 1, 1), block=(32 * cfg.W, 1, 1),
      args=[x, words, sz, y, N, K], shared_mem=smem)
    return y


_failed: list = []
_SMS: dict = {}


def _sms(device) -> int:
    """Streaming multiprocessors of ``device`` (132 on an H200; the CPU stand-in: 1)."""
    if device.type != "cuda":
        return 1
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def layer_matmul(x, words, sz, N, K):
    """``matmul`` for ``QuantLinear`` with the default shape; None (the layer then takes torch's
    int4 kernel) when the operands do not fit or the kernel cannot be compiled here -- logged once,
    and not tried again in this process."""
    if (_failed or words.data_ptr() % 16 or sz.data_ptr() % 8 or not words.is_contiguous()
            or not sz.is_contiguous()):
        return None
    try:
        return matmul(x, words, sz, N, K)
    except (RuntimeError, OSError) as exc:         # NVRTC missing or refusing
        _failed.append(f"{type(exc).__name__}: {exc}")
        log.warning("the CUDA int4 GEMV is not used: %s", _failed[0])
        return None


def silu_down(down, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``down(silu(gate) * up)`` in one launch (``matmul``'s ``silu``) for a ``QuantLinear`` the
    kernel takes (``ENABLED`` and ``FUSE_SILU``, one row, the tile layout with group 128, no bias) when ``up``
    follows ``gate`` in memory (the two halves of a merged gate|up GEMV's output); None otherwise
    (the caller multiplies and calls the layer)."""
    if (not (ENABLED and FUSE_SILU) or getattr(down, "_tiles_group", 0) != 128
            or down.bias is not None):
        return None
    K, N = down.in_features, down.out_features
    if (supports(gate, N, K, 128) is not None or up.numel() != K or up.dtype != gate.dtype
            or not (gate.is_contiguous() and up.is_contiguous())
            or up.data_ptr() != gate.data_ptr() + K * gate.element_size()):
        return None
    gu = gate.as_strided((1, 2 * K), (2 * K, 1))
    y = _guarded(down, lambda: matmul(gu, down.codes, down.scales, N, K, silu=True))
    return None if y is None else y.view(*gate.shape[:-1], N)


def glu(gate_up, x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of a merged gate|up ``QuantLinear`` (``N / 2`` rows each) in one launch
    (``matmul``'s ``glu``) where the kernel takes it (``ENABLED`` and ``FUSE_GLU``, one row, the
    tile layout with group 128, no bias); None otherwise (the caller runs the GEMV and ``silu_mul``)."""
    if (not (ENABLED and FUSE_GLU) or getattr(gate_up, "_tiles_group", 0) != 128
            or gate_up.bias is not None):
        return None
    K, N = gate_up.in_features, gate_up.out_features
    if supports(x, N, K, 128) is not None or glu_config(N, K).fits(N, K) is not None:
        return None
    y = _guarded(gate_up, lambda: matmul(x.reshape(1, K), gate_up.codes, gate_up.scales, N, K, glu=True))
    return None if y is None else y.view(*x.shape[:-1], N // 2)


def _guarded(layer, call):
    """``call()`` unless the kernel failed to compile before or ``layer``'s operands are off
    alignment (None); a compile failure is logged once and not tried again in this process."""
    if _failed or layer.codes.data_ptr() % 16 or layer.scales.data_ptr() % 8:
        return None
    try:
        return call()
    except (RuntimeError, OSError) as exc:         # NVRTC missing or refusing
        _failed.append(f"{type(exc).__name__}: {exc}")
        log.warning("the CUDA int4 GEMV is not used: %s", _failed[0])
        return None
