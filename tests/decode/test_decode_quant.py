"""Quantized stores (int4 and int8) with decode="graphs": the step runs each QuantLinear as its
module (unmerged), resident and streamed, with the tokens of transformers' generate() over the same
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
        assert stats["step"] == "fused" and stats["merged"]["unmerged"] > 0
        assert stats["mode"] == ("eager" if device == "cpu" else "graphs"), stats["eager_reason"]
        assert stats["fallback_calls"] == 0
        if device != "cpu":
            assert stats["replays"] == STEPS - 1
        model.flash.close()
