"""``load_model``: a Hugging Face model whose weights are views into the controller's memory.

The model is built from the stored config with every parameter on the meta device (no weight
memory, ~15 ms for an 8B shape), then each parameter is replaced by a zero-copy view of its block
in the host arena (device ``cpu``) or in the daemon's GPU arena (device ``cuda:N``). Nothing is
copied into the process: several processes share one copy, and a process that restarts attaches
to bytes that are already there.

While a load is still in flight, *gates* (one per decoder layer, plus embeddings and head) hold a
layer back until its bytes are there; once every gate has opened, the hooks remove themselves and
the forward pass runs as plain ``transformers`` code. Streamed layers (a weight budget below the
model size) are handled by ``client.stream``; the skeleton and the binding by ``client.skeleton``.
"""
from __future__ import annotations

import functools
import logging
import threading
import time

from ..cuda import attention_without_cudnn
from ..errors import (BudgetTooSmall, ConfigError, DeviceMapError, FlashIOError, FrameTooLarge,
                      MalformedFrame)
from ..sizes import parse_size
from ..store.views import block_tensors
from ..wire import (DEFAULT_STREAM_UNIT, GATE_FAILED, GATE_PENDING, GATE_READY, SLOT_ALIGNMENT, Plan,
                    control_views)
from .skeleton import (
    bind_parameters,
    build_skeleton,
    decoder_parts,
    imported_files,
    imports_module,
    start_imports,
)
from .placement import block_sizes, resolve
from .stream import StreamGroup, start_reports, start_streaming

log = logging.getLogger("deepseek_flash.model")


class Gates:
    """Holds each layer back until its bytes are there; removes itself once all have opened.

    ``control`` is a uint32 array in shared memory written by the loader (0 pending, 1 ready,
    2 failed). ``events`` (GPU only) are the loader's per-gate copy events: the compute stream
    waits on them, so the CPU never waits for a copy, only for the loader to have *issued* it.
    """

    def __init__(self, model, control, events=None, on_failure=None, part=None, device=None):
        self.control = control
        self.events = events
        self.on_failure = on_failure
        self.device = device                 # CUDA index whose compute stream waits (None: current)
        self.handles = []
        self._lock = threading.Lock()
        embed, layers, norm, head = decoder_parts(model)
        targets = [(embed, 0)] + [(layer, i + 1) for i, layer in enumerate(layers)]
        targets += [(norm, len(layers) + 1), (head, len(layers) + 1)]
        if part is not None:
            # One device's share of a split model: only its modules wait on its load's gates
            # (the other gates of its control page are empty, opened at once).
            keep = {0} if part.first else set()
            keep |= {i + 1 for i in part.layers} | ({len(layers) + 1} if part.last else set())
            targets = [(m, g) for m, g in targets if g in keep]
        watched = {g for _, g in targets}
        self.opened = [g not in watched for g in range(len(control))]
        for module, gate in targets:
            self.handles.append(module.register_forward_pre_hook(self._hook(gate)))

    def _hook(self, gate: int):
        def pre_hook(module, args):
            if not self.opened[gate]:
                self.wait(gate)
        return pre_hook

    def wait(self, gate: int, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        pause = 20e-6
        while self.control[gate] == GATE_PENDING:
            if time.monotonic() > deadline:
                raise FlashIOError(f"gate {gate} not loaded after {timeout:.0f} s", gate=gate)
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        if self.control[gate] == GATE_FAILED:
            if self.on_failure is not None:
                self.on_failure(gate)
            raise FlashIOError(f"loading gate {gate} failed; see the daemon log", gate=gate)
        if self.events is not None:
            import torch

            torch.cuda.current_stream(self.device).wait_event(self.events[gate])
        with self._lock:
            self.opened[gate] = True
            if all(self.opened):
                self.remove()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @property
    def active(self) -> bool:
        return bool(self.handles)


class PartHandle:
    """One device slice of a model loaded with ``device_map``: the part (``client.placement``),
    the attach reply for its blocks, its gates and its streaming runtime (None: all resident)."""

    def __init__(self, part, desc):
        self.part = part
        self.desc = desc
        self.plan = Plan.from_wire(desc["plan"])
        self.gates = None
        self.stream = None


class FlashModelHandle:
    """What keeps a loaded model's memory alive: the client, the load, the streaming runtime.

    Reachable as ``model.flash``; ``close()`` detaches (the daemon keeps GPU copies resident for
    the next client until memory is needed or ``deepseek-flash unload``).
    """

    def __init__(self, client, info, device, desc, owns_client: bool):
        self.client = client
        self.info = info
        self.device = device
        self.desc = desc
        self.gates = None
        self.stream = None
        self.decoder = None                     # decode.GraphDecoder with decode="graphs"
        self.timings: dict[str, float] = {}     # load_model's phases, ms
        self.imports = None                     # skeleton.Imports of a fresh process (ahead)
        self.shallow_read_s = None              # how long the controller read shallow for them
        self.priority = 0                       # of this model's reads in the controller
        self.parts: list[PartHandle] = []      # device_map: one per device slice
        self._hooks: list = []                  # device_map: activation moves between devices
        self._owns_client = owns_client
        self.closed = False

    def set_read_priority(self, priority: int) -> None:
        """The ``priority`` of the reads this model causes from now on -- the acquires of its
        streamed layers (higher goes to the disk before waiting reads of a lower one, and moves up
        reads of the same blocks queued earlier). ``deepseek-flash serve`` sets it before each
        forward from the classes of the requests in it."""
        self.priority = int(priority)
        # A model split over devices streams through one runtime per part (a StreamGroup).
        for runtime in getattr(self.stream, "runtimes", [self.stream]):
            side = getattr(runtime, "host_side", None)
            if side is not None:
                side.priority = self.priority

    def wait_loaded(self) -> None:
        """Until every layer of a load still in flight is there: its gates opened and, on a GPU,
        the current stream made to wait for their copies. A forward waits by itself (each layer
        behind its gate); code that reads a layer's weights directly (a submodule called alone,
        ``dequantized_weight``, a copy of the parameters) calls this first. Raises
        ``FlashIOError`` naming the gate whose load failed."""
        for gates in [self.gates] + [part.gates for part in self.parts]:
            if gates is None or not gates.active:
                continue
            for gate in range(len(gates.control)):
                if not gates.opened[gate]:
                    gates.wait(gate)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for part in self.parts:
            if part.gates is not None:
                part.gates.remove()
        if self.gates is not None:
            self.gates.remove()
        if self.stream is not None:
            self.stream.close()
        self.client.detach(self.info.name)
        if self._owns_client:
            self.client.close()


DECODE_MODES = ("eager", "graphs", "auto")   # decode.engine's modes (importing it imports transformers)


def check_decode_mode(mode: str) -> None:
    if mode not in DECODE_MODES:
        raise ConfigError(f"decode: {mode!r} is not one of {', '.join(DECODE_MODES)}", key="decode",
                          value=mode, allowed=list(DECODE_MODES))


def resolve_decode_mode(mode: str, device, *, split: bool = False,
                        tensor_parallel: bool = False) -> tuple[str, str | None]:
    """``load_model``'s ``decode`` as it applies to this load: ``(mode, reason)``, ``mode``
    ``"eager"`` or ``"graphs"``; ``reason`` says why ``"auto"`` chose eager (None otherwise).
    ``"auto"`` is graphs only where they are implemented and GPU-tested: one CUDA device, no
    device split, no tensor parallelism (its per-layer collectives would make the steps eager,
    untested on a GPU)."""
    check_decode_mode(mode)
    if mode != "auto":
        return mode, None
    if split:
        return "eager", ("decode='auto' runs transformers' generate for a model split over devices "
                         "(device_map): graphs are not implemented there")
    if tensor_parallel:
        return "eager", ("decode='auto' runs transformers' generate with tensor_parallel: graph "
                         "decode is not tested with its collectives")
    if getattr(device, "type", str(device)) != "cuda":
        return "eager", (f"decode='auto' runs transformers' generate on {device}: CUDA graphs need "
                         f"a CUDA device")
    return "graphs", None


def load_model(name_or_path, device=None, weight_budget=None, embedded=None, flash_context=None,
               *, client=None, socket_path=None, config=None, decode="eager", decode_capacity=None,
               priority: int = 0, device_map=None, tensor_parallel=None):
    """A ``transformers`` causal LM whose weights are views into the controller's memory.

    ``name_or_path``: a registered model name or a store directory (``deepseek-flash pack``).
    ``device``: ``"cpu"`` (views into the shared host arena) or ``"cuda[:N]"`` (views into the
    daemon's GPU arena on that device). ``weight_budget`` (bytes or ``"8GiB"``) caps the device
    memory this model may occupy; layers that do not fit are streamed (``client.stream``).
    ``embedded``: None uses the daemon when one answers, else an in-process controller.
    ``flash_context``: ``flash_config`` overrides for this model (e.g. ``prefetch_window``).
    ``priority``: of this model's disk reads in the controller (its load, its streamed layers):
    higher goes before waiting reads of other models, e.g. another model's cold load.
    ``device_map``: instead of ``device``, the decoder layers placed across devices --
    ``"auto"``, ``{"devices": [...]}`` or ``{"layers": ...}`` (``client.placement``,
    docs/multigpu.md); each device's share is its own load in its own arena, streamed through
    its own copy stream under its own budget (``weight_budget``: a total split by bytes, a dict
    per device, or a list per part); activations move between devices at the layer boundary and
    the logits come back on the first device. ``model.flash.parts`` lists the parts.
    ``tensor_parallel``: True (the default ``torch.distributed`` group) or a process group: this
    process runs its rank's shard of every linear weight (``client.tensor_parallel``), derived
    and served by the daemon; ``device`` is this rank's device. Logits equal the single-process
    model's up to the order of the sums (docs/multigpu.md).
    ``decode``: ``"eager"`` (transformers' ``generate``) or ``"graphs"``: ``generate()`` decodes
    each token as one CUDA-graph replay over a static KV cache of ``decode_capacity`` tokens per
    sequence (prompt + new; default ``min(4096, max_position_embeddings)``), see
    ``deepseek_flash.decode``; where capture is impossible it says why in the log and runs eagerly;
    a streamed model's copies into its slots are part of the captured step. ``"auto"``:
    ``"graphs"`` on a single CUDA device, ``"eager"`` elsewhere, with device_map or with
    tensor_parallel (the reason logged; ``resolve_decode_mode``).

    The call may return before a GPU load has finished: a forward pass waits, per layer, only
    where that layer's bytes are not there yet. ``model.generate()`` works unchanged.
    """
    import torch

    from . import Client

    check_decode_mode(decode)
    if device_map is not None:
        if device is not None:
            raise DeviceMapError("load_model: give device or device_map, not both",
                                 device=str(device))
        if decode == "graphs":
            raise DeviceMapError(f"load_model: decode={decode!r} is not implemented for a model "
                                 f"split over devices (device_map); use decode='eager'",
                                 device=str(device_map))
    device = "cpu" if device is None else device
    tp = None
    if tensor_parallel is not None and tensor_parallel is not False:
        if device_map is not None:
            raise DeviceMapError("load_model: tensor_parallel with a device_map is not implemented; "
                                 "give each rank its device", device=str(device_map))
        from .tensor_parallel import group_of

        tp = group_of(tensor_parallel)
    owns_client = client is None
    if client is None:
        client = Client(socket_path=socket_path, embedded=embedded, config=config)
    timings = {}
    mark = time.perf_counter()

    def lap(name):
        nonlocal mark
        now = time.perf_counter()
        timings[name] = round(timings.get(name, 0.0) + (now - mark) * 1e3, 3)
        mark = now

    handle = imports = None
    try:
        if tp is not None:
            info = client.shard(name_or_path, tp[1], tp[2], flash_context)
        else:
            info = client.open_model(name_or_path, flash_context)
        if device_map is not None:
            # A fresh process: the skeleton's imports (seconds) start now, on a thread of their
            # own, while the parts' attaches and loads are under way.
            imports = start_imports(info.config)
            _, reason = resolve_decode_mode(decode, None, split=True)
            if reason is not None:
                log.info("%s", reason)
            lap("open_model_ms")
            handle, model = _load_parts(client, info, device_map, weight_budget, priority,
                                        owns_client, lap, imports)
            handle.imports = imports
            model.flash = handle
            cuda_parts = [p.part.device for p in handle.parts if str(p.part.device).startswith("cuda")]
            if cuda_parts:
                attention_without_cudnn(model, cuda_parts[0])
            timings.update(handle.timings)
            handle.timings = timings
            timings["total_ms"] = round(sum(timings.values()), 3)
            return model
        dev = torch.device(device)
        target = "cpu" if dev.type == "cpu" else (dev.index if dev.index is not None else 0)
        budget = None if weight_budget is None else parse_size("weight_budget", weight_budget)
        lap("open_model_ms")
        handle = FlashModelHandle(client, info, dev, None, owns_client)
        handle.timings = timings
        # Attach first: a cold load starts reading and copying while the skeleton is built.
        handle.priority = priority
        # A fresh process: the skeleton's imports (seconds) start on a thread of their own once
        # the attach request is out, and run while the daemon answers it and the load's first
        # reads are under way. Not before: an import thread holds the interpreter lock most of
        # the time, and this thread's send waited 0.2-0.7 s for it -- time the load's reads
        # wait for. Meanwhile the controller reads shallow until this process says its imports
        # are done (they are system-call bound; a deep read queue on the same disk slows them).
        module = imports_module(info.config)

        def start():
            nonlocal imports
            imports = start_imports(info.config, bytecode_cache=getattr(client, "bytecode_cache", None))

        handle.desc = client.attach(info.name, target, weight_budget=budget, priority=priority,
                                    importing=module is not None, imports_module=module,
                                    sent=None if module is None else start)
        lap("attach_ms")
        handle.imports = imports
        if module is not None:
            try:
                if imports is not None:
                    imports.wait()
            finally:
                handle.shallow_read_s = _imports_done(client, imports)
            lap("imports_ms")
        model = build_skeleton(info.config)
        if dev.type != "cpu":
            # Rotary tables and other buffers are computed in this process; only they move.
            for module in model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[name] = buf.to(dev)
        lap("skeleton_ms")
        _bind(model, handle, target, lap)
        if tp is not None:
            from .tensor_parallel import install

            handle._hooks = install(model, *tp)
        model.flash = handle
        # Eager steps too (the graph decoder and serve set the same kernels themselves).
        attention_without_cudnn(model, dev)
        from ..decode.engine import for_loaded_model    # imports transformers: after the attach

        mode, reason = resolve_decode_mode(decode, dev, tensor_parallel=tp is not None)
        if reason is not None:
            log.info("%s", reason)
        for_loaded_model(model, handle, mode, decode_capacity)
        timings["total_ms"] = round(sum(timings.values()), 3)
        return model
    except BaseException as exc:
        if imports is not None and isinstance(exc, Exception):
            # The caller may import transformers next: not while that thread is halfway through.
            imports.wait()
        if handle is not None and handle.desc is not None:
            try:
                handle.close()
            except Exception:  # noqa: BLE001 -- the original error is the one to report
                log.exception("detaching %s after a failed load_model", handle.info.name)
        elif owns_client:
            client.close()
        raise


def _imports_done(client, imports) -> float | None:
    """Tell the controller this process's imports are done; a daemon is also told which files
    they opened (it reads them ahead at its next start; None: none were started, e.g. the
    module was imported meanwhile). The seconds it read shallow."""
    files = None
    if imports is not None and getattr(client, "mode", None) == "daemon":
        try:
            files = imported_files(opened=imports.opened, before=imports.before)
        except Exception as exc:  # noqa: BLE001 -- the report is an optimisation only
            log.debug("the imported files were not collected: %s", exc)
    if files is None:
        return client.imports_done()
    try:
        return client.imports_done(imports.module, files)
    except (MalformedFrame, FrameTooLarge) as exc:
        # A daemon that takes no report (or a smaller frame): the plain call still ends the hold.
        log.debug("imports_done with the files refused (%s): sent without them", exc)
        return client.imports_done()


def _resident_views(client, info, desc, plan, memory) -> tuple:
    """The load's gate views (its control page in the host arena) and the tensors of the plan's
    resident blocks, as views of ``memory`` at the offsets the control page gives."""
    gates, offsets = control_views(client.arena, desc["control_offset"], desc["num_gates"],
                                   desc["num_blocks"])
    resident = set(plan.resident)
    tensors = {}
    for i, block in enumerate(info.blocks):
        if block.id in resident:
            off = int(offsets[i])
            tensors.update(block_tensors(block, memory[off:off + block.length]))
    return gates, tensors


def _bind(model, handle, target, lap) -> None:
    """Bind the resident blocks of the controller's answer to ``attach`` (``handle.desc``), start
    streaming the rest if the plan says so, and gate layers still loading."""
    client, info, desc = handle.client, handle.info, handle.desc
    plan = Plan.from_wire(desc["plan"])
    memory, events = client.device_memory(target, desc)
    lap("device_memory_ms")
    gates, tensors = _resident_views(client, info, desc, plan, memory)
    bind_parameters(model, tensors, complete=not plan.streaming)
    if plan.streaming:
        handle.stream = start_streaming(model, handle, plan, desc, memory, target)
    if not bool((gates == GATE_READY).all()):
        handle.gates = Gates(model, gates, events)
    lap("bind_ms")


# --- a model split over devices (device_map) -----------------------------------------------------

def _devices_here() -> tuple[list[str], dict]:
    """The devices that exist in this process and the free memory of each CUDA device."""
    import torch

    devices, free = ["cpu"], {}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            devices.append(f"cuda:{i}")
            free[f"cuda:{i}"] = torch.cuda.mem_get_info(i)[0]
    return devices, free


def _load_parts(client, info, device_map, weight_budget, priority, owns_client, lap, imports=None):
    """``load_model`` with a ``device_map``: resolve the parts, attach each (its blocks, its
    device, its budget), then one skeleton bound part by part. Returns (handle, model)."""
    import torch

    # Sizes as the planner counts them, so a total budget's split gives each part its resident
    # minimum (anchors + slots) first.
    available, free = _devices_here()
    parts = resolve(device_map, weight_budget=weight_budget, available=available, free_bytes=free,
                    **block_sizes(info.blocks, info.num_layers, SLOT_ALIGNMENT,
                                  info.flash_config.get("stream_unit", DEFAULT_STREAM_UNIT)))
    first = torch.device(parts[0].device)
    handle = FlashModelHandle(client, info, first, None, owns_client)
    handle.priority = priority
    try:
        for part in parts:
            try:
                desc = client.attach(info.name, part.target, weight_budget=part.budget,
                                     priority=priority, blocks=part.blocks(info.blocks),
                                     part=part.index)
            except BudgetTooSmall as exc:
                raise BudgetTooSmall(f"{part.describe()}: {exc.message}", **{
                    **exc.fields, "device": part.device, "layers": list(part.layers)}) from None
            handle.parts.append(PartHandle(part, desc))
        handle.desc = handle.parts[0].desc
        lap("attach_ms")
        if imports is not None:
            imports.wait()
            lap("imports_ms")
        model = build_skeleton(info.config)
        _, layers, _, _ = decoder_parts(model)
        device_of = {}
        for p in parts:
            device_of.update({id(layers[i]): torch.device(p.device) for i in p.layers})
        last = torch.device(parts[-1].device)
        for name, module in model.named_modules():
            # Rotary tables and other buffers are computed here; each goes to its module's device.
            dev = first
            if name.startswith("model.layers."):
                dev = device_of[id(layers[int(name.split(".")[2])])]
            elif name.startswith(("model.norm", "lm_head")):
                dev = last
            for key, buf in module._buffers.items():
                if buf is not None and buf.device != dev:
                    module._buffers[key] = buf.to(dev)
        lap("skeleton_ms")
        runtimes = []
        for ph in handle.parts:
            part, desc, plan = ph.part, ph.desc, ph.plan
            memory, events = client.device_memory(part.target, desc)
            gates, tensors = _resident_views(client, info, desc, plan, memory)
            bind_parameters(model, {n: t for n, t in tensors.items() if part.owns(n)},
                            complete=False)
            if plan.streaming:
                ph.stream = start_streaming(model, handle, plan, desc, memory, part.target,
                                            part=True)
                runtimes.append(ph.stream)
            if not bool((gates == GATE_READY).all()):
                ph.gates = Gates(model, gates, events, part=part,
                                 device=None if part.target == "cpu" else part.target)
        bind_parameters(model, {})     # every parameter bound by some part
        if runtimes:
            handle.stream = StreamGroup(runtimes)
            start_reports(handle.stream, handle)
        handle._hooks = move_activations(model, parts)
        lap("bind_ms")
        return handle, model
    except BaseException:
        if handle.parts:
            try:
                handle.close()
            except Exception:  # noqa: BLE001 -- the original error is the one to report
                log.exception("detaching %s after a failed load_model", info.name)
        elif owns_client:
            client.close()
        raise


def _to(value, device, memo: dict | None = None):
    """``value`` with every tensor in it on ``device``. ``memo`` (id -> (source, copy)) reuses a
    copy made for an earlier layer of the same part: the rotary tables and masks are the same
    tensors for every layer of a pass, so they cross once per part, not once per layer."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        hit = memo.get(id(value)) if memo is not None else None
        if hit is not None and hit[0] is value:
            return hit[1]
        # Non-blocking only towards a GPU: a copy to the host must be complete when read.
        moved = value.to(device, non_blocking=device.type == "cuda")
        if memo is not None:
            memo[id(value)] = (value, moved)
        return moved
    if isinstance(value, tuple):
        return tuple(_to(v, device, memo) for v in value)
    if isinstance(value, list):
        return [_to(v, device, memo) for v in value]
    if isinstance(value, dict):
        return {k: _to(v, device, memo) for k, v in value.items()}
    return value


def move_activations(model, parts) -> list:
    """Hooks that carry activations across devices: before each decoder layer, its tensor
    arguments (hidden states, rotary tables, masks, positions) move to the layer's device where
    they are elsewhere (only at a part boundary does anything move); the logits go back to the
    embeddings' device, where ``generate()`` keeps its tokens. Nothing is hooked where every part
    shares one device. The KV cache needs nothing: transformers makes each layer's cache on its
    keys' device."""
    import torch

    _, layers, _, head = decoder_parts(model)
    if len({p.device for p in parts}) == 1:
        return []
    first = torch.device(parts[0].device)
    hooks = []
    for part in parts:
        memo: dict = {}
        start = part.layers[0]

        def pre(module, args, kwargs, device=torch.device(part.device), memo=memo, start=start,
                index=None):
            if index == start:
                memo.clear()          # a new pass: last pass's copies are not reused
            return _to(args, device, memo), _to(kwargs, device, memo)

        for i in part.layers:
            hooks.append(layers[i].register_forward_pre_hook(
                functools.partial(pre, index=i), with_kwargs=True))
    hooks.append(head.register_forward_hook(lambda module, args, out: _to(out, first)))
    return hooks
