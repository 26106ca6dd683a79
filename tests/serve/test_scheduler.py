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
    # The L0 reserve (2 of 8 slots): six L1 at most; the rest wait although slots are free.
    (8, [], [(f"l{i}", "L1", 64) for i in range(8)], [f"l{i}" for i in range(6)]),
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


@pytest.mark.parametrize("slots, running, arrivals, joined", ORDER_TABLE)
def test_join_order(slots, running, arrivals, joined):
    s = FlashScheduler(slots=slots, clock=Clock())
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


# Degrade: (seconds after start, running L1 count besides the L2 request, gpu busy, steps applied so far)
DEGRADE_TABLE = [
    # 10 slots: 9 L1 + 1 L2 running -> 0 % idle -> pressure; one step per second, in order.
    (9, None, [(0.0, ["temperature"]), (0.5, ["temperature"]), (1.0, ["temperature", "top_p"]),
               (2.0, ["temperature", "top_p", "max_new_tokens"]), (3.0, ["temperature", "top_p", "max_new_tokens"])]),
    # 8 of 10 busy -> 20 % idle -> no pressure, nothing degraded.
    (7, None, [(0.0, []), (5.0, [])]),
    # GPU 96 % busy: pressure only once it has lasted 5 s.
    (3, 0.96, [(0.0, []), (4.9, []), (5.0, ["temperature"]), (6.0, ["temperature", "top_p"])]),
    # GPU exactly 95 % is not "more than 95 %".
    (3, 0.95, [(0.0, []), (10.0, [])]),
]


@pytest.mark.parametrize("l1_running, busy, timeline", DEGRADE_TABLE)
def test_degrade_steps_in_order(l1_running, busy, timeline):
    clock = Clock()
    s = FlashScheduler(slots=10, clock=clock, gpu_busy=lambda: busy, l0_reserve=0.0)
    elastic = req("e", "L2", tokens=100, temperature=0.7, top_p=0.95)
    admit(s, elastic)
    assert ids(s.dispatch()) == ["e"]
    admit(s, *(req(f"r{i}") for i in range(l1_running)))
    assert len(s.dispatch()) == l1_running
    elastic.generated = 40
    start = clock.t
    for at, steps in timeline:
        clock.t = start + at
        s.tick()
        assert elastic.degraded == steps, at
    applied = set(elastic.degraded)
    assert elastic.temperature == (0.8 if "temperature" in applied else 0.7)
    assert elastic.top_p == (0.85 if "top_p" in applied else 0.95)
    # 60 tokens were left at the cut: 70 % of them -> 42 more.
    assert elastic.max_new_tokens == (40 + 42 if "max_new_tokens" in applied else 100)


def test_only_l2_is_degraded_and_none_policy_never_degrades():
    clock = Clock()
    for policy, expect in [("temperature_first", 1), ("none", 0)]:
        s = FlashScheduler(slots=2, clock=clock, l2_degrade_policy=policy, l0_reserve=0.0)
        admit(s, req("e", "L2"))
        s.dispatch()
        admit(s, req("a", "L1"), req("q", "L1"))
        s.dispatch()
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
