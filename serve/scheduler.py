"""The three-class request scheduler of ``deepseek-flash serve`` -- policy only, no threads, no torch.

A *slot* is one row of the running batch (``slots`` = the engine's ``--max-batch``). The engine asks
``route(request)`` when a request arrives (admit and queue it, or refuse it with an HTTP status and
``Retry-After``), ``dispatch()`` at every step boundary (which queued requests join the batch now),
``tick()`` after each step (degrade steps for elastic requests under pressure) and ``finish()`` when a
request leaves the batch. Time and GPU-busy readings are injected (``clock``, ``gpu_busy``), so the
decisions are tables: arrivals in, order and degrade steps out.

The classes (``priority_class`` in a request's ``flash_context``):

* **L0 real-time**: ``l0_reserve`` (15 %) of the slots are kept for L0 -- the other classes never
  occupy them -- and L0 requests join before anything else. At most ``l0_capacity`` L0 requests are
  in the system (queued + running); the next one is refused (429). An L0 request that finds every
  slot taken *preempts* a running request (``l0_preempts``): an L2 one first, else an L1 one, the
  one that started last (the least work to redo); the engine frees its row and the request goes
  back to the head of its class's queue (an L1 request keeps its finish tag) with what it
  generated so far, which it recomputes when it joins again. L0 rows are never preempted. So the
  reserve is *lent* to L1 while no L0 request waits (L2 never takes it): an arriving L0 request
  takes it back at once. ``l0_preempts=False``: no preemption, and the reserve stays idle.
* **L1 balanced** (the default): weighted fair queueing. A request's finish tag is the virtual time
  at its arrival plus ``max_new_tokens / weight`` with ``weight = l1_weight_func(request)``
  (default ``max(1, max_new_tokens // 64)``); the lowest tag joins first and the virtual time
  becomes the tag of the request that joined (self-clocked fair queueing). Service per unit of
  weight is what is equalised, so a long request is not starved by a stream of short ones.
* **L2 elastic**: joins only while the slots not used or wanted by anyone exceed ``l2_idle_above``
  (30 %) of all slots. It is degraded only under pressure from the other classes: when the
  *headroom left by L0/L1 demand* -- the slots neither running nor wanted by a queued L0/L1 request,
  averaged over the last ``idle_window`` (5 s) -- is below ``degrade_idle_below`` (10 %) of the
  slots, or when the device has been more than ``gpu_busy_above`` (95 %) busy for
  ``gpu_busy_seconds`` (5 s) while L0/L1 requests waited for a slot all that time. L2's own rows
  never count as pressure: in a continuously batched engine a full batch is the normal state, and
  an elastic request that merely fills idle rows must not degrade itself. Under pressure every
  running L2 request is degraded one step per ``degrade_interval``: temperature +0.1, then top_p
  0.85, then ``max_new_tokens`` cut to 70 % of what is left (``l2_degrade_policy=
  "temperature_first"``, the only order the seed defines; ``"none"`` never degrades).

Within a class, a request's integer ``priority`` comes first (lower runs earlier, as in vLLM), then
the class's own order. Overload beyond what the queue holds (``max_queued``) is refused with 429;
a draining server refuses with 503; both carry ``retry_after`` seconds estimated from the measured
service time.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ..errors import ConfigError

CLASSES = ("L0", "L1", "L2")
DEGRADE_POLICIES = ("temperature_first", "none")
# The degrade steps of "temperature_first", in the order they are applied.
DEGRADE_STEPS = ("temperature", "top_p", "max_new_tokens")


def default_l1_weight(request) -> int:
    """The seed's L1 weight: ``max_new_tokens // 64`` (at least 1)."""
    return max(1, int(request.max_new_tokens) // 64)


@dataclass(eq=False)
class SchedRequest:
    """What the scheduler knows of a request. The engine keeps ``generated`` current and reads the
    (possibly degraded) sampling fields back at every step."""

    id: str
    priority_class: str = "L1"
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    priority: int = 0
    generated: int = 0
    arrival: float = 0.0
    started: float | None = None
    degraded: list = field(default_factory=list)    # degrade steps applied, in order
    last_degrade: float | None = None
    tag: float = 0.0                                 # L1 finish tag (virtual time)
    seq: int = 0                                     # arrival order
    preemptible: bool = True                         # may give its row to an L0 request
    preempted: int = 0                               # times it gave its row back

    @property
    def queue_ms(self) -> float | None:
        return None if self.started is None else (self.started - self.arrival) * 1e3


@dataclass(frozen=True)
class Route:
    """The answer to ``route``: admitted (queued), or refused with ``status`` and ``retry_after``."""

    admitted: bool
    priority_class: str
    status: int = 200
    retry_after: int | None = None
    reason: str = ""


class FlashScheduler:
    """L0 reservation + admission limit, L1 weighted fair queueing, L2 elastic with degrade steps."""

    fifo = False

    def __init__(self, l0_capacity: int = 50, l1_weight_func=default_l1_weight,
                 l2_degrade_policy: str = "temperature_first", *, slots: int = 8,
                 l0_reserve: float = 0.15, l2_idle_above: float = 0.30, degrade_idle_below: float = 0.10,
                 gpu_busy_above: float = 0.95, gpu_busy_seconds: float = 5.0,
                 degrade_interval: float = 1.0, idle_window: float = 5.0, max_queued: int | None = None,
                 clock=time.monotonic, gpu_busy=None, l0_preempts: bool = True):
        if l2_degrade_policy not in DEGRADE_POLICIES:
            raise ConfigError(f"l2_degrade_policy {l2_degrade_policy!r} is not one of {DEGRADE_POLICIES}",
                              key="l2_degrade_policy", value=l2_degrade_policy,
                              allowed=list(DEGRADE_POLICIES))
        if int(l0_capacity) < 1:
            raise ConfigError(f"l0_capacity must be >= 1, got {l0_capacity}", key="l0_capacity",
                              value=l0_capacity, allowed=">= 1")
        if int(slots) < 1:
            raise ConfigError(f"slots (max batch) must be >= 1, got {slots}", key="slots", value=slots,
                              allowed=">= 1")
        if not 0.0 <= l0_reserve < 1.0:
            raise ConfigError(f"l0_reserve must be in [0, 1), got {l0_reserve}", key="l0_reserve",
                              value=l0_reserve, allowed="[0, 1)")
        self.l0_capacity = int(l0_capacity)
        self.l1_weight_func = l1_weight_func
        self.l2_degrade_policy = l2_degrade_policy
        self.slots = int(slots)
        # Never reserve every slot: a one-slot server still serves L1.
        self.l0_reserved = min(self.slots - 1, math.ceil(l0_reserve * self.slots - 1e-9))
        self.l2_idle_above = l2_idle_above
        self.degrade_idle_below = degrade_idle_below
        self.gpu_busy_above = gpu_busy_above
        self.gpu_busy_seconds = gpu_busy_seconds
        self.degrade_interval = degrade_interval
        if not idle_window > 0:
            raise ConfigError(f"idle_window must be > 0 seconds, got {idle_window}", key="idle_window",
                              value=idle_window, allowed="> 0")
        self.idle_window = float(idle_window)
        self.max_queued = 16 * self.slots if max_queued is None else int(max_queued)
        self.clock = clock
        self.gpu_busy = gpu_busy
        self.l0_preempts = bool(l0_preempts) and not self.fifo
        self._preempted: list[SchedRequest] = []
        self.queued: list[SchedRequest] = []
        self.running: list[SchedRequest] = []
        self.virtual_time = 0.0
        self.draining = False
        self.mean_service_s = 1.0           # EWMA of time in the batch; feeds Retry-After
        self._seq = 0
        self._busy_since: float | None = None
        # L0/L1 demand (slots running or wanted by them) as a step function: (since, slots).
        self._demand: list[tuple[float, int]] = []
        self.counters = {"admitted": {c: 0 for c in CLASSES}, "refused_429": {c: 0 for c in CLASSES},
                         "refused_503": {c: 0 for c in CLASSES}, "finished": {c: 0 for c in CLASSES},
                         "degrade_steps": {s: 0 for s in DEGRADE_STEPS}, "degraded_requests": 0,
                         "preempted": {c: 0 for c in CLASSES}}

    # -- admission --------------------------------------------------------------------------------
    def route(self, request: SchedRequest) -> Route:
        """Admit ``request`` into its class's queue, or refuse it (429 overload, 503 draining)."""
        cls = request.priority_class
        if cls not in CLASSES:
            raise ValueError(f"priority_class {cls!r} is not one of {CLASSES}")
        if self.draining:
            return self._refuse(request, 503, "the server is shutting down")
        if cls == "L0" and not self.fifo:
            in_system = sum(1 for r in self.queued + self.running if r.priority_class == "L0")
            if in_system >= self.l0_capacity:
                return self._refuse(request, 429, f"L0 admission limit reached (l0_capacity={self.l0_capacity})")
        if len(self.queued) >= self.max_queued:
            return self._refuse(request, 429, f"queue full ({self.max_queued} requests waiting)")
        request.arrival = self.clock()
        request.seq = self._seq
        self._seq += 1
        if cls == "L1":
            weight = self.l1_weight_func(request)
            if not weight or weight <= 0:
                raise ValueError(f"l1_weight_func returned {weight!r}; weights must be > 0")
            request.tag = self.virtual_time + request.max_new_tokens / weight
        self.queued.append(request)
        self.counters["admitted"][cls] += 1
        self._note_demand()
        return Route(True, cls)

    def _refuse(self, request, status: int, reason: str) -> Route:
        self.counters[f"refused_{status}"][request.priority_class] += 1
        return Route(False, request.priority_class, status, self.retry_after(), reason)

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the queue ahead times the mean time in the batch,
        spread over the slots; 1 to 60."""
        wait = (len(self.queued) + 1) * self.mean_service_s / self.slots
        return int(min(60, max(1, math.ceil(wait))))

    def drain(self) -> None:
        """Refuse everything new with 503 (the queue and the batch run to completion)."""
        self.draining = True

    # -- the batch --------------------------------------------------------------------------------
    def _count(self, requests, *classes) -> int:
        return sum(1 for r in requests if r.priority_class in classes)

    def _order(self, cls: str):
        queue = [r for r in self.queued if r.priority_class == cls]
        if cls == "L1":
            return sorted(queue, key=lambda r: (r.priority, r.tag, r.seq))
        return sorted(queue, key=lambda r: (r.priority, r.seq))

    def queued_count(self, cls: str) -> int:
        """Requests of class ``cls`` waiting to join."""
        return self._count(self.queued, cls)

    def dispatch(self, protect=()) -> list[SchedRequest]:
        """The queued requests that join the batch now, in order (they are marked running).
        ``protect``: running requests that must not be preempted now."""
        now = self.clock()
        chosen = []

        def start(r):
            self.queued.remove(r)
            self.running.append(r)
            if r.started is None:           # a preempted request keeps its first start
                r.started = now
            chosen.append(r)

        free = self.slots - len(self.running)
        for r in self._order("L0"):
            if free == 0 and not (self.l0_preempts and self._preempt_one(protect)):
                self._note_demand()
                return chosen
            start(r)
            free = max(0, free - 1)
        shared = self.slots - self.l0_reserved          # slots the other classes may hold
        # With preemption the reserve is lent to L1 while no L0 request waits: an L0 request
        # arriving takes it back at once, so the reserve costs L1 nothing while it is not needed.
        lent = self.slots if self.l0_preempts else shared
        for r in self._order("L1"):
            if free == 0 or self._count(self.running, "L1", "L2") >= lent:
                break
            start(r)
            free -= 1
            self.virtual_time = max(self.virtual_time, r.tag)
        for r in self._order("L2"):
            if free == 0 or self._count(self.running, "L1", "L2") >= shared:
                break
            if not self.l2_open():
                break
            start(r)
            free -= 1
        self._note_demand()
        return chosen

    def l2_open(self) -> bool:
        """L2's rule to join: the slots neither running (any class) nor wanted by a queued L0/L1
        request are more than ``l2_idle_above`` of all slots."""
        wanted = len(self.running) + self._count(self.queued, "L0", "L1")
        return (self.slots - wanted) / self.slots > self.l2_idle_above

    def _preempt_one(self, protect=()) -> bool:
        """Free a slot for an L0 request: the running L2 request that started last, else the L1
        one (none in ``protect``); it goes back to its queue. False when every running request is
        L0 (or not preemptible, or protected)."""
        for cls in ("L2", "L1"):
            victims = [r for r in self.running if r.priority_class == cls and r.preemptible
                       and not any(r is p for p in protect)]
            if victims:
                victim = max(victims, key=lambda r: (r.started or 0.0, r.seq))
                self.running.remove(victim)
                self.queued.append(victim)
                victim.preempted += 1
                self.counters["preempted"][cls] += 1
                self._preempted.append(victim)
                return True
        return False

    def take_preempted(self) -> list[SchedRequest]:
        """The requests preempted since the last call (the engine frees their rows)."""
        taken, self._preempted = self._preempted, []
        return taken

    def finish(self, request: SchedRequest) -> None:
        """``request`` left the batch (done, cancelled or failed) or the queue (cancelled)."""
        if request in self.running:
            self.running.remove(request)
            self.counters["finished"][request.priority_class] += 1
            if request.started is not None:
                spent = max(0.0, self.clock() - request.started)
                self.mean_service_s = 0.8 * self.mean_service_s + 0.2 * spent
        elif request in self.queued:
            self.queued.remove(request)
        self._note_demand()

    # -- pressure and degrade ---------------------------------------------------------------------
    def demand(self) -> int:
        """Slots L0/L1 use or want now: running plus queued, at most all slots."""
        return min(self.slots, self._count(self.running, "L0", "L1") + self._count(self.queued, "L0", "L1"))

    def _note_demand(self) -> None:
        now, slots = self.clock(), self.demand()
        if self._demand and self._demand[-1][1] == slots:
            return
        if self._demand and self._demand[-1][0] == now:
            self._demand[-1] = (now, slots)
        else:
            self._demand.append((now, slots))
        # Keep the last change before the window: it holds at the window's start.
        while len(self._demand) > 1 and self._demand[1][0] <= now - self.idle_window:
            self._demand.pop(0)

    def idle_fraction(self) -> float:
        """Headroom left by L0/L1 demand over the last ``idle_window`` seconds: one minus the
        time-average of the slots L0/L1 requests ran in or waited for, over all slots. Time before
        the first request counts as idle; L2's own rows do not count at all."""
        now = self.clock()
        start = now - self.idle_window
        used = 0.0
        for i, (since, slots) in enumerate(self._demand):
            until = self._demand[i + 1][0] if i + 1 < len(self._demand) else now
            used += slots * max(0.0, min(until, now) - max(since, start))
        return 1.0 - used / (self.idle_window * self.slots)

    def under_pressure(self) -> bool:
        """Pressure on L2 from the other classes: L0/L1 headroom below ``degrade_idle_below`` over
        the window, or the device more than ``gpu_busy_above`` busy for ``gpu_busy_seconds`` with
        L0/L1 requests waiting for a slot throughout."""
        now = self.clock()
        busy = self.gpu_busy() if self.gpu_busy is not None else None
        waiting = self._count(self.queued, "L0", "L1") > 0
        if busy is not None and busy > self.gpu_busy_above and waiting:
            if self._busy_since is None:
                self._busy_since = now
        else:
            self._busy_since = None
        gpu_hot = self._busy_since is not None and now - self._busy_since >= self.gpu_busy_seconds
        return gpu_hot or self.idle_fraction() < self.degrade_idle_below - 1e-9

    def tick(self) -> list[tuple[SchedRequest, str]]:
        """Degrade steps applied now: one step per running L2 request under pressure, at most one per
        ``degrade_interval`` for each request. Returns (request, step name) pairs."""
        if self.fifo or self.l2_degrade_policy == "none" or not self.under_pressure():
            return []
        now = self.clock()
        applied = []
        for r in self.running:
            if r.priority_class != "L2" or len(r.degraded) == len(DEGRADE_STEPS):
                continue
            if r.last_degrade is not None and now - r.last_degrade < self.degrade_interval:
                continue
            step = DEGRADE_STEPS[len(r.degraded)]
            if step == "temperature":
                r.temperature = round(r.temperature + 0.1, 6)
            elif step == "top_p":
                r.top_p = min(r.top_p, 0.85)
            else:
                left = max(0, r.max_new_tokens - r.generated)
                r.max_new_tokens = r.generated + int(left * 0.7)
            if not r.degraded:
                self.counters["degraded_requests"] += 1
            r.degraded.append(step)
            r.last_degrade = now
            self.counters["degrade_steps"][step] += 1
            applied.append((r, step))
        return applied

    def snapshot(self) -> dict:
        """Gauges and counters for /metrics."""
        return {"queued": {c: self._count(self.queued, c) for c in CLASSES},
                "running": {c: self._count(self.running, c) for c in CLASSES},
                "slots": self.slots, "l0_reserved": self.l0_reserved,
                "l2_headroom": round(self.idle_fraction(), 4),
                **{k: (dict(v) if isinstance(v, dict) else v) for k, v in self.counters.items()}}


class FifoScheduler(FlashScheduler):
    """The scheduler switched off: arrival order for every class, no reservation, no L0 limit, no
    preemption, no elastic rule, no degrade -- what the bench compares against. Overload still gets 429/503."""

    fifo = True

    def __init__(self, *, slots: int = 8, max_queued: int | None = None, clock=time.monotonic):
        super().__init__(slots=slots, l0_reserve=0.0, max_queued=max_queued, clock=clock)

    def dispatch(self) -> list[SchedRequest]:
        now = self.clock()
        chosen = []
        for r in sorted(self.queued, key=lambda r: r.seq)[: self.slots - len(self.running)]:
            self.queued.remove(r)
            self.running.append(r)
            if r.started is None:
                r.started = now
            chosen.append(r)
        self._note_demand()
        return chosen
