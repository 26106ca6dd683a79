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

import logging
import threading
import time

from ..errors import FlashIOError
from ..sizes import parse_size
from ..store.views import block_tensors
from ..wire import GATE_FAILED, GATE_PENDING, GATE_READY, Plan, control_views
from .skeleton import bind_parameters, build_skeleton, decoder_parts
from .stream import start_streaming

log = logging.getLogger("deepseek_flash.model")


class Gates:
    """Holds each layer back until its bytes are there; removes itself once all have opened.

    ``control`` is a uint32 array in shared memory written by the loader (0 pending, 1 ready,
    2 failed). ``events`` (GPU only) are the loader's per-gate copy events: the compute stream
    waits on them, so the CPU never waits for a copy, only for the loader to have *issued* it.
    """

    def __init__(self, model, control, events=None, on_failure=None):
        self.control = control
        self.events = events
        self.on_failure = on_failure
        self.opened = [False] * len(control)
        self.handles = []
        self._lock = threading.Lock()
        embed, layers, norm, head = decoder_parts(model)
        targets = [(embed, 0)] + [(layer, i + 1) for i, layer in enumerate(layers)]
        targets += [(norm, len(layers) + 1), (head, len(layers) + 1)]
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

            torch.cuda.current_stream().wait_event(self.events[gate])
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
        self.priority = 0                       # of this model's reads in the controller
        self._owns_client = owns_client
        self.closed = False

    def set_read_priority(self, priority: int) -> None:
        """The ``priority`` of the reads this model causes from now on -- the acquires of its
        streamed layers (higher goes to the disk before waiting reads of a lower one, and moves up
        reads of the same blocks queued earlier). ``deepseek-flash serve`` sets it before each
        forward from the classes of the requests in it."""
        self.priority = int(priority)
        side = getattr(self.stream, "host_side", None)
        if side is not None:
            side.priority = self.priority

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.gates is not None:
            self.gates.remove()
        if self.stream is not None:
            self.stream.close()
        self.client.detach(self.info.name)
        if self._owns_client:
            self.client.close()


def load_model(name_or_path, device="cpu", weight_budget=None, embedded=None, flash_context=None,
               *, client=None, socket_path=None, config=None, decode="eager", decode_capacity=None,
               priority: int = 0):
    """A ``transformers`` causal LM whose weights are views into the controller's memory.

    ``name_or_path``: a registered model name or a store directory (``deepseek-flash pack``).
    ``device``: ``"cpu"`` (views into the shared host arena) or ``"cuda[:N]"`` (views into the
    daemon's GPU arena on that device). ``weight_budget`` (bytes or ``"8GiB"``) caps the device
    memory this model may occupy; layers that do not fit are streamed (``client.stream``).
    ``embedded``: None uses the daemon when one answers, else an in-process controller.
    ``flash_context``: ``flash_config`` overrides for this model (e.g. ``prefetch_window``).
    ``priority``: of this model's disk reads in the controller (its load, its streamed layers):
    higher goes before waiting reads of other models, e.g. another model's cold load.
    ``decode``: ``"eager"`` (transformers' ``generate``) or ``"graphs"``: ``generate()`` decodes
    each token as one CUDA-graph replay over a static KV cache of ``decode_capacity`` tokens per
    sequence (prompt + new; default ``min(4096, max_position_embeddings)``), see
    ``deepseek_flash.decode``; where capture is impossible it says why in the log and runs eagerly.

    The call may return before a GPU load has finished: a forward pass waits, per layer, only
    where that layer's bytes are not there yet. ``model.generate()`` works unchanged.
    """
    import torch

    from ..decode.engine import check_mode, for_loaded_model
    from . import Client

    check_mode(decode)
    owns_client = client is None
    if client is None:
        client = Client(socket_path=socket_path, embedded=embedded, config=config)
    timings = {}
    mark = time.perf_counter()

    def lap(name):
        nonlocal mark
        now = time.perf_counter()
        timings[name] = round((now - mark) * 1e3, 3)
        mark = now

    handle = None
    try:
        info = client.open_model(name_or_path, flash_context)
        dev = torch.device(device)
        target = "cpu" if dev.type == "cpu" else (dev.index if dev.index is not None else 0)
        budget = None if weight_budget is None else parse_size("weight_budget", weight_budget)
        lap("open_model_ms")
        handle = FlashModelHandle(client, info, dev, None, owns_client)
        handle.timings = timings
        # Attach first: a cold load starts reading and copying while the skeleton is built.
        handle.priority = priority
        handle.desc = client.attach(info.name, target, weight_budget=budget, priority=priority)
        lap("attach_ms")
        model = build_skeleton(info.config)
        if dev.type != "cpu":
            # Rotary tables and other buffers are computed in this process; only they move.
            for module in model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[name] = buf.to(dev)
        lap("skeleton_ms")
        _bind(model, handle, target, lap)
        model.flash = handle
        for_loaded_model(model, handle, decode, decode_capacity)
        timings["total_ms"] = round(sum(timings.values()), 3)
        return model
    except BaseException:
        if handle is not None and handle.desc is not None:
            try:
                handle.close()
            except Exception:  # noqa: BLE001 -- the original error is the one to report
                log.exception("detaching %s after a failed load_model", handle.info.name)
        elif owns_client:
            client.close()
        raise


def _bind(model, handle, target, lap) -> None:
    """Bind the resident blocks of the controller's answer to ``attach`` (``handle.desc``), start
    streaming the rest if the plan says so, and gate layers still loading."""
    client, info, desc = handle.client, handle.info, handle.desc
    plan = Plan.from_wire(desc["plan"])
    memory, events = client.device_memory(target, desc)
    lap("device_memory_ms")
    gates, offsets = control_views(client.arena, desc["control_offset"], desc["num_gates"],
                                   desc["num_blocks"])
    resident = set(plan.resident)
    tensors = {}
    for i, block in enumerate(info.blocks):
        if block.id in resident:
            off = int(offsets[i])
            tensors.update(block_tensors(block, memory[off:off + block.length]))
    bind_parameters(model, tensors, complete=not plan.streaming)
    if plan.streaming:
        handle.stream = start_streaming(model, handle, plan, desc, memory, target)
    if not bool((gates == GATE_READY).all()):
        handle.gates = Gates(model, gates, events)
    lap("bind_ms")
