"""The attention function the tiered cache needs, registered with transformers under the name
``tiered_kv`` (``AttentionInterface``), and its mask function (``AttentionMaskInterface``).

A cache alone never sees the queries, so selection happens here: the model calls
``cache.update`` (which only records the step's keys and values) and then this function, which
hands the queries to the layer's ``TieredLayer.attend``. The mask function returns the 2-D key
validity (padding) mask, or None: causality is applied inside ``attend`` over only the attended
columns, so no ``[q, kv]`` mask of the whole context is ever built. A call whose keys did not come
from a ``TieredCache`` (a ``DynamicCache`` given to the same model) is computed exactly as
``sdpa`` would.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function

from deepseek_flash.errors import KVCacheBypassed, KVUnsupported

from .compute import sdpa as _sdpa

NAME = "tiered_kv"  # no "flash" in it: transformers treats such names as flash-attention kernels


# update() registers its returned key tensor here; attention pops it. Keyed by the tensor's id,
# checked by identity, so a stale entry can never match another tensor.
_ACTIVE: dict[int, object] = {}


def tiered_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    layer = _ACTIVE.pop(id(key), None)
    if layer is not None and layer.pending is not None and layer.pending[0] is key:
        layer._cache.check_module(module)
        if module.layer_idx != layer.index:
            from deepseek_flash.errors import KVCacheMismatch
            raise KVCacheMismatch(f"attention layer {module.layer_idx} got the keys of cache "
                                  f"layer {layer.index}")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return layer.attend(module, query, attention_mask, scale), None
    if kwargs:
        _refuse_bypassed_cache(module, kwargs)
    return _plain_attention(module, query, key, value, attention_mask, scaling)


def _refuse_bypassed_cache(module, kwargs) -> None:
    """A ``TieredCache`` among the attention's keyword arguments while the keys came from another
    cache: it was passed to the model under a keyword its ``forward`` does not take, so the model
    built a cache of its own (kv/compat.py). Refused before that goes unnoticed."""
    from .cache import TieredCache

    for name, value in kwargs.items():
        if isinstance(value, TieredCache):
            import transformers

            expected = value.cache_keyword or "past_key_values"
            raise KVCacheBypassed(
                f"a TieredCache reached {type(module).__name__}'s attention as the keyword "
                f"argument {name!r}, which the model's forward (transformers "
                f"{transformers.__version__}) does not take: the model ran with a cache of its own "
                f"and this one stayed empty; pass it as {expected}=cache "
                f"(deepseek_flash.kv.cache_kwargs(model, cache) gives the keyword)",
                keyword=name, expected=expected)


def _plain_attention(module, query, key, value, pad_mask, scaling):
    """What sdpa computes for a cache that is not tiered: causal (queries at the end of the
    keys) and padding."""
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = None
    if pad_mask is None and q_len == kv_len:
        return (_sdpa(query, key, value, None, q_len > 1, scaling, one_shape=q_len > 1)
                .transpose(1, 2).contiguous(), None)
    if pad_mask is not None or q_len > 1:
        causal = (torch.arange(kv_len, device=query.device)[None, :]
                  <= (kv_len - q_len + torch.arange(q_len, device=query.device))[:, None])
        mask = causal[None, None]
        if pad_mask is not None:
            mask = mask & pad_mask[:, None, None, :kv_len]
    return _sdpa(query, key, value, mask, False, scaling).transpose(1, 2).contiguous(), None


def tiered_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0,
                mask_function=causal_mask_function, attention_mask=None, **kwargs):
    """The key-validity mask ``[batch, kv_length]`` (bool) when some key is padding, else None.
    (transformers before 5.1x passes ``cache_position`` instead of ``q_length``/``q_offset``;
    neither is needed here.)"""
    if mask_function is not causal_mask_function:
        raise KVUnsupported("the tiered KV cache serves plain causal attention only (no sliding "
                            "window, chunked or bidirectional masks)")
    if attention_mask is None:
        return None
    mask = attention_mask[:, kv_offset:kv_offset + kv_length].to(torch.bool)
    if mask.shape[-1] < kv_length:
        mask = torch.nn.functional.pad(mask, (0, kv_length - mask.shape[-1]), value=True)
    if bool(mask.all()):
        return None
    return mask


_registered: set[str] = set()


def register_pair(name: str, attention, mask) -> None:
    """Register an attention function and its mask function with transformers under ``name``
    (idempotent): what a model's ``attn_implementation = name`` then calls."""
    if name not in _registered:
        AttentionInterface.register(name, attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask)
        _registered.add(name)


def register() -> None:
    """Register the tiered cache's attention and mask functions (idempotent)."""
    register_pair(NAME, tiered_attention, tiered_mask)


def install(model):
    """Switch ``model`` to the tiered attention function; return its text config. Raises
    ``KVUnsupported`` for a model the cache cannot serve."""
    register()
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        raise KVUnsupported(f"{type(model).__name__}: sliding-window attention "
                            f"(sliding_window={cfg.sliding_window}) is not served by the tiered "
                            f"KV cache")
    if getattr(cfg, "layer_types", None) and any(t != "full_attention" for t in cfg.layer_types):
        raise KVUnsupported(f"{type(model).__name__}: layer types {sorted(set(cfg.layer_types))}; "
                            f"the tiered KV cache serves full attention layers only")
    if not hasattr(model, "set_attn_implementation"):
        raise KVUnsupported(f"{type(model).__name__} has no set_attn_implementation: a "
                            f"transformers model using AttentionInterface is needed")
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
        if model.config._attn_implementation != NAME:
            raise KVUnsupported(f"{type(model).__name__} does not dispatch attention through "
                                f"AttentionInterface")
    return cfg
