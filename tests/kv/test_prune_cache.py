"""KV importance pruning inside the tiered cache (tiny random models): levels, recall, promotion,
offsets and compensation through the cache, stats and configuration."""
import pytest
import torch
from transformers import DynamicCache

from deepseek_flash.errors import ConfigError
from deepseek_flash.kv import TieredCache
from deepseek_flash.kv.layout import pack_pages
from deepseek_flash.kv.prune import compress_pages, decompress_pages, round_trip_bound

from kvmodels import greedy, reference, tiny_model


@pytest.fixture(scope="module")
def model3():
    return tiny_model("llama", layers=3, seed=2)


def ids_of(n, batch=1, seed=0):
    return torch.randint(1, 250, (batch, n), generator=torch.Generator().manual_seed(seed))


class Fixed:
    """A scorer callable with a score the test sets."""

    def __init__(self, value):
        self.value = value

    def __call__(self, inp):
        return torch.full_like(inp.mass, self.value)


def test_threshold_zero_keeps_every_page_on_the_device_and_is_exact(model3):
    ids = ids_of(120, batch=2)
    want_tokens, want_logits = reference(model3, ids, None, 12)
    cache = TieredCache.for_model(model3, prune_threshold=0.0, page_tokens=16)
    assert cache.gpu_tokens == 64  # pruning's recent window when gpu_tokens is not given
    tokens, logits = greedy(model3, ids, None, cache, 12)
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() <= 1e-5
    s = cache.stats()
    n = s["tokens"]
    assert n == 131 and s["level_tokens"] == [[n, 0, 0]] * 3
    assert s["demotions"] == s["promotions"] == s["recalls"] == 0
    # gpu_bytes: every token's K and V (fp32, 2 heads x 16), nothing else: no page summaries
    # (lossless recall ranks no page); the scorer's attention statistics (3 floats per token,
    # for 192 tokens: whole chunks of 64) apart. The host: the key and value norms (2 per head)
    kv = 2 * 2 * 16 * 4
    assert s["host_bytes"] == 3 * 192 * 2 * (2 * 2) * 4
    assert s["gpu_bytes"] == 3 * n * 2 * kv
    assert s["scorer_gpu_bytes"] == 3 * 192 * 2 * 3 * 4


def test_threshold_one_demotes_to_int4_and_recalls_everything(model3):
    ids = ids_of(150)
    ref = DynamicCache(config=model3.config)
    with torch.no_grad():
        model3(ids, cache=ref)
    cache = TieredCache.for_model(model3, prune_threshold=1.0, page_tokens=16, prune_every=2)
    with torch.no_grad():
        model3(ids[:, :140], cache=cache)
        for t in range(140, 150):
            model3(ids[:, t:t + 1], cache=cache)
    s = cache.stats()
    pages = (150 - 4 - 64) // 16   # 5 pages: 4 from the prefill, 1 during the decode
    # prefill pages: 1 -> 2 at the prefill's evaluation, -> 3 two steps later; the page written
    # at step 144 (when 64 + 16 recent tokens were there) went 1 -> 2 -> 3 by step 150
    assert [lv[1:] for lv in s["level_tokens"]] == [[0, pages * 16]] * 3
    assert s["level_tokens"][0][0] == 150 - pages * 16
    assert s["demotions"] == 3 * 2 * pages and s["promotions"] == 0
    # lossless recall: every demoted page attended each decode step (3 layers, batch 1)
    assert s["recalls"] > 0 and s["pages_fetched"] == s["recalls"]
    assert s["level3_bytes_saved"] > 0
    from deepseek_flash.kv.prune.compress import compressed_bytes, from_rows

    for i, layer in enumerate(cache.layers):
        l3 = layer.prune.l3
        assert sorted(l3.pages) == list(range(pages)) and len(layer.prune.l2) == 0
        want = pack_pages(ref.layers[i].keys[:, :, 4:4 + pages * 16],
                          ref.layers[i].values[:, :, 4:4 + pages * 16], 16)
        for j in range(pages):
            back = decompress_pages(from_rows(l3.rows([j]), layer.prune._like))
            assert back.shape == want[j].shape
            assert bool(((back - want[j]).abs() <= round_trip_bound(want[j])).all())
        # the int4 rows: 4 prefill pages in one buffer of 4, then page 4: the buffer doubled
        assert l3.capacity == 8 and l3.row_bytes == compressed_bytes(2, 16, 16)
        assert l3.row_bytes == sum(t.numel() * t.element_size() for t in
                                   vars(compress_pages(want[:1])).values()
                                   if isinstance(t, torch.Tensor))
    # and the scorer's key and value norms (2 per head, 192 tokens: chunks of 64)
    assert s["host_bytes"] == 3 * 8 * compressed_bytes(2, 16, 16) + 3 * 192 * (2 * 2) * 4


def test_device_tokens_bound_level_one_and_the_rest_waits_at_level_two(model3):
    # threshold 0: every page scores above it; prune_device_tokens 4 + 64 + 32 leaves level 1
    # two 16-token pages per layer -- the others stay at full precision on the host (level 2,
    # never compressed while they score above the threshold) and lossless recall attends them
    ids = ids_of(200, batch=2, seed=5)
    want_tokens, want_logits = reference(model3, ids, None, 12)
    cache = TieredCache.for_model(model3, prune_threshold=0.0, page_tokens=16, prune_every=2,
                                  prune_device_tokens=4 + 64 + 32)
    tokens, logits = greedy(model3, ids, None, cache, 12)
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() <= 1e-5
    s = cache.stats()
    n = s["tokens"]
    assert n == 211 and len(s["level_tokens"]) == 3
    for l1, l2, l3 in s["level_tokens"]:
        recent = n - 4 - (n - 4 - 64) // 16 * 16
        assert (l1, l2, l3) == (4 + recent + 32, n - 4 - recent - 32, 0)
    assert s["promotions"] == 0 and s["demotions"] > 0
    # KV on the device: sinks, recent window and two pages of K and V (fp32, 2 heads x 16) per
    # layer and sequence; the scorer's attention statistics (3 floats per token, 256 tokens:
    # whole chunks of 64) apart
    kv = 2 * 2 * 16 * 4
    assert s["gpu_bytes"] == 3 * (4 + recent + 32) * 2 * kv
    assert s["scorer_gpu_bytes"] == 3 * 256 * 2 * 3 * 4


def test_top_k_recall_and_promotion(model3):
    scorer = Fixed(0.0)
    cache = TieredCache.for_model(model3, prune_threshold=0.15, prune_scorer=scorer,
                                  page_tokens=16, top_k_pages=1, dense_layers=1, prune_every=1)
    ids = ids_of(140, batch=2)
    with torch.no_grad():
        model3(ids[:, :134], cache=cache)  # 4 sinks, 64 recent, 4 pages (+2 recent)
        before = cache.stats()["recalls"]
        assert before == 0
        for t in range(134, 138):
            model3(ids[:, t:t + 1], cache=cache)
    s = cache.stats()
    # 4 decode steps: the dense layer recalls all 4 demoted pages, the 2 others the best 1,
    # for each of the 2 sequences
    assert s["recalls"] == 4 * 2 * (4 + 1 + 1)
    assert all(lv[1:] == [0, 64] for lv in s["level_tokens"])
    # the scores rise: every page comes back to level 1 at the next evaluation, from int4
    scorer.value = 0.5
    with torch.no_grad():
        model3(ids[:, 138:139], cache=cache)
    s = cache.stats()
    assert s["promotions"] == 3 * 4 and all(lv[1:] == [0, 0] for lv in s["level_tokens"])
    layer = cache.layers[2].prune
    assert sorted(layer.l1_pages) == [0, 1, 2, 3] and len(layer.l3) == len(layer.l2) == 0
    # the emptied row stores hold no buffer: the host keeps the scorer's norms alone
    assert layer.host_bytes() == layer.stats.host_nbytes() == 192 * 2 * (2 * 2) * 4
    assert layer.l1_k.shape[2] == 4 * 16


def test_pattern_offset_keeps_the_pages_that_hold_it(model3):
    ids = ids_of(132)
    ids[0, 4 + 16 + 3] = 77   # page 1
    ids[0, 4 + 48 + 9] = 77   # page 3
    ids[0, :4 + 64][ids[0, :4 + 64] == 78] = 79
    ids[0, 4 + 16 + 5] = 78   # page 1 too, a second rule adds nothing to the page's largest
    cache = TieredCache.for_model(model3, prune_threshold=0.15, prune_scorer=Fixed(0.1),
                                  page_tokens=16, prune_offsets=[({77}, 0.08), ({78}, 0.02)])
    with torch.no_grad():
        model3(ids, cache=cache)
    for layer in cache.layers:
        assert layer.prune.level.tolist() == [2, 1, 2, 1]  # 0.1 + 0.08 >= 0.15 > 0.1 (+ 0.02)
    # the same with the offsets switched off: every page is demoted
    cache = TieredCache.for_model(model3, prune_threshold=0.15, prune_scorer=Fixed(0.1),
                                  page_tokens=16)
    with torch.no_grad():
        model3(ids, cache=cache)
    assert cache.layers[0].prune.level.tolist() == [2, 2, 2, 2]


@pytest.mark.parametrize("sinks, prompt, compensate, want", [
    (4, 4 + 16, True, [1]),    # 4 sinks + 1 page active: 0.14 * (32 / 20) ** 0.3 = 0.161 >= 0.15
    (4, 4 + 16, False, [2]),
    (0, 16, True, [1]),        # 16 active: 0.14 * 2 ** 0.3 = 0.172
    (4, 4 + 32, True, [2, 2]),  # 36 active tokens: no compensation
    (0, 32, True, [2, 2]),     # 32 active tokens: none either
])
def test_compensation_through_the_cache(model3, sinks, prompt, compensate, want):
    # no recent window: every token past the sinks is paged and scored
    cache = TieredCache.for_model(model3, prune_threshold=0.15, prune_scorer=Fixed(0.14),
                                  page_tokens=16, gpu_tokens=0, sink_tokens=sinks,
                                  prune_compensation=compensate)
    with torch.no_grad():
        model3(ids_of(prompt), cache=cache)
    assert [layer.prune.level.tolist() for layer in cache.layers] == [want] * 3


def test_stats_keys_with_pruning_off(model3):
    cache = TieredCache.for_model(model3, page_tokens=16, gpu_tokens=32)
    with torch.no_grad():
        model3(ids_of(100), cache=cache)
    s = cache.stats()
    assert s["level_tokens"] == [[4 + 32, 64, 0]] * 3
    assert (s["demotions"], s["promotions"], s["recalls"], s["level3_bytes_saved"]) == (0, 0, 0, 0)


def test_bad_prune_settings_are_config_errors(model3, tmp_path):
    for kwargs, key in [(dict(prune_threshold=1.5), "prune_threshold"),
                        (dict(prune_threshold="0.15"), "prune_threshold"),
                        (dict(prune_threshold=0.15, prune_scorer="mlp"), "prune_scorer"),
                        (dict(prune_threshold=0.15, prune_scorer=3), "prune_scorer"),
                        (dict(prune_threshold=0.15, prune_offsets=[("def", 0.08)]), "prune_offsets"),
                        (dict(prune_threshold=0.15, prune_every=0), "prune_every"),
                        (dict(prune_threshold=0.15, prune_device_tokens=-1),
                         "prune_device_tokens")]:
        with pytest.raises(ConfigError) as info:
            TieredCache.for_model(model3, **kwargs)
        assert info.value.key == key, kwargs


def _spill_run(model3, tmp_path, steps=10, **kw):
    """150 tokens (5 pages of 16 per layer past sinks + 64 recent), every page demoted (threshold
    1.0) and in int4 two evaluations later; a 1-byte host budget sends every level-3 page to disk."""
    cache = TieredCache.for_model(model3, prune_threshold=1.0, page_tokens=16, prune_every=2,
                                  **kw)
    ids = ids_of(150, seed=3)
    logits = []
    with torch.no_grad():
        logits.append(model3(ids[:, :140], cache=cache).logits[:, -1])
        for t in range(140, 140 + steps):
            logits.append(model3(ids[:, t:t + 1], cache=cache).logits[:, -1])
    return cache, torch.stack(logits)


def test_level3_past_host_bytes_spills_and_comes_back_exactly(model3, tmp_path):
    from pathlib import Path

    from deepseek_flash.kv.prune.compress import compressed_bytes

    plain, want = _spill_run(model3, tmp_path)
    cache, got = _spill_run(model3, tmp_path, host_bytes=1, spill_dir=tmp_path)
    assert torch.equal(got, want)  # the int4 bytes come back from disk exactly
    s, p = cache.stats(), plain.stats()
    assert s["level_tokens"] == p["level_tokens"] and s["level_tokens"][0][2] == 5 * 16
    assert s["level3_bytes_saved"] == p["level3_bytes_saved"] > 0
    assert p["spilled_bytes"] == p["chunks_spilled"] == 0
    # every level-3 page left the host: the host holds nothing; each layer's pages went in one
    # file at the evaluation that compressed them (4 prefill pages), then one more (page 4)
    norms = 3 * 192 * (2 * 2) * 4  # the scorer's key and value norms, on the host in both
    assert s["host_bytes"] == norms and p["host_bytes"] == 3 * 8 * compressed_bytes(2, 16, 16) + norms
    files = sorted(Path(tmp_path).glob("*-int4.pages"))
    assert s["chunks_spilled"] == len(files) == 6
    stride = -(-compressed_bytes(2, 16, 16) // 4096) * 4096
    assert s["spilled_bytes"] == sum(f.stat().st_size for f in files) == 3 * 5 * stride
    # lossless recall read every spilled page back (crc-checked) at each step after its spill
    assert s["pages_read_spilled"] > 0 and s["recalls"] == p["recalls"]
    cache.close()
    assert not list(Path(tmp_path).glob("*.pages"))


def test_a_promoted_spilled_page_leaves_its_file(model3, tmp_path):
    from pathlib import Path

    scorer = Fixed(0.0)
    cache = TieredCache.for_model(model3, prune_threshold=0.15, prune_scorer=scorer,
                                  page_tokens=16, prune_every=1, host_bytes=1, spill_dir=tmp_path)
    ids = ids_of(150, seed=4)
    with torch.no_grad():
        model3(ids[:, :140], cache=cache)
        model3(ids[:, 140:141], cache=cache)  # second evaluation: 2 -> 3, spilled
        assert cache.stats()["level_tokens"][0][2] == 4 * 16
        assert len(list(Path(tmp_path).glob("*.pages"))) == 3
        scorer.value = 0.5
        model3(ids[:, 141:142], cache=cache)  # every page back to level 1, from disk
    s = cache.stats()
    assert s["level_tokens"][0][1:] == [0, 0] and s["promotions"] == 3 * 4
    assert s["spilled_bytes"] == 0 and not list(Path(tmp_path).glob("*.pages"))


def test_a_corrupt_spilled_level3_page_strict_and_graceful(model3, tmp_path):
    from pathlib import Path

    from deepseek_flash.errors import KVPageCorrupt

    def corrupt(d):
        path = sorted(Path(d).glob("*L001-P00000000-int4.pages"))[0]
        raw = bytearray(path.read_bytes())
        raw[4096 + 10] ^= 0xFF  # row 1 = page 1 of layer 1
        path.write_bytes(bytes(raw))
        return path

    strict, graceful = tmp_path / "strict", tmp_path / "graceful"
    for d, mode in ((strict, "strict"), (graceful, "graceful")):
        cache, _ = _spill_run(model3, d, steps=4, host_bytes=1, spill_dir=d,
                              error_recovery_mode=mode)
        path = corrupt(d)
        step = ids_of(1, seed=9)
        with torch.no_grad():
            if mode == "strict":
                with pytest.raises(KVPageCorrupt) as info:
                    model3(step, cache=cache)
                assert info.value.path == str(path) and info.value.layer == 1
                assert info.value.page == 1 and info.value.code == 702
            else:
                model3(step, cache=cache)
                model3(step, cache=cache)  # read once, then left out
                s = cache.stats()
                assert s["pages_lost"] == 1 and cache.layers[1].prune.lost == {1}
                assert int(cache.layers[1].prune.level[1]) == 3


def test_a_failed_level3_spill_keeps_the_pages_and_says_so(model3, tmp_path):
    from deepseek_flash.errors import KVSpillFailed

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    plain, want = _spill_run(model3, tmp_path, steps=1)
    cache = TieredCache.for_model(model3, prune_threshold=1.0, page_tokens=16, prune_every=2,
                                  host_bytes=1, spill_dir=blocker / "sub")
    ids = ids_of(150, seed=3)
    with torch.no_grad():
        model3(ids[:, :140], cache=cache)
        model3(ids[:, 140:141], cache=cache)
        model3(ids[:, 141:142], cache=cache)  # 2 -> 3 and the spill fails
        with pytest.raises(KVSpillFailed) as info:
            model3(ids[:, 142:143], cache=cache)
    assert str(blocker) in str(info.value)
    s = cache.stats()
    assert s["spill_errors"] >= 1 and s["spilled_bytes"] == 0
    assert s["level_tokens"][0][2] == 4 * 16 and s["host_bytes"] > 0  # nothing lost
