"""load_model(device_map=...): a model split into parts, each attached, planned, budgeted and
streamed on its own, gives the logits of the single-device model exactly (fp32, CPU stand-ins for
the devices: two parts on "cpu" are two loads, two plans, two slot rings)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from deepseek_flash.client import Client
from deepseek_flash.client.model import _to, load_model
from deepseek_flash.client.placement import Part
from deepseek_flash.daemon.planner import resident_minimum
from deepseek_flash.fsutil import align_up
from deepseek_flash.errors import BudgetTooSmall, DeviceMapError, UnknownBlock
from deepseek_flash.store import Store, pack
from deepseek_flash.testing import assert_same_outputs, load_reference, make_tiny_model
from flashd_harness import Daemon

CONFIG = {"host_cache_bytes": "64MiB", "unified_memory_ratio": 0.05}
CUDA = torch.cuda.is_available()
# CPU stand-ins in CI; on a GPU machine two logical slices of one GPU and, with two, both GPUs.
PAIRS = [("cpu", "cpu"),
         pytest.param(("cuda:0", "cuda:0"), marks=[pytest.mark.gpu, pytest.mark.skipif(
             not CUDA, reason="needs CUDA")], id="cuda:0-slices"),
         pytest.param(("cuda:0", "cuda:1"), marks=[pytest.mark.gpu, pytest.mark.skipif(
             not CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")], id="two-gpus")]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("device-map")
    src = make_tiny_model(root / "src", "llama", dtype="float32", num_layers=6, seed=7)
    return src, pack(src, root / "store")


def ids(batch=2):
    return torch.randint(0, 256, (batch, 7), generator=torch.Generator().manual_seed(batch))


def part_minimum(store_path, part) -> int:
    blocks = Store.open(store_path).blocks
    mine = set(part.blocks(blocks))
    return resident_minimum([b for b in blocks if b.id in mine])


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "-".join(p))
def test_split_with_one_streaming_part_equals_the_single_device_model(store, pair):
    src, path = store
    ref = load_reference(src, device=pair[0])
    layers = [[pair[0], range(0, 2)], [pair[1], range(2, 6)]]
    with Client(embedded=True, config=CONFIG) as client:
        probe = load_model(path, client=client, device_map={"layers": layers})
        parts = [p.part for p in probe.flash.parts]
        probe.flash.close()
        budget = part_minimum(path, parts[1])
        model = load_model(path, client=client, weight_budget=[None, budget],
                           device_map={"layers": layers})
        first, second = model.flash.parts
        assert (first.part.layers, second.part.layers) == ((0, 1), (2, 3, 4, 5))
        # Part 0 holds everything it was given; part 1 streams its MLPs through its own ring.
        assert first.stream is None and not first.plan.streaming
        assert second.stream is not None and second.plan.streamed_layers == [2, 3, 4, 5]
        assert second.plan.budget == budget and second.stream.n == 2
        # Each part placed only its own blocks: embeddings with part 0, the head with part 1.
        blocks = {b.id: b for b in model.flash.info.blocks}
        assert {blocks[b].layer for b in first.plan.resident} == {-1, 0, 1}
        assert {blocks[b].role for b in first.plan.resident if blocks[b].layer < 0} == {"embed"}
        assert {blocks[b].role for b in second.plan.resident if blocks[b].layer < 0} == {"final_norm",
                                                                                          "lm_head"}
        assert [p.device for p in model.parameters()][-1] == torch.device(pair[1])
        assert_same_outputs(model, ref, ids().to(pair[0]))
        stats = model.flash.stream.stats()
        assert stats["passes"] > 0 and stats["streamed_layers"] == 4 and len(stats["parts"]) == 1
        # The controller's plan of the model lists both parts.
        listed = {m["name"]: m for m in client.list_models()}[model.flash.info.name]["plan"]["parts"]
        assert listed["0"]["device"] == pair[0] and listed["1"]["streamed_layers"] == [2, 3, 4, 5]
        model.flash.close()
        assert client.stats()["active_leases"] == 0


def test_auto_split_over_two_logical_slices_through_the_daemon(store, tmp_path):
    src, path = store
    ref = load_reference(src)
    daemon = Daemon(tmp_path / "flashd", CONFIG).start()
    try:
        blocks = Store.open(path).blocks
        whole = sum(align_up(b.length, 4096) for b in blocks)
        halves = [Part(0, "cpu", (0, 1, 2), True, False), Part(1, "cpu", (3, 4, 5), False, True)]
        sizes = [sum(align_up(b.length, 4096) for b in blocks if b.id in set(p.blocks(blocks)))
                 for p in halves]
        # A total budget gives each part its resident minimum first: the sum of the minimums
        # loads, where a split by bytes alone would leave a part below its own (each part pays
        # its own anchors and slots).
        minimums = [part_minimum(path, p) for p in halves]
        total = sum(minimums)
        assert total < whole
        assert min(total * n // whole - m for n, m in zip(sizes, minimums)) < 0
        model = load_model(path, socket_path=daemon.socket, device_map={"devices": ["cpu", "cpu"]},
                           weight_budget=total)
        assert model.flash.client.mode == "daemon"
        a, b = model.flash.parts
        assert a.part.layers == (0, 1, 2) and b.part.layers == (3, 4, 5)
        assert a.stream is not None and b.stream is not None
        assert [a.plan.budget, b.plan.budget] == minimums
        assert_same_outputs(model, ref, ids(3))
        assert model.flash.stream.stats()["streamed_layers"] == len(a.plan.streamed_layers) + \
            len(b.plan.streamed_layers)
        model.flash.close()
    finally:
        assert daemon.stop() == 0
        daemon.cleanup()


def test_a_part_whose_budget_cannot_hold_it_is_named(store):
    _, path = store
    with Client(embedded=True, config=CONFIG) as client:
        with pytest.raises(BudgetTooSmall) as exc:
            load_model(path, client=client, weight_budget={"cpu": 1000},
                       device_map={"layers": {"cpu": range(0, 6)}})
        assert exc.value.code == 402
        assert "part 0 on cpu (layers 0-5)" in str(exc.value) and exc.value.device == "cpu"
        assert exc.value.layers == [0, 1, 2, 3, 4, 5]
        # Nothing stays attached after the refusal.
        assert client.stats()["active_leases"] == 0


def test_bad_maps_fail_before_anything_is_attached(store):
    _, path = store
    with Client(embedded=True, config=CONFIG) as client:
        with pytest.raises(DeviceMapError, match="layers \\[5\\] are on no device"):
            load_model(path, client=client, device_map={"layers": {"cpu": range(0, 5)}})
        with pytest.raises(DeviceMapError, match="cuda:7 does not exist"):
            load_model(path, client=client, device_map={"devices": ["cpu", "cuda:7"]})
        with pytest.raises(DeviceMapError, match="device or device_map"):
            load_model(path, client=client, device="cpu", device_map="auto")
        with pytest.raises(DeviceMapError, match="decode='graphs'"):
            load_model(path, client=client, device_map="auto", decode="graphs")
        assert client.stats()["active_leases"] == 0
        # The attach op itself refuses a block the model does not have, typed.
        name = client.open_model(path).name
        with pytest.raises(UnknownBlock, match="no block 999"):
            client.attach(name, "cpu", blocks=[0, 999], part=1)


def test_activations_move_to_the_layer_device_recursively():
    """The boundary move, checked against a second device type CPU tests have: meta."""
    meta = torch.device("meta")
    hidden = torch.ones(2, 3)
    args, kwargs = _to((hidden,), meta), _to({"position_embeddings": (torch.ones(1), torch.ones(1)),
                                              "attention_mask": {"full_attention": torch.ones(1)},
                                              "use_cache": True, "past_key_values": None}, meta)
    assert args[0].device == meta and args[0].shape == (2, 3)
    assert all(t.device == meta for t in kwargs["position_embeddings"])
    assert kwargs["attention_mask"]["full_attention"].device == meta
    assert kwargs["use_cache"] is True and kwargs["past_key_values"] is None
    # Already there: the very same tensor, no copy.
    assert _to(hidden, torch.device("cpu")) is hidden
    # The same source tensor crosses once per part and pass: later layers get the same copy.
    memo = {}
    once = _to((hidden,), meta, memo)[0]
    assert _to({"h": hidden}, meta, memo)["h"] is once
    assert _to(torch.ones(2, 3), meta, memo) is not once
