"""The decode step's attention without a mask tensor: which keys a row sees is read from the device.

``decode_attention(query, k_cache, v_cache, valid_from, slot, visible, window, scale)``: one query
token per row in the packed grouped-query layout (``query`` (batch, kv_heads, group, dim), as
``kernels.rope_cache`` returns it) over the first ``visible`` slots of the static cache
(``k_cache``/``v_cache`` (batch, kv_heads, capacity, dim)). Row ``b`` attends to the slots ``s`` with
``valid_from[b] <= s <= slot`` (and ``s > slot - window`` where ``window`` > 0): exactly the keys
``step.decode_allowed`` allows. ``valid_from`` and ``slot`` are device tensors, so one captured graph
serves every position of its window; ``visible`` (a Python int, fixed per graph) only bounds the grid.

On CUDA (Triton), flash decoding in two kernels: each program takes ``CHUNK`` keys of one (row,
key/value head) -- the keys it may see loaded, the rest never read -- and keeps the softmax of its
group of query rows over them (``KERNEL``: ``tl.dot`` on the tensor cores, the group's rows padded to
16, float32 sums; or broadcast products in float32); a second kernel combines every program of a
(row, head) with all their partial sums loaded at once (one memory round trip, where
``kernels.decode_attention`` looped over them). Against torch's sdpa with the float mask the step built (memory-efficient
kernel + a mask kernel, 15 us a layer on the H200): docs/benchmarks.md. On the CPU (and where Triton
is off) the reference: the boolean mask built as the step builds it, as an additive bias, then sdpa --
the same operations, so the same bits, as the step with ``fused.ATTENTION = "sdpa"``.
"""
from __future__ import annotations

import os

import torch

from . import kernels

triton, tl = kernels.triton, getattr(kernels, "tl", None)

# The split kernel's shape: the least time summed over 256 and 512 keys in bench/attention.py's sweep
# on the H200 (2026-12-02, batch 1: 8.06 / 9.75 us against sdpa's 10.07 / 15.02 and the "sum"
# kernel's 32-key programs' 9.48 / 10.12): one program for 256 keys, 64 a loop step.
CHUNK = 256          # keys a program (multiple of BLOCK)
BLOCK = 64           # keys a loop step of a program
WARPS = 4
COMBINE_BLOCK = 16   # programs' partial sums a combine step loads at once
# The split kernel: "dot" (``tl.dot`` on the tensor cores: q . k in bfloat16 products with float32
# sums -- exact products --, p . v in tf32; float32 models in IEEE float32; the group's rows padded
# to 16) or "sum" (broadcast products in float32, no padding).
KERNEL = "dot"


def _ref_decode_attention(query, k_cache, v_cache, valid_from, slot, visible: int, window: int,
                          scale: float):
    k = torch.arange(visible, device=query.device)[None, :]
    allowed = (k >= valid_from[:, None]) & (k <= slot)
    if window > 0:
        allowed = allowed & (k > slot - window)
    allowed = allowed[:, None, None, :]
    bias = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(~allowed, float("-inf"))
    return torch.nn.functional.scaled_dot_product_attention(
        query, k_cache[:, :, :visible], v_cache[:, :, :visible], attn_mask=bias, scale=scale)


if triton is not None:
    @triton.jit
    def _flash_split_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, slot_ptr, part_ptr, ml_ptr,
                            L, KVH, SPLITS, WINDOW, q_sb, q_sh, q_sg, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl,
                            scale, G: tl.constexpr, G_PAD: tl.constexpr, CHUNK: tl.constexpr,
                            BLOCK: tl.constexpr, D: tl.constexpr):
        # One (row, key/value head) and CHUNK keys: the running max, sum and weighted values of its
        # G query rows over the keys it may see (float32), for the combine.
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // KVH
        h = bh % KVH
        slot = tl.load(slot_ptr)
        lo = tl.load(valid_ptr + b)
        if WINDOW > 0:
            lo = tl.maximum(lo, slot - WINDOW + 1)
        hi = tl.minimum(slot, L - 1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * q_sb + h * q_sh + g[:, None] * q_sg + d[None, :],
                    mask=g[:, None] < G, other=0.0).to(tl.float32) * scale
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for off in range(0, CHUNK, BLOCK):
            keys = split * CHUNK + off + tl.arange(0, BLOCK)
            live = (keys >= lo) & (keys <= hi)
            k = tl.load(k_ptr + b * k_sb + h * k_sh + keys[:, None] * k_sl + d[None, :],
                        mask=live[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + b * v_sb + h * v_sh + keys[:, None] * v_sl + d[None, :],
                        mask=live[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)            # [G_PAD, BLOCK]
            scores = tl.where(live[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        part = bh * SPLITS + split
        tl.store(part_ptr + (part * G_PAD + g[:, None]) * D + d[None, :], acc)
        tl.store(ml_ptr + (part * 2) * G_PAD + g, m_i)
        tl.store(ml_ptr + (part * 2 + 1) * G_PAD + g, l_i)

    @triton.jit
    def _flash_split_dot_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, slot_ptr, part_ptr, ml_ptr,
                                L, KVH, SPLITS, WINDOW, q_sb, q_sh, q_sg, k_sb, k_sh, k_sl, v_sb, v_sh,
                                v_sl, scale, G: tl.constexpr, G_PAD: tl.constexpr, CHUNK: tl.constexpr,
                                BLOCK: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
        # _flash_split_kernel's work on tl.dot: q (G_PAD >= 16 rows, the group's G) times the
        # BLOCK keys, then the probabilities times the values.
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // KVH
        h = bh % KVH
        slot = tl.load(slot_ptr)
        lo = tl.load(valid_ptr + b)
        if WINDOW > 0:
            lo = tl.maximum(lo, slot - WINDOW + 1)
        hi = tl.minimum(slot, L - 1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * q_sb + h * q_sh + g[:, None] * q_sg + d[None, :], mask=g[:, None] < G,
                    other=0.0)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for off in range(0, CHUNK, BLOCK):
            keys = split * CHUNK + off + tl.arange(0, BLOCK)
            live = (keys >= lo) & (keys <= hi)
            k = tl.load(k_ptr + b * k_sb + h * k_sh + keys[:, None] * k_sl + d[None, :],
                        mask=live[:, None], other=0.0)
            v = tl.load(v_ptr + b * v_sb + h * v_sh + keys[:, None] * v_sl + d[None, :],
                        mask=live[:, None], other=0.0)
            if IEEE:
                scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale                           # [G_PAD, BLOCK]
            scores = tl.where(live[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p, v.to(tl.float32), input_precision="tf32")
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        part = bh * SPLITS + split
        tl.store(part_ptr + (part * G_PAD + g[:, None]) * D + d[None, :], acc)
        tl.store(ml_ptr + (part * 2) * G_PAD + g, m_i)
        tl.store(ml_ptr + (part * 2 + 1) * G_PAD + g, l_i)

    @triton.jit
    def _flash_combine_kernel(part_ptr, ml_ptr, out_ptr, KVH, SPLITS, out_sb, out_sh, out_sg,
                              G: tl.constexpr, G_PAD: tl.constexpr, S_BLOCK: tl.constexpr,
                              D: tl.constexpr, ONE: tl.constexpr):
        # One (row, head): S_BLOCK programs' partial sums a step, each step's loads all at once
        # (ONE: all of them in one step, the largest of their maxima taken from what is loaded).
        bh = tl.program_id(0)
        b = bh // KVH
        h = bh % KVH
        s = tl.arange(0, S_BLOCK)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        top = tl.full([G_PAD], float("-inf"), tl.float32)
        if not ONE:
            for s0 in range(0, SPLITS, S_BLOCK):
                live = (s0 + s) < SPLITS
                m = tl.load(ml_ptr + ((bh * SPLITS + s0 + s[:, None]) * 2) * G_PAD + g[None, :],
                            mask=live[:, None], other=float("-inf"))
                top = tl.maximum(top, tl.max(m, axis=0))
            top = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for s0 in range(0, SPLITS, S_BLOCK):
            live = (s0 + s) < SPLITS
            part = bh * SPLITS + s0 + s
            m = tl.load(ml_ptr + (part[:, None] * 2) * G_PAD + g[None, :], mask=live[:, None],
                        other=float("-inf"))
            lsum = tl.load(ml_ptr + (part[:, None] * 2 + 1) * G_PAD + g[None, :], mask=live[:, None],
                           other=0.0)
            o = tl.load(part_ptr + (part[:, None, None] * G_PAD + g[None, :, None]) * D + d[None, None, :],
                        mask=live[:, None, None], other=0.0)
            if ONE:
                top = tl.max(m, axis=0)
                top = tl.where(top == float("-inf"), 0.0, top)
            w = tl.exp(m - top[None, :])                                          # [S_BLOCK, G_PAD]
            total += tl.sum(w * lsum, axis=0)
            acc += tl.sum(w[:, :, None] * o, axis=0)
        out = acc / total[:, None]
        tl.store(out_ptr + b * out_sb + h * out_sh + g[:, None] * out_sg + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g[:, None] < G)


def _tri_decode_attention(query, k_cache, v_cache, valid_from, slot, visible: int, window: int,
                          scale: float, chunk: int | None = None, block: int | None = None,
                          warps: int | None = None, kernel: str | None = None):
    chunk, block, warps, kernel = chunk or CHUNK, block or BLOCK, warps or WARPS, kernel or KERNEL
    b, kv_heads, group, d = query.shape
    dot = kernel == "dot"
    g_pad = max(16, triton.next_power_of_2(group)) if dot else triton.next_power_of_2(group)
    splits = triton.cdiv(visible, chunk)
    parts = torch.empty((b * kv_heads * splits, g_pad, d), dtype=torch.float32, device=query.device)
    ml = torch.empty((b * kv_heads * splits, 2, g_pad), dtype=torch.float32, device=query.device)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    args = (query, k_cache, v_cache, valid_from, slot, parts, ml, visible, kv_heads, splits, window,
            query.stride(0), query.stride(1), query.stride(2), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), scale)
    if dot:
        _flash_split_dot_kernel[(b * kv_heads, splits)](*args, G=group, G_PAD=g_pad, CHUNK=chunk,
                                                        BLOCK=block, D=d, IEEE=query.dtype == torch.float32,
                                                        num_warps=warps)
    else:
        _flash_split_kernel[(b * kv_heads, splits)](*args, G=group, G_PAD=g_pad, CHUNK=chunk, BLOCK=block,
                                                    D=d, num_warps=warps)
    _flash_combine_kernel[(b * kv_heads,)](
        parts, ml, out, kv_heads, splits, out.stride(0), out.stride(1), out.stride(2),
        G=group, G_PAD=g_pad, S_BLOCK=min(COMBINE_BLOCK, triton.next_power_of_2(splits)), D=d,
        ONE=splits <= COMBINE_BLOCK, num_warps=4)
    return out


def fits(query, k_cache, v_cache) -> str | None:
    """None where the kernel takes the call, else why not (the reference runs)."""
    d = query.shape[-1]
    if d & (d - 1) or not 16 <= d <= 256:
        return f"head size {d}"
    if not all(t.stride(-1) == 1 for t in (query, k_cache, v_cache)):
        return "a head dimension that is not contiguous"
    return None


def self_check(device, dtype, heads: int = 8, kv_heads: int = 2, head_dim: int = 64) -> str | None:
    """The kernels against the reference on ``device`` (None: they agree): 150 of a 160-slot cache
    (chunks partly and wholly outside what a row sees), row 1 left padded, row 2 beyond its first
    chunk, the slot inside the cache, with and without a window."""
    gen = torch.Generator(device="cpu").manual_seed(3)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    b, d, visible = 3, head_dim, 150
    query = rnd(b, kv_heads, heads // kv_heads, d)
    k_cache, v_cache = rnd(b, kv_heads, visible + 10, d), rnd(b, kv_heads, visible + 10, d)
    valid_from = torch.tensor([0, 3, 70], device=device)
    # Triton's interpreter has no bfloat16 matmul (numpy has no bfloat16): there the tl.dot kernel's
    # masks, chunks and combine are checked on float32 copies; its bfloat16 tensor-core dots only run
    # on a GPU (this check on the device, before the first step, and the GPU tests).
    if KERNEL == "dot" and dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        query, k_cache, v_cache = query.float(), k_cache.float(), v_cache.float()
    for slot, window in ((140, 0), (140, 50), (visible - 1, 0)):
        slot_t = torch.tensor([slot], device=device)
        for chunk, block in ((None, None), (64, 32)):        # one program a row, then several
            want = _ref_decode_attention(query, k_cache, v_cache, valid_from, slot_t, visible, window, d ** -0.5)
            got = _tri_decode_attention(query, k_cache, v_cache, valid_from, slot_t, visible, window, d ** -0.5,
                                        chunk, block)
            if not kernels._close(want, got, dtype):
                return f"flash decode_attention disagrees with the reference (slot {slot}, window {window})"
    return None


@torch.library.custom_op("deepseek_flash::flash_decode_attention", mutates_args=())
def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     valid_from: torch.Tensor, slot: torch.Tensor, visible: int, window: int,
                     scale: float) -> torch.Tensor:
    return _ref_decode_attention(query, k_cache, v_cache, valid_from, slot, visible, window, scale)


@decode_attention.register_kernel("cuda")
def _(query, k_cache, v_cache, valid_from, slot, visible, window, scale):
    if kernels.BACKEND.triton and fits(query, k_cache, v_cache) is None:
        return _tri_decode_attention(query, k_cache, v_cache, valid_from, slot, visible, window, scale)
    return _ref_decode_attention(query, k_cache, v_cache, valid_from, slot, visible, window, scale)
