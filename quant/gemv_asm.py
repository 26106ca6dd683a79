"""The PTX of one warp's work in the tensor-core int4 kernel of ``quant.gemv`` (``_int4_tiles_mma``):
the text its inline asm block runs, generated per tile shape. Kept apart from the kernels that
embed it; ``tests/quant/ptx_warp.py`` executes it lane by lane on the CPU."""
from __future__ import annotations


def _mma_asm(NT: int, BC: int, GROUP: int, PF: int = 0, S: int = 1, LO: int = 0) -> str:
    """PTX of one warp's work in the tensor-core int4 kernel (``_int4_tiles_mma``): ``S`` steps of
    ``NT`` n-tiles (8 output rows each) times ``BC`` chunks (128 input columns each) of the tile
    layout; step ``s`` takes the n-tiles ``s * $10 + warp * NT + j`` (``$10``: the program's
    n-tiles per step).

    Lane ``t`` (``g = t // 4``, ``r = t % 4``) loads its 16 bytes of each (n-tile, chunk): words
    ``i = 0..3`` of row ``g`` of the n-tile, whose nibble ``p = 4b + a`` is column
    ``32i + 2r + 8a + b`` (``int4pack.cuda_layout``). That is the ``mma.m16n8k16`` B fragment as it
    stands: for k-tile ``2i + a // 2`` of the chunk, register ``b0`` holds columns ``2r, 2r+1``
    (nibbles ``a`` and ``a + 4``: bits ``4a`` and ``16 + 4a``) and ``b1`` columns ``2r+8, 2r+9``
    (``a + 1``, ``a + 5``). ``((w >> 4a) & 0x000F000F) | 0x43004300`` -- one shift, one ``lop3``
    -- puts both nibbles of a pair in the mantissas of bfloat16 128.0: ``128 + q`` exactly. The A
    fragment is x, loaded once: row ``g`` (a row ``>= M`` reads row ``M - 1`` and is never stored;
    rows 8..15 are zero registers), columns ``2r, 2r+1`` and ``2r+8, 2r+9`` of each k-tile. Each
    scale group's accumulator starts at ``-136 * sum(x)`` over the group (the tensor cores with B
    all -136, once), so it ends at ``sum x * (q - 8)`` in float32; one float32 FMA applies the
    group's scale. Lanes of rows ``g < M`` store their two float32 sums per n-tile (columns
    ``2r, 2r+1``) to the split-K workspace. Loads are never predicated: an n-tile past the end
    re-reads the last valid one and is not stored. With ``S > 1`` the weights of step ``s + 1``
    are loaded (into a second set of registers) before step ``s`` is computed. ``PF`` (``S``
    1): lane 0 first asks the L2 for the same chunks of the n-tiles ``$10`` further on, where the
    program has them -- its next call (``cp.async.bulk.prefetch``, no registers held). ``LO``: a
    measurement aid, not a kernel -- the same loads and stores with the arithmetic replaced by an
    xor of the loaded words (wrong results; ``bench/gemv.py`` times it as the access pattern's own
    ceiling)."""
    gp = 128 // GROUP            # scale groups per chunk
    tiles = GROUP // 16          # k16 tiles per group
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    zero4 = "{0f00000000, 0f00000000, 0f00000000, 0f00000000}"
    nw, ns = NT * BC * 4, NT * BC * gp * 2
    L = []
    e = L.append
    e("{")
    e(".reg .pred pg, pst;")
    e(".reg .b32 lane, wid, g, gx, r, ntl, nt, nlast, tmp, zr, bneg, q0, q1, sc0, sc1;")
    for buf in "AB"[:min(S, 2)]:
        e(".reg .b32 w%s<%d>, s%s<%d>;" % (buf, nw, buf, ns))
    e(".reg .b32 xa<%d>, xb<%d>;" % (BC * 8, BC * 8))
    e(".reg .f32 bias<%d>, acc<%d>, d<4>;" % (BC * gp * 4, NT * 2))
    e(".reg .b64 wa, sa, xr, ob, oa, t64, n464;")
    e("mov.u32 lane, %laneid;")
    e("mov.u32 tmp, %tid.x;")
    e("shr.u32 wid, tmp, 5;")
    e("shr.u32 g, lane, 2;")
    e("and.b32 r, lane, 3;")
    e("mov.b32 zr, 0;")
    e("mov.b32 bneg, 0xC308C308;")                  # bfloat16 -136, twice
    e("cvt.u64.u32 n464, $7;")
    e("mul.lo.u32 ntl, wid, %d;" % NT)
    e("sub.u32 nlast, $5, 1;")
    e("setp.lt.u32 pg, g, $8;")
    if PF and S == 1:
        e(".reg .pred pp;")
        e(".reg .b64 pa;")
        for j in range(NT):
            e("add.u32 tmp, ntl, %d;" % j)
            e("add.u32 tmp, tmp, $10;")
            e("setp.lt.u32 pp, tmp, $5;")
            e("setp.eq.and.u32 pp, lane, 0, pp;")
            e("mul.wide.u32 t64, tmp, $6;")
            e("add.s64 pa, $1, t64;")
            e("@pp cp.async.bulk.prefetch.L2.global [pa], %d;" % (BC * 512))

    def n_tile(step, j):             # nt = step * $10 + ntl + j
        e("add.u32 nt, ntl, %d;" % j)
        if step:
            e("mad.lo.u32 nt, $10, %d, nt;" % step)

    def load(step, buf):
        for j in range(NT):
            n_tile(step, j)
            e("min.u32 tmp, nt, nlast;")
            # weights: w_base + n-tile * ntstride + lane * 16 (+ c * 512)
            e("mul.wide.u32 t64, tmp, $6;")
            e("add.s64 wa, $1, t64;")
            e("mul.wide.u32 t64, lane, 16;")
            e("add.s64 wa, wa, t64;")
            # scales: s_base + n-tile * 32 + r * 8 (+ (c * gp + h) * N * 4)
            e("shl.b32 tmp, tmp, 5;")
            e("mad.lo.u32 tmp, r, 8, tmp;")
            e("cvt.u64.u32 t64, tmp;")
            e("add.s64 sa, $2, t64;")
            for c in range(BC):
                k = (j * BC + c) * 4
                e("ld.global.nc.L1::no_allocate.v4.u32 {w%s%d, w%s%d, w%s%d, w%s%d}, [wa+%d];"
                  % (buf, k, buf, k + 1, buf, k + 2, buf, k + 3, c * 512))
            for ch in range(BC * gp):
                k = (j * BC * gp + ch) * 2
                e("ld.global.nc.v2.u32 {s%s%d, s%s%d}, [sa];" % (buf, k, buf, k + 1))
                if ch + 1 < BC * gp:
                    e("add.s64 sa, sa, n464;")

    def compute(step, buf):
        for j in range(NT):
            e("mov.f32 acc%d, 0f00000000;" % (2 * j))
            e("mov.f32 acc%d, 0f00000000;" % (2 * j + 1))
        for j in range(NT if LO else 0):
            e("mov.b32 q0, 0;")
            for k in range((j * BC) * 4, (j * BC + BC) * 4):
                e("xor.b32 q0, q0, w%s%d;" % (buf, k))
            for k in range(j * BC * gp * 2, (j + 1) * BC * gp * 2):
                e("xor.b32 q0, q0, s%s%d;" % (buf, k))
            e("mov.b32 acc%d, q0;" % (2 * j))
        for j in range(0 if LO else NT):
            for c in range(BC):
                for h in range(gp):
                    b = (c * gp + h) * 4
                    for tt in range(tiles):
                        t = h * tiles + tt
                        word = "w%s%d" % (buf, (j * BC + c) * 4 + t // 2)
                        i = c * 8 + t
                        if t % 2 == 0:
                            e("lop3.b32 q0, %s, 0x000F000F, 0x43004300, 0xEA;" % word)
                            e("shr.u32 tmp, %s, 4;" % word)
                        else:
                            e("shr.u32 tmp, %s, 8;" % word)
                            e("lop3.b32 q0, tmp, 0x000F000F, 0x43004300, 0xEA;")
                            e("shr.u32 tmp, %s, 12;" % word)
                        e("lop3.b32 q1, tmp, 0x000F000F, 0x43004300, 0xEA;")
                        src = ("{bias%d, bias%d, bias%d, bias%d}" % (b, b + 1, b + 2, b + 3)
                               if tt == 0 else "{d0, d1, d2, d3}")
                        e("%s {d0, d1, d2, d3}, {xa%d, zr, xb%d, zr}, {q0, q1}, %s;"
                          % (mma, i, i, src))
                    k = (j * BC * gp + c * gp + h) * 2
                    e("shl.b32 sc0, s%s%d, 16;" % (buf, k))
                    e("shl.b32 sc1, s%s%d, 16;" % (buf, k + 1))
                    e("fma.rn.f32 acc%d, d0, sc0, acc%d;" % (2 * j, 2 * j))
                    e("fma.rn.f32 acc%d, d1, sc1, acc%d;" % (2 * j + 1, 2 * j + 1))
        # the partial sums of rows g < M: ws_base + g * N * 4 + r * 8 + n-tile * 32
        for j in range(NT):
            n_tile(step, j)
            e("setp.lt.and.u32 pst, nt, $5, pg;")
            e("mul.wide.u32 t64, nt, 32;")
            e("add.s64 oa, ob, t64;")
            e("@pst st.global.v2.f32 [oa], {acc%d, acc%d};" % (2 * j, 2 * j + 1))

    load(0, "A")
    # activations: x_base + min(g, M - 1) * xstride + r * 4 (+ c * 256 + t * 32, + 16)
    e("sub.u32 gx, $8, 1;")
    e("min.u32 gx, g, gx;")
    e("mul.wide.u32 t64, gx, $9;")
    e("add.s64 xr, $3, t64;")
    e("mul.wide.u32 t64, r, 4;")
    e("add.s64 xr, xr, t64;")
    for c in range(BC):
        for t in range(8):
            i = c * 8 + t
            e("ld.global.b32 xa%d, [xr+%d];" % (i, c * 256 + t * 32))
            e("ld.global.b32 xb%d, [xr+%d];" % (i, c * 256 + t * 32 + 16))
    # each group's bias: -136 * the sum of its x, on the tensor cores
    for c in range(BC):
        for h in range(gp):
            b = (c * gp + h) * 4
            dst = "{bias%d, bias%d, bias%d, bias%d}" % (b, b + 1, b + 2, b + 3)
            for tt in range(tiles):
                i = c * 8 + h * tiles + tt
                e("%s %s, {xa%d, zr, xb%d, zr}, {bneg, bneg}, %s;"
                  % (mma, dst, i, i, zero4 if tt == 0 else dst))
    e("mul.wide.u32 t64, g, $7;")
    e("add.s64 ob, $4, t64;")
    e("mul.wide.u32 t64, r, 8;")
    e("add.s64 ob, ob, t64;")
    for step in range(S):
        if step + 1 < S:
            load(step + 1, "AB"[(step + 1) % 2])
        compute(step, "AB"[step % 2])
    e("mov.b32 $0, 0;")
    e("}")
    return "\n".join(L)
