"""Two eviction baselines for the pruning bench (bench/kv_prune.py), written here (the kvpress
package pins an older transformers). Both hold at most ``budget`` tokens per layer and sequence
and drop the rest for good:

* ``"streaming"`` -- StreamingLLM (Xiao et al., 2023): the first ``sinks`` tokens and the most
  recent ones. Keys keep the positions they were rotated at (no re-rotation into the window).
* ``"h2o"`` -- accumulated-attention eviction in the H2O / SnapKV style (Zhang et al., 2023): per
  KV head, the ``budget // 2`` most recent tokens plus the tokens with the largest attention
  accumulated over every query so far (summed over the head's query group), prompt included,
  divided by the number of queries that could see the token -- a plain sum favours the oldest
  tokens, which more queries have seen (the bias SnapKV's observation window avoids).

``EvictingCache.for_model(model, budget, policy)`` switches the model's attention to the
registered function ``evict_kv`` (explicit softmax, so the attention shares are seen) and returns
the cache; pass it as ``cache=`` / ``past_key_values=``. No padding (batches of equal length).
"""
from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..attention import register_pair

NAME = "evict_kv"
POLICIES = ("streaming", "h2o")
_ACTIVE: dict[int, "EvictLayer"] = {}


class EvictLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, budget: int, policy: str, sinks: int):
        super().__init__()
        self.budget, self.policy, self.sinks = budget, policy, sinks
        self.length = 0
        self.keys = self.values = None
        self.acc = None  # [b, h, kept] accumulated attention (h2o)
        self.seen = None  # [kept] queries that could see each kept token

    def lazy_initialization(self, key_states, value_states):
        self.keys = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[-1]))
        self.values = self.keys.clone()
        self.acc = key_states.new_zeros((*key_states.shape[:2], 0), dtype=torch.float32)
        self.seen = key_states.new_zeros((*key_states.shape[:2], 0), dtype=torch.float32)
        self.is_initialized = True

    def _evict(self):
        n = self.keys.shape[2]
        if n <= self.budget:
            return
        b, h, _, d = self.keys.shape
        if self.policy == "streaming":
            s = min(self.sinks, self.budget)
            idx = torch.cat((torch.arange(s), torch.arange(n - (self.budget - s), n)))
            idx = idx.to(self.keys.device).expand(b, h, -1)
        else:
            recent = self.budget // 2
            heavy = self.budget - recent
            mean = self.acc[:, :, :n - recent] / self.seen[:, :, :n - recent].clamp(min=1)
            top = mean.topk(heavy, dim=-1).indices
            rec = torch.arange(n - recent, n, device=self.keys.device).expand(b, h, recent)
            idx = torch.cat((top.sort(-1).values, rec), -1)
        self.keys = torch.gather(self.keys, 2, idx[..., None].expand(-1, -1, -1, d))
        self.values = torch.gather(self.values, 2, idx[..., None].expand(-1, -1, -1, d))
        self.acc = torch.gather(self.acc, 2, idx)
        self.seen = torch.gather(self.seen, 2, idx)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._evict()
        self.length += key_states.shape[2]
        self.keys = torch.cat((self.keys, key_states), 2)
        self.values = torch.cat((self.values, value_states), 2)
        zeros = self.acc.new_zeros((*key_states.shape[:2], key_states.shape[2]))
        self.acc = torch.cat((self.acc, zeros), 2)
        self.seen = torch.cat((self.seen, zeros), 2)
        _ACTIVE[id(self.keys)] = self
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int):
        kept = 0 if self.keys is None else self.keys.shape[2]
        return min(kept, self.budget) + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def kept(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


class EvictingCache(Cache):
    def __init__(self, num_layers: int, budget: int, policy: str = "h2o", sinks: int = 4):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: one of {POLICIES}")
        if budget < 2:
            raise ValueError(f"budget {budget}: at least 2 tokens")
        self.budget, self.policy = budget, policy
        super().__init__(layers=[EvictLayer(budget, policy, sinks) for _ in range(num_layers)])

    @classmethod
    def for_model(cls, model, budget: int, policy: str = "h2o", sinks: int = 4):
        register()
        if model.config._attn_implementation != NAME:
            model.set_attn_implementation(NAME)
        cfg = model.config.get_text_config()
        return cls(cfg.num_hidden_layers, budget, policy, sinks)

    def gpu_bytes(self) -> int:
        """KV bytes held (after this step's eviction they are at most ``budget`` tokens)."""
        return sum(2 * layer.keys.numel() * layer.keys.element_size()
                   for layer in self.layers if layer.keys is not None)

    def full_bytes(self) -> int:
        """KV bytes full attention would hold for the same tokens."""
        return sum(2 * layer.length * layer.keys[:, :, :1].numel() * layer.keys.element_size()
                   for layer in self.layers if layer.keys is not None)


def evict_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    **kwargs):
    layer = _ACTIVE.pop(id(key), None)
    b, hq, q, d = query.shape
    h, n = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else d ** -0.5
    g = query.reshape(b, h, (hq // h) * q, d)  # GQA groups are consecutive query heads
    logits = (g.float() @ key.float().transpose(-1, -2)) * scale
    if q > 1:
        qpos = n - q + torch.arange(q, device=query.device)
        allowed = torch.arange(n, device=query.device)[None, :] <= qpos[:, None]
        logits = logits.masked_fill(~allowed.repeat(hq // h, 1)[None, None], -math.inf)
    probs = logits.softmax(-1)
    if layer is not None:
        layer.acc += probs.sum(2)
        # queries (of the group) that could see each key: all q, fewer for this step's own keys
        seen = torch.full((n,), float(q), device=query.device)
        seen[n - q:] = torch.arange(q, 0, -1, device=query.device, dtype=torch.float32)
        layer.seen += seen * (hq // h)
    out = (probs.to(value.dtype) @ value).reshape(b, hq, q, d)
    return out.transpose(1, 2).contiguous(), None


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
          attention_mask=None, **kwargs):
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("the eviction baselines take no padding")
    return None


def register() -> None:
    register_pair(NAME, evict_attention, _mask)
