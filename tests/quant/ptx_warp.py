"""A warp of 32 lanes executing the PTX that ``quant.gemv._mma_asm`` writes, in numpy, on the CPU:
the instructions it uses and nothing else (anything else raises), so the CPU tests check the asm
text itself -- addresses, lane mapping, shifts and masks, the m16n8k16 fragments, predicates --
not a transcription of it. Memory is one flat byte array; pointers are offsets into it plus
``BASE``. ``mma`` multiplies in float64 and rounds the sum to float32 (the tensor cores' own
summation order is not modelled)."""
from __future__ import annotations

import re

import numpy as np

BASE = 1 << 20
GAP = 1 << 16          # unowned bytes after each tensor: a read past one cannot land in the next
M32 = np.uint64(0xFFFFFFFF)


class Memory:
    def __init__(self, nbytes: int):
        self.buf = np.zeros(nbytes + 8 * (GAP + 256), dtype=np.uint8)
        self.top = 0
        self.regions = []           # (start, end) offsets of what was put: every access inside one

    def put(self, arr: np.ndarray, like: int = 0) -> int:
        """Copy ``arr`` in at an address congruent to ``like`` modulo 256 (the real pointer's
        alignment, so a misaligned operand stays misaligned); its address."""
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        off = self.top + like % 256
        self.buf[off:off + raw.size] = raw
        self.regions.append((off, off + raw.size))
        self.top = (off + raw.size + GAP + 255) // 256 * 256
        return BASE + off

    def get(self, addr: int, nbytes: int) -> np.ndarray:
        return self.buf[addr - BASE:addr - BASE + nbytes]

    def inside(self, off: np.ndarray, nbytes: int) -> bool:
        """Whether every ``[off, off + nbytes)`` lies within one tensor that was put."""
        ok = np.zeros(off.shape, dtype=bool)
        for start, end in self.regions:
            ok |= (off >= start) & (off + nbytes <= end)
        return bool(ok.all())

    def load32(self, addrs: np.ndarray) -> np.ndarray:
        off = addrs.astype(np.int64) - BASE
        b = self.buf
        assert self.inside(off, 4) and (off % 4 == 0).all(), off
        return (b[off].astype(np.uint64) | b[off + 1].astype(np.uint64) << np.uint64(8)
                | b[off + 2].astype(np.uint64) << np.uint64(16)
                | b[off + 3].astype(np.uint64) << np.uint64(24))

    def store32(self, addrs: np.ndarray, vals: np.ndarray, mask: np.ndarray):
        off = addrs.astype(np.int64) - BASE
        assert self.inside(off[mask], 4) and (off[mask] % 4 == 0).all()
        for k in np.nonzero(mask)[0]:
            self.buf[off[k]:off[k] + 4] = np.array([vals[k]], dtype=np.uint32).view(np.uint8)


def _f32(v):
    return (v & M32).astype(np.uint32).view(np.float32)


def _bits(f):
    return np.asarray(f, dtype=np.float32).view(np.uint32).astype(np.uint64)


def _bf16_pair(v):
    """uint32 lanes -> (low, high) bfloat16 halves as float64."""
    lo = _f32((v & np.uint64(0xFFFF)) << np.uint64(16)).astype(np.float64)
    hi = _f32(v & np.uint64(0xFFFF0000)).astype(np.float64)
    return lo, hi


def run(asm: str, args: list, mem: Memory, warp: int = 0) -> None:
    """Execute ``asm`` (operands ``$1..``: ``args``; ``$0`` the dummy output) for warp ``warp``
    of its program."""
    lanes = np.arange(32, dtype=np.uint64)
    reg: dict = {"%laneid": lanes, "%tid.x": lanes + np.uint64(32 * warp)}
    pred: dict = {}

    def val(tok):
        tok = tok.strip()
        if tok.startswith("$"):
            return np.full(32, np.uint64(args[int(tok[1:]) - 1] & 0xFFFFFFFFFFFFFFFF))
        if tok.startswith("0f"):
            return np.full(32, np.uint64(int(tok[2:], 16)))
        if re.fullmatch(r"-?(0x[0-9A-Fa-f]+|\d+)", tok):
            return np.full(32, np.uint64(int(tok, 0) & 0xFFFFFFFFFFFFFFFF))
        return reg[tok]

    def vec(tok):
        return [t.strip() for t in tok.strip()[1:-1].split(",")]

    def addr(tok):
        m = re.fullmatch(r"\[(\w+)(?:\+(\d+))?\]", tok.strip())
        return reg[m.group(1)] + np.uint64(int(m.group(2) or 0))

    for line in asm.splitlines():
        line = line.strip()
        if line in ("{", "}", "") or line.startswith(".reg"):
            continue
        for stmt in filter(None, (s.strip() for s in line.split(";"))):
            mask = np.ones(32, dtype=bool)
            if stmt.startswith("@"):
                p, stmt = stmt.split(None, 1)
                mask = ~pred[p[2:]] if p.startswith("@!") else pred[p[1:]]
            op, rest = stmt.split(None, 1)
            ops = _split(rest)
            d = ops[0]
            if op in ("mov.u32", "mov.b32", "mov.f32"):
                if d != "$0":
                    reg[d] = val(ops[1]) & M32
            elif op == "shr.u32":
                reg[d] = (val(ops[1]) & M32) >> val(ops[2])
            elif op == "shl.b32":
                reg[d] = (val(ops[1]) << val(ops[2])) & M32
            elif op == "xor.b32":
                reg[d] = (val(ops[1]) ^ val(ops[2])) & M32
            elif op == "and.b32":
                reg[d] = val(ops[1]) & val(ops[2]) & M32
            elif op == "add.u32":
                reg[d] = (val(ops[1]) + val(ops[2])) & M32
            elif op == "sub.u32":
                reg[d] = (val(ops[1]) - val(ops[2])) & M32
            elif op == "min.u32":
                reg[d] = np.minimum(val(ops[1]) & M32, val(ops[2]) & M32)
            elif op == "mul.lo.u32":
                reg[d] = (val(ops[1]) * val(ops[2])) & M32
            elif op == "mad.lo.u32":
                reg[d] = (val(ops[1]) * val(ops[2]) + val(ops[3])) & M32
            elif op == "mul.wide.u32":
                reg[d] = (val(ops[1]) & M32) * (val(ops[2]) & M32)
            elif op == "cvt.u64.u32":
                reg[d] = val(ops[1]) & M32
            elif op == "add.s64":
                reg[d] = val(ops[1]) + val(ops[2])
            elif op == "setp.lt.u32":
                pred[d] = (val(ops[1]) & M32) < (val(ops[2]) & M32)
            elif op == "setp.eq.and.u32":
                pred[d] = ((val(ops[1]) & M32) == (val(ops[2]) & M32)) & pred[ops[3]]
            elif op == "cp.async.bulk.prefetch.L2.global":        # a hint: check the range only
                base = addr(ops[0])[mask].astype(np.int64) - BASE
                assert mem.inside(base, int(ops[1]))
                assert (base % 16 == 0).all() and int(ops[1]) % 16 == 0
            elif op == "setp.lt.and.u32":
                pred[d] = ((val(ops[1]) & M32) < (val(ops[2]) & M32)) & pred[ops[3]]
            elif op == "lop3.b32":
                a, b, c, lut = (val(t) for t in ops[1:5])
                assert int(lut[0]) == 0xEA, "only (a & b) | c"
                reg[d] = ((a & b) | c) & M32
            elif op.startswith("ld.global"):
                assert mask.all(), "loads are never predicated"
                base = addr(ops[1])
                width = 16 if ".v4" in op else 8 if ".v2" in op else 4
                assert ((base.astype(np.int64) - BASE) % width == 0).all(), (op, "misaligned")
                assert mem.inside(base.astype(np.int64) - BASE, width), (op, "out of bounds")
                names = vec(d) if d.startswith("{") else [d]
                for k, n in enumerate(names):
                    reg[n] = mem.load32(base + np.uint64(4 * k))
            elif op == "st.global.v2.f32":
                base = addr(ops[0])
                assert ((base[mask].astype(np.int64) - BASE) % 8 == 0).all(), "misaligned store"
                for k, n in enumerate(vec(ops[1])):
                    mem.store32(base + np.uint64(4 * k), reg[n] & M32, mask)
            elif op == "fma.rn.f32":
                r = (_f32(val(ops[1])).astype(np.float64) * _f32(val(ops[2])).astype(np.float64)
                     + _f32(val(ops[3])).astype(np.float64))
                reg[d] = _bits(r.astype(np.float32))
            elif op == "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32":
                dn, an, bn, cn = (vec(t) for t in ops[:4])
                reg.update(zip(dn, _mma([val(t) for t in an], [val(t) for t in bn],
                                        [val(t) for t in cn])))
            else:
                raise NotImplementedError(stmt)


def _split(rest: str) -> list:
    out, depth, cur = [], 0, ""
    for ch in rest:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return out


def _mma(a, b, c):
    """m16n8k16 row.col bf16 -> f32, by the PTX ISA's fragment layouts; float64 products and
    sums rounded to float32."""
    lane = np.arange(32)
    g, r = lane // 4, lane % 4
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    for reg_i, (row_off, col_off) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        lo, hi = _bf16_pair(a[reg_i])
        A[g + row_off, 2 * r + col_off] = lo
        A[g + row_off, 2 * r + col_off + 1] = hi
    for reg_i, k_off in enumerate((0, 8)):
        lo, hi = _bf16_pair(b[reg_i])
        B[2 * r + k_off, g] = lo
        B[2 * r + k_off + 1, g] = hi
    for reg_i, (row_off, col) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
        C[g + row_off, 2 * r + col] = _f32(c[reg_i])
    D = (A @ B + C).astype(np.float32)
    return [_bits(D[g + ro, 2 * r + co]) for ro, co in ((0, 0), (0, 1), (8, 0), (8, 1))]
