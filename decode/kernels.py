"""The fused operations of the decode step: each one kernel on CUDA (Triton), transformers' own
arithmetic on the CPU (and on CUDA where Triton is missing or fails its check).

* ``add_rms_norm(x, residual, weight, eps)``: ``residual += x`` (rounded to the model's dtype, as
  ``residual + hidden`` is in the decoder layer), then the RMSNorm of the new residual -- the
  residual add of one sub-block and the norm of the next in one pass; ``x=None``: the norm alone.
* ``rope_cache(q, k, v, cos, sin, slot, k_cache, v_cache)``: rotary embedding of the query and key
  heads, the rotated keys and the values written into the static cache at ``slot``; returns the
  rotated queries as ``(batch, kv_heads, group, head_dim)`` (the packed grouped-query layout).
* ``silu_mul(gate, up)``: ``silu(gate) * up``, the MLP's activation.

Each is a ``torch.library`` custom op (``deepseek_flash::...``): one operation in the dispatcher
whatever device runs it, so a dispatch hook on the CPU counts what a GPU step launches. The CUDA
kernels compute in float32 and round once where transformers rounds after every elementwise op
(up to one bf16 step apart); the norm's rounding points are the same as transformers'.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("deepseek_flash.decode")

try:   # Triton ships with CUDA builds of torch; without it the CUDA path is the reference.
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover -- depends on the torch build
    triton = None


# --- reference arithmetic (transformers' op order) ----------------------------------------------
def _ref_add_rms_norm(x, residual, weight, eps: float):
    if x is not None:
        residual.copy_(residual + x)
    dtype = residual.dtype
    h = residual.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _ref_rope_cache(q, k, v, cos, sin, slot, k_cache, v_cache):
    b, kv_heads, d = k_cache.shape[0], k_cache.shape[1], k_cache.shape[3]
    heads = q.shape[-1] // d
    cos, sin = cos.reshape(b, 1, 1, d), sin.reshape(b, 1, 1, d)
    qh = q.reshape(b, 1, heads, d).transpose(1, 2)
    kh = k.reshape(b, 1, kv_heads, d).transpose(1, 2)
    vh = v.reshape(b, 1, kv_heads, d).transpose(1, 2)
    q_rot = (qh * cos) + (_rotate_half(qh) * sin)
    k_rot = (kh * cos) + (_rotate_half(kh) * sin)
    k_cache.index_copy_(2, slot, k_rot.to(k_cache.dtype))
    v_cache.index_copy_(2, slot, vh.to(v_cache.dtype))
    return q_rot.reshape(b, kv_heads, heads // kv_heads, d)


def _ref_silu_mul(gate, up):
    return torch.nn.functional.silu(gate) * up


def _ref_decode_attention(query, keys, values, mask, scale: float):
    return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                            scale=scale)


# --- Triton kernels -------------------------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, x_stride, res_stride, out_stride, n, eps,
                             HAS_X: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        live = cols < n
        r = tl.load(res_ptr + row * res_stride + cols, mask=live, other=0.0)
        if HAS_X:
            x = tl.load(x_ptr + row * x_stride + cols, mask=live, other=0.0)
            r = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)
            tl.store(res_ptr + row * res_stride + cols, r, mask=live)
        h = r.to(tl.float32)
        variance = tl.sum(h * h, axis=0) / n
        normed = (h * (1.0 / tl.sqrt(variance + eps))).to(r.dtype)
        w = tl.load(w_ptr + cols, mask=live, other=0.0)
        out = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, qo_ptr,
                           q_stride, k_stride, v_stride, cs_stride, c_row, c_head, c_pos,
                           HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        live = cols < HALF
        slot = tl.load(slot_ptr)
        if head < HEADS + KV_HEADS:
            c1 = tl.load(cos_ptr + row * cs_stride + cols, mask=live, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + row * cs_stride + HALF + cols, mask=live, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + row * cs_stride + cols, mask=live, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + row * cs_stride + HALF + cols, mask=live, other=0.0).to(tl.float32)
            if head < HEADS:
                src = q_ptr + row * q_stride + head * 2 * HALF
                dst = qo_ptr + (row * HEADS + head) * 2 * HALF
            else:
                src = k_ptr + row * k_stride + (head - HEADS) * 2 * HALF
                dst = kc_ptr + row * c_row + (head - HEADS) * c_head + slot * c_pos
            x1 = tl.load(src + cols, mask=live, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF + cols, mask=live, other=0.0).to(tl.float32)
            tl.store(dst + cols, (x1 * c1 - x2 * s1).to(dst.dtype.element_ty), mask=live)
            tl.store(dst + HALF + cols, (x2 * c2 + x1 * s2).to(dst.dtype.element_ty), mask=live)
        else:
            # Names apart from the branch above: Triton merges same-named values of both branches.
            v_src = v_ptr + row * v_stride + (head - HEADS - KV_HEADS) * 2 * HALF
            v_dst = vc_ptr + row * c_row + (head - HEADS - KV_HEADS) * c_head + slot * c_pos
            v1 = tl.load(v_src + cols, mask=live, other=0.0)
            v2 = tl.load(v_src + HALF + cols, mask=live, other=0.0)
            tl.store(v_dst + cols, v1.to(vc_ptr.dtype.element_ty), mask=live)
            tl.store(v_dst + HALF + cols, v2.to(vc_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, g_stride, u_stride, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < n
        g = tl.load(g_ptr + row * g_stride + cols, mask=live, other=0.0)
        u = tl.load(u_ptr + row * u_stride + cols, mask=live, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        out = act.to(tl.float32) * u.to(tl.float32)
        tl.store(out_ptr + row * n + cols, out.to(out_ptr.dtype.element_ty), mask=live)


    @triton.jit
    def _rotary(ptr, d, c, sn, HALF: tl.constexpr, D: tl.constexpr):
        # x * cos + rotate_half(x) * sin in float32 for the D values at ``ptr`` (broadcast over
        # the leading dims of ``d``): rotate_half(x)[j] = -x[j + HALF] below HALF, x[j - HALF] above.
        x = tl.load(ptr + d).to(tl.float32)
        other = tl.load(ptr + (d + HALF) % D).to(tl.float32)
        return x * c + tl.where(d < HALF, -other, other) * sn

    @triton.jit
    def _attention_split_kernel(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, ml_ptr, qr_ptr, kr_ptr, vr_ptr,
                                cos_ptr, sin_ptr, slot_ptr, L, G, KVH, SPLITS,
                                q_sb, q_sh, q_sg, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl, m_sb, m_sl,
                                qr_stride, kr_stride, vr_stride, cs_stride,
                                scale, HAS_MASK: tl.constexpr, ROPE: tl.constexpr, CHUNK: tl.constexpr,
                                BLOCK_L: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr):
        # One (sequence, key/value head) and one CHUNK of keys: the softmax of its group of query
        # rows over the chunk (running max, sum, weighted values in float32), for the combine.
        # ROPE: the step's rotary and cache write too (``rope_attention``): the query rows rotated
        # from the projection's output (rounded to its dtype, as rope_cache stores them), the new
        # key rotated and the new value written at the slot by the program whose chunk holds it,
        # which uses them from registers (no other program reads that slot).
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // KVH
        h = bh % KVH
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        if ROPE:
            slot = tl.load(slot_ptr)
            c = tl.load(cos_ptr + b * cs_stride + d).to(tl.float32)
            sn = tl.load(sin_ptr + b * cs_stride + d).to(tl.float32)
            rows = tl.minimum(g, G - 1)        # padding rows repeat the last one (ignored at the end)
            q = _rotary(qr_ptr + b * qr_stride + (h * G + rows[:, None]) * D, d[None, :], c[None, :],
                        sn[None, :], D // 2, D)
            q = q.to(qr_ptr.dtype.element_ty).to(tl.float32)
            k_new = _rotary(kr_ptr + b * kr_stride + h * D, d, c, sn, D // 2, D).to(k_ptr.dtype.element_ty)
            v_new = tl.load(vr_ptr + b * vr_stride + h * D + d).to(v_ptr.dtype.element_ty)
            if slot // CHUNK == split:
                tl.store(k_ptr + b * k_sb + h * k_sh + slot * k_sl + d, k_new)
                tl.store(v_ptr + b * v_sb + h * v_sh + slot * v_sl + d, v_new)
        else:
            q = tl.load(q_ptr + b * q_sb + h * q_sh + g[:, None] * q_sg + d[None, :],
                        mask=g[:, None] < G, other=0.0).to(tl.float32)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for off in range(0, CHUNK, BLOCK_L):
            keys = split * CHUNK + off + tl.arange(0, BLOCK_L)
            live = keys < L
            k = tl.load(k_ptr + b * k_sb + h * k_sh + keys[:, None] * k_sl + d[None, :],
                        mask=live[:, None], other=0.0).to(tl.float32)
            if ROPE:
                k = tl.where(keys[:, None] == slot, k_new.to(tl.float32)[None, :], k)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            if HAS_MASK:
                bias = tl.load(m_ptr + b * m_sb + keys * m_sl, mask=live, other=0.0).to(tl.float32)
                scores = scores + bias[None, :]
            scores = tl.where(live[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + b * v_sb + h * v_sh + keys[:, None] * v_sl + d[None, :],
                        mask=live[:, None], other=0.0).to(tl.float32)
            if ROPE:
                v = tl.where(keys[:, None] == slot, v_new.to(tl.float32)[None, :], v)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        part = bh * SPLITS + split
        tl.store(o_ptr + (part * G_PAD + g[:, None]) * D + d[None, :], acc)
        tl.store(ml_ptr + (part * 2) * G_PAD + g, m_i)
        tl.store(ml_ptr + (part * 2 + 1) * G_PAD + g, l_i)

    @triton.jit
    def _attention_combine_kernel(o_ptr, ml_ptr, out_ptr, G, KVH, SPLITS, out_sb, out_sh, out_sg,
                                  G_PAD: tl.constexpr, D: tl.constexpr):
        bh = tl.program_id(0)
        b = bh // KVH
        h = bh % KVH
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        top = tl.full([G_PAD], float("-inf"), tl.float32)
        for split in range(0, SPLITS):
            top = tl.maximum(top, tl.load(ml_ptr + ((bh * SPLITS + split) * 2) * G_PAD + g))
        top = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for split in range(0, SPLITS):
            part = bh * SPLITS + split
            w = tl.exp(tl.load(ml_ptr + (part * 2) * G_PAD + g) - top)
            total += w * tl.load(ml_ptr + (part * 2 + 1) * G_PAD + g)
            acc += w[:, None] * tl.load(o_ptr + (part * G_PAD + g[:, None]) * D + d[None, :])
        out = acc / total[:, None]
        tl.store(out_ptr + b * out_sb + h * out_sh + g[:, None] * out_sg + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g[:, None] < G)


    @triton.jit
    def _argmax_part_kernel(x_ptr, val_ptr, idx_ptr, n, x_stride, PARTS, BLOCK: tl.constexpr):
        # The largest value of one BLOCK of a row and its first index; a NaN wins (its first index),
        # as in torch.argmax.
        row = tl.program_id(0)
        part = tl.program_id(1)
        cols = part * BLOCK + tl.arange(0, BLOCK)
        live = cols < n
        x = tl.load(x_ptr + row * x_stride + cols, mask=live, other=float("-inf")).to(tl.float32)
        nan = x != x
        big = 2147483647
        nan_at = tl.min(tl.where(nan & live, cols, big), axis=0)
        top = tl.max(tl.where(nan, float("-inf"), x), axis=0)
        top_at = tl.min(tl.where(live & (x == top), cols, big), axis=0)
        found = nan_at < big
        tl.store(val_ptr + row * PARTS + part, tl.where(found, float("nan"), top))
        tl.store(idx_ptr + row * PARTS + part, tl.where(found, nan_at, top_at))

    @triton.jit
    def _argmax_final_kernel(val_ptr, idx_ptr, out_ptr, PARTS, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        p = tl.arange(0, BLOCK)
        live = p < PARTS
        v = tl.load(val_ptr + row * PARTS + p, mask=live, other=float("-inf"))
        i = tl.load(idx_ptr + row * PARTS + p, mask=live, other=2147483647)
        big = 2147483647
        nan = (v != v) & live
        nan_at = tl.min(tl.where(nan, i, big), axis=0)
        top = tl.max(tl.where(nan, float("-inf"), v), axis=0)
        top_at = tl.min(tl.where(live & (v == top), i, big), axis=0)
        tl.store(out_ptr + row, tl.where(nan_at < big, nan_at, top_at).to(tl.int64))


def _rows(t):
    """``t`` as (rows, features) with unit stride along features (a view; decode shapes are)."""
    flat = t.reshape(-1, t.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat


def _tri_add_rms_norm(x, residual, weight, eps: float):
    res = residual.view(-1, residual.shape[-1])
    n = res.shape[-1]
    out = torch.empty_like(residual)
    xr = _rows(x) if x is not None else res
    _add_rms_norm_kernel[(res.shape[0],)](xr, res, weight, out, xr.stride(0), res.stride(0), n, n, eps,
                                          HAS_X=x is not None, BLOCK=triton.next_power_of_2(n),
                                          num_warps=8 if n >= 2048 else 4)
    return out


def _tri_rope_cache(q, k, v, cos, sin, slot, k_cache, v_cache):
    b, kv_heads, d = k_cache.shape[0], k_cache.shape[1], k_cache.shape[3]
    heads = q.shape[-1] // d
    qr, kr, vr = _rows(q), _rows(k), _rows(v)
    cs = cos.reshape(b, d)
    sn = sin.reshape(b, d)
    if cs.stride(-1) != 1 or sn.stride() != cs.stride():
        cs, sn = cs.contiguous(), sn.contiguous()
    q_out = torch.empty((b, kv_heads, heads // kv_heads, d), dtype=q.dtype, device=q.device)
    _rope_cache_kernel[(b, heads + 2 * kv_heads)](
        qr, kr, vr, cs, sn, slot, k_cache, v_cache, q_out, qr.stride(0), kr.stride(0), vr.stride(0),
        cs.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEADS=heads, KV_HEADS=kv_heads, HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2), num_warps=1)
    return q_out


def _tri_silu_mul(gate, up):
    g, u = _rows(gate), _rows(up)
    n = g.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = 1024
    _silu_mul_kernel[(g.shape[0], triton.cdiv(n, block))](g, u, out, g.stride(0), u.stride(0), n,
                                                          BLOCK=block, num_warps=4)
    return out


ATTENTION_CHUNK = 64        # keys per program of the split kernel
ARGMAX_BLOCK = 2048         # values per program of the first argmax kernel


def _ref_greedy(logits):
    return logits.argmax(dim=-1)


def _tri_greedy(logits):
    """``logits.argmax(-1)`` of a (rows, vocab) tensor in two kernels (blocks of a row, then the
    row): torch's reduction takes one program per row (28 us for the 8B vocab on the H200)."""
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, n = x.shape
    parts = triton.cdiv(n, ARGMAX_BLOCK)
    vals = torch.empty((rows, parts), dtype=torch.float32, device=x.device)
    idx = torch.empty((rows, parts), dtype=torch.int32, device=x.device)
    out = torch.empty((rows,), dtype=torch.int64, device=x.device)
    _argmax_part_kernel[(rows, parts)](x, vals, idx, n, x.stride(0), parts, BLOCK=ARGMAX_BLOCK, num_warps=8)
    _argmax_final_kernel[(rows,)](vals, idx, out, parts, BLOCK=max(16, triton.next_power_of_2(parts)),
                                  num_warps=4)
    return out


def _tri_decode_attention(query, keys, values, mask, scale: float, chunk: int | None = None,
                          block: int = 64, warps: int = 4, rope=None):
    """Split-key (flash-decoding) attention of one query token per row in the packed grouped-query
    layout: ``query`` (batch, kv_heads, group, dim), ``keys``/``values`` (batch, kv_heads, length,
    dim) views of the cache, ``mask`` None or additive (batch, 1, 1, length). Two kernels: each
    ``ATTENTION_CHUNK`` keys (``chunk``) of each (row, head) in float32 (``tl.dot`` at IEEE float32
    precision over the group's rows padded to 16), ``block`` keys a loop step on ``warps`` warps,
    then their combination, rounded once (bench/attention.py times the shapes).
    ``rope`` = (q, k, v, cos, sin, slot) as ``rope_cache`` takes them: the first kernel also rotates
    the query rows and the new key and writes the new key and value into ``keys``/``values`` at the
    slot (``query`` is then only the output's shape and dtype)."""
    chunk = chunk or ATTENTION_CHUNK
    b, kv_heads, group, d = query.shape
    length = keys.shape[2]
    if mask is not None:
        mask = mask.expand(b, 1, 1, length)
    g_pad = max(16, triton.next_power_of_2(group))       # tl.dot's smallest tile
    splits = triton.cdiv(length, chunk)
    parts = torch.empty((b * kv_heads * splits, g_pad, d), dtype=torch.float32, device=keys.device)
    ml = torch.empty((b * kv_heads * splits, 2, g_pad), dtype=torch.float32, device=keys.device)
    out = torch.empty(query.shape, dtype=query.dtype, device=keys.device)
    m_arg = mask if mask is not None else keys
    m_sb, m_sl = (mask.stride(0), mask.stride(3)) if mask is not None else (0, 0)
    if rope is None:
        q_arg, (qr, kr, vr, cs, sn, slot), rs = query, (keys,) * 6, (0, 0, 0, 0)
    else:
        q_arg = keys
        q, k, v, cos, sin, slot = rope
        qr, kr, vr = _rows(q), _rows(k), _rows(v)
        cs, sn = cos.reshape(b, d), sin.reshape(b, d)
        if cs.stride(-1) != 1 or sn.stride() != cs.stride():
            cs, sn = cs.contiguous(), sn.contiguous()
        rs = (qr.stride(0), kr.stride(0), vr.stride(0), cs.stride(0))
    _attention_split_kernel[(b * kv_heads, splits)](
        q_arg, keys, values, m_arg, parts, ml, qr, kr, vr, cs, sn, slot, length, group, kv_heads, splits,
        q_arg.stride(0), q_arg.stride(1), q_arg.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), m_sb, m_sl, *rs, scale,
        HAS_MASK=mask is not None, ROPE=rope is not None, CHUNK=chunk, BLOCK_L=block, G_PAD=g_pad, D=d,
        num_warps=warps)
    _attention_combine_kernel[(b * kv_heads,)](
        parts, ml, out, group, kv_heads, splits, out.stride(0), out.stride(1), out.stride(2),
        G_PAD=g_pad, D=d, num_warps=4)
    return out


def _ref_rope_attention(q, k, v, cos, sin, slot, k_cache, v_cache, visible: int, mask, scale: float):
    query = _ref_rope_cache(q, k, v, cos, sin, slot, k_cache, v_cache)
    return _ref_decode_attention(query, k_cache[:, :, :visible], v_cache[:, :, :visible], mask, scale)


def _tri_rope_attention(q, k, v, cos, sin, slot, k_cache, v_cache, visible: int, mask, scale: float):
    b, kv_heads, d = k_cache.shape[0], k_cache.shape[1], k_cache.shape[3]
    shape = torch.empty((b, kv_heads, q.shape[-1] // d // kv_heads, d), dtype=q.dtype, device="meta")
    return _tri_decode_attention(shape, k_cache[:, :, :visible], v_cache[:, :, :visible], mask, scale,
                                 rope=(q, k, v, cos, sin, slot))


# --- which implementation CUDA runs ---------------------------------------------------------------
class _Backend:
    """Whether CUDA runs the Triton kernels: decided by ``check_triton`` (once per device and
    dtype); off until checked."""

    def __init__(self):
        self.triton = False
        self.reason = "not checked"
        self.checked: dict = {}


BACKEND = _Backend()


def check_triton(device, dtype, dims: dict | None = None) -> str | None:
    """Run each Triton kernel once against the reference on ``device`` at the model's ``dims``
    (``hidden``, ``heads``, ``kv_heads``, ``head_dim``, ``intermediate``: the shapes the step will
    compile for) in ``dtype``; enable them when all agree. Returns why they are off (None: on)."""
    key = (str(device), dtype, tuple(sorted((dims or {}).items())))
    if key in BACKEND.checked:
        return BACKEND.checked[key]
    if triton is None:
        reason = "triton is not installed"
    else:
        try:
            reason = _self_check(torch.device(device), dtype, **(dims or {}))
        except Exception as exc:   # noqa: BLE001 -- a kernel that cannot compile here: torch ops
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    BACKEND.checked[key] = reason
    BACKEND.triton, BACKEND.reason = reason is None, reason or "on"
    if reason is not None:
        log.warning("decode: fused Triton kernels off (%s); the step uses torch ops", reason)
    return reason


def _close(a, b, dtype) -> bool:
    tol = 1e-5 if dtype == torch.float32 else 2 ** -5   # two bf16 steps: a check for wrong
    # indexing, not for rounding (Triton's interpreter rounds to bf16 differently from CUDA)
    return bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol))


def _self_check(device, dtype, hidden: int = 320, heads: int = 8, kv_heads: int = 2, head_dim: int = 64,
                intermediate: int = 320) -> str | None:
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    b, d, cap, n = 3, head_dim, 16, hidden
    x, res, w = rnd(b, 1, n), rnd(b, 1, n), rnd(n)
    res_ref, res_tri = res.clone(), res.clone()
    if not (_close(_ref_add_rms_norm(x, res_ref, w, 1e-6), _tri_add_rms_norm(x, res_tri, w, 1e-6), dtype)
            and _close(res_ref, res_tri, dtype)):
        return "add_rms_norm disagrees with the reference"
    qkv = rnd(b, 1, (heads + 2 * kv_heads) * d)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    angle = rnd(b, 1, d).float()
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    slot = torch.tensor([5], device=device)
    caches = [torch.zeros(b, kv_heads, cap, d, device=device, dtype=dtype) for _ in range(4)]
    q_ref = _ref_rope_cache(q, k, v, cos, sin, slot, caches[0], caches[1])
    q_tri = _tri_rope_cache(q, k, v, cos, sin, slot, caches[2], caches[3])
    if not (_close(q_ref, q_tri, dtype) and _close(caches[0], caches[2], dtype)
            and torch.equal(caches[1], caches[3])):
        return "rope_cache disagrees with the reference"
    gu = rnd(b, 1, 2 * intermediate)
    gate, up = gu.split([intermediate, intermediate], dim=-1)
    if not _close(_ref_silu_mul(gate, up), _tri_silu_mul(gate, up), dtype):
        return "silu_mul disagrees with the reference"
    # Attention over 150 keys of a 160-slot cache (three chunks, the last partial): row 1 left
    # padded, row 2 with its whole first chunk masked (a chunk with nothing to attend to).
    length = 150
    query = rnd(b, kv_heads, heads // kv_heads, d)
    cache_k, cache_v = rnd(b, kv_heads, length + 10, d), rnd(b, kv_heads, length + 10, d)
    allowed = torch.ones(b, 1, 1, length, dtype=torch.bool, device=device)
    allowed[1, ..., :3] = False
    allowed[2, ..., :70] = False
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))
    keys, values = cache_k[:, :, :length], cache_v[:, :, :length]
    scale = d ** -0.5
    for m in (mask, None):
        if not _close(_ref_decode_attention(query, keys, values, m, scale),
                      _tri_decode_attention(query, keys, values, m, scale), dtype):
            return "decode_attention disagrees with the reference"
    # The rotary, cache write and attention in one (the step's rope_attention), slot 97 of 150.
    slot = torch.tensor([97], device=device)
    for m in (mask, None):
        caches = [c.clone() for c in (cache_k, cache_v, cache_k, cache_v)]
        want = _ref_rope_attention(q, k, v, cos, sin, slot, caches[0], caches[1], length, m, scale)
        got = _tri_rope_attention(q, k, v, cos, sin, slot, caches[2], caches[3], length, m, scale)
        if not (_close(want, got, dtype) and _close(caches[0], caches[2], dtype)
                and torch.equal(caches[1], caches[3])):
            return "rope_attention disagrees with the reference"
    from . import flash      # the step's maskless attention (its own module)
    reason = flash.self_check(device, dtype, heads, kv_heads, head_dim)
    if reason is not None:
        return reason
    # Greedy choice over 5000 values (three blocks): ties (the first wins), a row of one value,
    # a NaN (it wins, as in torch).
    logits = torch.randn(4, 5000, generator=gen).to(device=device, dtype=torch.float32)
    logits[0, 4000] = logits[0, 100] = logits[0].max() + 1
    logits[1] = 0.5
    logits[2, 4500] = logits[2, 4700] = float("nan")
    if not torch.equal(_ref_greedy(logits), _tri_greedy(logits)):
        return "greedy disagrees with the reference"
    return None


# --- the custom ops -------------------------------------------------------------------------------
@torch.library.custom_op("deepseek_flash::add_rms_norm", mutates_args=("residual",))
def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    return _ref_add_rms_norm(x, residual, weight, eps)


@add_rms_norm.register_kernel("cuda")
def _(x, residual, weight, eps):
    if BACKEND.triton:
        return _tri_add_rms_norm(x, residual, weight, eps)
    return _ref_add_rms_norm(x, residual, weight, eps)


@torch.library.custom_op("deepseek_flash::rope_cache", mutates_args=("k_cache", "v_cache"))
def rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, slot: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> torch.Tensor:
    return _ref_rope_cache(q, k, v, cos, sin, slot, k_cache, v_cache)


@rope_cache.register_kernel("cuda")
def _(q, k, v, cos, sin, slot, k_cache, v_cache):
    if BACKEND.triton:
        return _tri_rope_cache(q, k, v, cos, sin, slot, k_cache, v_cache)
    return _ref_rope_cache(q, k, v, cos, sin, slot, k_cache, v_cache)


@torch.library.custom_op("deepseek_flash::silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _ref_silu_mul(gate, up)


@silu_mul.register_kernel("cuda")
def _(gate, up):
    if BACKEND.triton:
        return _tri_silu_mul(gate, up)
    return _ref_silu_mul(gate, up)


def _attention_fits(query, keys, values, mask) -> bool:
    """The kernel's case: unit stride along the head dimension, a power-of-two head size, an
    additive (floating-point) mask of one query or none."""
    d = query.shape[-1]
    return ((d & (d - 1)) == 0 and 16 <= d <= 256 and all(t.stride(-1) == 1 for t in (query, keys, values))
            and (mask is None or (mask.is_floating_point() and mask.dim() == 4 and mask.shape[2] == 1)))


@torch.library.custom_op("deepseek_flash::decode_attention", mutates_args=())
def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    return _ref_decode_attention(query, keys, values, mask, scale)


@decode_attention.register_kernel("cuda")
def _(query, keys, values, mask, scale):
    if BACKEND.triton and _attention_fits(query, keys, values, mask):
        return _tri_decode_attention(query, keys, values, mask, scale)
    return _ref_decode_attention(query, keys, values, mask, scale)


@torch.library.custom_op("deepseek_flash::greedy", mutates_args=())
def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row of (rows, vocab) logits: ``argmax(-1)``, exactly."""
    return _ref_greedy(logits)


@greedy.register_kernel("cuda")
def _(logits):
    if BACKEND.triton and logits.dim() == 2:
        return _tri_greedy(logits)
    return _ref_greedy(logits)


@torch.library.custom_op("deepseek_flash::rope_attention", mutates_args=("k_cache", "v_cache"))
def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, slot: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   visible: int, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``rope_cache`` then ``decode_attention`` over the first ``visible`` slots, as one operation
    (on CUDA: the rotary and the cache write inside the attention's first kernel)."""
    return _ref_rope_attention(q, k, v, cos, sin, slot, k_cache, v_cache, visible, mask, scale)


@rope_attention.register_kernel("cuda")
def _(q, k, v, cos, sin, slot, k_cache, v_cache, visible, mask, scale):
    keys, values = k_cache[:, :, :visible], v_cache[:, :, :visible]
    if BACKEND.triton and _attention_fits(keys, keys, values, mask):
        return _tri_rope_attention(q, k, v, cos, sin, slot, k_cache, v_cache, visible, mask, scale)
    return _ref_rope_attention(q, k, v, cos, sin, slot, k_cache, v_cache, visible, mask, scale)
