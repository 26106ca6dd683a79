"""Prefetch policy: what to read ahead (``ForwardOrder``) and how far ahead (``WindowPolicy``).

Both halves are pure (no IO, no locks, no clock) and both sides use them: the daemon's block
manager and loader walk ``ForwardOrder`` and schedule the reads themselves; a streaming client
(``client.stream``) moves its window with ``WindowController``, which keeps ``WindowPolicy``'s
decisions and logs them.

**What.** A forward pass walks *stages* in a fixed order: the head (embeddings), decoder layers 0..L-1, the
tail (final norm, lm_head); decoding then starts the next pass at the head again. Acquiring layer
``i`` asks for the next ``prefetch_window`` stages after it, wrapping round, so the blocks a client
needs next are read from NVMe while it computes on the current layer. Hot stages (head and tail
blocks are small and normally resident) are included; resident blocks cost nothing to ask for.

**How far.** A streaming client's window (how many layers ahead it copies into its slots)
moves within ``[low, high]`` once per forward pass:

* it grows while the compute stream stalls on copies (miss rate above ``grow_at``);
* it shrinks while the PCIe link is busy with other work (``other_load`` above ``busy_at`` of
  the link), so streaming yields to the traffic it did not cause;
* it shrinks by one after ``calm_passes`` passes in a row with every layer prefetched and none
  stalled (hit rate 100 %): copies then land earlier than needed, and a smaller window puts
  fewer bytes on a link other clients share; a stall grows it back;
* otherwise it holds.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("deepseek_flash.prefetch")


class ForwardOrder:
    """The stage sequence of one model: lists of block ids in forward order."""

    def __init__(self, blocks, num_layers: int):
        head, tail = [], []
        layers: list[list[int]] = [[] for _ in range(num_layers)]
        for block in blocks:
            if block.layer >= 0:
                while block.layer >= len(layers):
                    layers.append([])
                layers[block.layer].append(block.id)
            elif block.role == "embed":
                head.append(block.id)
            else:
                tail.append(block.id)
        self.layers = layers
        # Stage 0 is the head, stage i + 1 is layer i, the last stage is the tail.
        self.stages: list[list[int]] = [head, *layers, tail]

    def layer_blocks(self, layer: int) -> list[int]:
        return list(self.layers[layer])

    def stages_after(self, layer: int, window: int) -> list[int]:
        """Block ids of the ``window`` stages that follow ``layer``, nearest first (cyclic)."""
        if window <= 0 or not self.stages:
            return []
        start = layer + 1
        out: list[int] = []
        count = 0
        n = len(self.stages)
        for step in range(1, n):
            stage = self.stages[(start + step) % n]
            if not stage:
                continue
            out.extend(stage)
            count += 1
            if count >= window:
                break
        return out


@dataclass(frozen=True)
class WindowStep:
    """One pass's outcome: the next window, the next count of calm passes, why it changed."""

    window: int
    calm: int
    reason: str | None = None       # None: the window held


@dataclass(frozen=True)
class WindowPolicy:
    """The window rule (see the module docstring) as a function of one pass's observations."""

    low: int
    high: int
    grow_at: float = 0.05
    busy_at: float = 0.5
    calm_passes: int = 32

    def clamp(self, window: int) -> int:
        return min(max(window, self.low), max(self.low, self.high))

    def step(self, window: int, calm: int, misses: int, layers: int,
             other_load: float | None = None) -> WindowStep:
        """After a pass of ``layers`` streamed layers, ``misses`` of them not prefetched or
        stalled, with the link ``other_load`` busy with other traffic (None: unknown), holding
        ``window`` after ``calm`` calm passes in a row."""
        high = max(self.low, self.high)
        miss_rate = misses / layers if layers else 0.0
        calm = calm + 1 if misses == 0 else 0
        if other_load is not None and other_load > self.busy_at and window > self.low:
            return WindowStep(window - 1, 0, f"link busy with other work ({other_load:.0%})")
        if miss_rate > self.grow_at and window < high:
            return WindowStep(window + 1, 0, f"stalls on {miss_rate:.0%} of streamed layers")
        if calm >= self.calm_passes and window > self.low:
            return WindowStep(window - 1, 0, f"hit rate 100% without stalls for {calm} passes")
        return WindowStep(window, calm)


class WindowController:
    """One client's window under a ``WindowPolicy``: the current value, and the last 32 changes
    with their time and reason (reported to the controller as ``decisions``)."""

    def __init__(self, window: int, low: int, high: int, **policy):
        self.policy = WindowPolicy(low, high, **policy)
        self.window = self.policy.clamp(window)
        self._calm = 0
        self.decisions: list[dict] = []

    def update(self, misses: int, layers: int, other_load: float | None = None) -> int:
        step = self.policy.step(self.window, self._calm, misses, layers, other_load)
        if step.reason is not None:
            self.decisions.append({"time": time.time(), "from": self.window, "to": step.window,
                                   "reason": step.reason})
            del self.decisions[:-32]
            log.info("prefetch window %d -> %d: %s", self.window, step.window, step.reason)
        self.window, self._calm = step.window, step.calm
        return self.window
