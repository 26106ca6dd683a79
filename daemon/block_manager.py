"""The host tier's front door: which blocks are in the shared host arena, who holds them, and
what leaves first.

``BlockManager`` is the one object the server, the device tier and the embedded controller call.
It owns a ``HostState`` (every record, behind one lock) and the parts that work on it, each in
its own module:

    registry.py     clients, open models (name resolution, budget check), plans, config
    leases.py       acquire / release / prefetch / load: pins and the IO they start
    residency.py    arena space and eviction (where eviction is decided)
    reads.py        IO batches to the engine and the completion thread (where a block is read)
    read_errors.py  what a failed read does (a pure policy) and the recovery paths
    telemetry.py    counters, load log, streaming reports, the status snapshot

It knows nothing of sockets: the daemon's server and the embedded client call the same methods.
IO waits happen on the completion thread, outside the lock; an acquire that must read returns a
``concurrent.futures.Future`` that the completion thread resolves, so the server's event loop
never blocks on the disk.
"""
from __future__ import annotations

from .config import FlashConfig
from ..wire import Lease, ModelInfo
from .host_state import HostState
from .leases import Leases
from .read_errors import Recovery
from .reads import ReadPipeline
from .registry import Registry
from .residency import Residency
from .telemetry import Telemetry

__all__ = ["BlockManager", "Lease", "ModelInfo"]


class BlockManager:
    """Residency, leases and eviction of the host tier. Thread-safe; see the module docstring.

    The public methods are those of its parts, bound here (no extra call on the hot path).
    """

    def __init__(self, config: FlashConfig, arena, engine):
        self.state = state = HostState(config, arena, engine)
        self.arena = arena
        self.engine = engine
        residency = Residency(state)
        recovery = Recovery(state, residency)
        telemetry = Telemetry(state, recovery.degraded_locked)
        registry = Registry(state, residency, telemetry)
        self.reads = reads = ReadPipeline(state, residency, recovery, telemetry)
        leases = Leases(state, residency, reads, recovery)
        self.telemetry = telemetry
        # lifecycle and config
        self.close = reads.close
        self.update_config = registry.update_config
        self.set_tunable = registry.set_tunable
        # clients
        self.connect = registry.connect
        self.disconnect = registry.disconnect
        self.connected = registry.connected
        self.kv_alloc = registry.kv_alloc
        self.kv_free = registry.kv_free
        # models
        self.resolve = registry.resolve
        self.open_model = registry.open_model
        self.close_model = registry.close_model
        self.save_access_counts = registry.save_access_counts
        self.unload = registry.unload
        self.set_plan = registry.set_plan
        # leases and reads
        self.acquire = leases.acquire
        self.acquire_async = leases.acquire_async
        self.release = leases.release
        self.prefetch = leases.prefetch
        self.load = leases.load
        # the read shape while a client imports (reads.py)
        self.hold_shallow = reads.hold_shallow
        self.end_shallow = reads.end_shallow
        self.imports_read_ahead = reads.imports_read_ahead
        self.read_outside = reads.read_outside
        state.disconnect_hooks.append(lambda cid: reads.end_shallow(cid, "it disconnected"))
        # device state (driven by daemon.recovery)
        self.set_device = recovery.set_device
        self.set_host_only = recovery.set_host_only
        self.device_models = recovery.device_models
        self.degraded_reasons = recovery.degraded_reasons
        # telemetry
        self.stats = telemetry.stats
        self.list_models = telemetry.list_models
        self.residency = telemetry.residency
        self.snapshot = telemetry.snapshot
        self.report_stream = telemetry.report_stream
        self.report_kv = telemetry.report_kv
        self.clients_of_pid = telemetry.clients_of_pid
        self.load_samples = telemetry.load_samples

    @property
    def config(self) -> FlashConfig:
        return self.state.config

    @property
    def generation(self) -> int:
        """Bumped on every state change (the status publisher polls it)."""
        return self.state.generation

    @property
    def counters(self) -> dict:
        return self.state.counters

    @property
    def load_log(self):
        """Completed reads, oldest first: tuples ``telemetry.LOAD_FIELDS``."""
        return self.telemetry.load_log

    # --- the tiers above ------------------------------------------------------------------------
    def on_disconnect(self, hook) -> None:
        """Call ``hook(client_id)`` (outside the lock) after a client is gone and its leases are
        released -- how the tiers above drop their per-client state."""
        self.state.disconnect_hooks.append(hook)

    def on_open(self, hook) -> None:
        """Call ``hook(model_name, store_path)`` (outside the lock) when a model is first opened --
        how the recovery tier maps the store to its block device."""
        self.state.open_hooks.append(hook)

    def on_device_error(self, hook) -> None:
        """Call ``hook(model_name, error)`` (outside the lock) when a read fails in a way that
        points at the device rather than at one block (EIO, ENXIO, a vanished file)."""
        self.state.device_error_hooks.append(hook)

    def add_copy_source(self, source) -> None:
        """A tier that may hold a good copy of a block: ``source(model_name, block_info, dest)``
        writes the payload into ``dest`` (a memoryview of the block's length) and returns True, or
        returns False. Called under the manager's lock on the recovery path only; it must not call
        back into the manager. The copy is checked against the block's crc32c before it is served."""
        self.state.copy_sources.append(source)
