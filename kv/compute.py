"""The attention arithmetic of a tiered step: scaled dot-product attention of the queries over the
attended columns (sinks + pages + recent + this step's tokens), with causality and padding
applied over those columns only: by the flash kernel's own lower-right causality where it serves
(CUDA, no padding), else by a mask built in chunks of queries for a long prefill."""
from __future__ import annotations

import contextlib
import logging

import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right

from deepseek_flash.cuda import sdpa_backends

log = logging.getLogger("deepseek_flash.kv.cache")

_LOWER_RIGHT = [True]  # False once torch refused the lower-right causal bias (logged once)


def sdpa(query, keys, values, mask, is_causal, scale, one_shape=False):
    """``scaled_dot_product_attention`` over GQA keys. With a mask on CUDA the kv heads are
    repeated first: the fused kernels that take a mask do not all take GQA, and the fallback
    would materialise every score. A ``CausalBias`` (``lower_right``) holds no mask: torch runs it
    in the flash kernel with the kv heads as they are.

    cuDNN's kernel is left out (deepseek_flash/cuda.py: it builds a plan for every new shape, and
    a decode step's key length is new every step) unless ``one_shape``: a whole prompt's causal
    attention, the same shape in every layer of the forward, where the caller's choice stands
    (torch's default picks cuDNN on recent GPUs, as for a ``DynamicCache`` prefill)."""
    groups = query.shape[1] // keys.shape[1]
    if (groups > 1 and mask is not None and query.device.type == "cuda"
            and not isinstance(mask, CausalBias)):
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
        groups = 1
    with contextlib.nullcontext() if one_shape else sdpa_backends(query.device):
        return torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale,
            enable_gqa=groups > 1)


def lower_right(query, keys, values):
    """Causality of queries that are the last ``q_len`` of ``kv_len`` keys as torch's lower-right
    ``CausalBias``, where the flash kernel takes it (CUDA; GQA as it is): no ``[q, kv]`` mask and
    no repeated kv heads are built -- at 128K context on an 8B shape a prefill chunk's mask and
    repeated keys and values would be ~3 GB. None elsewhere (the caller builds the mask, in chunks
    of ``prefill_chunk`` queries)."""
    if query.device.type != "cuda":
        return None
    try:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        with sdpa_backends(query.device):
            params = SDPAParams(query, keys, values, None, 0.0, False,
                                query.shape[1] != keys.shape[1])
            if not can_use_flash_attention(params):
                return None
    except (ImportError, RuntimeError, TypeError):  # a torch without it: the mask is built
        return None
    return causal_lower_right(query.shape[2], keys.shape[2])


def attend_columns(query, k_parts, v_parts, cols, k_new, v_new, pad_mask, scaling, *,
                   length: int, prefill_chunk: int, keys_out: list | None = None,
                   joined: tuple | None = None):
    """Attention of ``query`` ``[b, q_heads, q_len, d]`` over the committed parts (in slot
    order) and the new tokens -> ``[b, q_len, q_heads, d]``.

    ``cols`` says which of the ``length`` committed slots the parts are: None (all), a bool mask
    over the slots (the parts hold every slot; the False ones are dropped here), or slot indices
    ``[b, n]`` (the parts hold just those). ``pad_mask`` ``[b, length + q_len]`` is the key
    validity (padding) or None. ``keys_out``: a list the concatenated keys (parts, then the new
    tokens) are appended to, for a caller that reads them too. ``joined``: those keys and
    values assembled already (kv/graphs.py's ``AttentionInput``; the parts are then not read)."""
    b, hq, q_len, d = query.shape
    if joined is not None:
        keys, values = joined
    else:
        keys = torch.cat((*k_parts, k_new), 2)
        values = torch.cat((*v_parts, v_new), 2)
    if keys_out is not None:
        keys_out.append(keys)
    n_past = keys.shape[2] - q_len
    keep = cols if isinstance(cols, torch.Tensor) and cols.dtype == torch.bool else None
    if keep is not None:
        full = torch.cat((keep, keep.new_ones(q_len)))
        keys, values = keys[:, :, full], values[:, :, full]
        n_past = int(keep.sum())
    # key validity per sequence: padding (2D mask over slots) gathered to the attended columns
    valid = None
    if pad_mask is not None:
        past_mask = pad_mask[:, :length]
        if keep is not None:
            past_mask = past_mask[:, keep]
        elif cols is not None:
            past_mask = torch.gather(past_mask, 1, cols)
        valid = torch.cat((past_mask, pad_mask[:, length:length + q_len]), 1)
    if n_past == 0 and valid is None:
        # a first prompt without padding: plain causal attention, no mask, one call
        out = sdpa(query, keys, values, None, q_len > 1, scaling, one_shape=q_len > 1)
        return out.transpose(1, 2).contiguous()
    if valid is None and q_len > 1 and _LOWER_RIGHT[0]:
        # queries at the end of their keys, no padding: the flash kernel's own causality, one
        # call over every query (no mask to bound, so no chunks)
        bias = lower_right(query, keys, values)
        if bias is not None:
            try:
                return sdpa(query, keys, values, bias, False, scaling).transpose(1, 2).contiguous()
            except RuntimeError as exc:  # nothing computed: the mask is built from now on
                _LOWER_RIGHT[0] = False
                log.warning("causal attention of prefill chunks with a built mask: torch refused "
                            "its lower-right causal bias (%s)", exc)
    if valid is None and q_len == 1:
        # a decode step without padding: no mask, one call over the whole keys (the loop below
        # would slice them to the same length)
        return sdpa(query, keys, values, None, False, scaling).transpose(1, 2).contiguous()
    outs = []
    step = q_len if q_len <= prefill_chunk else prefill_chunk
    for a in range(0, q_len, step):
        e = min(q_len, a + step)
        kv_len = n_past + e
        mask = None
        if e - a > 1 or valid is not None:
            causal = (torch.arange(kv_len, device=query.device)[None, :]
                      <= (n_past + torch.arange(a, e, device=query.device))[:, None])
            mask = causal[None, None]
            if valid is not None:
                mask = mask & valid[:, None, None, :kv_len]
        outs.append(sdpa(query[:, :, a:e], keys[:, :, :kv_len], values[:, :, :kv_len], mask,
                         False, scaling))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
    return out.transpose(1, 2).contiguous()
