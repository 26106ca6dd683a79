"""Requests on the host tier: acquire (a lease), release, prefetch and whole-model load.

An acquire pins the blocks, allocates arena space for the absent ones (``residency``, evicting
under the lock, which only touches Python state), asks ``prefetch_window`` stages ahead, and
submits one IO batch (``reads``). It returns an already-resolved future when every block was
resident (the warm path: no IO, no condition variable) or a ``concurrent.futures.Future`` that
the completion thread resolves. A block of a host-only model or a quarantined block is served
without the disk (``read_errors``) or fails at once, typed.
"""
from __future__ import annotations

from concurrent.futures import Future

from ..errors import FlashError, LeaseError, LimitExceeded, NotResident, UnknownBlock
from ..wire import Lease
from .host_state import (
    ABSENT,
    DAEMON_CLIENT,
    LOADING,
    HostState,
    Resolved,
    Ticket,
    resolve_futures,
)


class Leases:
    """acquire / release / prefetch / load of one host tier."""

    def __init__(self, state: HostState, residency, reads, recovery):
        self.s = state
        self.residency = residency
        self.reads = reads
        self.recovery = recovery

    def acquire(self, client_id, model, blocks=None, layer=None, priority: int = 0, wait: bool = True,
                timeout: float | None = None) -> Lease:
        """Blocking acquire (the embedded client's path)."""
        return self.acquire_async(client_id, model, blocks, layer, priority, wait).result(timeout)

    def acquire_async(self, client_id, model, blocks=None, layer=None, priority: int = 0,
                      wait: bool = True, requester: int | None = None) -> Future:
        """Lease ``blocks`` (or every block of ``layer``) of ``model``; a Future of the ``Lease``
        (a ``Resolved`` one when every block was resident).

        The reads of a higher ``priority`` go to the disk before waiting reads of a lower one
        (``reads.ReadPipeline``; 0 by default, a load's own). With ``wait=False`` an
        acquire that would have to read raises ``NotResident`` after starting those reads.
        ``requester``: the client whose request this acquire serves, when another holds the lease
        (a shared GPU load holds its leases as the daemon): the reads count as that client's in
        the profiler's load log.
        """
        s = self.s
        with s.lock:
            client = s.client(client_id)
            m = s.model(model)
            if m.failed is not None:
                # A fresh instance: the recorded one may be raised in several threads at once.
                raise type(m.failed)(m.failed.message, **m.failed.fields)
            ids = self.requested(m, blocks, layer)
            if len(client.leases) >= s.config.max_leases_per_client:
                raise LimitExceeded(f"client {client_id} holds {len(client.leases)} leases, the "
                                    f"maximum (max_leases_per_client); release some first",
                                    limit=s.config.max_leases_per_client)
            wanted = self._pin_locked(m, ids)
            protect: set = set()
            batch = self._make_resident_locked(m, wanted, protect)
            if layer is not None:
                handle = client.handles.get(m.name)
                window = (handle.config if handle else m.config).prefetch_window
                if window:
                    batch += self.prefetch_locked(m, m.order.stages_after(layer, window), protect)
            self.reads.submit_locked(batch, client_id if requester is None else requester, priority)
            s.generation += 1
            pending = [b for b in wanted if b.state == LOADING]
            if pending:
                # Blocks queued earlier at a lower priority (a prefetch hint, another load) are
                # read at this acquire's priority.
                self.reads.promote_locked(pending, priority)
            else:
                # The common, warm case: no Future, no ticket.
                return Resolved(self.residency.grant(client, m, wanted))
            if not wait:
                self.residency.unpin(m, [b.info.id for b in wanted])
                raise NotResident(f"model {m.name}: {len(pending)} of {len(wanted)} blocks are being "
                                  f"read from disk (first: block {pending[0].info.id}); retry",
                                  model=m.name, blocks=[b.info.id for b in pending])
            ticket = Ticket(client, m, ids, wanted, make_lease=True)
            ticket.remaining = len(pending)
            for b in pending:
                b.waiters.append(ticket)
        return ticket.future

    def _pin_locked(self, m, ids) -> list:
        """Take a reference on each wanted block and count the hit or miss."""
        s = self.s
        s.tick += 1
        tick = s.tick
        wanted = [m.blocks[i] for i in ids]
        counters = s.counters
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
        return wanted

    def _make_resident_locked(self, m, wanted, protect: set) -> list:
        """Arena space for the absent wanted blocks and their dependencies; returns the blocks to
        read. ``protect`` gains what must not be evicted meanwhile. On failure the pins of
        ``wanted`` are dropped and the typed error raised."""
        to_load = [b for b in wanted if b.state == ABSENT]
        to_load += [d for b in wanted for d in b.dep_blocks if d.state == ABSENT]
        if not to_load:
            return []
        protect.update(wanted)
        protect.update(d for b in wanted for d in b.dep_blocks)
        if m.host_only or any(b.quarantined for b in to_load):
            # No disk read for these: another tier's copy, or a typed error at once.
            try:
                self.recovery.serve_without_disk_locked(m, to_load, set(wanted), protect)
            except FlashError:
                self.residency.unpin(m, [b.info.id for b in wanted])
                self.s.counters["failed_requests"] += 1
                raise
            to_load = [b for b in to_load if b.state == ABSENT and not b.quarantined
                       and not m.host_only]
            if not to_load:
                return []
        try:
            return self.residency.allocate(to_load, protect, prefetch=False)
        except FlashError:
            self.residency.unpin(m, [b.info.id for b in wanted])
            raise

    def requested(self, m, blocks, layer) -> list[int]:
        """Block ids of an acquire or prefetch: ``layer``'s blocks and/or ``blocks``, checked."""
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
        s = self.s
        with s.lock:
            client = s.client(client_id)
            lease = client.leases.pop(lease_id, None)
            if lease is None:
                raise LeaseError(f"client {client_id} holds no lease {lease_id}", lease=lease_id)
            model = s.models.get(lease.model)
            self.residency.unpin(model, lease.blocks)
            if model is not None and model.deferred:
                self.reads.submit_locked(self.prefetch_locked(model, model.deferred, set()), client_id)
            s.generation += 1

    # --- prefetch / warm-up -------------------------------------------------------------------
    def prefetch(self, model: str, layers=None, blocks=None, client_id: int = DAEMON_CLIENT) -> int:
        """Start reading the blocks of ``layers`` (and ``blocks``) ahead of use; returns how many
        reads were started. Advisory: blocks that do not fit without evicting leased, hot or
        still-unused prefetched blocks are skipped."""
        s = self.s
        with s.lock:
            m = s.model(model)
            ids = []
            for layer in layers or []:
                ids += self.requested(m, None, layer)
            if blocks:
                ids += self.requested(m, blocks, None)
            batch = self.prefetch_locked(m, ids, set())
            self.reads.submit_locked(batch, client_id)
            s.generation += 1
            return len(batch)

    def prefetch_locked(self, m, ids, protect) -> list:
        if m.host_only:
            return []
        absent = [m.blocks[i] for i in ids if m.blocks[i].state == ABSENT and not m.blocks[i].quarantined]
        batch = self.residency.allocate(absent, protect, prefetch=True)
        for b in batch:
            b.prefetched = True
        self.s.counters["prefetch_issued"] += len(batch)
        self.s.counters["prefetch_dropped"] += len(absent) - len(batch)
        # What did not fit is retried when a lease on this model is released (a streaming client
        # releases the layer behind it, which is exactly the room the window needs).
        m.deferred = [b.info.id for b in absent[len(batch):]]
        return batch

    def load(self, model: str, client_id: int = DAEMON_CLIENT) -> Future:
        """Read every block of ``model`` that fits (forward order); a Future of a summary dict."""
        s = self.s
        resolved = []
        with s.lock:
            m = s.model(model)
            absent = [] if m.host_only else [b for b in m.blocks.values()
                                             if b.state == ABSENT and not b.quarantined]
            batch = self.residency.allocate(absent, set(), prefetch=True)
            self.reads.submit_locked(batch, client_id)
            ticket = Ticket(s.clients[DAEMON_CLIENT], m, [], [], make_lease=False)
            pending = [b for b in m.blocks.values() if b.state == LOADING]
            ticket.remaining = len(pending)
            for b in pending:
                b.waiters.append(ticket)
            if not pending:
                resolved.append((ticket.future, self.reads.finish_locked(ticket)))
            s.generation += 1
        resolve_futures(resolved)
        return ticket.future

