"""A load_model model (embedded controller) with kv_* keys in its flash_context: TieredCache takes
them as defaults and decodes exactly as DynamicCache on the reference model."""
import pytest
import torch

from deepseek_flash.client.model import load_model
from deepseek_flash.errors import ConfigError
from deepseek_flash.kv import TieredCache
from deepseek_flash.store import pack
from deepseek_flash.testing import load_reference, make_tiny_model

from kvmodels import greedy, reference

CONFIG = {"host_cache_bytes": "64MiB"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-load-model")
    src = make_tiny_model(root / "src", "llama", num_layers=2, seed=5)
    return src, pack(src, root / "store")


def test_flash_context_kv_keys_reach_the_cache(store):
    src, packed = store
    ids = torch.randint(1, 256, (2, 300), generator=torch.Generator().manual_seed(3))
    ref = load_reference(src)
    want_tokens, want_logits = reference(ref, ids, None, 8)
    model = load_model(packed, embedded=True, config=CONFIG,
                       flash_context={"kv_gpu_tokens": 32, "kv_page_tokens": 16})
    try:
        cache = TieredCache.for_model(model)
        assert (cache.gpu_tokens, cache.page_tokens_setting) == (32, 16)
        tokens, logits = greedy(model, ids, None, cache, 8)
        assert torch.equal(tokens, want_tokens)
        assert (logits - want_logits).abs().max().item() <= 1e-4
        assert cache.stats()["pages"] == 2 * 2 * ((300 + 7 - 4 - 32) // 16)
    finally:
        model.flash.close()


def test_bad_kv_key_in_flash_context_is_refused_at_open(store):
    _, packed = store
    with pytest.raises(ConfigError) as info:
        load_model(packed, embedded=True, config=CONFIG,
                   flash_context={"kv_top_k_pages": 2.5})
    assert info.value.key == "kv_top_k_pages"


def test_flash_context_prune_threshold_reaches_the_cache(store):
    src, packed = store
    ids = torch.randint(1, 256, (1, 200), generator=torch.Generator().manual_seed(4))
    model = load_model(packed, embedded=True, config=CONFIG,
                       flash_context={"kv_prune_threshold": 0.0, "kv_page_tokens": 16})
    try:
        assert model.flash.info.flash_config["kv_prune_threshold"] == 0.0
        cache = TieredCache.for_model(model)
        # pruning on: the recent window defaults to 64 tokens; threshold 0 keeps every page on
        # the device, so the decode is DynamicCache's
        assert (cache.prune.threshold, cache.gpu_tokens) == (0.0, 64)
        want_tokens, want_logits = reference(load_reference(src), ids, None, 6)
        tokens, logits = greedy(model, ids, None, cache, 6)
        assert torch.equal(tokens, want_tokens)
        assert (logits - want_logits).abs().max().item() <= 1e-4
        s = cache.stats()
        assert s["level_tokens"][0] == [205, 0, 0]
        # no page on the host: it holds the pruning scorer's key and value norms alone
        assert s["host_bytes"] == sum(x.prune.stats.host_nbytes() for x in cache.layers) > 0
        off = TieredCache.for_model(model, gpu_tokens=128)  # an explicit argument still wins
        assert off.gpu_tokens == 128 and off.prune is not None
    finally:
        model.flash.close()
    with pytest.raises(ConfigError) as info:
        load_model(packed, embedded=True, config=CONFIG, flash_context={"kv_prune_threshold": 2})
    assert info.value.key == "kv_prune_threshold"
