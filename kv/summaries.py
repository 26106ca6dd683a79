"""The selection step's state: per page, per KV head, the channel-wise minimum and maximum of the
page's keys (Quest), kept on the device next to the recent window, and the step that turns the
current queries into the pages to attend (the pure scoring rules are in kv/select.py)."""
from __future__ import annotations

import torch

from .select import group_queries, mass_logits, page_scores, quest_bound, select_pages


class PageSummaries:
    """Key min/max of pages ``0 .. n - 1`` of one layer, ``[b, kv_heads, capacity, d]`` each;
    the capacity grows by doubling, only the first ``n`` pages count."""

    def __init__(self):
        self.kmin: torch.Tensor | None = None
        self.kmax: torch.Tensor | None = None
        self.n = 0

    def init(self, like: torch.Tensor) -> None:
        b, h, _, d = like.shape
        self.kmin = like.new_empty((b, h, 0, d))
        self.kmax = like.new_empty((b, h, 0, d))

    def append(self, kmin: torch.Tensor, kmax: torch.Tensor) -> None:
        """Summaries ``[b, h, m, d]`` of the next ``m`` pages."""
        need = self.n + kmin.shape[2]
        cap = self.kmin.shape[2]
        if need > cap:
            new_cap = max(need, 2 * cap, 16)
            b, h, _, d = kmin.shape
            grown_min = kmin.new_empty((b, h, new_cap, d))
            grown_max = kmin.new_empty((b, h, new_cap, d))
            grown_min[:, :, :self.n] = self.kmin[:, :, :self.n]
            grown_max[:, :, :self.n] = self.kmax[:, :, :self.n]
            self.kmin, self.kmax = grown_min, grown_max
        self.kmin[:, :, self.n:need] = kmin
        self.kmax[:, :, self.n:need] = kmax
        self.n = need

    def append_keys(self, keys: torch.Tensor, page_tokens: int) -> None:
        """Summarise the keys ``[b, h, m * page_tokens, d]`` of the next ``m`` pages."""
        b, h, t, d = keys.shape
        blocks = keys.view(b, h, t // page_tokens, page_tokens, d)
        self.append(blocks.amin(3), blocks.amax(3))

    def gpu_bytes(self) -> int:
        """Bytes of the summaries of the pages held (the unused capacity is not counted)."""
        if self.kmin is None:
            return 0
        per_page = self.kmin[:, :, :1].numel() * self.kmin.element_size()
        return 2 * self.n * per_page

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
        """``choose`` for the default ``"hybrid"`` score in fewer operations (a decode step runs
        it once per layer; an eager step is bound by the host): the Quest bound as two batched
        matmuls, and the union of the two rankings as one integer key -- ``min(rank_q, rank_w)``
        first, ``rank_q`` second, all keys distinct -- whose ``k`` smallest are exactly the ``k``
        best of ``page_scores(bound, "hybrid")`` (tests/kv/test_kv_select.py)."""
        b, _, _, d = query.shape
        h, n = self.kmin.shape[1], self.n
        q = query.reshape(b * h, -1, d).float()  # the GQA grouping of group_queries
        kmin = self.kmin[:, :, :n].reshape(b * h, n, d).float().transpose(1, 2)
        kmax = self.kmax[:, :, :n].reshape(b * h, n, d).float().transpose(1, 2)
        bound = ((torch.bmm(q.clamp(min=0), kmax) + torch.bmm(q.clamp(max=0), kmin)) * scale
                 ).view(b, h, -1, n)
        rank_q = _int_ranks(page_scores(bound, "quest"))
        rank_w = _int_ranks(page_scores(bound, "windowed", window_pages))
        key = torch.add(rank_q, torch.minimum(rank_q, rank_w), alpha=2 * n + 2)
        return key.topk(k, dim=-1, largest=False).indices.sort(dim=-1).values


def _int_ranks(scores: torch.Tensor) -> torch.Tensor:
    """0 for the best page of each row, 1 for the next, ... (int64; select._ranks' order)."""
    return scores.argsort(-1, descending=True).argsort(-1)
