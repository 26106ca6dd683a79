"""Where a block is read into the host tier: reads in chunks, by priority, one completion thread.

``submit_locked`` takes the blocks that ``leases`` allocated, in file order (a cold load is one
sequential sweep; crc32c is checked by the engine as each extent lands), cut into chunks of about
``chunk_bytes``. Chunks wait in the pipeline's own queue -- highest ``priority`` first, then
arrival -- and are handed to the ``IOEngine`` only while less than ``inflight_bytes`` is in it. The
engine serves what it was given in submission order, so without this an urgent acquire (an L0
request's layers) would queue behind all of another model's cold load; with it, behind at most
``inflight_bytes`` (a few times the engine's own queue, so the disk stays busy).

While a client says it is importing (``attach`` with ``importing``: a fresh process building
its model class, thousands of small file reads that wait behind every read the load keeps queued
on the same disk), the engine reads at ``SHALLOW_SHAPE``, one 4 MiB read at a time as ``dd`` does;
``imports_done``, that client's disconnect or detach, or ``SHALLOW_MAX_S`` bring its full depth
back (``hold_shallow``/``end_shallow``; docs/benchmarks.md has the measurements behind it). A client
whose module's files the daemon read ahead at start (``imports_ahead``: the learned manifest) holds
nothing: its imports find their files in the page cache, so the load reads at full depth from the
request on (``imports_read_ahead`` lifts the holds of clients that attached while it still read).

A block of a model quantized as it enters the host tier (``quant.host_tier``) is read from its
source block into a staging buffer (crc32c-checked against the source); the completion thread
hands such a batch to the ``flash-quantize`` thread, which transcodes the blocks into their arena
regions outside the lock and then completes the batch -- so seconds of quantization never hold up
the completion of other reads.

The completion thread waits on the engine with the GIL released, turns each completion into
success or a typed error, and under the lock marks blocks resident or hands failures to the
recovery policy (``read_errors``), then hands the engine the next chunks; futures are resolved
outside the lock, so the server's done-callback (its wake-up) never runs under it.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import mmap
import queue
import threading
import time

from ..errors import FlashError, FlashIOError, StoreTruncated, UnknownClient
from ..io import error_of
from .host_state import RESIDENT, BlockState, HostState, Ticket, resolve_futures

log = logging.getLogger("deepseek_flash.block_manager")


# Reads are handed to the engine in chunks of about this many bytes (at least one block each).
CHUNK_BYTES = 8 << 20
RETRY_PRIORITY = 1 << 30
# The engine's shape while a client imports: one 4 MiB read in flight (dd's), and for how long at
# most one client's word keeps it there (a client that never says it is done).
SHALLOW_SHAPE = (1, 4 << 20)
SHALLOW_MAX_S = 60.0


class ReadPipeline:
    """Submits block reads and completes them on its own thread (``flash-io-completion``)."""

    def __init__(self, state: HostState, residency, recovery, telemetry, chunk_bytes: int = CHUNK_BYTES,
                 inflight_bytes: int | None = None):
        self.s = state
        self.residency = residency
        self.recovery = recovery
        self.telemetry = telemetry
        self.chunk_bytes = chunk_bytes
        if inflight_bytes is None:
            engine = state.engine
            queued = getattr(engine, "queue_depth", 32) * getattr(engine, "request_size", 1 << 20)
            inflight_bytes = max(2 * chunk_bytes, 4 * queued)
        self.inflight_bytes = inflight_bytes
        self.inflight = 0                    # bytes handed to the engine and not yet completed
        self._waiting: list = []             # heap of (-priority, seq, tokens, requests, bytes)
        self._seq = itertools.count()
        self._batches: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._completion_loop, name="flash-io-completion",
                                        daemon=True)
        self._thread.start()
        self._transcodes: queue.Queue = queue.Queue()
        self._transcoder: threading.Thread | None = None   # started by the first staged batch
        self.shallow = state.shallow          # client -> (since, until, module), monotonic
        self._outside: dict[int, tuple] = {}  # token -> (callback, BlockInfo, model) of read_outside
        shape = getattr(state.engine, "shape", None)
        self.full_shape = tuple(shape) if shape is not None else None

    # --- the read shape while a client imports -------------------------------------------------
    def hold_shallow(self, client_id: int, max_s: float = SHALLOW_MAX_S,
                     module: str | None = None) -> None:
        """Read at ``SHALLOW_SHAPE`` until ``end_shallow(client_id)`` or ``max_s`` seconds --
        unless ``module`` (what the client imports) had its files read ahead (``warm_imports``)."""
        with self.s.lock:
            now = time.monotonic()
            since = self.shallow.get(client_id, (now, 0.0, None))[0]
            self.shallow[client_id] = (since, now + max_s, module)
            warm = "" if client_id in self.s.shallow_holders() else " (its files read ahead)"
            self._reshape_locked(f"client {client_id} imports {module or 'its model class'}{warm}")

    def imports_read_ahead(self, modules) -> None:
        """The files of ``modules``' imports are in the page cache (read ahead at start): a
        client importing one of them no longer keeps the reads shallow."""
        with self.s.lock:
            now = time.monotonic()
            for module in modules:
                self.s.warm_at.setdefault(module, now)
            self.s.warm_imports = self.s.warm_imports | frozenset(modules)
            self._reshape_locked("import files read ahead for " + ", ".join(sorted(modules))[:200])

    def end_shallow(self, client_id: int, why: str = "its imports are done") -> float | None:
        """Client ``client_id`` no longer needs shallow reads: the seconds it held them (None when
        it held none) -- up to when its module's files were read ahead, if they were meanwhile (0
        when they were before); full depth again once no client holds them."""
        with self.s.lock:
            held = self.shallow.pop(client_id, None)
            if held is None:
                return None
            now = time.monotonic()
            warm = [self.s.warm_at[m] for m in (held[2], "*") if m in self.s.warm_at]
            seconds = max(0.0, min([now, *warm]) - held[0])
            self._reshape_locked(f"client {client_id}: {why} after {seconds:.2f} s")
            return seconds

    def _expire_shallow_locked(self) -> None:
        if not self.shallow:
            return
        now = time.monotonic()
        for cid, (since, until, _) in list(self.shallow.items()):
            if now >= until:
                del self.shallow[cid]
                self._reshape_locked(f"client {cid} held shallow reads for {now - since:.0f} s, "
                                     f"the most one client may")

    def _reshape_locked(self, why: str) -> None:
        engine = self.s.engine
        if self.full_shape is None or not hasattr(engine, "set_shape"):
            return
        holders = self.s.shallow_holders()
        want = SHALLOW_SHAPE if holders else self.full_shape
        want = (min(want[0], self.full_shape[0]), want[1])
        if tuple(engine.shape) != want:
            try:
                engine.set_shape(*want)
            except FlashError as exc:   # a closed engine: nothing more will be read anyway
                log.debug("read shape %s not set: %s", want, exc)
                return
        log.info("reads at %d x %d KiB (%d clients importing): %s", want[0], want[1] >> 10,
                 len(holders), why)

    def close(self) -> None:
        """Stop the completion thread once every read asked for has finished (the waiting chunks
        go to the engine now, so no acquire or load is left without an answer)."""
        with self.s.lock:
            self.inflight_bytes = float("inf")
            self._pump_locked()
        self._batches.put(None)
        self._thread.join()
        if self._transcoder is not None:
            self._transcodes.put(None)
            self._transcoder.join()

    def submit_locked(self, blocks, client_id: int | None = None, priority: int = 0) -> None:
        """Read ``blocks`` on behalf of ``client_id`` (None: a retry, which keeps the block's
        original requester), before any waiting read of a lower ``priority``."""
        if not blocks:
            return
        from .._core import ReadRequest

        s = self.s
        if client_id is not None:
            client = s.clients.get(client_id)
            requester = (client_id, client.info.get("pid") if client is not None else None)
        now = time.monotonic_ns()

        # Forward (file) order turns a cold load into one sequential sweep.
        blocks = sorted(blocks, key=lambda b: (b.model.path, b.info.file, b.info.offset))
        requests = []
        for b in blocks:
            token = next(s.token_ids)
            b.token = token
            b.submitted_ns = now
            if client_id is not None:
                b.requester = requester
            s.tokens[token] = b
            source = _source_block(b)
            if source is None:
                info, dest = b.info, s.arena.view(b.offset, b.info.length)
            else:
                info = source
                b.staging = dest = mmap.mmap(-1, max(source.length, 1))   # page-aligned
            requests.append(ReadRequest(path=str(b.model.store.data_path(info)), offset=info.offset,
                                        length=info.length, dest=dest, dest_offset=0,
                                        block_id=token, expected_crc=info.crc32c))
        self._queue_locked(requests, priority)

    def _queue_locked(self, requests, priority: int) -> None:
        """Queue ``requests`` (their ``block_id`` the token each completion is matched by) in
        chunks of about ``chunk_bytes``, in their order, before any waiting read of a lower
        ``priority``; then start what the engine has room for."""
        chunk, size = [], 0
        for request in requests:
            chunk.append(request)
            size += request.length
            if size >= self.chunk_bytes:
                self._push_locked(chunk, size, priority)
                chunk, size = [], 0
        if chunk:
            self._push_locked(chunk, size, priority)
        self._pump_locked()

    def _push_locked(self, chunk, size: int, priority: int) -> None:
        tokens = [request.block_id for request in chunk]
        heapq.heappush(self._waiting, (-priority, next(self._seq), tokens, chunk, size))

    def read_outside(self, model: str, reads, priority: int = 0) -> bool:
        """``read_outside_locked`` for an open model's name; False (nothing read) where the host
        tier would not read it from disk as it is: a model whose device is gone (host only) or one
        quantized as it enters the host tier."""
        with self.s.lock:
            m = self.s.model(model)
            if m.host_only or getattr(m.store, "source_block", None) is not None:
                return False
            self.read_outside_locked(m, reads, priority)
            return True

    def read_outside_locked(self, model, reads, priority: int = 0) -> None:
        """Read blocks of ``model`` (a ``ModelState``) into memory outside the host arena: ``reads``
        is ``[(BlockInfo, dest, callback)]``, in the order to read them; each ``callback(error)``
        (None: the block's exact bytes are in ``dest``, crc32c checked) runs on the completion
        thread outside the lock. They queue with the host tier's reads (same priority order, same
        engine shape) and count in ``bytes_read_nvme``; the host tier's books are not touched
        (``daemon.staging``: the read-ahead beyond the arena while CUDA starts)."""
        from .._core import ReadRequest

        requests = []
        for info, dest, callback in reads:
            token = next(self.s.token_ids)
            self._outside[token] = (callback, info, model.name)
            requests.append(ReadRequest(path=str(model.store.data_path(info)), offset=info.offset,
                                        length=info.length, dest=dest, dest_offset=0,
                                        block_id=token, expected_crc=info.crc32c))
        self._queue_locked(requests, priority)

    def promote_locked(self, blocks, priority: int) -> int:
        """Reads of ``blocks`` still waiting in the pipeline at a lower priority move up to
        ``priority`` (a chunk of their own; the rest of their chunk keeps its place), so an urgent
        acquire of blocks that a prefetch hint or another load queued earlier does not wait behind
        what was queued before them. Reads already handed to the engine are left alone. Returns how
        many reads moved."""
        tokens = {b.token for b in blocks if getattr(b, "token", None) is not None}
        if not tokens or not self._waiting:
            return 0
        moved, kept = [], []
        for neg, seq, toks, reqs, size in self._waiting:
            if -neg >= priority or tokens.isdisjoint(toks):
                kept.append((neg, seq, toks, reqs, size))
                continue
            rest = [(t, r) for t, r in zip(toks, reqs) if t not in tokens]
            urgent = [(t, r) for t, r in zip(toks, reqs) if t in tokens]
            if rest:
                kept.append((neg, seq, [t for t, _ in rest], [r for _, r in rest], sum(r.length for _, r in rest)))
            moved.extend(urgent)
        if not moved:
            return 0
        # File order within the promoted chunk, as submit_locked makes it.
        moved.sort(key=lambda tr: (tr[1].path, tr[1].offset))
        kept.append((-priority, next(self._seq), [t for t, _ in moved], [r for _, r in moved],
                     sum(r.length for _, r in moved)))
        heapq.heapify(kept)
        self._waiting = kept
        self._pump_locked()
        return len(moved)

    def _pump_locked(self) -> None:
        """Hand the engine the most urgent waiting chunks while it holds less than ``inflight_bytes``
        (always at least one chunk, however large)."""
        self._expire_shallow_locked()
        while self._waiting and (self.inflight == 0
                                 or self.inflight + self._waiting[0][4] <= self.inflight_bytes):
            _, _, tokens, requests, size = heapq.heappop(self._waiting)
            try:
                batch = self.s.engine.submit(requests)
            except FlashError as exc:
                self._batches.put(("failed", tokens, exc, 0))
                continue
            self.inflight += size
            self._batches.put((batch, tokens, None, size))

    def _completion_loop(self) -> None:
        engine = self.s.engine
        while True:
            item = self._batches.get()
            if item is None:
                return
            batch, tokens, error, size = item
            results: dict[int, FlashError | None] = {}
            if error is None:
                try:
                    completions = engine.wait(batch)
                except FlashError as exc:
                    error = exc
                except Exception as exc:  # noqa: BLE001 -- never leave the batch's waiters hanging
                    error = FlashIOError(f"IO engine failed waiting for batch {batch}: {exc!r}",
                                         errno=0, path="", offset=-1, block_id=-1)
                else:
                    for c in completions:
                        results[c.block_id] = results.get(c.block_id) or self._error_of(c)
            if any(getattr(self.s.tokens.get(t), "staging", None) is not None for t in tokens):
                if self._transcoder is None:
                    self._transcoder = threading.Thread(target=self._transcode_loop,
                                                        name="flash-quantize", daemon=True)
                    self._transcoder.start()
                self._transcodes.put((batch, tokens, results, error, size))
                continue
            try:
                self._complete(tokens, results, error, size)
            except Exception:  # a bug here must not kill the only completion thread
                log.exception("completing IO batch %s failed", batch)

    def _transcode_loop(self) -> None:
        while True:
            item = self._transcodes.get()
            if item is None:
                return
            batch, tokens, results, error, size = item
            try:
                self._transcode(tokens, results, error)
                self._complete(tokens, results, error, size)
            except Exception:  # a bug here must not kill the thread: the batch's waiters would hang
                log.exception("completing quantized IO batch %s failed", batch)

    def _transcode(self, tokens, results, batch_error) -> None:
        """Quantize the blocks of this batch that were read into staging buffers into their arena
        regions (outside the lock: a LOADING block's region is nobody else's); a failure is the
        block's read error."""
        for token in tokens:
            block = self.s.tokens.get(token)
            if block is None or block.staging is None:
                continue
            staging, block.staging = block.staging, None
            if batch_error is None and results.get(token) is None:
                info = block.info
                try:
                    block.model.store.transcode(info, staging, self.s.arena.view(block.offset, info.length))
                except Exception as exc:  # noqa: BLE001 -- typed for the waiters, never lost
                    log.exception("model %s: quantizing block %s failed", block.model.name, info.id)
                    results[token] = FlashError(
                        f"model {block.model.name}, block {info.id} ({info.role}, layer "
                        f"{info.layer}): quantizing it as it entered the host tier failed: {exc!r}",
                        model=block.model.name, block_id=info.id)
            staging.close()

    def _error_of(self, completion) -> FlashError | None:
        """The native mapping's exception (``deepseek_flash.io``), naming the block and its model
        (requests carry a token as their block id)."""
        block = self.s.tokens.get(completion.block_id)
        if block is None:
            outside = self._outside.get(completion.block_id)
            if outside is None:
                return None
            _, info, model = outside
        else:
            info, model = block.info, block.model.name
        err = error_of(completion, info.id, f"model {model}, block {info.id} ({info.role}, layer "
                                            f"{info.layer})", model=model)
        if err is not None and getattr(err, "eof", False):
            # The file ends before the block does: the store is corrupt, its device is not at fault.
            fields = {k: v for k, v in err.fields.items() if k not in ("errno", "eof")}
            return StoreTruncated(f"{err.message}: the data file is shorter than its metadata says",
                                  **{**fields, "length": info.length})
        return err

    def _complete(self, tokens, results, batch_error, size: int = 0) -> None:
        s = self.s
        resolved = []
        retry = []
        device_errors = []
        outside = []
        with s.lock:
            self.inflight -= size
            for token in tokens:
                if token in self._outside:
                    callback, info, _ = self._outside.pop(token)
                    error = batch_error or results.get(token, FlashIOError(
                        f"block {info.id}: the IO engine reported no completion", errno=0,
                        path=info.file, offset=info.offset, block_id=info.id))
                    if error is None:
                        s.counters["bytes_read_nvme"] += info.length
                    outside.append((callback, error))
                    continue
                block = s.tokens.pop(token, None)
                if block is None:
                    continue
                if token not in results and batch_error is None:
                    info = block.info
                    results[token] = FlashIOError(f"block {info.id} of model {block.model.name}: the IO "
                                                  f"engine reported no completion", errno=0,
                                                  path=info.file, offset=info.offset, block_id=info.id)
                error = batch_error or results.get(token)
                if error is None:
                    block.state = RESIDENT
                    block.retries = 0
                    source = _source_block(block)
                    s.counters["bytes_read_nvme"] += (source or block.info).length
                    self.telemetry.record_load_locked(block)
                    self.wake_waiters_locked(block, resolved)
                    continue
                outcome = self.recovery.failed_read_locked(block, error, device_errors)
                if outcome == "retry":
                    retry.append(block)
                elif outcome == "served":
                    self.wake_waiters_locked(block, resolved)
                else:
                    self._fail_waiters_locked(block, error, resolved)
            # Someone waits for a retried block: it goes before everything still waiting.
            self.submit_locked(retry, priority=RETRY_PRIORITY)
            self._pump_locked()
            self.residency.evict_to_threshold()
            s.generation += 1
        resolve_futures(resolved)
        for callback, error in outside:
            try:
                callback(error)
            except Exception:   # a bug there must not kill the only completion thread
                log.exception("callback of a read outside the host arena failed")
        for name, error in device_errors:
            for hook in s.device_error_hooks:
                try:
                    hook(name, error)
                except Exception:
                    log.exception("device error hook %r failed for model %s", hook, name)

    def _fail_waiters_locked(self, block: BlockState, error, resolved: list) -> None:
        waiters, block.waiters = block.waiters, []
        for ticket in waiters:
            if not ticket.done:
                ticket.done = True
                self.s.counters["failed_requests"] += 1
                self.residency.unpin(ticket.model, [b.info.id for b in ticket.pinned])
                resolved.append((ticket.future, error))

    def wake_waiters_locked(self, block: BlockState, resolved: list) -> None:
        """``block`` is resident: tickets waiting for nothing else are finished."""
        waiters, block.waiters = block.waiters, []
        for ticket in waiters:
            ticket.remaining -= 1
            if ticket.remaining == 0 and not ticket.done:
                resolved.append((ticket.future, self.finish_locked(ticket)))

    def finish_locked(self, ticket: Ticket):
        """The lease (or load summary) of a ticket whose blocks are all resident."""
        ticket.done = True
        m = ticket.model
        if not ticket.make_lease:
            resident = [b for b in m.blocks.values() if b.state == RESIDENT]
            return {"model": m.name, "blocks": len(m.blocks), "resident_blocks": len(resident),
                    "resident_bytes": sum(b.info.length for b in resident),
                    "total_bytes": m.store.total_bytes}
        client = ticket.client
        if not client.connected or m.name not in self.s.models:
            self.residency.unpin(m, [b.info.id for b in ticket.pinned])
            return UnknownClient(f"client {client.id} disconnected before its acquire finished",
                                 client=client.id)
        return self.residency.grant(client, m, ticket.pinned)


def _source_block(block: BlockState):
    """The source block a block quantized on entry is read from (None: read it as it is)."""
    source_block = getattr(block.model.store, "source_block", None)
    return None if source_block is None else source_block(block.info)
