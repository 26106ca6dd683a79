"""The host tier: which blocks are in the shared host arena, who holds them, and what leaves first.

``BlockManager`` opens models (store paths or names resolved under ``store_roots``), moves blocks
from NVMe into the ``HostArena`` through the ``IOEngine`` (one batch per acquire, in forward order,
crc32c checked by the engine on every read), hands out *leases* (a client's promise that it is
reading the block; a leased block is never evicted), and evicts unleased blocks when the arena is
above ``eviction_threshold`` or an allocation does not fit. Hot blocks (embeddings, norms) go only
when nothing else can.

It knows nothing of sockets: the daemon's server and the embedded client call the same methods.
All state sits behind one lock; IO waits happen on the completion thread, outside it. An acquire
that must read returns a ``concurrent.futures.Future`` that the completion thread resolves, so the
server's event loop never blocks on the disk.
"""
from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from ..errors import (
    ArenaFull,
    BlockChecksumError,
    BudgetTooSmall,
    DeviceError,
    FlashError,
    FlashIOError,
    LeaseError,
    LimitExceeded,
    NotResident,
    OutOfMemory,
    StoreInUse,
    UnknownBlock,
    UnknownClient,
    UnknownModel,
)
from ..prefetch import ForwardOrder
from ..wire import Lease, ModelInfo
from .config import _NAME as MODEL_NAME_RE
from .config import FlashConfig

log = logging.getLogger("deepseek_flash.block_manager")

ABSENT, LOADING, RESIDENT = "absent", "loading", "resident"
# Counters a streaming client reports (cumulative per client and model).
STREAM_COUNTERS = ("prefetch_hits", "prefetch_miss_count_stream", "fabric_stall_cycles",
                   "fabric_stall_us", "bytes_streamed")
ALIGN = 4096
# The embedded controller and the daemon's own `load` requests act as this client.
DAEMON_CLIENT = 0
# Read failures that say the device (or the file system on it) is going away, not one bad block:
# in graceful mode they switch the model to host-only instead of failing block after block.
DEVICE_ERRNOS = frozenset({errno.EIO, errno.ENXIO, errno.ENODEV, errno.ENOENT, errno.ESTALE,
                           errno.EROFS, errno.ENOTCONN, errno.ESHUTDOWN})
# Completed block loads kept for `profile` (flash-profiler): ~100 B each, so ~10 MiB at most.
LOAD_LOG_SIZE = 100_000


def _aligned(n: int) -> int:
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class _Block:
    __slots__ = (
        "dep_blocks",
        "error",
        "info",
        "last_use",
        "model",
        "offset",
        "prefetched",
        "quarantined",
        "refs",
        "requester",
        "retries",
        "saved_uses",
        "state",
        "submitted_ns",
        "token",
        "uses",
        "waiters",
    )

    def __init__(self, info, model):
        self.info = info
        self.model = model
        self.offset = -1
        self.state = ABSENT
        self.refs = 0
        self.last_use = 0
        self.uses = 0
        self.saved_uses = 0      # of ``uses``, how many are already in the store's access_freq
        self.prefetched = False   # loaded ahead and not acquired since
        self.waiters: list[_Ticket] = []
        self.error: FlashError | None = None
        self.quarantined = False      # its disk copy failed: never read from disk again (until unload)
        self.retries = 0
        self.token = -1
        self.dep_blocks: list[_Block] = []
        self.requester = (DAEMON_CLIENT, None)   # (client id, pid) whose request read it
        self.submitted_ns = 0


class _Model:
    def __init__(self, name, store, config, file_overrides, ignored):
        self.name = name
        self.store = store
        self.path = str(store.path)
        self.config: FlashConfig = config
        self.file_overrides = file_overrides
        self.ignored = ignored
        self.blocks = {b.id: _Block(b, self) for b in store.blocks}
        for block in self.blocks.values():
            block.dep_blocks = [self.blocks[d] for d in block.info.deps if d in self.blocks]
        self.order = ForwardOrder(store.blocks, store.num_layers)
        self.failed: FlashError | None = None
        self.failed_by_device = False      # ``failed`` came from a device loss: cleared when it returns
        self.host_only: str | None = None  # why new disk reads fail fast (device gone), or None
        self.device: dict = {}             # the block device under the store (daemon.recovery)
        self.plan: dict = {}
        self.pinned: frozenset = frozenset()
        self.deferred: list[int] = []      # prefetches that found no room, retried on release


class _Handle:
    """One client's open of one model (per-open flash_context lives here)."""

    __slots__ = ("config", "context", "model")

    def __init__(self, model, context, config):
        self.model = model
        self.context = context
        self.config = config


class _Client:
    def __init__(self, cid, info):
        self.id = cid
        self.info = info
        self.leases: dict[int, Lease] = {}
        self.handles: dict[str, _Handle] = {}
        self.connected = True


class _Ticket:
    """An acquire (or a warm-up) waiting for loads; resolved on the completion thread."""

    __slots__ = ("client", "done", "future", "ids", "make_lease", "model", "pinned", "remaining")

    def __init__(self, client, model, ids, pinned, make_lease):
        self.future: Future = Future()
        self.client = client
        self.model = model
        self.ids = ids
        self.pinned = pinned
        self.remaining = 0
        self.make_lease = make_lease
        self.done = False


class Resolved:
    """An already-finished stand-in for a ``concurrent.futures.Future`` (done, result, exception,
    add_done_callback): a warm acquire needs no condition variable."""

    __slots__ = ("_value",)

    def __init__(self, value):
        self._value = value

    def done(self) -> bool:
        return True

    def result(self, timeout=None):
        return self._value

    def exception(self, timeout=None):
        return None

    def add_done_callback(self, fn) -> None:
        fn(self)


def _check_data_files(store) -> None:
    """Every data file a store's metadata names lies inside the store directory: metadata is
    input too, and must not make the daemon read (and serve) a file elsewhere."""
    root = os.path.realpath(store.path)
    for name in sorted({b.file for b in store.blocks}):
        real = os.path.realpath(os.path.join(root, name))
        if not real.startswith(root + os.sep):
            raise UnknownModel(f"{store.path}: block data file {name!r} resolves to {real}, outside the "
                               f"store directory; refusing to serve it", model=store.name, file=name)


class BlockManager:
    """Residency, leases and eviction of the host tier. Thread-safe; see the module docstring."""

    def __init__(self, config: FlashConfig, arena, engine):
        self.config = config
        self.arena = arena
        self.engine = engine
        self._lock = threading.Lock()
        self._models: dict[str, _Model] = {}
        self._clients: dict[int, _Client] = {DAEMON_CLIENT: _Client(DAEMON_CLIENT, {"name": "daemon"})}
        self._tokens: dict[int, _Block] = {}
        self._client_ids = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._token_ids = itertools.count(1)
        self._tick = 0
        self.generation = 0           # bumped on every state change (the status publisher polls it)
        self.counters = dict.fromkeys(
            ("hits", "misses", "evictions", "bytes_read_nvme", "prefetch_issued", "prefetch_used",
             "prefetch_dropped", "load_errors", "checksum_errors", "leases_granted", "unloads",
             "recovered_blocks", "device_errors", "failed_requests"), 0)
        self._disconnect_hooks: list = []
        self._open_hooks: list = []
        self._device_error_hooks: list = []
        # Tiers above the host arena that may hold a good copy of a block (graceful recovery):
        # callables(model_name, BlockInfo, dest memoryview) -> bool.
        self._copy_sources: list = []
        # Streaming clients report their slot-ring counters: (client, model) -> latest report,
        # plus the totals of clients that are gone.
        self._streams: dict[tuple, dict] = {}
        self._stream_totals = dict.fromkeys(STREAM_COUNTERS, 0)
        # Completed reads, oldest first (see ``load_samples``); appended on the completion thread.
        self.load_log: collections.deque = collections.deque(maxlen=LOAD_LOG_SIZE)
        self._load_seq = itertools.count(1)
        self._batches: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._completion_loop, name="flash-io-completion",
                                        daemon=True)
        self._thread.start()

    # --- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the completion thread (after in-flight reads finish)."""
        self._batches.put(None)
        self._thread.join()

    def update_config(self, config: FlashConfig) -> None:
        """Apply a reloaded or tuned config to the daemon and every open model and handle."""
        with self._lock:
            if config.host_cache_bytes != self.config.host_cache_bytes:
                log.warning("host_cache_bytes changed to %s; the arena keeps %s until restart",
                            fmt_bytes(config.host_cache_bytes), fmt_bytes(self.arena.size))
            self.config = config
            for model in self._models.values():
                model.config = config.override(model.file_overrides, scope="model")
            for client in self._clients.values():
                for handle in client.handles.values():
                    handle.config = handle.model.config.override(handle.context, scope="model")
            self._evict_to_threshold()
            self.generation += 1

    def set_tunable(self, key: str, value) -> tuple:
        from .config import check_tunable

        parsed = check_tunable(key, value)
        old = self.config[key]
        self.update_config(self.config.override({key: parsed}))
        return old, parsed

    # --- clients -----------------------------------------------------------------------------
    def connect(self, info: dict | None = None) -> int:
        with self._lock:
            cid = next(self._client_ids)
            self._clients[cid] = _Client(cid, info or {})
            self.generation += 1
            return cid

    def on_disconnect(self, hook) -> None:
        """Call ``hook(client_id)`` (outside the lock) after a client is gone and its leases are
        released -- how the tiers above drop their per-client state."""
        self._disconnect_hooks.append(hook)

    def on_open(self, hook) -> None:
        """Call ``hook(model_name, store_path)`` (outside the lock) when a model is first opened --
        how the recovery tier maps the store to its block device."""
        self._open_hooks.append(hook)

    def on_device_error(self, hook) -> None:
        """Call ``hook(model_name, error)`` (outside the lock) when a read fails in a way that
        points at the device rather than at one block (EIO, ENXIO, a vanished file)."""
        self._device_error_hooks.append(hook)

    def add_copy_source(self, source) -> None:
        """A tier that may hold a good copy of a block: ``source(model_name, block_info, dest)``
        writes the payload into ``dest`` (a memoryview of the block's length) and returns True, or
        returns False. Called under the manager's lock on the recovery path only; it must not call
        back into the manager. The copy is checked against the block's crc32c before it is served."""
        self._copy_sources.append(source)

    def disconnect(self, client_id: int) -> int:
        """Forget a client and release every lease it holds; returns the number released."""
        with self._lock:
            client = self._clients.pop(client_id, None)
            if client is None:
                return 0
            client.connected = False
            released = len(client.leases)
            for lease in client.leases.values():
                self._unpin(self._models.get(lease.model), lease.blocks)
            client.leases.clear()
            self.generation += 1
        if released:
            log.info("client %s (%s) gone: released %d leases", client_id, client.info, released)
        with self._lock:
            for key in [k for k in self._streams if k[0] == client_id]:
                self._fold_stream(self._streams.pop(key))
        for hook in self._disconnect_hooks:
            try:
                hook(client_id)
            except Exception:   # one tier's bug must not keep the others from cleaning up
                log.exception("disconnect hook %r failed for client %s", hook, client_id)
        return released

    def connected(self, client_id: int) -> bool:
        with self._lock:
            return client_id in self._clients

    def _client(self, client_id) -> _Client:
        try:
            return self._clients[client_id]
        except KeyError:
            raise UnknownClient(f"no client {client_id} (disconnected?)", client=client_id) from None

    # --- models ------------------------------------------------------------------------------
    def resolve(self, name_or_path: str, trusted: bool = True) -> Path:
        """The store directory for a registered name, a name under ``store_roots``, or an
        absolute path. Names never reach outside their root (no '..', no symlink escapes). An
        untrusted caller (a peer that is neither root nor the daemon's user) may name an absolute
        path only when it resolves inside a store root: the daemon must not read, on its behalf,
        files that the peer could not read itself."""
        text = str(name_or_path)
        registry = self.config.models
        if text in registry:
            return Path(registry[text])
        if os.path.isabs(text):
            if not trusted:
                real = os.path.realpath(text)
                if not any(real.startswith(os.path.realpath(root) + os.sep)
                           for root in self.config.store_roots):
                    raise UnknownModel(f"{text!r}: absolute store paths outside store_roots "
                                       f"{self.config.store_roots} are only accepted from root or the "
                                       f"daemon's user; open it by name", model=text)
            return Path(text)
        if not MODEL_NAME_RE.fullmatch(text) or any(p in (".", "..") for p in text.split("/")):
            raise UnknownModel(f"{text!r} is not a model name (letters, digits, '.', '_', '-', '/'; "
                               f"no '..') nor an absolute store path", model=text)
        for root in self.config.store_roots:
            root_real = os.path.realpath(root)
            candidate = os.path.realpath(os.path.join(root_real, text))
            if candidate.startswith(root_real + os.sep) and os.path.isdir(candidate):
                return Path(candidate)
        raise UnknownModel(f"no model named {text!r}: not registered in `models` and not found under "
                           f"store_roots {self.config.store_roots}", model=text)

    def open_model(self, client_id: int, name_or_path, flash_context: dict | None = None) -> ModelInfo:
        from ..store import Store

        with self._lock:
            uid = self._client(client_id).info.get("uid")
            model = self._models.get(str(name_or_path))
            if model is None:
                config = self.config
        opened = None
        if model is None:
            path = self.resolve(name_or_path, trusted=uid is None or uid in (0, os.getuid()))
            real = os.path.realpath(path)
            with self._lock:
                model = next((m for m in self._models.values() if m.path == real), None)
            if model is None:
                store = Store.open(real)   # file IO outside the lock
                _check_data_files(store)
                mconfig, ignored = config.model_overrides(store.config, store.name)
                file_overrides = {k: v for k, v in (store.config.get("flash_config") or {}).items()
                                  if k not in ignored}
                self._check_budget(store)
                with self._lock:
                    model = next((m for m in self._models.values() if m.path == real), None)
                    if model is None:
                        name = self._unique_name(store.name)
                        model = _Model(name, store, mconfig, file_overrides, ignored)
                        model.path = real
                        self._models[name] = model
                        self.generation += 1
                        opened = model
                        log.info("opened model %s from %s (%d blocks, %s)", name, real,
                                 len(store.blocks), fmt_bytes(store.total_bytes))
        if opened is not None:
            for hook in self._open_hooks:
                try:
                    hook(opened.name, opened.path)
                except Exception:   # device discovery is advisory: the model still serves
                    log.exception("open hook %r failed for model %s", hook, opened.name)
        context = dict(flash_context or {})
        handle_config = model.config.override(context, scope="model")
        with self._lock:
            client = self._client(client_id)
            client.handles[model.name] = _Handle(model, context, handle_config)
            self.generation += 1
            return self._info(model, handle_config)

    def _unique_name(self, base: str) -> str:
        name, n = base, 2
        while name in self._models:
            name, n = f"{base}-{n}", n + 1
        return name

    def _check_budget(self, store) -> None:
        size = self.arena.size
        per_layer: dict[int, int] = {}
        largest = None
        for b in store.blocks:
            if b.layer >= 0:
                per_layer[b.layer] = per_layer.get(b.layer, 0) + _aligned(b.length)
            if largest is None or b.length > largest.length:
                largest = b
        layer, layer_bytes = max(per_layer.items(), key=lambda kv: kv[1], default=(-1, 0))
        if layer_bytes > size:
            raise BudgetTooSmall(
                f"model {store.name}: host_cache_bytes {fmt_bytes(size)} ({size} bytes) is smaller than "
                f"one decoder layer: layer {layer} needs {fmt_bytes(layer_bytes)} ({layer_bytes} bytes)",
                budget=size, needed=layer_bytes, model=store.name, layer=layer)
        if largest is not None and _aligned(largest.length) > size:
            need = _aligned(largest.length)
            raise BudgetTooSmall(
                f"model {store.name}: host_cache_bytes {fmt_bytes(size)} ({size} bytes) cannot hold "
                f"block {largest.id} ({largest.role}) of {fmt_bytes(need)} ({need} bytes)",
                budget=size, needed=need, model=store.name, block_id=largest.id)

    def _info(self, model: _Model, config: FlashConfig) -> ModelInfo:
        store = model.store
        return ModelInfo(name=model.name, path=model.path, config=store.config, blocks=store.blocks,
                         num_layers=store.num_layers, total_bytes=store.total_bytes,
                         flash_config={k: config[k] for k in ("prefetch_window", "error_recovery_mode",
                                                              "quantization_scheme",
                                                              "quantization_granularity")},
                         plan=dict(model.plan), ignored_overrides=list(model.ignored))

    def _model(self, name) -> _Model:
        try:
            return self._models[name]
        except KeyError:
            raise UnknownModel(f"model {name!r} is not open (open it first; open: "
                               f"{sorted(self._models) or 'none'})", model=name) from None

    def close_model(self, client_id: int, name: str) -> int:
        """Drop a client's handle on a model and its leases on it; the blocks stay cached."""
        with self._lock:
            client = self._client(client_id)
            model = self._model(name)
            client.handles.pop(name, None)
            mine = [lid for lid, lease in client.leases.items() if lease.model == name]
            for lid in mine:
                self._unpin(model, client.leases.pop(lid).blocks)
            self.generation += 1
            return len(mine)

    def save_access_counts(self, name: str | None = None) -> int:
        """Fold the uses counted since the last save into each store's ``access_freq`` (what
        ``defrag`` orders by); all open models when ``name`` is None. Returns blocks updated. A
        store that cannot be written (read-only, under maintenance) keeps its counts for later."""
        from ..store.maintenance import add_access_counts

        with self._lock:
            models = list(self._models.values()) if name is None else [self._model(name)]
            work = [(m, {b.info.id: b.uses - b.saved_uses for b in m.blocks.values()
                         if b.uses > b.saved_uses}) for m in models]
        updated = 0
        for m, counts in work:
            if not counts:
                continue
            try:
                add_access_counts(m.path, counts)
            except (FlashError, OSError) as exc:   # the metadata stays as it was; retried later
                log.warning("model %s: access counts not saved to %s: %s", m.name, m.path, exc)
                continue
            with self._lock:
                for bid, n in counts.items():
                    m.blocks[bid].saved_uses += n
            updated += len(counts)
        return updated

    def unload(self, name: str) -> dict:
        """Forget a model and free its host memory; refused while any block of it is leased."""
        self.save_access_counts(name)
        with self._lock:
            model = self._model(name)
            busy = [b for b in model.blocks.values() if b.refs or b.state == LOADING]
            if busy:
                holders = {c.id for c in self._clients.values()
                           for lease in c.leases.values() if lease.model == name}
                raise StoreInUse(f"model {name}: {len(busy)} blocks are leased or loading (clients "
                                 f"{sorted(holders)}); release them before unloading",
                                 model=name, blocks=len(busy))
            freed = 0
            for block in model.blocks.values():
                if block.state == RESIDENT:
                    freed += _aligned(block.info.length)
                    self._drop(block)
            del self._models[name]
            for client in self._clients.values():
                client.handles.pop(name, None)
            self.counters["unloads"] += 1
            self.generation += 1
        log.info("unloaded model %s (%s freed)", name, fmt_bytes(freed))
        return {"model": name, "freed_bytes": freed}

    # --- device state (driven by daemon.recovery) ---------------------------------------------
    def set_device(self, name: str, device: dict) -> None:
        """Record the block device under a model's store (shown in its status info)."""
        with self._lock:
            model = self._models.get(name)
            if model is not None:
                model.device = dict(device)
                self.generation += 1

    def set_host_only(self, name: str, reason: str | None) -> bool:
        """The device under ``name`` went away (``reason``) or came back (None). Graceful models
        keep serving their host-resident blocks and fail new disk reads fast with DeviceError;
        strict models fail every request with it until the device returns. True if it changed."""
        with self._lock:
            m = self._models.get(name)
            if m is None:
                return False
            if reason is not None:
                changed = m.host_only is None
                m.host_only = reason
                if m.config.error_recovery_mode == "strict" and m.failed is None:
                    m.failed = DeviceError(f"model {name}: its device is unavailable ({reason})",
                                           model=name, device=m.device.get("node", ""), reason=reason)
                    m.failed_by_device = True
                if not changed:
                    return False
                log.error("model %s: host-only (%s)", name, reason)
            else:
                if m.host_only is None:
                    return False
                m.host_only = None
                if m.failed_by_device:
                    m.failed, m.failed_by_device = None, False
                log.warning("model %s: device back, disk reads resume", name)
            self.generation += 1
            return True

    def device_models(self) -> dict:
        """name -> {path, device, host_only, mode} of every open model (for the recovery tier)."""
        with self._lock:
            return {m.name: {"path": m.path, "device": dict(m.device), "host_only": m.host_only,
                             "mode": m.config.error_recovery_mode,
                             # blocks whose reads failed (not quarantined): read them to see
                             # whether the device is back
                             "probe": [b.info.id for b in m.blocks.values()
                                       if b.error is not None and not b.quarantined][:8]
                             or [next(iter(m.blocks))] if m.blocks else []}
                    for m in self._models.values()}

    def degraded_reasons(self) -> list[str]:
        """Why the controller is DEGRADED (empty when it is not)."""
        with self._lock:
            return self._degraded_locked()

    def _degraded_locked(self) -> list[str]:
        out = []
        for m in self._models.values():
            if m.failed is not None:
                out.append(f"model {m.name} failed: {m.failed}")
            if m.host_only is not None and not m.failed_by_device:
                out.append(f"model {m.name} host-only: {m.host_only}")
            bad = sorted(b.info.id for b in m.blocks.values() if b.quarantined)
            if bad:
                out.append(f"model {m.name}: {len(bad)} quarantined block(s) {bad[:8]}")
        return out

    def set_plan(self, name: str, plan: dict) -> None:
        """Register a residency plan for a model. ``{"pin": [block ids]}`` keeps those blocks in
        the host tier once loaded (never evicted while the plan stands); other keys are kept for
        the tiers above (the GPU fabric) to read back from ``ModelInfo.plan``."""
        with self._lock:
            model = self._model(name)
            pins = plan.get("pin", [])
            for bid in pins:
                if bid not in model.blocks:
                    raise UnknownBlock(f"model {name}: residency plan pins block {bid}, which does "
                                       f"not exist ({len(model.blocks)} blocks)", block_id=bid, model=name)
            model.plan = dict(plan)
            model.pinned = frozenset(pins)
            self.generation += 1

    # --- acquire / release --------------------------------------------------------------------
    def acquire(self, client_id, model, blocks=None, layer=None, priority: int = 0, wait: bool = True,
                timeout: float | None = None) -> Lease:
        """Blocking acquire (the embedded client's path)."""
        return self.acquire_async(client_id, model, blocks, layer, priority, wait).result(timeout)

    def acquire_async(self, client_id, model, blocks=None, layer=None, priority: int = 0,
                      wait: bool = True, requester: int | None = None) -> Future:
        """Lease ``blocks`` (or every block of ``layer``) of ``model``; a Future of the ``Lease``
        (a ``Resolved`` one when every block was resident).

        ``priority`` is reserved (accepted, not yet used for ordering). With ``wait=False`` an
        acquire that would have to read raises ``NotResident`` after starting those reads.
        ``requester``: the client whose request this acquire serves, when another holds the lease
        (a shared GPU load holds its leases as the daemon): the reads count as that client's in
        the profiler's load log.
        """
        with self._lock:
            client = self._client(client_id)
            m = self._model(model)
            if m.failed is not None:
                # A fresh instance: the recorded one may be raised in several threads at once.
                raise type(m.failed)(m.failed.message, **m.failed.fields)
            ids = self._requested(m, blocks, layer)
            if len(client.leases) >= self.config.max_leases_per_client:
                raise LimitExceeded(f"client {client_id} holds {len(client.leases)} leases, the "
                                    f"maximum (max_leases_per_client); release some first",
                                    limit=self.config.max_leases_per_client)
            self._tick += 1
            tick = self._tick
            wanted = [m.blocks[i] for i in ids]
            counters = self.counters
            for b in wanted:
                b.refs += 1
                b.last_use = tick
                b.uses += 1
                if b.state == ABSENT:
                    counters["misses"] += 1
                else:
                    counters["hits"] += 1
                    if b.prefetched:
                        counters["prefetch_used"] += 1
                b.prefetched = False
            to_load = [b for b in wanted if b.state == ABSENT]
            to_load += [d for b in wanted for d in b.dep_blocks if d.state == ABSENT]
            protect = set()
            batch = []
            if to_load and (m.host_only or any(b.quarantined for b in to_load)):
                # No disk read for these: another tier's copy, or a typed error at once.
                protect.update(wanted)
                protect.update(d for b in wanted for d in b.dep_blocks)
                try:
                    self._serve_without_disk(m, to_load, set(wanted), protect)
                except FlashError:
                    self._unpin(m, [b.info.id for b in wanted])
                    counters["failed_requests"] += 1
                    raise
                to_load = [b for b in to_load if b.state == ABSENT and not b.quarantined
                           and not m.host_only]
            if to_load:
                protect.update(wanted)
                protect.update(d for b in wanted for d in b.dep_blocks)
                try:
                    batch = self._allocate(to_load, protect, prefetch=False)
                except FlashError:
                    self._unpin(m, [b.info.id for b in wanted])
                    raise
            if layer is not None:
                handle = client.handles.get(m.name)
                window = (handle.config if handle else m.config).prefetch_window
                if window:
                    batch += self._prefetch_locked(m, m.order.stages_after(layer, window), protect)
            self._submit(batch, client_id if requester is None else requester)
            self.generation += 1
            pending = [b for b in wanted if b.state == LOADING]
            if not pending:
                # The common, warm case: no Future, no ticket.
                return Resolved(self._grant(client, m, wanted))
            if not wait:
                self._unpin(m, [b.info.id for b in wanted])
                raise NotResident(f"model {m.name}: {len(pending)} of {len(wanted)} blocks are being "
                                  f"read from disk (first: block {pending[0].info.id}); retry",
                                  model=m.name, blocks=[b.info.id for b in pending])
            ticket = _Ticket(client, m, ids, wanted, make_lease=True)
            ticket.remaining = len(pending)
            for b in pending:
                b.waiters.append(ticket)
        return ticket.future

    def _serve_without_disk(self, m: _Model, blocks, wanted, protect) -> None:
        """Make ``blocks`` resident without reading the disk (the model is host-only, or a block
        is quarantined): from a copy source, else a typed error naming the block. Dependencies
        that cannot be served are skipped (they are read along, not leased)."""
        for block in blocks:
            if not (m.host_only or block.quarantined) or block.state != ABSENT:
                continue
            if self._copy_sources:
                error = block.error
                self._allocate([block], protect, prefetch=False)
                if self._copy_into(block):
                    continue
                self._drop(block)
                block.error = error
            if block not in wanted:
                continue
            info = block.info
            if block.quarantined and block.error is not None:
                raise type(block.error)(f"{block.error.message} (quarantined: no other tier holds a "
                                        f"good copy)", **block.error.fields)
            raise DeviceError(f"model {m.name}: block {info.id} ({info.role}, layer {info.layer}) is not "
                              f"in the host tier and its device is unavailable ({m.host_only}); "
                              f"serving host-resident blocks only", model=m.name, block_id=info.id,
                              device=m.device.get("node", ""), reason=m.host_only)

    def _copy_into(self, block: _Block) -> bool:
        """Fill the block's arena region from a copy source; True when a verified copy landed."""
        from .._core import crc32c

        dest = self.arena.view(block.offset, block.info.length)
        for source in self._copy_sources:
            try:
                if not source(block.model.name, block.info, dest):
                    continue
            except Exception:   # a broken tier must not take the recovery path down with it
                log.exception("copy source %r failed for block %s", source, block.info.id)
                continue
            if crc32c(dest) == block.info.crc32c:
                block.state = RESIDENT
                self.counters["recovered_blocks"] += 1
                log.warning("model %s: block %s served from another tier's copy (%r)",
                            block.model.name, block.info.id, source)
                return True
            log.error("model %s: copy of block %s from %r failed its crc32c; not served",
                      block.model.name, block.info.id, source)
        dest[:] = bytes(len(dest))
        return False

    def _requested(self, m: _Model, blocks, layer) -> list[int]:
        if layer is not None:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(m.order.layers):
                raise UnknownBlock(f"model {m.name}: no layer {layer!r} (it has {len(m.order.layers)} "
                                   f"layers)", model=m.name, layer=layer)
            ids = m.order.layer_blocks(layer)
            if blocks:
                ids = sorted(set(ids) | set(blocks))
        elif blocks:
            ids = list(dict.fromkeys(blocks))
        else:
            raise LeaseError(f"model {m.name}: acquire needs `blocks` or `layer`", model=m.name)
        for bid in ids:
            if bid not in m.blocks:
                raise UnknownBlock(f"model {m.name}: no block {bid!r} (it has {len(m.blocks)} blocks, "
                                   f"ids {min(m.blocks)}..{max(m.blocks)})", model=m.name, block_id=bid)
        return ids

    def release(self, client_id: int, lease_id: int) -> None:
        with self._lock:
            client = self._client(client_id)
            lease = client.leases.pop(lease_id, None)
            if lease is None:
                raise LeaseError(f"client {client_id} holds no lease {lease_id}", lease=lease_id)
            model = self._models.get(lease.model)
            self._unpin(model, lease.blocks)
            if model is not None and model.deferred:
                self._submit(self._prefetch_locked(model, model.deferred, set()), client_id)
            self.generation += 1

    def _unpin(self, model, block_ids) -> None:
        if model is None:
            return
        for bid in block_ids:
            block = model.blocks[bid]
            block.refs -= 1

    # --- prefetch / warm-up -------------------------------------------------------------------
    def prefetch(self, model: str, layers=None, blocks=None, client_id: int = DAEMON_CLIENT) -> int:
        """Start reading the blocks of ``layers`` (and ``blocks``) ahead of use; returns how many
        reads were started. Advisory: blocks that do not fit without evicting leased, hot or
        still-unused prefetched blocks are skipped."""
        with self._lock:
            m = self._model(model)
            ids = []
            for layer in layers or []:
                ids += self._requested(m, None, layer)
            if blocks:
                ids += self._requested(m, blocks, None)
            batch = self._prefetch_locked(m, ids, set())
            self._submit(batch, client_id)
            self.generation += 1
            return len(batch)

    def _prefetch_locked(self, m: _Model, ids, protect) -> list:
        if m.host_only:
            return []
        absent = [m.blocks[i] for i in ids if m.blocks[i].state == ABSENT and not m.blocks[i].quarantined]
        batch = self._allocate(absent, protect, prefetch=True)
        for b in batch:
            b.prefetched = True
        self.counters["prefetch_issued"] += len(batch)
        self.counters["prefetch_dropped"] += len(absent) - len(batch)
        # What did not fit is retried when a lease on this model is released (a streaming client
        # releases the layer behind it, which is exactly the room the window needs).
        m.deferred = [b.info.id for b in absent[len(batch):]]
        return batch

    def load(self, model: str, client_id: int = DAEMON_CLIENT) -> Future:
        """Read every block of ``model`` that fits (forward order); a Future of a summary dict."""
        resolved = []
        with self._lock:
            m = self._model(model)
            absent = [] if m.host_only else [b for b in m.blocks.values()
                                             if b.state == ABSENT and not b.quarantined]
            batch = self._allocate(absent, set(), prefetch=True)
            self._submit(batch, client_id)
            ticket = _Ticket(self._clients[DAEMON_CLIENT], m, [], [], make_lease=False)
            pending = [b for b in m.blocks.values() if b.state == LOADING]
            ticket.remaining = len(pending)
            for b in pending:
                b.waiters.append(ticket)
            if not pending:
                resolved.append((ticket.future, self._finish_locked(ticket)))
            self.generation += 1
        self._resolve(resolved)
        return ticket.future

    # --- allocation and eviction ----------------------------------------------------------------
    def _allocate(self, blocks, protect, prefetch: bool) -> list:
        """Give each block arena space (evicting as needed) and mark it LOADING. For a demand
        load a block that cannot fit raises OutOfMemory (earlier allocations are undone); for a
        prefetch the rest of the list is skipped."""
        done = []
        for block in blocks:
            if block.state != ABSENT:
                continue
            offset = self._make_room(block, protect, prefetch)
            if offset is None:
                break
            if isinstance(offset, FlashError):
                for b in done:
                    self.arena.free(b.offset)
                    b.offset, b.state = -1, ABSENT
                raise offset
            block.offset = offset
            block.state = LOADING
            block.error = None
            protect.add(block)
            done.append(block)
        return done

    def _make_room(self, block: _Block, protect, prefetch: bool):
        need = _aligned(block.info.length)
        arena = self.arena
        limit = self.config.eviction_threshold * arena.size
        # Soft pass: keep the arena under the threshold, evicting cold (non-hot) blocks only.
        if arena.used + need > limit:
            for victim in self._candidates(protect, hot=False, prefetch=prefetch):
                self._evict(victim)
                if arena.used + need <= limit:
                    break
        try:
            return arena.alloc(need)
        except ArenaFull:
            pass
        # Hard pass: the allocation itself does not fit; hot blocks go last and only here.
        for hot in (False, True):
            if hot and prefetch:
                break
            for victim in self._candidates(protect, hot=hot, prefetch=prefetch):
                self._evict(victim)
                try:
                    return arena.alloc(need)
                except ArenaFull:
                    continue
        if prefetch:
            return None
        leased = sum(_aligned(b.info.length) for m in self._models.values() for b in m.blocks.values()
                     if b.refs and b.state != ABSENT)
        return OutOfMemory(
            f"host tier full: block {block.info.id} ({block.info.role}, layer {block.info.layer}) of "
            f"model {block.model.name} needs {fmt_bytes(need)}; {fmt_bytes(arena.used)} of "
            f"{fmt_bytes(arena.size)} in use, {fmt_bytes(leased)} of it leased or loading, largest "
            f"free extent {fmt_bytes(arena.largest_free())}; release leases or raise host_cache_bytes",
            model=block.model.name, block_id=block.info.id, needed=need, used=arena.used,
            budget=arena.size, leased=leased, largest_free=arena.largest_free())

    def _candidates(self, protect, hot: bool, prefetch: bool) -> list:
        policy = self.config.block_eviction_policy
        out = []
        for m in self._models.values():
            for b in m.blocks.values():
                if (b.state != RESIDENT or b.refs or b in protect or b.info.id in m.pinned
                        or b.info.hot != hot or (prefetch and b.prefetched)):
                    continue
                out.append(b)
        if policy == "lru":
            out.sort(key=lambda b: b.last_use)
        else:
            # access_frequency_weighted: fewest observed uses plus the store's packed access_freq
            # hint go first; recency breaks ties so a one-off burst does not pin a block forever.
            out.sort(key=lambda b: (b.uses + b.info.access_freq, b.last_use))
        return out

    def _evict(self, block: _Block) -> None:
        self._drop(block)
        self.counters["evictions"] += 1

    def _drop(self, block: _Block) -> None:
        self.arena.free(block.offset)
        block.offset = -1
        block.state = ABSENT
        block.prefetched = False

    def _evict_to_threshold(self) -> None:
        limit = self.config.eviction_threshold * self.arena.size
        if self.arena.used <= limit:
            return
        for victim in self._candidates(set(), hot=False, prefetch=True):
            if self.arena.used <= limit:
                break
            self._evict(victim)

    # --- IO ------------------------------------------------------------------------------------
    def _submit(self, blocks, client_id: int | None = None) -> None:
        """Read ``blocks`` in one engine batch on behalf of ``client_id`` (None: a retry, which
        keeps the block's original requester)."""
        if not blocks:
            return
        from .._core import ReadRequest

        if client_id is not None:
            client = self._clients.get(client_id)
            requester = (client_id, client.info.get("pid") if client is not None else None)
        now = time.monotonic_ns()

        # Forward (file) order turns a cold load into one sequential sweep.
        blocks = sorted(blocks, key=lambda b: (b.model.path, b.info.file, b.info.offset))
        requests, tokens = [], []
        for b in blocks:
            token = next(self._token_ids)
            b.token = token
            b.submitted_ns = now
            if client_id is not None:
                b.requester = requester
            self._tokens[token] = b
            tokens.append(token)
            requests.append(ReadRequest(path=str(b.model.store.data_path(b.info)), offset=b.info.offset,
                                        length=b.info.length,
                                        dest=self.arena.view(b.offset, b.info.length), dest_offset=0,
                                        block_id=token, expected_crc=b.info.crc32c))
        try:
            batch = self.engine.submit(requests)
        except FlashError as exc:
            self._batches.put(("failed", tokens, exc))
            return
        self._batches.put((batch, tokens, None))

    def _completion_loop(self) -> None:
        while True:
            item = self._batches.get()
            if item is None:
                return
            batch, tokens, error = item
            results: dict[int, FlashError | None] = {}
            if error is None:
                try:
                    completions = self.engine.wait(batch)
                except FlashError as exc:
                    error = exc
                except Exception as exc:  # noqa: BLE001 -- never leave the batch's waiters hanging
                    error = FlashIOError(f"IO engine failed waiting for batch {batch}: {exc!r}",
                                         errno=0, path="", offset=-1, block_id=-1)
                else:
                    for c in completions:
                        results[c.block_id] = results.get(c.block_id) or self._error_of(c)
            try:
                self._complete(tokens, results, error)
            except Exception:  # a bug here must not kill the only completion thread
                log.exception("completing IO batch %s failed", batch)

    def _error_of(self, completion) -> FlashError | None:
        block = self._tokens.get(completion.block_id)
        if block is None:
            return None
        info, path = block.info, str(block.model.store.data_path(block.info))
        if completion.status < 0:
            err = -completion.status
            return FlashIOError(f"{path}: reading block {info.id} ({info.role}, layer {info.layer}) of "
                                f"model {block.model.name}: {os.strerror(err)}", errno=err, path=path,
                                offset=info.offset, block_id=info.id, model=block.model.name)
        if completion.bytes != info.length and completion.status == 0 and completion.bytes < info.length:
            return FlashIOError(f"{path}: block {info.id} of model {block.model.name} truncated: "
                                f"{completion.bytes} of {info.length} bytes at offset {info.offset}",
                                errno=0, path=path, offset=info.offset, block_id=info.id,
                                model=block.model.name)
        if not completion.crc_ok:
            return BlockChecksumError(f"{path}: block {info.id} ({info.role}, layer {info.layer}) of "
                                      f"model {block.model.name} failed its crc32c check "
                                      f"(expected {info.crc32c:#010x})", block_id=info.id, path=path,
                                      expected=info.crc32c, model=block.model.name)
        return None

    def _complete(self, tokens, results, batch_error) -> None:
        resolved = []
        retry = []
        device_errors = []
        with self._lock:
            for token in tokens:
                block = self._tokens.pop(token, None)
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
                    self.counters["bytes_read_nvme"] += block.info.length
                    self._record_load(block)
                    self._wake_waiters(block, resolved)
                    continue
                self.counters["load_errors"] += 1
                m = block.model
                graceful = m.config.error_recovery_mode == "graceful"
                checksum = isinstance(error, BlockChecksumError)
                if checksum:
                    self.counters["checksum_errors"] += 1
                if graceful and block.retries < 1 and not m.host_only:
                    # A flipped bit on the wire or a transient media error: read once more.
                    block.retries += 1
                    log.warning("retrying %s", error)
                    retry.append(block)
                    continue
                log.error("%s", error)
                device_lost = (isinstance(error, FlashIOError) and not checksum
                               and getattr(error, "errno", None) in DEVICE_ERRNOS | {0})
                if checksum:
                    # Its disk copy is bad: never read again until the model is unloaded.
                    block.quarantined = True
                if device_lost:
                    self.counters["device_errors"] += 1
                    device_errors.append((m.name, error))
                    if graceful and not m.host_only:
                        m.host_only = f"read error: {error}"
                        log.error("model %s: switching to host-only (%s)", m.name, error)
                block.error, block.retries = error, 0
                if graceful and self._copy_sources and self._copy_into(block):
                    self._wake_waiters(block, resolved)
                    continue
                # Whatever landed is not the block: no client may ever see those bytes.
                self.arena.view(block.offset, block.info.length)[:] = bytes(block.info.length)
                self.arena.free(block.offset)
                block.offset, block.state = -1, ABSENT
                if not graceful:
                    m.failed = error
                waiters, block.waiters = block.waiters, []
                for ticket in waiters:
                    if not ticket.done:
                        ticket.done = True
                        self.counters["failed_requests"] += 1
                        self._unpin(ticket.model, [b.info.id for b in ticket.pinned])
                        resolved.append((ticket.future, error))
            self._submit(retry)
            self._evict_to_threshold()
            self.generation += 1
        self._resolve(resolved)
        for name, error in device_errors:
            for hook in self._device_error_hooks:
                try:
                    hook(name, error)
                except Exception:
                    log.exception("device error hook %r failed for model %s", hook, name)

    def _wake_waiters(self, block: _Block, resolved: list) -> None:
        """``block`` is resident: tickets waiting for nothing else are finished."""
        waiters, block.waiters = block.waiters, []
        for ticket in waiters:
            ticket.remaining -= 1
            if ticket.remaining == 0 and not ticket.done:
                resolved.append((ticket.future, self._finish_locked(ticket)))

    def _finish_locked(self, ticket: _Ticket):
        """The lease (or load summary) of a ticket whose blocks are all resident."""
        ticket.done = True
        m = ticket.model
        if not ticket.make_lease:
            resident = [b for b in m.blocks.values() if b.state == RESIDENT]
            return {"model": m.name, "blocks": len(m.blocks), "resident_blocks": len(resident),
                    "resident_bytes": sum(b.info.length for b in resident),
                    "total_bytes": m.store.total_bytes}
        client = ticket.client
        if not client.connected or m.name not in self._models:
            self._unpin(m, [b.info.id for b in ticket.pinned])
            return UnknownClient(f"client {client.id} disconnected before its acquire finished",
                                 client=client.id)
        return self._grant(client, m, ticket.pinned)

    def _grant(self, client: _Client, m: _Model, blocks) -> Lease:
        lease = Lease(next(self._lease_ids), m.name, {b.info.id: b.offset for b in blocks}, client.id)
        client.leases[lease.id] = lease
        self.counters["leases_granted"] += 1
        return lease

    @staticmethod
    def _resolve(resolved) -> None:
        # Outside the lock: done-callbacks (the server's wake-up) run right here.
        for future, value in resolved:
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

    # --- load profile (flash-profiler) ----------------------------------------------------------
    def _record_load(self, block: _Block) -> None:
        cid, pid = block.requester
        info = block.info
        self.load_log.append((next(self._load_seq), time.time(), cid, os.getpid() if pid is None else pid,
                              block.model.name, info.id, info.layer, info.role,
                              (time.monotonic_ns() - block.submitted_ns) // 1000, info.length))

    def clients_of_pid(self, pid: int) -> list[int]:
        """Ids of the connected clients whose process is ``pid`` (SO_PEERCRED at connect; clients
        without a peer pid -- the embedded one, the daemon's own -- count as this process)."""
        with self._lock:
            return sorted(c.id for c in self._clients.values()
                          if c.id != DAEMON_CLIENT and c.info.get("pid", os.getpid()) == pid)

    def load_samples(self, pid: int | None = None, after: int = 0, since: float = 0.0,
                     limit: int = 10_000) -> list[tuple]:
        """Completed block loads with sequence number > ``after`` and wall time > ``since``
        (for ``pid``'s requests, or everyone's): tuples ``(seq, time, client, pid, model, block,
        layer, role, latency_us, bytes)``, oldest first, at most ``limit``. Latency is submit
        to the engine -> completion seen by the completion thread."""
        with self._lock:
            if self.load_log and self.load_log[-1][0] <= after:
                return []
            log_copy = list(self.load_log)
        out = [s for s in log_copy if s[0] > after and s[1] > since and (pid is None or s[3] == pid)]
        return out[:limit]

    # --- introspection ------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            return self._stats_locked()

    # --- streaming reports ------------------------------------------------------------------------
    def report_stream(self, client_id: int, model: str, stats: dict) -> None:
        """Record a streaming client's cumulative counters (see ``client.stream``)."""
        with self._lock:
            self._client(client_id)
            self._model(model)
            counts = dict(stats, prefetch_miss_count_stream=stats.get("prefetch_miss_count", 0))
            self._streams[(client_id, model)] = {
                **{k: int(counts.get(k, 0)) for k in STREAM_COUNTERS},
                "prefetch_window": int(stats.get("prefetch_window", 0)),
                "decisions": list(stats.get("decisions", []))[-8:]}
            self.generation += 1

    def _fold_stream(self, report: dict) -> None:
        for k in STREAM_COUNTERS:
            self._stream_totals[k] += report[k]

    def _stream_counts(self) -> dict:
        out = dict(self._stream_totals)
        for report in self._streams.values():
            for k in STREAM_COUNTERS:
                out[k] += report[k]
        return out

    def _stats_locked(self) -> dict:
        c = dict(self.counters)
        stream = self._stream_counts()
        c.update(stream)
        # Host-tier acquires and GPU slot prefetches both count: a hit is data that was there
        # before it was needed.
        hits = c["hits"] + stream["prefetch_hits"]
        misses = c["misses"] + stream["prefetch_miss_count_stream"]
        c["prefetch_hit_rate"] = hits / (hits + misses) if hits + misses else 1.0
        c["prefetch_miss_count"] = misses
        c["block_eviction_count"] = c["evictions"]
        c["active_leases"] = sum(len(cl.leases) for cl in self._clients.values())
        c["connected_clients"] = len(self._clients) - 1
        c["host_bytes_used"] = self.arena.used
        c["host_bytes_total"] = self.arena.size
        c["resident_blocks"] = sum(1 for m in self._models.values() for b in m.blocks.values()
                                   if b.state == RESIDENT)
        c["loading_blocks"] = len(self._tokens)
        c["open_models"] = len(self._models)
        c["quarantined_blocks"] = sum(1 for m in self._models.values() for b in m.blocks.values()
                                      if b.quarantined)
        c["host_only_models"] = sum(1 for m in self._models.values() if m.host_only is not None)
        return c

    def list_models(self) -> list[dict]:
        with self._lock:
            return [self._model_summary(m) for m in self._models.values()]

    def _model_summary(self, m: _Model) -> dict:
        resident = [b for b in m.blocks.values() if b.state == RESIDENT]
        streams = [r for (cid, name), r in self._streams.items() if name == m.name]
        return {"plan": dict(m.plan),
                "streaming_clients": len(streams),
                "prefetch_window": max((r["prefetch_window"] for r in streams), default=None),
                "prefetch_decisions": streams[-1]["decisions"] if streams else [],
                "name": m.name, "path": m.path, "state": "failed" if m.failed else "open",
                "blocks": len(m.blocks), "resident_blocks": len(resident),
                "resident_bytes": sum(b.info.length for b in resident),
                "total_bytes": m.store.total_bytes, "num_layers": m.store.num_layers,
                "leased_blocks": sum(1 for b in m.blocks.values() if b.refs),
                "clients": sorted(c.id for c in self._clients.values() if m.name in c.handles),
                "error": str(m.failed) if m.failed else None,
                "error_recovery_mode": m.config.error_recovery_mode,
                "quarantined_blocks": sorted(b.info.id for b in m.blocks.values() if b.quarantined),
                "unified_memory_fabric": "HOST_ONLY" if m.host_only is not None else "ENABLED",
                "host_only_reason": m.host_only,
                **{f"device_{k}": v for k, v in m.device.items()}}

    def residency(self, name: str) -> dict[int, str]:
        """block id -> "absent" | "loading" | "resident" for one open model."""
        with self._lock:
            return {bid: b.state for bid, b in self._model(name).blocks.items()}

    def snapshot(self) -> dict:
        """Everything the status tree shows, in one consistent read: the sections ``status``,
        ``stats``, ``devices``, ``models``, ``tunables`` (the StatusTree publisher's layout)."""
        with self._lock:
            stats = self._stats_locked()
            models = {}
            for m in self._models.values():
                summary = self._model_summary(m)
                summary["residency"] = [
                    {"id": b.info.id, "role": b.info.role, "layer": b.info.layer, "state": b.state,
                     "bytes": b.info.length, "refs": b.refs, "uses": b.uses, "hot": b.info.hot}
                    for b in m.blocks.values()]
                models[m.name] = summary
            degraded = self._degraded_locked()
            status = {"controller_state": "DEGRADED" if degraded else "ACTIVE",
                      "degraded_reason": "; ".join(degraded),
                      "host_only_models": stats["host_only_models"],
                      "prefetch_hit_rate": stats["prefetch_hit_rate"],
                      "semantic_block_count": sum(len(m.blocks) for m in self._models.values()),
                      # The GPU tier registers itself above the host tier; alone this is host-only.
                      "unified_memory_fabric": "HOST_ONLY"}
            return {"status": status, "stats": stats, "devices": {}, "models": models,
                    "tunables": self.config.tunables()}
