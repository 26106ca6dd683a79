"""One forward over the static cache, and the choice of the next token -- fixed shapes, no host sync.

The attention mask is built on the device from three tensors: each row's first real slot
(``valid_from``: left padding), the slot being written, and the visible length (a Python int fixed
per graph). Positions for the rotary tables are ``slot - valid_from``, as ``generate`` computes
them from the attention mask. The model is called module by module as transformers defines it
(``model.model`` then ``model.lm_head``), so a swapped module -- a quantized Linear, say -- runs
inside the step with nothing special.
"""
from __future__ import annotations

import inspect

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")
SUPPORTED_ATTENTION = ("sdpa", "eager")


def unsupported(model) -> str | None:
    """Why the static-cache step cannot run this model (None: it can)."""
    config = model.config
    if config.model_type not in SUPPORTED_ARCHS:
        return f"model type {config.model_type!r} (the step knows {', '.join(SUPPORTED_ARCHS)})"
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        return f"attention implementation {impl!r} (the step builds masks for sdpa and eager)"
    if not hasattr(model, "model") or not hasattr(model, "lm_head"):
        return "a causal LM without .model and .lm_head"
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return f"parameters on several devices ({', '.join(sorted(map(str, devices)))})"
    return None


def cache_keyword(model) -> str:
    """The decoder's name for the cache argument (``past_key_values`` up to transformers 5.2x,
    ``cache`` after)."""
    params = inspect.signature(type(model.model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class MaskSpec:
    """What the model's decoder expects as attention mask: kinds of layers and their windows."""

    def __init__(self, model):
        import torch

        config = model.config
        self.dtype = model.dtype
        self.additive = (getattr(config, "_attn_implementation", None) or "eager") == "eager"
        self.min_value = torch.finfo(self.dtype).min if self.additive else None
        window = getattr(config, "sliding_window", None)
        if config.model_type == "qwen2":
            # Qwen2 takes a mapping by layer type; sliding layers only where layer_types says so.
            kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
            self.windows = {kind: (window if kind == "sliding_attention" else None) for kind in kinds}
            self.windows.setdefault("full_attention", None)
            self.mapping = True
        else:
            # Mistral applies its sliding window to every layer; Llama has none.
            self.windows = {"full_attention": window if config.model_type == "mistral" else None}
            self.mapping = False

    def build(self, allowed_fn):
        """``allowed_fn(window) -> bool (batch, 1, queries, keys)``, as the model wants it."""
        import torch

        masks = {}
        for kind, window in self.windows.items():
            allowed = allowed_fn(window)
            if self.additive:
                allowed = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill(
                    ~allowed, self.min_value)
            masks[kind] = allowed
        return masks if self.mapping else masks["full_attention"]


def prefill_allowed(prompt: int, visible: int, valid_from, window):
    """Queries at slots ``0..prompt-1`` over keys ``0..visible-1``: causal, never a padding slot;
    a padding query sees only itself (its output is never used, and a row with nothing to
    attend to would be NaN)."""
    import torch

    device = valid_from.device
    q = torch.arange(prompt, device=device)[:, None]
    k = torch.arange(visible, device=device)[None, :]
    allowed = (k <= q)[None] & (k[None] >= valid_from[:, None, None])
    if window is not None:
        allowed = allowed & (k > q - window)[None]
    allowed = allowed | (k == q)[None]
    return allowed[:, None]


def decode_allowed(slot, visible: int, valid_from, key_slots, window):
    """One query at ``slot`` (a device tensor of one element) over keys ``0..visible-1``."""
    k = key_slots[:visible][None, :]
    allowed = (k >= valid_from[:, None]) & (k <= slot)
    if window is not None:
        allowed = allowed & (k > slot - window)
    return allowed[:, None, None, :]


PACKED_ATTENTION = "deepseek_flash_packed_gqa"


def packed_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """sdpa for one query token with grouped key/value heads, without repeating the cache.

    The query heads that share a key/value head become that head's query rows: (batch, heads, 1,
    dim) -> (batch, kv_heads, group, dim), so attention reads each cached key once instead of
    ``group`` times through ``repeat_kv`` (what transformers' sdpa path does when a mask is given).
    Everything else -- prefill, no grouping -- is transformers' sdpa unchanged.
    """
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or kv_heads == heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask,
                                                           scale=scaling)
    return out.reshape(batch, 1, heads, dim), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_gqa_attention)


def fused_rms_norm(module, hidden_states):
    """transformers' RMSNorm (float32 statistics, cast back, times the weight) with the
    statistics in one ``rms_norm`` kernel instead of five elementwise ones."""
    import torch

    dtype = hidden_states.dtype
    normed = torch.nn.functional.rms_norm(hidden_states.float(), (hidden_states.shape[-1],),
                                          eps=module.variance_epsilon)
    return module.weight * normed.to(dtype)


def rms_norms(model) -> list:
    """The model's RMSNorm modules of the Llama family (weight x normalised input)."""
    import torch

    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")
            and hasattr(m, "variance_epsilon") and isinstance(getattr(m, "weight", None), torch.nn.Parameter)]


class StepModules:
    """For the duration of one call of the step, another registered attention function and fused
    norms (the config and the modules are read when a layer runs: in a captured graph, only at
    capture; outside the step the model is untouched)."""

    def __init__(self, config, attention=None, norms=()):
        self.config, self.attention, self.norms = config, attention, list(norms)

    def __enter__(self):
        import types

        self.saved = self.config._attn_implementation
        if self.attention is not None:
            self.config._attn_implementation = self.attention
        for norm in self.norms:
            norm.forward = types.MethodType(fused_rms_norm, norm)

    def __exit__(self, *exc):
        if self.attention is not None:
            self.config._attn_implementation = self.saved
        for norm in self.norms:
            del norm.forward


def forward_last(model, cache_kw: str, input_ids, position_ids, mask, cache, swaps: StepModules):
    """Float32 logits of each row's last token (``generate`` takes logits in float32 too)."""
    with swaps:
        out = model.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                          use_cache=True, **{cache_kw: cache})
    hidden = out[0][:, -1:, :]
    return model.lm_head(hidden)[:, -1, :].float()


def choose(logits, sampling):
    """The next token per row: argmax, or a sample after temperature, top-k and top-p -- in the
    order transformers applies them -- drawn with the exponential race (no host sync)."""
    import torch

    from .kernels import greedy

    if sampling is None:
        return greedy(logits)
    temperature, top_k, top_p = sampling
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        ordered, order = torch.sort(logits, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p)
        drop[:, -1:] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(1)
    return greedy(probs / race)
