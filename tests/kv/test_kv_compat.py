"""The keyword a cache reaches the model under differs between transformers versions (``cache``
vs ``past_key_values``); a TieredCache under a keyword the model's forward does not take would
be ignored by transformers (the model builds a cache of its own and the tiered one stays empty:
stats of 0 bytes). It is refused instead, and ``cache_kwargs`` gives the right keyword."""
import pytest
import torch
import transformers

from deepseek_flash.errors import KVCacheBypassed, KVUnsupported
from deepseek_flash.kv import TieredCache, cache_keyword, cache_kwargs, compat

from kvmodels import tiny_model

T = 70


def _expected_full_bytes(model, tokens):
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return tokens * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4  # fp32


def test_cache_kwargs_fills_the_cache_exactly():
    model = tiny_model("llama", seed=1)
    cache = TieredCache.for_model(model, gpu_tokens=16, page_tokens=16)
    ids = torch.randint(1, 256, (1, T))
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))
        model(ids[:, :1], **cache_kwargs(model, cache))
    s = cache.stats()
    assert s["tokens"] == T + 1
    assert s["full_bytes"] == _expected_full_bytes(model, T + 1) > 0
    assert s["pages"] == 2 * 3  # 2 layers x 3 pages of 16 past 4 sinks and 16+ recent tokens
    assert s["host_bytes"] >= s["pages"] * s["page_bytes"] > 0


@pytest.mark.parametrize("keyword", ["cache", "past_key_values", "kv_cache"])
def test_a_cache_under_any_keyword_is_used_or_refused_never_ignored(keyword):
    model = tiny_model("llama", seed=1)
    cache = TieredCache.for_model(model, gpu_tokens=16, page_tokens=16)
    ids = torch.randint(1, 256, (1, T))
    try:
        with torch.no_grad():
            model(ids, **{keyword: cache})
    except KVCacheBypassed as exc:
        assert exc.code == 705
        assert exc.keyword == keyword and exc.expected == cache_keyword(model)
        assert f"{exc.expected}=cache" in str(exc) and transformers.__version__ in str(exc)
        assert cache.stats()["tokens"] == 0
        return
    assert keyword != "kv_cache"  # no transformers takes this one
    assert cache.stats()["full_bytes"] == _expected_full_bytes(model, T)


def test_cache_keyword_follows_the_forward_signature():
    class Old(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return super().forward(input_ids, **kwargs)

    class New(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, cache=None, **kwargs):
            return super().forward(input_ids, **kwargs)

    class Wrapped(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    cfg = tiny_model("llama").config
    assert cache_keyword(Old(cfg)) == "past_key_values"
    assert cache_keyword(New(cfg)) == "cache"
    decoder = transformers.LlamaModel.forward
    import inspect
    want = "cache" if "cache" in inspect.signature(decoder).parameters else "past_key_values"
    assert cache_keyword(Wrapped(cfg)) == want


def test_a_transformers_older_than_the_floor_is_refused_by_name(monkeypatch):
    model = tiny_model("llama", seed=1)
    monkeypatch.setattr(compat, "transformers_version_text", lambda: "5.5.4")
    with pytest.raises(KVUnsupported, match=r"transformers 5\.5\.4 is older .*\(5\.10 or newer\)"):
        TieredCache.for_model(model)
