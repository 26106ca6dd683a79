"""Continuous batching over a ``transformers`` causal LM: requests join and leave at step boundaries.

One engine thread runs *steps*. At each step boundary it drops cancelled requests (their rows are
free at once), asks the scheduler which queued requests join, gives each newcomer a free row of the
shared KV cache and prefills one chunk of its prompt (``prefill_chunk`` tokens, so a long prompt
never holds the batch back by more than one chunk), then runs **one batched decode** over every row
that has a token to feed, samples, and retires the rows that finished. A long request therefore
delays a short one by at most one step.

An L0 request does not wait for a whole step: arriving during an eager forward it cuts in between
two of its layers (``_l0_cut_in``), arriving during a graph forward its prompt runs beside it on a
second CUDA stream (``beside.L0Beside``, which may preempt a row that forward writes).

This module decides what runs when and keeps the books (rows, scheduler, statistics, responses);
the forwards over the shared KV cache and the sampling are ``runner``'s, the L0-beside path
``beside``'s, a request's tokens-to-text ``generation``'s.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

from ..errors import FlashError
from .beside import L0Beside
from .generation import Generation
from .runner import RowRunner
from .scheduler import FlashScheduler, Route

log = logging.getLogger("deepseek_flash.serve")

# Added to the model's read priority (``--read-priority``) for the reads a forward causes, by the
# highest class among its rows: an L0 request's layers go to the disk before another model's
# load and before the reads of L1/L2 forwards; L2 yields to everyone.
READ_PRIORITY_BY_CLASS = {"L0": 1, "L1": 0, "L2": -1}

# The interpreter's switch interval while an engine runs (CPython's default: 5 ms). The engine
# thread and the event loop share one interpreter lock; a thread that wants it back from a busy
# holder -- the engine after each forward's wait on the device, the event loop to read a new
# request or write a token -- waits up to this long, and an L0 request's first token meets
# several such hand-offs on its way.
SWITCH_INTERVAL_S = 0.0005


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


class Engine:
    """The batching loop over ``model`` (a ``load_model`` model or any HF causal LM)."""

    def __init__(self, model, tokenizer, scheduler: FlashScheduler | None = None, *, max_batch: int = 8,
                 max_model_len: int | None = None, prefill_chunk: int = 512, device=None,
                 warm: bool | None = None, decode: str = "auto", switch_interval_s: float | None = SWITCH_INTERVAL_S):
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
        # The batch's decode: CUDA graphs where they can be captured (``RowRunner(decode=)``).
        self.runner = RowRunner(model, self.max_batch, self.max_model_len, device, decode=decode,
                                prefill_chunk=self.prefill_chunk)
        self.eos_ids = frozenset(self._eos_ids(model))
        self.flash = getattr(model, "flash", None)
        self.stream = getattr(self.flash, "stream", None)
        self.read_base = int(getattr(self.flash, "priority", 0) or 0)
        # Every attention width met at start-up (``RowRunner.warm``): by default on a CUDA device,
        # where a shape's first forward costs hundreds of milliseconds, when the weights are resident
        # (a streamed model's forward streams every layer: the sweep would cost a start-up of
        # minutes for a large model).
        self.warm = (self.runner.device.type == "cuda" and self.stream is None) if warm is None else bool(warm)
        self.warm_s: float | None = None
        # The interpreter's switch interval while the engine runs (``start``; None: left as is).
        self.switch_interval_s = switch_interval_s
        self._saved_switch: float | None = None
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
        self._cutting = False                   # an L0 prefill nested in another forward runs
        self._outer: list = []                  # the requests of the forward it is nested in
        # An L0 request may cut into other prompts' chunk between two layers (``_l0_cut_in``).
        self.cut_in = (not self.scheduler.fifo and self.stream is None
                       and getattr(getattr(model, "model", None), "layers", None) is not None)
        self.l0_recent_s = 10.0
        # An L0 request arriving during a graph forward of the batch is prefilled beside it
        # (``beside``: not with the scheduler off, nor for a streamed model).
        self.l0_beside = L0Beside(self, enabled=not self.scheduler.fifo and self.stream is None)
        self._dropped: set = set()              # requests preempted during this step
        if self.scheduler.gpu_busy is None:
            self.scheduler.gpu_busy = self.utilisation
        self.stats = {"steps": 0, "decode_steps": 0, "prefill_chunks": 0, "prompt_tokens": 0,
                      "generated_tokens": 0, "finished": 0, "prefill_forwards": 0, "cancelled": 0, "failed": 0,
                      "preempted": 0, "l2_open_steps": 0, "l0_beside": 0, "l0_beside_concurrent": 0,
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
        """Warm the runner (``warm``), move what start-up made out of the garbage collector's
        sight (``gc.freeze``: the model's and the server's long-lived objects are never scanned
        again, so a collection under load walks only what requests made), then run the thread."""
        import gc

        if self.warm and self.warm_s is None:
            # Frozen first too: each CUDA graph capture of the warm-up starts with a collection.
            gc.collect()
            gc.freeze()
            self.warm_s = self.runner.warm(self.prefill_chunk)
            log.info("engine warm: %d attention widths in %.2f s, decode %s", len(self.runner.kv_seen),
                     self.warm_s, self.runner.decode_stats())
        gc.collect()
        gc.freeze()
        if self.switch_interval_s is not None and self._saved_switch is None:
            self._saved_switch = sys.getswitchinterval()
            sys.setswitchinterval(min(self._saved_switch, self.switch_interval_s))
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
        self.l0_beside.close()
        if self._saved_switch is not None:
            sys.setswitchinterval(self._saved_switch)
            self._saved_switch = None

    def _run(self) -> None:
        import torch

        with torch.inference_mode():
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
        self._join()

    def _join(self, protect=()) -> None:
        """The requests the scheduler lets join now take their rows; those it preempts for them
        (none of ``protect``) leave theirs (lock held)."""
        # (``FifoScheduler.dispatch`` takes no ``protect``: it never preempts.)
        chosen = self.scheduler.dispatch(protect=protect) if protect else self.scheduler.dispatch()
        for req in self.scheduler.take_preempted():
            self._preempt(self._gens[id(req)])
        self._admit(chosen)

    def l0_recent(self) -> bool:
        """Whether an L0 request arrived in the last ``l0_recent_s`` seconds."""
        return self._l0_at is not None and time.monotonic() - self._l0_at < self.l0_recent_s

    def _admit(self, chosen) -> None:
        """Give each request the scheduler chose a free row (lock held)."""
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
                    gen.kv_cache = self.runner.tiered_cache(gen.kv_options)
                except Exception as exc:   # noqa: BLE001 -- the request fails typed, the batch runs on
                    self._retire(gen, None, exc if isinstance(exc, FlashError)
                                 else FlashError(f"tiered KV cache: {exc}"))

    def _preempt(self, gen: Generation) -> None:
        """``gen`` gave its row to an L0 request (lock held): it waits in the queue and goes on
        where it was when it joins again (``Generation.rewind``)."""
        if gen.row is not None and self._rows[gen.row] is gen:
            self._rows[gen.row] = None
        gen.rewind()
        self._dropped.add(id(gen))              # a token the step in flight makes for it is dropped
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
    def _solo_step(self, gen: Generation) -> None:
        """One forward of a request on its own tiered cache: its whole prompt, or its last token."""
        if gen.prefilled < len(gen.prompt_ids):
            chunk = gen.prompt_ids[gen.prefilled:]
        else:
            chunk = gen.output_ids[-1:]
        self._read_priority([gen])
        token = self.runner.sample(self.runner.solo(gen.kv_cache, chunk), [gen])[0]
        if gen.prefilled < len(gen.prompt_ids):
            gen.prefilled = len(gen.prompt_ids)
            self.stats["prefill_chunks"] += 1
            self.stats["prompt_tokens"] += len(chunk)
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

    @staticmethod
    def _prefill_shape(group) -> tuple:
        """(tokens per row, key positions read) of the forward ``_prefill`` makes of ``group``."""
        width = max(n for _, n in group)
        return width, max(g.prefilled + n for g, n in group) + (1 if any(n < width for _, n in group) else 0)

    def _prefill(self, group, l0: bool = False, meanwhile=None) -> None:
        """One forward over ``group`` -- (generation, tokens) pairs: the next ``tokens`` of each
        prompt. Rows are left-padded to the longest chunk, so the last position is every row's last
        real token; padding writes its keys at the row's next position (``end``), which no real
        query of this forward reads and the row's next forward overwrites before reading it. A
        prompt whose last chunk this is gets its first token now, before the batch's decode."""
        ids, pos, kv_len = self._prefill_inputs(group)
        logits, spent = self.runner.prefill([g.row for g, _ in group], ids, pos, kv_len, l0=l0, meanwhile=meanwhile)
        self._prefilled(group, logits, spent)

    def _prefill_inputs(self, group) -> tuple:
        """(token ids, positions, key positions read) of the forward over ``group`` (``_prefill``),
        with the read priority of its most urgent request set."""
        width, kv_len = self._prefill_shape(group)
        ids, pos = [], []
        for gen, n in group:
            start = gen.prefilled
            end = start + n
            ids.append([0] * (width - n) + gen.fill_ids[start:end])
            pos.append([end] * (width - n) + list(range(start, end)))
        self._read_priority([g for g, _ in group])
        return ids, pos, kv_len

    def _prefilled(self, group, logits, spent: float) -> None:
        """The books after the forward over ``group`` (``_prefill``) gave ``logits`` in ``spent``
        seconds: prompts advanced, the first token of each prompt it finished."""
        width = max(n for _, n in group)
        # What a prompt token adds to a forward: the time beyond a decode forward's, per token.
        cost = max(0.0, spent - (self._decode_s or 0.0)) / (len(group) * width)
        self._per_token_s = cost if self._per_token_s is None else 0.8 * self._per_token_s + 0.2 * cost
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
            rows = logits if len(done) == len(logits) else logits[done]   # no index copy when all are done
            tokens = self.runner.sample(rows, [group[i][0] for i in done])
            now = time.monotonic()
            with self._lock:
                for i, token in zip(done, tokens):
                    gen = group[i][0]
                    if not gen.cancelled:
                        self._accept(gen, token, now)

    def _l0_cut_in(self, module, args) -> None:
        """Forward pre-hook on every decoder layer while a chunk of other prompts (or an eager
        decode) runs: an L0 request that arrived meanwhile joins and its prompt is prefilled now,
        in a forward of its own nested between two layers of the other one -- it waits for one
        layer, not for the whole forward. Its row is a free one, or that of a request it preempts,
        never one of the requests this forward still writes (``_outer``); where neither exists it
        joins at the next step boundary as before."""
        if self._cutting:
            return
        with self._lock:
            if not self.scheduler.queued_count("L0"):
                return
            self._join(self._outer)
        self._cutting = True
        try:
            with self.runner.nested():
                self._prefill_l0()
        finally:
            self._cutting = False

    def _cut_in_hooks(self, outer=()):
        """``_l0_cut_in`` on every decoder layer for the duration of a ``with`` (not with the
        scheduler off, nor for a streamed model, whose layer ring one forward at a time drives)."""
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        if not self.cut_in or layers is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        self._outer = [g.sched for g in outer]
        stack.callback(setattr, self, "_outer", [])
        for layer in layers:
            stack.callback(layer.register_forward_pre_hook(self._l0_cut_in).remove)
        return stack

    def _l0_group(self) -> list:
        """The L0 prompts in the batch with tokens left to prefill, one chunk each (lock held)."""
        return [(g, min(self.prefill_chunk, len(g.fill_ids) - g.prefilled)) for g in self._rows
                if g is not None and g.sched.priority_class == "L0" and g.prefilled < len(g.fill_ids)
                and not g.cancelled and g.kv_cache is None]

    def _prefill_l0(self) -> None:
        """Every L0 prompt in the batch, one chunk each, in one forward of their own -- before any
        other prefill or the decode of this step."""
        with self._lock:
            group = self._l0_group()
        if group:
            self._prefill(group, l0=True)

    def _queued_l0_need(self) -> int:
        """The cache slots the longest queued L0 prompt (and its padding) writes (lock held)."""
        return max((len(g.fill_ids) for g in self._gens.values() if g.row is None
                    and g.sched.priority_class == "L0"), default=0) + 1

    def _step(self) -> None:
        """One step: L0 prompts, then at most ``prefill_chunk`` tokens of the other prompts (in the
        order they joined, packed into one forward), then -- after letting in an L0 request that
        arrived meanwhile, and prefilling it -- one batched decode over every row with a token to
        feed. An L0 request therefore waits for at most one forward of bounded size before its
        own prefill, whatever the batch holds."""
        with self._lock:
            batch = [g for g in self._rows if g is not None]
            self._dropped = set()
        self._apply_window(batch)
        self._prefill_l0()
        l0_recent = self.l0_recent()
        # Where an L0 request can cut in, it waits for one layer of the chunk, whatever its size.
        budget = prefill_budget(self.prefill_chunk, self._decode_s, self._per_token_s,
                                l0_recent and not self.cut_in)
        # While L0 traffic is recent, other prompts go in forwards a prompt graph runs, so that an
        # L0 request arriving meanwhile goes beside the forward instead of waiting for a layer of
        # an eager one (tens of milliseconds of the interpreter's time on a GPU): a long prompt --
        # or a preempted request re-filling its prompt and output -- in chunks of the widest
        # graph's width, each covered at any attention width (``StaticPrefill(deep=True)``).
        graphs = self.runner.static_prefill if l0_recent and self.l0_beside.enabled else None
        if graphs is not None:
            budget = min(budget, graphs.widest())
        # Packed in join order while rows x the widest chunk stays within the budget (padding is
        # compute too) -- and, with ``graphs``, while a graph has the forward's shape; the first
        # prompt in line always gets its share.
        group, width = [], 0
        for gen in sorted((g for g in batch if g.sched.priority_class != "L0" and not g.cancelled
                           and g.kv_cache is None and g.row is not None and g.prefilled < len(g.fill_ids)),
                          key=lambda g: (g.sched.started, g.sched.seq)):
            need = len(gen.fill_ids) - gen.prefilled
            n = min(need, budget) if not group else min(need, max(width, budget // (len(group) + 1)))
            if group and (len(group) + 1) * max(width, n) > budget:
                break
            if group and graphs is not None and not graphs.covers(len(group) + 1,
                                                                  *self._prefill_shape(group + [(gen, n)])):
                break
            group.append((gen, n))
            width = max(width, n)
        if group:
            # An L0 request arriving meanwhile cuts in between two layers (eager), or goes beside
            # the forward (a graph).
            with self._cut_in_hooks([g for g, _ in group]):
                self._prefill(group, meanwhile=self.l0_beside.meanwhile([g for g, _ in group]))
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
            self._read_priority(decoding)
            # An eager decode (no CUDA graphs here) lets an L0 request cut in between its layers too.
            with self._cut_in_hooks(decoding) if self.runner.static is None else contextlib.nullcontext():
                positions = [len(g.prompt_ids) + len(g.output_ids) - 1 for g in decoding]
                # With L0 traffic, an L0 request arriving meanwhile is prefilled beside the decode.
                tokens, spent = self.runner.decode(
                    decoding, [g.row for g in decoding], [g.output_ids[-1] for g in decoding], positions,
                    meanwhile=self.l0_beside.meanwhile(decoding, dict(zip(map(id, decoding), positions))))
            produced = list(zip(decoding, tokens))
            self._decode_s = spent if self._decode_s is None else 0.8 * self._decode_s + 0.2 * spent
            self.stats["decode_steps"] += 1
            self.stats["batch_rows_sum"] += len(decoding)
        else:
            produced = []
        self.stats["steps"] += 1
        now = time.monotonic()
        with self._lock:
            for gen, token in produced:
                if not gen.cancelled and id(gen) not in self._dropped:
                    self._accept(gen, token, now)
            self.scheduler.tick()
            # Steps after which L2's rule lets an elastic request join (``FlashScheduler.l2_open``).
            self.stats["l2_open_steps"] += bool(self.scheduler.l2_open())

    def _accept(self, gen: Generation, token: int, now: float) -> None:
        """``token`` is ``gen``'s next: count it, hand it to the request, retire the request when it
        is done (lock held)."""
        if gen.first_token_at is None:
            gen.first_token_at = now
            self.stats["ttft_ms"][gen.sched.priority_class].append((now - gen.sched.arrival) * 1e3)
            del self.stats["ttft_ms"][gen.sched.priority_class][:-4096]
        before = len(gen.output_ids)
        reason = gen.take(token, self.eos_ids, self.max_model_len, self.tokenizer)
        self.stats["generated_tokens"] += len(gen.output_ids) - before
        if reason is not None:
            self._retire(gen, reason)

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
            stats["kv"] = {"tokens": tokens, "cache": "rows", "bytes": tokens * self.runner.cache.bytes_per_token}
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

