"""Who and what the host tier serves: clients, open models, per-open configs, plans.

Opening a model resolves its name (registered names, names under ``store_roots`` that never
resolve outside their root, absolute paths), opens the store outside the lock, checks that its
data files lie inside it and that the host arena can hold a layer, and registers it once (two
opens of one directory share it). Closing and unloading release what a client or a model holds;
block uses are folded into the store's ``access_freq`` at unload (what ``defrag`` orders by).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ..errors import FlashError, LeaseError, StoreInUse, UnknownBlock, UnknownModel
from ..quant.scheme import check_served, quantized_at
from ..wire import ModelInfo
from .config import _NAME as MODEL_NAME_RE
from .config import MODEL_SCOPE, FlashConfig, check_tunable
from .host_state import (
    LOADING,
    RESIDENT,
    ClientState,
    HandleState,
    HostState,
    ModelState,
    aligned,
    fmt_bytes,
)

log = logging.getLogger("deepseek_flash.block_manager")


def check_data_files(store) -> None:
    """Every data file a store's metadata names lies inside the store directory: metadata is
    input too, and must not make the daemon read (and serve) a file elsewhere."""
    root = os.path.realpath(store.path)
    for name in sorted({b.file for b in store.blocks}):
        real = os.path.realpath(os.path.join(root, name))
        if not real.startswith(root + os.sep):
            raise UnknownModel(f"{store.path}: block data file {name!r} resolves to {real}, outside the "
                               f"store directory; refusing to serve it", model=store.name, file=name)


class Registry:
    """Clients and models of one host tier."""

    def __init__(self, state: HostState, residency, telemetry):
        self.s = state
        self.residency = residency
        self.telemetry = telemetry

    # --- config ----------------------------------------------------------------------------------
    def update_config(self, config: FlashConfig) -> None:
        """Apply a reloaded or tuned config to the daemon and every open model and handle."""
        s = self.s
        with s.lock:
            if config.host_cache_bytes != s.config.host_cache_bytes:
                log.warning("host_cache_bytes changed to %s; the arena keeps %s until restart",
                            fmt_bytes(config.host_cache_bytes), fmt_bytes(s.arena.size))
            s.config = config
            for model in s.models.values():
                model.config = config.override(model.file_overrides, scope="model")
            for client in s.clients.values():
                for handle in client.handles.values():
                    handle.config = handle.model.config.override(handle.context, scope="model")
            self.residency.evict_to_threshold()
            s.generation += 1

    def set_tunable(self, key: str, value) -> tuple:
        parsed = check_tunable(key, value)
        old = self.s.config[key]
        self.update_config(self.s.config.override({key: parsed}))
        return old, parsed

    # --- clients -----------------------------------------------------------------------------
    def connect(self, info: dict | None = None) -> int:
        s = self.s
        with s.lock:
            cid = next(s.client_ids)
            s.clients[cid] = ClientState(cid, info or {})
            s.generation += 1
            return cid

    def disconnect(self, client_id: int) -> int:
        """Forget a client and release every lease it holds; returns the number released."""
        s = self.s
        with s.lock:
            client = s.clients.pop(client_id, None)
            if client is None:
                return 0
            client.connected = False
            released = len(client.leases)
            for lease in client.leases.values():
                self.residency.unpin(s.models.get(lease.model), lease.blocks)
            client.leases.clear()
            for offset in client.kv_regions:
                s.arena.free(offset)
            client.kv_regions.clear()
            self.telemetry.client_gone_locked(client_id)
            s.generation += 1
        if released:
            log.info("client %s (%s) gone: released %d leases", client_id, client.info, released)
        for hook in s.disconnect_hooks:
            try:
                hook(client_id)
            except Exception:   # one tier's bug must not keep the others from cleaning up
                log.exception("disconnect hook %r failed for client %s", hook, client_id)
        return released

    # --- host memory a client holds for itself (a tiered KV cache's pages) ------------------------
    def kv_alloc(self, client_id: int, model: str, nbytes: int) -> int:
        """Arena space of ``nbytes`` for the KV pages of ``client_id``'s cache on open ``model``
        (made as a demand load makes room; OutOfMemory when all in the way is leased); the arena
        offset. Freed by ``kv_free`` or when the client leaves."""
        s = self.s
        if nbytes <= 0:
            raise FlashError(f"kv_alloc: {nbytes} bytes")
        with s.lock:
            client = s.client(client_id)
            s.model(model)
            offset = self.residency.reserve(
                nbytes, f"KV pages of client {client_id} on model {model}", model=model)
            client.kv_regions[offset] = (model, aligned(nbytes))
            s.generation += 1
            return offset

    def kv_free(self, client_id: int, offset: int) -> int:
        """Give back a region ``kv_alloc`` returned; its bytes."""
        s = self.s
        with s.lock:
            client = s.client(client_id)
            region = client.kv_regions.pop(offset, None)
            if region is None:
                raise LeaseError(f"client {client_id} holds no KV region at arena offset {offset}",
                                 offset=offset)
            s.arena.free(offset)
            s.generation += 1
            return region[1]

    def connected(self, client_id: int) -> bool:
        with self.s.lock:
            return client_id in self.s.clients

    # --- models ------------------------------------------------------------------------------
    def resolve(self, name_or_path: str, trusted: bool = True) -> Path:
        """The store directory for a registered name, a name under ``store_roots``, or an
        absolute path. Names never reach outside their root (no '..', no symlink escapes). An
        untrusted caller (a peer that is neither root nor the daemon's user) may name an absolute
        path only when it resolves inside a store root: the daemon must not read, on its behalf,
        files that the peer could not read itself."""
        config = self.s.config
        text = str(name_or_path)
        registry = config.models
        if text in registry:
            return Path(registry[text])
        if os.path.isabs(text):
            if not trusted:
                real = os.path.realpath(text)
                if not any(real.startswith(os.path.realpath(root) + os.sep)
                           for root in config.store_roots):
                    raise UnknownModel(f"{text!r}: absolute store paths outside store_roots "
                                       f"{config.store_roots} are only accepted from root or the "
                                       f"daemon's user; open it by name", model=text)
            return Path(text)
        if not MODEL_NAME_RE.fullmatch(text) or any(p in (".", "..") for p in text.split("/")):
            raise UnknownModel(f"{text!r} is not a model name (letters, digits, '.', '_', '-', '/'; "
                               f"no '..') nor an absolute store path", model=text)
        for root in config.store_roots:
            root_real = os.path.realpath(root)
            candidate = os.path.realpath(os.path.join(root_real, text))
            if candidate.startswith(root_real + os.sep) and os.path.isdir(candidate):
                return Path(candidate)
        raise UnknownModel(f"no model named {text!r}: not registered in `models` and not found under "
                           f"store_roots {config.store_roots}", model=text)

    def open_model(self, client_id: int, name_or_path, flash_context: dict | None = None) -> ModelInfo:
        """Open (or re-open) a model for a client with per-open ``flash_context`` overrides; None
        keeps the context of the client's open handle on it (a re-open from the controller)."""
        from ..store import Store

        s = self.s
        with s.lock:
            uid = s.client(client_id).info.get("uid")
            model = s.models.get(str(name_or_path))
            if model is None:
                config = s.config
        opened = None
        if model is None:
            path = self.resolve(name_or_path, trusted=uid is None or uid in (0, os.getuid()))
            real = os.path.realpath(path)
            with s.lock:
                model = next((m for m in s.models.values() if m.path == real), None)
            if model is None:
                from ..quant.host_tier import serving_store

                store = Store.open(real)   # file IO outside the lock
                check_data_files(store)
                mconfig, ignored = config.model_overrides(store.config, store.name)
                # The first open decides how the host tier holds the model: an unquantized store
                # with a scheme is quantized as its blocks enter the host tier.
                first = mconfig.override(dict(flash_context or {}), scope="model")
                store = serving_store(store, first.quantization_scheme,
                                      first.quantization_granularity, first.int4_layout)
                file_overrides = {k: v for k, v in (store.config.get("flash_config") or {}).items()
                                  if k not in ignored}
                self.residency.check_budget(store)
                with s.lock:
                    model = next((m for m in s.models.values() if m.path == real), None)
                    if model is None:
                        name = self._unique_name(store.name)
                        model = ModelState(name, store, mconfig, file_overrides, ignored)
                        model.path = real
                        s.models[name] = model
                        s.generation += 1
                        opened = model
                        log.info("opened model %s from %s (%d blocks, %s%s)", name, real,
                                 len(store.blocks), fmt_bytes(store.total_bytes),
                                 "" if quantized_at(store) != "host_tier" else
                                 f", quantized {store.spec.label()} as blocks enter the host tier")
        if opened is not None:
            for hook in s.open_hooks:
                try:
                    hook(opened.name, opened.path)
                except Exception:   # device discovery is advisory: the model still serves
                    log.exception("open hook %r failed for model %s", hook, opened.name)
        if flash_context is None:
            # A re-open from inside the controller (attach, read-ahead, load) keeps the context
            # the client opened the model with: its window must reach the attach's plan.
            with s.lock:
                held = s.client(client_id).handles.get(model.name)
            flash_context = held.context if held is not None and held.model is model else {}
        context = dict(flash_context)
        handle_config = model.config.override(context, scope="model")
        check_served(model.store.quant, handle_config.quantization_scheme,
                     handle_config.quantization_granularity, model.name, quantized_at(model.store))
        with s.lock:
            client = s.client(client_id)
            client.handles[model.name] = HandleState(model, context, handle_config)
            s.generation += 1
            return self._info(model, handle_config)

    def _unique_name(self, base: str) -> str:
        name, n = base, 2
        while name in self.s.models:
            name, n = f"{base}-{n}", n + 1
        return name

    @staticmethod
    def _info(model: ModelState, config: FlashConfig) -> ModelInfo:
        store = model.store
        return ModelInfo(name=model.name, path=model.path, config=store.config, blocks=store.blocks,
                         num_layers=store.num_layers, total_bytes=store.total_bytes,
                         flash_config={k: config[k] for k in MODEL_SCOPE},
                         plan=dict(model.plan), ignored_overrides=list(model.ignored))

    def close_model(self, client_id: int, name: str) -> int:
        """Drop a client's handle on a model and its leases on it; the blocks stay cached."""
        s = self.s
        with s.lock:
            client = s.client(client_id)
            model = s.model(name)
            client.handles.pop(name, None)
            mine = [lid for lid, lease in client.leases.items() if lease.model == name]
            for lid in mine:
                self.residency.unpin(model, client.leases.pop(lid).blocks)
            s.generation += 1
            return len(mine)

    def save_access_counts(self, name: str | None = None) -> int:
        """Fold the uses counted since the last save into each store's ``access_freq`` (what
        ``defrag`` orders by); all open models when ``name`` is None. Returns blocks updated. A
        store that cannot be written (read-only, under maintenance) keeps its counts for later."""
        from ..store.maintenance import add_access_counts

        s = self.s
        with s.lock:
            models = list(s.models.values()) if name is None else [s.model(name)]
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
            with s.lock:
                for bid, n in counts.items():
                    m.blocks[bid].saved_uses += n
            updated += len(counts)
        return updated

    def unload(self, name: str) -> dict:
        """Forget a model and free its host memory; refused while any block of it is leased."""
        self.save_access_counts(name)
        s = self.s
        with s.lock:
            model = s.model(name)
            busy = [b for b in model.blocks.values() if b.refs or b.state == LOADING]
            if busy:
                holders = {c.id for c in s.clients.values()
                           for lease in c.leases.values() if lease.model == name}
                raise StoreInUse(f"model {name}: {len(busy)} blocks are leased or loading (clients "
                                 f"{sorted(holders)}); release them before unloading",
                                 model=name, blocks=len(busy))
            freed = 0
            for block in model.blocks.values():
                if block.state == RESIDENT:
                    freed += aligned(block.info.length)
                    self.residency.drop(block)
            del s.models[name]
            for client in s.clients.values():
                client.handles.pop(name, None)
            s.counters["unloads"] += 1
            s.generation += 1
        log.info("unloaded model %s (%s freed)", name, fmt_bytes(freed))
        return {"model": name, "freed_bytes": freed}

    def set_plan(self, name: str, plan: dict) -> None:
        """Register a residency plan for a model. ``{"pin": [block ids]}`` keeps those blocks in
        the host tier once loaded (never evicted while the plan stands); other keys are kept for
        the tiers above (the GPU fabric) to read back from ``ModelInfo.plan``."""
        s = self.s
        with s.lock:
            model = s.model(name)
            pins = plan.get("pin", [])
            for bid in pins:
                if bid not in model.blocks:
                    raise UnknownBlock(f"model {name}: residency plan pins block {bid}, which does "
                                       f"not exist ({len(model.blocks)} blocks)", block_id=bid, model=name)
            model.plan = dict(plan)
            model.pinned = frozenset(pins)
            s.generation += 1
