"""Which pages a decode step attends to: the pure policy, table-tested (tests/kv/test_select.py).

Every function takes tensors of fixed shape and returns tensors; no state, no copies of pages.

* ``quest_bound``: Quest's upper bound of ``q . k`` over a page from the page's per-channel key
  minimum and maximum: ``sum_d max(q_d * min_d, q_d * max_d)``, computed as two matmuls.
* ``page_scores``: one score per (sequence, page) from the bounds of all heads and queries.
  ``"quest"``: each head's bounds become log-shares (``bound - logsumexp over pages``) and a page
  scores the best log-share any head gives it -- a page one head needs is kept even when the
  other heads ignore it. ``"windowed"``: each head's bounds are softmax-normalised inside windows
  of ``window_pages`` consecutive pages and summed over heads and queries -- an estimate of the
  attention mass a page receives, relative to its neighbourhood.
* ``"hybrid"`` (the default): the union of the ``"quest"`` and ``"windowed"`` rankings -- a page
  either rule ranks in its top ``j`` is in, ``j`` growing until ``k`` pages are: the heads'
  sharpest needs (Quest, what retrieval rests on) and the broad attention mass (windowed, what
  perplexity rests on) share the budget (docs/benchmarks.md, kv_accuracy).
* ``mass_logits`` + ``"mass"`` / ``"mass_max"``: an estimate of each page's attention mass from
  the same min/max (the keys' midpoint and spread per channel), softmax over the pages per head
  and query, summed (``mass``) or the best log-share of any head (``mass_max``). Measured, not
  better than the Quest bound on the trained model (docs/benchmarks.md).
* ``select_pages``: the top ``k`` pages per sequence, in page order.
"""
from __future__ import annotations

import math

import torch

SCORES = ("quest", "hybrid", "mass", "mass_max", "windowed")


def resolve_top_k(top_k_pages: int | float | None, n_pages: int) -> int | None:
    """Pages to attend out of ``n_pages``: None (all: lossless), an int (at most that many) or a
    fraction in (0, 1] of the pages (rounded up, at least one)."""
    if top_k_pages is None:
        return None
    if isinstance(top_k_pages, float):
        k = math.ceil(top_k_pages * n_pages)
    else:
        k = int(top_k_pages)
    k = max(1, k)
    return None if k >= n_pages else k


def quest_bound(queries: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                scale: float) -> torch.Tensor:
    """``queries`` ``[b, kv_heads, g, d]`` (g = query heads per kv head x query positions),
    ``kmin``/``kmax`` ``[b, kv_heads, n, d]`` -> bounds ``[b, kv_heads, g, n]`` (fp32)."""
    q = queries.float()
    # one matmul over 2d channels: [q+, q-] . [max, min] (PageSummaries keeps them side by side)
    q = torch.cat((q.clamp(min=0), q.clamp(max=0)), -1)
    return (q @ torch.cat((kmax, kmin), -1).float().transpose(-1, -2)) * scale


def mass_logits(queries: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                scale: float) -> torch.Tensor:
    """An estimate of ``log sum_j exp(q . k_j)`` over a page's keys, up to a constant, from the
    same per-channel min/max: the keys taken as independent per channel, centred on the
    midpoint ``(min + max) / 2`` with standard deviation ``(max - min) / 4``, give
    ``q . mid + (scale / 2) . sum_d q_d^2 . sd_d^2`` (log-normal mean). ``queries``
    ``[b, kv_heads, g, d]``, ``kmin``/``kmax`` ``[b, kv_heads, n, d]`` -> ``[b, kv_heads, g, n]``
    (fp32, scaled)."""
    q = queries.float()
    lo, hi = kmin.float(), kmax.float()
    mid = (lo + hi) * 0.5
    var = ((hi - lo) * 0.25).square()
    return (q @ mid.transpose(-1, -2)) * scale + (q.square() @ var.transpose(-1, -2)) * (0.5 * scale * scale)


def page_scores(bound: torch.Tensor, score: str = "quest", window_pages: int = 64) -> torch.Tensor:
    """``bound`` ``[b, kv_heads, g, n]`` -> ``[b, n]``; higher is more worth attending. For
    ``"mass"`` ``bound`` holds ``mass_logits``: each head's and query's estimated attention mass
    over the pages (a softmax) is summed over heads and queries."""
    if score == "mass":
        return bound.softmax(-1).sum(dim=(1, 2))
    if score in ("quest", "mass_max"):
        share = bound - bound.logsumexp(-1, keepdim=True)
        return share.amax(dim=(1, 2))
    if score == "hybrid":
        # a page ranked high by either rule: the union of the top j of both rankings, j growing
        # until k pages are in (ties: the better Quest rank first)
        n = bound.shape[-1]
        rank_q = _ranks(page_scores(bound, "quest"))
        rank_w = _ranks(page_scores(bound, "windowed", window_pages))
        return -(torch.minimum(rank_q, rank_w) + rank_q / (2 * n + 2))
    if score == "windowed":
        b, h, g, n = bound.shape
        w = max(1, int(window_pages))
        pad = (-n) % w
        padded = torch.nn.functional.pad(bound, (0, pad), value=float("-inf")) if pad else bound
        mass = padded.view(b, h, g, -1, w).softmax(-1).view(b, h, g, n + pad)[..., :n]
        return mass.sum(dim=(1, 2))
    raise ValueError(f"unknown page score {score!r}; choose from {SCORES}")


def _ranks(scores: torch.Tensor) -> torch.Tensor:
    """0 for the best page of each row, 1 for the next, ... (float)."""
    return scores.argsort(-1, descending=True).argsort(-1).float()


def select_pages(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[b, k]`` (int64, ascending) of the ``k`` best pages of each sequence."""
    return scores.topk(k, dim=-1).indices.sort(dim=-1).values


def group_queries(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``query`` ``[b, q_heads, q_len, d]`` -> ``[b, kv_heads, (q_heads / kv_heads) * q_len, d]``:
    the queries that read each kv head (GQA groups are consecutive query heads)."""
    b, hq, t, d = query.shape
    return query.reshape(b, kv_heads, (hq // kv_heads) * t, d)
