"""Where eviction is decided: arena space for blocks, pins, leases, and what leaves first.

A block is pinned while a lease (or a pending acquire) holds it (``refs``), while it is loading,
and while a residency plan names it; such blocks never leave. Everything else is a candidate:
``lru`` sends the least recently used first, ``access_frequency_weighted`` the fewest uses
(observed plus the store's packed ``access_freq``). Eviction is soft above
``eviction_threshold`` (cold blocks only) and hard when an allocation does not fit (hot blocks
last, never for a prefetch). All methods expect the caller to hold ``HostState.lock``.
"""
from __future__ import annotations

from ..errors import ArenaFull, BudgetTooSmall, FlashError, OutOfMemory
from ..wire import Lease
from .host_state import ABSENT, LOADING, RESIDENT, BlockState, HostState, aligned, fmt_bytes


class Residency:
    """Arena space and eviction of the host tier (under the caller's ``HostState.lock``)."""

    def __init__(self, state: HostState):
        self.s = state

    def check_budget(self, store) -> None:
        """BudgetTooSmall when the arena cannot hold one decoder layer or the largest block."""
        size = self.s.arena.size
        per_layer: dict[int, int] = {}
        largest = None
        for b in store.blocks:
            if b.layer >= 0:
                per_layer[b.layer] = per_layer.get(b.layer, 0) + aligned(b.length)
            if largest is None or b.length > largest.length:
                largest = b
        layer, layer_bytes = max(per_layer.items(), key=lambda kv: kv[1], default=(-1, 0))
        if layer_bytes > size:
            raise BudgetTooSmall(
                f"model {store.name}: host_cache_bytes {fmt_bytes(size)} ({size} bytes) is smaller than "
                f"one decoder layer: layer {layer} needs {fmt_bytes(layer_bytes)} ({layer_bytes} bytes)",
                budget=size, needed=layer_bytes, model=store.name, layer=layer)
        if largest is not None and aligned(largest.length) > size:
            need = aligned(largest.length)
            raise BudgetTooSmall(
                f"model {store.name}: host_cache_bytes {fmt_bytes(size)} ({size} bytes) cannot hold "
                f"block {largest.id} ({largest.role}) of {fmt_bytes(need)} ({need} bytes)",
                budget=size, needed=need, model=store.name, block_id=largest.id)

    # --- leases ------------------------------------------------------------------------------------
    def grant(self, client, m, blocks) -> Lease:
        s = self.s
        lease = Lease(next(s.lease_ids), m.name, {b.info.id: b.offset for b in blocks}, client.id)
        client.leases[lease.id] = lease
        s.counters["leases_granted"] += 1
        return lease

    @staticmethod
    def unpin(model, block_ids) -> None:
        if model is None:
            return
        for bid in block_ids:
            model.blocks[bid].refs -= 1

    # --- allocation and eviction -------------------------------------------------------------------
    def allocate(self, blocks, protect, prefetch: bool) -> list:
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
                    self.s.arena.free(b.offset)
                    b.offset, b.state = -1, ABSENT
                raise offset
            block.offset = offset
            block.state = LOADING
            block.error = None
            protect.add(block)
            done.append(block)
        return done

    def _make_room(self, block: BlockState, protect, prefetch: bool):
        need = aligned(block.info.length)
        offset = self._room(need, protect, prefetch)
        if offset is not None or prefetch:
            return offset
        return self._out_of_memory(
            need, f"block {block.info.id} ({block.info.role}, layer {block.info.layer}) of model "
            f"{block.model.name}", model=block.model.name, block_id=block.info.id)

    def reserve(self, nbytes: int, what: str, **fields) -> int:
        """Arena space of ``nbytes`` for a client's own data (a tiered KV cache's pages), made
        as a demand load makes room (unleased cold blocks first, hot ones last); raises
        OutOfMemory naming ``what`` when everything in the way is leased. Under the lock."""
        need = aligned(nbytes)
        offset = self._room(need, set(), False)
        if offset is None:
            raise self._out_of_memory(need, what, **fields)
        return offset

    def _room(self, need: int, protect, prefetch: bool):
        """An arena offset for ``need`` bytes, evicting as needed; None when it cannot fit."""
        arena = self.s.arena
        limit = self.s.config.eviction_threshold * arena.size
        # Soft pass: keep the arena under the threshold, evicting cold (non-hot) blocks only.
        if arena.used + need > limit:
            for victim in self.candidates(protect, hot=False, prefetch=prefetch):
                self.evict(victim)
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
            for victim in self.candidates(protect, hot=hot, prefetch=prefetch):
                self.evict(victim)
                try:
                    return arena.alloc(need)
                except ArenaFull:
                    continue
        return None

    def _out_of_memory(self, need: int, what: str, **fields) -> OutOfMemory:
        arena = self.s.arena
        leased = sum(aligned(b.info.length) for m in self.s.models.values() for b in m.blocks.values()
                     if b.refs and b.state != ABSENT)
        return OutOfMemory(
            f"host tier full: {what} needs {fmt_bytes(need)}; {fmt_bytes(arena.used)} of "
            f"{fmt_bytes(arena.size)} in use, {fmt_bytes(leased)} of it leased or loading, largest "
            f"free extent {fmt_bytes(arena.largest_free())}; release leases or raise host_cache_bytes",
            **fields, needed=need, used=arena.used, budget=arena.size, leased=leased,
            largest_free=arena.largest_free())

    def candidates(self, protect, hot: bool, prefetch: bool) -> list:
        """Blocks that may be evicted now, first to go first."""
        policy = self.s.config.block_eviction_policy
        out = []
        for m in self.s.models.values():
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

    def evict(self, block: BlockState) -> None:
        self.drop(block)
        self.s.counters["evictions"] += 1

    def drop(self, block: BlockState) -> None:
        self.s.arena.free(block.offset)
        block.offset = -1
        block.state = ABSENT
        block.prefetched = False

    def evict_to_threshold(self) -> None:
        arena = self.s.arena
        limit = self.s.config.eviction_threshold * arena.size
        if arena.used <= limit:
            return
        for victim in self.candidates(set(), hot=False, prefetch=True):
            if arena.used <= limit:
                break
            self.evict(victim)
