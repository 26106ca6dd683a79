"""The Triton kernels of a top-K layer's fused decode step (kv/fused.py ``FusedStep`` launches
them, in this order):

1. ``_score``: the Quest bound of every page and head (``[q+, q-] . [max, min]``) and each
   window's softmax mass (the ``"windowed"`` score, per head), one program per (sequence, kv
   head, window of pages);
2. ``_choose``: one program: the ``"quest"`` score (log-shares, best head), the windowed sum,
   both rankings, the hybrid key and its ``k`` smallest (kv/summaries.py ``_choose_hybrid``; each
   ranking one sort of packed keys, ``_ranked``), the page cache's bookkeeping (kv/pagecache.py ``gather_into``: hits, the least recently chosen
   victims for the misses -- one sort of the slots' stamps, ``_victims`` --, the tables, the
   counters), and the step's keys and values written into
   the recent window at its device-held position -- or, split (kv/fused.py ``SPLIT``), ``_rank``
   (the rankings and the hybrid key, many programs), ``_select`` (the ``k`` smallest keys, many
   programs) and ``_book`` (the page cache's bookkeeping and the window write, one program);
3. ``_fetch``: the misses' pages from the host (read through the unified address space, as the
   one gather of kv/span.py) into their slots -- the only bytes that cross PCIe;
4. ``_attend``: flash decoding over the sinks, the chosen pages in their slots (through the slot
   of each chosen page) and the recent window, split over the columns;
5. ``_combine``: the splits' partial softmaxes into the output ``[b, 1, q_heads, d]``.

Without Triton the names are absent (``triton`` is None) and the torch path serves.
"""
from __future__ import annotations

try:  # Triton is optional: the torch path serves without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None

NEVER = 1 << 62
"""A key or stamp larger than any real one (a page not chosen, a slot never used)."""
KERNELS = ("_score", "_choose", "_rank", "_select", "_book", "_fetch", "_attend", "_combine")

if triton is not None:

    @triton.jit
    def _ranked(x, p, valid, NP: tl.constexpr):
        """The pages ``p`` [NP] in the order of their scores ``x`` (float32): the higher score
        first, equal scores by the lower page, pages not ``valid`` last -- as int64 keys whose
        remainder by ``NP`` is the page (the position of a valid page is its rank)."""
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 and 0.0 are one score
        bits = x.to(tl.int32, bitcast=True)
        order = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)  # increasing with x
        desc = 2147483647 - order  # in [0, 2^32): the higher x, the smaller
        desc = tl.where(valid, desc, 4294967296)
        return tl.sort(desc * NP + p.to(tl.int64))

    @triton.jit
    def _victims(stamp, held, c, C, CP: tl.constexpr):
        """Slots ``c`` [CP] in the order they give way: empty (stamp -1), then the least
        recently chosen, the lower slot first; slots that hold a page chosen now (``held``) and
        slots past ``C`` last -- as int64 keys whose remainder by ``CP`` is the slot."""
        s = tl.minimum(stamp, 1 << 40) + 1  # >= 0: empty slots hold -1
        s = tl.where(held, (1 << 40) + 1, s)
        s = tl.where(c < C, s, (1 << 40) + 2)
        return tl.sort(s * CP + c.to(tl.int64))

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
    def _choose(bound_ptr, wpart_ptr, is_ptr, chosen_ptr, slot_out_ptr, src_out_ptr,
                sop_ptr, sop_w, page_of_slot_ptr, last_used_ptr, step_ptr,
                table_ptr, table_w, hits_ptr, misses_ptr, last_ptr, win_ptr, winpos_ptr, kin_ptr,
                vin_ptr, n_ptr, k, B, C, NB, CAP,
                H: tl.constexpr, HG: tl.constexpr, RB: tl.constexpr, NP: tl.constexpr,
                CP: tl.constexpr, D: tl.constexpr):
        # scratch: is_ptr int64 [3 * NP + 2 * CP] (each page's "quest" rank, chosen flag and
        # windowed rank; the victim of each rank at 3 * NP + CP). Every ranking is one sort
        # (O(NP log^2 NP) in this one program, not NP^2 comparisons)
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
            # --- ranks (0 = best; ties: the lower page first), the hybrid key and its k smallest
            # (all distinct), each by one sort: a page's rank is its position ----------------
            srt = _ranked(quest, p, valid, NP)
            tl.store(is_ptr + srt % NP, p.to(tl.int64))
            srt = _ranked(wsum, p, valid, NP)
            tl.store(is_ptr + 2 * NP + srt % NP, p.to(tl.int64))
            tl.debug_barrier()
            rq = tl.load(is_ptr + p)
            rw = tl.load(is_ptr + 2 * NP + p)
            key = tl.minimum(rq, rw) * (2 * n + 2) + rq
            key = tl.where(valid, key, (2 * NP + 3) * NP)  # past any page's key
            srt = tl.sort(key * NP + p.to(tl.int64))
            tl.store(is_ptr + NP + srt % NP, (p < k).to(tl.int64))
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
            stamp = tl.load(last_used_ptr + b * (C + 1) + c, mask=cm, other=0)
            srt = _victims(stamp, held != 0, c, C, CP)
            tl.store(is_ptr + 3 * NP + CP + c, srt % CP, mask=cm)  # the victim of each rank
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
              H: tl.constexpr, NP: tl.constexpr, CP: tl.constexpr, D: tl.constexpr):
        # scratch: is_ptr int64 [2 * CP] (the victim of each rank at CP)
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
            stamp = tl.load(last_used_ptr + b * (C + 1) + c, mask=cm, other=0)
            srt = _victims(stamp, held != 0, c, C, CP)
            tl.store(is_ptr + CP + c, srt % CP, mask=cm)  # the victim of each rank
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
