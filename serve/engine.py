"""Continuous batching over a ``transformers`` causal LM: requests join and leave at step boundaries.

One engine thread runs *steps*. At each step boundary it drops cancelled requests (their rows are
free at once), asks the scheduler which queued requests join, gives each newcomer a free row of the
shared KV cache and prefills one chunk of its prompt (``prefill_chunk`` tokens, so a long prompt
never holds the batch back by more than one chunk), then runs **one batched decode** over every row
that has a token to feed, samples, and retires the rows that finished. A long request therefore
delays a short one by at most one step.

The KV cache (``RowCache``) is one tensor pair per layer of shape ``[rows, kv_heads, max_len,
head_dim]``; a request owns a row from position 0, so rows need no left padding. Each forward gets
per-row ``position_ids`` and a 4-D additive mask (a query at position ``p`` sees keys ``0..p`` of its
own row), which ``transformers`` takes as it is; the cache's ``update`` scatters the new keys at each
row's positions and hands the attention the rows of this forward. Keys beyond a row's length (left
by an earlier occupant) are masked, so a request's greedy output is the same alone or in a batch.
"""
from __future__ import annotations

import inspect
import logging
import math
import threading
import time
from dataclasses import dataclass, field

from ..errors import FlashError
from .scheduler import FlashScheduler, Route, SchedRequest

log = logging.getLogger("deepseek_flash.serve")

# Added to the model's read priority (``--read-priority``) for the reads a forward causes, by the
# highest class among its rows: an L0 request's layers go to the disk before another model's
# load and before the reads of L1/L2 forwards; L2 yields to everyone.
READ_PRIORITY_BY_CLASS = {"L0": 1, "L1": 0, "L2": -1}

# The attention reads a multiple of this many key positions (masked beyond each row's length), so
# the shapes a forward's attention sees are few and repeat, whatever the rows' lengths.
KV_BUCKET = 64
# Attention kernels a forward may use on a CUDA device: every one but cuDNN's. cuDNN's attention
# (torch's first choice on sm90/sm100 with a recent cuDNN) builds an execution plan for every new
# shape -- hundreds of milliseconds each -- and a continuously batched engine makes new shapes all
# the time (rows joining and leaving, lengths growing); the memory-efficient kernel takes the same
# additive mask with no per-shape set-up.
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
# Forwards kept for ``Engine.profile`` (the most recent).
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


@dataclass(eq=False)
class Generation:
    """One request's state in the engine. ``on_event(kind, data)`` is called from the engine thread
    with ``("token", {"text": delta, "token": id})``, then ``("done", {...})`` or
    ``("error", FlashError)``."""

    sched: SchedRequest
    prompt_ids: list
    on_event: object
    stop_ids: frozenset = frozenset()
    stop_strings: tuple = ()
    seed: int | None = None
    prefetch_window: int | None = None
    row: int | None = None
    prefilled: int = 0
    output_ids: list = field(default_factory=list)
    text: str = ""
    sent: int = 0                       # characters of ``text`` already emitted
    prefix_offset: int = 0              # incremental detokenization window (see Engine._detokenize)
    read_offset: int = 0
    finish_reason: str | None = None
    cancelled: bool = False
    first_token_at: float | None = None
    bytes_streamed_at_start: int = 0
    generator: object = None
    kv_options: dict | None = None      # for_model arguments: runs on a TieredCache of its own
    kv_cache: object = None
    fill_ids: list = None               # what prefill puts in the cache: the prompt, or after a
    resumed: bool = False               # preemption the prompt and the tokens generated but the last
    dispatched: bool = False

    def __post_init__(self):
        if self.fill_ids is None:
            self.fill_ids = self.prompt_ids
        # A request on a tiered KV cache of its own keeps its row (its cache is not recomputed).
        self.sched.preemptible = self.kv_options is None

    def cancel(self) -> None:
        """The client went away: the engine frees the row at the next step boundary."""
        self.cancelled = True


def prefill_budget(chunk: int, decode_s: float | None, per_token_s: float | None, l0_recent: bool,
                   floor: int = 16) -> int:
    """Tokens of other prompts one step may prefill (in one forward). Without L0 traffic in the last
    seconds: a whole ``chunk``. With it: as many as keep that forward to about half a decode
    forward's time -- ``decode_s`` and the measured prefill cost per token ``per_token_s`` -- so an
    L0 request arriving meanwhile waits about as long as for a decode, not for a long prefill; at
    least ``floor`` tokens (prompts still progress), at most ``chunk``. Where a forward's cost hardly
    depends on its tokens (a launch-bound GPU step) this is the whole chunk again."""
    if not l0_recent or not decode_s or not per_token_s:
        return chunk
    return min(chunk, max(floor, int(decode_s / per_token_s / 2)))


def _sample(torch, logits, gens):
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


class Engine:
    """The batching loop over ``model`` (a ``load_model`` model or any HF causal LM)."""

    def __init__(self, model, tokenizer, scheduler: FlashScheduler | None = None, *, max_batch: int = 8,
                 max_model_len: int | None = None, prefill_chunk: int = 512, device=None):
        import torch

        self.torch = torch
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = int(max_batch)
        self.scheduler = scheduler or FlashScheduler(slots=self.max_batch)
        if self.scheduler.slots != self.max_batch:
            raise ValueError(f"scheduler has {self.scheduler.slots} slots, the engine {self.max_batch} rows")
        cfg = model.config
        self.max_model_len = int(min(max_model_len or cfg.max_position_embeddings,
                                     cfg.max_position_embeddings))
        self.prefill_chunk = int(prefill_chunk)
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = param.dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.cache = RowCache(cfg.num_hidden_layers, self.max_batch, kv_heads, head_dim,
                              self.max_model_len, self.dtype, self.device)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self.eos_ids = frozenset(self._eos_ids(model))
        self._attn_default = getattr(cfg, "_attn_implementation", None)
        self.flash = getattr(model, "flash", None)
        self.stream = getattr(self.flash, "stream", None)
        self.read_base = int(getattr(self.flash, "priority", 0) or 0)
        self._lock = threading.Condition()
        self._gens: dict[int, Generation] = {}        # id(SchedRequest) -> Generation
        self._rows: list[Generation | None] = [None] * self.max_batch
        self._stop = False
        self._thread = None
        # Step-time utilisation: the scheduler's device-busy reading where NVML gives none.
        self._busy_s = 0.0
        self._util_mark = (time.monotonic(), 0.0)
        self._util = 0.0
        # Forward costs (EWMA, seconds) for the prefill budget under L0 traffic; the last L0 arrival.
        self._decode_s: float | None = None
        self._per_token_s: float | None = None
        self._l0_at: float | None = None
        self.l0_recent_s = 10.0
        if self.scheduler.gpu_busy is None:
            self.scheduler.gpu_busy = self.utilisation
        self._sdpa = None
        if self.device.type == "cuda":
            from torch.nn.attention import SDPBackend

            self._sdpa = [getattr(SDPBackend, name) for name in SDPA_BACKENDS]
        # (kind, rows, tokens per row, launch seconds, seconds until the result was on the host)
        self._profile: list = []
        self.stats = {"steps": 0, "decode_steps": 0, "prefill_chunks": 0, "prompt_tokens": 0,
                      "generated_tokens": 0, "finished": 0, "prefill_forwards": 0, "cancelled": 0, "failed": 0, "preempted": 0,
                      "ttft_ms": {c: [] for c in ("L0", "L1", "L2")}, "batch_rows_sum": 0}

    @staticmethod
    def _eos_ids(model):
        ids = set()
        for cfg in (getattr(model, "generation_config", None), model.config):
            eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif eos:
                ids.update(int(e) for e in eos)
        return ids

    # -- requests in ----------------------------------------------------------------------------
    def submit(self, gen: Generation) -> Route:
        """Route ``gen`` through the scheduler; admitted requests run from the next step boundary."""
        with self._lock:
            route = self.scheduler.route(gen.sched)
            if route.admitted and gen.sched.priority_class == "L0":
                self._l0_at = time.monotonic()
            if route.admitted:
                self._gens[id(gen.sched)] = gen
                self._lock.notify()
            return route

    def cancel(self, gen: Generation) -> None:
        with self._lock:
            gen.cancel()
            self._lock.notify()

    def running(self) -> int:
        with self._lock:
            return sum(g is not None for g in self._rows)

    # -- thread -----------------------------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._run, name="serve-engine", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new requests (503), let the batch and the queue run out for up to ``timeout``
        seconds, then fail what is left with ``ShuttingDown``."""
        from ..errors import ShuttingDown

        deadline = time.monotonic() + timeout
        with self._lock:
            self.scheduler.drain()
            while self._gens and time.monotonic() < deadline:
                self._lock.wait(0.05)
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            for gen in list(self._gens.values()):
                self._retire(gen, None, ShuttingDown("the server is shutting down"))

    def _run(self) -> None:
        with self.torch.inference_mode():
            while True:
                with self._lock:
                    self._boundary()
                    if self._stop:
                        return
                    if not any(self._rows):
                        self._lock.wait(0.05)
                        continue
                began = time.monotonic()
                try:
                    self._step()
                except Exception as exc:     # noqa: BLE001 -- every running request gets the error
                    log.exception("engine step failed")
                    err = exc if isinstance(exc, FlashError) else FlashError(f"generation failed: {exc}")
                    with self._lock:
                        for gen in [g for g in self._rows if g is not None]:
                            self._retire(gen, None, err)
                finally:
                    self._busy_s += time.monotonic() - began

    def utilisation(self) -> float:
        """The fraction of wall time spent in steps since the previous reading (readings at least
        0.5 s apart; in between the last one is returned) -- the device-busy measure of the
        scheduler's degrade rule where NVML gives none."""
        now = time.monotonic()
        since, busy_then = self._util_mark
        if now - since >= 0.5:
            self._util = min(1.0, (self._busy_s - busy_then) / (now - since))
            self._util_mark = (now, self._busy_s)
        return self._util

    def _boundary(self) -> None:
        """Drop cancelled requests, then let the scheduler fill the free rows (lock held)."""
        for gen in list(self._gens.values()):
            if gen.cancelled:
                self.stats["cancelled"] += 1
                self._retire(gen, "cancelled")
        chosen = self.scheduler.dispatch()
        for req in self.scheduler.take_preempted():
            self._preempt(self._gens[id(req)])
        for req in chosen:
            gen = self._gens[id(req)]
            gen.row = self._rows.index(None)
            self._rows[gen.row] = gen
            if gen.dispatched:
                continue                    # a preempted request rejoining: its state is kept
            gen.dispatched = True
            if self.stream is not None:
                gen.bytes_streamed_at_start = self.stream.bytes_streamed
            if gen.kv_options is not None:
                try:
                    gen.kv_cache = self._tiered_cache(gen.kv_options)
                except Exception as exc:   # noqa: BLE001 -- the request fails typed, the batch runs on
                    self._retire(gen, None, exc if isinstance(exc, FlashError)
                                 else FlashError(f"tiered KV cache: {exc}"))

    def _preempt(self, gen: Generation) -> None:
        """``gen`` gave its row to an L0 request (lock held): it waits in the queue and, when it
        joins again, prefills its prompt and the tokens it generated but the last (whose keys were
        in the row), then decodes on from the last -- its client sees no gap but the wait."""
        if gen.row is not None and self._rows[gen.row] is gen:
            self._rows[gen.row] = None
        gen.row = None
        gen.prefilled = 0
        gen.resumed = bool(gen.output_ids)
        gen.fill_ids = gen.prompt_ids + gen.output_ids[:-1] if gen.output_ids else gen.prompt_ids
        self.stats["preempted"] += 1

    def _retire(self, gen: Generation, reason: str | None, error: Exception | None = None) -> None:
        """Take ``gen`` out of the batch and the scheduler and tell its client (lock held)."""
        self._gens.pop(id(gen.sched), None)
        if gen.row is not None and self._rows[gen.row] is gen:
            self._rows[gen.row] = None
        gen.row = None
        self.scheduler.finish(gen.sched)
        self._lock.notify_all()
        # A request's own KV cache (and its spill files) is gone before its client hears the end.
        if error is not None:
            self.stats["failed"] += 1
            self._close_kv(gen)
            gen.on_event("error", error)
            return
        gen.finish_reason = reason
        if reason == "cancelled":
            self._close_kv(gen)
            return
        self.stats["finished"] += 1
        final = self.flash_stats(gen)
        self._close_kv(gen)
        gen.on_event("done", final)

    @staticmethod
    def _close_kv(gen: Generation) -> None:
        if gen.kv_cache is not None:
            gen.kv_cache.close()

    # -- one step ---------------------------------------------------------------------------------
    # -- requests on a tiered KV cache of their own ---------------------------------------------
    def _attention(self, name) -> None:
        if name is not None and self.model.config._attn_implementation != name:
            self.model.set_attn_implementation(name)

    def _tiered_cache(self, options: dict):
        """A ``TieredCache`` for one request (``flash_context``'s ``kv_*`` keys); the shared batch
        keeps its own attention implementation."""
        from ..kv import TieredCache

        try:
            return TieredCache.for_model(self.model, **options)
        finally:
            self._attention(self._attn_default)

    def _solo_step(self, gen: Generation) -> None:
        """One forward of a request on its own tiered cache: its whole prompt, or its last token."""
        torch = self.torch
        if gen.prefilled < len(gen.prompt_ids):
            chunk = gen.prompt_ids[gen.prefilled:]
        else:
            chunk = gen.output_ids[-1:]
        kwargs = {self._cache_kw: gen.kv_cache, "use_cache": True}
        if self._keep_kw is not None:
            kwargs[self._keep_kw] = 1
        self._read_priority([gen])
        from ..kv.attention import NAME

        self._attention(NAME)
        try:
            logits = self.model(input_ids=torch.tensor([chunk], device=self.device), **kwargs).logits[:, -1, :]
        finally:
            self._attention(self._attn_default)
        if gen.prefilled < len(gen.prompt_ids):
            gen.prefilled = len(gen.prompt_ids)
            self.stats["prefill_chunks"] += 1
            self.stats["prompt_tokens"] += len(chunk)
        token = _sample(torch, logits, [gen])[0]
        with self._lock:
            if not gen.cancelled and gen.finish_reason is None:
                self._accept(gen, token, time.monotonic())

    def _read_priority(self, gens) -> None:
        """Reads this forward causes (a streamed model's layers not yet in the host tier) carry the
        priority of the most urgent class among ``gens``."""
        if self.stream is None or not hasattr(self.flash, "set_read_priority"):
            return
        p = self.read_base + max(READ_PRIORITY_BY_CLASS[g.sched.priority_class] for g in gens)
        if p != self.flash.priority:
            self.flash.set_read_priority(p)

    def _forward(self, rows: list, ids, positions, kv_len):
        torch = self.torch
        kv_len = min(self.cache.max_len, -(-kv_len // KV_BUCKET) * KV_BUCKET)
        span = (rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[0] + len(rows))) else None
        self.cache.bind(torch.tensor(rows, device=self.device), positions, kv_len, span)
        keys = torch.arange(kv_len, device=self.device)
        allowed = keys[None, None, None, :] <= positions[:, None, :, None]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        kwargs = {self._cache_kw: self.cache, "use_cache": True}
        if self._keep_kw is not None:
            kwargs[self._keep_kw] = 1
        if self._sdpa is None:
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, **kwargs)
        else:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(self._sdpa):
                out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, **kwargs)
        return out.logits[:, -1, :]

    def _record(self, kind: str, rows: int, tokens: int, launch_s: float, total_s: float) -> None:
        self._profile.append((kind, rows, tokens, launch_s, total_s))
        if len(self._profile) > 2 * PROFILE_SAMPLES:
            del self._profile[:-PROFILE_SAMPLES]

    def profile(self, reset: bool = False) -> dict:
        """Where the engine's time went since the last reset: per kind of forward (``decode`` by
        rows in the batch, ``prefill``) the count and the p50/p99/max milliseconds from the
        forward's start until its result was on the host (``ms``), and of that the time the host
        spent issuing it (``launch_ms``: close to ``ms`` when the host, not the device, is the
        bound). ``reset`` starts a new period."""
        samples = self._profile[-PROFILE_SAMPLES:]
        if reset:
            self._profile = []
        groups: dict = {}
        for kind, rows, tokens, launch_s, total_s in samples:
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
            q = ttft_quantiles(total, (0.5, 0.99))
            ql = ttft_quantiles(launch, (0.5, 0.99))
            out[key] = {"forwards": len(items), "rows_mean": round(sum(i[0] for i in items) / len(items), 2),
                        "tokens_mean": round(sum(i[0] * i[1] for i in items) / len(items), 1),
                        "ms_p50": round(q[0.5] * 1e3, 3), "ms_p99": round(q[0.99] * 1e3, 3),
                        "ms_max": round(total[-1] * 1e3, 3), "launch_ms_p50": round(ql[0.5] * 1e3, 3),
                        "launch_ms_p99": round(ql[0.99] * 1e3, 3)}
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _prefill(self, group) -> None:
        """One forward over ``group`` -- (generation, tokens) pairs: the next ``tokens`` of each
        prompt. Rows are left-padded to the longest chunk, so the last position is every row's last
        real token; padding writes its keys at the row's next position (``end``), which no real
        query of this forward reads and the row's next forward overwrites before reading it. A
        prompt whose last chunk this is gets its first token now, before the batch's decode."""
        torch = self.torch
        width = max(n for _, n in group)
        ids, pos = [], []
        for gen, n in group:
            start = gen.prefilled
            end = start + n
            ids.append([0] * (width - n) + gen.fill_ids[start:end])
            pos.append([end] * (width - n) + list(range(start, end)))
        rows = [g.row for g, _ in group]
        positions = torch.tensor(pos, device=self.device)
        kv_len = max(g.prefilled + n for g, n in group) + (1 if any(n < width for _, n in group) else 0)
        self._read_priority([g for g, _ in group])
        began = time.perf_counter()
        logits = self._forward(rows, torch.tensor(ids, device=self.device), positions, kv_len)
        launched = time.perf_counter() - began
        self._sync()                # the cost of this forward, not of the next one that waits
        spent = time.perf_counter() - began
        self._record("prefill", len(group), width, launched, spent)
        # What a prompt token adds to a forward: the time beyond a decode forward's, per token.
        sample = max(0.0, spent - (self._decode_s or 0.0)) / (len(group) * width)
        self._per_token_s = sample if self._per_token_s is None else 0.8 * self._per_token_s + 0.2 * sample
        self.stats["prefill_forwards"] += 1
        done = []
        for i, (gen, n) in enumerate(group):
            gen.prefilled += n
            self.stats["prefill_chunks"] += 1
            self.stats["prompt_tokens"] += n
            if gen.prefilled == len(gen.fill_ids) and not gen.resumed:
                done.append(i)
        if done:
            # The first token goes out now, not after the batch's decode: TTFT is one prefill.
            tokens = _sample(torch, logits[done], [group[i][0] for i in done])
            now = time.monotonic()
            with self._lock:
                for i, token in zip(done, tokens):
                    gen = group[i][0]
                    if not gen.cancelled:
                        self._accept(gen, token, now)

    def _prefill_l0(self) -> None:
        """Every L0 prompt in the batch, one chunk each, in one forward of their own -- before any
        other prefill or the decode of this step."""
        with self._lock:
            group = [(g, min(self.prefill_chunk, len(g.fill_ids) - g.prefilled)) for g in self._rows
                     if g is not None and g.sched.priority_class == "L0" and g.prefilled < len(g.fill_ids)
                     and not g.cancelled and g.kv_cache is None]
        if group:
            self._prefill(group)

    def _step(self) -> None:
        """One step: L0 prompts, then at most ``prefill_chunk`` tokens of the other prompts (in the
        order they joined, packed into one forward), then -- after letting in an L0 request that
        arrived meanwhile, and prefilling it -- one batched decode over every row with a token to
        feed. An L0 request therefore waits for at most one forward of bounded size before its
        own prefill, whatever the batch holds."""
        torch = self.torch
        with self._lock:
            batch = [g for g in self._rows if g is not None]
        self._apply_window(batch)
        self._prefill_l0()
        l0_recent = self._l0_at is not None and time.monotonic() - self._l0_at < self.l0_recent_s
        budget = prefill_budget(self.prefill_chunk, self._decode_s, self._per_token_s, l0_recent)
        # Packed in join order while rows x the widest chunk stays within the budget (padding is
        # compute too); the first prompt in line always gets its share.
        group, width = [], 0
        for gen in sorted((g for g in batch if g.sched.priority_class != "L0" and not g.cancelled
                           and g.kv_cache is None and g.row is not None and g.prefilled < len(g.fill_ids)),
                          key=lambda g: (g.sched.started, g.sched.seq)):
            need = len(gen.fill_ids) - gen.prefilled
            n = min(need, budget) if not group else min(need, max(width, budget // (len(group) + 1)))
            if group and (len(group) + 1) * max(width, n) > budget:
                break
            group.append((gen, n))
            width = max(width, n)
        if group:
            self._prefill(group)
        with self._lock:
            if self.scheduler.queued_count("L0"):
                self._boundary()
        self._prefill_l0()
        # Requests on a tiered KV cache of their own: one forward each.
        for gen in [g for g in batch if g.kv_cache is not None]:
            if not gen.cancelled and gen.finish_reason is None and gen.row is not None:
                self._solo_step(gen)
        # One batched decode over every row whose last token is not yet in the cache.
        with self._lock:
            decoding = [g for g in self._rows if g is not None and g.prefilled == len(g.fill_ids)
                        and g.output_ids and g.finish_reason is None and not g.cancelled
                        and g.kv_cache is None]
        if decoding:
            rows = [g.row for g in decoding]
            ids = torch.tensor([[g.output_ids[-1]] for g in decoding], device=self.device)
            lengths = [len(g.prompt_ids) + len(g.output_ids) - 1 for g in decoding]
            pos = torch.tensor(lengths, device=self.device)[:, None]
            self._read_priority(decoding)
            began = time.perf_counter()
            logits = self._forward(rows, ids, pos, max(lengths) + 1)
            launched = time.perf_counter() - began
            produced = list(zip(decoding, _sample(torch, logits, decoding)))
            spent = time.perf_counter() - began
            self._record("decode", len(decoding), 1, launched, spent)
            self._decode_s = spent if self._decode_s is None else 0.8 * self._decode_s + 0.2 * spent
            self.stats["decode_steps"] += 1
            self.stats["batch_rows_sum"] += len(decoding)
        else:
            produced = []
        self.stats["steps"] += 1
        now = time.monotonic()
        with self._lock:
            for gen, token in produced:
                if not gen.cancelled:
                    self._accept(gen, token, now)
            self.scheduler.tick()

    def _accept(self, gen: Generation, token: int, now: float) -> None:
        """Append ``token`` to ``gen``, emit the new text, retire the request when it is done."""
        if gen.first_token_at is None:
            gen.first_token_at = now
            self.stats["ttft_ms"][gen.sched.priority_class].append((now - gen.sched.arrival) * 1e3)
            del self.stats["ttft_ms"][gen.sched.priority_class][:-4096]
        reason = None
        appended = token not in gen.stop_ids and token not in self.eos_ids
        if appended:
            gen.output_ids.append(token)
            self.stats["generated_tokens"] += 1
        else:
            reason = "stop"
        n = len(gen.output_ids)
        gen.sched.generated = n
        if reason is None and (n >= gen.sched.max_new_tokens or len(gen.prompt_ids) + n >= self.max_model_len):
            reason = "length"
        before = len(gen.text)
        self._detokenize(gen, final=reason is not None)
        if gen.stop_strings and len(gen.text) > before:
            # Only the new text (and the longest stop string's reach back into the old) can match.
            start = max(0, before - max(len(s) for s in gen.stop_strings) + 1)
            hits = [at for at in (gen.text.find(stop, start) for stop in gen.stop_strings) if at >= 0]
            if hits:
                gen.text, reason = gen.text[:min(hits)], "stop"
        # Hold back the tail that may still become a stop string.
        ready = len(gen.text)
        if reason is None and gen.stop_strings:
            hold = max(len(s) for s in gen.stop_strings) - 1
            ready = max(gen.sent, ready - hold)
        # One event per generated token (its text may be empty while held back), so a stream shows
        # progress -- and the time to the first token -- even before the text is printable.
        if ready > gen.sent or appended:
            gen.on_event("token", {"text": gen.text[gen.sent: ready], "token": token})
            gen.sent = ready
        if reason is not None:
            self._retire(gen, reason)

    def _detokenize(self, gen: Generation, final: bool) -> None:
        """Extend ``gen.text`` by the characters the new tokens complete, decoding only a window
        of the last tokens (not the whole output at every token): the window from
        ``gen.prefix_offset`` keeps the context a tokenizer needs for a leading space, and text
        that ends in an incomplete UTF-8 sequence waits for the next token -- except at the end
        (``final``), where the whole output's decode is what is answered."""
        ids = gen.output_ids
        decode = self.tokenizer.decode
        prefix = decode(ids[gen.prefix_offset: gen.read_offset], skip_special_tokens=True)
        new = decode(ids[gen.prefix_offset:], skip_special_tokens=True)
        if final or (len(new) > len(prefix) and not new.endswith("\ufffd")):
            gen.text += new[len(prefix):]
            gen.prefix_offset, gen.read_offset = gen.read_offset, len(ids)

    def _apply_window(self, batch) -> None:
        """Requests that asked for a ``prefetch_window`` pin the stream's window (the largest asked,
        within the slot ring) while they run; otherwise the window controller adapts it."""
        if self.stream is None:
            return
        asked = [g.prefetch_window for g in batch if g.prefetch_window is not None]
        if asked:
            ctl = self.stream.controller
            ctl.window = ctl.policy.clamp(max(asked))

    # -- reporting --------------------------------------------------------------------------------
    def flash_stats(self, gen: Generation) -> dict:
        """The ``flash`` object of a response."""
        req = gen.sched
        stats = {"class": req.priority_class, "priority": req.priority,
                 "queue_ms": None if req.queue_ms is None else round(req.queue_ms, 3),
                 "ttft_ms": None if gen.first_token_at is None else round((gen.first_token_at - req.arrival) * 1e3, 3),
                 "degrade_steps": list(req.degraded), "preempted": req.preempted}
        tokens = len(gen.prompt_ids) + len(gen.output_ids)
        if gen.kv_cache is not None:
            tiered = gen.kv_cache.stats()
            stats["kv"] = {"tokens": tokens, "cache": "tiered",
                           "bytes": tiered["gpu_bytes"] + tiered["host_bytes"] + tiered["spilled_bytes"],
                           "tiered": tiered}
        else:
            stats["kv"] = {"tokens": tokens, "cache": "rows", "bytes": tokens * self.cache.bytes_per_token}
        if self.stream is not None:
            hits, misses = self.stream.hits, self.stream.misses
            stats.update(prefetch_hit_rate=round(hits / (hits + misses), 4) if hits + misses else None,
                         prefetch_window=self.stream.controller.window,
                         bytes_streamed=self.stream.bytes_streamed - gen.bytes_streamed_at_start)
        else:
            # Every weight is resident: nothing is streamed, nothing can miss.
            stats.update(prefetch_hit_rate=None, prefetch_window=None, bytes_streamed=0)
        return stats

    def snapshot(self) -> dict:
        with self._lock:
            snap = self.scheduler.snapshot()
            snap["engine"] = {k: v for k, v in self.stats.items() if k != "ttft_ms"}
            snap["ttft_ms"] = {c: list(v) for c, v in self.stats["ttft_ms"].items()}
            snap["rows_busy"] = sum(g is not None for g in self._rows)
            return snap


def ttft_quantiles(values, qs=(0.5, 0.9, 0.99)) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    return {q: ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] for q in qs}
