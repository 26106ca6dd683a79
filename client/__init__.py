"""Client side: talk to the controller (daemon socket or embedded) and build models on its memory.

``Client()`` connects to ``deepseek-flashd`` when its socket answers and otherwise runs the
controller in this process (``embedded=True`` forces that, ``embedded=False`` forbids it). Either
way the methods, results and typed errors are the same. Over the socket the host arena arrives
once, as a file descriptor in the hello reply, and is mapped here; leases carry offsets into it.

When the daemon restarts, the next call reconnects (with backoff), maps the new arena, reopens the
models this client had open and re-acquires its leases; ``Lease`` objects are updated in place
and ``generation`` goes up, so code holding views can tell that offsets moved.
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from pathlib import Path

from .. import paths, protocol
from ..cuda import open_gpu_arena, register_host_memory, unregister_host_memory
from ..errors import (DaemonNotRunning, FlashError, PermissionDenied, ProtocolError, ShuttingDown,
                      UnknownOperation)
from ..wire import Lease, ModelInfo

log = logging.getLogger("deepseek_flash.client")

__all__ = ["Client", "Lease", "ModelInfo"]


# Operations that only let go of what the daemon holds for this client. Once the connection is
# lost that state died with the daemon, so they are answered here (None) instead of reconnecting:
# under socket activation a reconnect would start a stopped daemon just to be told so.
RELEASING_OPS = frozenset({"release", "detach", "close_model", "report_stream", "report_kv",
                           "kv_free", "imports_done"})


def _once(fn):
    """``fn`` that runs on its first call only."""
    done = []

    def call():
        if not done:
            done.append(True)
            fn()
    return call


class _SocketBackend:
    """One connection to the daemon, re-established after a daemon restart."""

    mode = "daemon"

    def __init__(self, path: Path, reconnect_timeout: float, on_reconnect, spin_us: float = 0.0,
                 connect_timeout: float = 5.0, handshake_timeout: float = 30.0):
        self.path = Path(path)
        self.spin_us = spin_us
        self.reconnect_timeout = reconnect_timeout
        self.connect_timeout = connect_timeout
        self.handshake_timeout = handshake_timeout
        self.closed = False
        self.on_reconnect = on_reconnect
        self.sock = None
        self.arena = None
        self.generation = 0
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._in_reconnect = False
        self._connect()

    def _connect(self) -> None:
        from .._core import HostArena

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(self.connect_timeout)
        try:
            sock.connect(str(self.path))
        except TimeoutError:
            sock.close()
            raise self._no_answer(self.connect_timeout, "connection to be accepted") from None
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise DaemonNotRunning(f"no deepseek-flashd at {self.path} ({exc.strerror})",
                                   socket=str(self.path)) from None
        except PermissionError:
            sock.close()
            raise PermissionDenied(f"{self.path}: permission denied (the socket's mode and group "
                                   f"decide who may connect)", socket=str(self.path)) from None
        except OSError:
            sock.close()
            raise
        try:
            # A listening socket whose daemon cannot start (systemd's, while the service fails)
            # accepts the connection and never answers: the hello is where that shows.
            sock.settimeout(self.handshake_timeout)
            req_id = next(self._ids)
            fds: list[int] = []
            try:
                sock.sendall(protocol.request(req_id, "hello", {"protocol": protocol.PROTOCOL_VERSION,
                                                                "client": f"pid {os.getpid()}"}))
                reply = protocol.recv_message(sock, protocol.DEFAULT_MAX_FRAME, fds)
            except TimeoutError:
                raise self._no_answer(self.handshake_timeout, "hello reply") from None
            except ConnectionError as exc:
                raise DaemonNotRunning(f"deepseek-flashd at {self.path} closed the connection before its "
                                       f"hello reply ({exc})", socket=str(self.path),
                                       waited_for="hello reply", timeout=self.handshake_timeout) from None
            sock.settimeout(None)
            try:
                hello = protocol.result_of(reply)
                if not fds:
                    raise ProtocolError("the daemon's hello reply carried no arena fd")
                arena = HostArena.attach(fds[0], hello["arena_size"])
            finally:
                for fd in fds:
                    os.close(fd)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.hello = hello
        self.max_frame = hello["max_frame_bytes"]
        self.reader = protocol.MessageReader(sock, self.max_frame, self.spin_us)
        self.arena = arena

    def _no_answer(self, timeout: float, waited_for: str) -> DaemonNotRunning:
        return DaemonNotRunning(
            f"no answer from deepseek-flashd at {self.path}: waited {timeout:g} s for its {waited_for} "
            f"(a socket-activated daemon that fails to start, e.g. on an invalid flash.json, never "
            f"answers: systemctl status deepseek-flash)", socket=str(self.path), waited_for=waited_for,
            timeout=timeout)

    def call(self, op: str, args: dict, retry: bool = True, sent=None):
        """``op``'s result. ``sent``: called once, right after the request first went out."""
        if sent is not None:
            sent = _once(sent)
        with self._lock:
            if self.sock is None:
                if op in RELEASING_OPS:
                    return None
                if self.closed:
                    raise ProtocolError(f"{op}: this client is closed")
                self._reconnect()
                return self._roundtrip(op, args, sent)
            try:
                return self._roundtrip(op, args, sent)
            except (ConnectionError, BrokenPipeError, OSError, ShuttingDown) as exc:
                # ShuttingDown: the daemon is draining; its successor will take the socket.
                if isinstance(exc, TimeoutError) or self._in_reconnect:
                    raise
                if op in RELEASING_OPS:
                    log.info("connection to %s lost (%s); %s needs no daemon, not reconnecting",
                             self.path, exc, op)
                    self.sock.close()
                    self.sock = None
                    return None
                log.warning("connection to %s lost (%s); reconnecting", self.path, exc)
                self._reconnect()
                if not retry:
                    return None
                return self._roundtrip(op, args, sent)

    def _roundtrip(self, op, args, sent=None):
        req_id = next(self._ids)
        self.sock.sendall(protocol.request(req_id, op, args, self.max_frame))
        if sent is not None:
            sent()
        while True:
            reply = self.reader.read()
            if reply.get("id") == req_id:
                return protocol.result_of(reply)
            if reply.get("id") is None:
                protocol.result_of(reply)   # an unsolicited error (refused, bad frame): raise it
            log.warning("dropping reply to unknown request %r", reply.get("id"))

    def _reconnect(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.02
        while True:
            try:
                self._connect()
                break
            except (DaemonNotRunning, ConnectionError, OSError) as exc:
                if time.monotonic() + delay > deadline:
                    raise DaemonNotRunning(f"deepseek-flashd at {self.path} did not come back within "
                                           f"{self.reconnect_timeout:.0f} s ({exc})",
                                           socket=str(self.path)) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        self.generation += 1
        self._in_reconnect = True
        try:
            self.on_reconnect()
        finally:
            self._in_reconnect = False

    def close(self) -> None:
        self.closed = True
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class Client:
    """The controller's API, over the daemon socket or embedded (see the module docstring)."""

    def __init__(self, socket_path=None, embedded: bool | None = None, config=None, *,
                 reconnect_timeout: float = 30.0, spin_us: float = 0.0, connect_timeout: float = 5.0,
                 handshake_timeout: float = 30.0):
        """``spin_us``: poll that long for a reply before sleeping -- lower round trips for one
        latency-bound client on a VM (cross-CPU wake-ups cost ~30 us there), at the cost of CPU
        that many clients on few cores would rather give the daemon. Off by default.

        ``connect_timeout`` / ``handshake_timeout``: seconds to wait for the socket to accept the
        connection and for the daemon's hello reply (a socket-activated daemon starts within
        it); past them ``DaemonNotRunning`` names the socket and what was waited for."""
        self._models: dict[str, tuple[str, dict]] = {}    # name -> (what was opened, context)
        self._leases: dict[int, tuple[Lease, dict]] = {}  # id(lease) -> (lease, acquire args)
        self._callbacks = []
        self._host_tensor = None             # the host arena as a tensor (this mapping)
        self._pinned_arena = None            # the arena mapping page-locked by this client
        self._gpu_arenas: dict = {}          # CUDA index -> the daemon's arena segments (DeviceMemory)
        if embedded:
            self._backend = self._embedded(config)
            return
        path = socket_path or paths.client_socket_path()
        try:
            self._backend = _SocketBackend(path, reconnect_timeout, self._restore, spin_us,
                                           connect_timeout, handshake_timeout)
        except DaemonNotRunning as exc:
            if embedded is False:
                raise
            # Not INFO: a user expecting the shared daemon gets private, unshared memory instead.
            log.warning("no deepseek-flashd answered at %s (%s); running the controller in this "
                        "process (embedded): weights are not shared with other processes", path,
                        exc.message)
            self._backend = self._embedded(config)

    @staticmethod
    def _embedded(config):
        from .embedded import EmbeddedController

        return EmbeddedController(config)

    # --- properties -------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """"daemon" or "embedded"."""
        return self._backend.mode

    @property
    def arena(self):
        """The host arena (mapped once); lease offsets point into it."""
        return self._backend.arena

    @property
    def generation(self) -> int:
        """Goes up each time the daemon restarted under this client (offsets then changed)."""
        return self._backend.generation

    def on_reconnect(self, callback) -> None:
        """Call ``callback(client)`` after a reconnect has restored models and leases."""
        self._callbacks.append(callback)

    # --- API --------------------------------------------------------------------------------------
    def open_model(self, name_or_path, flash_context: dict | None = None) -> ModelInfo:
        what = str(name_or_path)
        wire = self._backend.call("open_model", {"model": what, "flash_context": flash_context or {}})
        info = ModelInfo.from_wire(wire)
        self._models[info.name] = (what, dict(flash_context or {}))
        return info

    def shard(self, model, rank: int, world: int, flash_context: dict | None = None) -> ModelInfo:
        """Open rank ``rank``'s shard of a ``world``-wide tensor-parallel split of ``model``: a
        model of its own whose linear weights are ``1/world`` of the source's (derived by the
        daemon the first time; docs/multigpu.md)."""
        args = {"model": str(model), "rank": int(rank), "world": int(world),
                "flash_context": flash_context or {}}
        info = ModelInfo.from_wire(self._backend.call("shard", args))
        self._models[info.name] = (("shard", args), dict(flash_context or {}))
        return info

    def acquire(self, model, blocks: list[int] | None = None, layer: int | None = None,
                priority: int = 0, wait: bool = True) -> Lease:
        args = {"model": _name(model), "priority": priority, "wait": wait}
        if blocks is not None:
            args["blocks"] = list(blocks)
        if layer is not None:
            args["layer"] = layer
        wire = self._backend.call("acquire", args)
        lease = Lease.from_wire(wire)
        self._leases[id(lease)] = (lease, args)
        return lease

    def release(self, lease: Lease) -> None:
        self._leases.pop(id(lease), None)
        # After a daemon restart the lease died with the old daemon: nothing to resend.
        self._backend.call("release", {"lease": lease.id}, retry=False)

    def prefetch(self, model, layers: list[int] | None = None, blocks: list[int] | None = None) -> int:
        return self._backend.call("prefetch", {"model": _name(model), "layers": list(layers or []),
                                               "blocks": list(blocks or [])})["scheduled"]

    def close_model(self, model) -> None:
        name = _name(model)
        self._models.pop(name, None)
        for key, (lease, _) in list(self._leases.items()):
            if lease.model == name:
                del self._leases[key]
        self._backend.call("close_model", {"model": name})

    def load(self, model, wait: bool = True) -> dict:
        """Open ``model`` in the controller and read every block that fits (``deepseek-flash load``)."""
        return self._backend.call("load", {"model": str(_name(model)), "wait": wait})

    def unload(self, model, tier: str = "all") -> dict:
        """Forget ``model`` (``tier="all"``) or only drop its device copies (``"device"``)."""
        name = _name(model)
        result = self._backend.call("unload", {"model": name, "tier": tier})
        if tier == "all":
            self._models.pop(name, None)
        return result

    # --- device tier (used by load_model) ---------------------------------------------------------
    def attach(self, model, device, weight_budget: int | None = None, priority: int = 0,
               blocks: list[int] | None = None, part: int = 0, importing: bool = False,
               imports_module: str | None = None, sent=None) -> dict:
        """The model's memory on ``device`` ("cpu" or a CUDA index) for this client: plan,
        control page (gates, block offsets), GPU arena and events, streaming slots. A load this
        attach starts reads with ``priority`` (higher goes to the disk first). ``blocks``/``part``:
        one device's share of a model split over devices (``load_model(device_map=...)``).
        ``importing``: this process is still importing (its model class): the controller reads
        shallow, as ``dd`` does, until ``imports_done`` -- thousands of small file reads would
        otherwise wait behind every read the load keeps queued on the disk; ``imports_module``,
        the module it imports: a daemon that read that module's files ahead at start (its
        learned manifest) reads at full depth at once. ``sent``: called once the request is on
        its way (a daemon's socket: right after it was written; in-process: right before), while
        this call waits for the answer -- e.g. to start work on another thread that, started
        earlier, would hold the interpreter lock while this thread tries to send."""
        # Only a client in another process needs CUDA IPC handles; sharing memory with oneself
        # would pin it in torch's IPC bookkeeping for good.
        args = {"model": _name(model), "device": device, "ipc": self.mode == "daemon"}
        if weight_budget is not None:
            args["weight_budget"] = int(weight_budget)
        if priority:
            args["priority"] = int(priority)
        if blocks is not None:
            args["blocks"] = [int(b) for b in blocks]
            args["part"] = int(part)
        if importing:
            args["importing"] = True
            if imports_module is not None:
                args["imports_module"] = str(imports_module)
        if sent is not None:
            return self._backend.call("attach", args, sent=sent)
        return self._backend.call("attach", args)

    @property
    def bytecode_cache(self) -> str | None:
        """The daemon's compiled-module cache (its hello; ``deepseek_flash.bytecode``), None in
        embedded mode or where the daemon keeps none."""
        return (getattr(self._backend, "hello", None) or {}).get("bytecode_cache")

    def imports_done(self, module: str | None = None, files: dict | None = None) -> float | None:
        """This process's imports are done (after ``attach(..., importing=True)``): the controller
        reads at full depth again. The seconds it read shallow for this client (None: it did not).
        ``module``/``files`` (``client.skeleton.imported_files()``): what the imports opened, for
        the daemon to read ahead at its next start."""
        args = {} if module is None or files is None else {"module": module, "files": files}
        try:
            out = self._backend.call("imports_done", args)
        except UnknownOperation:
            return None     # a daemon older than this library: it read at full depth throughout
        return None if out is None else out.get("shallow_s")

    def detach(self, model=None) -> None:
        self._backend.call("detach", {"model": _name(model)} if model is not None else {})

    def host_tensor(self, pinned: bool = False):
        """The host arena as one uint8 tensor (this process's mapping); ``pinned`` page-locks
        it for the GPU once per process, so copies from it run at link speed."""
        import torch

        if self._host_tensor is None:
            self._host_tensor = torch.frombuffer(self.arena, dtype=torch.uint8)
        if pinned and self.mode == "embedded":
            # The controller's fabric pins this very mapping (at start, in the background).
            self._backend.fabric.pin_host()
        elif pinned and self._pinned_arena is None:
            if register_host_memory(self.arena.address, self.arena.size):
                self._pinned_arena = self.arena
        return self._host_tensor

    def device_memory(self, device, desc: dict):
        """(uint8 tensor over the device memory the attach offsets point into, gate events)."""
        if device == "cpu":
            return self.host_tensor(), None
        if self.mode == "embedded":
            load = self._backend.attachments.by_control_offset(desc["control_offset"])
            return self._backend.fabric.arenas[device].memory, load.placement.events
        import torch

        # Segments this process has not opened yet are opened (once each); released ones dropped.
        arena = self._gpu_arenas[device] = open_gpu_arena(desc["gpu_arena"],
                                                          self._gpu_arenas.get(device))
        events = [torch.cuda.Event.from_ipc_handle(device, bytes(h)) for h in desc["events"]]
        return arena, events

    def status(self) -> dict:
        return self._backend.call("status", {})

    def stats(self) -> dict:
        return self._backend.call("stats", {})

    def get_tunable(self, key: str | None = None):
        return self._backend.call("get_tunable", {"key": key} if key else {})

    def set_tunable(self, key: str, value) -> dict:
        return self._backend.call("set_tunable", {"key": key, "value": value})

    def list_models(self) -> list[dict]:
        return self._backend.call("list_models", {})

    def call(self, op: str, args: dict | None = None):
        """Send any operation by name (``wire.OPS``); its result."""
        return self._backend.call(op, args or {})

    def close(self) -> None:
        self._drop_mappings()
        self._backend.close()

    def _drop_mappings(self) -> None:
        """Forget this process's views of the controller's memory: the host tensor, the
        page-locking of the arena mapping it covers, the GPU arenas opened by IPC."""
        if self._pinned_arena is not None:
            unregister_host_memory(self._pinned_arena.address)
            self._pinned_arena = None
        self._host_tensor = None
        self._gpu_arenas.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- after a daemon restart --------------------------------------------------------------------
    def _restore(self) -> None:
        # The new daemon has a new host arena (mapped at another address) and new GPU arenas:
        # what was mapped or page-locked for the old one is dropped, and remade on first use.
        self._drop_mappings()
        for name, (what, context) in list(self._models.items()):
            try:
                if isinstance(what, tuple):     # a tensor-parallel shard: asked for again
                    self._backend.call(*what)
                    continue
                self._backend.call("open_model", {"model": what, "flash_context": context})
            except FlashError as exc:
                log.warning("could not reopen model %s after reconnect: %s", name, exc)
                self._models.pop(name, None)
        for key, (lease, args) in list(self._leases.items()):
            try:
                wire = self._backend.call("acquire", args)
            except FlashError as exc:
                log.warning("could not re-acquire lease on %s after reconnect: %s", lease.model, exc)
                del self._leases[key]
                continue
            lease.id = wire["lease"]
            lease.blocks = wire["blocks"]
        for callback in self._callbacks:
            callback(self)


def _name(model) -> str:
    return model.name if isinstance(model, ModelInfo) else str(model)

