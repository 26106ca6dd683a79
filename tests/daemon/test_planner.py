"""Residency planning under a weight budget: what stays, what streams, and the too-small error."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from deepseek_flash.daemon.planner import plan_residency
from deepseek_flash.prefetch import auto_window
from deepseek_flash.wire import SLOT_ALIGNMENT

from deepseek_flash.errors import BudgetTooSmall


def blocks(layers=4, embed=40960, attn=16384, norms=512, gate_up=32768, down=16384, head=40960):
    out = [SimpleNamespace(id=0, role="embed", layer=-1, length=embed)]
    for i in range(layers):
        for role, n in (("norms", norms), ("attn", attn), ("mlp_gate_up", gate_up), ("mlp_down", down)):
            out.append(SimpleNamespace(id=len(out), role=role, layer=i, length=n))
    out.append(SimpleNamespace(id=len(out), role="final_norm", layer=-1, length=norms))
    out.append(SimpleNamespace(id=len(out), role="lm_head", layer=-1, length=head))
    return out


def aligned(n):
    return -(-n // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


def test_no_budget_keeps_everything_resident():
    bs = blocks()
    plan = plan_residency(bs, None, 2)
    assert plan.resident == [b.id for b in bs]
    assert plan.streamed_layers == [] and plan.n_slots == 0 and not plan.streaming


def test_minimum_budget_streams_every_mlp_through_two_slots():
    bs = blocks()
    anchors = sum(aligned(b.length) for b in bs if not b.role.startswith("mlp"))
    slot = 32768 + 16384
    plan = plan_residency(bs, anchors + 2 * slot, 4)
    assert plan.streamed_layers == [0, 1, 2, 3]
    assert plan.n_slots == 2 and plan.slot_bytes == slot
    assert {bs[i].role for i in plan.resident} == {"embed", "norms", "attn", "final_norm", "lm_head"}
    assert plan.stream_blocks[2] == [b.id for b in bs if b.layer == 2 and b.role.startswith("mlp")]


def test_budget_below_minimum_names_the_sizes():
    bs = blocks()
    anchors = sum(aligned(b.length) for b in bs if not b.role.startswith("mlp"))
    with pytest.raises(BudgetTooSmall) as exc:
        plan_residency(bs, anchors + 2 * 49152 - 1, 1, model="tiny")
    err = exc.value
    assert err.code == 402
    assert err.minimum == anchors + 2 * 49152 and err.anchors == anchors and err.slot_bytes == 49152
    assert "tiny" in str(err) and str(anchors + 2 * 49152) in str(err)


def test_spare_budget_keeps_a_suffix_of_layers_resident_and_window_sets_slots():
    bs = blocks(layers=6)
    anchors = sum(aligned(b.length) for b in bs if not b.role.startswith("mlp"))
    slot = 49152
    plan = plan_residency(bs, anchors + 3 * slot + slot, 2)   # 3 slots + one resident layer
    assert plan.n_slots == 3
    # The ring serves the first layers; the last one stays (a pass then starts streaming at once).
    assert plan.streamed_layers == [0, 1, 2, 3, 4]
    assert {b.id for b in bs if b.layer == 5} <= set(plan.resident)
    assert plan.resident_bytes == anchors + slot
    plan = plan_residency(bs, anchors + 3 * slot + 2 * slot, 2)
    assert plan.streamed_layers == [0, 1, 2, 3]
    assert plan.resident == sorted(plan.resident)


def test_large_window_is_capped_by_the_budget():
    bs = blocks(layers=3)
    anchors = sum(aligned(b.length) for b in bs if not b.role.startswith("mlp"))
    plan = plan_residency(bs, anchors + 2 * 49152 + 100, 8)
    assert plan.streamed_layers == [0, 1, 2] and plan.n_slots == 2


def test_plan_round_trips_through_the_wire():
    from deepseek_flash.wire import Plan

    bs = blocks()
    anchors = sum(aligned(b.length) for b in bs if not b.role.startswith("mlp"))
    plan = plan_residency(bs, anchors + 2 * 49152, 1)
    again = Plan.from_wire(plan.to_wire())
    assert again == plan


def test_auto_window_is_resolved_from_slot_size_and_link():
    bs = blocks(layers=12, gate_up=32 << 20, down=16 << 20)
    anchors = sum(aligned(b.length) for b in bs if not b.role.startswith("mlp"))
    slot = (32 << 20) + (16 << 20)
    # 48 MiB a slot: 0.8 ms at 63 GB/s -> a ring of three slots, the window starting at all three
    # (every slot refilled as soon as its layer has run).
    plan = plan_residency(bs, anchors + 6 * slot, "auto", link_bytes_per_s=63e9)
    assert plan.window == 3 and plan.n_slots == 3
    assert plan.streamed_layers == list(range(0, 9))
    # A slow link makes the same slot last longer: the same ring.
    plan = plan_residency(bs, anchors + 6 * slot, "auto", link_bytes_per_s=8e9)
    assert (plan.window, plan.n_slots) == (3, 3)
    # Tiny slots on a fast link: more slots, the window still the whole ring.
    small = blocks(layers=40, gate_up=64 << 10, down=32 << 10)
    small_slot = aligned((64 << 10)) + aligned(32 << 10)
    small_anchors = sum(aligned(b.length) for b in small if not b.role.startswith("mlp"))
    plan = plan_residency(small, small_anchors + 20 * small_slot, "auto", link_bytes_per_s=63e9)
    assert plan.n_slots == auto_window(small_slot, 63e9) + 1 > 3 and plan.window == plan.n_slots
    # An explicit window is the one asked for (three slots for two ahead); the budget caps it.
    plan = plan_residency(bs, anchors + 6 * slot, 2)
    assert plan.n_slots == 3 and plan.window == 2
    plan = plan_residency(bs, anchors + 3 * slot, 4)
    assert plan.n_slots == 3 and plan.window == 3
    assert plan_residency(bs, anchors + 6 * slot, 0).window == 0
