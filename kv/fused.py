"""A top-K layer's decode step in five Triton kernels (kv/layer.py ``_attend_fused``).

The captured graph of kv/graphs.py runs a top-K layer's choice, page-cache bookkeeping, gather
and the assembly of the attention's keys and values as ~90 small torch operations, then torch's
attention over the assembled buffer: at 32K on an 8B shape ~4,300 kernels a step, most of them a
few us of launch and tail (docs/benchmarks.md, kv). Here the same step is

1. ``_score``: the Quest bound of every page and head (``[q+, q-] . [max, min]``) and each
   window's softmax mass (the ``"windowed"`` score, per head), one program per (sequence, kv
   head, window of pages);
2. ``_choose``: one program: the ``"quest"`` score (log-shares, best head), the windowed sum,
   both rankings, the hybrid key and its ``k`` smallest (kv/summaries.py ``_choose_hybrid``), the
   page cache's bookkeeping (kv/pagecache.py ``gather_into``: hits, the least recently chosen
   victims for the misses, the tables, the counters), and the step's keys and values written into
   the recent window at its device-held position;
3. ``_fetch``: the misses' pages from the host (read through the unified address space, as the
   one gather of kv/span.py) into their slots -- the only bytes that cross PCIe;
4. ``_attend``: flash decoding over the sinks, the chosen pages in their slots (through the slot
   of each chosen page) and the recent window, split over the columns;
5. ``_combine``: the splits' partial softmaxes into the output ``[b, 1, q_heads, d]``.

Nothing is assembled: the attention reads the pages where the page cache keeps them. The chosen
pages and the tables are the same as the torch path's (the same ranks, ties broken the same way);
the scores and the attention are the same arithmetic in another order (ulp-level, checked by
tests/kv/test_kv_fused.py through ``TRITON_INTERPRET=1`` on the CPU and on CUDA by
tests/kv/test_kv_gpu.py). On by default (``TieredCache.fused``; ``DEEPSEEK_FLASH_KV_FUSED=0`` turns
it off): measured faster than the torch path on an H200 (docs/benchmarks.md, kv). The torch path
stays the fallback (no Triton, the CPU, a spilled chunk, no page cache, another score). With
``SPLIT`` (``DEEPSEEK_FLASH_KV_FUSED_SPLIT=1``) ``_choose`` runs as three kernels: ``_rank`` (the
rankings and the hybrid key, many programs), ``_select`` (the ``k`` smallest keys, many programs)
and ``_book`` (the page cache's bookkeeping and the window write, one program) -- the same values.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("deepseek_flash.kv.cache")

try:  # Triton is optional: the torch path serves without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None

_NEVER = 1 << 62
KERNELS = ("_score", "_choose", "_rank", "_select", "_book", "_fetch", "_attend", "_combine")
SPLIT = [os.environ.get("DEEPSEEK_FLASH_KV_FUSED_SPLIT", "0") == "1"]
"""Whether the choice runs as three kernels (``_rank`` over many programs, ``_select``,
``_book``) instead of one program (``_choose``): the same values; a list, so the bench flips it."""


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def available(device: torch.device) -> bool:
    """Whether the fused step can run on ``device``: Triton present, and CUDA (or the Triton
    interpreter on the CPU, as the tests run it)."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


def default_on() -> bool:
    """``TieredCache.fused``'s default: on (measured faster on an H200: docs/benchmarks.md, kv)
    unless ``DEEPSEEK_FLASH_KV_FUSED=0``."""
    return os.environ.get("DEEPSEEK_FLASH_KV_FUSED", "1") != "0"


def _p2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


if triton is not None:

    # the scalars that change with the context are not specialised on (a page boundary
    # would otherwise compile a kernel again in the middle of decoding)
    @triton.jit(do_not_specialize=["NB"])
    def _score(q_ptr, mm_ptr, bound_ptr, wpart_ptr, n_ptr, scale, mm_sb, mm_sh, NB,
               H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
               W: tl.constexpr):
        n = tl.load(n_ptr)  # the page count, on the device: a graph serves as pages are added
        bh = tl.program_id(0)
        blk = tl.program_id(1)
        b = bh // H
        h = bh % H
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gm = g < G
        q = tl.load(q_ptr + (bh * G + g)[:, None] * D + d[None, :], mask=gm[:, None],
                    other=0.0).to(tl.float32)
        pp = blk * W + tl.arange(0, W)
        pm = pp < n
        base = mm_ptr + b * mm_sb + h * mm_sh + pp[:, None] * (2 * D)
        kmax = tl.load(base + d[None, :], mask=pm[:, None], other=0.0).to(tl.float32)
        kmin = tl.load(base + D + d[None, :], mask=pm[:, None], other=0.0).to(tl.float32)
        qp = tl.maximum(q, 0.0)
        qn = tl.minimum(q, 0.0)
        bound = (tl.dot(qp, tl.trans(kmax), input_precision="ieee")
                 + tl.dot(qn, tl.trans(kmin), input_precision="ieee")) * scale  # [GP, W]
        tl.store(bound_ptr + (bh * G + g)[:, None] * NB + pp[None, :], bound,
                 mask=gm[:, None] & pm[None, :])
        # the windowed score: each query's softmax inside this window of W pages, summed over
        # this head's queries (the heads are summed by _choose)
        x = tl.where(pm[None, :], bound, float("-inf"))
        m = tl.max(x, axis=1)
        e = tl.exp(x - m[:, None])
        mass = e / tl.sum(e, axis=1)[:, None]
        mass = tl.where(gm[:, None], mass, 0.0)
        tl.store(wpart_ptr + bh * NB + pp, tl.sum(mass, axis=0), mask=pm)

    @triton.jit(do_not_specialize=["k", "C", "NB"])
    def _choose(bound_ptr, wpart_ptr, fs_ptr, is_ptr, chosen_ptr, slot_out_ptr, src_out_ptr,
                sop_ptr, sop_w, page_of_slot_ptr, last_used_ptr, step_ptr,
                table_ptr, table_w, hits_ptr, misses_ptr, last_ptr, win_ptr, winpos_ptr, kin_ptr,
                vin_ptr, n_ptr, k, B, C, NB, CAP,
                H: tl.constexpr, HG: tl.constexpr, RB: tl.constexpr, NP: tl.constexpr,
                BI: tl.constexpr, CP: tl.constexpr, BC: tl.constexpr, D: tl.constexpr,
                NEVER: tl.constexpr):
        # scratch: fs_ptr float32 [2 * NP] (quest, windowed); is_ptr int64 [3 * NP + 2 * CP]
        # (hybrid key, chosen flag, exclusive count of chosen before, stamps, victim of rank)
        n = tl.load(n_ptr)
        p = tl.arange(0, NP)
        valid = p < n
        step = tl.load(step_ptr)
        total_miss = tl.sum(tl.zeros((NP,), tl.int64), axis=0)
        for b in range(B):
            # --- the "quest" score: best log-share over heads and queries ----------------------
            quest = tl.full((NP,), float("-inf"), tl.float32)
            for r0 in range(0, HG, RB):
                r = r0 + tl.arange(0, RB)
                x = tl.load(bound_ptr + (b * HG + r)[:, None] * NB + p[None, :],
                            mask=(r[:, None] < HG) & valid[None, :], other=float("-inf"))
                mx = tl.max(x, axis=1)
                lse = tl.log(tl.sum(tl.exp(x - mx[:, None]), axis=1)) + mx
                share = tl.where(r[:, None] < HG, x - lse[:, None], float("-inf"))
                quest = tl.maximum(quest, tl.max(share, axis=0))
            wsum = tl.zeros((NP,), tl.float32)
            for h in range(H):
                wsum += tl.load(wpart_ptr + (b * H + h) * NB + p, mask=valid, other=0.0)
            tl.store(fs_ptr + p, quest)
            tl.store(fs_ptr + NP + p, wsum)
            tl.debug_barrier()
            # --- ranks (0 = best; ties: the lower page first) and the hybrid key ---------------
            for i0 in range(0, NP, BI):
                i = i0 + tl.arange(0, BI)
                qi = tl.load(fs_ptr + i)
                wi = tl.load(fs_ptr + NP + i)
                qj = tl.load(fs_ptr + p)
                wj = tl.load(fs_ptr + NP + p)
                before = p[None, :] < i[:, None]
                vj = valid[None, :]
                rq = tl.sum((((qj[None, :] > qi[:, None]) | ((qj[None, :] == qi[:, None]) & before))
                             & vj).to(tl.int32), axis=1).to(tl.int64)
                rw = tl.sum((((wj[None, :] > wi[:, None]) | ((wj[None, :] == wi[:, None]) & before))
                             & vj).to(tl.int32), axis=1).to(tl.int64)
                key = tl.minimum(rq, rw) * (2 * n + 2) + rq
                key = tl.where(i < n, key, NEVER)
                tl.store(is_ptr + i, key)
            tl.debug_barrier()
            # --- the k smallest keys (all distinct), in page order ----------------------------
            for i0 in range(0, NP, BI):
                i = i0 + tl.arange(0, BI)
                ki = tl.load(is_ptr + i)
                kj = tl.load(is_ptr + p)
                below = tl.sum((kj[None, :] < ki[:, None]).to(tl.int32), axis=1)
                tl.store(is_ptr + NP + i, ((below < k) & (i < n)).to(tl.int64))
            tl.debug_barrier()
            sel = tl.load(is_ptr + NP + p)
            at = tl.cumsum(sel, axis=0) - sel  # the chosen index of a chosen page
            chosen = sel != 0
            tl.store(chosen_ptr + b * k + at, p.to(tl.int64), mask=chosen)
            # --- the page cache: hits, victims (empty, then least recently chosen slots that
            # hold no page chosen now, the slot's index breaking ties), tables ------------------
            slot = tl.load(sop_ptr + b * sop_w + p, mask=chosen, other=-1)
            miss = chosen & (slot < 0)
            c = tl.arange(0, CP)
            cm = c < C
            pg = tl.load(page_of_slot_ptr + b * C + c, mask=cm, other=-1)
            held = tl.load(is_ptr + NP + tl.maximum(pg, 0), mask=cm & (pg >= 0), other=0)
            stamp = tl.load(last_used_ptr + b * (C + 1) + c, mask=cm, other=NEVER)
            stamp = tl.where(held != 0, NEVER, stamp)
            stamp = tl.where(cm, stamp, NEVER + 1)
            tl.store(is_ptr + 3 * NP + c, stamp)
            tl.debug_barrier()
            for c0 in range(0, CP, BC):
                ci = c0 + tl.arange(0, BC)
                si = tl.load(is_ptr + 3 * NP + ci)
                sj = tl.load(is_ptr + 3 * NP + c)
                rank = tl.sum(((sj[None, :] < si[:, None])
                               | ((sj[None, :] == si[:, None]) & (c[None, :] < ci[:, None])))
                              .to(tl.int32), axis=1)
                tl.store(is_ptr + 3 * NP + CP + rank, ci.to(tl.int64), mask=ci < C)
            tl.debug_barrier()
            m = tl.cumsum(miss.to(tl.int32), axis=0)
            victim = tl.load(is_ptr + 3 * NP + CP + tl.maximum(m - 1, 0), mask=miss, other=0)
            new_slot = tl.where(miss, victim, slot)
            evicted = tl.load(page_of_slot_ptr + b * C + new_slot, mask=chosen, other=-1)
            tl.store(sop_ptr + b * sop_w + evicted, tl.full((NP,), -1, tl.int64),
                     mask=chosen & (evicted >= 0))
            tl.debug_barrier()
            tl.store(sop_ptr + b * sop_w + p, new_slot, mask=chosen)
            tl.store(page_of_slot_ptr + b * C + new_slot, p.to(tl.int64), mask=chosen)
            tl.store(last_used_ptr + b * (C + 1) + new_slot, tl.zeros((NP,), tl.int64) + step,
                     mask=chosen)
            row = tl.load(table_ptr + b * table_w + p, mask=miss, other=-1)
            tl.store(slot_out_ptr + b * k + at, new_slot, mask=chosen)
            tl.store(src_out_ptr + b * k + at, tl.where(miss, row, -1), mask=chosen)
            total_miss += tl.sum(miss.to(tl.int64), axis=0)
            tl.debug_barrier()
        tl.store(step_ptr, step + 1)
        tl.store(hits_ptr, tl.load(hits_ptr) + B * k - total_miss)
        tl.store(misses_ptr, tl.load(misses_ptr) + total_miss)
        tl.store(last_ptr, total_miss)
        # --- the step's keys and values into the recent window at its position ----------------
        pos = tl.load(winpos_ptr)
        dd = tl.arange(0, D)
        for j in range(B * H):  # keys [b, h, 1, d] then values, each where it lies
            tl.store(win_ptr + (j * CAP + pos) * D + dd, tl.load(kin_ptr + j * D + dd))
            tl.store(win_ptr + ((B * H + j) * CAP + pos) * D + dd, tl.load(vin_ptr + j * D + dd))
        tl.store(winpos_ptr, pos + 1)

    # _choose split in three (``SPLIT``): the rankings over many programs, then the choice,
    # then the page cache's bookkeeping in one program -- the same values as _choose's
    @triton.jit(do_not_specialize=["NB"])
    def _rank(bound_ptr, wpart_ptr, key_ptr, n_ptr, NB,
              H: tl.constexpr, HG: tl.constexpr, RB: tl.constexpr, NP: tl.constexpr,
              BI: tl.constexpr, NEVER: tl.constexpr):
        n = tl.load(n_ptr)
        b = tl.program_id(0)
        i = tl.program_id(1) * BI + tl.arange(0, BI)
        p = tl.arange(0, NP)
        valid = p < n
        iv = i < n
        quest = tl.full((NP,), float("-inf"), tl.float32)
        quest_i = tl.full((BI,), float("-inf"), tl.float32)
        for r0 in range(0, HG, RB):
            r = r0 + tl.arange(0, RB)
            rm = r < HG
            x = tl.load(bound_ptr + (b * HG + r)[:, None] * NB + p[None, :],
                        mask=rm[:, None] & valid[None, :], other=float("-inf"))
            mx = tl.max(x, axis=1)
            lse = tl.log(tl.sum(tl.exp(x - mx[:, None]), axis=1)) + mx
            share = tl.where(rm[:, None], x - lse[:, None], float("-inf"))
            quest = tl.maximum(quest, tl.max(share, axis=0))
            xi = tl.load(bound_ptr + (b * HG + r)[:, None] * NB + i[None, :],
                         mask=rm[:, None] & iv[None, :], other=float("-inf"))
            share_i = tl.where(rm[:, None], xi - lse[:, None], float("-inf"))
            quest_i = tl.maximum(quest_i, tl.max(share_i, axis=0))
        wsum = tl.zeros((NP,), tl.float32)
        wsum_i = tl.zeros((BI,), tl.float32)
        for h in range(H):
            wsum += tl.load(wpart_ptr + (b * H + h) * NB + p, mask=valid, other=0.0)
            wsum_i += tl.load(wpart_ptr + (b * H + h) * NB + i, mask=iv, other=0.0)
        before = p[None, :] < i[:, None]
        vj = valid[None, :]
        rq = tl.sum((((quest[None, :] > quest_i[:, None])
                      | ((quest[None, :] == quest_i[:, None]) & before)) & vj).to(tl.int32),
                    axis=1).to(tl.int64)
        rw = tl.sum((((wsum[None, :] > wsum_i[:, None])
                      | ((wsum[None, :] == wsum_i[:, None]) & before)) & vj).to(tl.int32),
                    axis=1).to(tl.int64)
        key = tl.minimum(rq, rw) * (2 * n + 2) + rq
        tl.store(key_ptr + b * NP + i, tl.where(iv, key, NEVER))

    @triton.jit(do_not_specialize=["k"])
    def _select(key_ptr, sel_ptr, n_ptr, k, NP: tl.constexpr, BI: tl.constexpr):
        n = tl.load(n_ptr)
        b = tl.program_id(0)
        i = tl.program_id(1) * BI + tl.arange(0, BI)
        p = tl.arange(0, NP)
        ki = tl.load(key_ptr + b * NP + i)
        kj = tl.load(key_ptr + b * NP + p)
        below = tl.sum((kj[None, :] < ki[:, None]).to(tl.int32), axis=1)
        tl.store(sel_ptr + b * NP + i, ((below < k) & (i < n)).to(tl.int64))

    @triton.jit(do_not_specialize=["k", "C"])
    def _book(sel_ptr, is_ptr, chosen_ptr, slot_out_ptr, src_out_ptr,
              sop_ptr, sop_w, page_of_slot_ptr, last_used_ptr, step_ptr,
              table_ptr, table_w, hits_ptr, misses_ptr, last_ptr, win_ptr, winpos_ptr, kin_ptr,
              vin_ptr, k, B, C, CAP,
              H: tl.constexpr, NP: tl.constexpr, CP: tl.constexpr, BC: tl.constexpr,
              D: tl.constexpr, NEVER: tl.constexpr):
        # scratch: is_ptr int64 [2 * CP] (stamps, victim of rank)
        p = tl.arange(0, NP)
        step = tl.load(step_ptr)
        total_miss = tl.sum(tl.zeros((NP,), tl.int64), axis=0)
        for b in range(B):
            sel = tl.load(sel_ptr + b * NP + p)
            at = tl.cumsum(sel, axis=0) - sel
            chosen = sel != 0
            tl.store(chosen_ptr + b * k + at, p.to(tl.int64), mask=chosen)
            slot = tl.load(sop_ptr + b * sop_w + p, mask=chosen, other=-1)
            miss = chosen & (slot < 0)
            c = tl.arange(0, CP)
            cm = c < C
            pg = tl.load(page_of_slot_ptr + b * C + c, mask=cm, other=-1)
            held = tl.load(sel_ptr + b * NP + tl.maximum(pg, 0), mask=cm & (pg >= 0), other=0)
            stamp = tl.load(last_used_ptr + b * (C + 1) + c, mask=cm, other=NEVER)
            stamp = tl.where(held != 0, NEVER, stamp)
            stamp = tl.where(cm, stamp, NEVER + 1)
            tl.store(is_ptr + c, stamp)
            tl.debug_barrier()
            for c0 in range(0, CP, BC):
                ci = c0 + tl.arange(0, BC)
                si = tl.load(is_ptr + ci)
                sj = tl.load(is_ptr + c)
                rank = tl.sum(((sj[None, :] < si[:, None])
                               | ((sj[None, :] == si[:, None]) & (c[None, :] < ci[:, None])))
                              .to(tl.int32), axis=1)
                tl.store(is_ptr + CP + rank, ci.to(tl.int64), mask=ci < C)
            tl.debug_barrier()
            m = tl.cumsum(miss.to(tl.int32), axis=0)
            victim = tl.load(is_ptr + CP + tl.maximum(m - 1, 0), mask=miss, other=0)
            new_slot = tl.where(miss, victim, slot)
            evicted = tl.load(page_of_slot_ptr + b * C + new_slot, mask=chosen, other=-1)
            tl.store(sop_ptr + b * sop_w + evicted, tl.full((NP,), -1, tl.int64),
                     mask=chosen & (evicted >= 0))
            tl.debug_barrier()
            tl.store(sop_ptr + b * sop_w + p, new_slot, mask=chosen)
            tl.store(page_of_slot_ptr + b * C + new_slot, p.to(tl.int64), mask=chosen)
            tl.store(last_used_ptr + b * (C + 1) + new_slot, tl.zeros((NP,), tl.int64) + step,
                     mask=chosen)
            row = tl.load(table_ptr + b * table_w + p, mask=miss, other=-1)
            tl.store(slot_out_ptr + b * k + at, new_slot, mask=chosen)
            tl.store(src_out_ptr + b * k + at, tl.where(miss, row, -1), mask=chosen)
            total_miss += tl.sum(miss.to(tl.int64), axis=0)
            tl.debug_barrier()
        tl.store(step_ptr, step + 1)
        tl.store(hits_ptr, tl.load(hits_ptr) + B * k - total_miss)
        tl.store(misses_ptr, tl.load(misses_ptr) + total_miss)
        tl.store(last_ptr, total_miss)
        pos = tl.load(winpos_ptr)
        dd = tl.arange(0, D)
        for j in range(B * H):  # keys [b, h, 1, d] then values, each where it lies
            tl.store(win_ptr + (j * CAP + pos) * D + dd, tl.load(kin_ptr + j * D + dd))
            tl.store(win_ptr + ((B * H + j) * CAP + pos) * D + dd, tl.load(vin_ptr + j * D + dd))
        tl.store(winpos_ptr, pos + 1)

    @triton.jit(do_not_specialize=["K", "C"])
    def _fetch(host_ptr, slots_ptr, src_ptr, slot_ptr, K, C, UNIT_W, PAGE_W,
               CW: tl.constexpr):
        bj = tl.program_id(0)
        ch = tl.program_id(1)
        b = bj // K
        src = tl.load(src_ptr + bj)
        slot = tl.load(slot_ptr + bj)
        off = ch * CW + tl.arange(0, CW)
        m = (off < PAGE_W) & ((off * 0 + src) >= 0)
        x = tl.load(host_ptr + src * UNIT_W + off, mask=m)
        tl.store(slots_ptr + (b * C + slot) * PAGE_W + off, x, mask=m)

    @triton.jit(do_not_specialize=["K", "C", "NBLK", "BPS"])
    def _attend(q_ptr, sinks_ptr, slots_ptr, win_ptr, winpos_ptr, slot_ptr,
                acc_ptr, ml_ptr, scale, S, K, C, B, CAP, NBLK, BPS,
                H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                P: tl.constexpr, NSPLIT: tl.constexpr):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // H
        h = bh % H
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        t = tl.arange(0, P)
        gm = g < G
        q = tl.load(q_ptr + (bh * G + g)[:, None] * D + d[None, :], mask=gm[:, None], other=0.0)
        length = tl.load(winpos_ptr)
        m_i = tl.full((GP,), -1.0e30, tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        page_e = 2 * H * P * D
        for blk in range(split * BPS, tl.minimum(NBLK, (split + 1) * BPS)):
            w = blk - 1 - K
            n_valid = tl.where(blk == 0, S, tl.where(blk <= K, P, tl.minimum(P, length - w * P)))
            if blk == 0:
                kb = sinks_ptr + (b * H + h) * S * D
                vb = sinks_ptr + ((B + b) * H + h) * S * D
            elif blk <= K:
                s_ = tl.load(slot_ptr + b * K + blk - 1)
                kb = slots_ptr + (b * C + s_) * page_e + h * P * D
                vb = kb + H * P * D
            else:
                kb = win_ptr + (b * H + h) * CAP * D + w * P * D
                vb = win_ptr + ((B + b) * H + h) * CAP * D + w * P * D
            tm = t < n_valid
            kt = tl.load(kb + t[:, None] * D + d[None, :], mask=tm[:, None], other=0.0)
            vt = tl.load(vb + t[:, None] * D + d[None, :], mask=tm[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale
            s = tl.where(tm[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            acc = acc * alpha[:, None] + tl.dot(pr.to(vt.dtype), vt, input_precision="ieee")
            m_i = m_new
        row = (bh * NSPLIT + split) * GP + g
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc)
        tl.store(ml_ptr + row * 2, m_i)
        tl.store(ml_ptr + row * 2 + 1, l_i)

    @triton.jit
    def _combine(acc_ptr, ml_ptr, out_ptr, G: tl.constexpr, GP: tl.constexpr,
                 D: tl.constexpr, NSPLIT: tl.constexpr):
        bh = tl.program_id(0)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        m = tl.full((GP,), -1.0e30, tl.float32)
        for s in range(NSPLIT):
            m = tl.maximum(m, tl.load(ml_ptr + ((bh * NSPLIT + s) * GP + g) * 2))
        l_sum = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        for s in range(NSPLIT):
            row = (bh * NSPLIT + s) * GP + g
            w = tl.exp(tl.load(ml_ptr + row * 2) - m)
            l_sum += tl.load(ml_ptr + row * 2 + 1) * w
            acc += tl.load(acc_ptr + row[:, None] * D + d[None, :]) * w[:, None]
        out = acc / l_sum[:, None]
        tl.store(out_ptr + (bh * G + g)[:, None] * D + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])


def pages_room(n: int) -> int:
    """The pages a fused step's buffers and grids are sized for, given ``n`` pages now."""
    return max(16, _p2(n))


def _addresses(q, k_new, v_new) -> tuple:
    return q.data_ptr(), k_new.data_ptr(), v_new.data_ptr()


def reads_in_place(q, k_new, v_new) -> bool:
    """Whether the kernels can read the step's query ``[b, hq, 1, d]``, keys and values
    ``[b, h, 1, d]`` where they lie: each dense in (b, head, channel) order, as a decode step's
    projections leave them."""
    return q.is_contiguous() and k_new.is_contiguous() and v_new.is_contiguous()


class _Direct:
    """What an emulated graph over the step's own tensors reruns (tests/kv): the step with the
    tensors of the step replaying it."""

    def __init__(self, step):
        self.step = step

    def _run(self):
        return self.step.run(*self.step.live)


def applies(layer, cache, k: int) -> str | None:
    """Why the fused step cannot serve this layer's decode step (None: it can)."""
    layout = cache.layout
    p, d = layout.page_tokens, layout.head_dim
    w = cache.window_pages
    if cache.score != "hybrid":
        return "score"
    if w < 16 or w > 256 or w & (w - 1):
        return "window_pages"
    if d < 16 or d & (d - 1) or p < 16:
        return "head_dim"
    if layer.sinks > p or layer.sinks < 1:
        return "sinks"
    if (layout.page_bytes % 8) or layout.elem_bytes < 2:
        return "layout"
    return None


class FusedStep:
    """The buffers and kernels of one top-K layer's fused decode step for fixed shapes and
    buffers (``key``), captured as a CUDA graph where it runs on CUDA."""

    def __init__(self, key, layer, span, page_cache, window, sinks_kv, query, k: int,
                 scaling: float):
        cache = layer._cache
        self.key = key
        self.settings = cache._fused_settings()
        self.shape, self.dtype = query.shape, query.dtype
        self.layer_index = layer.index
        self.summaries = layer.summaries
        self.span, self.pc, self.window, self.sinks_kv = span, page_cache, window, sinks_kv
        b, hq, _, d = query.shape
        h = cache.kv_heads
        self.b, self.h, self.g, self.d = b, h, hq // h, d
        self.n, self.k = layer.summaries.n, k
        self.scale, self.scaling = float(cache.scale), float(scaling)
        self.w = cache.window_pages
        self.p = cache.page_tokens
        dev = query.device
        self.np_ = pages_room(self.n)
        # the page count the kernels read (``set_pages``): one graph serves while pages are
        # added up to ``np_`` (the buffers' room), the same ``k`` and the same host view
        self.n_dev = torch.full((1,), self.n, dtype=torch.int64, device=dev)
        self.nb = self.np_
        self.cp = max(16, _p2(page_cache.capacity))
        self.gp = max(16, _p2(self.g))
        f32 = torch.float32
        self.q_in = torch.empty((b, hq, 1, d), dtype=query.dtype, device=dev)
        self.kv_in = torch.empty((2, b, h, 1, d), dtype=query.dtype, device=dev)
        self.k_in, self.v_in = self.kv_in[0], self.kv_in[1]
        self.bound = torch.empty((b * h * self.g, self.nb), dtype=f32, device=dev)
        self.wpart = torch.empty((b * h, self.nb), dtype=f32, device=dev)
        self.fs = torch.empty(2 * self.np_, dtype=f32, device=dev)
        self.iscratch = torch.empty(3 * self.np_ + 2 * self.cp, dtype=torch.int64, device=dev)
        self.chosen = torch.zeros((b, k), dtype=torch.int64, device=dev)
        self.slot_out = torch.zeros((b, k), dtype=torch.int64, device=dev)
        self.src_out = torch.zeros((b, k), dtype=torch.int64, device=dev)
        cap = window.capacity
        self.nblk = 1 + k + -(-cap // self.p)
        sms = (torch.cuda.get_device_properties(dev).multi_processor_count
               if dev.type == "cuda" else 4)
        nsplit = max(1, min(self.nblk, (2 * sms) // (b * h)))
        self.bps = -(-self.nblk // nsplit)
        self.nsplit = -(-self.nblk // self.bps)
        self.acc = torch.empty((b * h * self.nsplit * self.gp, d), dtype=f32, device=dev)
        self.ml = torch.empty((b * h * self.nsplit * self.gp, 2), dtype=f32, device=dev)
        self.out = torch.empty((b, 1, hq, d), dtype=query.dtype, device=dev)
        page_words = cache.layout.page_bytes // 8
        unit = span.rows.shape[1] * span.rows.element_size()
        if unit % 8:
            raise RuntimeError("host rows not 8-byte units")
        self.host_words = span.rows.view(torch.int64) if span.rows.dtype != torch.int64 else span.rows
        self.slots_words = page_cache.slots.view(torch.int64)
        self.unit_w, self.page_w = unit // 8, page_words
        self.cw = min(1024, _p2(page_words))
        self.rb = min(_p2(h * self.g), max(1, 8192 // self.np_))
        self.bi = max(1, min(self.np_, 8192 // self.np_))
        self.bc = max(1, min(self.cp, 8192 // self.cp))
        self.split = SPLIT[0]
        self.bi_split = max(1, min(self.np_, 16))
        self.keys = torch.empty((b, self.np_), dtype=torch.int64, device=dev)
        self.sel = torch.empty((b, self.np_), dtype=torch.int64, device=dev)
        self.graph = None
        # the graph over the step's own tensors (``go``): where it reads them, the addresses the
        # last step's came at, the running step's tensors while it replays (what an emulated
        # graph reruns), whether its capture failed
        self.direct = self.direct_at = self.seen_at = self.live = None
        self.direct_failed = False

    def set_pages(self, n: int) -> None:
        """The layer's page count now (``n <= np_``): one device fill where it changed."""
        if n != self.n:
            self.n_dev.fill_(n)
            self.n = n

    def load(self, query, k_new, v_new) -> None:
        torch._foreach_copy_([self.q_in, self.k_in, self.v_in], [query, k_new, v_new])

    def run(self, q=None, k_new=None, v_new=None) -> torch.Tensor:
        """The kernels, in order, on the current stream (five; seven with ``SPLIT``), reading the
        step's query, keys and values from ``q``, ``k_new``, ``v_new`` (contiguous; see
        ``reads_in_place``) or, None, from the fixed buffers ``load`` fills; -> the chosen pages
        ``[b, k]`` (the output ``[b, 1, hq, d]`` is in ``out``)."""
        if q is None:
            q, k_new, v_new = self.q_in, self.k_in, self.v_in
        b, h, g, d = self.b, self.h, self.g, self.d
        pc, win = self.pc, self.window
        mm = self.summaries.minmax
        _score[(b * h, -(-self.np_ // self.w))](
            q, mm, self.bound, self.wpart, self.n_dev, self.scale, mm.stride(0),
            mm.stride(1), self.nb, H=h, G=g, GP=self.gp, D=d, W=self.w)
        if self.split:
            bi = self.bi_split
            _rank[(b, self.np_ // bi)](
                self.bound, self.wpart, self.keys, self.n_dev, self.nb, H=h, HG=h * g, RB=self.rb,
                NP=self.np_, BI=bi, NEVER=_NEVER)
            _select[(b, self.np_ // bi)](self.keys, self.sel, self.n_dev, self.k, NP=self.np_,
                                         BI=bi)
            _book[(1,)](
                self.sel, self.iscratch, self.chosen, self.slot_out, self.src_out,
                pc.slot_of_page, pc.slot_of_page.shape[1], pc.page_of_slot, pc.last_used,
                pc.step, self.span.table, self.span.table.shape[1], pc.hits, pc.misses,
                pc.last_misses, win.kv, win.pos, k_new, v_new, self.k, b, pc.capacity,
                win.capacity, H=h, NP=self.np_, CP=self.cp, BC=self.bc, D=d, NEVER=_NEVER,
                num_warps=8)
        else:
            self._choose_one(b, h, g, d, pc, win, k_new, v_new)
        _fetch[(b * self.k, -(-self.page_w // self.cw))](
            self.host_words, self.slots_words, self.src_out, self.slot_out, self.k, pc.capacity,
            self.unit_w, self.page_w, CW=self.cw)
        _attend[(b * h, self.nsplit)](
            q, self.sinks_kv, pc.slots, win.kv, win.pos, self.slot_out, self.acc,
            self.ml, self.scaling, self.sinks_kv.shape[3], self.k, pc.capacity, b,
            win.capacity, self.nblk, self.bps, H=h, G=g, GP=self.gp, D=d, P=self.p,
            NSPLIT=self.nsplit)
        _combine[(b * h,)](self.acc, self.ml, self.out, G=g, GP=self.gp, D=d,
                           NSPLIT=self.nsplit)
        return self.chosen

    def _choose_one(self, b, h, g, d, pc, win, k_new, v_new) -> None:
        _choose[(1,)](
            self.bound, self.wpart, self.fs, self.iscratch, self.chosen, self.slot_out,
            self.src_out, pc.slot_of_page, pc.slot_of_page.shape[1], pc.page_of_slot,
            pc.last_used, pc.step, self.span.table, self.span.table.shape[1], pc.hits, pc.misses,
            pc.last_misses,
            win.kv, win.pos, k_new, v_new, self.n_dev, self.k, b, pc.capacity, self.nb,
            win.capacity,
            H=h, HG=h * g, RB=self.rb, NP=self.np_, BI=self.bi, CP=self.cp, BC=self.bc, D=d,
            NEVER=_NEVER, num_warps=8)

    _run = run  # the name kv/graphs.py's test emulation replays

    def capture(self, pool) -> None:
        """This step eagerly (the kernels compiled, the step's work done), then the same kernels
        captured as a CUDA graph and replayed once (its page-cache counts put back: the eager run
        counted the step), as kv/graphs.py's ``SelectGraph``."""
        from . import graphs

        dev = self.q_in.device
        win, pc = self.window, self.pc
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            pos_before = win.pos.clone()
            self.run()
            win.pos.copy_(pos_before)
            counted = pc.snapshot()
            graph = graphs.new_graph(self)
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                self.run()
            finally:
                graph.capture_end()
            win.pos.copy_(pos_before)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = graph
        graph.replay()
        pc.restore(counted)

    def _capture_direct(self, pool, q, k_new, v_new) -> None:
        """After a step done: the same kernels captured reading ``q``, ``k_new``, ``v_new`` where
        they lie (``direct``), for the next steps whose tensors come at those addresses. Nothing
        runs (the kernels were compiled for such pointers by the buffers' step: 16-byte aligned
        both); an emulated capture that runs them has its effects on the window's position, the
        counts and the output undone (the pages it chose again were the step's: no page moves)."""
        from . import graphs

        dev = q.device
        win, pc = self.window, self.pc
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            pos_before, counted, out = win.pos.clone(), pc.snapshot(), self.out.clone()
            graph = graphs.new_graph(_Direct(self))
            self.live = (q, k_new, v_new)
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                self.run(q, k_new, v_new)
            finally:
                graph.capture_end()
                self.live = None
            win.pos.copy_(pos_before)
            pc.restore(counted)
            self.out.copy_(out)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.direct, self.direct_at = graph, _addresses(q, k_new, v_new)

    def go(self, query, k_new, v_new, pool) -> None:
        """One decode step through this step's kernels, ``out`` its output. Captured: the
        graph reading the step's tensors where they lie when they are where it was captured for
        (``direct``: no copy), else their copy into the buffers and the buffers' graph; the
        direct graph is captured after a step whose tensors came at the same addresses as the
        step's before (the caching allocator hands a steady decode step the same blocks every
        step). Not captured (the CPU's interpreter): the kernels read the tensors in place.
        ``pool``: a function giving the graphs' memory pool."""
        live = (query, k_new, v_new)
        if self.graph is None:
            if reads_in_place(*live):
                self.run(*live)
            else:
                self.load(*live)
                self.run()
            return
        at = _addresses(*live)
        if at == self.direct_at and reads_in_place(*live):
            self.live = live
            try:
                self.direct.replay()
            finally:
                self.live = None
            return
        self.load(*live)
        self.graph.replay()
        if (self.direct is None and at == self.seen_at and not self.direct_failed
                and all(a % 16 == 0 for a in at) and reads_in_place(*live)):
            try:
                self._capture_direct(pool(), *live)
            except Exception as exc:  # the buffers' graph serves on
                self.direct_failed = True
                self.direct = self.direct_at = None
                log.warning("layer %d: the fused step's graph over the step's own tensors was "
                            "not captured (%s); its buffers' graph serves", self.layer_index, exc)
        self.seen_at = at
