"""``GraphDecoder``: prefill once, then one CUDA-graph replay per token over a static KV cache.

Shapes are bucketed so that graphs are few and reused: the batch rounds up to a power of two
(rows beyond the real batch decode a pad token and are dropped), and the attention reads the first
``visible`` slots of the cache, ``visible`` a multiple of ``LENGTH_BUCKET`` tokens that grows with
the sequence. A graph is keyed by (batch bucket, visible, sampling kind, eos rule); a new prompt
length, a new ``max_new_tokens``, ``min_new_tokens`` or new temperature/top-p values within the
capacity replay the same graphs (the eos rule -- ``min_new_tokens`` / ``min_length`` as
transformers' processors apply them -- is a mask and a step count held in device tensors).
``capacity`` (tokens per sequence, prompt + new) sizes the cache once; a request beyond it raises
``DecodeCapacityExceeded`` before any work.

State the step reads and writes lives in fixed device tensors (``state.StepState``): the last token, each
row's first real slot, the slot written next, the output index, the finished flags and the output
buffer. Before capturing, the step runs twice eagerly on a side stream (as CUDA graphs require)
and the scalars it advanced are put back. ``stats()["graph_pool_bytes"]``: the memory the
graphs' shared pool holds (reserved memory after each capture less before it, the allocator's
cache emptied first, as ``torch.cuda.graph`` does on entry anyway; 0 again after ``reset``).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time

from ..cuda import sdpa_backends
from ..errors import DecodeCapacityExceeded
from . import fused as fusion
from . import kernels
from . import request as requests
from .cache import Cursor, KVStore
from .state import StepState, is_eos, suppress_eos
from .step import (PACKED_ATTENTION, MaskSpec, StepModules, cache_keyword, choose, decode_allowed,
                   forward_last, prefill_allowed, register_attention, rms_norms, unsupported)

log = logging.getLogger("deepseek_flash.decode")

DEFAULT_CAPACITY = 4096
LENGTH_BUCKET = 256
# With eos ids, the host looks at the finished flags once per this many steps (one sync).
CHECK_EVERY = 32


def batch_bucket(batch: int) -> int:
    return 1 << (batch - 1).bit_length()


def length_bucket(tokens: int, capacity: int, step: int = LENGTH_BUCKET) -> int:
    return min(capacity, -(-tokens // step) * step)


def _oom_error(torch):
    return getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def _records_logits(kind) -> bool:
    return isinstance(kind, tuple) and kind[-1] == "logits"


class GraphDecoder:
    """Owns a model's static cache and decode graphs; ``generate`` is the model's new ``generate``.

    ``capacity``: tokens per sequence (prompt + new tokens) the cache holds; default
    ``min(4096, max_position_embeddings)``. ``graphs``: False runs the same step eagerly.
    ``before_capture``: called once before the first capture (``load_model`` waits there for a
    load still in flight). ``hooks_ok``: modules whose forward hooks are known to be graph-safe.
    ``packed_attention``: single-token attention over grouped key/value heads without repeating
    the cache (``step.packed_gqa_attention``; models using sdpa). ``fused_norm``: RMSNorm
    statistics in one kernel (``step.fused_rms_norm``). ``length_step``: the visible length grows
    in steps of this many tokens. ``fused``: decode steps run the model's own fused forward
    (``decode.fused``: merged q|k|v and gate|up GEMVs, rotary + cache write, residual add + norm and
    SiLU x up as one kernel each) where the model allows it; prefill always runs transformers'
    modules. ``ring``: a streamed model's ``client.stream.StaticRing``: decode steps run the ring's
    copies themselves (inside the graph), in place of its per-layer hooks; needs the fused step.
    """

    def __init__(self, model, capacity: int | None = None, graphs: bool = True, before_capture=None,
                 hooks_ok=(), packed_attention: bool = True, fused_norm: bool = True,
                 length_step: int = LENGTH_BUCKET, fused: bool = True, ring=None):
        import torch

        self.torch = torch
        self.model = model
        self.transformers_generate = type(model).generate.__get__(model)
        config = model.config
        limit = getattr(config, "max_position_embeddings", None) or DEFAULT_CAPACITY
        self.capacity = int(capacity) if capacity is not None else min(DEFAULT_CAPACITY, limit)
        if self.capacity <= 0:
            raise ValueError(f"decode capacity must be a positive number of tokens, not {capacity}")
        self.before_capture = before_capture
        self.ring = ring
        if ring is not None:
            hooks_ok = list(hooks_ok) + ring.runtime.hooked_modules()
        self.hooks_ok = set(map(id, hooks_ok))
        self._ring_checked = False
        self.unsupported = unsupported(model)
        self.device = next(p.device for p in model.parameters() if not p.is_meta)
        self.eager_reason = None if graphs else "graphs=False"
        if self.eager_reason is None and self.device.type != "cuda":
            self.eager_reason = f"CUDA graphs need a CUDA device (model on {self.device.type})"
        self.length_step = int(length_step)
        self.attention = None
        if self.unsupported is None:
            self.cache_kw = cache_keyword(model)
            self.masks = MaskSpec(model)
            if packed_attention and config._attn_implementation == "sdpa":
                register_attention()
                self.attention = PACKED_ATTENTION
            self.swaps = StepModules(config, self.attention, rms_norms(model) if fused_norm else ())
        self.fused = None                       # fusion.FusedForward once built
        self._fused_ran = False
        self.fused_reason = "fused=False" if not fused else (
            self.unsupported or fusion.unsupported(model))
        self.store: KVStore | None = None
        self._caches: dict = {}
        self._kv_rows: dict = {}
        self.states: dict[int, StepState] = {}
        self.graphs: dict[tuple, object] = {}
        self.pool = None
        self.cursor = Cursor()
        self._logged: set[str] = set()
        self.counters = {"generate_calls": 0, "fallback_calls": 0, "captures": 0, "capture_s": 0.0,
                         "replays": 0, "eager_steps": 0, "graph_pool_bytes": 0, "oom_fallbacks": 0}
        self.last_fallback: str | None = None
        # One static state per model: concurrent generate() calls take turns.
        self._lock = threading.Lock()

    # --- public ----------------------------------------------------------------------------------
    def generate(self, *args, **kwargs):
        """``model.generate`` with the same arguments and the same result (a tensor of prompt +
        new ids); calls the step cannot implement go to transformers' ``generate``."""
        reason = self.unsupported
        req = None
        if reason is None:
            req = requests.parse(self.model, args, kwargs)
            if isinstance(req, requests.Fallback):
                reason, req = req.reason, None
        if req is not None and req.input_ids.device != self.device:
            reason, req = f"prompt on {req.input_ids.device}, model on {self.device}", None
        if req is None:
            self.counters["fallback_calls"] += 1
            self.last_fallback = reason
            self._log_once(f"decoding through transformers' generate(): {reason}")
            return self.transformers_generate(*args, **kwargs)
        self._check_capacity(req)
        with self._lock, self._on_device(), self.torch.inference_mode():
            self.counters["generate_calls"] += 1
            try:
                return self._run(req)
            except _oom_error(self.torch) as exc:
                reason = self._release_after_oom(exc)
        # Out of device memory in the static cache, a capture or a step: the cache and graphs are
        # released and this call decodes through transformers' generate (its own memory error,
        # if that does not fit either, reaches the caller); the next call tries again.
        self.counters["fallback_calls"] += 1
        self.last_fallback = reason
        self._log_once(f"decoding through transformers' generate(): {reason}")
        return self.transformers_generate(*args, **kwargs)

    def _release_after_oom(self, exc) -> str:
        self.counters["oom_fallbacks"] += 1
        self.reset()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        return f"out of device memory in the static-cache decode ({first})"

    def _on_device(self):
        """Streams and captures on the model's device, whatever device is current, and its
        attention without cuDNN's kernel (a plan per new prompt length; deepseek_flash/cuda.py)."""
        if self.device.type == "cuda":
            stack = contextlib.ExitStack()
            stack.enter_context(self.torch.cuda.device(self.device))
            stack.enter_context(sdpa_backends(self.device))
            return stack
        return contextlib.nullcontext()

    def generate_with_logits(self, *args, **kwargs):
        """(tokens, float32 logits of every step (batch, new, vocab)): a diagnostic for parity
        measurements; its graphs are captured for the call and dropped after it."""
        req = requests.parse(self.model, args, kwargs)
        if isinstance(req, requests.Fallback):
            raise ValueError(f"generate_with_logits: {req.reason}")
        self._check_capacity(req)
        with self._lock, self._on_device(), self.torch.inference_mode():
            st = self._state(batch_bucket(req.batch))
            st.logits = self.torch.zeros(st.batch, req.new_tokens, self.model.config.vocab_size,
                                         dtype=self.torch.float32, device=self.device)
            try:
                tokens = self._run(req)
            finally:
                logits = st.logits
                st.logits = None
                for key in [k for k in self.graphs if _records_logits(k[2])]:
                    del self.graphs[key]
        return tokens, logits[:req.batch, :tokens.shape[1] - req.prompt]

    def _check_capacity(self, req) -> None:
        if req.prompt + req.new_tokens > self.capacity:
            raise DecodeCapacityExceeded(
                f"prompt of {req.prompt} tokens + {req.new_tokens} new tokens exceeds the decode "
                f"capacity of {self.capacity} tokens (load_model(..., decode_capacity=N) or "
                f"decode.enable(model, capacity=N))", prompt=req.prompt, new_tokens=req.new_tokens,
                capacity=self.capacity)

    def stats(self) -> dict:
        return {"mode": self.mode, "capacity": self.capacity,
                "ring": self.ring.stats() if self.ring is not None else None, "attention": self.attention or "model's",
                "fused_norms": len(self.swaps.norms) if self.unsupported is None else 0,
                "step": "fused" if self.fused is not None else "modules",
                "fused_reason": self.fused_reason,
                "merged": self.fused.stats.as_dict() if self.fused is not None else None,
                "triton": kernels.BACKEND.reason if self.device.type == "cuda" else "cpu",
                "eager_reason": self.eager_reason,
                "unsupported": self.unsupported, "last_fallback": self.last_fallback,
                "graphs": len(self.graphs), "kv_bytes": self.store.nbytes if self.store else 0,
                "batch_rows": self.store.batch if self.store else 0, **self.counters}

    @property
    def mode(self) -> str:
        if self.unsupported is not None:
            return "transformers"
        return "eager" if self.eager_reason else "graphs"

    def reset(self) -> None:
        """Drop the cache and graphs (memory back to the allocator); the next call rebuilds them."""
        self.graphs.clear()
        self.states.clear()
        self.store = None
        # The caches' views hold the old buffers too: drop them before a larger cache is made (a
        # batch-8 cache was allocated while the batch-1 one still lived).
        self._caches = {}
        self._kv_rows = {}
        self.pool = None
        self.counters["graph_pool_bytes"] = 0

    # --- decode ----------------------------------------------------------------------------------
    def _run(self, req):
        torch = self.torch
        self._ensure_fused()
        bucket = batch_bucket(req.batch)
        st = self._state(bucket)
        sampling_kind = None if not req.do_sample else (req.top_k, req.top_p < 1.0)
        st.eos.fill_(-1)
        if req.eos:
            st.eos[:len(req.eos)] = torch.tensor(req.eos, dtype=torch.int64)
        st.pad.fill_(req.pad)
        st.temperature.fill_(req.temperature)
        st.top_p.fill_(req.top_p)
        # A graph keyed with ``suppress`` holds the eos rule; min_new 0 never needs it.
        suppress = req.min_new > 0
        st.min_new.fill_(req.min_new)
        st.eos_mask.zero_()
        eos_in_vocab = [e for e in req.eos if 0 <= e < st.eos_mask.numel()]
        if suppress and eos_in_vocab:
            st.eos_mask[eos_in_vocab] = True

        if st.logits is not None:
            sampling_kind = (sampling_kind, "logits")
        first = self._prefill(st, req, sampling_kind, suppress)
        b, prompt = req.batch, req.prompt
        st.tokens.fill_(req.pad)
        st.tokens[:b] = first
        st.valid_from.zero_()
        st.valid_from[:b] = req.valid_from
        st.finished.fill_(True)
        st.finished[:b] = is_eos(first, st.eos)
        st.out[:, 0] = st.tokens
        st.done[0] = st.finished.all()
        st.slot.fill_(prompt)
        st.step.fill_(1)

        steps = 1
        ring = self._ring_for_steps()
        if ring is not None:
            ring.enter()
        try:
            while steps < req.new_tokens:
                if req.eos and steps % CHECK_EVERY == 0 and bool(st.done[steps - 1]):
                    break
                visible = length_bucket(prompt + steps, self.capacity, self.length_step)
                self._advance(st, visible, sampling_kind, suppress)
                if ring is not None and self.fused is not None:
                    ring.count_step()
                steps += 1
        finally:
            if ring is not None:
                ring.exit()
        new = st.out[:b, :steps]
        if req.eos:
            done = st.done[:steps].nonzero()
            if done.numel():
                new = new[:, :int(done[0, 0]) + 1]
        return torch.cat([req.input_ids, new.to(req.input_ids.dtype)], dim=1)

    def _prefill(self, st, req, sampling_kind, suppress: bool = False):
        torch = self.torch
        b, prompt = req.batch, req.prompt
        cursor = self.cursor
        cursor.index = torch.arange(prompt, device=self.device)
        cursor.visible = length_bucket(prompt, self.capacity, self.length_step)
        cursor.length = 0
        cache = self.store.cache(b, cursor)
        valid_from = req.valid_from
        positions = (torch.arange(prompt, device=self.device)[None, :] - valid_from[:, None]).clamp(min=0)
        mask = self.masks.build(lambda w: prefill_allowed(prompt, cursor.visible, valid_from, w))
        logits = forward_last(self.model, self.cache_kw, req.input_ids, positions, mask, cache,
                              self.swaps)
        cursor.length = prompt
        if st.logits is not None:
            st.logits[:b, 0] = logits
        if suppress:
            logits = suppress_eos(logits, st, 0)
        return choose(logits, self._sampling(st, sampling_kind))

    def _ring_for_steps(self):
        """The static ring when decode steps run it (the fused step of a streamed model); the
        first time, its host side is made ready (offsets leased, pages locked) or the reason it
        cannot be captured is logged (the steps then run eagerly)."""
        if self.ring is None or self.fused is None:
            if self.ring is not None and self.eager_reason is None:
                self._to_eager(f"{STREAMED_REASON} ({self.fused_reason})")
            return None
        if not self._ring_checked:
            self._ring_checked = True
            reason = self.ring.host_ready()
            if reason is not None and self.eager_reason is None:
                self._to_eager(reason)
        return self.ring

    def _wait_loaded(self) -> None:
        if self.before_capture is not None:
            self.before_capture()
            self.before_capture = None

    def _ensure_fused(self) -> None:
        """Build the fused forward on the first call (after a load in flight has finished: merged
        copies need the bytes; the load's per-layer hooks are gone by then)."""
        if self.fused is not None or self.fused_reason is not None:
            return
        self._wait_loaded()
        hooked = fusion.hooked_module(self.model, self.hooks_ok)
        if hooked is not None:
            self.fused_reason = f"{hooked} (the fused step would not run them)"
            self._log_once(f"decode steps run transformers' modules: {self.fused_reason}")
            return
        if self.device.type == "cuda":
            config = self.model.config
            heads = config.num_attention_heads
            kernels.check_triton(self.device, self.model.dtype, dict(
                hidden=config.hidden_size, heads=heads,
                kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                intermediate=config.intermediate_size))
        # Merged matrices are ordinary tensors (usable outside inference mode afterwards).
        with self.torch.inference_mode(False), self.torch.no_grad():
            self.fused = fusion.FusedForward.build(self.model, self.ring)

    def _sampling(self, st, kind):
        if _records_logits(kind):
            kind = kind[0]
        if kind is None:
            return None
        top_k, use_top_p = kind
        return (st.temperature, top_k, st.top_p if use_top_p else None)

    def _step(self, st, visible: int, sampling_kind, suppress: bool = False) -> None:
        """One token for every row of the bucket: the function each graph captures."""
        torch = self.torch
        cursor = self.cursor
        cursor.index = st.slot
        cursor.visible = visible
        positions = (st.slot - st.valid_from).clamp(min=0)[:, None]
        build = lambda: self.masks.build(lambda w: decode_allowed(st.slot, visible, st.valid_from,  # noqa: E731
                                                                 st.key_slots, w))
        fused = self.fused is not None
        mask = build() if not fused or self.fused.uses_mask() else None
        logits = self._fused_logits(st, positions, mask, visible) if fused else None
        if logits is None:
            mask = build() if mask is None else mask
            logits = forward_last(self.model, self.cache_kw, st.tokens[:, None], positions, mask,
                                  self._caches[st.batch], self.swaps)
        if st.logits is not None:
            st.logits.index_copy_(1, st.step, logits[:, None])
        if suppress:
            logits = suppress_eos(logits, st, st.step)
        nxt = choose(logits, self._sampling(st, sampling_kind))
        nxt = torch.where(st.finished, st.pad, nxt)
        st.finished |= is_eos(nxt, st.eos)
        st.out.index_copy_(1, st.step, nxt[:, None])
        st.done.index_copy_(0, st.step, st.finished.all()[None])
        st.tokens.copy_(nxt)
        st.slot += 1
        st.step += 1

    def _fused_logits(self, st, positions, mask, visible: int):
        """The fused forward's logits; its first run is checked: should it raise (a kernel this
        device cannot run), the step falls back to transformers' modules for good, logged (the
        retry rewrites the same cache slot; a streamed model's hooks take the ring back)."""
        rows = self._kv_rows.get(st.batch)
        if rows is None:
            rows = self._kv_rows[st.batch] = ([k[:st.batch] for k in self.store.keys],
                                              [v[:st.batch] for v in self.store.values])
        if self._fused_ran:
            return self.fused(st.tokens, positions, mask, rows[0], rows[1], st.slot, visible,
                              st.valid_from, self.masks.windows)
        try:
            logits = self.fused(st.tokens, positions, mask, rows[0], rows[1], st.slot, visible,
                                st.valid_from, self.masks.windows)
        except _oom_error(self.torch):
            raise                  # memory, not the kernels: generate() falls back for this call
        except Exception as exc:   # noqa: BLE001 -- any failure: the modules' step, with the reason
            self.fused = None
            self.fused_reason = f"the fused step failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]
            self._log_once(f"decode steps run transformers' modules: {self.fused_reason}")
            if self.ring is not None:
                if self.device.type == "cuda":
                    self.torch.cuda.synchronize(self.device)
                self.ring.exit()
                if self.eager_reason is None:   # the ring's hooks issue copies from Python
                    self._to_eager(f"{STREAMED_REASON} ({self.fused_reason})")
            return None
        self._fused_ran = True
        return logits

    def _advance(self, st, visible: int, sampling_kind, suppress: bool = False) -> None:
        if self.eager_reason is None:
            graph = self.graphs.get((st.batch, visible, sampling_kind, suppress))
            if graph is None:
                graph = self._capture(st, visible, sampling_kind, suppress)
            if graph is not None:
                graph.replay()
                self.counters["replays"] += 1
                return
        self._step(st, visible, sampling_kind, suppress)
        self.counters["eager_steps"] += 1

    # --- capture ---------------------------------------------------------------------------------
    def _capture(self, st, visible: int, sampling_kind, suppress: bool = False):
        torch = self.torch
        reason = self._capture_blocker()
        if reason is not None:
            self._to_eager(reason)
            return None
        self._wait_loaded()
        t0 = time.perf_counter()
        saved = st.snapshot()
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(st, visible, sampling_kind, suppress)
        torch.cuda.current_stream(self.device).wait_stream(side)
        st.restore(saved)
        if self.eager_reason is not None:      # the warm-up fell back (the fused step failed)
            return None
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # The collector must not run inside the capture: a cycle it frees there may hold CUDA
        # resources whose release is illegal while capturing (seen: an abort in the GPU suite).
        # thread_local: CUDA calls of the process's other threads (a controller's copy threads)
        # neither join nor invalidate this capture.
        gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        # torch.cuda.graph empties the allocator's cache as it starts: empty it first, so reserved
        # memory after the capture less before is what the capture took into the graphs' pool
        # (which nothing but the graphs uses, and which stays reserved while they live).
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._step(st, visible, sampling_kind, suppress)
        except Exception as exc:   # noqa: BLE001 -- any capture failure means: run eagerly, say why
            torch.cuda.synchronize(self.device)
            st.restore(saved)
            self._to_eager(f"capture failed: {type(exc).__name__}: {exc}".splitlines()[0][:300])
            return None
        finally:
            if gc_was_enabled:
                gc.enable()
        st.restore(saved)
        self.graphs[(st.batch, visible, sampling_kind, suppress)] = graph
        self.counters["captures"] += 1
        self.counters["capture_s"] += time.perf_counter() - t0
        self.counters["graph_pool_bytes"] += torch.cuda.memory_reserved(self.device) - reserved
        return graph

    def _capture_blocker(self) -> str | None:
        """A reason the step cannot be captured faithfully (None: it can)."""
        return capture_blocker(self.model, self.hooks_ok)

    def _to_eager(self, reason: str) -> None:
        self.eager_reason = reason
        self.graphs.clear()
        self._log_once(f"decode steps run eagerly over the static cache: {reason}")

    # --- buffers ---------------------------------------------------------------------------------
    def _state(self, bucket: int) -> StepState:
        if self.store is None or self.store.batch < bucket:
            if self.store is not None:
                log.info("decode cache grows from %d to %d rows; graphs are captured again",
                         self.store.batch, bucket)
            self.reset()
            config = self.model.config
            heads = config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            self.store = KVStore(config.num_hidden_layers, bucket, kv_heads, self.capacity, head_dim,
                                 self.model.dtype, self.device)
            self._caches = {}
            self._kv_rows = {}
        st = self.states.get(bucket)
        if st is None:
            head = self.model.get_output_embeddings()
            vocab = getattr(head, "out_features", None) or self.model.config.vocab_size
            st = self.states[bucket] = StepState(bucket, self.capacity, vocab, self.device, self.torch)
            self._caches[bucket] = self.store.cache(bucket, self.cursor)
        return st

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.warning(message)


def capture_blocker(model, hooks_ok=()) -> str | None:
    """Why a CUDA graph of ``model``'s forward would not do what the forward does (None: it
    would): forward hooks (a graph runs them once, at capture), other than those of the modules
    whose ids are in ``hooks_ok``."""
    hooked = fusion.hooked_module(model, hooks_ok)
    return None if hooked is None else f"{hooked} (a graph would run them once)"


def enable(model, capacity: int | None = None, graphs: bool = True, **options) -> GraphDecoder:
    """Give ``model`` a ``generate`` that decodes with a static cache and CUDA graphs; returns the
    decoder (also ``model.flash_decoder``). ``capacity``: tokens per sequence, prompt + new."""
    decoder = GraphDecoder(model, capacity=capacity, graphs=graphs, **options)
    model.generate = decoder.generate
    model.flash_decoder = decoder
    if decoder.unsupported is not None:
        decoder._log_once(f"decoding through transformers' generate(): {decoder.unsupported}")
    elif decoder.eager_reason is not None:
        decoder._log_once(f"decode steps run eagerly over the static cache: {decoder.eager_reason}")
    return decoder


from ..client.model import DECODE_MODES  # noqa: E402 -- one list, checked by load_model too
STREAMED_REASON = "streamed layers need the fused step to run the slot ring's copies in the graph"


def check_mode(mode: str) -> None:
    from ..errors import ConfigError

    if mode not in DECODE_MODES:
        raise ConfigError(f"decode: {mode!r} is not one of {', '.join(DECODE_MODES)}", key="decode",
                          value=mode, allowed=list(DECODE_MODES))


def for_loaded_model(model, handle, mode: str, capacity: int | None) -> GraphDecoder | None:
    """``load_model``'s hook: ``mode`` ``"eager"`` leaves transformers' ``generate``; ``"graphs"``
    installs a ``GraphDecoder`` that first waits for a load still in flight (the gates' hooks
    remove themselves once every layer is there, so nothing per layer is left to capture);
    ``"auto"``: ``"graphs"`` on a CUDA device, ``"eager"`` elsewhere."""
    check_mode(mode)
    if mode == "auto":
        mode = "graphs" if handle.device.type == "cuda" else "eager"
    if mode == "eager":
        return None

    # A streamed model: decode steps run the ring's copies as a fixed schedule (``StaticRing``)
    # in place of its per-layer hooks, so they are captured with the step.
    ring = handle.stream.static_ring() if handle.stream is not None else None
    decoder = enable(model, capacity=capacity, before_capture=handle.wait_loaded, ring=ring)
    handle.decoder = decoder
    return decoder
