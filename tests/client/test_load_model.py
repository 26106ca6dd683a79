"""load_model: logits and greedy tokens bit-identical to plain transformers, embedded and through
the daemon, first client and attaching clients, resident and streamed -- on the CPU in CI and on
CUDA where a GPU is present (the same tests, device ``cuda:0``, marked ``gpu``)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from deepseek_flash.client import Client
from deepseek_flash.client.model import load_model
from deepseek_flash.daemon.planner import resident_minimum
from flashd_harness import Daemon

from deepseek_flash.errors import BudgetTooSmall
from deepseek_flash.store import Store, pack
from deepseek_flash.testing import assert_same_outputs, load_reference, make_tiny_model

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda:0", marks=[pytest.mark.gpu,
                                                pytest.mark.skipif(not CUDA, reason="needs CUDA")])]
CASES = [("llama", "float32"), ("qwen2", "bfloat16"), ("mistral", "float16"), ("llama", "bfloat16")]
CONFIG = {"host_cache_bytes": "64MiB", "unified_memory_ratio": 0.05}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("load-model")
    out = {}
    for arch, dtype in CASES:
        src = make_tiny_model(root / f"{arch}-{dtype}-src", arch, dtype=dtype, num_layers=4,
                              seed=len(out))
        out[(arch, dtype)] = (src, pack(src, root / f"{arch}-{dtype}"))
    return out


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("flashd-load"), CONFIG).start()
    yield d
    assert d.stop() == 0
    d.cleanup()


def inputs(batch: int):
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, 256, (batch, 6), generator=g)


def assert_same_as_reference(model, ref, device):
    for batch in (1, 3):
        assert_same_outputs(model, ref, inputs(batch).to(device))


def minimum_budget(store_path) -> int:
    return resident_minimum(Store.open(store_path).blocks)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_embedded_resident_is_bit_exact(stores, case, device):
    src, store = stores[case]
    ref = load_reference(src, device=device)
    with Client(embedded=True, config=CONFIG) as client:
        model = load_model(store, device=device, client=client)
        assert model.flash.client.mode == "embedded"
        param = next(model.parameters())
        assert param.device == torch.device(device) and str(param.dtype) == f"torch.{case[1]}"
        # On CUDA its attention runs without cuDNN's kernel (as the reference's does).
        assert hasattr(model.forward, "__flash_sdpa__") == (device != "cpu")
        assert_same_as_reference(model, ref, device)
        model.flash.close()


@pytest.mark.parametrize("device", DEVICES)
def test_daemon_first_and_attaching_clients_share_bytes(stores, daemon, device, tmp_path):
    src, store = stores[("qwen2", "bfloat16")]
    ref = load_reference(src, device=device)
    first = load_model(store, device=device, socket_path=daemon.socket)
    assert first.flash.client.mode == "daemon"
    assert_same_as_reference(first, ref, device)
    # A second process attaches to the same model while the first still holds it.
    script = (
        "import sys, json, torch\n"
        "from deepseek_flash.client.model import load_model\n"
        "m = load_model(sys.argv[1], device=sys.argv[2], socket_path=sys.argv[3])\n"
        "ids = torch.load(sys.argv[4]).to(sys.argv[2])\n"
        "with torch.no_grad():\n"
        "    torch.save(m(ids).logits.cpu(), sys.argv[5])\n"
        "p = dict(m.named_parameters())['model.layers.0.mlp.down_proj.weight']\n"
        "print(json.dumps({'ptr': p.data_ptr() if p.device.type == 'cuda' else None}))\n"
        "m.flash.close()\n")
    torch.save(inputs(3), tmp_path / "ids.pt")
    out = subprocess.run([sys.executable, "-c", script, str(store), device, str(daemon.socket),
                          str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    with torch.no_grad():
        want = ref(inputs(3).to(device)).logits.cpu()
    assert torch.equal(torch.load(tmp_path / "logits.pt"), want)
    stats = daemon.client().stats()
    assert stats["connected_clients"] >= 1
    first.flash.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [0, 2, 4])
@pytest.mark.parametrize("mode", ["embedded", "daemon"])
@pytest.mark.parametrize("policy", ["lru", "access_frequency_weighted"])
def test_streamed_under_budget_is_bit_exact(stores, daemon, device, window, mode, policy):
    src, store = stores[("llama", "float32")]
    ref = load_reference(src, device=device)
    budget = minimum_budget(store)
    client = (Client(embedded=True, config={**CONFIG, "block_eviction_policy": policy})
              if mode == "embedded" else Client(daemon.socket, embedded=False))
    with client:
        if mode == "daemon":
            client.set_tunable("block_eviction_policy", policy)
        assert client.get_tunable()["block_eviction_policy"] == policy
        model = load_model(store, device=device, client=client, weight_budget=budget,
                           flash_context={"prefetch_window": window})
        runtime = model.flash.stream
        # The minimum budget holds exactly two slots, whatever the window asks for; each of the
        # four layers' MLPs is one unit, or three (``stream_unit``'s default).
        units = 4 * (3 if runtime.plan.unit == "projection" else 1)
        assert runtime is not None and runtime.m == units and runtime.n == 2
        # The window asked for reached the plan (capped by the ring's two slots).
        assert runtime.plan.window == min(window, 2)
        assert_same_as_reference(model, ref, device)
        assert runtime.stats()["passes"] > 0
        models = client.list_models()
        assert any(m.get("plan", {}).get("streamed_layers") for m in models), models
        model.flash.close()
        # Detached: the load's and the streamed layers' host leases all went back.
        assert client.stats()["active_leases"] == 0
        if mode == "daemon":
            client.set_tunable("block_eviction_policy", "lru")    # the module's daemon is shared


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: "-".join(c))
@pytest.mark.parametrize("mode", ["embedded", "daemon"])
def test_projection_slots_are_bit_exact(stores, daemon, device, case, mode):
    """``stream_unit: projection`` for each arch: every projection of the four layers' MLPs in a
    slot of its own (12 units through the smallest ring), logits and tokens those of the
    reference -- on CUDA through the copy stream, events and the per-projection hooks."""
    src, store = stores[case]
    ref = load_reference(src, device=device)
    budget = resident_minimum(Store.open(store).blocks, "projection")
    client = Client(embedded=True, config=CONFIG) if mode == "embedded" else Client(daemon.socket,
                                                                                   embedded=False)
    with client:
        model = load_model(store, device=device, client=client, weight_budget=budget,
                           flash_context={"stream_unit": "projection"})
        runtime = model.flash.stream
        assert runtime.plan.unit == "projection" and (runtime.m, runtime.n) == (12, 2)
        assert_same_as_reference(model, ref, device)
        stats = runtime.stats()
        assert stats["prefetch_hits"] + stats["prefetch_miss_count"] == 12 * stats["passes"]
        model.flash.close()
        assert client.stats()["active_leases"] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: "-".join(c))
def test_projection_slots_beside_a_spread_resident_mlp_are_bit_exact(stores, device, case):
    """The default unit, a budget that keeps one MLP resident beside a two-slot ring: the ring's
    copies are far shorter than the stretch between two tokens, so the resident MLP is spread
    (layer 1 of four; 0, 2 and 3 stream) -- logits and tokens those of the reference, the hooks
    skipping the resident layer between streamed units."""
    from deepseek_flash.fsutil import align_up
    from deepseek_flash.wire import SLOT_ALIGNMENT, STREAM_ROLES

    src, store = stores[case]
    ref = load_reference(src, device=device)
    blocks = Store.open(store).blocks
    one_mlp = sum(align_up(b.length, SLOT_ALIGNMENT) for b in blocks
                  if b.layer == 1 and b.role in STREAM_ROLES)
    budget = resident_minimum(blocks) + one_mlp
    with Client(embedded=True, config=CONFIG) as client:
        model = load_model(store, device=device, client=client, weight_budget=budget,
                           flash_context={"prefetch_window": 1})
        runtime = model.flash.stream
        assert runtime.plan.unit == "projection" and runtime.layers == [0, 2, 3]
        assert (runtime.m, runtime.n) == (9, 2)
        assert runtime.plan.resident_bytes + 2 * runtime.plan.slot_bytes == budget
        assert_same_as_reference(model, ref, device)
        stats = runtime.stats()
        assert stats["prefetch_hits"] + stats["prefetch_miss_count"] == 9 * stats["passes"] > 0
        model.flash.close()
        assert client.stats()["active_leases"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_two_clients_stream_the_same_model_at_once(stores, daemon, device):
    src, store = stores[("qwen2", "bfloat16")]
    ref = load_reference(src, device=device)
    budget = minimum_budget(store)
    a = load_model(store, device=device, socket_path=daemon.socket, weight_budget=budget)
    b = load_model(store, device=device, socket_path=daemon.socket, weight_budget=budget)
    ids = inputs(2).to(device)
    with torch.no_grad():
        want = ref(ids).logits
        for _ in range(3):
            # Interleaved passes: each client's slots follow its own position.
            la, lb = a(ids).logits, b(ids).logits
            assert torch.equal(la, want) and torch.equal(lb, want)
    a.flash.close()
    b.flash.close()


def test_budget_below_minimum_is_a_clear_error(stores):
    src, store = stores[("llama", "float32")]
    budget = minimum_budget(store) - 1
    with Client(embedded=True, config=CONFIG) as client, pytest.raises(BudgetTooSmall) as exc:
        load_model(store, device="cpu", client=client, weight_budget=budget)
    assert exc.value.code == 402 and str(budget) in str(exc.value)


def test_model_stays_resident_after_last_client_until_unload(stores, daemon):
    src, store = stores[("mistral", "float16")]
    m = load_model(store, socket_path=daemon.socket)
    name = m.flash.info.name
    m.flash.close()
    with daemon.client() as c:
        listed = {x["name"]: x for x in c.list_models()}
        assert listed[name]["resident_blocks"] == len(Store.open(store).blocks)
        assert json.dumps(c.unload(name))
        assert name not in {x["name"] for x in c.list_models()}


def test_load_model_records_its_phases(stores):
    src, store = stores[("llama", "bfloat16")]
    with Client(embedded=True, config=CONFIG) as client:
        model = load_model(store, device="cpu", client=client)
        t = model.flash.timings
        assert list(t) == ["open_model_ms", "attach_ms", "skeleton_ms", "device_memory_ms", "bind_ms",
                           "total_ms"]
        assert all(v >= 0 for v in t.values())
        assert t["total_ms"] == pytest.approx(sum(v for k, v in t.items() if k != "total_ms"), abs=0.01)
        model.flash.close()


def test_a_load_model_that_fails_after_attaching_detaches(stores, monkeypatch):
    """The attach happens before the skeleton is built: if building fails, the client's
    attachment (its CPU load and host leases) must not outlive the call."""
    from deepseek_flash.client import model as model_mod

    src, store = stores[("llama", "float32")]

    def broken(config):
        raise RuntimeError("skeleton broke")

    with Client(embedded=True, config=CONFIG) as client:
        monkeypatch.setattr(model_mod, "build_skeleton", broken)
        with pytest.raises(RuntimeError, match="skeleton broke"):
            load_model(store, device="cpu", client=client)
        loader = client._backend.attachments.loader
        assert [ld for ld in loader.loads() if ld.clients] == []
        assert client.stats()["active_leases"] == 0
        monkeypatch.undo()
        # The client is still usable for the next load.
        model = load_model(store, device="cpu", client=client)
        ref = load_reference(src, device="cpu")
        assert_same_outputs(model, ref, inputs(1))
        model.flash.close()
