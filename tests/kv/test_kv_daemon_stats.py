"""A load_model model's tiered KV caches report to its controller (report_kv): the controller's
stats carry kv_gpu_bytes, kv_host_bytes, kv_spilled_bytes, kv_pages_fetched, the model's status
entry its kv.* fields, and both reach the status tree files; a closed, collected or disconnected
cache leaves its page fetches in the totals and its bytes nowhere."""
import gc

import pytest
import torch

from deepseek_flash.client.model import load_model
from deepseek_flash.errors import ConfigError, LeaseError, MalformedFrame
from deepseek_flash.kv import TieredCache
from deepseek_flash.store import pack
from deepseek_flash.sysfs_shim.publisher import parse, render
from deepseek_flash.testing import make_tiny_model

from kvmodels import greedy

CONFIG = {"host_cache_bytes": "64MiB"}
KV_STATS = ("kv_caches", "kv_gpu_bytes", "kv_host_bytes", "kv_spilled_bytes", "kv_pages_fetched",
            "kv_arena_bytes")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-daemon-stats")
    src = make_tiny_model(root / "src", "llama", num_layers=2, seed=5)
    m = load_model(pack(src, root / "store"), embedded=True, config=CONFIG)
    yield m
    m.flash.close()


def _kv(client):
    stats = client.call("stats")
    return {k: stats[k] for k in KV_STATS}


def test_cache_stats_reach_the_controller_and_the_status_tree(model, tmp_path):
    client, name = model.flash.client, model.flash.info.name
    base = _kv(client)["kv_pages_fetched"]
    ids = torch.randint(1, 256, (1, 300), generator=torch.Generator().manual_seed(1))
    cache = TieredCache.for_model(model, gpu_tokens=32, page_tokens=16, host_bytes=4096,
                                  spill_dir=tmp_path, report_interval=0.0)
    greedy(model, ids, None, cache, 4)
    assert cache.report()
    s = cache.stats()
    assert s["spilled_bytes"] > 0 and s["pages_fetched"] > 0
    # the host chunks are the controller's arena regions (4 KiB pages: no rounding)
    assert s["host_bytes"] > 0 and s["arena_fallbacks"] == 0
    assert _kv(client) == {"kv_caches": 1, "kv_gpu_bytes": s["gpu_bytes"],
                           "kv_host_bytes": s["host_bytes"], "kv_spilled_bytes": s["spilled_bytes"],
                           "kv_pages_fetched": base + s["pages_fetched"],
                           "kv_arena_bytes": s["host_bytes"]}
    snapshot = client.call("status")
    device, paged = 303 - s["pages"] // 2 * 16, s["pages"] // 2 * 16  # per layer (2 layers)
    assert snapshot["models"][name]["kv"] == {
        "caches": 1, "tokens": 303, "gpu_bytes": s["gpu_bytes"], "host_bytes": s["host_bytes"],
        "spilled_bytes": s["spilled_bytes"], "full_bytes": s["full_bytes"],
        "pages_fetched": s["pages_fetched"], "arena_bytes": s["host_bytes"],
        # without pruning, level 1 is the device and level 2 the host (and spill files)
        "level1_tokens": 2 * device, "level2_tokens": 2 * paged, "level3_tokens": 0,
        "level3_bytes_saved": 0, "demotions": 0, "promotions": 0, "recalls": 0,
        "level_tokens": {"layer0": f"{device} {paged} 0", "layer1": f"{device} {paged} 0"}}
    files = render(snapshot)
    info = parse(files[f"models/{name}/info"].decode())
    assert int(info["kv.gpu_bytes"]) == s["gpu_bytes"] and int(info["kv.tokens"]) == 303
    assert int(parse(files["stats"].decode())["kv_spilled_bytes"]) == s["spilled_bytes"]
    assert f'deepseek_flash_kv_pages_fetched_total {base + s["pages_fetched"]}' in \
        files["metrics.prom"].decode()
    cache.close()
    assert _kv(client) == {"kv_caches": 0, "kv_gpu_bytes": 0, "kv_host_bytes": 0,
                           "kv_spilled_bytes": 0, "kv_pages_fetched": base + s["pages_fetched"],
                           "kv_arena_bytes": 0}
    assert client.call("status")["models"][name]["kv"]["caches"] == 0


def test_a_collected_cache_and_a_departed_client_leave_their_fetches_only(model):
    client = model.flash.client
    base = _kv(client)["kv_pages_fetched"]
    ids = torch.randint(1, 256, (1, 200), generator=torch.Generator().manual_seed(2))
    cache = TieredCache.for_model(model, gpu_tokens=32, page_tokens=16)  # reports every second
    greedy(model, ids, None, cache, 2)
    cache.report()
    fetched = cache.stats()["pages_fetched"]
    assert _kv(client)["kv_caches"] == 1
    del cache
    gc.collect()
    assert _kv(client) == {"kv_caches": 0, "kv_gpu_bytes": 0, "kv_host_bytes": 0,
                           "kv_spilled_bytes": 0, "kv_pages_fetched": base + fetched,
                           "kv_arena_bytes": 0}
    # another client of the same controller reports, then disconnects without closing
    backend = client._backend
    other = backend.manager.connect({"name": "other"})
    used = client.call("stats")["host_bytes_used"]
    region = backend.ops.call(other, "kv_alloc", {"model": model.flash.info.name, "bytes": 5000})
    assert region["bytes"] == 5000 and region["offset"] % 4096 == 0
    backend.ops.call(other, "report_kv", {"model": model.flash.info.name, "stats": {
        "cache": 1, "tokens": 10, "gpu_bytes": 100, "host_bytes": 8192, "pages_fetched": 7}})
    assert _kv(client)["kv_gpu_bytes"] == 100 and _kv(client)["kv_caches"] == 1
    assert _kv(client)["kv_arena_bytes"] == 8192
    assert client.call("stats")["host_bytes_used"] == used + 8192
    backend.manager.disconnect(other)
    assert _kv(client) == {"kv_caches": 0, "kv_gpu_bytes": 0, "kv_host_bytes": 0,
                           "kv_spilled_bytes": 0, "kv_pages_fetched": base + fetched + 7,
                           "kv_arena_bytes": 0}
    assert client.call("stats")["host_bytes_used"] == used
    with pytest.raises(LeaseError, match="no KV region"):
        client.call("kv_free", {"offset": region["offset"]})
    with pytest.raises(MalformedFrame, match="gpu_bytes"):
        client.call("report_kv", {"model": model.flash.info.name, "stats": {"gpu_bytes": "x"}})


def test_pruning_stats_reach_the_stats_the_status_tree_and_metrics(model):
    """A pruning cache's tokens per level (per layer and summed), level moves, recalls and the
    bytes level 3 saves: in the controller's stats, the model's kv.* fields, the tree files and
    metrics.prom; after close only the counters stay."""
    client, name = model.flash.client, model.flash.info.name
    before = client.call("stats")
    ids = torch.randint(1, 256, (2, 150), generator=torch.Generator().manual_seed(6))
    cache = TieredCache.for_model(model, prune_threshold=1.0, page_tokens=16, prune_every=2,
                                  report_interval=0.0)
    greedy(model, ids, None, cache, 6)
    assert cache.report()
    s = cache.stats()
    assert s["demotions"] > 0 and s["recalls"] > 0 and s["level3_bytes_saved"] > 0
    levels = [[n * 2 for n in lv] for lv in s["level_tokens"]]  # batch 2
    assert levels[0][2] > 0 and levels[0][0] == 2 * (4 + cache.layers[0].recent_k.shape[2])
    stats = client.call("stats")
    want = {"kv_level1_tokens": sum(lv[0] for lv in levels),
            "kv_level2_tokens": sum(lv[1] for lv in levels),
            "kv_level3_tokens": sum(lv[2] for lv in levels),
            "kv_level3_bytes_saved": s["level3_bytes_saved"],
            "kv_demotions": before["kv_demotions"] + s["demotions"],
            "kv_promotions": before["kv_promotions"] + s["promotions"],
            "kv_recalls": before["kv_recalls"] + s["recalls"]}
    assert {k: stats[k] for k in want} == want
    snapshot = client.call("status")
    kv = snapshot["models"][name]["kv"]
    assert kv["level_tokens"] == {f"layer{i}": " ".join(map(str, lv)) for i, lv in enumerate(levels)}
    assert (kv["demotions"], kv["recalls"]) == (s["demotions"], s["recalls"])
    files = render(snapshot)
    info = parse(files[f"models/{name}/info"].decode())
    assert info["kv.level_tokens.layer1"] == " ".join(map(str, levels[1]))
    assert int(info["kv.level3_tokens"]) == want["kv_level3_tokens"]
    assert int(parse(files["stats"].decode())["kv_demotions"]) == want["kv_demotions"]
    prom = files["metrics.prom"].decode()
    assert f'deepseek_flash_kv_recalls_total {want["kv_recalls"]}' in prom
    assert f'deepseek_flash_kv_level3_tokens {want["kv_level3_tokens"]}' in prom
    assert "# TYPE deepseek_flash_kv_demotions_total counter" in prom
    assert f'deepseek_flash_model_kv_level1_tokens{{model="{name}"}} {want["kv_level1_tokens"]}' in prom
    cache.close()
    after = client.call("stats")
    assert after["kv_level3_tokens"] == after["kv_level1_tokens"] == 0
    assert after["kv_demotions"] == want["kv_demotions"] and after["kv_recalls"] == want["kv_recalls"]
    with pytest.raises(MalformedFrame, match="level_tokens"):
        client.call("report_kv", {"model": name, "stats": {"level_tokens": [[1, 2]]}})


def test_reporting_off_and_bad_interval(model):
    cache = TieredCache.for_model(model, report_interval=None)
    assert cache.report() is False
    with pytest.raises(ConfigError) as info:
        TieredCache.for_model(model, report_interval=-1)
    assert info.value.key == "report_interval"


def test_arena_full_falls_back_to_own_memory_and_decodes_exactly(model):
    """A chunk larger than the whole host arena: the controller refuses (OutOfMemory), the chunk
    lives in this process's memory, and the tokens are those of the plain cache."""
    ids = torch.randint(1, 256, (1, 200), generator=torch.Generator().manual_seed(4))
    plain = TieredCache.for_model(model, gpu_tokens=32, page_tokens=16, host_arena=False)
    want = greedy(model, ids, None, plain, 3)
    cache = TieredCache.for_model(model, gpu_tokens=32, page_tokens=16, chunk_pages=20000)
    got = greedy(model, ids, None, cache, 3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert cache.stats()["arena_fallbacks"] == 2  # one chunk per layer
    assert _kv(model.flash.client)["kv_arena_bytes"] == 0
    cache.close()
