"""A streamed model's ring as a fixed per-step schedule (``StaticRing``), for a caller that runs the
layers itself and captures the step in a CUDA graph (``decode.fused``)."""
from __future__ import annotations


class StaticRing:
    """A runtime's ring as a fixed per-step schedule, for a caller that runs the layers itself
    (the decode step, ``decode.fused``) -- capturable in a CUDA graph.

    Streamed unit ``idx`` (a layer's MLP, or one projection of it: the plan's ``unit``) always
    lives in slot ``idx % n``, so the copies of one step are the same at every step: at ``begin``
    the first ``n`` units' copies (every slot is free: the step starts after the previous one's
    compute, in stream order); before a unit runs, compute waits for its copy; after it ran, its
    slot is marked free and unit ``idx + n``'s copy is issued into it, after that compute. With
    whole-layer units the caller brackets each streamed layer with ``before(layer)`` /
    ``after(layer)``; with projection units it calls each projection through ``wrap(module)``
    (``before`` / ``after`` then do nothing). The window is the slot count: the most the slots
    allow, fixed, so the plan never changes between steps (the runtime's adaptive window applies
    to passes run through the hooks). Copies go on the runtime's copy stream (forked from and
    joined back into the compute stream: a captured graph holds them as its own nodes) from the
    runtime's page-locked host mapping. ``enter`` / ``exit`` bracket a run of static steps
    between passes run through the hooks (whose hooks do nothing meanwhile). On the CPU the
    copies are synchronous.
    """

    def __init__(self, runtime):  # a client.stream.StreamRuntime
        self.runtime = runtime
        self.layers = list(runtime.layers)
        self.index = {layer: idx for idx, layer in enumerate(self.layers)}
        self.n, self.m = runtime.n, runtime.m
        self.per_layer = runtime.plan.unit == "layer"
        self._unit_of = {id(module): idx for idx, module in enumerate(runtime.unit_modules)}
        ops = runtime.ops
        self.copy_done = [ops.event() for _ in range(self.n)]
        self.compute_done = [ops.event() for _ in range(self.n)]
        self.step_bytes = sum(n for _, layout in runtime.units for *_, n in layout)
        self.steps = 0
        self.copies: list = []     # (layer, slot) of the copies of the last step (a trace)

    def host_ready(self) -> str | None:
        """Every streamed block's host offset known and its pages locked; else why not."""
        rt = self.runtime
        for layer in self.layers:
            if any(bid not in rt.host_offsets for bid in rt.plan.stream_blocks[layer]):
                rt.host_offsets.update(rt.fetch_host(layer))
        side = rt.host_side
        if side is not None:
            side._thread.join()
            if side.pinned_bytes < self.step_bytes:
                return (f"streamed host ranges not page-locked ({side.pinned_bytes} of "
                        f"{self.step_bytes} bytes): copies from pageable memory cannot be captured")
        return None

    def enter(self) -> None:
        """Before the first static step: the hooks stand aside, and compute waits for copies
        they still have in flight (they write the same slots)."""
        rt = self.runtime
        rt.suspend()
        if rt.is_cuda:
            import torch

            torch.cuda.current_stream(rt.ops.device).wait_stream(rt.ops.copy_stream)

    def exit(self) -> None:
        self.runtime.resume()

    def _copy(self, idx: int, wait_compute: bool) -> None:
        rt = self.runtime
        layer, layout = rt.units[idx]
        slot = idx % self.n
        wait_for = self.compute_done[slot] if wait_compute else None
        for bid, start, offset, n in layout:
            src = rt.host_offsets[bid] + start
            rt.ops.copy(rt.slots[slot][offset:offset + n], rt.host[src:src + n], wait_for)
            wait_for = None
        rt.ops.record_copy(self.copy_done[slot])
        self.copies.append((layer, slot))

    def begin(self) -> None:
        rt = self.runtime
        self.copies = []
        if rt.is_cuda:
            import torch

            rt.ops.copy_stream.wait_stream(torch.cuda.current_stream(rt.ops.device))
        for idx in range(min(self.n, self.m)):
            self._copy(idx, wait_compute=False)

    def before_unit(self, idx: int) -> None:
        """Compute waits for unit ``idx``'s copy."""
        self.runtime.ops.wait_copy(self.copy_done[idx % self.n])

    def after_unit(self, idx: int) -> None:
        """Unit ``idx`` ran: its slot takes unit ``idx + n`` (after that compute)."""
        self.runtime.ops.record_compute(self.compute_done[idx % self.n])
        if idx + self.n < self.m:
            self._copy(idx + self.n, wait_compute=True)

    def before(self, layer: int) -> None:
        if self.per_layer:
            self.before_unit(self.index[layer])

    def after(self, layer: int) -> None:
        if self.per_layer:
            self.after_unit(self.index[layer])

    def wrap(self, module):
        """``module`` as the step calls it: a streamed projection (projection units) waits for
        its copy before and frees its slot after; anything else as it is."""
        idx = None if self.per_layer else self._unit_of.get(id(module))
        return module if idx is None else _UnitCall(self, idx, module)

    def end(self) -> None:
        """Joins the copy stream back into compute (a capture must end joined)."""
        rt = self.runtime
        if rt.is_cuda:
            import torch

            torch.cuda.current_stream(rt.ops.device).wait_stream(rt.ops.copy_stream)

    def count_step(self) -> None:
        """Host-side counters of one step run (a replay issues no Python)."""
        self.steps += 1
        rt = self.runtime
        with rt._lock:
            rt.bytes_streamed += self.step_bytes
            rt.tokens += 1
            if rt.is_cuda:   # the link sampler must not read these bytes as others' traffic
                rt._issued_mark += self.step_bytes
                rt._bytes_completed += self.step_bytes

    def stats(self) -> dict:
        return {"static_steps": self.steps, "slots": self.n, "streamed_layers": len(self.layers),
                "streamed_units": self.m, "step_bytes": self.step_bytes}


class _UnitCall:
    """One streamed projection as a static step calls it (``StaticRing.wrap``)."""

    def __init__(self, ring: StaticRing, idx: int, module):
        self.ring, self.idx, self.module = ring, idx, module
        self.weight = getattr(module, "weight", None)
        if hasattr(module, "out_features"):
            self.out_features = module.out_features

    def __call__(self, x):
        self.ring.before_unit(self.idx)
        out = self.module(x)
        self.ring.after_unit(self.idx)
        return out
