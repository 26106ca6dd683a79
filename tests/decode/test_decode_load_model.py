"""load_model(..., decode="graphs"): the loaded model's generate() decodes over the static cache
(captured on CUDA) with transformers' tokens; a bad mode is a typed error before any attach."""
import logging

import pytest
import torch
from decode_models import DEVICES, left_padded

from deepseek_flash.client import Client
from deepseek_flash.client.model import load_model, resolve_decode_mode
from deepseek_flash.errors import ConfigError
from deepseek_flash.store import pack
from deepseek_flash.testing import load_reference, make_tiny_model

CONFIG = {"host_cache_bytes": "64MiB", "unified_memory_ratio": 0.05}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode-load")
    src = make_tiny_model(root / "src", "qwen2", num_layers=3, seed=7)
    return src, pack(src, root / "store")


@pytest.mark.parametrize("device", DEVICES)
def test_graph_decode_of_a_loaded_model(store, device):
    src, path = store
    ref = load_reference(src, device=device)
    ids, mask = left_padded(2, 8, device)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=0)
    with Client(embedded=True, config=CONFIG) as client:
        model = load_model(path, device=device, client=client, decode="graphs", decode_capacity=128)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want)
        stats = model.flash.decoder.stats()
        assert stats["capacity"] == 128 and stats["generate_calls"] == 1
        assert stats["mode"] == ("eager" if device == "cpu" else "graphs")
        model.flash.close()


def test_eager_is_the_default_and_a_bad_mode_is_refused(store):
    _, path = store
    with Client(embedded=True, config=CONFIG) as client:
        model = load_model(path, client=client)
        assert model.flash.decoder is None and "generate" not in vars(model)
        model.flash.close()
        with pytest.raises(ConfigError) as err:
            load_model(path, client=client, decode="fast")
        assert err.value.key == "decode" and err.value.allowed == ["eager", "graphs", "auto"]

def test_auto_on_the_cpu_and_with_a_device_map_is_eager_with_the_reason(store, caplog):
    _, path = store
    with Client(embedded=True, config=CONFIG) as client, \
            caplog.at_level(logging.INFO, logger="deepseek_flash.model"):
        cpu = load_model(path, client=client, decode="auto")      # auto: graphs on CUDA only
        assert cpu.flash.decoder is None and "generate" not in vars(cpu)
        cpu.flash.close()
        assert any("decode='auto' runs transformers' generate on cpu" in r.getMessage()
                   for r in caplog.records)
        split = load_model(path, client=client, decode="auto", device_map={"devices": ["cpu"]})
        assert "generate" not in vars(split) and not hasattr(split, "flash_decoder")
        split.flash.close()
        assert any("split over devices (device_map)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mode, kw, want, words", [
    ("auto", {}, "graphs", None),
    ("auto", {"split": True}, "eager", "device_map"),
    ("auto", {"tensor_parallel": True}, "eager", "tensor_parallel"),
    ("graphs", {"tensor_parallel": True}, "graphs", None),      # asked for: the engine decides
    ("eager", {}, "eager", None),
])
def test_what_auto_resolves_to_on_a_cuda_device(mode, kw, want, words):
    # Pure: a torch.device needs no GPU.
    got, reason = resolve_decode_mode(mode, torch.device("cuda:0"), **kw)
    assert got == want
    assert (reason is None) if words is None else (words in reason)
    assert resolve_decode_mode("auto", torch.device("cpu")) == (
        "eager", "decode='auto' runs transformers' generate on cpu: CUDA graphs need a CUDA device")
    with pytest.raises(ConfigError):
        resolve_decode_mode("fast", torch.device("cuda:0"))


@pytest.mark.parametrize("unit, spread", [("layer", False), ("projection", False), ("projection", True)],
                         ids=["layer", "projection", "projection-spread"])
@pytest.mark.parametrize("device", DEVICES)
def test_streamed_model_runs_the_slot_ring_inside_the_step(store, device, unit, spread):
    """Under the minimum budget the MLPs of a tail of layers stream through slots; the decode
    steps run the ring as a fixed schedule (captured on CUDA) and give transformers' tokens, and
    a later generate() -- whose prefill runs the ring through its hooks again -- does too.
    ``spread``: one MLP more in the budget, a two-slot ring: the resident MLP sits between the
    streamed layers (0 and 2 stream, 1 stays), the step skipping it in the ring's schedule."""
    from deepseek_flash.daemon.planner import resident_minimum
    from deepseek_flash.fsutil import align_up
    from deepseek_flash.store import Store
    from deepseek_flash.wire import SLOT_ALIGNMENT, STREAM_ROLES

    src, path = store
    ref = load_reference(src, device=device)
    ids, mask = left_padded(2, 8, device)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    ids2, mask2 = left_padded(1, 5, device, seed=3)
    want2 = ref.generate(ids2, attention_mask=mask2, max_new_tokens=40, do_sample=False, pad_token_id=0)
    blocks = Store.open(path).blocks
    budget = resident_minimum(blocks, unit)
    context = {"stream_unit": unit}
    if spread:
        budget += sum(align_up(b.length, SLOT_ALIGNMENT) for b in blocks
                      if b.layer == 1 and b.role in STREAM_ROLES)
        context["prefetch_window"] = 1
    with Client(embedded=True, config=CONFIG) as client:
        model = load_model(path, device=device, client=client, weight_budget=budget, decode="graphs",
                           flash_context=context)
        runtime = model.flash.stream
        assert runtime is not None and runtime.n < runtime.m          # fewer slots than units
        assert runtime.layers == ([0, 2] if spread else [0, 1, 2])
        assert runtime.m == len(runtime.layers) * (3 if unit == "projection" else 1)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want)
        stats = model.flash.decoder.stats()
        assert stats["step"] == "fused" and stats["ring"]["static_steps"] == 23
        assert stats["mode"] == ("eager" if device == "cpu" else "graphs")
        streamed = runtime.stats()["bytes_streamed"]
        got2 = model.generate(ids2, attention_mask=mask2, max_new_tokens=40, do_sample=False,
                              pad_token_id=0)
        assert torch.equal(got2, want2)
        # 39 static steps plus one pass through the hooks (the prefill), every layer's bytes each,
        # and the hooks' prefetch of the next pass's first layers (less than a pass)
        moved = runtime.stats()["bytes_streamed"] - streamed
        assert 40 * stats["ring"]["step_bytes"] <= moved < 41 * stats["ring"]["step_bytes"]
        model.flash.close()


@pytest.mark.parametrize("unit", ["layer", "projection"])
def test_static_ring_schedule_is_the_same_every_step(store, unit):
    """The copies of a step: the first n units at its start, then unit idx + n after unit idx,
    each into slot idx % n -- the same list at every step (what a graph replays)."""
    from deepseek_flash.daemon.planner import resident_minimum
    from deepseek_flash.store import Store

    _, path = store
    budget = resident_minimum(Store.open(path).blocks, unit)
    with Client(embedded=True, config=CONFIG) as client:
        model = load_model(path, client=client, weight_budget=budget, decode="graphs",
                           flash_context={"stream_unit": unit})
        ring = model.flash.decoder.ring
        ids, mask = left_padded(1, 6)
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
        first = list(ring.copies)
        model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert ring.copies == first
        units = model.flash.stream.units
        assert len(units) == len(model.flash.stream.layers) * (3 if unit == "projection" else 1)
        assert first == [(layer, idx % ring.n) for idx, (layer, _) in enumerate(units)]
        model.flash.close()
