"""``DenseMirror``: a dense layer's paged keys and values kept on the device as well.

A dense layer (the first ``dense_layers``) attends every page at every step, so with its pages on
the host alone it moves all of them over PCIe each step -- 2 of 32 layers of an 8B model are
~270 MB per step at 32K, sharing the link with the top-K layers' gathers. With ``dense_on_device``
(the default on a CUDA device) such a layer also keeps its pages on the device, in token order
(``[batch, kv_heads, tokens, head_dim]``, appended as pages are written): its attention reads them
there and nothing is copied. The host pages stay as they are (the spill tier, the stats' host
bytes); the mirror's bytes count in ``gpu_bytes``.

The buffer keeps room for the sinks before the pages and for the recent and the step's tokens
after them (``joined``): a decode step copies its sinks there once and its few recent and new
tokens each step, and the attention reads all of the layer's keys and values as one prefix of the
buffer -- no concatenation of every page each step (at 32K on an 8B shape a four-part
concatenation of a layer's keys or values took ~200 us of device time on an H200, against ~33 us
for DynamicCache's two-part one).
"""
from __future__ import annotations

import torch

GROW_TOKENS = 256
"""The capacity grows by at least this many tokens (or a sixteenth) at a time."""


class DenseMirror:
    def __init__(self, front: int = 0):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.tokens = 0  # paged tokens held, from ``front``
        self.front = front  # tokens of room before the pages: the sinks' (``joined``)
        self.sinks_in = False  # the sinks copied into that room

    def _room(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        """Capacity for ``need`` tokens (sinks' room included), what is held kept."""
        cap = 0 if self.k is None else self.k.shape[2]
        if need <= cap:
            return
        # exactly what a prefill writes; then in steps of a sixteenth (at least GROW_TOKENS)
        new_cap = need if self.k is None else max(need, cap + max(cap // 16, GROW_TOKENS))
        b, h, _, d = like_k.shape
        k = like_k.new_empty((b, h, new_cap, d))
        v = like_v.new_empty((b, h, new_cap, like_v.shape[-1]))
        held = self.front + self.tokens
        if self.k is not None and held:
            k[:, :, :held] = self.k[:, :, :held]
            v[:, :, :held] = self.v[:, :, :held]
        self.k, self.v = k, v

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys and values ``[b, h, t, d]`` of the pages just written (in order)."""
        start = self.front + self.tokens
        need = start + keys.shape[2]
        self._room(need, keys, values)
        self.k[:, :, start:need] = keys
        self.v[:, :, start:need] = values
        self.tokens += keys.shape[2]

    def parts(self):
        """Keys and values of every paged token (views)."""
        a, e = self.front, self.front + self.tokens
        return self.k[:, :, a:e], self.v[:, :, a:e]

    def joined(self, sink_k, sink_v, recent_k, recent_v, k_new, v_new):
        """Keys and values ``[b, h, tokens, d]`` of sinks, pages, recent and the step's tokens, in
        that order, as one prefix of the buffer (views): the sinks copied in once, the recent and
        new tokens after the pages every call. None where the sinks do not fill the room kept
        for them (the caller concatenates the parts)."""
        s = sink_k.shape[2]
        if s != self.front or self.k is None:
            return None
        end = s + self.tokens
        r, t = recent_k.shape[2], k_new.shape[2]
        need = end + r + t
        self._room(need, recent_k, recent_v)
        k, v = self.k, self.v
        if not self.sinks_in:
            k[:, :, :s] = sink_k
            v[:, :, :s] = sink_v
            self.sinks_in = True
        torch._foreach_copy_([k[:, :, end:end + r], k[:, :, end + r:need],
                              v[:, :, end:end + r], v[:, :, end + r:need]],
                             [recent_k, k_new, recent_v, v_new])
        return k[:, :, :need], v[:, :, :need]

    def nbytes(self) -> int:
        """Bytes held (the capacity: what the device has allocated for it)."""
        if self.k is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
