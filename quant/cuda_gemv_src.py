"""The CUDA C++ source of ``quant.cuda_gemv``'s batch-1 int4 GEMV (compiled at run time through NVRTC;
``cuda_gemv.Config`` sets its ``-D`` shape: NT, W, U, PIPE, SILU, SWAP, GLU, RING, NORM). What each
mode does is said beside its code; ``cuda_gemv`` documents the kernel as a whole."""

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
#ifndef NORM
#define NORM 0
#endif
#ifndef PDL
#define PDL 0
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

// NORM: x is a sub-block's output and res the residual; what is staged is decode.kernels.add_rms_norm's
// output: h = bf16(res + x), bf16(nw * bf16(h * (1 / sqrt(mean(h^2) + eps)))) (sqrt.approx and
// div.full, as Triton's sqrt and division), h written to res_out by CTA 0.
__device__ __forceinline__ u32 add_pair(u32 a, u32 b) {
    return (u32)to_bf16(bf16_lo(a) + bf16_lo(b)) | ((u32)to_bf16(bf16_hi(a) + bf16_hi(b)) << 16);
}
__device__ __forceinline__ float sq_pair(u32 h) { return bf16_lo(h) * bf16_lo(h) + bf16_hi(h) * bf16_hi(h); }
__device__ __forceinline__ u32 norm_pair(u32 h, u32 w, float inv) {
    const u16 lo = to_bf16(bf16_lo(h) * inv), hi = to_bf16(bf16_hi(h) * inv);
    return (u32)to_bf16(bf16_lo(w) * __uint_as_float((u32)lo << 16))
           | ((u32)to_bf16(bf16_hi(w) * __uint_as_float((u32)hi << 16)) << 16);
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
             const u32* __restrict__ sz, u16* __restrict__ y, int N, int K,
             const uint4* __restrict__ res, const uint4* __restrict__ nw, uint4* __restrict__ res_out,
             double eps) {
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
#if PDL
    // launched with programmatic dependent launch (quant.cuda_launch): the next kernel may start
    // once every CTA got here; the codes' first loads are out, the input is read after the
    // kernel before this one has finished
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    // Stage x: 8 columns 8 e .. 8 e + 7 of chunk c are pairs r = 0..3 of half h of k-tile kt.
    // SILU: x is gate | up ([2K]); what is staged is silu(gate) * up.
#if NORM
    float ss = 0.f;
    for (int e = tid; e < (K >> 3); e += 32 * W) {
        const uint4 a = x[e], b = res[e];
        uint4 v;
        v.x = add_pair(b.x, a.x); v.y = add_pair(b.y, a.y); v.z = add_pair(b.z, a.z); v.w = add_pair(b.w, a.w);
        ss += (sq_pair(v.x) + sq_pair(v.y)) + (sq_pair(v.z) + sq_pair(v.w));
        if (blockIdx.x == 0) res_out[e] = v;
        const int col = (e << 3) & 127, c = e >> 4;
        const int base = ((c * 4) * 8 + (col >> 4)) * 2 + ((col >> 3) & 1);
        xf[base] = v.x; xf[base + 16] = v.y; xf[base + 32] = v.z; xf[base + 48] = v.w;
    }
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) part[warp] = ss;
    __syncthreads();
    float tot = 0.f;
#pragma unroll
    for (int w2 = 0; w2 < W; ++w2) tot += part[w2];
    float root, inv;
    asm("sqrt.approx.f32 %0, %1;" : "=f"(root) : "f"(tot / (float)K + (float)eps));
    asm("div.full.f32 %0, %1, %2;" : "=f"(inv) : "f"(1.f), "f"(root));
    for (int e = tid; e < (K >> 3); e += 32 * W) {     // the words this thread staged above
        const uint4 g = nw[e];
        const int col = (e << 3) & 127, c = e >> 4;
        const int base = ((c * 4) * 8 + (col >> 4)) * 2 + ((col >> 3) & 1);
        xf[base] = norm_pair(xf[base], g.x, inv); xf[base + 16] = norm_pair(xf[base + 16], g.y, inv);
        xf[base + 32] = norm_pair(xf[base + 32], g.z, inv); xf[base + 48] = norm_pair(xf[base + 48], g.w, inv);
    }
#else
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
#endif
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
