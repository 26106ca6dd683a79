"""``DenseMirror``: a dense layer's paged keys and values kept on the device as well.

A dense layer (the first ``dense_layers``) attends every page at every step, so with its pages on
the host alone it moves all of them over PCIe each step -- 2 of 32 layers of an 8B model are
~270 MB per step at 32K, sharing the link with the top-K layers' gathers. With ``dense_on_device``
(the default on a CUDA device) such a layer also keeps its pages on the device, in token order
(``[batch, kv_heads, tokens, head_dim]``, appended as pages are written): its attention reads them
there and nothing is copied. The host pages stay as they are (the spill tier, the stats' host
bytes); the mirror's bytes count in ``gpu_bytes``.
"""
from __future__ import annotations

import torch

GROW_TOKENS = 256
"""The capacity grows by at least this many tokens (or a sixteenth) at a time."""


class DenseMirror:
    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.tokens = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys and values ``[b, h, t, d]`` of the pages just written (in order)."""
        t = keys.shape[2]
        need = self.tokens + t
        cap = 0 if self.k is None else self.k.shape[2]
        if need > cap:
            # exactly what a prefill writes; then in steps of a sixteenth (at least GROW_TOKENS)
            new_cap = need if self.k is None else max(need, cap + max(cap // 16, GROW_TOKENS))
            b, h, _, d = keys.shape
            k = keys.new_empty((b, h, new_cap, d))
            v = values.new_empty((b, h, new_cap, values.shape[-1]))
            if self.tokens:
                k[:, :, :self.tokens] = self.k[:, :, :self.tokens]
                v[:, :, :self.tokens] = self.v[:, :, :self.tokens]
            self.k, self.v = k, v
        self.k[:, :, self.tokens:need] = keys
        self.v[:, :, self.tokens:need] = values
        self.tokens = need

    def parts(self):
        """Keys and values of every paged token (views)."""
        return self.k[:, :, :self.tokens], self.v[:, :, :self.tokens]

    def nbytes(self) -> int:
        """Bytes held (the capacity: what the device has allocated for it)."""
        if self.k is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
