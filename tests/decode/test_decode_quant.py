"""Quantized stores (int4 and int8) with decode="graphs": the step runs each QuantLinear as its
module (unmerged; resident int4 in the tile layout merged, q|k|v and gate|up), resident and streamed, with the tokens of transformers' generate() over the same
quantized model for 64 steps in fp32 (the CPU runs the static-cache steps eagerly; CUDA captures
them, marked gpu)."""
import pytest
import torch
from decode_models import DEVICES, left_padded

from deepseek_flash.client import Client
from deepseek_flash.client.model import load_model
from deepseek_flash.daemon.planner import resident_minimum
from deepseek_flash.quant import QuantSpec
from deepseek_flash.quant.linear import QuantLinear
from deepseek_flash.store import Store, pack
from deepseek_flash.testing import make_tiny_model

CONFIG = {"host_cache_bytes": "64MiB", "unified_memory_ratio": 0.05}


STEPS = 64


@pytest.fixture(scope="module", params=["int4_symmetric", "int8_symmetric"], ids=["int4", "int8"])
def store(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("decode-quant")
    src = make_tiny_model(root / "src", "llama", dtype="float32", num_layers=4, seed=5)
    return pack(src, root / request.param, quant=QuantSpec(request.param, "per_block", 32),
                quant_device="cpu")


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
@pytest.mark.parametrize("device", DEVICES)
def test_quantized_model_decodes_with_transformers_tokens(store, device, streamed):
    budget = resident_minimum(Store.open(store).blocks) if streamed else None
    ids, mask = left_padded(2, 7, device, seed=4)
    with Client(embedded=True, config=CONFIG) as client:
        model = load_model(store, device=device, client=client, weight_budget=budget, decode="graphs")
        assert any(isinstance(m, QuantLinear) for m in model.modules())
        assert (model.flash.stream is not None) == streamed
        want = model.flash.decoder.transformers_generate(ids, attention_mask=mask, max_new_tokens=STEPS,
                                                         do_sample=False, pad_token_id=0)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want)
        stats = model.flash.decoder.stats()
        merged = stats["merged"]
        assert stats["step"] == "fused" and merged["unmerged"] + merged["quantized"] == 2 * 4
        # int4 in the tile layout (CUDA's default) on resident bytes: q|k|v and gate|up merged
        tiles = device != "cpu" and store.name == "int4_symmetric"
        fixed = 4 - (len(model.flash.stream.layers) if streamed else 0)
        assert merged["quantized"] == (2 * fixed if tiles else 0)
        assert stats["mode"] == ("eager" if device == "cpu" else "graphs"), stats["eager_reason"]
        assert stats["fallback_calls"] == 0
        if device != "cpu":
            assert stats["replays"] == STEPS - 1
        model.flash.close()


@pytest.fixture(scope="module")
def tiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode-tiles")
    src = make_tiny_model(root / "src", "qwen2", dtype="bfloat16", hidden_size=128, intermediate_size=256,
                          num_heads=4, num_kv_heads=2, num_layers=3, seed=7)
    return pack(src, root / "int4", quant=QuantSpec("int4_symmetric", "per_block", 128), quant_device="cpu")


def _decoded(store, device, merge, monkeypatch, steps=16):
    """(tokens, decoder stats) of a tile-layout int4 model (qwen2: q/k/v biases), its q|k|v and
    gate|up merged or (``merge`` False) each run alone. Merged: each merged group's outputs at 1
    and 2 rows are checked bit for bit against its projections run alone, while the model is open."""
    from deepseek_flash.decode import fused

    if not merge:
        monkeypatch.setattr(fused, "MERGE_QUANTIZED", False)
    ids, mask = left_padded(2, 6, device, seed=2)
    config = {**CONFIG, "int4_layout": "cuda_tiles"}
    with Client(embedded=True, config=config) as client:
        model = load_model(store, device=device, client=client, decode="graphs")
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, pad_token_id=0)
        stats = model.flash.decoder.stats()
        g = torch.Generator().manual_seed(3)
        for layer in model.flash.decoder.fused.layers if merge else ():
            for group in (layer.qkv, layer.gate_up):
                assert group.quant.codes.data_ptr() == group.modules[0].codes.data_ptr()
                for rows in (1, 2):
                    x = torch.randn(rows, 1, 128, generator=g).to(device=device, dtype=torch.bfloat16)
                    got = group(x)
                    for part, module in zip(got, group.modules):
                        assert torch.equal(part, module(x))
        model.flash.close()
    monkeypatch.undo()
    return tokens, stats


@pytest.mark.parametrize("device", DEVICES)
def test_tiled_int4_projections_merge_into_one_gemv_with_the_same_outputs(tiled, device, monkeypatch):
    """q|k|v and gate|up of the tile layout: one QuantLinear each over a view of the codes the
    host tier lays back to back (no codes copied), each output bit for bit what its projection
    alone gives (each column is the same arithmetic), so the same tokens."""
    tokens, stats = _decoded(tiled, device, True, monkeypatch)
    merged = stats["merged"]
    assert merged["quantized"] == 2 * 3 and merged["copies"] == 0 and merged["copy_bytes"] == 0
    # new bytes: the scales of q|k|v (128 + 2 * 64 rows) and gate|up (2 * 256 rows), one group of
    # 128 = 4 bytes a row, and the q|k|v biases (2 bytes a row)
    assert merged["quant_copy_bytes"] == 3 * ((256 + 512) * 4 + 256 * 2)
    assert merged["unmerged"] == 0 and stats["fallback_calls"] == 0
    want_tokens, alone = _decoded(tiled, device, False, monkeypatch)
    assert alone["merged"]["quantized"] == 0 and alone["merged"]["unmerged"] == 2 * 3
    assert torch.equal(tokens, want_tokens)
    if device != "cpu":
        assert stats["mode"] == "graphs" and stats["replays"] == alone["replays"] > 0


def test_the_step_takes_silu_of_gate_up_from_the_merged_gemv_where_glu_answers(tiled, monkeypatch):
    """``cuda_gemv.glu`` (the gate|up GEMV with silu_mul in its epilogue; CUDA only) wired into the
    fused step: where it answers, its output is the down GEMV's input and no silu_mul runs. A
    stand-in with the unfused arithmetic gives the unfused step's tokens."""
    from deepseek_flash.decode import fused, kernels

    want, _ = _decoded(tiled, "cpu", True, monkeypatch)
    calls = []

    def stand_in(gate_up, x):
        calls.append(gate_up.out_features)
        gate, up = gate_up(x).split(gate_up.out_features // 2, dim=-1)
        return kernels._ref_silu_mul(gate, up)

    def no_silu_mul(gate, up):
        raise AssertionError("silu_mul ran beside glu")

    monkeypatch.setattr(fused, "glu", stand_in)
    monkeypatch.setattr(kernels, "silu_mul", no_silu_mul)
    tokens, stats = _decoded(tiled, "cpu", True, monkeypatch)
    assert torch.equal(tokens, want) and calls and set(calls) == {512}


def test_the_step_takes_the_residual_add_and_norm_into_the_gemv_where_norm_gemv_answers(tiled, monkeypatch):
    """``cuda_gemv.norm_gemv`` (the residual add + RMSNorm staged inside the q|k|v and gate|up
    GEMVs; CUDA only) wired into the fused step: where it answers, no add_rms_norm runs before that
    GEMV (only the first layer's, with no sub-block output yet, and the final norm), and the new
    residual it returns carries on. A stand-in with the unfused arithmetic gives the same tokens."""
    from deepseek_flash.decode import fused, kernels

    want, _ = _decoded(tiled, "cpu", True, monkeypatch)
    calls, norms = [], []

    def stand_in(layer, x, residual, weight, eps, glu=False):
        calls.append(layer.out_features)
        new = residual.clone()
        y = layer(kernels._ref_add_rms_norm(x, new, weight, eps))
        return (kernels._ref_silu_mul(*y.split(layer.out_features // 2, dim=-1)) if glu else y), new

    real = kernels.add_rms_norm

    def counted(x, residual, weight, eps):
        norms.append(x is None)
        return real(x, residual, weight, eps)

    monkeypatch.setattr(fused, "norm_gemv", stand_in)
    monkeypatch.setattr(kernels, "add_rms_norm", counted)
    tokens, _ = _decoded(tiled, "cpu", True, monkeypatch)
    assert torch.equal(tokens, want)
    steps = len(norms) // 2
    assert set(calls) == {256, 512} and calls.count(512) == calls.count(256) + steps
    assert norms.count(True) == steps and len(norms) == 2 * steps   # layer 0's in-norm and the final one
