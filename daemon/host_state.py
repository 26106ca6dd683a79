"""The host tier's shared state: one lock and every record it guards.

The block manager's parts (``registry``, ``residency``, ``leases``, ``reads``, ``read_errors``,
``telemetry``) hold no state of their own beyond what they are handed here: models, clients,
blocks, in-flight reads, counters and the hooks of the tiers above. ``HostState.lock`` guards all
of it; a method named ``*_locked`` expects the caller to hold it. Hooks are called outside it.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future

from ..errors import FlashError, UnknownClient, UnknownModel
from ..fsutil import align_up
from ..prefetch import ForwardOrder
from ..wire import Lease
from .config import FlashConfig

ABSENT, LOADING, RESIDENT = "absent", "loading", "resident"
# The embedded controller and the daemon's own `load` requests act as this client.
DAEMON_CLIENT = 0
ALIGN = 4096
COUNTERS = ("hits", "misses", "evictions", "bytes_read_nvme", "prefetch_issued", "prefetch_used",
            "prefetch_dropped", "load_errors", "checksum_errors", "leases_granted", "unloads",
            "recovered_blocks", "device_errors", "failed_requests")


def aligned(n: int) -> int:
    """Bytes a block of ``n`` bytes takes in the host arena (4 KiB granules, at least one)."""
    return max(ALIGN, align_up(n, ALIGN))


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class BlockState:
    """One block of an open model: where it is in the host arena and who needs it."""

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
        "staging",
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
        self.waiters: list[Ticket] = []
        self.error: FlashError | None = None
        self.quarantined = False      # its disk copy failed: never read from disk again (until unload)
        self.retries = 0
        self.token = -1
        self.dep_blocks: list[BlockState] = []
        self.requester = (DAEMON_CLIENT, None)   # (client id, pid) whose request read it
        self.submitted_ns = 0
        self.staging = None      # the source payload being read, for a block quantized on entry


class ModelState:
    """One open model: its store, effective config, blocks and recovery state."""

    def __init__(self, name, store, config, file_overrides, ignored):
        self.name = name
        self.store = store
        self.path = str(store.path)
        self.config: FlashConfig = config
        self.file_overrides = file_overrides
        self.ignored = ignored
        self.blocks = {b.id: BlockState(b, self) for b in store.blocks}
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


class HandleState:
    """One client's open of one model (per-open flash_context lives here)."""

    __slots__ = ("config", "context", "model")

    def __init__(self, model, context, config):
        self.model = model
        self.context = context
        self.config = config


class ClientState:
    def __init__(self, cid, info):
        self.id = cid
        self.info = info
        self.leases: dict[int, Lease] = {}
        self.handles: dict[str, HandleState] = {}
        self.kv_regions: dict[int, tuple[str, int]] = {}  # arena offset -> (model, bytes)
        self.connected = True


class Ticket:
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


def resolve_futures(resolved) -> None:
    """Finish ``(future, value-or-exception)`` pairs. Called outside the lock: done-callbacks
    (the server's wake-up) run right here."""
    for future, value in resolved:
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)


class HostState:
    """Everything the host tier knows, behind ``lock``."""

    def __init__(self, config: FlashConfig, arena, engine):
        self.lock = threading.Lock()
        self.config = config
        self.arena = arena
        self.engine = engine
        self.models: dict[str, ModelState] = {}
        self.clients: dict[int, ClientState] = {
            DAEMON_CLIENT: ClientState(DAEMON_CLIENT, {"name": "daemon"})}
        self.tokens: dict[int, BlockState] = {}     # in-flight read token -> block
        self.client_ids = itertools.count(1)
        self.lease_ids = itertools.count(1)
        self.token_ids = itertools.count(1)
        self.tick = 0
        self.generation = 0           # bumped on every state change (the status publisher polls it)
        self.counters = dict.fromkeys(COUNTERS, 0)
        # Clients importing (attach with importing): client -> (since, until, module), monotonic;
        # the engine reads shallow while any of them imports a module whose files were not read
        # ahead at start (``warm_imports``, daemon/imports_ahead.py; reads.py).
        self.shallow: dict[int, tuple[float, float, str | None]] = {}
        self.warm_imports: frozenset[str] = frozenset()
        self.warm_at: dict[str, float] = {}          # module -> when its files were read ahead
        # The tiers above: called outside the lock (see BlockManager.on_*), except copy sources.
        self.disconnect_hooks: list = []
        self.open_hooks: list = []
        self.device_error_hooks: list = []
        # Tiers above the host arena that may hold a good copy of a block (graceful recovery):
        # callables(model_name, BlockInfo, dest memoryview) -> bool.
        self.copy_sources: list = []

    def shallow_holders(self) -> list[int]:
        """The clients whose imports keep the reads shallow: those importing a module whose files
        were not read ahead (a client whose files are in the page cache loses nothing to deep
        reads)."""
        if "*" in self.warm_imports:        # imports_ahead.ANY_MODULE: the fallback packages read
            return []
        return [cid for cid, held in self.shallow.items() if held[2] not in self.warm_imports]

    def client(self, client_id) -> ClientState:
        try:
            return self.clients[client_id]
        except KeyError:
            raise UnknownClient(f"no client {client_id} (disconnected?)", client=client_id) from None

    def model(self, name) -> ModelState:
        try:
            return self.models[name]
        except KeyError:
            raise UnknownModel(f"model {name!r} is not open (open it first; open: "
                               f"{sorted(self.models) or 'none'})", model=name) from None
