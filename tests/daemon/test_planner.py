"""Residency planning under a weight budget: what stays, what streams, and the too-small error."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from deepseek_flash.daemon.planner import plan_residency, spread
from deepseek_flash.prefetch import PASS_GAP_S, auto_window
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


def layer_plan(*args, **kw):
    """Whole-MLP slots (these blocks list no tensors, so they have no projections)."""
    return plan_residency(*args, unit="layer", **kw)


def test_no_budget_keeps_everything_resident():
    bs = blocks()
    plan = layer_plan(bs, None, 2)
    assert plan.resident == [b.id for b in bs]
    assert plan.streamed_layers == [] and plan.n_slots == 0 and not plan.streaming


def test_minimum_budget_streams_every_mlp_through_two_slots():
    bs = blocks()
    anchors = sum(aligned(b.length) for b in bs if not b.role.startswith("mlp"))
    slot = 32768 + 16384
    plan = layer_plan(bs, anchors + 2 * slot, 4)
    assert plan.streamed_layers == [0, 1, 2, 3]
    assert plan.n_slots == 2 and plan.slot_bytes == slot
    assert {bs[i].role for i in plan.resident} == {"embed", "norms", "attn", "final_norm", "lm_head"}
    assert plan.stream_blocks[2] == [b.id for b in bs if b.layer == 2 and b.role.startswith("mlp")]


def test_budget_below_minimum_names_the_sizes():
    bs = blocks()
    anchors = sum(aligned(b.length) for b in bs if not b.role.startswith("mlp"))
    with pytest.raises(BudgetTooSmall) as exc:
        layer_plan(bs, anchors + 2 * 49152 - 1, 1, model="tiny")
    err = exc.value
    assert err.code == 402
    assert err.minimum == anchors + 2 * 49152 and err.anchors == anchors and err.slot_bytes == 49152
    assert "tiny" in str(err) and str(anchors + 2 * 49152) in str(err)


def test_spare_budget_keeps_a_suffix_of_layers_resident_and_window_sets_slots():
    bs = blocks(layers=6)
    anchors = sum(aligned(b.length) for b in bs if not b.role.startswith("mlp"))
    slot = 49152
    # A link so slow that three slots' copies last longer than the stretch between two tokens.
    slow = 3 * slot / PASS_GAP_S
    plan = layer_plan(bs, anchors + 3 * slot + slot, 2, link_bytes_per_s=slow)   # 3 slots + one layer
    assert plan.n_slots == 3
    # The ring serves the first layers; the last one stays (a pass then starts streaming at once).
    assert plan.streamed_layers == [0, 1, 2, 3, 4]
    assert {b.id for b in bs if b.layer == 5} <= set(plan.resident)
    assert plan.resident_bytes == anchors + slot
    plan = layer_plan(bs, anchors + 3 * slot + 2 * slot, 2, link_bytes_per_s=slow)
    assert plan.streamed_layers == [0, 1, 2, 3]
    assert plan.resident == sorted(plan.resident)


def test_a_ring_shorter_than_the_pass_gap_spreads_the_resident_mlps():
    """Three slots whose copies last less than ``PASS_GAP_S``: the same resident MLPs' count
    (same bytes, same slots) among the streamed layers, the first and last layer streaming, so
    none runs between two tokens."""
    bs = blocks(layers=6)
    anchors = sum(aligned(b.length) for b in bs if not b.role.startswith("mlp"))
    slot = 49152
    just_short = 3 * slot / PASS_GAP_S * 1.001
    for link in (just_short, None):                      # None: the nominal link
        plan = layer_plan(bs, anchors + 3 * slot + 2 * slot, 2, link_bytes_per_s=link)
        assert plan.n_slots == 3 and plan.window == 2
        assert plan.streamed_layers == [0, 2, 3, 5]      # evenly spaced, first and last
        assert plan.resident_bytes == anchors + 2 * slot
        assert {b.id for b in bs if b.layer in (1, 4)} <= set(plan.resident)
        assert plan.resident == sorted(plan.resident)
        assert plan.stream_blocks == {layer: [b.id for b in bs if b.layer == layer and b.role.startswith("mlp")]
                                      for layer in (0, 2, 3, 5)}


@pytest.mark.parametrize("n, keep, resident", [
    (6, 2, [1, 4]), (12, 3, [2, 5, 9]), (32, 14, [1, 3, 6, 8, 10, 12, 14, 17, 19, 21, 23, 25, 28, 30]),
    (5, 0, []), (5, 4, [1, 2, 3, 4]), (5, 3, [1, 2, 3]), (4, 2, [1, 2]),
])
def test_spread_keeps_the_streamed_layers_evenly_spaced_with_the_first_and_last(n, keep, resident):
    layers = list(range(10, 10 + n))
    got = spread(layers, keep)
    assert got == [10 + i for i in resident] and len(got) == keep


def test_large_window_is_capped_by_the_budget():
    bs = blocks(layers=3)
    anchors = sum(aligned(b.length) for b in bs if not b.role.startswith("mlp"))
    plan = layer_plan(bs, anchors + 2 * 49152 + 100, 8)
    assert plan.streamed_layers == [0, 1, 2] and plan.n_slots == 2


def test_plan_round_trips_through_the_wire():
    from deepseek_flash.wire import Plan

    bs = blocks()
    anchors = sum(aligned(b.length) for b in bs if not b.role.startswith("mlp"))
    plan = layer_plan(bs, anchors + 2 * 49152, 1)
    again = Plan.from_wire(plan.to_wire())
    assert again == plan


def test_auto_window_is_resolved_from_slot_size_and_link():
    bs = blocks(layers=12, gate_up=32 << 20, down=16 << 20)
    anchors = sum(aligned(b.length) for b in bs if not b.role.startswith("mlp"))
    slot = (32 << 20) + (16 << 20)
    # 48 MiB a slot: 0.8 ms at 63 GB/s -> a ring of three slots, the window starting at all three
    # (every slot refilled as soon as its layer has run).
    plan = layer_plan(bs, anchors + 6 * slot, "auto", link_bytes_per_s=63e9)
    assert plan.window == 3 and plan.n_slots == 3
    # Three slots are 2.4 ms of copies, short of the stretch between two tokens: the three
    # resident MLPs sit among the streamed layers.
    assert plan.streamed_layers == [0, 1, 3, 4, 6, 7, 8, 10, 11]
    # A slow link makes the same slot last longer: the same ring.
    plan = layer_plan(bs, anchors + 6 * slot, "auto", link_bytes_per_s=8e9)
    assert (plan.window, plan.n_slots) == (3, 3)
    # Tiny slots on a fast link: more slots, the window still the whole ring.
    small = blocks(layers=40, gate_up=64 << 10, down=32 << 10)
    small_slot = aligned((64 << 10)) + aligned(32 << 10)
    small_anchors = sum(aligned(b.length) for b in small if not b.role.startswith("mlp"))
    plan = layer_plan(small, small_anchors + 20 * small_slot, "auto", link_bytes_per_s=63e9)
    assert plan.n_slots == auto_window(small_slot, 63e9) + 1 > 3 and plan.window == plan.n_slots
    # An explicit window is the one asked for (three slots for two ahead); the budget caps it.
    plan = layer_plan(bs, anchors + 6 * slot, 2)
    assert plan.n_slots == 3 and plan.window == 2
    plan = layer_plan(bs, anchors + 3 * slot, 4)
    assert plan.n_slots == 3 and plan.window == 3
    assert layer_plan(bs, anchors + 6 * slot, 0).window == 0


def seven_b_blocks(arch):
    """The blocks of the bench's 7-8B shapes (bench/_common.ARCH_SHAPES), bf16, from the store's
    layout alone (no weights)."""
    from deepseek_flash.store.layout import TensorSpec, plan_blocks

    shapes = {"llama": (4096, 32, 14336, 128256, 32, 8), "qwen2": (3584, 28, 18944, 152064, 28, 4),
              "mistral": (4096, 32, 14336, 32768, 32, 8)}
    hidden, layers, inter, vocab, heads, kv = shapes[arch]
    dim = hidden // heads
    shape = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
             "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shape.update({p + "input_layernorm.weight": (hidden,),
                      p + "post_attention_layernorm.weight": (hidden,),
                      p + "self_attn.q_proj.weight": (heads * dim, hidden),
                      p + "self_attn.k_proj.weight": (kv * dim, hidden),
                      p + "self_attn.v_proj.weight": (kv * dim, hidden),
                      p + "self_attn.o_proj.weight": (hidden, heads * dim),
                      p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                      p + "mlp.down_proj.weight": (hidden, inter)})
        if arch == "qwen2":
            shape.update({p + f"self_attn.{x}_proj.bias": (n * dim,)
                          for x, n in (("q", heads), ("k", kv), ("v", kv))})
    specs = {name: TensorSpec(name, "bfloat16", s) for name, s in shape.items()}
    config = {"num_hidden_layers": layers, "model_type": arch}
    return plan_blocks(config, specs, lambda a, b: False, arch), hidden * inter * 2


@pytest.mark.parametrize("arch, layer_plan, projection_plan", [
    # (streamed layers, slots) with whole-MLP slots, then with projection slots.
    ("llama", (25, 3), (23, 5)),
    ("qwen2", (20, 3), (18, 5)),
    ("mistral", (20, 3), (18, 3)),
])
def test_projection_slots_keep_more_mlps_resident_under_8_gib(arch, layer_plan, projection_plan):
    """8 GiB at a 55.4 GB/s link: a slot of one projection is a third of a whole-MLP slot, so a
    ring of three takes two MLPs' bytes less and two more MLPs stay resident; what is left after
    them (less than one MLP) becomes more slots (llama, qwen2: two more)."""
    from deepseek_flash.wire import stream_units

    bs, projection = seven_b_blocks(arch)
    mlp = 3 * projection                               # gate, up, down: each aligned already
    budget = 8 << 30
    anchors = sum(aligned(b.length) for b in bs if not b.role.startswith("mlp"))
    layers = len({b.layer for b in bs if b.layer >= 0})
    by_id = {b.id: b for b in bs}
    for unit, (streamed, slots), slot in (("layer", layer_plan, mlp),
                                          ("projection", projection_plan, projection)):
        plan = plan_residency(bs, budget, "auto", arch, 55.4e9, unit)
        assert plan.unit == unit and plan.slot_bytes == slot
        assert (len(plan.streamed_layers), plan.n_slots, plan.window) == (streamed, slots, slots)
        # A contiguous head streams where the ring's copies outlast the stretch between two
        # tokens (whole MLPs; llama's and qwen2's five projection slots); mistral's three
        # projection slots (6.4 ms) do not: as many resident MLPs, spread among the streamed.
        if plan.n_slots * slot / 55.4e9 >= PASS_GAP_S:
            assert plan.streamed_layers == list(range(streamed))
        else:
            assert (arch, unit) == ("mistral", "projection")
            assert plan.streamed_layers == [0, 2, 4, 5, 7, 9, 11, 13, 15, 16, 18, 20, 22, 24, 26,
                                            27, 29, 31]
        # The rest of the budget holds whole MLPs resident.
        assert plan.resident_bytes == anchors + (layers - streamed) * mlp
        assert plan.resident_bytes + plan.n_slots * slot <= budget
        left = budget - plan.resident_bytes - plan.n_slots * slot
        assert left < min(mlp, slot) or plan.n_slots == 9
        units = [u for layer in plan.streamed_layers
                 for u in stream_units([by_id[b] for b in plan.stream_blocks[layer]], unit)]
        assert len(units) == streamed * (1 if unit == "layer" else 3)
        # What crosses the link per token: every streamed MLP byte once.
        assert sum(n for u in units for _, _, n in u) == streamed * mlp
    # The ring of three projections takes two MLPs less than the ring of three MLPs: two more
    # MLPs resident; llama's and qwen2's budget left over is two more projection slots.
    assert layer_plan[0] - projection_plan[0] == 2
    # The link the daemon plans with is NVML's capacity (63.0 GB/s on the H200, above the 55.4
    # measured): the same plans, layouts included.
    for unit in ("layer", "projection"):
        assert (plan_residency(bs, budget, "auto", arch, 63.0e9, unit)
                == plan_residency(bs, budget, "auto", arch, 55.4e9, unit))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_the_default_unit_streams_fewer_bytes_than_whole_mlp_slots(arch):
    """The default ``stream_unit`` (no unit given: config and planner) is one projection a slot:
    at 8 GiB it keeps two more MLPs resident than whole-MLP slots on every 7-8B shape."""
    from deepseek_flash.daemon.config import KEYS

    bs, _ = seven_b_blocks(arch)
    mlp_bytes = {b.id: b.length for b in bs if b.role.startswith("mlp")}
    default = plan_residency(bs, 8 << 30, "auto", arch, 55.4e9)
    layer = plan_residency(bs, 8 << 30, "auto", arch, 55.4e9, "layer")
    assert KEYS["stream_unit"].default == default.unit == "projection"

    def streamed(plan):
        return sum(mlp_bytes[b] for layer in plan.streamed_layers for b in plan.stream_blocks[layer])

    per_mlp = streamed(layer) // len(layer.streamed_layers)
    assert streamed(layer) - streamed(default) == 2 * per_mlp
    assert default.resident_bytes - layer.resident_bytes == 2 * per_mlp


def test_projection_units_follow_the_mlp_order_and_hold_codes_with_scales():
    """gate, up, down -- the order the MLP runs them -- each unit one module's ranges; a
    quantized weight's unit is its codes and its scales."""
    from deepseek_flash.wire import stream_units, unit_bytes

    t = lambda name, off, n, quant=None: SimpleNamespace(name=name, offset=off, nbytes=n, quant=quant)
    p = "model.layers.2.mlp."
    gate_up = SimpleNamespace(id=7, length=300, tensors=[
        t(p + "gate_proj.weight", 0, 100, {"scales_offset": 200, "scales_nbytes": 10}),
        t(p + "up_proj.weight", 100, 100, {"scales_offset": 210, "scales_nbytes": 10})])
    down = SimpleNamespace(id=8, length=120, tensors=[t(p + "down_proj.weight", 0, 100),
                                                      t(p + "down_proj.bias", 100, 20)])
    assert stream_units([gate_up, down], "projection") == [
        [(7, 0, 100), (7, 200, 10)], [(7, 100, 100), (7, 210, 10)], [(8, 0, 100), (8, 100, 20)]]
    assert stream_units([gate_up, down], "layer") == [[(7, 0, 300), (8, 0, 120)]]
    assert unit_bytes([(7, 0, 100), (7, 200, 10)]) == 2 * SLOT_ALIGNMENT
    with pytest.raises(ValueError, match="layer, projection"):
        stream_units([down], "tensor")
