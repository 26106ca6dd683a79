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

**Two lanes.** A prompt is issued without waiting for it; an L0 request arriving while another
one's prompt is still on the device goes on the second *lane* at once -- a second set of L0 graphs
(``RowRunner.static_prefill_l0b``) on a second side stream -- instead of waiting for it (at ~10 L0
requests a second and ~3 ms a prompt, ~3 % of them would). Each prompt's first tokens are taken by
its lane's waiter thread as soon as the device has run it, holding the engine's lock (one hand-off
of the interpreter lock: the engine thread need not wake first). A failure on the second lane
switches that lane off (``second_reason``); with both busy, the next prompt waits for a free one.

**Rows.** The L0 prompt's row is never one the forward in flight writes (``writing``) -- except,
for the decode, a row whose decode slot lies beyond every queued L0 prompt (``protected``): the
decode writes one slot per row, the prompt writes slots ``0..len`` of its row, so on a full batch
the L0 request may take that row now; the decode's token for the request it preempted is dropped
and that request rewinds (``Generation.rewind``), as any preempted one.

**Waiting.** The engine thread waits on its condition for whichever comes first, a new request or
the device: ``DeviceWaiter`` threads -- one for the forward, one per lane -- block on a CUDA event
recorded after the forward or the prompt (off the interpreter lock), a lane's then takes the
prompt's first tokens, and each wakes it -- no polling.

What the engine provides (``L0Beside(engine)``): ``_lock`` (its condition; the scheduler and the
rows are touched under it), ``scheduler``, ``runner`` (``static_prefill_l0``/``_l0b``, ``side``/
``side_b``, ``prefill_start``/``prefill_end``, ``issued_event``), ``stats`` (``l0_beside`` counts
the prompts run here, ``l0_beside_concurrent`` those issued while another ran), ``l0_recent()``,
``_join(protect)`` (dispatch, preempt, admit: lock held), ``_l0_group()`` (the L0 prompts in the
batch with tokens left: lock held), ``_queued_l0_need()`` (the longest queued L0 prompt: lock
held), ``_prefill_shape(group)``, ``_prefill_inputs(group)`` and ``_prefilled(group, logits, s)``
(the books after a prompt forward: its first tokens).
"""
from __future__ import annotations

import contextlib
import logging
import threading

log = logging.getLogger("deepseek_flash.serve")


class DeviceWaiter:
    """A thread that waits for CUDA events (``event.synchronize()``, which lets the interpreter
    lock go) and then -- holding ``cond`` -- runs the job's ``then`` (if any), sets ``flag[0]`` and
    wakes every waiter on ``cond``: the engine thread waits on its condition for whichever comes
    first, the device or a new request."""

    def __init__(self, cond: threading.Condition):
        import queue

        self.cond = cond
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="serve-device-waiter", daemon=True)
        self._thread.start()

    def watch(self, event, flag: list, then=None) -> None:
        self._jobs.put((event, flag, then))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            event, flag, then = job
            try:
                event.synchronize()
            except Exception:   # noqa: BLE001 -- the step's own wait on the device reports it
                log.exception("waiting for the device failed")
            finally:
                with self.cond:
                    try:
                        if then is not None:
                            then()
                    except Exception:   # noqa: BLE001 -- ``then`` reports its own failures
                        log.exception("after waiting for the device")
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

    def use(self, wait: bool = True):
        """``wait=False``: the host does not wait for the stream at the end (a prompt issued
        there, waited for later: ``L0Beside``)."""
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
                if wait:
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


class Lane:
    """One set of L0 prompt graphs and the side stream its prompts run on; ``index`` 0 or 1."""

    def __init__(self, index: int, graphs, side: SideStream):
        self.index, self.graphs, self.side = index, graphs, side


class Launched:
    """An L0 prompt forward issued on ``lane`` and not yet taken: its ``group`` ((generation,
    tokens) pairs), what ``RowRunner.prefill_start`` returned, and ``done[0]`` once the device has
    run it (set by the device waiter; at once off CUDA)."""

    def __init__(self, group, lane: Lane, started: tuple, done: list):
        self.group, self.lane, self.done = group, lane, done
        self.logits, self.began, self.launch_s = started
        self.taken = False                      # its first tokens taken (``L0Beside._finish``)


class L0Beside:
    """The L0-beside path of ``engine`` (see the module's doc)."""

    def __init__(self, engine, enabled: bool):
        self.engine = engine
        self.enabled = bool(enabled)
        self.reason: str | None = None          # why it was switched off, if it failed
        self.second_reason: str | None = None   # why the second lane was, if it failed
        # A waiter per thing waited for -- the forward in flight, each lane -- so that none's
        # wake-up waits for another's event.
        self._waiters: dict = {}

    def meanwhile(self, writing, slots: dict | None = None):
        """``meanwhile`` for a graph forward over ``writing`` (its generations; ``slots`` for the
        decode, see ``protected``), or None where no L0 request goes beside it: the path off, or
        no L0 traffic lately."""
        if not (self.enabled and self.engine.l0_recent()):
            return None
        return lambda issued: self.run(writing, issued, slots)

    def lanes(self) -> list:
        """The lanes L0 prompts may run on now: the L0 graphs on the side stream and, where a
        second set exists and has not failed, that set on the second side stream."""
        runner = self.engine.runner
        if runner.static_prefill_l0 is None:
            return []
        lanes = [Lane(0, runner.static_prefill_l0, runner.side)]
        if runner.static_prefill_l0b is not None and self.second_reason is None:
            lanes.append(Lane(1, runner.static_prefill_l0b, runner.side_b))
        return lanes

    def _watch(self, key, event, flag: list, then=None) -> None:
        """Wake the engine's condition once ``event`` has happened (``flag[0]`` set then, after
        ``then()``), from ``key``'s waiter thread (``"forward"``, or a lane's index)."""
        waiter = self._waiters.get(key)
        if waiter is None:
            waiter = self._waiters[key] = DeviceWaiter(self.engine._lock)
        waiter.watch(event, flag, then)

    def run(self, writing, issued, slots: dict | None = None) -> None:
        """Until ``issued`` -- a CUDA event after the forward over ``writing`` -- has happened (None:
        the forward is done already), let L0 requests join and run their prompts beside it: each
        issued on a free lane without waiting for it, so that an L0 request arriving while another
        one's prompt runs goes on the second lane at once instead of waiting for it; each prompt's
        first token taken as soon as the device has run it. Returns once the forward and every
        prompt issued here are done."""
        eng = self.engine
        lanes = self.lanes()
        protect = [g.sched for g in writing]
        tried = set()
        inflight: list[Launched] = []
        done = [issued is None]
        if issued is not None:
            # A thread of its own waits on the device (without the interpreter lock) and wakes
            # this one, as a new request does: no polling.
            self._watch("forward", issued, done)
        while True:
            with eng._lock:
                if eng.scheduler.queued_count("L0"):
                    if slots is not None:
                        protect = protected(writing, slots, eng._queued_l0_need())
                    eng._join(protect)
                group = [(g, n) for g, n in eng._l0_group() if id(g) not in tried]
                if group:
                    tried.update(id(g) for g, _ in group)
                    if not (self.enabled and lanes
                            and lanes[0].graphs.covers(len(group), *eng._prefill_shape(group))):
                        group = []
                # A prompt's first tokens are taken by its lane's waiter thread as soon as the
                # device has run it (``_launch``); here only where it ran as issued (off CUDA).
                finished = [f for f in inflight if f.done[0]]
                for f in finished:
                    inflight.remove(f)
                    if not f.taken:
                        self._finish(f)
                if group:
                    free = [lane for lane in lanes if all(f.lane is not lane for f in inflight)]
                    if free:
                        launched = self._launch(group, free[0], concurrent=bool(inflight))
                        if launched is not None:
                            inflight.append(launched)
                        lanes = [lane for lane in lanes if lane.index == 0 or self.second_reason is None]
                        continue
                    tried.difference_update(id(g) for g, _ in group)     # every lane busy: later
                if not inflight and (done[0] or issued.query()):
                    return
                eng._lock.wait(0.05)

    def _launch(self, group, lane: Lane, concurrent: bool) -> Launched | None:
        """Issue the prompt forward of ``group`` on ``lane`` (None: not issued -- failed, or no
        graph has its shape -- and its requests wait for the next step). Lock held: the books a
        lane's waiter thread changes (``_finish``) are not read meanwhile."""
        eng = self.engine
        try:
            ids, pos, kv_len = eng._prefill_inputs(group)
            with lane.side.use(wait=False):
                started = eng.runner.prefill_start([g.row for g, _ in group], ids, pos, kv_len, lane.graphs)
                event = None if started is None else eng.runner.issued_event()
        except Exception as exc:   # noqa: BLE001 -- off for good; the request joins as before
            self._failed(lane, exc)
            return None
        if started is None:
            return None
        if concurrent:
            eng.stats["l0_beside_concurrent"] += 1
        launched = Launched(group, lane, started, [event is None])
        if event is not None:
            # Its first tokens taken by the waiter thread itself, as soon as the event has
            # happened: one hand-off of the interpreter lock, not two.
            self._watch(lane.index, event, launched.done, lambda: self._finish(launched))
        return launched

    def _finish(self, f: Launched) -> None:
        """Take the first tokens of ``f``, done on the device (lock held: the engine thread's, or
        its lane's waiter thread's once the prompt's event happened)."""
        eng = self.engine
        f.taken = True
        width = max(n for _, n in f.group)
        try:
            with eng.runner.torch.inference_mode(), f.lane.side.use():
                spent = eng.runner.prefill_end(len(f.group), width, f.began, f.launch_s)
                eng._prefilled(f.group, f.logits, spent)
            eng.stats["l0_beside"] += 1
        except Exception as exc:   # noqa: BLE001 -- off for good; the request joins as before
            self._failed(f.lane, exc)

    def _failed(self, lane: Lane, exc: Exception) -> None:
        """A failure on the second lane switches that lane off; on the first, the whole path."""
        reason = f"{type(exc).__name__}: {exc}"[:300]
        if lane.index == 1:
            log.exception("an L0 prompt on the second side stream failed; one L0 prompt at a time from now")
            self.second_reason = reason
        else:
            log.exception("an L0 prompt beside another forward failed; L0 prompts wait for the step")
            self.enabled, self.reason = False, reason

    def close(self) -> None:
        for waiter in self._waiters.values():
            waiter.close()
        self._waiters = {}
