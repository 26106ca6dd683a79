"""What the host tier tells operators: counters, the load log, streaming reports, the snapshot.

Reads only: every figure comes from ``HostState`` in one consistent read under its lock. The
load log (the profiler's source) is appended on the IO completion thread; streaming clients'
cumulative counters arrive through ``report_stream`` and are folded into totals when they leave.
"""
from __future__ import annotations

import collections
import itertools
import os
import time

from .host_state import DAEMON_CLIENT, RESIDENT, BlockState, HostState

# Counters a streaming client reports (cumulative per client and model).
STREAM_COUNTERS = ("prefetch_hits", "prefetch_miss_count_stream", "fabric_stall_cycles",
                   "fabric_stall_us", "bytes_streamed")
# What a client's tiered KV cache reports (deepseek_flash.kv, ``report_kv``): gauges of the bytes
# it holds per tier and its cumulative page fetches.
KV_GAUGES = ("tokens", "gpu_bytes", "host_bytes", "spilled_bytes", "full_bytes",
             "level1_tokens", "level2_tokens", "level3_tokens", "level3_bytes_saved")
KV_COUNTERS = ("pages_fetched", "demotions", "promotions", "recalls")
# Completed block loads kept for `profile` (flash-profiler): ~100 B each, so ~10 MiB at most.
LOAD_LOG_SIZE = 100_000
LOAD_FIELDS = ("seq", "time", "client", "pid", "model", "block", "layer", "role", "latency_us", "bytes")


class Telemetry:
    """Counters, load log and snapshots of one host tier."""

    def __init__(self, state: HostState, degraded_locked):
        self.s = state
        self._degraded_locked = degraded_locked      # () -> reasons, under the lock
        # Streaming clients report their slot-ring counters: (client, model) -> latest report,
        # plus the totals of clients that are gone.
        self.streams: dict[tuple, dict] = {}
        self._stream_totals = dict.fromkeys(STREAM_COUNTERS, 0)
        # Tiered KV caches of clients: (client, model, cache) -> latest report; a cache that
        # closes (or whose client leaves) drops its gauges and folds its counters into totals.
        self.kv: dict[tuple, dict] = {}
        self._kv_totals = dict.fromkeys(KV_COUNTERS, 0)
        # Completed reads, oldest first (see ``load_samples``); appended on the completion thread.
        self.load_log: collections.deque = collections.deque(maxlen=LOAD_LOG_SIZE)
        self._load_seq = itertools.count(1)

    # --- load profile (flash-profiler) ----------------------------------------------------------
    def record_load_locked(self, block: BlockState) -> None:
        cid, pid = block.requester
        info = block.info
        self.load_log.append((next(self._load_seq), time.time(), cid, os.getpid() if pid is None else pid,
                              block.model.name, info.id, info.layer, info.role,
                              (time.monotonic_ns() - block.submitted_ns) // 1000, info.length))

    def clients_of_pid(self, pid: int) -> list[int]:
        """Ids of the connected clients whose process is ``pid`` (SO_PEERCRED at connect; clients
        without a peer pid -- the embedded one, the daemon's own -- count as this process)."""
        with self.s.lock:
            return sorted(c.id for c in self.s.clients.values()
                          if c.id != DAEMON_CLIENT and c.info.get("pid", os.getpid()) == pid)

    def load_samples(self, pid: int | None = None, after: int = 0, since: float = 0.0,
                     limit: int = 10_000) -> list[tuple]:
        """Completed block loads with sequence number > ``after`` and wall time > ``since``
        (for ``pid``'s requests, or everyone's): tuples ``LOAD_FIELDS``, oldest first, at most
        ``limit``. Latency is submit to the engine -> completion seen by the completion thread."""
        with self.s.lock:
            if self.load_log and self.load_log[-1][0] <= after:
                return []
            log_copy = list(self.load_log)
        out = [s for s in log_copy if s[0] > after and s[1] > since and (pid is None or s[3] == pid)]
        return out[:limit]

    # --- streaming reports ------------------------------------------------------------------------
    def report_stream(self, client_id: int, model: str, stats: dict) -> None:
        """Record a streaming client's cumulative counters (see ``client.stream``)."""
        with self.s.lock:
            self.s.client(client_id)
            self.s.model(model)
            counts = dict(stats, prefetch_miss_count_stream=stats.get("prefetch_miss_count", 0))
            self.streams[(client_id, model)] = {
                **{k: int(counts.get(k, 0)) for k in STREAM_COUNTERS},
                "prefetch_window": int(stats.get("prefetch_window", 0)),
                "decisions": list(stats.get("decisions", []))[-8:]}
            self.s.generation += 1

    def client_gone_locked(self, client_id: int) -> None:
        """Fold a departed client's streaming and KV reports into the totals."""
        for key in [k for k in self.streams if k[0] == client_id]:
            report = self.streams.pop(key)
            for k in STREAM_COUNTERS:
                self._stream_totals[k] += report[k]
        for key in [k for k in self.kv if k[0] == client_id]:
            self._kv_gone_locked(key)

    # --- tiered KV caches ---------------------------------------------------------------------
    def report_kv(self, client_id: int, model: str, stats: dict) -> None:
        """Record a client's tiered KV cache stats (``deepseek_flash.kv``; docs/kv.md): ``cache``
        (the client's id for it), the ``KV_GAUGES`` and ``KV_COUNTERS`` now, and ``closed``
        (true on the last report: the cache let its memory go)."""
        with self.s.lock:
            self.s.client(client_id)
            self.s.model(model)
            key = (client_id, model, int(stats.get("cache") or 0))
            self.kv[key] = {k: int(stats.get(k) or 0) for k in KV_GAUGES + KV_COUNTERS}
            self.kv[key]["level_tokens"] = [list(lv) for lv in stats.get("level_tokens") or ()]
            if stats.get("closed"):
                self._kv_gone_locked(key)
            self.s.generation += 1

    def _kv_gone_locked(self, key) -> None:
        report = self.kv.pop(key)
        for k in KV_COUNTERS:
            self._kv_totals[k] += report[k]

    def _kv_stats_locked(self, model: str | None = None) -> dict:
        """``kv_*`` fields: gauges summed over the live caches (of ``model``, or all), page fetches
        of every cache ever reported (for all models only: a closed cache's model may be gone)."""
        live = [r for (cid, name, _), r in self.kv.items() if model is None or name == model]
        out = {"caches": len(live), **{k: sum(r[k] for r in live) for k in KV_GAUGES}}
        out["arena_bytes"] = sum(nbytes for c in self.s.clients.values()
                                 for name, nbytes in c.kv_regions.values()
                                 if model is None or name == model)
        for k in KV_COUNTERS:
            out[k] = sum(r[k] for r in live) + (self._kv_totals[k] if model is None else 0)
        if model is not None:
            out["level_tokens"] = _layer_levels(r["level_tokens"] for r in live)
        return out

    def _stream_counts(self) -> dict:
        out = dict(self._stream_totals)
        for report in self.streams.values():
            for k in STREAM_COUNTERS:
                out[k] += report[k]
        return out

    # --- introspection ------------------------------------------------------------------------
    def stats(self) -> dict:
        with self.s.lock:
            return self.stats_locked()

    def stats_locked(self) -> dict:
        s = self.s
        c = dict(s.counters)
        stream = self._stream_counts()
        c.update(stream)
        # Host-tier acquires and GPU slot prefetches both count: a hit is data that was there
        # before it was needed.
        hits = c["hits"] + stream["prefetch_hits"]
        misses = c["misses"] + stream["prefetch_miss_count_stream"]
        c["prefetch_hit_rate"] = hits / (hits + misses) if hits + misses else 1.0
        c["prefetch_miss_count"] = misses
        c["block_eviction_count"] = c["evictions"]
        c["active_leases"] = sum(len(cl.leases) for cl in s.clients.values())
        c["connected_clients"] = len(s.clients) - 1
        c["host_bytes_used"] = s.arena.used
        c["host_bytes_total"] = s.arena.size
        c["resident_blocks"] = sum(1 for m in s.models.values() for b in m.blocks.values()
                                   if b.state == RESIDENT)
        c["loading_blocks"] = len(s.tokens)
        shape = getattr(s.engine, "shape", None)
        if shape is not None:
            c["read_depth"], c["read_request_bytes"] = int(shape[0]), int(shape[1])
        c["shallow_read_clients"] = len(s.shallow_holders())
        c["open_models"] = len(s.models)
        c["quarantined_blocks"] = sum(1 for m in s.models.values() for b in m.blocks.values()
                                      if b.quarantined)
        c["host_only_models"] = sum(1 for m in s.models.values() if m.host_only is not None)
        kv = self._kv_stats_locked()
        c.update(kv_caches=kv["caches"], kv_gpu_bytes=kv["gpu_bytes"], kv_host_bytes=kv["host_bytes"],
                 kv_spilled_bytes=kv["spilled_bytes"], kv_pages_fetched=kv["pages_fetched"],
                 kv_arena_bytes=kv["arena_bytes"],
                 **{f"kv_{k}": kv[k] for k in ("level1_tokens", "level2_tokens", "level3_tokens",
                                               "demotions", "promotions", "recalls",
                                               "level3_bytes_saved")})
        return c

    def list_models(self) -> list[dict]:
        with self.s.lock:
            return [self._model_summary(m) for m in self.s.models.values()]

    def _model_summary(self, m) -> dict:
        resident = [b for b in m.blocks.values() if b.state == RESIDENT]
        streams = [r for (cid, name), r in self.streams.items() if name == m.name]
        return {"plan": dict(m.plan),
                "streaming_clients": len(streams),
                "prefetch_window": max((r["prefetch_window"] for r in streams), default=None),
                "prefetch_decisions": streams[-1]["decisions"] if streams else [],
                "name": m.name, "path": m.path, "state": "failed" if m.failed else "open",
                "blocks": len(m.blocks), "resident_blocks": len(resident),
                "resident_bytes": sum(b.info.length for b in resident),
                "total_bytes": m.store.total_bytes, "num_layers": m.store.num_layers,
                **_quantization(m.store),
                "leased_blocks": sum(1 for b in m.blocks.values() if b.refs),
                "clients": sorted(c.id for c in self.s.clients.values() if m.name in c.handles),
                "error": str(m.failed) if m.failed else None,
                "error_recovery_mode": m.config.error_recovery_mode,
                "quarantined_blocks": sorted(b.info.id for b in m.blocks.values() if b.quarantined),
                "unified_memory_fabric": "HOST_ONLY" if m.host_only is not None else "ENABLED",
                "host_only_reason": m.host_only,
                **{f"device_{k}": v for k, v in m.device.items()},
                "kv": self._kv_stats_locked(m.name)}

    def residency(self, name: str) -> dict[int, str]:
        """block id -> "absent" | "loading" | "resident" for one open model."""
        with self.s.lock:
            return {bid: b.state for bid, b in self.s.model(name).blocks.items()}

    def snapshot(self) -> dict:
        """Everything the status tree shows, in one consistent read: the sections ``status``,
        ``stats``, ``devices``, ``models``, ``tunables`` (the StatusTree publisher's layout)."""
        with self.s.lock:
            stats = self.stats_locked()
            models = {}
            for m in self.s.models.values():
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
                      "semantic_block_count": sum(len(m.blocks) for m in self.s.models.values()),
                      # The GPU tier registers itself above the host tier; alone this is host-only.
                      "unified_memory_fabric": "HOST_ONLY"}
            return {"status": status, "stats": stats, "devices": {}, "models": models,
                    "tunables": self.s.config.tunables()}


def _layer_levels(reports) -> dict:
    """Per layer, the tokens at levels 1, 2 and 3 summed over caches' ``level_tokens``:
    ``{"layer0": "l1 l2 l3", ...}`` (one status line per layer)."""
    sums: list[list[int]] = []
    for per_layer in reports:
        for i, lv in enumerate(per_layer):
            if i == len(sums):
                sums.append([0, 0, 0])
            for j in range(3):
                sums[i][j] += int(lv[j])
    return {f"layer{i}": " ".join(map(str, lv)) for i, lv in enumerate(sums)}


def _quantization(store) -> dict:
    """A model's quantization fields in its status entry (``none`` and 0 for a plain store):
    scheme, granularity, group size, where the weights were quantized (``pack``, ``host_tier``
    for an unquantized store quantized as its blocks are loaded, ``none``) and the payload bytes
    read from disk for the whole model (``total_bytes`` is what the tiers hold)."""
    from ..quant.scheme import quantized_at

    quant = store.quant
    source = getattr(store, "source", store)
    fields = {"quantized_at": quantized_at(store), "disk_bytes": source.total_bytes}
    if not quant:
        return {"quantization_scheme": "none", "quantization_granularity": "none",
                "quantization_group_size": 0, **fields}
    return {"quantization_scheme": quant["scheme"], "quantization_granularity": quant["granularity"],
            "quantization_group_size": quant["group_size"], **fields}
