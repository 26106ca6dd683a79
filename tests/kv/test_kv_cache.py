"""TieredCache in lossless mode: the same greedy tokens and logits as DynamicCache, with most of
the KV in host pages; a cache given to another model; bad arguments."""
import pytest
import torch

from deepseek_flash.errors import ConfigError, KVCacheMismatch, KVError
from deepseek_flash.kv import TieredCache, cache_kwargs

from kvmodels import greedy, reference, tiny_model

PROMPT, STEPS = 1500, 64


def _prompt(batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (batch, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding of different lengths, as a tokenizer makes for a batch
        mask[1, :37] = 0
        mask[2, :200] = 0
    return ids, mask


@pytest.mark.parametrize("batch", [1, 3])
def test_lossless_matches_dynamic_cache(llama, batch):
    ids, mask = _prompt(batch)
    want_tokens, want_logits = reference(llama, ids, mask, STEPS)
    cache = TieredCache.for_model(llama, gpu_tokens=64, sink_tokens=4, page_tokens=32)
    tokens, logits = greedy(llama, ids, mask, cache, STEPS)
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() <= 1e-4
    s = cache.stats()
    total = PROMPT + STEPS - 1
    assert s["tokens"] == total and s["batch"] == batch
    # pages hold all but the sinks and 64..95 recent tokens; the device holds the rest
    pages = (total - 4 - 64) // 32
    assert s["pages"] == pages * batch * 2
    token_bytes = 2 * 2 * 16 * 4  # K+V, 2 kv heads, head_dim 16, fp32
    assert s["full_bytes"] == total * batch * token_bytes * 2
    recent = total - 4 - pages * 32
    summaries = 2 * pages * 2 * 16 * 4 * batch  # min and max per page, head and channel
    assert s["gpu_bytes"] == 2 * ((4 + recent) * batch * token_bytes + summaries)
    assert s["host_bytes"] >= pages * batch * 32 * token_bytes * 2
    assert s["spilled_bytes"] == 0
    assert s["pages_fetched"] > 0


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_lossless_other_architectures(arch):
    model = tiny_model(arch, seed=3)
    ids, mask = torch.randint(1, 256, (1, 300)), None
    want_tokens, want_logits = reference(model, ids, mask, 8)
    cache = TieredCache.for_model(model, gpu_tokens=16, page_tokens=16, sink_tokens=2)
    tokens, logits = greedy(model, ids, mask, cache, 8)
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() <= 1e-4
    assert cache.stats()["pages"] > 0


def test_dynamic_cache_still_exact_after_install(llama):
    """The tiered attention function computes a plain cache's attention as sdpa does."""
    ids, mask = _prompt(3, seed=5)
    ids, mask = ids[:, :200], mask[:, :200]
    mask[2, :150] = 0
    model = tiny_model("llama", seed=7)
    want_tokens, want_logits = reference(model, ids, mask, 6)
    TieredCache.for_model(model)
    tokens, logits = reference(model, ids, mask, 6)
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() <= 1e-5


def test_cache_given_to_another_model_is_refused():
    a, b = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    ids = torch.randint(1, 256, (1, 40))
    cache = TieredCache.for_model(a, gpu_tokens=8, page_tokens=16)
    TieredCache.for_model(b)
    with torch.no_grad(), pytest.raises(KVCacheMismatch, match="another model"):
        b(ids, **cache_kwargs(b, cache))
    # a model never set up: its sdpa attention leaves the keys unconsumed
    plain = tiny_model("llama", seed=3)
    cache2 = TieredCache.for_model(a, gpu_tokens=8, page_tokens=16)
    with torch.no_grad(), pytest.raises(KVCacheMismatch, match="did not set up"):
        plain(ids, **cache_kwargs(plain, cache2))
    with torch.no_grad(), pytest.raises(KVError, match="unusable"):
        a(ids, **cache_kwargs(a, cache2))
    # other geometry
    wide = tiny_model("llama", seed=4, num_kv_heads=4)
    cache3 = TieredCache.for_model(a)
    TieredCache.for_model(wide)
    with torch.no_grad(), pytest.raises(KVCacheMismatch, match="4 heads"):
        wide(ids, **cache_kwargs(wide, cache3))


@pytest.mark.parametrize("kwargs,key", [
    (dict(gpu_tokens=-1), "gpu_tokens"),
    (dict(sink_tokens=1.5), "sink_tokens"),
    (dict(page_tokens=48), "page_tokens"),
    (dict(top_k_pages=0), "top_k_pages"),
    (dict(top_k_pages=1.5), "top_k_pages"),
    (dict(host_bytes=1 << 20), "host_bytes"),
    (dict(score="max"), "score"),
    (dict(error_recovery_mode="lenient"), "error_recovery_mode"),
])
def test_bad_arguments_name_the_key(llama, kwargs, key):
    with pytest.raises(ConfigError) as info:
        TieredCache.for_model(llama, **kwargs)
    assert info.value.key == key


def test_load_model_flash_config_sets_the_defaults(llama):
    """A load_model model carries its effective flash_config (flash.json, the model's
    flash_config, the open's flash_context) in model.flash.info; its kv_* keys are the defaults."""
    from types import SimpleNamespace

    llama.flash = SimpleNamespace(info=SimpleNamespace(flash_config={
        "prefetch_window": 2, "kv_gpu_tokens": 128, "kv_sink_tokens": 8, "kv_page_tokens": 16,
        "kv_top_k_pages": 0.25, "kv_host_bytes": None, "kv_spill_dir": None}))
    try:
        cache = TieredCache.for_model(llama)
        assert (cache.gpu_tokens, cache.sink_tokens, cache.page_tokens, cache.top_k_pages) == \
            (128, 8, 16, 0.25)
        cache = TieredCache.for_model(llama, gpu_tokens=64, top_k_pages=3)
        assert (cache.gpu_tokens, cache.sink_tokens, cache.top_k_pages) == (64, 8, 3)
        llama.flash.info.flash_config["kv_host_bytes"] = 1 << 20
        with pytest.raises(ConfigError) as info:  # a host budget needs a spill directory
            TieredCache.for_model(llama)
        assert info.value.key == "host_bytes"
    finally:
        del llama.flash


def test_chunk_copies_fall_back_when_foreach_copy_is_refused(monkeypatch):
    # fetch_all copies every host chunk in one _foreach_copy_; where torch refuses it the chunks
    # are copied one call each, with the same result
    import deepseek_flash.kv.pages as pages

    src = [torch.arange(6.0).view(3, 2), torch.arange(4.0).view(2, 2) + 10]
    want = torch.cat(src)

    def refuse(*args, **kwargs):
        raise RuntimeError("refused")

    monkeypatch.setattr(pages, "_FOREACH", [True])
    monkeypatch.setattr(torch, "_foreach_copy_", refuse)
    out = torch.zeros(5, 2)
    pages._copy_all(out.split([3, 2]), src, False)
    assert torch.equal(out, want) and pages._FOREACH == [False]
    out.zero_()
    pages._copy_all(out.split([3, 2]), src, False)  # refused once: not tried again
    assert torch.equal(out, want)
