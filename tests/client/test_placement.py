"""client.placement: device_map forms resolved into parts, budgets split, bad maps refused typed."""
from __future__ import annotations

import pytest

from deepseek_flash.client.placement import Part, normalize_device, resolve
from deepseek_flash.errors import BudgetTooSmall, DeviceMapError, error_from_code
from deepseek_flash.store.format import BlockInfo

HERE = ["cpu", "cuda:0", "cuda:1"]
EIGHT = dict(num_layers=8, layer_bytes=[100] * 8, edge_bytes=(50, 50), available=HERE)


def spans(parts):
    return [(p.device, list(p.layers), p.first, p.last) for p in parts]


def test_auto_uses_every_gpu_and_splits_layers_by_free_memory():
    parts = resolve("auto", **EIGHT, free_bytes={"cuda:0": 3000, "cuda:1": 1000})
    # 900 bytes: cuda:0 takes three quarters of them (the embeddings count on its side).
    assert spans(parts) == [("cuda:0", [0, 1, 2, 3, 4, 5], True, False),
                            ("cuda:1", [6, 7], False, True)]
    assert [p.budget for p in parts] == [None, None]


def test_auto_without_a_gpu_is_one_cpu_part():
    parts = resolve("auto", num_layers=3, layer_bytes=[1, 1, 1], edge_bytes=(0, 0), available=["cpu"])
    assert spans(parts) == [("cpu", [0, 1, 2], True, True)]


def test_devices_may_repeat_as_logical_slices_and_a_total_budget_splits_by_bytes():
    parts = resolve({"devices": ["cuda:0", "cuda:0"]}, **EIGHT, weight_budget="450")
    assert spans(parts) == [("cuda:0", [0, 1, 2, 3], True, False), ("cuda:0", [4, 5, 6, 7], False, True)]
    assert [p.target for p in parts] == [0, 0]
    assert [p.budget for p in parts] == [225, 225]


# Layers of 100 bytes of which 60 may stream (the MLP), a large embedding and a small head: an
# automatic map cuts at the middle byte -- layers 0-2 + embeddings (500 bytes), 3-7 + head (520).
# Resident minimums (anchors + two slots of 60): 500 - 180 + 120 = 440 and 520 - 300 + 120 = 340.
SKEWED = dict(num_layers=8, layer_bytes=[100] * 8, stream_bytes=[60] * 8, edge_bytes=(200, 20),
              available=HERE)


def test_a_total_budget_gives_each_part_its_resident_minimum_first():
    parts = resolve({"devices": ["cuda:0", "cuda:0"]}, **SKEWED, weight_budget=800)
    assert [list(p.layers) for p in parts] == [[0, 1, 2], [3, 4, 5, 6, 7]]
    # By bytes alone part 0 would get 800 * 500 // 1020 = 392 < 440 and its attach would fail;
    # the 20 bytes over the minimums go by what each part could still keep (60 : 180).
    assert [p.budget for p in parts] == [440 + 5, 340 + 15]
    # A budget that holds everything still splits by bytes (every part whole).
    assert [p.budget for p in resolve({"devices": ["cuda:0", "cuda:1"]}, **SKEWED,
                                      weight_budget=2040)] == [1000, 1040]
    # Per device: one device's budget over its two slices follows the same rule.
    per_device = resolve({"devices": ["cuda:0", "cuda:0"]}, **SKEWED, weight_budget={"cuda:0": 800})
    assert [p.budget for p in per_device] == [445, 355]


def test_a_total_below_the_parts_minimums_is_refused_naming_each_part():
    with pytest.raises(BudgetTooSmall) as exc:
        resolve({"devices": ["cuda:0", "cuda:1"]}, **SKEWED, weight_budget=779)
    err = exc.value
    assert err.code == 402 and err.minimum == 780 and err.part_minimums == [440, 340]
    assert err.budget == 779
    assert "part on cuda:0 (layers 0-2) 440" in str(err) and "part on cuda:1 (layers 3-7) 340" in str(err)
    assert [p.budget for p in resolve({"devices": ["cuda:0", "cuda:1"]}, **SKEWED,
                                      weight_budget=780)] == [440, 340]
    # One part is not split: the planner's own refusal names what it misses.
    assert [p.budget for p in resolve({"devices": ["cuda:0"]}, **SKEWED, weight_budget=10)] == [10]


def test_projection_slots_lower_each_parts_minimum():
    """With ``stream_unit: projection`` a slot holds the largest projection (20 of the 60 here):
    minimums 500 - 180 + 40 = 360 and 520 - 300 + 40 = 260."""
    projection = dict(SKEWED, slot_bytes=[20] * 8)
    with pytest.raises(BudgetTooSmall) as exc:
        resolve({"devices": ["cuda:0", "cuda:1"]}, **projection, weight_budget=619)
    assert exc.value.minimum == 620 and exc.value.part_minimums == [360, 260]
    assert [p.budget for p in resolve({"devices": ["cuda:0", "cuda:1"]}, **projection,
                                      weight_budget=620)] == [360, 260]


def test_block_sizes_give_the_largest_unit_of_each_layer(tmp_path):
    from deepseek_flash.client.placement import block_sizes
    from deepseek_flash.store import Store, pack
    from deepseek_flash.testing import make_tiny_model
    from deepseek_flash.wire import SLOT_ALIGNMENT

    store = Store.open(pack(make_tiny_model(tmp_path / "src", "mistral", num_layers=2), tmp_path / "s"))
    whole = block_sizes(store.blocks, 2, SLOT_ALIGNMENT, "layer")
    split = block_sizes(store.blocks, 2, SLOT_ALIGNMENT, "projection")
    assert whole["slot_bytes"] == whole["stream_bytes"] == split["stream_bytes"]
    down = next(t for b in store.blocks if b.layer == 0 and b.role == "mlp_down" for t in b.tensors)
    assert split["slot_bytes"] == [-(-down.nbytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT] * 2
    assert 3 * split["slot_bytes"][0] == split["stream_bytes"][0]


def test_a_budget_per_device_steers_an_automatic_map_and_is_split_among_its_slices():
    parts = resolve({"devices": ["cuda:1", "cuda:0", "cuda:0"]}, **EIGHT,
                    weight_budget={"cuda:1": 450, "cuda:0": "900"})
    assert [p.device for p in parts] == ["cuda:1", "cuda:0", "cuda:0"]
    # Three equal capacities (cuda:0's 900 shared by its two slices): 300 of the 900 bytes each,
    # a layer going where its middle byte falls.
    assert [list(p.layers) for p in parts] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert [p.budget for p in parts] == [450, 900 * 300 // 650, 900 * 350 // 650]


def test_explicit_map_orders_parts_by_first_layer_and_takes_lists_per_part():
    parts = resolve({"layers": {"cuda:1": range(4, 8), "cuda:0": [0, 1, 2, 3]}}, **EIGHT,
                    weight_budget=[None, 300])
    assert spans(parts) == [("cuda:0", [0, 1, 2, 3], True, False), ("cuda:1", [4, 5, 6, 7], False, True)]
    assert [p.budget for p in parts] == [None, 300]
    same = resolve({"layers": [["cpu", [0, 1, 2]], ["cpu", range(3, 8)]]}, **EIGHT)
    assert spans(same) == [("cpu", [0, 1, 2], True, False), ("cpu", [3, 4, 5, 6, 7], False, True)]


@pytest.mark.parametrize("device_map,budget,words", [
    ({"devices": ["cuda:2"]}, None, ["cuda:2", "does not exist"]),
    ({"devices": ["tpu:0"]}, None, ["'tpu:0'", "not a device"]),
    ({"layers": {"cuda:0": range(0, 4), "cuda:1": range(3, 8)}}, None, ["layer 3", "twice", "cuda:0", "cuda:1"]),
    ({"layers": {"cuda:0": range(0, 4), "cuda:1": [4, 5]}}, None, ["layers [6, 7]", "no device"]),
    ({"layers": {"cuda:0": range(0, 9)}}, None, ["layer 8", "cuda:0", "does not exist"]),
    ({"layers": {"cuda:0": range(0, 8)}}, {"cuda:1": 10}, ["cuda:1", "does not use"]),
    ({"devices": ["cpu"] * 9}, None, ["9 devices", "8 layers"]),
    ({"devices": "cuda:0"}, None, ["non-empty list"]),
    ({"gpus": 2}, None, ["device_map must be"]),
    ({"layers": {"cuda:0": range(0, 8)}}, [1, 2], ["2 budgets", "1 parts"]),
])
def test_bad_maps_are_typed_errors_naming_the_fault(device_map, budget, words):
    with pytest.raises(DeviceMapError) as exc:
        resolve(device_map, **EIGHT, weight_budget=budget)
    assert exc.value.code == 901 and isinstance(exc.value, ValueError)
    for word in words:
        assert word in str(exc.value)
    # It crosses the socket as the same class.
    assert type(error_from_code(901, "x")) is DeviceMapError


def test_missing_and_repeated_layers_are_named_in_the_fields():
    with pytest.raises(DeviceMapError) as exc:
        resolve({"layers": {"cuda:0": [0, 1, 2, 5]}}, **EIGHT)
    assert exc.value.missing == [3, 4, 6, 7] and exc.value.layer == 3
    with pytest.raises(DeviceMapError) as exc:
        resolve({"layers": [["cuda:0", [0, 1]], ["cuda:1", [1, 2]]]}, **EIGHT)
    assert exc.value.layer == 1 and exc.value.device == "cuda:1"


def test_normalize_device_forms():
    assert normalize_device("cuda", HERE) == "cuda:0"
    assert normalize_device(1, HERE) == "cuda:1"
    assert normalize_device(" cuda:01 ", HERE) == "cuda:1"


def _block(bid, role, layer):
    return BlockInfo(id=bid, role=role, layer=layer, file="", offset=0, length=1, crc32c=0, tensors=[])


def test_parts_own_their_blocks_and_names_tied_head_goes_with_the_last_part():
    blocks = [_block(0, "embed", -1)] + [_block(1 + i, "attn", i) for i in range(4)] + \
             [_block(5, "final_norm", -1)]
    a = Part(0, "cpu", (0, 1), first=True, last=False)
    b = Part(1, "cpu", (2, 3), first=False, last=True)
    assert a.blocks(blocks) == [0, 1, 2]
    # No lm_head block: the head is an alias of the embedding block, so the last part needs it.
    assert b.blocks(blocks) == [0, 3, 4, 5]
    untied = blocks + [_block(6, "lm_head", -1)]
    assert b.blocks(untied) == [3, 4, 5, 6]
    assert a.owns("model.embed_tokens.weight") and not b.owns("model.embed_tokens.weight")
    assert b.owns("lm_head.weight") and b.owns("model.norm.weight") and not a.owns("lm_head.weight")
    assert a.owns("model.layers.1.mlp.down_proj.weight") and not a.owns("model.layers.2.mlp.up_proj.weight")
    assert b.describe() == "part 1 on cpu (layers 2-3)"


def test_l0_device_holds_its_layers_whole_and_the_budget_goes_to_the_others():
    parts = resolve({"devices": ["cuda:0", "cuda:1"], "l0_device": "cuda:0"}, **EIGHT,
                    weight_budget=800)
    assert [p.l0 for p in parts] == [True, False]
    # cuda:0 holds embeddings + layers 0-3 (450 bytes) whole; cuda:1 gets the other 350.
    assert [p.budget for p in parts] == [None, 350]
    with pytest.raises(DeviceMapError) as exc:
        resolve({"devices": ["cuda:0", "cuda:1"], "l0_device": "cuda:0"}, **EIGHT, weight_budget=400)
    assert exc.value.device == "cuda:0" and "450 bytes" in str(exc.value)
    with pytest.raises(DeviceMapError, match="its weight_budget is 100"):
        resolve({"layers": {"cuda:0": range(0, 4), "cuda:1": range(4, 8)}, "l0_device": "cuda:0"},
                **EIGHT, weight_budget={"cuda:0": 100, "cuda:1": 300})
    with pytest.raises(DeviceMapError, match="l0_device cuda:1 holds no layers"):
        resolve({"devices": ["cuda:0"], "l0_device": "cuda:1"}, **EIGHT)
    per_device = resolve({"devices": ["cuda:0", "cuda:1"], "l0_device": "cuda:0"}, **EIGHT,
                         weight_budget={"cuda:1": 300})
    assert [p.budget for p in per_device] == [None, 300]
