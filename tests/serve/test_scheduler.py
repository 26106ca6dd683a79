"""The scheduler policy as tables: arrivals -> join order, pressure -> degrade steps, overload -> status."""
import pytest

from deepseek_flash.errors import ConfigError
from deepseek_flash.serve.scheduler import FifoScheduler, FlashScheduler, SchedRequest, default_l1_weight


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def req(rid, cls="L1", tokens=64, priority=0, temperature=1.0, top_p=1.0):
    return SchedRequest(id=rid, priority_class=cls, max_new_tokens=tokens, priority=priority,
                        temperature=temperature, top_p=top_p)


def ids(requests):
    return [r.id for r in requests]


def admit(s, *requests):
    for r in requests:
        assert s.route(r).admitted, r.id


@pytest.mark.parametrize("slots, reserved", [(1, 0), (2, 1), (4, 1), (8, 2), (20, 3), (100, 15)])
def test_l0_reservation_is_15_percent_of_the_slots_never_all(slots, reserved):
    assert FlashScheduler(slots=slots).l0_reserved == reserved


@pytest.mark.parametrize("tokens, weight", [(1, 1), (63, 1), (64, 1), (127, 1), (128, 2), (512, 8)])
def test_default_l1_weight_is_max_new_tokens_div_64(tokens, weight):
    assert default_l1_weight(req("a", tokens=tokens)) == weight


# (slots, running before, arrivals in order, expected join order)
ORDER_TABLE = [
    # L0 first, then L1 by finish tag: 32 tokens (w 1, tag 32) before 128 (w 2, tag 64) and 512
    # (w 8, tag 64); equal tags keep arrival order.
    (8, [], [("a", "L1", 512), ("b", "L1", 128), ("c", "L1", 32), ("d", "L0", 32)], ["d", "c", "a", "b"]),
    # The L0 reserve (2 of 8 slots) without preemption: six L1 at most; the rest wait although
    # slots are free.
    (8, [], [(f"l{i}", "L1", 64) for i in range(8)], [f"l{i}" for i in range(6)], False),
    # With preemption (the default) the reserve is lent to L1 while no L0 waits ...
    (8, [], [(f"l{i}", "L1", 64) for i in range(8)], [f"l{i}" for i in range(8)]),
    # ... L2 still stops at its 30 % idle line.
    (10, [], [(f"e{i}", "L2", 64) for i in range(10)], [f"e{i}" for i in range(7)]),
    # ... and L0 takes the reserved slots.
    (8, [("r", "L1", 64)] * 6, [("x", "L0", 16), ("y", "L0", 16), ("z", "L1", 16)], ["x", "y"]),
    # L2 joins only while more than 30 % of the slots are wanted by nobody: 10 slots, 6 busy -> 40 %
    # idle -> one L2 joins (then 30 %, not more than 30 %: the second waits).
    (10, [("r", "L1", 64)] * 6, [("p", "L2", 64), ("q", "L2", 64)], ["p"]),
    # A queued L1 counts as wanted: 10 slots, 5 running + 2 L1 queued-and-joining -> 30 % idle: no L2.
    (10, [("r", "L1", 64)] * 5, [("p", "L2", 64), ("m", "L1", 64), ("n", "L1", 64)], ["m", "n"]),
    # Idle machine: L2 fills up to the 30 % line (10 slots -> 7 L2).
    (10, [], [(f"e{i}", "L2", 64) for i in range(9)], [f"e{i}" for i in range(7)]),
]


@pytest.mark.parametrize("slots, running, arrivals, joined, preempts", [row + (True,) * (5 - len(row))
                                                                       for row in ORDER_TABLE])
def test_join_order(slots, running, arrivals, joined, preempts):
    s = FlashScheduler(slots=slots, clock=Clock(), l0_preempts=preempts)
    for i, (rid, cls, tokens) in enumerate(running):
        admit(s, req(f"{rid}{i}", cls, tokens))
    assert len(s.dispatch()) == len(running)
    admit(s, *(req(rid, cls, tokens) for rid, cls, tokens in arrivals))
    assert ids(s.dispatch()) == joined


def test_priority_comes_first_within_a_class_lower_earlier():
    s = FlashScheduler(slots=1, clock=Clock())
    admit(s, req("late", priority=5), req("soon", priority=-1), req("mid", priority=0))
    order = []
    for _ in range(3):
        (r,) = s.dispatch()
        order.append(r.id)
        s.finish(r)
    assert order == ["soon", "mid", "late"]


def test_wfq_virtual_time_keeps_a_long_request_from_starving():
    # One slot. A 512-token L1 request (tag 64) waits behind short ones (tag 32 each) only until the
    # virtual time passes its tag: short requests arriving later get tags above it.
    s = FlashScheduler(slots=1, clock=Clock())
    admit(s, req("long", tokens=512), req("s1", tokens=32))
    order = []
    for i in range(2, 6):
        (r,) = s.dispatch()
        order.append(r.id)
        s.finish(r)
        admit(s, req(f"s{i}", tokens=32))
    assert order == ["s1", "long", "s2", "s3"]
    assert s.virtual_time == 64 + 32


def test_l0_admission_limit_refuses_with_429_and_retry_after():
    s = FlashScheduler(l0_capacity=2, slots=4, clock=Clock())
    admit(s, req("a", "L0"), req("b", "L0"))
    route = s.route(req("c", "L0"))
    assert (route.admitted, route.status, route.retry_after) == (False, 429, 1)
    assert "l0_capacity=2" in route.reason
    assert s.route(req("d", "L1")).admitted          # the limit is L0's alone
    s.finish(s.dispatch()[0])                         # one L0 leaves -> room again
    assert s.route(req("e", "L0")).admitted
    assert s.snapshot()["refused_429"] == {"L0": 1, "L1": 0, "L2": 0}


def test_full_queue_gets_429_draining_gets_503_both_with_retry_after():
    clock = Clock()
    s = FlashScheduler(slots=2, max_queued=3, clock=clock)
    admit(s, req("a"), req("b"), req("c"))
    full = s.route(req("d"))
    assert (full.admitted, full.status) == (False, 429) and "queue full" in full.reason
    # Retry-After follows the measured time in the batch: 4 in line x 10 s / 2 slots = 20 s.
    s.mean_service_s = 10.0
    assert s.route(req("e")).retry_after == 20
    s.drain()
    off = s.route(req("f", "L0"))
    assert (off.admitted, off.status, off.retry_after) == (False, 503, 20)


@pytest.mark.parametrize("bad", ["L3", "", "l0"])
def test_unknown_class_is_a_value_error(bad):
    with pytest.raises(ValueError, match="priority_class"):
        FlashScheduler().route(req("a", bad))


def test_bad_construction_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError) as err:
        FlashScheduler(l2_degrade_policy="length_first")
    assert err.value.key == "l2_degrade_policy"
    with pytest.raises(ConfigError):
        FlashScheduler(l0_capacity=0)
    with pytest.raises(ConfigError) as err:
        FlashScheduler(idle_window=0)
    assert err.value.key == "idle_window"


T1 = ["temperature"]
T2 = ["temperature", "top_p"]
T3 = ["temperature", "top_p", "max_new_tokens"]

# Degrade under L0/L1 demand (10 slots, no L0 reserve, 5 s window): an L2 request runs; then
# (L1 running, L1 queued) arrive at t=0; timeline of (seconds, steps applied so far).
DEMAND_TABLE = [
    # 9 L1 + the L2 in the batch and 1 L1 waiting: L0/L1 want all 10 slots. The 5 s average
    # headroom falls below 10 % after 4.5 s; then one step per second, in order, never a fourth.
    (9, 1, [(0.0, []), (4.4, []), (4.6, T1), (5.0, T1), (5.6, T2), (6.6, T3), (20.0, T3)]),
    # 9 L1 + the L2, nothing waiting: L0/L1 leave 10 % headroom -- not below 10 %. The batch is
    # full, but the L2 request only fills what L0/L1 do not want.
    (9, 0, [(0.0, []), (60.0, [])]),
    # 4 L1 and the L2: half the slots idle.
    (4, 0, [(0.0, []), (60.0, [])]),
]


def running_l2(s, clock, tokens=100, n_l1=0, n_waiting=0):
    """An L2 request that joined an idle scheduler, then ``n_l1`` L1 requests that join and
    ``n_waiting`` that wait (all arriving at ``clock.t``)."""
    elastic = req("e", "L2", tokens=tokens, temperature=0.7, top_p=0.95)
    admit(s, elastic)
    assert ids(s.dispatch()) == ["e"]
    admit(s, *(req(f"r{i}") for i in range(n_l1)))
    assert len(s.dispatch()) == n_l1
    admit(s, *(req(f"w{i}") for i in range(n_waiting)))
    assert s.dispatch() == [] and len(s.queued) == n_waiting
    return elastic


def play(s, clock, elastic, timeline):
    start = clock.t
    for at, steps in timeline:
        clock.t = start + at
        s.tick()
        assert elastic.degraded == steps, at


@pytest.mark.parametrize("l1_running, l1_waiting, timeline", DEMAND_TABLE)
def test_degrade_follows_l0_l1_demand_over_the_window(l1_running, l1_waiting, timeline):
    clock = Clock()
    s = FlashScheduler(slots=10, clock=clock, l0_reserve=0.0)
    elastic = running_l2(s, clock, n_l1=l1_running, n_waiting=l1_waiting)
    elastic.generated = 40
    play(s, clock, elastic, timeline)
    applied = set(elastic.degraded)
    assert elastic.temperature == (0.8 if "temperature" in applied else 0.7)
    assert elastic.top_p == (0.85 if "top_p" in applied else 0.95)
    # 60 tokens were left at the cut: 70 % of them -> 42 more.
    assert elastic.max_new_tokens == (40 + 42 if "max_new_tokens" in applied else 100)


def test_the_cut_is_70_percent_of_what_is_left_when_it_is_applied():
    clock = Clock()
    s = FlashScheduler(slots=2, clock=clock, l0_reserve=0.0, idle_window=1.0)
    elastic = running_l2(s, clock, tokens=50, n_l1=1, n_waiting=1)
    for at, generated, steps, max_new in [(1.0, 3, T1, 50), (2.0, 10, T2, 50), (3.0, 17, T3, 17 + 23),
                                          (4.0, 30, T3, 40)]:
        clock.t = 100.0 + at
        elastic.generated = generated
        s.tick()
        assert (elastic.degraded, elastic.max_new_tokens) == (steps, max_new), at
    assert (elastic.temperature, elastic.top_p) == (0.8, 0.85)
    assert s.snapshot()["degrade_steps"] == {"temperature": 1, "top_p": 1, "max_new_tokens": 1}
    assert s.snapshot()["degraded_requests"] == 1


def test_a_burst_shorter_than_the_window_does_not_degrade():
    # 10 slots: L1 demand at 100 % for 2 s, then 50 % -- the 5 s average never leaves < 10 %.
    clock = Clock()
    s = FlashScheduler(slots=10, clock=clock, l0_reserve=0.0)
    elastic = running_l2(s, clock, n_l1=9, n_waiting=3)
    clock.t += 2.0
    s.tick()
    for r in list(s.running):
        if r.priority_class == "L1" and len(s.running) > 6:
            s.finish(r)
    s.queued[:] = []
    s._note_demand()
    for step in range(100):
        clock.t += 0.1
        s.tick()
    assert elastic.degraded == [] and 0.4 < s.idle_fraction() < 0.6


@pytest.mark.parametrize("busy", [0.0, 0.96, 1.0])
def test_l2_alone_on_an_idle_server_is_never_degraded(busy):
    # One slot, the L2 request in it: the batch is full and the device busy, but nobody else wants
    # anything -- an hour of steps, no degrade step.
    clock = Clock()
    s = FlashScheduler(slots=1, clock=clock, gpu_busy=lambda: busy)
    elastic = running_l2(s, clock)
    play(s, clock, elastic, [(t / 10, []) for t in range(0, 36000, 7)])
    # Eight rows of L2 only: the same.
    s = FlashScheduler(slots=10, clock=clock, gpu_busy=lambda: busy, l0_reserve=0.0)
    admit(s, *(req(f"e{i}", "L2") for i in range(7)))
    assert len(s.dispatch()) == 7
    for _ in range(600):
        clock.t += 1.0
        assert s.tick() == []
    assert s.idle_fraction() == 1.0


# The device-busy trigger (10 slots, no reserve, 3 L2 + 7 L1 running): (busy, L1 waiting, timeline)
BUSY_TABLE = [
    # More than 95 % busy with an L1 request waiting: pressure once both have lasted 5 s (the
    # 8-of-10 L0/L1 demand alone leaves 20 % headroom, no pressure).
    (0.96, 1, [(0.0, []), (4.9, []), (5.0, T1), (6.0, T2)]),
    # Exactly 95 % is not "more than 95 %".
    (0.95, 1, [(0.0, []), (10.0, [])]),
    # Busy, but nobody waits: degrading L2 would help no one.
    (0.99, 0, [(0.0, []), (10.0, [])]),
    # No reading (no NVML, no engine measure): only the headroom rule.
    (None, 1, [(0.0, []), (10.0, [])]),
]


def busy_batch(busy, waiting):
    """10 slots, no reserve: 3 L2 joined an idle server, then 7 L1 filled it and ``waiting`` more
    L1 wait. Returns (scheduler, clock, the first L2 request)."""
    clock = Clock()
    s = FlashScheduler(slots=10, clock=clock, gpu_busy=lambda: busy, l0_reserve=0.0)
    admit(s, req("e", "L2", temperature=0.7, top_p=0.95), req("f", "L2"), req("g", "L2"))
    assert len(s.dispatch()) == 3
    admit(s, *(req(f"r{i}") for i in range(7)))
    assert len(s.dispatch()) == 7
    admit(s, *(req(f"w{i}") for i in range(waiting)))
    assert s.dispatch() == []
    return s, clock, s.running[0]


@pytest.mark.parametrize("busy, waiting, timeline", BUSY_TABLE)
def test_device_busy_for_5s_with_l0_l1_waiting_degrades(busy, waiting, timeline):
    s, clock, elastic = busy_batch(busy, waiting)
    play(s, clock, elastic, timeline)


def test_busy_must_last_with_someone_waiting_throughout():
    s, clock, elastic = busy_batch(1.0, 1)
    clock.t += 4.0
    assert s.tick() == []
    s.finish(s.queued[0])                   # the waiting request leaves: the clock restarts
    clock.t += 1.0
    assert s.tick() == []
    admit(s, req("again"))
    assert s.tick() == []
    clock.t += 4.0
    assert s.tick() == []
    clock.t += 1.0
    assert [(r.id, step) for r, step in s.tick()] == [("e", "temperature"), ("f", "temperature"),
                                                      ("g", "temperature")]


def test_only_l2_is_degraded_and_none_policy_never_degrades():
    for policy, expect in [("temperature_first", 1), ("none", 0)]:
        clock = Clock()
        s = FlashScheduler(slots=2, clock=clock, l2_degrade_policy=policy, l0_reserve=0.0)
        running_l2(s, clock, n_l1=1, n_waiting=1)
        clock.t += 5.0
        s.tick()
        assert sum(len(r.degraded) for r in s.running) == expect
        assert s.snapshot()["degraded_requests"] == expect


def test_fifo_is_arrival_order_for_every_class():
    s = FifoScheduler(slots=3, clock=Clock())
    admit(s, req("a", "L2"), req("b", "L1", 512), req("c", "L0"), req("d", "L1", 32))
    assert ids(s.dispatch()) == ["a", "b", "c"]
    s.tick()
    assert all(not r.degraded for r in s.running)


def test_queue_ms_and_finish_from_the_queue():
    clock = Clock()
    s = FlashScheduler(slots=1, clock=clock)
    admit(s, req("a"), req("b"))
    clock.t += 0.25
    (a,) = s.dispatch()
    assert a.queue_ms == pytest.approx(250.0)
    b = s.queued[0]
    s.finish(b)                                      # cancelled while queued
    assert s.queued == [] and s.snapshot()["finished"]["L1"] == 0
    clock.t += 2.0
    s.finish(a)
    assert s.mean_service_s == pytest.approx(0.8 * 1.0 + 0.2 * 2.0)


# (running, joined in this order at times 1, 2, ...; L0 arrivals one per dispatch) ->
# (which request each L0 arrival took the slot of, None: it waits)
PREEMPT_TABLE = [
    # L2 first, then L1 -- among a class the one that started last; L0 rows never.
    ([("a", "L1"), ("b", "L2"), ("c", "L1"), ("d", "L0")], ["b", "c", "a", None]),
    ([("a", "L2"), ("b", "L2"), ("c", "L1"), ("d", "L1")], ["b", "a", "d", "c", None]),
    ([("a", "L0"), ("b", "L0")], [None]),
]


@pytest.mark.parametrize("running, victims", PREEMPT_TABLE)
def test_an_l0_request_finding_every_slot_taken_preempts(running, victims):
    clock = Clock()
    s = FlashScheduler(slots=len(running), l0_reserve=0.0, clock=clock)
    for rid, cls in running:
        clock.t += 1
        admit(s, req(rid, cls))
        assert ids(s.dispatch()) == [rid]
    firsts = {r.id: r.started for r in s.running}
    for k, victim in enumerate(victims):
        clock.t += 1
        admit(s, req(f"x{k}", "L0"))
        joined = s.dispatch()
        preempted = s.take_preempted()
        if victim is None:
            assert joined == [] and preempted == [] and ids(s.queued)[-1] == f"x{k}"
            continue
        assert ids(joined) == [f"x{k}"] and ids(preempted) == [victim]
        assert victim in ids(s.queued) and victim not in ids(s.running) and preempted[0].preempted == 1
    assert s.take_preempted() == []
    n = sum(v is not None for v in victims)
    by_class = {c: sum(1 for rid, cls in running if cls == c and rid in victims) for c in ("L0", "L1", "L2")}
    assert s.snapshot()["preempted"] == by_class and sum(by_class.values()) == n
    # A preempted request rejoins (when a slot frees) with its first start: its queue time stays
    # the first wait.
    for r in list(s.running):
        s.finish(r)
    for r in s.dispatch():
        if r.id in firsts:
            assert r.started == firsts[r.id]


@pytest.mark.parametrize("protect, victim", [((), "c"), (("c",), "b"), (("c", "b"), "a"), (("a", "b", "c"), None)])
def test_protected_requests_are_never_preempted(protect, victim):
    # The engine protects the requests of the forward an L0 prefill is nested in.
    clock = Clock()
    s = FlashScheduler(slots=3, l0_reserve=0.0, clock=clock)
    for rid in "abc":
        clock.t += 1
        admit(s, req(rid, "L1"))
        assert ids(s.dispatch()) == [rid]
    admit(s, req("x", "L0"))
    joined = s.dispatch(protect=[r for r in s.running if r.id in protect])
    assert ids(s.take_preempted()) == ([victim] if victim else [])
    assert ids(joined) == (["x"] if victim else [])


def test_a_preempted_l1_request_keeps_its_finish_tag_and_rejoins_before_later_ones():
    clock = Clock()
    s = FlashScheduler(slots=1, l0_reserve=0.0, clock=clock)
    admit(s, req("long", "L1", tokens=512))               # tag 64
    s.dispatch()
    admit(s, req("x", "L0"), req("later", "L1", tokens=512))   # later: tag 128
    assert ids(s.dispatch()) == ["x"] and ids(s.take_preempted()) == ["long"]
    s.finish(s.running[0])
    assert ids(s.dispatch()) == ["long"]


def pinned(rid, cls):
    r = req(rid, cls)
    r.preemptible = False                                 # a request on a tiered KV cache of its own
    return r


@pytest.mark.parametrize("make, running", [
    (lambda: FlashScheduler(slots=1, l0_reserve=0.0, clock=Clock()), pinned("t", "L2")),
    (lambda: FlashScheduler(slots=1, l0_reserve=0.0, clock=Clock(), l0_preempts=False), req("a", "L2")),
    (lambda: FifoScheduler(slots=1, clock=Clock()), req("a", "L2")),
], ids=["not-preemptible", "l0_preempts-off", "fifo"])
def test_no_preemption_where_requests_cannot_give_their_row_or_in_fifo(make, running):
    s = make()
    admit(s, running)
    assert s.dispatch() == [running]
    admit(s, req("x", "L0"))
    assert s.dispatch() == [] and s.take_preempted() == []
