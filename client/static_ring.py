"""A streamed model's ring as a fixed per-step schedule (``StaticRing``), for a caller that runs the
layers itself and captures the step in a CUDA graph (``decode.fused``)."""
from __future__ import annotations


class StaticRing:
    """A runtime's ring as a fixed per-step schedule, for a caller that runs the layers itself
    (the decode step, ``decode.fused``) -- capturable in a CUDA graph.

    Streamed layer ``idx`` always lives in slot ``idx % n``, so the copies of one step are the
    same at every step: at ``begin`` the first ``n`` layers' copies (every slot is free: the step
    starts after the previous one's compute, in stream order); ``before(idx)`` makes compute wait
    for layer ``idx``'s copy; ``after(idx)`` marks the slot free and issues layer ``idx + n``'s copy
    into it, after that compute. The window is the slot count: the most the slots allow, fixed,
    so the plan never changes between steps (the runtime's adaptive window applies to passes run
    through the hooks). Copies go on the runtime's copy stream (forked from and joined back into
    the compute stream: a captured graph holds them as its own nodes) from the runtime's
    page-locked host mapping. ``enter`` / ``exit`` bracket a run of static steps between passes
    run through the hooks. On the CPU the copies are synchronous.
    """

    def __init__(self, runtime):  # a client.stream.StreamRuntime
        self.runtime = runtime
        self.layers = list(runtime.layers)
        self.index = {layer: idx for idx, layer in enumerate(self.layers)}
        self.n, self.m = runtime.n, runtime.m
        ops = runtime.ops
        self.copy_done = [ops.event() for _ in range(self.n)]
        self.compute_done = [ops.event() for _ in range(self.n)]
        self.step_bytes = sum(runtime.blocks[bid].length for layer in self.layers
                              for bid, _ in runtime._slot_layout[layer])
        self.steps = 0
        self.copies: list = []     # (layer, slot) of the copies of the last step (a trace)

    def host_ready(self) -> str | None:
        """Every streamed block's host offset known and its pages locked; else why not."""
        rt = self.runtime
        for layer in self.layers:
            if any(bid not in rt.host_offsets for bid, _ in rt._slot_layout[layer]):
                rt.host_offsets.update(rt.fetch_host(layer))
        side = rt.host_side
        if side is not None:
            side._thread.join()
            if side.pinned_bytes < self.step_bytes:
                return (f"streamed host ranges not page-locked ({side.pinned_bytes} of "
                        f"{self.step_bytes} bytes): copies from pageable memory cannot be captured")
        return None

    def enter(self) -> None:
        """Before the first static step: compute waits for copies the hooks still have in flight
        (they write the same slots)."""
        rt = self.runtime
        if rt.is_cuda:
            import torch

            torch.cuda.current_stream(rt.ops.device).wait_stream(rt.ops.copy_stream)

    def exit(self) -> None:
        self.runtime.resume()

    def _copy(self, idx: int, wait_compute: bool) -> None:
        rt = self.runtime
        layer, slot = self.layers[idx], idx % self.n
        wait_for = self.compute_done[slot] if wait_compute else None
        for bid, offset in rt._slot_layout[layer]:
            src, n = rt.host_offsets[bid], rt.blocks[bid].length
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

    def before(self, layer: int) -> None:
        self.runtime.ops.wait_copy(self.copy_done[self.index[layer] % self.n])

    def after(self, layer: int) -> None:
        idx = self.index[layer]
        self.runtime.ops.record_compute(self.compute_done[idx % self.n])
        if idx + self.n < self.m:
            self._copy(idx + self.n, wait_compute=True)

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
        return {"static_steps": self.steps, "slots": self.n, "streamed_layers": self.m,
                "step_bytes": self.step_bytes}
