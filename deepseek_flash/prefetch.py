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

**Where it starts.** ``prefetch_window`` defaults to ``"auto"``: the planner sizes the ring with
``auto_window`` (three slots -- one copy on the link, the next queued behind it, one computing --
and more only where one slot's copy is so short that issuing the next copy would leave the link
idle) and starts the window at the whole ring: a slot is refilled as soon as its layer has run
(the copy waits on the GPU for that compute), so when a pass ends every slot's copy for the
next pass is already on the link while the host samples the token and runs the resident layers
up to the first streamed one -- the one stretch where it issues nothing (``PASS_GAP_S``; where
the ring's copies are shorter than that the planner spreads the resident layers among the
streamed ones, so the stretch holds none of them). So no user has to tune it. An explicit ``prefetch_window`` is taken as asked. The daemon's read-ahead of stages uses
``readahead_window``.

**Whose traffic.** ``other_link_load`` is the only source of ``other_load``: the device's PCIe
receive rate averaged over many of NVML's short (20 ms) samples spread over an interval, less the
bytes this client's copies *completed* over the same interval (copy events, not issue times), as
a fraction of the link. Where too few samples cover the interval it answers None (unknown), and
the window then ignores the link: it never shrinks on traffic that is ours.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

log = logging.getLogger("deepseek_flash.prefetch")


AUTO = "auto"
# Stages the daemon reads ahead of an acquired layer when ``prefetch_window`` is "auto".
DEFAULT_READAHEAD = 2
# Where NVML cannot tell the link: PCIe gen 4 x16 after encoding, bytes/s.
NOMINAL_LINK_BYTES_PER_S = 25e9
# A streaming client issues the next copy from Python after a layer ran (tens of microseconds);
# the copies queued ahead must keep the link busy for at least this long meanwhile.
ISSUE_COVER_S = 200e-6
MAX_AUTO_WINDOW = 8
# Between two tokens the host issues no copy: from the last streamed unit of a pass (whose slot
# takes the next pass's unit) to the first streamed unit of the next one (whose slot frees the
# next) lie the resident layers after it, the head and norm, sampling, the next pass's start and
# the layers before it. The copies the ring holds queued must last at least this long or the link
# idles there: measured on the H200 (2026-12-02, mistral 7B, 14 resident layers at the end of the
# pass, three 117 MB slots = 6.4 ms of copies at 55.4 GB/s): the link idled 2.25 ms a token, so
# the stretch is ~8.6 ms. The planner compares it with the ring's copy time at the link's rate.
PASS_GAP_S = 9e-3
# NVML's PCIe throughput counter covers the last 20 ms before each call.
NVML_SAMPLE_S = 0.02


def readahead_window(window) -> int:
    """Stages the daemon reads ahead for ``prefetch_window`` (an int, or "auto")."""
    return DEFAULT_READAHEAD if window == AUTO else int(window)


def auto_window(slot_bytes: int, link_bytes_per_s: float | None) -> int:
    """``prefetch_window: "auto"`` as a ring size: the planner gives it this + 1 slots (and the
    client's window starts at all of them, see the module docstring).

    Two copies in flight keep the link busy while a layer computes (one on the link, the next
    queued), so 2 is enough wherever one slot's copy lasts longer than issuing the next one; for
    small layers the window covers ``ISSUE_COVER_S`` of copies instead (at most
    ``MAX_AUTO_WINDOW``)."""
    link = link_bytes_per_s or NOMINAL_LINK_BYTES_PER_S
    if slot_bytes <= 0:
        return 2
    copy_s = slot_bytes / link
    return min(MAX_AUTO_WINDOW, max(2, 1 + math.ceil(ISSUE_COVER_S / copy_s)))


def other_link_load(rx_rates, own_bytes: int, seconds: float, capacity: float | None,
                    sample_s: float = NVML_SAMPLE_S) -> float | None:
    """How busy the link was with traffic that is not ours, as a fraction of ``capacity``.

    ``rx_rates``: NVML receive rates (bytes/s), each over the ``sample_s`` before it was read,
    spread over an interval of ``seconds``; ``own_bytes``: what this client's copies completed
    in that same interval. The mean of the samples and our completed bytes then describe the same
    window of time. None (unknown) without a capacity, or where the samples cover less than half
    of the interval: one short sample against a longer average reads our own bursts as someone
    else's traffic.
    """
    rates = list(rx_rates)
    if not capacity or seconds <= 0 or not rates or len(rates) * sample_s < 0.5 * seconds:
        return None
    total = sum(rates) / len(rates)
    ours = own_bytes / seconds
    return max(0.0, total - ours) / capacity


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
        window = readahead_window(window)
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
