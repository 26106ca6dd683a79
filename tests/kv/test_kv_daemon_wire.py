"""Over the socket of a real deepseek-flashd: a client's TieredCache keeps its host pages in the
daemon's host arena, decodes exactly as DynamicCache, and its figures reach the daemon's status
tree (stats: kv_*; models/<name>/info: kv.*)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from flashd_harness import assert_eventually, daemon_factory, tiny_store  # noqa: E402,F401

from deepseek_flash.client.model import load_model  # noqa: E402
from deepseek_flash.kv import TieredCache  # noqa: E402
from deepseek_flash.sysfs_shim.publisher import parse  # noqa: E402

from kvmodels import greedy, reference  # noqa: E402


def test_cache_over_the_daemon_socket(daemon_factory, tiny_store):  # noqa: F811
    d = daemon_factory({"host_cache_bytes": "64MiB"}).start()
    model = load_model(tiny_store, device="cpu", socket_path=d.socket)
    try:
        assert model.flash.client.mode == "daemon"
        name = model.flash.info.name
        ids = torch.randint(1, 200, (1, 150), generator=torch.Generator().manual_seed(6))
        want_tokens, want_logits = reference(model, ids, None, 4)
        cache = TieredCache.for_model(model, gpu_tokens=32, page_tokens=16)
        tokens, logits = greedy(model, ids, None, cache, 4)
        assert torch.equal(tokens, want_tokens)
        assert (logits - want_logits).abs().max().item() <= 1e-4
        assert cache.report()
        s = cache.stats()
        assert s["host_bytes"] > 0 and s["arena_fallbacks"] == 0

        def tree(path):
            file = d.runtime / path
            return parse(file.read_text()) if file.exists() else {}
        # the tree is published from the daemon's latest snapshot: wait for this report in it
        assert_eventually(lambda: tree("stats").get("kv_host_bytes") == str(s["host_bytes"]),
                          what="the cache's report in the stats file")
        stats = tree("stats")
        assert stats["kv_caches"] == "1"
        assert int(stats["kv_host_bytes"]) == int(stats["kv_arena_bytes"]) == s["host_bytes"]
        assert int(stats["kv_gpu_bytes"]) == s["gpu_bytes"]
        assert int(stats["kv_pages_fetched"]) == s["pages_fetched"] > 0
        assert_eventually(lambda: tree(f"models/{name}/info").get("kv.tokens") == "153",
                          what="the cache's report in the model's info")
        info = tree(f"models/{name}/info")
        assert int(info["kv.tokens"]) == 153 and int(info["kv.full_bytes"]) == s["full_bytes"]
        cache.close()
        assert_eventually(lambda: tree("stats").get("kv_caches") == "0", what="kv_caches: 0")
        assert tree("stats")["kv_arena_bytes"] == "0"
        assert int(tree("stats")["kv_pages_fetched"]) == s["pages_fetched"]
    finally:
        model.flash.close()
    assert d.stop() == 0
