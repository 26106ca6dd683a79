"""The selection step's state: per page, per KV head, the channel-wise minimum and maximum of the
page's keys (Quest), kept on the device next to the recent window, and the step that turns the
current queries into the pages to attend (the pure scoring rules are in kv/select.py)."""
from __future__ import annotations

import torch

from .select import group_queries, mass_logits, page_scores, quest_bound, select_pages


class PageSummaries:
    """Key max and min of pages ``0 .. n - 1`` of one layer, side by side in one tensor
    ``[b, kv_heads, capacity, 2 * d]`` (channels ``0 .. d - 1`` the maximum, ``d .. 2d - 1`` the
    minimum), so that the Quest bound of every page and head is one batched matmul; the capacity
    grows by doubling, only the first ``n`` pages count."""

    def __init__(self):
        self.minmax: torch.Tensor | None = None
        self.n = 0

    @property
    def kmin(self) -> torch.Tensor | None:
        """``[b, kv_heads, capacity, d]`` (a view)."""
        if self.minmax is None:
            return None
        return self.minmax[..., self.minmax.shape[-1] // 2:]

    @property
    def kmax(self) -> torch.Tensor | None:
        if self.minmax is None:
            return None
        return self.minmax[..., :self.minmax.shape[-1] // 2]

    def init(self, like: torch.Tensor) -> None:
        b, h, _, d = like.shape
        self.minmax = like.new_empty((b, h, 0, 2 * d))

    def append(self, kmin: torch.Tensor, kmax: torch.Tensor) -> None:
        """Summaries ``[b, h, m, d]`` of the next ``m`` pages."""
        need = self.n + kmin.shape[2]
        cap = self.minmax.shape[2]
        if need > cap:
            # a power of two: the fused step's buffers are sized the same way (kv/fused.py
            # ``pages_room``), so its graph is rebuilt for both at once
            new_cap = max(1 << (need - 1).bit_length(), 2 * cap, 16)
            b, h, _, d2 = self.minmax.shape
            grown = self.minmax.new_empty((b, h, new_cap, d2))
            grown[:, :, :self.n] = self.minmax[:, :, :self.n]
            self.minmax = grown
        d = kmin.shape[-1]
        self.minmax[:, :, self.n:need, :d] = kmax
        self.minmax[:, :, self.n:need, d:] = kmin
        self.n = need

    def append_keys(self, keys: torch.Tensor, page_tokens: int) -> None:
        """Summarise the keys ``[b, h, m * page_tokens, d]`` of the next ``m`` pages."""
        b, h, t, d = keys.shape
        blocks = keys.view(b, h, t // page_tokens, page_tokens, d)
        kmin, kmax = blocks.aminmax(dim=3)
        self.append(kmin, kmax)

    def gpu_bytes(self) -> int:
        """Bytes of the summaries of the pages held (the unused capacity is not counted)."""
        if self.minmax is None:
            return 0
        per_page = self.minmax[:, :, :1].numel() * self.minmax.element_size()
        return self.n * per_page

    def scores(self, query: torch.Tensor, scale: float, score: str,
               window_pages: int) -> torch.Tensor:
        """``query`` ``[b, q_heads, q_len, d]`` -> one score per page ``[b, n]`` (fp32)."""
        queries = group_queries(query, self.kmin.shape[1])
        kmin, kmax = self.kmin[:, :, :self.n], self.kmax[:, :, :self.n]
        if score in ("mass", "mass_max"):
            return page_scores(mass_logits(queries, kmin, kmax, scale), score)
        return page_scores(quest_bound(queries, kmin, kmax, scale), score, window_pages)

    def choose(self, query: torch.Tensor, k: int, *, scale: float, score: str,
               window_pages: int, lost: set[int] | None = None) -> torch.Tensor:
        """The ``k`` pages of each sequence to attend, ``[b, k]`` ascending; lost pages never."""
        if score == "hybrid" and not lost:
            return self._choose_hybrid(query, k, scale, window_pages)
        scores = self.scores(query, scale, score, window_pages)
        if lost:
            gone = torch.tensor(sorted(lost), device=scores.device)
            scores[:, gone] = float("-inf")
        return select_pages(scores, k)

    def _choose_hybrid(self, query: torch.Tensor, k: int, scale: float,
                       window_pages: int) -> torch.Tensor:
        """``choose`` for the default ``"hybrid"`` score in few operations (a decode step runs
        it once per layer; an eager step is bound by the host): the Quest bound of every page and
        head as one batched matmul of ``[q+, q-]`` over the stored ``[max, min]``, both rankings
        from one sort (the ranks its inverse, one scatter), and their union as one integer key
        -- ``min(rank_q, rank_w)`` first, ``rank_q`` second, all keys distinct -- whose ``k``
        smallest are exactly the ``k`` best of ``page_scores(bound, "hybrid")`` (tests/kv/test_kv_select.py)."""
        b, _, _, d = query.shape
        h, n = self.minmax.shape[1], self.n
        q = query.reshape(b * h, -1, d).float()  # the GQA grouping of group_queries
        q = torch.cat((q.clamp(min=0), q.clamp(max=0)), -1)
        minmax = self.minmax[:, :, :n].float().reshape(b * h, n, 2 * d)  # one copy, not two
        bound = torch.bmm(q, minmax.transpose(1, 2)).mul_(scale).view(b, h, -1, n)
        # page_scores' "quest" and "windowed" written straight into one [2, b, n] (on CUDA each
        # operation is a node of the layer's captured graph: no stack, a leaner logsumexp)
        scores = bound.new_empty((2, b, n))
        torch.amax(bound - logsumexp_last(bound), dim=(1, 2), out=scores[0])
        g = bound.shape[2]
        w = max(1, int(window_pages))
        pad = (-n) % w
        padded = torch.nn.functional.pad(bound, (0, pad), value=float("-inf")) if pad else bound
        mass = padded.view(b, h, g, -1, w).softmax(-1).view(b, h, g, n + pad)[..., :n]
        torch.sum(mass, dim=(1, 2), out=scores[1])
        # [2, b, n]: quest, windowed -- the rank of each page is the inverse of the sort order:
        # one scatter where a second sort of the order would give the same (a permutation)
        order = scores.argsort(-1, descending=True)
        ranks = torch.empty_like(order).scatter_(
            -1, order, torch.arange(n, device=order.device).expand(order.shape))
        key = torch.add(ranks[0], ranks.amin(0), alpha=2 * n + 2)
        return key.topk(k, dim=-1, largest=False).indices.sort(dim=-1).values


def logsumexp_last(x: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(x, -1, keepdim=True)``, the same arithmetic in the same order (torch's
    composite: the maximum, infinite maxima taken as 0, the sum of ``exp(x - max)``, its log plus
    the maximum) in 7 operations instead of 9: the infinite maxima by one ``nan_to_num_``."""
    maxes = x.amax(-1, keepdim=True)
    maxes.nan_to_num_(nan=float("nan"), posinf=0.0, neginf=0.0)
    return (x - maxes).exp_().sum(-1, keepdim=True).log_().add_(maxes)
