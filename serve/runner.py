"""The device side of the engine's steps: forwards of the model over rows of one shared KV cache, and
the sampling of each row's next token. Which requests go into which forward is the engine's.

The KV cache (``RowCache``) is one tensor pair per layer of shape ``[rows, kv_heads, max_len + 1,
head_dim]`` (the last slot is scratch, never read); a request owns a row from position 0, so rows need no left padding. Each forward gets
per-row ``position_ids`` and a 4-D additive mask (a query at position ``p`` sees keys ``0..p`` of its
own row), which ``transformers`` takes as it is; the cache's ``update`` scatters the new keys at each
row's positions and hands the attention the rows of this forward. Keys beyond a row's length (left
by an earlier occupant) are masked, so a request's greedy output is the same alone or in a batch.
The batch's decode step runs as CUDA graphs over every row where it can (``graphs.StaticDecode``).
"""
from __future__ import annotations

import inspect
import logging
import math
import time

# Attention on a CUDA device: every kernel but cuDNN's (SDPA_BACKENDS, deepseek_flash/cuda.py):
# cuDNN builds an execution plan for every new shape, and a continuously batched engine makes new
# shapes all the time; the memory-efficient kernel takes the same additive mask with no set-up.
from deepseek_flash.cuda import SDPA_BACKENDS, sdpa_backends  # noqa: F401 (SDPA_BACKENDS: tests)

from .beside import SideStream

log = logging.getLogger("deepseek_flash.serve")

# The attention reads a multiple of this many key positions (masked beyond each row's length), so
# the shapes a forward's attention sees are few and repeat, whatever the rows' lengths.
KV_BUCKET = 64
# The batch's decode step (``RowRunner(decode=...)``): see ``RowRunner._decode_setup``.
DECODE_MODES = ("auto", "eager", "static")
# Forwards kept for ``RowRunner.profile`` (the most recent).
PROFILE_SAMPLES = 8192


class RowCache:
    """The shared KV cache: a row per batch slot (duck-typed ``transformers`` cache).

    ``bind(rows, positions, kv_len)`` before a forward names the rows it runs on, the position of
    each of its tokens, and how many key positions the attention reads; ``bind_static(positions,
    kv_len)`` a forward over every row, one token each, written with a scatter (``StaticDecode``).
    Each row has one slot more than ``max_len``: ``scratch``, where a row with nothing to decode
    writes in the fixed-shape step; no attention width reaches it."""

    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype, device):
        import torch

        shape = (rows, kv_heads, max_len + 1, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.scratch = max_len
        self.bytes_per_token = 2 * num_layers * kv_heads * head_dim * self.keys[0].element_size()
        self._rows = self._positions = self._span = None
        self._kv_len = 0
        self._static = False
        self.is_compileable = False

    def bind(self, rows, positions, kv_len: int, span: tuple[int, int] | None = None) -> None:
        """``span``: (first, end) when ``rows`` is that contiguous ascending range -- the attention
        then reads a view of the cache instead of a gathered copy of every row's keys."""
        self._rows, self._positions, self._kv_len, self._span = rows, positions, kv_len, span
        self._static = False

    def bind_static(self, positions, kv_len: int) -> None:
        """A forward over every row, one token each at ``positions`` (``[rows, 1]``, on the
        device): fixed shapes, nothing read on the host (what a CUDA graph captures)."""
        self._positions, self._kv_len, self._static = positions, kv_len, True

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._static:
            # key_states: [rows, kv_heads, 1, head_dim]; each row's one key at its position.
            index = self._positions.view(-1, 1, 1, 1).expand(key_states.shape)
            keys.scatter_(2, index, key_states.to(keys.dtype))
            values.scatter_(2, index, value_states.to(values.dtype))
            return keys[:, :, : self._kv_len], values[:, :, : self._kv_len]
        rows, pos = self._rows[:, None], self._positions
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

    def __init__(self, model, rows: int, max_len: int, device=None, decode: str = "auto",
                 prefill_chunk: int = 512):
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
        self.static = self.static_prefill = self.static_prefill_l0 = self.static_prefill_l0b = None
        # L0 prompts beside a forward in flight go to a CUDA stream of their own (``side_stream``);
        # a second L0 prompt arriving meanwhile to a second one, from its own graphs (``beside``).
        self.side = SideStream(torch, self.device)
        self.side_b = SideStream(torch, self.device)
        self.prefill_chunk = int(prefill_chunk)
        self.decode_reason = self._decode_setup(decode)
        if self.decode_reason is not None:
            log.info("serve decode steps run eagerly: %s", self.decode_reason)

    def _decode_setup(self, decode: str) -> str | None:
        """The batch's decode step (``decode``): ``"auto"`` (default) CUDA graphs of the fixed-shape
        step (``graphs.StaticDecode``) where they can be captured, else the eager decode over the
        gathered rows; ``"eager"`` always that; ``"static"`` the fixed-shape step run eagerly.
        Returns why the decode is eager (None: it is not)."""
        from .graphs import L0_PREFILL_ROWS, StaticDecode, StaticPrefill, graphs_blocker

        if decode not in DECODE_MODES:
            raise ValueError(f"decode {decode!r} is not one of {DECODE_MODES}")
        if decode == "eager":
            return "decode='eager'"
        if decode == "static":
            self.static = StaticDecode(self, capture=False)
            self.static_prefill = StaticPrefill(self, capture=False, chunk=self.prefill_chunk, deep=True)
            self.static_prefill_l0 = StaticPrefill(self, capture=False, chunk=self.prefill_chunk,
                                                   rows=L0_PREFILL_ROWS)
            self.static_prefill_l0b = StaticPrefill(self, capture=False, chunk=self.prefill_chunk,
                                                    rows=L0_PREFILL_ROWS)
            return None
        reason = graphs_blocker(self)
        if reason is None:
            self.static = StaticDecode(self, capture=True)
            self.static_prefill = StaticPrefill(self, capture=True, chunk=self.prefill_chunk, deep=True)
            # L0 prompts have graphs of their own (own buffers, memory pool and capture stream): they
            # can run beside any other graph of the batch (``beside.L0Beside``).
            self.static_prefill_l0 = StaticPrefill(self, capture=True, chunk=self.prefill_chunk,
                                                   rows=L0_PREFILL_ROWS)
            # A second set, so that two L0 prompts can run at once, each on its own side stream.
            self.static_prefill_l0b = StaticPrefill(self, capture=True, chunk=self.prefill_chunk,
                                                    rows=L0_PREFILL_ROWS)
        return reason

    @property
    def decode_mode(self) -> str:
        """``graphs``, ``static`` (the fixed-shape step, eagerly) or ``eager``."""
        if self.static is None:
            return "eager"
        return self.static.stats()["mode"]

    def decode_stats(self) -> dict:
        """How the batch decodes: mode, why eager (``reason``), graphs captured, replays."""
        prefill = None if self.static_prefill is None else self.static_prefill.stats()
        if prefill is not None:
            prefill["l0"] = None if self.static_prefill_l0 is None else self.static_prefill_l0.stats()
            prefill["l0b"] = None if self.static_prefill_l0b is None else self.static_prefill_l0b.stats()
        if self.static is None:
            return {"mode": "eager", "reason": self.decode_reason, "prefill": prefill}
        return self.static.stats() | {"prefill": prefill}

    def _kwargs(self, cache) -> dict:
        kwargs = {self._cache_kw: cache, "use_cache": True}
        if self._keep_kw is not None:
            kwargs[self._keep_kw] = 1
        return kwargs

    def forward(self, rows: list, ids, positions, kv_len):
        """Logits at the last position of each of ``rows`` after feeding ``ids`` at ``positions``;
        the attention reads ``kv_len`` key positions, rounded up to a ``KV_BUCKET``."""
        torch = self.torch
        kv_len = self._width(kv_len)
        span = (rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[0] + len(rows))) else None
        self.cache.bind(torch.tensor(rows, device=self.device), positions, kv_len, span)
        keys = torch.arange(kv_len, device=self.device)
        allowed = keys[None, None, None, :] <= positions[:, None, :, None]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return self.call_model(ids, positions, mask).logits[:, -1, :]

    def call_model(self, ids, positions, mask):
        """The model over the bound ``cache`` (cuDNN's attention left out on a CUDA device)."""
        kwargs = self._kwargs(self.cache)
        with sdpa_backends(self.device):
            return self.model(input_ids=ids, position_ids=positions, attention_mask=mask, **kwargs)

    def nested(self):
        """A forward run inside another one (between two of its layers) leaves the outer
        forward's cache binding as it found it."""
        import contextlib

        cache = self.cache

        @contextlib.contextmanager
        def keep():
            saved = (cache._rows, cache._positions, cache._kv_len, cache._span, cache._static,
                     getattr(self, "_kv_last", 0))
            try:
                yield
            finally:
                (cache._rows, cache._positions, cache._kv_len, cache._span, cache._static,
                 self._kv_last) = saved
        return keep()

    def bucket(self, kv_len: int) -> int:
        """``kv_len`` rounded up to a ``KV_BUCKET`` multiple, at most the cache's length."""
        return min(self.cache.max_len, -(-kv_len // KV_BUCKET) * KV_BUCKET)

    def _width(self, kv_len: int) -> int:
        """``kv_len`` rounded up to a ``KV_BUCKET`` multiple (at most the cache's length), noted."""
        kv_len = self.bucket(kv_len)
        self.kv_seen.add(kv_len)
        self._kv_last = kv_len
        return kv_len

    def prefill(self, rows: list, ids: list, positions: list, kv_len: int, l0: bool = False, meanwhile=None):
        """One forward of prompt chunks (``ids``/``positions``: a list per row, of equal length);
        returns (logits, seconds until the forward was done on the device). ``l0``: L0 prompts,
        from their own graphs where one has the shape. ``meanwhile`` as for ``decode``, where the
        forward is a graph (of the other prompts)."""
        torch = self.torch
        began = time.perf_counter()
        logits = None
        if l0 and self.static_prefill_l0 is not None:
            logits = self.static_prefill_l0.run(rows, ids, positions, self._width(kv_len))
        if logits is None and self.static_prefill is not None:  # a captured shape, or the static test mode
            logits = self.static_prefill.run(rows, ids, positions, self._width(kv_len))
            if logits is not None and meanwhile is not None and not l0:
                self._meanwhile(meanwhile)
        if logits is None:
            logits = self.forward(rows, torch.tensor(ids, device=self.device),
                                  torch.tensor(positions, device=self.device), kv_len)
        launched = time.perf_counter() - began
        self._sync()                # the cost of this forward, not of the next one that waits
        spent = time.perf_counter() - began
        self._record("prefill", len(rows), len(ids[0]), launched, spent, began)
        return logits, spent

    def prefill_start(self, rows: list, ids: list, positions: list, kv_len: int, graphs):
        """Issue a prompt forward (as ``prefill``) from ``graphs`` (a ``StaticPrefill``) on the
        current stream and return without waiting for it: (logits, perf_counter at the start,
        seconds issuing it) for ``prefill_end``; None where ``graphs`` has no such shape."""
        began = time.perf_counter()
        logits = graphs.run(rows, ids, positions, self._width(kv_len))
        if logits is None:
            return None
        return logits, began, time.perf_counter() - began

    def prefill_end(self, rows: int, tokens: int, began: float, launched: float) -> float:
        """Wait for the forward ``prefill_start`` issued (on the current stream), record it; the
        seconds from its start until it was done."""
        self._sync()
        spent = time.perf_counter() - began
        self._record("prefill", rows, tokens, launched, spent, began)
        return spent

    def issued_event(self):
        """A CUDA event recorded after the work issued so far on the current stream (None off
        CUDA, where the work ran as it was issued)."""
        if self.device.type != "cuda":
            return None
        event = self.torch.cuda.Event()
        event.record(self.torch.cuda.current_stream(self.device))
        return event

    def decode(self, gens, rows: list, last: list, lengths: list, meanwhile=None):
        """One batched decode: each row's ``last`` token at its position ``lengths``; returns (the
        next token of each of ``gens``, seconds until they were on the host). With the fixed-shape
        step (graphs), ``meanwhile(issued)`` is called once the step is issued, before its result
        is waited for: ``issued`` is a CUDA event recorded after it (None off CUDA, where the step
        ran as it was issued); ``side_stream`` runs work beside it."""
        torch = self.torch
        began = time.perf_counter()
        logits = None
        if self.static is not None:
            kv_len = self._width(max(lengths) + 1)
            logits = self.static.run(rows, last, lengths, kv_len)
            if logits is None:                  # capture failed: eager from now on, logged
                self.decode_reason, self.static = self.static.reason, None
            elif meanwhile is not None:
                self._meanwhile(meanwhile)
        if logits is None:
            ids = torch.tensor([[t] for t in last], device=self.device)
            positions = torch.tensor(lengths, device=self.device)[:, None]
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

    def _meanwhile(self, meanwhile) -> None:
        """``meanwhile(issued)`` with a CUDA event recorded after the work just issued on the
        current stream (None off CUDA: the work ran as it was issued)."""
        issued = None
        if self.device.type == "cuda":
            issued = self.torch.cuda.Event()
            issued.record(self.torch.cuda.current_stream(self.device))
        meanwhile(issued)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            if self.side.active or self.side_b.active:  # not the batch's decode that runs beside it
                self.torch.cuda.current_stream(self.device).synchronize()
            else:
                self.torch.cuda.synchronize(self.device)

    def side_stream(self):
        """A ``with`` under which forwards go to a CUDA stream of their own, beside the batch's
        decode in flight on the main one, and wait only for themselves (a no-op off CUDA;
        ``beside.SideStream``)."""
        return self.side.use()

    def warm(self, prefill_chunk: int = 512) -> float:
        """Meet, before any request does, every shape a forward can have. The batch's decode at
        every attention width (``KV_BUCKET`` multiples up to the cache's length): its CUDA graphs
        captured (``StaticDecode``), or eagerly one decode over all rows and one over two rows apart
        (the gathered-rows path). A one-row prompt of 1, 2, 3, 4, 6, 8, ... tokens up to
        ``prefill_chunk`` (the matrix products pick their kernels by the number of tokens), and the
        sampling. On a CUDA device the first forward of a new shape costs tens to hundreds of
        milliseconds of host time (kernel selection, a kernel's module loaded at its first use);
        met under load, that stalls every running request and the queue behind it -- an L0
        request's first token among them. Keys written here are beyond any request's length
        (masked, as an earlier occupant's are). Returns the seconds it took."""
        from types import SimpleNamespace

        torch = self.torch
        began = time.perf_counter()
        rows = self.cache.keys[0].shape[0]
        widths = sorted({self._width(n) for n in range(KV_BUCKET, self.cache.max_len + KV_BUCKET, KV_BUCKET)})
        with torch.inference_mode():
            if self.static is not None and self.static.capture:
                self.static.capture_all(widths)
                if self.static.reason is not None:
                    self.decode_reason, self.static = self.static.reason, None
            elif self.static is not None:
                for kv_len in widths:
                    self.static.run([0], [0], [kv_len - 1], kv_len)
            if self.static_prefill is not None and self.static_prefill.capture:
                self.static_prefill.capture_all()
                for kv_len in {k for _, _, k in self.static_prefill.keys()}:
                    self.kv_seen.add(kv_len)
                if self.static_prefill.reason is not None:
                    self.static_prefill = None
            if self.static_prefill_l0 is not None and self.static_prefill_l0.capture:
                self.static_prefill_l0.capture_all()
                if self.static_prefill_l0.reason is not None:
                    self.static_prefill_l0 = None
            if self.static_prefill_l0b is not None and self.static_prefill_l0b.capture:
                self.static_prefill_l0b.capture_all()
                if self.static_prefill_l0b.reason is not None or self.static_prefill_l0 is None:
                    self.static_prefill_l0b = None
            for kv_len in widths if self.static is None else ():
                last = kv_len - 1
                for group in (list(range(rows)), [0, rows - 1] if rows > 2 else None):
                    if group is None:
                        continue
                    ids = torch.zeros((len(group), 1), dtype=torch.long, device=self.device)
                    positions = torch.full((len(group), 1), last, device=self.device)
                    self.forward(group, ids, positions, last + 1)
            for n in prompt_sizes(min(prefill_chunk, self.cache.max_len)):
                ids = torch.zeros((1, n), dtype=torch.long, device=self.device)
                logits = self.forward([0], ids, torch.arange(n, device=self.device)[None, :], n)
            hot = SimpleNamespace(sched=SimpleNamespace(temperature=0.7, top_p=0.9), generator=None, seed=0)
            cold = SimpleNamespace(sched=SimpleNamespace(temperature=0.0, top_p=1.0), generator=None, seed=0)
            self.sample(torch.cat([logits, logits]), [hot, cold])
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


def prompt_sizes(limit: int) -> list:
    """1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and their halfway points) up to ``limit``,
    ``limit`` included: the prompt lengths ``RowRunner.warm`` runs."""
    sizes, p = {limit}, 1
    while p <= limit:
        sizes.update(n for n in (p, p + p // 2) if n <= limit)
        p *= 2
    return sorted(sizes)


def quantiles(values, qs=(0.5, 0.9, 0.99)) -> dict:
    """{q: the smallest value with at least a fraction q of ``values`` at or below it}; {} if none."""
    if not values:
        return {}
    ordered = sorted(values)
    return {q: ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] for q in qs}
