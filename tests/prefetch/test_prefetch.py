"""Prefetch policy: the stage sequence a forward pass walks, and the window a streaming client moves."""
import pytest

from deepseek_flash.prefetch import (ForwardOrder, WindowController, WindowPolicy, WindowStep,
                                     auto_window, other_link_load, readahead_window)

from deepseek_flash.store import Store


def test_stages_follow_forward_order(tiny_store):
    store = Store.open(tiny_store)
    order = ForwardOrder(store.blocks, store.num_layers)
    roles = {b.id: b.role for b in store.blocks}
    assert [roles[i] for i in order.stages[0]] == ["embed"]
    assert [roles[i] for i in order.stages[-1]] == ["final_norm", "lm_head"]
    for layer in range(4):
        assert [roles[i] for i in order.layer_blocks(layer)] == ["norms", "attn", "mlp_gate_up", "mlp_down"]
    assert len(order.stages) == 6


def test_window_is_cyclic_and_bounded(tiny_store):
    store = Store.open(tiny_store)
    order = ForwardOrder(store.blocks, store.num_layers)
    layer_of = {b.id: (b.layer, b.role) for b in store.blocks}

    def stages(layer, window):
        return sorted({layer_of[i][0] if layer_of[i][0] >= 0 else layer_of[i][1]
                       for i in order.stages_after(layer, window)}, key=str)

    assert order.stages_after(1, 0) == []
    assert stages(0, 2) == [1, 2]
    # after the last layer: the head of the model (final norm, lm_head), then round to embed
    assert stages(3, 1) == ["final_norm", "lm_head"]
    assert stages(3, 3) == [0, "embed", "final_norm", "lm_head"]
    # a window larger than the model covers every other stage once, never the layer itself
    everything = order.stages_after(2, 64)
    assert len(everything) == len(set(everything)) == len(store.blocks) - 4


def test_window_controller_grows_on_stalls_and_yields_to_a_busy_link():
    c = WindowController(1, low=1, high=3)
    assert c.update(misses=0, layers=10) == 1
    assert c.update(misses=3, layers=10) == 2
    assert c.update(misses=3, layers=10) == 3
    assert c.update(misses=9, layers=10) == 3          # bounded
    assert c.update(misses=0, layers=10, other_load=0.8) == 2
    assert [d["to"] for d in c.decisions] == [2, 3, 2]
    assert "busy" in c.decisions[-1]["reason"] and "stalls" in c.decisions[0]["reason"]


def test_window_controller_shrinks_after_sustained_full_hit_rate_and_regrows_on_a_stall():
    c = WindowController(3, low=1, high=3, calm_passes=4)
    for _ in range(3):
        assert c.update(misses=0, layers=10) == 3
    assert c.update(misses=0, layers=10) == 2          # the 4th clean pass in a row
    assert "hit rate 100%" in c.decisions[-1]["reason"]
    # The count restarts after a change, and a miss resets it.
    for _ in range(3):
        assert c.update(misses=0, layers=10) == 2
    assert c.update(misses=1, layers=100) == 2          # below grow_at: holds, but not calm
    for _ in range(3):
        assert c.update(misses=0, layers=10) == 2
    assert c.update(misses=0, layers=10) == 1
    for _ in range(8):
        assert c.update(misses=0, layers=10) == 1       # bounded below
    assert c.update(misses=2, layers=10) == 2           # a stall grows it back
    assert [d["to"] for d in c.decisions] == [2, 1, 2]


P = WindowPolicy(low=1, high=3, grow_at=0.05, busy_at=0.5, calm_passes=4)


@pytest.mark.parametrize("window, calm, misses, layers, other_load, expected", [
    # holds: no stalls yet, or stalls at or below grow_at, or no layers at all
    (2, 0, 0, 10, None, WindowStep(2, 1)),
    (2, 2, 0, 10, 0.5, WindowStep(2, 3)),                       # busy_at is not exceeded
    (2, 3, 1, 20, None, WindowStep(2, 0)),                      # 5 %: holds, but not calm
    (2, 0, 0, 0, None, WindowStep(2, 1)),
    # grows on stalls, bounded by high
    (1, 0, 1, 10, None, WindowStep(2, 0, "stalls on 10% of streamed layers")),
    (3, 0, 9, 10, None, WindowStep(3, 0)),
    # a busy link wins over stalls, bounded by low
    (2, 0, 9, 10, 0.8, WindowStep(1, 0, "link busy with other work (80%)")),
    (1, 0, 9, 10, 0.8, WindowStep(2, 0, "stalls on 90% of streamed layers")),
    (1, 0, 0, 10, 0.8, WindowStep(1, 1)),
    # shrinks after calm_passes clean passes in a row, bounded by low
    (3, 3, 0, 10, None, WindowStep(2, 0, "hit rate 100% without stalls for 4 passes")),
    (1, 3, 0, 10, None, WindowStep(1, 4)),
    (2, 9, 1, 10, None, WindowStep(3, 0, "stalls on 10% of streamed layers")),
])
def test_window_policy_table(window, calm, misses, layers, other_load, expected):
    assert P.step(window, calm, misses, layers, other_load) == expected


@pytest.mark.parametrize("low, high, window, clamped", [(1, 3, 0, 1), (1, 3, 7, 3), (2, 1, 5, 2),
                                                        (0, 0, 4, 0)])
def test_window_policy_clamps_the_start(low, high, window, clamped):
    assert WindowController(window, low=low, high=high).window == clamped


GB = 1e9
CAP = 63e9


@pytest.mark.parametrize("rx, own_bytes, seconds, expected", [
    # Only our copies on the link, steady or in bursts: every 20 ms reading is ours, so the mean
    # of the readings equals our completed bytes over the interval -> no other traffic.
    ([55 * GB] * 25, 27.5 * GB, 0.5, 0.0),
    ([60 * GB, 0.0] * 12 + [60 * GB], 15.6 * GB, 0.5, 0.0),     # bursts: 13 of 25 readings busy
    ([58 * GB] * 25, 29.5 * GB, 0.5, 0.0),                       # reads a little below ours: 0, never < 0
    # Someone else's 30 GB/s beside our 20 GB/s.
    ([50 * GB] * 25, 10 * GB, 0.5, 30 / 63),
    # Nothing of ours: all of it is other traffic.
    ([40 * GB] * 50, 0, 1.0, 40 / 63),
    # Too few readings for the interval (one 20 ms reading against 0.5 s): unknown, not a guess.
    ([60 * GB], 15 * GB, 0.5, None),
    ([], 0, 0.5, None),
    ([10 * GB] * 25, 0, 0.0, None),
])
def test_other_link_load_matches_readings_and_completed_bytes(rx, own_bytes, seconds, expected):
    got = other_link_load(rx, own_bytes, seconds, CAP)
    assert got == expected if expected in (None, 0.0) else abs(got - expected) < 1e-12
    assert other_link_load(rx, own_bytes, seconds, None) is None


@pytest.mark.parametrize("window", [1, 2, 3])
@pytest.mark.parametrize("rx, own_bytes", [
    ([55 * GB] * 25, 27.5 * GB),                        # link saturated by our copies
    ([63 * GB, 0.0, 63 * GB, 63 * GB] * 6 + [0.0], 26.46 * GB),   # bursty copies, 18/25 busy
    ([63 * GB], 8 * GB),                                # one reading against an average: unknown
])
def test_the_window_never_shrinks_on_our_own_traffic(window, rx, own_bytes):
    """With nothing but our copies on the link, a pass with stalls grows the window (or holds at
    high) and a calm pass holds it: the link never counts as busy with other work."""
    load = other_link_load(rx, own_bytes, 0.5, CAP)
    assert load is None or load < P.busy_at
    stalled = P.step(window, 0, 5, 10, load)
    assert stalled.window == min(window + 1, P.high)
    calm = P.step(window, 0, 0, 10, load)
    assert calm.window == window and calm.reason is None


@pytest.mark.parametrize("slot_bytes, link, window", [
    (336 << 20, 63e9, 2),           # an 8B layer's MLP: 5.6 ms a copy, two in flight suffice
    (336 << 20, None, 2),           # nominal link
    (4 << 20, 63e9, 5),             # 67 us a copy: cover 200 us of issuing
    (49152, 63e9, 8),               # tiny layers: capped
    (0, 63e9, 2),
])
def test_auto_window_from_slot_size_and_link(slot_bytes, link, window):
    assert auto_window(slot_bytes, link) == window


def test_readahead_window_resolves_auto():
    assert readahead_window("auto") == 2 and readahead_window(0) == 0 and readahead_window(5) == 5
