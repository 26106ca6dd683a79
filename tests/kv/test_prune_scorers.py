"""Scorers of KV pruning and the two eviction baselines of its bench."""
import math

import pytest
import torch
from transformers import DynamicCache

from deepseek_flash.kv.prune import EvictingCache, MLPScorer, ScoreInput, attention_scorer, resolve_scorer
from deepseek_flash.kv.prune.scorers import TokenStats, attention_probs, features

from kvmodels import tiny_model


def _input(mass, observed=None, knorm=None):
    b, n = mass.shape
    observed = torch.ones_like(mass) if observed is None else observed
    knorm = torch.ones(b, 2, n) if knorm is None else knorm
    return ScoreInput(0, 2, mass, mass, observed, knorm, torch.ones(b, 2, n),
                      torch.arange(n), n + 10)


def test_attention_scorer_maps_relative_share_to_0_1():
    mass = torch.tensor([[0.0, 0.99, 1.01, 17 / 3, 97.0]])
    s = attention_scorer(_input(mass))  # equal key norms: z = 0
    # x / (17/3 + x): the uniform share (1.0) scores the default threshold 0.15, 17/3 of it 0.5
    h = 17 / 3
    assert s[0].tolist() == pytest.approx([0.0, 0.99 / (h + 0.99), 1.01 / (h + 1.01), 0.5,
                                           97 / (h + 97)])
    assert attention_scorer(_input(torch.ones(1, 1)))[0].item() == pytest.approx(0.15)
    # below the default threshold 0.15 exactly when the share is below the uniform share
    assert (s[0] < 0.15).tolist() == [True, True, False, False, False]
    # never observed: 0.5 (kept)
    s = attention_scorer(_input(torch.zeros(1, 3), observed=torch.tensor([[0.0, 1.0, 0.0]])))
    assert s[0].tolist() == [0.5, 0.0, 0.5]
    # a larger key norm lowers the score: exp(-0.2 * z)
    kn = torch.tensor([[[1.0, 3.0]] * 2])
    s = attention_scorer(_input(torch.ones(1, 2), knorm=kn))
    z = 1 / math.sqrt(2)  # z-scores of [1, 3] with the unbiased std
    want = [math.exp(0.2 * z) / (h + math.exp(0.2 * z)), math.exp(-0.2 * z) / (h + math.exp(-0.2 * z))]
    assert s[0].tolist() == pytest.approx(want, rel=1e-5)


def test_token_stats_average_the_share_relative_to_uniform():
    st = TokenStats(window=4)
    st.append(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    st.observe(torch.tensor([[0.5, 0.25, 0.25]]), None)       # first: taken as is (x3)
    assert st.mass.tolist() == [[1.5, 0.75, 0.75]]
    st.observe(torch.tensor([[1.0]]), torch.tensor([[2]]))     # slot 2 alone: share 1 of 1
    assert st.mass[0].tolist() == pytest.approx([1.5, 0.75, 0.75 + 0.25 * (1.0 - 0.75)])
    assert st.observed.tolist() == [[1, 1, 2]]
    assert st.knorm[0, 0].tolist() == pytest.approx([math.sqrt(2)] * 3)


def test_token_stats_grow_by_chunks_and_keep_what_they_hold():
    from deepseek_flash.kv.prune.scorers import STATS_CHUNK

    torch.manual_seed(0)
    st = TokenStats(window=4)
    keys = torch.randn(2, 3, 70, 8)
    vals = torch.randn(2, 3, 70, 8)
    st.append(keys[:, :, :60], vals[:, :, :60])
    st.observe(torch.full((2, 60), 1 / 60), None)
    assert st.capacity == STATS_CHUNK == 64
    # 3 floats per token and sequence on the device, 2 norms per head on the host
    assert st.nbytes() == 2 * 64 * 3 * 4 and st.host_nbytes() == 2 * 64 * 2 * 3 * 4
    for t in range(60, 70):  # decode: in place until the chunk is full, then one more chunk
        st.append(keys[:, :, t:t + 1], vals[:, :, t:t + 1])
    assert st.capacity == 128
    assert st.nbytes() == 2 * 128 * 3 * 4 and st.host_nbytes() == 2 * 128 * 2 * 3 * 4
    assert torch.equal(st.knorm, keys.float().norm(dim=-1))
    assert torch.equal(st.vnorm, vals.float().norm(dim=-1))
    assert st.mass[:, :60].eq(1.0).all() and st.mass[:, 60:].eq(0).all()
    assert st.observed.tolist() == [[1.0] * 60 + [0.0] * 10] * 2


def test_attention_probs_are_the_softmax_shares():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 3, 8)   # 4 query heads over 2 kv heads, 3 queries
    k = torch.randn(2, 2, 5, 8)
    got = attention_probs(q, k, 0.3, causal_offset=2)
    ref = torch.zeros(2, 5)
    for b in range(2):
        for hq in range(4):
            for i in range(3):
                w = (q[b, hq, i] @ k[b, hq // 2].T * 0.3)[:3 + i].softmax(-1)
                ref[b, :3 + i] += w / 12
    assert torch.allclose(got, ref, atol=1e-6)
    assert torch.allclose(got.sum(-1), torch.ones(2))


def test_mlp_scorer_saves_loads_and_checks_heads(tmp_path):
    torch.manual_seed(0)
    m = MLPScorer(kv_heads=2)
    inp = _input(torch.rand(2, 6) * 3)
    s = m(inp)
    assert s.shape == (2, 6) and bool(((s > 0) & (s < 1)).all())
    assert features(inp).shape == (2, 6, 9)
    m.save(tmp_path / "kv_prune_mlp.pt")
    m2 = resolve_scorer(str(tmp_path / "kv_prune_mlp.pt"))
    assert torch.equal(m2(inp), s)
    with pytest.raises(ValueError, match="trained for 3 KV heads"):
        MLPScorer(kv_heads=3)(inp)
    with pytest.raises(ValueError, match="no kv_prune_mlp.pt beside the model"):
        resolve_scorer("mlp", model=torch.nn.Linear(1, 1))
    assert resolve_scorer("attention") is attention_scorer
    f = lambda inp: inp.mass  # noqa: E731
    assert resolve_scorer(f) is f
    with pytest.raises(ValueError, match="prune_scorer"):
        resolve_scorer(3)


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_eviction_baselines(policy):
    model = tiny_model("llama", layers=2)
    torch.manual_seed(1)
    ids = torch.randint(1, 200, (2, 40))

    def logits(cache):
        with torch.no_grad():
            out = [model(ids[:, :30], cache=cache).logits[:, -1]]
            for t in range(30, 40):
                out.append(model(ids[:, t:t + 1], cache=cache).logits[:, -1])
        return torch.stack(out)

    want = logits(DynamicCache(config=model.config))
    # a budget above the context evicts nothing: DynamicCache's logits
    big = EvictingCache.for_model(model, 1000, policy)
    assert torch.allclose(logits(big), want, atol=1e-5)
    small = EvictingCache.for_model(model, 12, policy)
    got = logits(small)
    assert small.get_seq_length() == 40 and small.layers[0].kept() == 13  # 12 + this step's
    assert small.gpu_bytes() == 2 * 2 * 13 * 2 * 2 * 16 * 4  # layers, K+V, tokens, b, heads, d, fp32
    assert small.full_bytes() == big.full_bytes() == 2 * 2 * 40 * 2 * 2 * 16 * 4
    assert not torch.allclose(got[1:], want[1:], atol=1e-3)
    if policy == "streaming":  # sinks 0..3 and the most recent tokens
        layer = small.layers[0]
        assert torch.equal(layer.keys[:, :, :4], big.layers[0].keys[:, :, :4])
    model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("options", [{}, {"gpu_tokens": 0, "prune_threshold": 1.0}])
def test_every_layer_scored_at_once_gives_each_layer_s_scores_exactly(options):
    """An evaluation scores every layer with the built-in attention scorer in one set of
    operations; the page scores are those of scoring layer by layer, to the bit (with the
    compensation acting too: fewer than 32 active tokens). A callable scorer or pattern offsets
    go layer by layer (None)."""
    from deepseek_flash.kv import TieredCache
    from deepseek_flash.kv.prune.state import attention_scores_together

    from kvmodels import tiny_model

    model = tiny_model("llama", layers=3, seed=4)
    ids = torch.randint(1, 250, (2, 300), generator=torch.Generator().manual_seed(2))
    kw = {"prune_threshold": 0.15, "page_tokens": 16, **options}
    cache = TieredCache.for_model(model, **kw)
    with torch.no_grad():
        model(ids[:, :290], cache=cache)
        for t in range(290, 300):
            model(ids[:, t:t + 1], cache=cache)
    prunes = [layer.prune for layer in cache.layers]
    together = attention_scores_together(prunes)
    apart = [p.device_page_scores() for p in prunes]
    assert len(together) == 3 and all(torch.equal(a, b) for a, b in zip(together, apart))
    if options:  # fewer than 32 active tokens (levels 1 and 2): the compensation acts
        assert all(l1 + l2 < 32 for l1, l2, _ in cache.stats()["level_tokens"])
    custom = TieredCache.for_model(model, prune_scorer=lambda inp: inp.mass.clamp(0, 1), **kw)
    with torch.no_grad():
        model(ids[:, :290], cache=custom)
    assert attention_scores_together([layer.prune for layer in custom.layers]) is None


def test_mlp_file_beside_the_model_is_the_scorer_a_cache_runs(tmp_path):
    """``prune_scorer="mlp"`` loads ``kv_prune_mlp.pt`` from the model's directory (where
    bench/kv_prune_train.py's output goes) and the cache scores with it: the same greedy tokens
    and logits as passing the scorer object itself, every call of it counted."""
    from deepseek_flash.kv import TieredCache

    from kvmodels import greedy

    model = tiny_model("llama", layers=2, seed=3)
    model.config.name_or_path = str(tmp_path)
    torch.manual_seed(4)
    MLPScorer(kv_heads=model.config.num_key_value_heads).save(tmp_path / "kv_prune_mlp.pt")
    ids = torch.randint(1, 250, (1, 120), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    runs = []
    for spec in ("mlp", MLPScorer.load(tmp_path / "kv_prune_mlp.pt")):
        cache = TieredCache.for_model(model, prune_threshold=0.5, prune_scorer=spec,
                                      page_tokens=16, gpu_tokens=16, prune_every=4)
        assert isinstance(cache.prune.scorer, MLPScorer)
        calls = []
        cache.prune.scorer.net.register_forward_hook(lambda *a: calls.append(1))
        runs.append(greedy(model, ids, mask, cache, 12))
        assert calls and cache.stats()["demotions"] > 0
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
