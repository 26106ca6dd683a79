"""The batch-1 int4 GEMV in CUDA C++ (compiled at run time through NVRTC, ``torch.cuda._compile_kernel``),
on the tile layout the host tier already stores (torch's CUDA int4 layout, ``inner_k_tiles`` 8;
``int4pack.cuda_layout``) and its ``[K/group, N, 2]`` bfloat16 (scale, zero) pairs, zero 0
(``int4pack.scales_and_zeros``): nothing repacked, nothing derived.

Why CUDA C++: a batch-1 int4 GEMV streams 1/4 byte a weight, so at the copy rate an H200 SM must
retire ~33 weights a cycle. Turning each nibble into a float32 and one FMA costs ~3 instructions a
weight (the Triton kernels of ``quant.gemv``: 33-38 SASS a 32-bit word), which is already the SM's
whole issue rate. Here the tensor cores do the multiply: per 32-bit word four ``lop3`` (plus three
shifts) give four bfloat16x2 registers ``128 + q`` that *are* the B fragments of
``mma.m16n8k16`` in this layout (``gemv._mma_asm`` says how), and two ``mma`` consume them:
~10 instructions a word.

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

The arithmetic is ``gemv.mma_reference`` (split 1): the CPU tests hold that to the dequantize +
matmul allowance and check this module's launch path with a fake compiler; the GPU tests run the
kernel against it and torch's int4 kernel.
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

// Issue the loads of chunks c .. c + U - 1 (all before any use).
__device__ __forceinline__ void load(Batch& b, const u32* __restrict__ words,
                                     const u32* __restrict__ sz, int c, int nt0, int ntl,
                                     int KO, int N, int lane) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int nt = min(nt0 + j, ntl);
            ld_stream(b.w[u][j], words + ((size_t)(nt * KO + c + u) * 32 + lane) * 4);
#if SWAP
            b.s[u][j] = sz[(size_t)(c + u) * N + nt * 8 + (lane >> 2)];
#else
            b.s[u][j] = *(const uint2*)(sz + ((size_t)(c + u) * N + nt * 8 + 2 * (lane & 3)));
#endif
        }
    }
}

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
    float* part = xsum + KO;                          // [W][NT*8]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int r = lane & 3;
    const int cpw = KO / W;                   // chunks a warp (KO % W == 0, cpw % U == 0)
    const int c0 = warp * cpw;
    const int ntl = (N >> 3) - 1;
    const int nblk = (ntl + NT) / NT;         // blocks of NT n-tiles; a CTA takes blockIdx.x,
                                              // then every gridDim.x-th (a grid smaller than
                                              // nblk stages x once for several blocks)
    Batch A, B;
#if PIPE
    load(A, words, sz, c0, blockIdx.x * NT, ntl, KO, N, lane);
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
    const int nt0 = blk * NT;
    float acc[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = 0.f;
#if PIPE
    if (blk != blockIdx.x) load(A, words, sz, c0, nt0, ntl, KO, N, lane);
    for (int cb = 0; cb < cpw; cb += 2 * U) {
        if (cb + U < cpw) load(B, words, sz, c0 + cb + U, nt0, ntl, KO, N, lane);
        compute(A, acc, xf, xsum, c0 + cb, r);
        if (cb + 2 * U < cpw) load(A, words, sz, c0 + cb + 2 * U, nt0, ntl, KO, N, lane);
        if (cb + U < cpw) compute(B, acc, xf, xsum, c0 + cb + U, r);
    }
#else
    for (int cb = 0; cb < cpw; cb += U) {
        load(A, words, sz, c0 + cb, nt0, ntl, KO, N, lane);
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
    if (tid < NT * 8) {
        float s = 0.f;
#pragma unroll
        for (int w2 = 0; w2 < W; ++w2) s += part[w2 * NT * 8 + tid];
        const int n = nt0 * 8 + tid;
        if (n < N) y[n] = to_bf16(s);
    }
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

    def fits(self, N: int, K: int) -> str | None:
        """None when this shape can run ``N x K``, else why not."""
        KO = K // 128
        if self.A and self.NT % 2:
            return f"NT = {self.NT} n-tiles with A = 1 (pairs of n-tiles)"
        if KO % self.W:
            return f"K / 128 = {KO} chunks not a multiple of W = {self.W} warps"
        if (KO // self.W) % self.U:
            return f"{KO // self.W} chunks a warp not a multiple of U = {self.U}"
        return None

    def smem(self, K: int) -> int:
        return (K // 128) * 256 + (K // 128) * 4 + self.W * self.NT * 8 * 4


# (NT, U, P) per (N, K) of the 8B llama's decode GEMVs: the H200 sweep's fastest (bench/gemv.py
# --cuda, 2026-12-02); other shapes take (2, 1, 1). W, the warps splitting K, is a function of K
# alone (``warps``): it sets the order of a row's float32 sums, so a merged GEMV's outputs keep the
# bits of each projection's own call (``linear.merge_tiles``), whatever N.
PINNED = {(6144, 4096): (2, 1, 1), (4096, 4096): (2, 1, 1), (28672, 4096): (4, 1, 1),
          (4096, 14336): (2, 1, 1)}
WARPS_BY_K = {4096: 8, 14336: 16}
# Whether the default shapes put two n-tiles in the mma's A operand (``Config.A``): off until the
# H200 has run it (the CPU stand-in and NVRTC have).
SWAP = 0
# Whether the fused decode step multiplies silu(gate) * up inside the down GEMV (``silu_down``):
# off until the H200 has run it.
FUSE_SILU = False


def warps(K: int) -> int:
    """The warps a CTA splitting K (each a whole number of 128-column chunks)."""
    if K in WARPS_BY_K:
        return WARPS_BY_K[K]
    return next(w for w in (8, 4, 2, 1) if (K // 128) % w == 0)


def default_config(N: int, K: int) -> Config:
    """The shape used when none is given: a pure function of ``N x K`` (and ``SWAP``)."""
    nt, u, p = PINNED.get((N, K), (2, 1, 1))
    cfg = Config(nt, warps(K), u, p, A=SWAP)
    return cfg if cfg.fits(N, K) is None else Config(2, warps(K), 1, 1, A=SWAP)


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
                    f"-DSILU={cfg.S}", f"-DSWAP={cfg.A}", "-std=c++17"]
            k = compile(SOURCE, "int4_gemv_m1", nvcc_options=opts + ["-DLOADS_ONLY"] * cfg.LO)
            self._cache[cfg] = k
        return k


KERNELS = Kernels()


def _bf16_bits_to_float(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The low and high bfloat16 halves of int64-held 32-bit words as float32."""
    lo = ((v & 0xFFFF) << 16).to(torch.int32).view(torch.float32)
    hi = (v & 0xFFFF0000).to(torch.int32).view(torch.float32)
    return lo, hi


class Emulated:
    """A CPU stand-in for one compiled kernel, with the call signature of torch's
    (``grid``, ``block``, ``args``, ``shared_mem``): the kernel's index arithmetic statement by
    statement, vectorized over CTAs, warps and lanes, each ``mma.m16n8k16`` assembled from the
    lanes' fragments as the PTX ISA lays them out and multiplied in float64 (float32 sums: the
    tensor cores' order is theirs). What the CPU tests run the launch path and the layout through."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.calls = []

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        cfg = self.cfg
        x, words, sz, y, N, K = args
        self.calls.append(dict(grid=grid, block=block, shared_mem=shared_mem, N=N, K=K))
        assert block == (32 * cfg.W, 1, 1) and shared_mem == cfg.smem(K)
        KO = K // 128
        xv = x.reshape(-1)
        if cfg.S:       # silu(gate) * up, rounded as decode.kernels.silu_mul
            g, u = xv[:K].float(), xv[K:2 * K].float()
            a = (g / (1.0 + torch.exp2(g * -1.4426950408889634))).to(torch.bfloat16)
            xv = (a.float() * u).to(torch.bfloat16)
        xp = xv[:K].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF   # [K/2]
        e = torch.arange(K // 2)
        col, c = (e << 1) & 127, e >> 6
        kt, h, rr = col >> 4, (col >> 3) & 1, (col >> 1) & 3
        xf = torch.empty(KO * 64, dtype=torch.int64)
        xf[((c * 4 + rr) * 8 + kt) * 2 + h] = xp
        lane = torch.arange(32)
        a_lo, a_hi = _bf16_bits_to_float(xf.view(KO, 32, 2))    # lane: words 2 lane, 2 lane + 1
        s = (a_lo[..., 0] + a_hi[..., 0]) + (a_lo[..., 1] + a_hi[..., 1])        # [KO, 32]
        for o in (16, 8, 4, 2, 1):
            s = s + s[:, lane ^ o]
        xsum = s[:, 0]
        wd = words.reshape(-1).to(torch.int64) & 0xFFFFFFFF
        szp = sz.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF       # [K/128 * N]
        nb = -(-(N // 8) // cfg.NT)          # every block, whichever CTA of the grid takes it
        assert 1 <= grid[0] <= nb
        cpw = KO // cfg.W
        g, r = lane // 4, lane % 4
        blk = torch.arange(nb)[:, None, None]
        warp = torch.arange(cfg.W)[None, :, None]
        ln = lane[None, None, :]
        acc = torch.zeros(cfg.NT, 2, nb, cfg.W, 32, dtype=torch.float32)
        for j in range(cpw):
            c = warp * cpw + j                                                   # [1, W, 1]
            a = xf[((c * 4 + r[None, None, :]) * 16)[..., None] + torch.arange(16)]   # [1,W,32,16]
            bias = -136.0 * xsum[c]                                              # [1, W, 1]
            wv, sv = [], []
            for t in range(cfg.NT):
                nt = torch.clamp(blk * cfg.NT + t, max=N // 8 - 1)               # [nb, 1, 1]
                base = ((nt * KO + c) * 32 + ln) * 4                             # [nb, W, 32]
                wv.append([wd[base + i] for i in range(4)])
                sv.append(c * N + nt * 8 + (g[None, None, :] if cfg.A else 2 * r[None, None, :]))
            zero = torch.zeros(nb, cfg.W, 32)
            for t in range(0, cfg.NT, 2 if cfg.A else 1):
                d = [bias.expand(nb, cfg.W, 32).clone() for _ in range(2 if not cfg.A else 4)]
                d += [zero.clone() for _ in range(4 - len(d))]
                e = [zero.clone() for _ in range(4)]
                for i in range(4):
                    v = [[((w[i] >> (4 * q)) & 0x000F000F) | 0x43004300 for q in range(4)]
                         for w in wv[t:t + 2]]
                    x0, x1, x2, x3 = (a[..., 4 * i + k] for k in range(4))
                    if cfg.A:       # n-tiles t, t + 1 as A (rows g, g + 8), x as B
                        d = _mma(d, (v[0][0], v[1][0], v[0][1], v[1][1]), (x0, x1))
                        e = _mma(e, (v[0][2], v[1][2], v[0][3], v[1][3]), (x2, x3))
                    else:
                        d = _mma(d, (x0, None, x1, None), (v[0][0], v[0][1]))
                        d = _mma(d, (x2, None, x3, None), (v[0][2], v[0][3]))
                if cfg.A:
                    for k, tt in ((0, t), (2, t + 1)):
                        s0 = _bf16_bits_to_float(szp[sv[tt]])[0]
                        acc[tt, 0] = ((d[k] + e[k]).double() * s0.double()
                                      + acc[tt, 0].double()).float()
                else:
                    s0 = _bf16_bits_to_float(szp[sv[t]])[0]
                    s1 = _bf16_bits_to_float(szp[sv[t] + 1])[0]
                    acc[t, 0] = (d[0].double() * s0.double() + acc[t, 0].double()).float()
                    acc[t, 1] = (d[1].double() * s1.double() + acc[t, 1].double()).float()
        # A: lanes 4g hold row g of each n-tile; else lanes 0..3 rows 2r, 2r+1. The warps' sums
        # are added in warp order.
        part = acc[:, 0, :, :, ::4] if cfg.A else acc[:, :, :, :, :4]
        tot = part[..., 0, :]
        for w in range(1, cfg.W):
            tot = tot + part[..., w, :]
        if cfg.A:                                                     # [NT, nb, 8]: t*8 + g
            rows = tot.permute(1, 0, 2).reshape(nb, cfg.NT * 8)
        else:                                                         # [NT, 2, nb, 4]: t*8+2r+h
            rows = tot.permute(2, 0, 3, 1).reshape(nb, cfg.NT * 8)
        yv = rows.reshape(-1)[:N].to(torch.bfloat16)
        y.view(-1)[:yv.numel()] = yv


def _mma(d, a, b):
    """One ``mma.m16n8k16.row.col.f32.bf16.bf16.f32`` over a warp's fragments (each [..., 32]
    lanes; None: a zero register), g = lane // 4, r = lane % 4: A registers ``a0..a3`` hold
    (row g, columns 2r, 2r+1), (g+8, 2r..), (g, 2r+8, 2r+9), (g+8, 2r+8..); B registers ``b0, b1``
    (rows 2r, 2r+1, column g), (2r+8, 2r+9, g); C/D ``d0..d3`` (g, 2r), (g, 2r+1), (g+8, 2r),
    (g+8, 2r+1). The products in float64, rounded once to float32 (the tensor cores' float32
    order is theirs)."""
    regs = [t for t in (*a, *b, *d) if t is not None]
    lead = torch.broadcast_shapes(*(t.shape for t in regs))[:-1]
    lane = torch.arange(32)
    g, r = lane // 4, lane % 4
    A = torch.zeros(*lead, 16, 16, dtype=torch.float64)
    B = torch.zeros(*lead, 16, 8, dtype=torch.float64)
    C = torch.zeros(*lead, 16, 8, dtype=torch.float64)
    for val, row, col in zip(a, (g, g + 8, g, g + 8), (2 * r, 2 * r, 2 * r + 8, 2 * r + 8)):
        if val is not None:
            lo, hi = _bf16_bits_to_float(val.expand(*lead, 32))
            A[..., row, col] = lo.double()
            A[..., row, col + 1] = hi.double()
    for val, row in zip(b, (2 * r, 2 * r + 8)):
        lo, hi = _bf16_bits_to_float(val.expand(*lead, 32))
        B[..., row, g] = lo.double()
        B[..., row + 1, g] = hi.double()
    C[..., g, 2 * r], C[..., g, 2 * r + 1] = d[0].double(), d[1].double()
    C[..., g + 8, 2 * r], C[..., g + 8, 2 * r + 1] = d[2].double(), d[3].double()
    D = (A @ B + C).float()
    return [D[..., g, 2 * r], D[..., g, 2 * r + 1], D[..., g + 8, 2 * r], D[..., g + 8, 2 * r + 1]]


def emulated_compile(source: str, name: str, nvcc_options=(), **_):
    """``torch.cuda._compile_kernel``'s stand-in: an ``Emulated`` kernel of the ``-D`` shape."""
    assert name == "int4_gemv_m1" and source == SOURCE
    opts = dict(o[2:].split("=") for o in nvcc_options if o.startswith("-D") and "=" in o)
    assert "-DLOADS_ONLY" not in nvcc_options, "the stand-in emulates the kernel, not the aid"
    return Emulated(Config(int(opts["NT"]), int(opts["W"]), int(opts["U"]), int(opts["PIPE"]),
                           S=int(opts["SILU"]), A=int(opts["SWAP"])))


def matmul(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, N: int, K: int,
           cfg: Config | None = None, kernels: Kernels | None = None,
           out: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """``x [1, K] @ W.T`` -> ``[1, N]`` bfloat16, ``W`` in the tile layout ``words`` with its
    ``[K/128, N, 2]`` scales ``sz`` (group 128). ``supports`` must have said yes. ``silu``: ``x``
    is ``[1, 2K]``, gate then up, and the product is taken with ``silu(gate) * up`` (rounded as
    ``decode.kernels.silu_mul`` rounds it) -- that kernel and this one's input in one launch."""
    cfg = dataclasses.replace(cfg or default_config(N, K), S=int(silu))
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
    y = out if out is not None else torch.empty((1, N), dtype=torch.bfloat16, device=x.device)
    k = (kernels or KERNELS).get(cfg)
    smem = cfg.smem(K)
    if smem >= 48 * 1024 and getattr(k, "_max_shared_mem_bytes", 0) < smem:
        k.set_shared_memory_config(smem)
    blocks = -(-(N // 8) // cfg.NT)
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
    if _failed or down.codes.data_ptr() % 16 or down.scales.data_ptr() % 8:
        return None
    try:
        y = matmul(gu, down.codes, down.scales, N, K, silu=True)
    except (RuntimeError, OSError) as exc:         # NVRTC missing or refusing
        _failed.append(f"{type(exc).__name__}: {exc}")
        log.warning("the CUDA int4 GEMV is not used: %s", _failed[0])
        return None
    return y.view(*gate.shape[:-1], N)
