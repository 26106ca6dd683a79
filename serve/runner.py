"""The device side of the engine's steps: forwards of the model over rows of one shared KV cache, and
the sampling of each row's next token. Which requests go into which forward is the engine's.

The KV cache (``RowCache``) is one tensor pair per layer of shape ``[rows, kv_heads, max_len,
head_dim]``; a request owns a row from position 0, so rows need no left padding. Each forward gets
per-row ``position_ids`` and a 4-D additive mask (a query at position ``p`` sees keys ``0..p`` of its
own row), which ``transformers`` takes as it is; the cache's ``update`` scatters the new keys at each
row's positions and hands the attention the rows of this forward. Keys beyond a row's length (left
by an earlier occupant) are masked, so a request's greedy output is the same alone or in a batch.
"""
from __future__ import annotations

import inspect
import math
import time

# Attention on a CUDA device: every kernel but cuDNN's (SDPA_BACKENDS, deepseek_flash/cuda.py):
# cuDNN builds an execution plan for every new shape, and a continuously batched engine makes new
# shapes all the time; the memory-efficient kernel takes the same additive mask with no set-up.
from deepseek_flash.cuda import SDPA_BACKENDS, sdpa_backends  # noqa: F401 (SDPA_BACKENDS: tests)

# The attention reads a multiple of this many key positions (masked beyond each row's length), so
# the shapes a forward's attention sees are few and repeat, whatever the rows' lengths.
KV_BUCKET = 64
# Forwards kept for ``RowRunner.profile`` (the most recent).
PROFILE_SAMPLES = 8192


class RowCache:
    """The shared KV cache: a row per batch slot (duck-typed ``transformers`` cache).

    ``bind(rows, positions, kv_len)`` before a forward names the rows it runs on, the position of
    each of its tokens, and how many key positions the attention reads."""

    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype, device):
        import torch

        shape = (rows, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.bytes_per_token = 2 * num_layers * kv_heads * head_dim * self.keys[0].element_size()
        self._rows = self._positions = None
        self._kv_len = 0
        self.is_compileable = False

    def bind(self, rows, positions, kv_len: int, span: tuple[int, int] | None = None) -> None:
        """``span``: (first, end) when ``rows`` is that contiguous ascending range -- the attention
        then reads a view of the cache instead of a gathered copy of every row's keys."""
        self._rows, self._positions, self._kv_len, self._span = rows, positions, kv_len, span

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rows, pos = self._rows[:, None], self._positions
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        # Advanced indices around a slice put the indexed dims first: [b, q, kv_heads, head_dim].
        keys[rows, :, pos] = key_states.transpose(1, 2).to(keys.dtype)
        values[rows, :, pos] = value_states.transpose(1, 2).to(values.dtype)
        if self._span is not None:
            first, end = self._span
            return keys[first:end, :, : self._kv_len], values[first:end, :, : self._kv_len]
        return keys[self._rows, :, : self._kv_len], values[self._rows, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def __len__(self):
        return len(self.keys)


class RowRunner:
    """Forwards of ``model`` over rows of its ``RowCache`` (``prefill``, ``decode``), and over a
    request's own tiered KV cache (``solo``); each timed for ``profile``."""

    def __init__(self, model, rows: int, max_len: int, device=None):
        import torch

        self.torch = torch
        self.model = model
        cfg = model.config
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = param.dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.cache = RowCache(cfg.num_hidden_layers, rows, kv_heads, head_dim, max_len, self.dtype, self.device)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self.attn_default = getattr(cfg, "_attn_implementation", None)
        self.sdpa = self.device.type == "cuda"  # attention without cuDNN (SDPA_BACKENDS)
        # (kind, rows, tokens per row, launch seconds, seconds until the result was on the host,
        # monotonic start, attention key positions)
        self._profile: list = []
        # Attention widths (``KV_BUCKET`` multiples) that a forward has met: see ``warm``.
        self.kv_seen: set = set()

    def _kwargs(self, cache) -> dict:
        kwargs = {self._cache_kw: cache, "use_cache": True}
        if self._keep_kw is not None:
            kwargs[self._keep_kw] = 1
        return kwargs

    def forward(self, rows: list, ids, positions, kv_len):
        """Logits at the last position of each of ``rows`` after feeding ``ids`` at ``positions``;
        the attention reads ``kv_len`` key positions, rounded up to a ``KV_BUCKET``."""
        torch = self.torch
        kv_len = min(self.cache.max_len, -(-kv_len // KV_BUCKET) * KV_BUCKET)
        self.kv_seen.add(kv_len)
        self._kv_last = kv_len
        span = (rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[0] + len(rows))) else None
        self.cache.bind(torch.tensor(rows, device=self.device), positions, kv_len, span)
        keys = torch.arange(kv_len, device=self.device)
        allowed = keys[None, None, None, :] <= positions[:, None, :, None]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        kwargs = self._kwargs(self.cache)
        with sdpa_backends(self.device):
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, **kwargs)
        return out.logits[:, -1, :]

    def prefill(self, rows: list, ids: list, positions: list, kv_len: int):
        """One forward of prompt chunks (``ids``/``positions``: a list per row, of equal length);
        returns (logits, seconds until the forward was done on the device)."""
        torch = self.torch
        began = time.perf_counter()
        logits = self.forward(rows, torch.tensor(ids, device=self.device),
                              torch.tensor(positions, device=self.device), kv_len)
        launched = time.perf_counter() - began
        self._sync()                # the cost of this forward, not of the next one that waits
        spent = time.perf_counter() - began
        self._record("prefill", len(rows), len(ids[0]), launched, spent, began)
        return logits, spent

    def decode(self, gens, rows: list, last: list, lengths: list):
        """One batched decode: each row's ``last`` token at its position ``lengths``; returns (the
        next token of each of ``gens``, seconds until they were on the host)."""
        torch = self.torch
        ids = torch.tensor([[t] for t in last], device=self.device)
        positions = torch.tensor(lengths, device=self.device)[:, None]
        began = time.perf_counter()
        logits = self.forward(rows, ids, positions, max(lengths) + 1)
        launched = time.perf_counter() - began
        tokens = self.sample(logits, gens)
        spent = time.perf_counter() - began
        self._record("decode", len(rows), 1, launched, spent, began)
        return tokens, spent

    def solo(self, kv_cache, ids: list):
        """Logits at the last of ``ids`` fed on ``kv_cache`` (a request's ``TieredCache``), with the
        model's attention switched to the cache's function for this forward only."""
        from ..kv.attention import NAME

        self.attention(NAME)
        try:
            return self.model(input_ids=self.torch.tensor([ids], device=self.device),
                              **self._kwargs(kv_cache)).logits[:, -1, :]
        finally:
            self.attention(self.attn_default)

    def sample(self, logits, gens) -> list:
        """``sample`` on this runner's device."""
        return sample(self.torch, logits, gens)

    def attention(self, name) -> None:
        if name is not None and self.model.config._attn_implementation != name:
            self.model.set_attn_implementation(name)

    def tiered_cache(self, options: dict):
        """A ``TieredCache`` for one request (``flash_context``'s ``kv_*`` keys); the shared batch
        keeps its own attention implementation."""
        from ..kv import TieredCache

        try:
            return TieredCache.for_model(self.model, **options)
        finally:
            self.attention(self.attn_default)

    def forwards(self, since: float = 0.0) -> list:
        """The recorded forwards that began at or after ``since`` (``time.perf_counter``), oldest
        first: (kind, rows, tokens per row, began, ms until the result was on the host, ms the host
        spent issuing it, attention key positions)."""
        return [(kind, rows, tokens, began, round(total_s * 1e3, 3), round(launch_s * 1e3, 3), kv)
                for kind, rows, tokens, launch_s, total_s, began, kv in self._profile[-PROFILE_SAMPLES:]
                if began >= since]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def warm(self) -> float:
        """Meet, before any request does, every attention width a forward can have: one decode
        forward over all rows per ``KV_BUCKET`` multiple up to the cache's length, one over two
        rows apart (the gathered-rows path), and a prompt chunk. On a CUDA device the first forward
        of a new shape costs a few hundred milliseconds of host time (kernel selection and set-up);
        met under load, that stalls every running request and the queue behind it -- an L0
        request's first token among them. Keys written here are beyond any request's length
        (masked, as an earlier occupant's are). Returns the seconds it took."""
        torch = self.torch
        began = time.perf_counter()
        rows = self.cache.keys[0].shape[0]
        widths = range(KV_BUCKET, self.cache.max_len + KV_BUCKET, KV_BUCKET)
        with torch.inference_mode():
            for kv_len in widths:
                last = min(kv_len, self.cache.max_len) - 1
                for group in (list(range(rows)), [0, rows - 1] if rows > 2 else None):
                    if group is None:
                        continue
                    ids = torch.zeros((len(group), 1), dtype=torch.long, device=self.device)
                    positions = torch.full((len(group), 1), last, device=self.device)
                    self.forward(group, ids, positions, last + 1)
            chunk = min(KV_BUCKET, self.cache.max_len)
            ids = torch.zeros((1, chunk), dtype=torch.long, device=self.device)
            self.forward([0], ids, torch.arange(chunk, device=self.device)[None, :], chunk)
            self._sync()
        return time.perf_counter() - began

    def _record(self, kind: str, rows: int, tokens: int, launch_s: float, total_s: float,
                began: float = 0.0) -> None:
        self._profile.append((kind, rows, tokens, launch_s, total_s, began, getattr(self, "_kv_last", 0)))
        if len(self._profile) > 2 * PROFILE_SAMPLES:
            del self._profile[:-PROFILE_SAMPLES]

    def profile(self, reset: bool = False) -> dict:
        """Where the time went since the last reset: per kind of forward (``decode`` by rows in the
        batch, ``prefill``) the count and the p50/p99/max milliseconds from the forward's start until
        its result was on the host (``ms``), and of that the time the host spent issuing it
        (``launch_ms``: close to ``ms`` when the host, not the device, is the bound). ``reset``
        starts a new period."""
        samples = self._profile[-PROFILE_SAMPLES:]
        if reset:
            self._profile = []
        groups: dict = {}
        for kind, rows, tokens, launch_s, total_s, *_ in samples:
            if kind == "decode":
                key = "decode_rows_" + next(f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in
                                            ((1, 1), (2, 4), (5, 8), (9, 16), (17, 1 << 30)) if rows <= hi)
            else:
                key = kind
            groups.setdefault(key, []).append((rows, tokens, launch_s, total_s))
        out = {}
        for key, items in sorted(groups.items()):
            total = sorted(t for *_, t in items)
            launch = sorted(item[2] for item in items)
            q = quantiles(total, (0.5, 0.99))
            ql = quantiles(launch, (0.5, 0.99))
            out[key] = {"forwards": len(items), "rows_mean": round(sum(i[0] for i in items) / len(items), 2),
                        "tokens_mean": round(sum(i[0] * i[1] for i in items) / len(items), 1),
                        "ms_p50": round(q[0.5] * 1e3, 3), "ms_p99": round(q[0.99] * 1e3, 3),
                        "ms_max": round(total[-1] * 1e3, 3), "launch_ms_p50": round(ql[0.5] * 1e3, 3),
                        "launch_ms_p99": round(ql[0.99] * 1e3, 3)}
        return out


def sample(torch, logits, gens):
    """Next token per row: greedy where temperature is 0, else temperature + top-p, all sampled rows
    in one pass over the vocabulary (softmax, nucleus, inverse CDF) whatever the batch size. Each
    request draws its uniform number from its own generator (seeded by ``seed``), so its tokens do
    not depend on which other requests share the batch."""
    greedy = logits.argmax(dim=-1)
    hot = [i for i, g in enumerate(gens) if g.sched.temperature > 1e-5]
    if not hot:
        return greedy.tolist()
    device = logits.device
    temps = torch.tensor([gens[i].sched.temperature for i in hot], device=device)
    probs = torch.softmax(logits[hot].float() / temps[:, None], dim=-1)
    top_ps = [gens[i].sched.top_p for i in hot]
    order = None
    if any(p < 1.0 for p in top_ps):
        probs, order = probs.sort(dim=-1, descending=True)
        limit = torch.tensor(top_ps, device=device)[:, None]
        keep = (probs.cumsum(-1) - probs < limit) | (limit >= 1.0)
        probs = probs * keep
    cdf = probs.cumsum(-1)
    u = torch.tensor([_uniform(torch, gens[i]) for i in hot], device=device, dtype=cdf.dtype)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=cdf.shape[-1] - 1)
    if order is not None:
        picked = order.gather(-1, picked)
    out = greedy.tolist()
    for i, token in zip(hot, picked[:, 0].tolist()):
        out[i] = token
    return out


def _uniform(torch, gen) -> float:
    """A uniform number in [0, 1) from the request's own generator (on the CPU; made at its first
    draw, seeded by the request's ``seed`` or at random)."""
    if gen.generator is None:
        gen.generator = torch.Generator()
        gen.generator.manual_seed(gen.seed if gen.seed is not None else torch.seed())
    return float(torch.rand((), generator=gen.generator))


def quantiles(values, qs=(0.5, 0.9, 0.99)) -> dict:
    """{q: the smallest value with at least a fraction q of ``values`` at or below it}; {} if none."""
    if not values:
        return {}
    ordered = sorted(values)
    return {q: ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] for q in qs}
