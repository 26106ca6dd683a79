"""L0 prompts *beside* a forward of the batch already on the device: the second CUDA stream, and the
preemption of a row that forward still writes into.

The engine's batch forwards -- the decode step, other prompts' chunk -- run as CUDA graphs
(``graphs``): once one is issued, the host is idle until its result is taken. ``L0Beside`` fills
that gap. ``meanwhile(writing, slots)`` is the function the runner calls once the forward is issued
(``RowRunner.decode``/``prefill``, ``meanwhile=``; None: nothing goes beside it): until the forward
is done on the device, an L0 request that arrives joins the batch at once -- in a free row, or in
the row of a request it preempts -- and its prompt runs from the L0 requests' own graphs
(``RowRunner.static_prefill_l0``: own buffers, memory pool and cuBLAS workspace) on a stream of its
own (``SideStream``), its first token out before the forward's result is taken. A prompt of a
shape no L0 graph has waits for the next step, as does every L0 request while this path is off: the
scheduler off (FIFO), a streamed model (its layer ring is driven by one forward at a time), no L0
request in the last ``Engine.l0_recent_s`` seconds, or after a failure here (logged, ``reason``).

**Rows.** The L0 prompt's row is never one the forward in flight writes (``writing``) -- except,
for the decode, a row whose decode slot lies beyond every queued L0 prompt (``protected``): the
decode writes one slot per row, the prompt writes slots ``0..len`` of its row, so on a full batch
the L0 request may take that row now; the decode's token for the request it preempted is dropped
and that request rewinds (``Generation.rewind``), as any preempted one.

**Waiting.** The engine thread waits on its condition for whichever comes first, a new request or
the device: a ``DeviceWaiter`` thread blocks on a CUDA event recorded after the forward (off the
interpreter lock) and wakes it -- no polling.

What the engine provides (``L0Beside(engine)``): ``_lock`` (its condition; the scheduler and the
rows are touched under it), ``scheduler``, ``runner``, ``stats`` (``l0_beside`` counts the prompts
run here), ``l0_recent()``, ``_join(protect)`` (dispatch, preempt, admit: lock held),
``_l0_group()`` (the L0 prompts in the batch with tokens left: lock held), ``_queued_l0_need()``
(the longest queued L0 prompt: lock held), ``_prefill_shape(group)`` and ``_prefill(group, l0=True)``.
"""
from __future__ import annotations

import contextlib
import logging
import threading

log = logging.getLogger("deepseek_flash.serve")


class DeviceWaiter:
    """A thread that waits for CUDA events (``event.synchronize()``, which lets the interpreter
    lock go) and then sets ``flag[0]`` and wakes every waiter on ``cond``: the engine thread waits
    on its condition for whichever comes first, the device or a new request."""

    def __init__(self, cond: threading.Condition):
        import queue

        self.cond = cond
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="serve-device-waiter", daemon=True)
        self._thread.start()

    def watch(self, event, flag: list) -> None:
        self._jobs.put((event, flag))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            event, flag = job
            try:
                event.synchronize()
            except Exception:   # noqa: BLE001 -- the step's own wait on the device reports it
                log.exception("waiting for the device failed")
            finally:
                with self.cond:
                    flag[0] = True
                    self.cond.notify_all()


# The side stream's priority: the highest the device has (torch maps a number beyond the range to
# its end; lower is more urgent, the main stream's is 0). A CUDA graph's kernels run at the
# priority of the stream it is launched into, so where the L0 prompt and the decode beside it both
# have blocks waiting for a multiprocessor, the L0 prompt's go first.
SIDE_STREAM_PRIORITY = -100


class SideStream:
    """The CUDA stream L0 prompts run on beside the batch's forward in flight on the main one
    (made at first use, at ``SIDE_STREAM_PRIORITY``). ``use()``: a ``with`` under which forwards
    go to it and at whose end the host waits for this stream only (a no-op off CUDA); ``active``
    while inside, so the runner's own wait for a forward (``RowRunner._sync``) waits for this
    stream, not for the device."""

    def __init__(self, torch, device):
        self.torch = torch
        self.device = device
        self.stream = None
        self.active = False

    def use(self):
        torch = self.torch

        @contextlib.contextmanager
        def side():
            if self.device.type != "cuda":
                yield
                return
            if self.stream is None:
                self.stream = torch.cuda.Stream(device=self.device, priority=SIDE_STREAM_PRIORITY)
            self.active = True
            try:
                with torch.cuda.stream(self.stream):
                    yield
                self.stream.synchronize()
            finally:
                self.active = False
        return side()


def protected(writing, slots: dict, need: int) -> list:
    """The requests of the decode in flight (``writing``; ``slots``: ``id(generation)`` -> the one
    cache slot the decode writes in its row) that an L0 request must not preempt now: those whose
    slot is within ``need`` (the longest queued L0 prompt's slots and its padding's). Their
    ``SchedRequest``s, as ``FlashScheduler.dispatch(protect=)`` takes them."""
    return [g.sched for g in writing if slots[id(g)] <= need]


class L0Beside:
    """The L0-beside path of ``engine`` (see the module's doc)."""

    def __init__(self, engine, enabled: bool):
        self.engine = engine
        self.enabled = bool(enabled)
        self.reason: str | None = None          # why it was switched off, if it failed
        self._waiter: DeviceWaiter | None = None

    def meanwhile(self, writing, slots: dict | None = None):
        """``meanwhile`` for a graph forward over ``writing`` (its generations; ``slots`` for the
        decode, see ``protected``), or None where no L0 request goes beside it: the path off, or
        no L0 traffic lately."""
        if not (self.enabled and self.engine.l0_recent()):
            return None
        return lambda issued: self.run(writing, issued, slots)

    def run(self, writing, issued, slots: dict | None = None) -> None:
        """Until ``issued`` -- a CUDA event after the forward over ``writing`` -- has happened (None:
        the forward is done already), let L0 requests join and run their prompts beside it."""
        eng = self.engine
        prefill = eng.runner.static_prefill_l0
        protect = [g.sched for g in writing]
        tried = set()
        done = [issued is None]
        if issued is not None:
            # A thread of its own waits on the device (without the interpreter lock) and wakes
            # this one, as a new request does: no polling.
            if self._waiter is None:
                self._waiter = DeviceWaiter(eng._lock)
            self._waiter.watch(issued, done)
        while True:
            with eng._lock:
                if eng.scheduler.queued_count("L0"):
                    if slots is not None:
                        protect = protected(writing, slots, eng._queued_l0_need())
                    eng._join(protect)
                group = [(g, n) for g, n in eng._l0_group() if id(g) not in tried]
                if group:
                    tried.update(id(g) for g, _ in group)
                    if prefill is None or not prefill.covers(len(group), *eng._prefill_shape(group)):
                        group = []
                if not group:
                    if done[0] or issued.query():
                        return
                    eng._lock.wait(0.05)
                    continue
            try:
                with eng.runner.side_stream():
                    eng._prefill(group, l0=True)
                eng.stats["l0_beside"] += 1
            except Exception as exc:   # noqa: BLE001 -- off for good; the request joins as before
                log.exception("an L0 prompt beside another forward failed; L0 prompts wait for the step")
                self.enabled, self.reason = False, f"{type(exc).__name__}: {exc}"[:300]
                prefill = None

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.close()
            self._waiter = None
