"""quant.host_tier: an unquantized store opened with ``quantization_scheme`` is quantized as its
blocks enter the host tier -- the host tier holds, byte for byte, the payloads of the same store
packed with ``--quantize`` (CPU), clients see quantized blocks, the status says where the weights
were quantized; embedded and daemon."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from flashd_harness import Daemon, assert_eventually

from deepseek_flash.client import Client
from deepseek_flash.client.model import load_model
from deepseek_flash.errors import ConfigError
from deepseek_flash.quant import QuantSpec
from deepseek_flash.quant.host_tier import QuantizingStore
from deepseek_flash.quant.linear import QuantLinear
from deepseek_flash.store import Store, pack
from deepseek_flash.testing import make_tiny_model

INT4 = QuantSpec("int4_symmetric", "per_block", 128)      # the keys' group size: 128
# The stored layout in the host tier on any machine (a CUDA one would default to the kernel's tile
# layout: tests/quant/test_tiles.py).
CONFIG = {"host_cache_bytes": "64MiB", "unified_memory_ratio": 0.05, "int4_layout": "stored"}
KEYS = {"quantization_scheme": "int4_symmetric", "quantization_granularity": "per_block"}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("host-tier")
    out = {}
    for arch in ("llama", "qwen2"):                         # qwen2: biases beside the codes
        src = make_tiny_model(root / f"{arch}-src", arch, dtype="bfloat16", hidden_size=128,
                              intermediate_size=256, num_heads=4, num_kv_heads=2, num_layers=2,
                              seed=3)
        out[arch] = (pack(src, root / f"{arch}-plain"),
                     pack(src, root / f"{arch}-int4", quant=INT4, quant_device="cpu"))
    return out


def block_maps(blocks):
    """What a client sees of each block, without where the source lies on disk."""
    return [{k: v for k, v in b.__dict__.items() if k not in ("file", "offset", "crc32c",
                                                             "header_offset", "header_size",
                                                             "access_freq", "_view_spec")}
            for b in blocks]


def host_payloads(client, info) -> dict:
    lease = client.acquire(info.name, [b.id for b in info.blocks])
    try:
        arena = memoryview(client.arena).cast("B")
        return {b.id: bytes(arena[lease.blocks[b.id]:lease.blocks[b.id] + b.length])
                for b in info.blocks}
    finally:
        client.release(lease)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_host_tier_holds_the_bytes_of_the_packed_store(stores, arch):
    plain, packed = stores[arch]
    want = Store.open(packed)
    with Client(embedded=True, config={**CONFIG, **KEYS}) as client:
        info = client.open_model(plain)
        assert block_maps(info.blocks) == block_maps(want.blocks)
        assert info.total_bytes == want.total_bytes < Store.open(plain).total_bytes
        got = host_payloads(client, info)
        for b in want.blocks:
            assert got[b.id] == want.read_block(b.id), f"block {b.id} ({b.role}, layer {b.layer})"
        (entry,) = client.list_models()
        assert (entry["quantization_scheme"], entry["quantization_granularity"],
                entry["quantization_group_size"], entry["quantized_at"]) == \
            ("int4_symmetric", "per_block", 128, "host_tier")
        assert entry["total_bytes"] == want.total_bytes
        assert entry["disk_bytes"] == Store.open(plain).total_bytes
        assert client.stats()["bytes_read_nvme"] == Store.open(plain).total_bytes
        # The crc32c recorded for each transcoded block is the packed block's.
        store = QuantizingStore(Store.open(plain), INT4)
        assert [store.read_block(b.id) for b in store.blocks] == [got[b.id] for b in want.blocks]
        assert [b.crc32c for b in store.blocks] == [b.crc32c for b in want.blocks]


def test_model_runs_as_the_packed_one_daemon_and_status(stores, tmp_path):
    plain, packed = stores["llama"]
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    with Client(embedded=True, config=CONFIG) as client:
        ref = load_model(packed, device="cpu", client=client)
        with torch.no_grad():
            want = ref(ids).logits
        ref.flash.close()
    daemon = Daemon(tmp_path / "d", {**CONFIG, **KEYS}).start()
    try:
        with Client(daemon.socket, embedded=False) as client:
            model = load_model(plain, device="cpu", client=client)
            proj = model.model.layers[0].mlp.down_proj
            assert isinstance(proj, QuantLinear) and proj.spec == INT4
            with torch.no_grad():
                assert torch.equal(model(ids).logits, want)
            path = daemon.runtime / "models" / "llama-plain" / "info"
            text = assert_eventually(lambda: path.exists() and path.read_text(), 10, str(path))
            assert "quantized_at: host_tier\n" in text
            assert "quantization_scheme: int4_symmetric\n" in text
            model.flash.close()
    finally:
        assert daemon.stop() == 0
        daemon.cleanup()


def test_first_open_decides_and_later_opens_must_agree(stores):
    plain, _ = stores["llama"]
    with Client(embedded=True, config=CONFIG) as client:
        info = client.open_model(plain, {"quantization_scheme": "int4_symmetric"})
        assert info.blocks[2].quant == INT4.to_dict()             # the first layer's attn block
        client.open_model(plain)                                  # 'none': served as held
        with pytest.raises(ConfigError, match="the model is served int4_symmetric per_block g128 "
                                              r"\(quantized as its blocks enter the host tier\), but "
                                              "the configuration asks for quantization_scheme "
                                              "'int8_symmetric'"):
            client.open_model(plain, {"quantization_scheme": "int8_symmetric"})
    with Client(embedded=True, config=CONFIG) as client:
        client.open_model(plain)
        with pytest.raises(ConfigError, match="the model is open unquantized"):
            client.open_model(plain, {"quantization_scheme": "int4_symmetric"})


def test_a_weight_the_group_does_not_divide_is_refused_at_open(tmp_path):
    src = make_tiny_model(tmp_path / "src", "llama", dtype="bfloat16", num_layers=1)   # hidden 64
    plain = pack(src, tmp_path / "plain")
    from deepseek_flash.errors import UnsupportedModel

    with Client(embedded=True, config={**CONFIG, **KEYS}) as client:
        with pytest.raises(UnsupportedModel, match="not a multiple of the group size 128"):
            client.open_model(plain)


def test_a_failed_quantization_is_the_blocks_typed_error(stores, monkeypatch):
    from deepseek_flash.errors import FlashError

    def fail(self, info, source, dest):
        raise RuntimeError("codec failure")

    monkeypatch.setattr(QuantizingStore, "transcode", fail)
    plain, _ = stores["llama"]
    with Client(embedded=True, config={**CONFIG, **KEYS}) as client:
        info = client.open_model(plain)
        with pytest.raises(FlashError, match=r"block 2 \(attn, layer 0\): quantizing it as it "
                                             r"entered the host tier failed: RuntimeError\('codec "
                                             r"failure'\)"):
            client.acquire(info.name, [2])


def test_quantizing_does_not_hold_up_other_reads(stores, monkeypatch):
    import threading

    plain, packed = stores["llama"]
    real = QuantizingStore.transcode
    entered, go = threading.Event(), threading.Event()

    def slow(self, info, source, dest):
        entered.set()
        assert go.wait(30)
        return real(self, info, source, dest)

    monkeypatch.setattr(QuantizingStore, "transcode", slow)
    with Client(embedded=True, config=CONFIG) as client:
        quantized = client.open_model(plain, KEYS)
        other = client.open_model(packed)
        done = []
        t = threading.Thread(target=lambda: done.append(client.acquire(quantized.name, [3])))
        t.start()
        try:
            assert entered.wait(30)
            lease = client.acquire(other.name, [3])       # read and completed meanwhile
            assert not done
            client.release(lease)
        finally:
            go.set()
            t.join(30)
        assert done and 3 in done[0].blocks
        client.release(done[0])
