"""quant.host_tier.TiledStore (``int4_layout: cuda_tiles``): the host tier holds int4 weights in the
tile layout of torch's CUDA int4 kernel, byte for byte what ``int4pack.cuda_layout`` and
``int4pack.scales_and_zeros`` build from the stored bytes (packed or quantized on entry); a model
binds those bytes as they are (nothing derived, ``derived_nbytes`` 0), streamed == resident bit
exact, embedded and daemon, and its logits follow the stored-layout model's."""
from __future__ import annotations

import gc
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from flashd_harness import Daemon

from deepseek_flash.client import Client
from deepseek_flash.client.model import Gates, load_model
from deepseek_flash.daemon.planner import resident_minimum
from deepseek_flash.errors import FlashIOError
from deepseek_flash.quant import QuantSpec, int4pack
from deepseek_flash.quant.host_tier import TILES, QuantizingStore, TiledStore
from deepseek_flash.quant.linear import QuantLinear, derived_nbytes
from deepseek_flash.store import Store, pack
from deepseek_flash.store.views import block_tensors
from deepseek_flash.testing import make_tiny_model
from deepseek_flash.wire import GATE_FAILED, GATE_READY

CUDA = torch.cuda.is_available()
INT4 = QuantSpec("int4_symmetric", "per_block", 128)
CONFIG = {"host_cache_bytes": "64MiB", "unified_memory_ratio": 0.05}
TILED = {**CONFIG, "int4_layout": "cuda_tiles"}
STORED = {**CONFIG, "int4_layout": "stored"}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiles")
    src = make_tiny_model(root / "src", "qwen2", dtype="bfloat16", hidden_size=128,
                          intermediate_size=256, num_heads=4, num_kv_heads=2, num_layers=4, seed=5)
    return src, pack(src, root / "plain"), pack(src, root / "int4", quant=INT4, quant_device="cpu")


def test_host_tier_bytes_equal_the_layout_int4pack_builds(stores):
    _src, plain, int4 = stores
    base = Store.open(int4)
    tiled = TiledStore(base)
    on_entry = TiledStore(QuantizingStore(Store.open(plain), INT4))
    seen = 0
    for block in tiled.blocks:
        stored = block_tensors(base.block(block.id), base.read_block(block.id))
        payload = tiled.read_block(block.id)
        assert on_entry.read_block(block.id) == payload       # quantized on entry: same bytes
        got = block_tensors(block, payload)
        for name, want in stored.items():
            t = got[name]
            if not hasattr(want, "spec"):
                assert torch.equal(t, want), name
                continue
            assert t.layout == TILES and t.kernel == (8, 128), name
            assert torch.equal(t.data, int4pack.cuda_layout(want.data, 8)), name
            sz = int4pack.scales_and_zeros(want.scales, INT4, want.shape, 128, torch.bfloat16)
            assert t.scales.dtype == torch.bfloat16 and torch.equal(t.scales, sz), name
            assert torch.equal(int4pack.codes_from_cuda_layout(t.data, *want.shape), want.data)
            seen += 1
    assert seen == 4 * 7
    grown = sum(b.length for b in tiled.blocks) - base.total_bytes
    # Only the scales grow, to (scale, 0) pairs (alignment padding absorbs part of it).
    assert 0 < grown <= sum(t.quant["scales_nbytes"] // 2 for b in tiled.blocks for t in b.tensors
                            if t.quant)


@pytest.mark.parametrize("mode", ["embedded", "daemon"])
def test_tiled_model_binds_the_host_bytes_streamed_equals_resident(stores, mode, tmp_path):
    _src, _plain, int4 = stores
    budget = resident_minimum(TiledStore(Store.open(int4)).blocks)
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    daemon = Daemon(tmp_path / "d", TILED).start() if mode == "daemon" else None
    try:
        client = Client(daemon.socket, embedded=False) if daemon else Client(embedded=True, config=TILED)
        with client:
            resident = load_model(int4, device="cpu", client=client)
            streamed = load_model(int4, device="cpu", client=client, weight_budget=budget)
            assert streamed.flash.stream is not None
            proj = resident.model.layers[0].mlp.down_proj
            assert isinstance(proj, QuantLinear) and proj.layout == TILES
            assert proj.codes.dtype == torch.int32 and proj.scales.dtype == torch.bfloat16
            with torch.no_grad():
                want = resident(ids).logits
                for _ in range(2):
                    assert torch.equal(streamed(ids).logits, want)
                resident(ids[:, :1])                          # decode-sized M: nothing derived
            assert derived_nbytes(resident) == 0 and derived_nbytes(streamed) == 0
            tokens = resident.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
            assert torch.equal(streamed.generate(ids, attention_mask=mask, max_new_tokens=6,
                                                 do_sample=False), tokens)
            streamed.flash.close()
            resident.flash.close()
    finally:
        if daemon is not None:
            assert daemon.stop() == 0
            daemon.cleanup()


def test_a_closed_streamed_model_dies_with_its_last_reference(stores):
    """``close()`` then dropping the model frees its streaming slot views at once, not at the
    next cyclic garbage collection: on a GPU those views are device memory that the arena hands
    to the next load as soon as the model is closed (a bench phase measured the previous
    phase's model still allocated beside its own)."""
    _src, _plain, int4 = stores
    budget = resident_minimum(TiledStore(Store.open(int4)).blocks)
    with Client(embedded=True, config=TILED) as client:
        model = load_model(int4, device="cpu", client=client, weight_budget=budget)
        layer = model.flash.stream.layers[0]
        with torch.no_grad():
            model(torch.ones(1, 4, dtype=torch.long))
        codes = weakref.ref(model.model.layers[layer].mlp.down_proj.codes)
        alive = weakref.ref(model)
        model.flash.close()
        gc.collect()
        assert codes() is not None
        gc.disable()
        try:
            del model
            assert alive() is None and codes() is None
        finally:
            gc.enable()


def test_tiled_logits_follow_the_stored_layout(stores):
    """The tile layout's one rounding: bfloat16 scales (the CUDA kernel's), so logits stay within
    a bfloat16 model's tolerance of the stored layout's (tests/quant/test_runtime.py)."""
    _src, _plain, int4 = stores
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(2))
    out = {}
    for label, config in (("tiles", TILED), ("stored", STORED)):
        with Client(embedded=True, config=config) as client:
            model = load_model(int4, device="cpu", client=client)
            assert model.model.layers[0].self_attn.q_proj.layout == (TILES if label == "tiles" else "rows")
            with torch.no_grad():
                out[label] = model(ids).logits.float()
            model.flash.close()
    rel = float((out["tiles"] - out["stored"]).abs().max() / out["stored"].abs().max())
    assert 0 < rel < 2e-2


def test_a_layer_read_alone_waits_for_the_load_in_flight(stores):
    """A layer called alone is outside its model's load gates (they hook the decoder layers): it
    may read bytes still on their way -- on the GPU, memory the load has not written yet (the
    ``nan`` of the CUDA test below on its first run). ``model.flash.wait_loaded()`` waits for
    every gate, and a gate that failed raises ``FlashIOError`` naming it. A CPU load answers
    only once its blocks are read, so the load in flight is played here: layer 0's bytes zeroed
    and put back by a "loader" thread just before it opens the gates."""
    _src, _plain, int4 = stores
    with Client(embedded=True, config=TILED) as client:
        model = load_model(int4, device="cpu", client=client)
        proj = model.model.layers[0].mlp.down_proj
        assert proj.layout == TILES and model.flash.gates is None
        x = torch.randn(1, 1, proj.in_features, dtype=torch.bfloat16,
                        generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = x.float() @ proj.dequantized_weight(torch.float32).T
            codes, scales = proj.codes.clone(), proj.scales.clone()
            for failed in (False, True):
                proj.codes.zero_()
                proj.scales.zero_()
                control = np.zeros(len(model.model.layers) + 2, dtype=np.uint32)   # all pending
                model.flash.gates = Gates(model, control)
                assert not proj.dequantized_weight(torch.float32).any()     # alone: no wait

                def loader():
                    time.sleep(0.05)
                    proj.codes.copy_(codes)
                    proj.scales.copy_(scales)
                    control[:] = GATE_READY
                    if failed:
                        control[1] = GATE_FAILED

                thread = threading.Thread(target=loader)
                thread.start()
                try:
                    if failed:
                        with pytest.raises(FlashIOError, match="gate 1 failed") as info:
                            model.flash.wait_loaded()
                        assert info.value.gate == 1
                        continue
                    model.flash.wait_loaded()
                finally:
                    thread.join()
                assert model.flash.gates.opened == [True] * len(control)
                assert not model.flash.gates.active               # the hooks removed themselves
                ref = x.float() @ proj.dequantized_weight(torch.float32).T
                assert torch.equal(ref, want) and ref.abs().max() > 0
                rel = float((proj(x).float() - ref).abs().max() / ref.abs().max())
                assert rel < 1.6e-2, rel
        model.flash.gates = None
        model.flash.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_default_binds_the_kernel_operands_and_the_layer_captures_in_a_graph(stores):
    """On a CUDA machine ``auto`` holds the tiles; the layer runs torch's kernel on the bound
    bytes (nothing derived) within the kernel's tolerance of the float32 reference, and its
    forward replays from a CUDA graph with the same result as eager."""
    _src, _plain, int4 = stores
    base = Store.open(int4)
    on_cpu, on_gpu = TiledStore(base, "cpu"), TiledStore(base, "cuda")
    for block in on_cpu.blocks:                  # the daemon derives on the GPU: same bytes
        assert on_gpu.read_block(block.id) == on_cpu.read_block(block.id)
    with Client(embedded=True, config=CONFIG) as client:
        model = load_model(int4, device="cuda:0", client=client)
        # The layer is called alone, outside the model's forward and so outside its load gates:
        # its bytes may still be on their way to the GPU until the load is waited for.
        model.flash.wait_loaded()
        proj = model.model.layers[0].mlp.down_proj
        assert proj.layout == TILES and proj.codes.is_cuda
        g = torch.Generator(device="cuda:0").manual_seed(0)
        x = torch.randn(1, 1, proj.in_features, device="cuda:0", dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            ref = x.float() @ proj.dequantized_weight(torch.float32).T
            eager = proj(x)
            rel = float((eager.float() - ref).abs().max() / ref.abs().max())
            assert rel < 1.6e-2, rel
            static = x.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                proj(static)                                  # warm up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = proj(static)
            y = torch.randn(x.shape, device="cuda:0", dtype=torch.bfloat16, generator=g)
            static.copy_(y)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, proj(y))
        assert derived_nbytes(model) == 0
        model.flash.close()
