"""The static KV cache: fixed buffers the captured step writes into at a position held on the device.

``KVStore`` owns one key and one value buffer per decoder layer, ``(batch, kv_heads, capacity,
head_dim)``, allocated once (zeroed, so rows never read hold finite numbers). ``StaticKVCache`` is
a ``transformers`` ``Cache`` over the first ``batch`` rows of a store; its layers
(``StaticKVLayer``) write the new keys/values at ``cursor.index`` -- a device tensor, so the same
captured graph serves every position -- and return the first ``cursor.visible`` slots, a length
fixed per graph (masked beyond the current position). Nothing here reads a position on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass
class Cursor:
    """Where the next keys/values go (``index``: device int64 tensor, one entry per query token)
    and how many slots attention reads (``visible``); ``length`` mirrors the host's count."""

    index: object = None
    visible: int = 0
    length: int = 0


class StaticKVLayer(CacheLayerMixin):
    """One decoder layer's keys and values in fixed buffers."""

    is_compileable = True

    def __init__(self, keys, values, cursor: Cursor):
        super().__init__()
        self.keys, self.values, self.cursor = keys, values, cursor
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to do: the buffers exist before the first token."""

    def update(self, key_states, value_states, *args, **kwargs):
        index = self.cursor.index
        self.keys.index_copy_(2, index, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, index, value_states.to(self.values.dtype))
        n = self.cursor.visible
        return self.keys[:, :, :n], self.values[:, :, :n]

    def get_mask_sizes(self, query_length, *args, **kwargs):
        return self.cursor.visible, 0

    def get_seq_length(self) -> int:
        return self.cursor.length

    def get_max_length(self) -> int:
        return self.keys.shape[2]

    def get_max_cache_shape(self) -> int:
        return self.keys.shape[2]


class StaticKVCache(Cache):
    """A transformers ``Cache`` whose layers are ``StaticKVLayer`` views of a ``KVStore``."""

    def __init__(self, layers: list, cursor: Cursor):
        super().__init__(layers=layers)
        self.cursor = cursor

    @property
    def is_compileable(self) -> bool:
        return True


class KVStore:
    """Per-layer key/value buffers for up to ``batch`` sequences of ``capacity`` tokens."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype, device):
        import torch

        shape = (batch, kv_heads, capacity, head_dim)
        self.batch, self.capacity = batch, capacity
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def cache(self, batch: int, cursor: Cursor) -> StaticKVCache:
        """A cache over the first ``batch`` rows (views: same memory for every batch bucket)."""
        if batch > self.batch:
            raise ValueError(f"batch {batch} exceeds the store's {self.batch} rows")
        layers = [StaticKVLayer(k[:batch], v[:batch], cursor) for k, v in zip(self.keys, self.values)]
        return StaticKVCache(layers, cursor)
