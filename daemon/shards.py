"""The ``shard`` op: one tensor-parallel rank's shard of a model, derived once, served as a model.

A process of a tensor-parallel world asks for ``(model, rank, world)``. The first time, the
daemon reads the source store block by block and writes the rank's shard as a store of its own
(``store.shard.derive``: column splits are byte ranges of the stored rows, row splits a strided
read, the rest replicated) under ``<state dir>/shards/<metadata digest>/<model>.tp<r>of<w>``; the
digest of the source's ``flash_metadata.bin`` keys it, so a repacked or defragmented source gets
new shards. Then -- and every later time, also after a daemon restart -- the shard store is
opened for the client like any model: host tier, GPU arena of the client's device, CUDA IPC views,
streaming under a budget. The process never acquires a byte outside its shard.

A derivation runs on its own thread (``flash-shard-...``) and answers with a Future, so the
daemon's loop keeps serving; ranks asking for the same shard at once share one derivation.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import Future
from pathlib import Path

from ..errors import FlashError, ShardError, StoreExists
from ..store import Store
from ..store.format import METADATA_FILE
from ..store.shard import check_world, derive
from .host_state import DAEMON_CLIENT

log = logging.getLogger("deepseek_flash.shards")


def digest(store: Store) -> str:
    """What names a source's shards: its metadata's bytes (offsets, crc32c of every block)."""
    return hashlib.sha256((store.path / METADATA_FILE).read_bytes()).hexdigest()[:16]


class Shards:
    """Derives and opens tensor-parallel shards (see the module docstring)."""

    def __init__(self, manager, root: Path):
        self.manager = manager
        self.root = Path(root)
        self._lock = threading.Lock()
        self._building: dict[Path, Future] = {}
        self.derived = 0                          # shard stores written by this controller

    def path_of(self, store: Store, name: str, rank: int, world: int) -> Path:
        return self.root / digest(store) / f"{name}.tp{rank}of{world}"

    def shard(self, client_id: int, model: str, rank: int, world: int,
              flash_context: dict | None = None) -> dict | Future:
        """The wire ``ModelInfo`` of rank ``rank``'s shard (opened for the client), or a Future
        of it while the shard is derived."""
        info = self.manager.open_model(client_id, model)     # the caller may open the source
        store = Store.open(info.path)
        check_world(store.config, world, rank, quantized=store.quant is not None, model=info.name)
        out = self.path_of(store, info.name, rank, world)
        if out.exists():
            return self._open(client_id, out, flash_context)
        with self._lock:
            building = self._building.get(out)
            if building is None:
                building = self._building[out] = Future()
                threading.Thread(target=self._derive, args=(store, rank, world, out, building),
                                 daemon=True, name=f"flash-shard-{info.name}-{rank}of{world}").start()
        result: Future = Future()

        def opened(done: Future) -> None:
            try:
                done.result()
                result.set_result(self._open(client_id, out, flash_context))
            except BaseException as exc:   # noqa: BLE001 -- delivered to the client, typed
                result.set_exception(exc)

        building.add_done_callback(opened)
        return result

    def _derive(self, store: Store, rank: int, world: int, out: Path, done: Future) -> None:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            log.info("deriving tensor-parallel shard %d of %d of %s at %s", rank, world,
                     store.name, out)
            try:
                derive(store, rank, world, out)
                self.derived += 1
            except StoreExists:
                pass        # another controller (or an earlier run) wrote it meanwhile
            done.set_result(out)
        except FlashError as exc:
            done.set_exception(exc)
        except Exception as exc:   # noqa: BLE001 -- any failure reaches the client typed
            log.exception("deriving %s failed", out)
            done.set_exception(ShardError(f"deriving shard {rank} of {world} of {store.name} "
                                          f"failed: {type(exc).__name__}: {exc}", world=world,
                                          rank=rank, path=str(out)))
        finally:
            with self._lock:
                self._building.pop(out, None)

    def _open(self, client_id: int, out: Path, flash_context: dict | None) -> dict:
        # The daemon opens its own derived store (a path under its state directory, which an
        # untrusted peer could not name); the client then opens it by name, as any model.
        name = self.manager.open_model(DAEMON_CLIENT, str(out)).name
        return self.manager.open_model(client_id, name, flash_context).to_wire()
