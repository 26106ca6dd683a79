"""The op table: wire requests -> ``BlockManager`` / device-tier calls -> wire results.

``Operations.call(client_id, op, args)`` checks each argument's presence and type (a
``MalformedFrame`` naming it), calls the host tier (``BlockManager``) or the device tier
(``Attachments``), and returns a wire map or a Future of one. The daemon's server and the
embedded controller run this very object, so both modes answer alike; only the transport
differs.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from ..errors import ConfigError, MalformedFrame, UnknownClient, UnknownOperation
from ..wire import OPS, Lease
from .block_manager import BlockManager
from .imports_ahead import flatten

log = logging.getLogger("deepseek_flash.server")


def _arg(op: str, args: dict, name: str, kind, required: bool = True, default=None):
    if name not in args or args[name] is None:
        if required:
            raise MalformedFrame(f"{op}: argument {name!r} is missing", op=op, argument=name)
        return default
    value = args[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedFrame(f"{op}: argument {name!r} has the wrong type ({type(value).__name__})",
                             op=op, argument=name)
    return value


class Operations:
    """The op table: ``call(client_id, op, args)`` -> a wire result, or a Future of one."""

    def __init__(self, manager: BlockManager, status=None, attachments=None, shards=None,
                 imports_ahead=None):
        self.manager = manager
        self.imports_ahead = imports_ahead     # the daemon's learned import files (or None)
        self.attachments = attachments
        self.shards = shards
        self._status = status or manager.snapshot
        self._table = {op: getattr(self, "op_" + op) for op in OPS if op != "hello"}

    def call(self, client_id: int, op: str, args: dict):
        try:
            handler = self._table[op]
        except KeyError:
            raise UnknownOperation(f"unknown operation {op!r}; known: hello, {', '.join(self._table)}",
                                   op=op) from None
        return handler(client_id, args)

    def op_list_models(self, cid, args):
        return self.manager.list_models()

    def op_open_model(self, cid, args):
        name = _arg("open_model", args, "model", str)
        context = _arg("open_model", args, "flash_context", dict, required=False, default={})
        return self.manager.open_model(cid, name, context).to_wire()

    def op_close_model(self, cid, args):
        return {"released": self.manager.close_model(cid, _arg("close_model", args, "model", str))}

    def op_acquire(self, cid, args):
        model = _arg("acquire", args, "model", str)
        blocks = _arg("acquire", args, "blocks", list, required=False)
        layer = _arg("acquire", args, "layer", int, required=False)
        priority = _arg("acquire", args, "priority", int, required=False, default=0)
        wait = _arg("acquire", args, "wait", bool, required=False, default=True)
        future = self.manager.acquire_async(cid, model, blocks, layer, priority, wait)
        if future.done():
            return future.result().to_wire()
        return _chain(future, Lease.to_wire)

    def op_release(self, cid, args):
        self.manager.release(cid, _arg("release", args, "lease", int))

    def op_prefetch(self, cid, args):
        model = _arg("prefetch", args, "model", str)
        layers = _arg("prefetch", args, "layers", list, required=False, default=[])
        blocks = _arg("prefetch", args, "blocks", list, required=False, default=[])
        return {"scheduled": self.manager.prefetch(model, layers, blocks, client_id=cid)}

    def op_status(self, cid, args):
        return self._status()

    def op_stats(self, cid, args):
        return self.manager.stats()

    def op_get_tunable(self, cid, args):
        key = _arg("get_tunable", args, "key", str, required=False)
        tunables = self.manager.config.tunables()
        if key is None:
            return tunables
        if key not in tunables:
            raise ConfigError(f"unknown tunable {key!r}; tunables: {', '.join(tunables)}", key=key,
                              value=None, allowed=list(tunables))
        return tunables[key]

    def op_set_tunable(self, cid, args):
        key = _arg("set_tunable", args, "key", str)
        if "value" not in args:
            raise MalformedFrame("set_tunable: argument 'value' is missing", op="set_tunable",
                                 argument="value")
        old, new = self.manager.set_tunable(key, args["value"])
        log.info("tunable %s: %r -> %r (client %s)", key, old, new, cid)
        return {"key": key, "old": old, "new": new}

    def op_load(self, cid, args):
        name = _arg("load", args, "model", str)
        wait = _arg("load", args, "wait", bool, required=False, default=True)
        info = self.manager.open_model(cid, name, None)
        future = self.manager.load(info.name, client_id=cid)
        if future.done() or not wait:
            return future.result() if future.done() else {"model": info.name, "started": True}
        return future

    def op_unload(self, cid, args):
        model = _arg("unload", args, "model", str)
        tier = _arg("unload", args, "tier", str, required=False, default="all")
        if tier not in ("all", "device"):
            raise MalformedFrame(f"unload: tier must be 'all' or 'device', not {tier!r}",
                                 op="unload", argument="tier")
        freed = self.attachments.unload(model) if self.attachments is not None else 0
        if tier == "device":
            return {"model": model, "freed_device_bytes": freed}
        return {**self.manager.unload(model), "freed_device_bytes": freed}

    def op_attach(self, cid, args):
        """A model's memory on a device for this client (see ``daemon.attachments.Attachments``)."""
        model = _arg("attach", args, "model", str)
        device = args.get("device", "cpu")
        if device != "cpu" and (not isinstance(device, int) or isinstance(device, bool) or device < 0):
            raise MalformedFrame(f"attach: device must be 'cpu' or a CUDA index, not {device!r}",
                                 op="attach", argument="device")
        budget = _arg("attach", args, "weight_budget", int, required=False)
        ipc = _arg("attach", args, "ipc", bool, required=False, default=True)
        priority = _arg("attach", args, "priority", int, required=False, default=0)
        blocks = _arg("attach", args, "blocks", list, required=False)
        part = _arg("attach", args, "part", int, required=False, default=0)
        if blocks is not None and not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
            raise MalformedFrame("attach: 'blocks' must be a list of block ids", op="attach",
                                 argument="blocks")
        importing = _arg("attach", args, "importing", bool, required=False, default=False)
        module = _arg("attach", args, "imports_module", str, required=False)
        if self.attachments is None:
            raise UnknownOperation("attach: this controller has no device tier", op="attach")
        if not importing:
            return self.attachments.attach(cid, model, device, budget, ipc=ipc, priority=priority,
                                           blocks=blocks, part=part)
        # The client still imports its model class: the load reads shallow until it says
        # imports_done (or detaches, disconnects, or its attach fails).
        self.manager.hold_shallow(cid, module=module)
        try:
            out = self.attachments.attach(cid, model, device, budget, ipc=ipc, priority=priority,
                                          blocks=blocks, part=part)
        except BaseException:
            self.manager.end_shallow(cid, "its attach failed")
            raise
        if isinstance(out, Future):
            out.add_done_callback(lambda f: f.exception() is not None
                                  and self.manager.end_shallow(cid, "its attach failed"))
        return out

    def op_imports_done(self, cid, args):
        """The client's imports (``attach`` with ``importing``) are done: the load reads at full
        depth again unless another client still imports. ``shallow_s``: how long this client
        held shallow reads (null: it held none). ``module`` and ``files`` (``{directory: [name,
        ...]}``, both or neither): what that client's imports opened -- kept for the next start
        (``daemon.imports_ahead``; ignored by a controller that does not read ahead)."""
        module = _arg("imports_done", args, "module", str, required=False)
        files = _arg("imports_done", args, "files", dict, required=False)
        if (module is None) != (files is None):
            missing = "files" if files is None else "module"
            raise MalformedFrame(f"imports_done: 'module' and 'files' go together; {missing!r} is missing",
                                 op="imports_done", argument=missing)
        seconds = self.manager.end_shallow(cid)
        if files is not None and self.imports_ahead is not None:
            # Off the loop: the list (a few hundred KiB at most) is only checked and written.
            ahead = self.imports_ahead
            threading.Thread(target=lambda: ahead.learn(module, flatten(files)), daemon=True,
                             name="flash-imports-learn").start()
        return {"shallow_s": None if seconds is None else round(seconds, 3)}

    def op_shard(self, cid, args):
        """Rank ``rank`` of a ``world``-wide tensor-parallel split of ``model``: its shard,
        derived once and opened for this client (``daemon.shards``); a ModelInfo like
        ``open_model``'s, or a Future of it while the shard is derived."""
        model = _arg("shard", args, "model", str)
        rank = _arg("shard", args, "rank", int)
        world = _arg("shard", args, "world", int)
        context = _arg("shard", args, "flash_context", dict, required=False, default={})
        if self.shards is None:
            raise UnknownOperation("shard: this controller derives no shards", op="shard")
        return self.shards.shard(cid, model, rank, world, context)

    def op_detach(self, cid, args):
        self.manager.end_shallow(cid, "it detached")
        if self.attachments is not None:
            self.attachments.detach(cid, _arg("detach", args, "model", str, required=False))

    def op_profile(self, cid, args):
        """Completed block loads requested by process ``pid`` (flash-profiler): those after
        sequence ``after`` and wall time ``since``; ``require_connected`` (default true) makes a
        pid with no connected client an UnknownClient error. ``last_seq``: the newest sequence
        number recorded for anyone (where a new window starts)."""
        pid = _arg("profile", args, "pid", int)
        after = _arg("profile", args, "after", int, required=False, default=0)
        since = args.get("since", 0.0)
        if isinstance(since, bool) or not isinstance(since, (int, float)):
            raise MalformedFrame("profile: argument 'since' must be a number", op="profile",
                                 argument="since")
        limit = _arg("profile", args, "limit", int, required=False, default=10_000)
        clients = self.manager.clients_of_pid(pid)
        if not clients and _arg("profile", args, "require_connected", bool, required=False, default=True):
            raise UnknownClient(f"no client of pid {pid} is connected to this controller", pid=pid)
        fields = ("seq", "time", "client", "pid", "model", "block", "layer", "role", "latency_us",
                  "bytes")
        ring = self.manager.load_log
        return {"now": time.time(), "clients": clients, "fields": list(fields),
                "last_seq": ring[-1][0] if ring else 0,
                "samples": [list(s) for s in self.manager.load_samples(pid, after, float(since), limit)]}

    def op_report_stream(self, cid, args):
        """A streaming client's prefetch counters (hits, misses, stalls, window, decisions)."""
        model = _arg("report_stream", args, "model", str)
        stats = _arg("report_stream", args, "stats", dict)
        self.manager.report_stream(cid, model, stats)

    def op_kv_alloc(self, cid, args):
        """Host arena space for this client's tiered KV pages on ``model``: ``{offset, bytes}``."""
        model = _arg("kv_alloc", args, "model", str)
        nbytes = _arg("kv_alloc", args, "bytes", int)
        if nbytes <= 0:
            raise MalformedFrame(f"kv_alloc: bytes must be positive, not {nbytes}", op="kv_alloc",
                                 argument="bytes")
        return {"offset": self.manager.kv_alloc(cid, model, nbytes), "bytes": nbytes}

    def op_kv_free(self, cid, args):
        return {"freed": self.manager.kv_free(cid, _arg("kv_free", args, "offset", int))}

    def op_report_kv(self, cid, args):
        """A client's tiered KV cache stats (``deepseek_flash.kv``): bytes per tier, page fetches."""
        model = _arg("report_kv", args, "model", str)
        stats = _arg("report_kv", args, "stats", dict)
        for key, value in stats.items():
            if key == "level_tokens":
                if not _level_list(value):
                    raise MalformedFrame("report_kv: stats field 'level_tokens' must be a list "
                                         "(one per layer, at most 4096) of [level 1, level 2, "
                                         "level 3] non-negative integers", op="report_kv",
                                         argument="stats")
            elif not isinstance(value, (int, bool)) and value is not None:
                raise MalformedFrame(f"report_kv: stats field {key!r} must be an integer",
                                     op="report_kv", argument="stats")
        self.manager.report_kv(cid, model, stats)


def _level_list(value) -> bool:
    """Whether ``value`` is a report's ``level_tokens``: per layer three non-negative ints."""
    return (isinstance(value, (list, tuple)) and len(value) <= 4096
            and all(isinstance(lv, (list, tuple)) and len(lv) == 3
                    and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lv)
                    for lv in value))


def _chain(future: Future, convert) -> Future:
    out: Future = Future()

    def done(f):
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(convert(f.result()))
    future.add_done_callback(done)
    return out
