"""``RecentWindow``: a top-K layer's recent tokens in fixed device buffers (the captured-graph
path on CUDA, kv/graphs.py).

Without it the recent window is a new tensor every step (the old one concatenated with the
step's tokens), and the attention concatenates sinks, pages, window and the step's tokens once
more: four allocations and copies per layer and step, each a dispatched operation on a host that
bounds an eager decode step. Here the window has room for ``capacity`` tokens (``gpu_tokens +
page_tokens + select_max_queries``: what it can hold between two page write-outs, plus one
step's queries); the step's keys and values are written at the window's length -- by the layer's
captured graph, at a position kept on the device (``pos``), so one graph serves every step
between two page boundaries -- and the graph then copies sinks, pages and the whole window into
the attention's buffers (``AttentionInput``), whose prefix the attention reads. When pages leave,
the tokens after them move to the front (every ``page_tokens`` steps).
"""
from __future__ import annotations

import torch


class RecentWindow:
    """Keys and values ``[b, kv_heads, capacity, head_dim]``, the first ``length`` tokens held."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        b, h, r, d = keys.shape
        # keys and values in one buffer: one copy moves both (a node fewer in a graph)
        self.kv = keys.new_zeros((2, b, h, capacity, d))
        self.keys, self.values = self.kv[0], self.kv[1]
        self.keys[:, :, :r].copy_(keys)
        self.values[:, :, :r].copy_(values)
        self.length = r
        self.pos = torch.zeros(1, dtype=torch.int64, device=keys.device)  # where a graph writes
        self.pos_value: int | None = 0  # what ``pos`` holds, as far as the host knows
        self.ahead = 0  # tokens of the running step a graph has written already
        self._inputs: dict[tuple, tuple] = {}

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens held, as views."""
        return self.keys.narrow(2, 0, self.length), self.values.narrow(2, 0, self.length)

    def inputs(self, query: torch.Tensor, k_new: torch.Tensor) -> tuple:
        """Fixed buffers a graph reads the step's query, keys and values from, and the offsets
        ``0 .. t - 1`` of the step's tokens: ``(q_in, k_in, v_in, steps, kv_in)`` (``k_in`` and
        ``v_in`` are the two halves of ``kv_in``)."""
        key = (tuple(query.shape), tuple(k_new.shape), query.dtype)
        got = self._inputs.get(key)
        if got is None:
            t = k_new.shape[2]
            kv_in = k_new.new_empty((2, *k_new.shape))
            got = (torch.empty_like(query), kv_in[0], kv_in[1],
                   torch.arange(t, device=k_new.device), kv_in)
            self._inputs = {key: got}
        return got

    def sync_pos(self) -> None:
        """Before a replay: ``pos`` at the window's length (one device fill when it is not:
        after an eager step or a page write-out)."""
        if self.pos_value != self.length:
            self.pos.fill_(self.length)
            self.pos_value = self.length

    def write_at_pos(self, kv_in, steps) -> None:
        """The graph's part: the step's keys and values (``kv_in`` ``[2, b, h, t, d]``) at
        ``pos``, then ``pos`` past them."""
        self.kv.index_copy_(3, self.pos + steps, kv_in)
        self.pos.add_(steps.shape[0])

    def write(self, k_new, v_new) -> None:
        """Eagerly: the step's tokens at the window's length (the length is the caller's)."""
        r, t = self.length, k_new.shape[2]
        self.keys[:, :, r:r + t].copy_(k_new)
        self.values[:, :, r:r + t].copy_(v_new)

    def drop_front(self, n: int) -> None:
        """The first ``n`` tokens left (written out as pages): the rest moves to the front."""
        rest = self.length - n
        self.kv[:, :, :, :rest].copy_(self.kv[:, :, :, n:self.length].clone())
        self.length = rest
