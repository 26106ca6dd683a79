"""load_model(..., decode="graphs"): the loaded model's generate() decodes over the static cache
(captured on CUDA) with transformers' tokens; a bad mode is a typed error before any attach."""
import pytest
import torch
from decode_models import DEVICES, left_padded

from deepseek_flash.client import Client
from deepseek_flash.client.model import load_model
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
        assert err.value.key == "decode" and err.value.allowed == ["eager", "graphs"]


def test_streamed_model_decodes_eagerly_over_the_static_cache_and_says_why(store, caplog):
    import logging

    from deepseek_flash.daemon.planner import resident_minimum
    from deepseek_flash.decode.engine import STREAMED_REASON
    from deepseek_flash.store import Store

    src, path = store
    ref = load_reference(src)
    ids, mask = left_padded(2, 8)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    budget = resident_minimum(Store.open(path).blocks)
    with Client(embedded=True, config=CONFIG) as client, \
            caplog.at_level(logging.WARNING, logger="deepseek_flash.decode"):
        model = load_model(path, client=client, weight_budget=budget, decode="graphs")
        assert model.flash.stream is not None
        got = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want)
        assert model.flash.decoder.eager_reason == STREAMED_REASON
        assert model.flash.decoder.stats()["eager_steps"] == 23
        assert any(STREAMED_REASON in r.getMessage() for r in caplog.records)
        model.flash.close()
