"""A quantized store through load_model: QuantLinear swapped in at bind time, logits equal to plain
transformers running the dequantized weights (CPU), resident == streamed bit-exact, embedded and
daemon; on CUDA (marked gpu) the fused kernel against a float32 reference."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from flashd_harness import Daemon

from deepseek_flash.client import Client
from deepseek_flash.client.model import load_model
from deepseek_flash.daemon.planner import resident_minimum
from deepseek_flash.quant import QuantSpec
from deepseek_flash.quant.linear import QuantLinear
from deepseek_flash.store import Store, pack
from deepseek_flash.testing import assert_same_outputs, load_reference, make_tiny_model

CUDA = torch.cuda.is_available()
CONFIG = {"host_cache_bytes": "64MiB", "unified_memory_ratio": 0.05}
SPECS = {"int4-g32": QuantSpec("int4_symmetric", "per_block", 32),
         "int8-tensor": QuantSpec("int8_symmetric", "per_tensor")}
CASES = [("llama", "bfloat16", "int4-g32"), ("qwen2", "float16", "int8-tensor"),
         ("mistral", "float32", "int4-g32")]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-runtime")
    out = {}
    for arch, dtype, scheme in CASES:
        src = make_tiny_model(root / f"{arch}-src", arch, dtype=dtype, num_layers=4, seed=len(out))
        out[(arch, dtype, scheme)] = (src, pack(src, root / f"{arch}-{scheme}", quant=SPECS[scheme],
                                                quant_device="cpu"))
    return out


def dequantized_reference(src, store, device="cpu"):
    """Plain transformers with every quantized weight replaced by its dequantized value."""
    ref = load_reference(src, device=device)
    s = Store.open(store)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            _block, t = s.find(name)
            if t.quant:
                param.copy_(s.tensor(name).to(device))
    return ref


def inputs(batch: int, device="cpu"):
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, 256, (batch, 6), generator=g).to(device)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_embedded_resident_equals_transformers_on_dequantized_weights(stores, case):
    src, store = stores[case]
    ref = dequantized_reference(src, store)
    with Client(embedded=True, config=CONFIG) as client:
        model = load_model(store, device="cpu", client=client)
        layer = model.model.layers[0]
        for proj in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
            assert isinstance(proj, QuantLinear) and proj.spec == SPECS[case[2]]
        assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == getattr(torch, case[1])
        if case[0] == "qwen2":
            assert layer.self_attn.q_proj.bias is not None
        for batch in (1, 3):
            assert_same_outputs(model, ref, inputs(batch))
        model.flash.close()


@pytest.mark.parametrize("mode", ["embedded", "daemon"])
def test_streamed_equals_resident_bit_exact(stores, mode, tmp_path):
    src, store = stores[("llama", "bfloat16", "int4-g32")]
    budget = resident_minimum(Store.open(store).blocks)
    ids = inputs(2)
    daemon = Daemon(tmp_path / "d", CONFIG).start() if mode == "daemon" else None
    try:
        client = Client(daemon.socket, embedded=False) if daemon else Client(embedded=True, config=CONFIG)
        with client:
            resident = load_model(store, device="cpu", client=client)
            streamed = load_model(store, device="cpu", client=client, weight_budget=budget)
            assert streamed.flash.stream is not None and streamed.flash.stream.m == 4
            with torch.no_grad():
                want = resident(ids).logits
                for _ in range(2):
                    assert torch.equal(streamed(ids).logits, want)
            mask = torch.ones_like(ids)
            assert torch.equal(
                streamed.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False),
                resident.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
            streamed.flash.close()
            resident.flash.close()
    finally:
        if daemon is not None:
            assert daemon.stop() == 0
            daemon.cleanup()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_cuda_kernel_against_float32_reference_and_streamed_bit_exact(stores, case):
    src, store = stores[case]
    ref = dequantized_reference(src, store, "cuda:0").float()
    with Client(embedded=True, config=CONFIG) as client:
        model = load_model(store, device="cuda:0", client=client)
        budget = resident_minimum(Store.open(store).blocks)
        streamed = load_model(store, device="cuda:0", client=client, weight_budget=budget)
        ids = inputs(3, "cuda:0")
        with torch.no_grad():
            got = model(ids).logits
            want = ref(ids).logits
            rel = ((got.float() - want).abs().max() / want.abs().max()).item()
            assert rel < {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}[got.dtype]
            for _ in range(2):
                assert torch.equal(streamed(ids).logits, got)
        mask = torch.ones_like(ids[:1])
        a = model.generate(ids[:1], attention_mask=mask, max_new_tokens=32, do_sample=False)
        b = ref.generate(ids[:1], attention_mask=mask, max_new_tokens=32, do_sample=False)
        assert torch.equal(a, b), "greedy tokens differ from the float32 reference"
        streamed.flash.close()
        model.flash.close()


def test_config_keys_checked_and_quantization_in_the_model_listing(stores):
    from deepseek_flash.errors import ConfigError

    src, store = stores[("llama", "bfloat16", "int4-g32")]
    with Client(embedded=True, config=CONFIG) as client:
        with pytest.raises(ConfigError, match="packed int4_symmetric per_block g32, but the "
                                              "configuration asks for quantization_scheme "
                                              "'int8_symmetric'"):
            client.open_model(store, {"quantization_scheme": "int8_symmetric"})
        model = load_model(store, device="cpu", client=client,
                           flash_context={"quantization_scheme": "int4_symmetric"})
        (entry,) = client.list_models()
        assert (entry["quantization_scheme"], entry["quantization_granularity"],
                entry["quantization_group_size"]) == ("int4_symmetric", "per_block", 32)
        assert entry["total_bytes"] == Store.open(store).total_bytes
        model.flash.close()
    plain = Path(str(store).replace("llama-int4-g32", "plain"))
    with Client(embedded=True, config={**CONFIG, "quantization_scheme": "int4_symmetric"}) as client:
        with pytest.raises(ConfigError, match="packed unquantized"):
            client.open_model(pack(src, plain))
