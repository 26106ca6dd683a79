"""A CPU stand-in for ``quant.cuda_gemv``'s compiled kernel: ``Emulated`` executes the kernel's
index arithmetic statement by statement and each ``mma.m16n8k16``'s fragment layout (what the CPU
tests run the launch path and the layout through); ``emulated_compile`` is
``torch.cuda._compile_kernel``'s stand-in that returns one."""
from __future__ import annotations

import torch

from .cuda_gemv import SOURCE, Config


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
        x, words, sz, y, N, K, res, nw, res_out, eps = args
        self.calls.append(dict(grid=grid, block=block, shared_mem=shared_mem, N=N, K=K))
        assert block == (32 * cfg.W, 1, 1) and shared_mem == cfg.smem(K)
        KO = K // 128
        xv = x.reshape(-1)
        if cfg.NORM:    # add_rms_norm's rounding points (its float32 sum in torch's order)
            h = (res.reshape(-1).float() + xv.float()).to(torch.bfloat16)
            res_out.view(-1).copy_(h)
            var = (h.float() * h.float()).sum() / K
            normed = (h.float() * (1.0 / torch.sqrt(var + eps))).to(torch.bfloat16)
            xv = (nw.reshape(-1).float() * normed.float()).to(torch.bfloat16)
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
        half, hn = N // 16, cfg.NT // 2      # GLU: n-tiles of gate (then of up), of each a block
        nb = -(-half // hn) if cfg.GLU else -(-(N // 8) // cfg.NT)   # every block, whichever CTA takes it
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
                if cfg.GLU:
                    nt = (half if t >= hn else 0) + torch.clamp(blk * hn + t % hn, max=half - 1)
                else:
                    nt = torch.clamp(blk * cfg.NT + t, max=N // 8 - 1)           # [nb, 1, 1]
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
        if cfg.GLU:     # silu(gate) * up of each row's bfloat16 sums, rounded as silu_mul
            gate = rows[:, :cfg.NT * 4].reshape(-1)[:N // 2].to(torch.bfloat16).float()
            up = rows[:, cfg.NT * 4:].reshape(-1)[:N // 2].to(torch.bfloat16).float()
            a = (gate / (1.0 + torch.exp2(gate * -1.4426950408889634))).to(torch.bfloat16)
            yv = (a.float() * up).to(torch.bfloat16)
        else:
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
                           S=int(opts["SILU"]), A=int(opts["SWAP"]), GLU=int(opts["GLU"]),
                           R=int(opts["RING"]), NORM=int(opts["NORM"]), PDL=int(opts["PDL"])))
