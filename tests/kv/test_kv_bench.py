"""bench/kv.py runs end to end on the CPU (--smoke) and its figures are consistent."""
import json

from kvmodels import bench_module


def test_kv_bench_smoke(tmp_path):
    bench = bench_module("kv")
    out = tmp_path / "kv.json"
    assert bench.main(["--smoke", "--contexts", "700", "--decode", "2", "--pairs", "2",
                       "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    (r,) = result["contexts"]
    assert result["smoke"] and r["context"] == 700
    # 4 layers, 2 kv heads x 16 channels, fp32: 256 bytes per token and layer; a decode run is
    # 4 warm-up steps and 2 timed windows of 2 steps
    tokens = 700 + 4 + 2 * 2
    assert r["dynamic_kv_bytes"] == r["tiered_full_bytes"] == tokens * 4 * 256
    assert r["gpu_kv_ratio"] == round(r["tiered_gpu_bytes"] / r["dynamic_kv_bytes"], 4) < 1
    # after the paired windows (2 of 4 warm-up steps and 2 timed ones) and the lossless warm-up
    pages = (tokens + 2 * (4 + 2) + 4 + 2 * 2 - 4 - 512) // 32
    assert r["lossless_bytes_per_token"] == pages * 4 * 32 * 256
    assert r["topk25_pages_per_token"] > 0
    # the page cache (on by default with top-K): fewer pages cross than without it, its slots
    # counted in top-K's GPU bytes (above the lossless figure), both published
    assert r["topk25_nocache_pages_per_token"] > r["topk25_pages_per_token"]
    assert 0 < r["topk25_page_cache_hit_rate"] <= 1
    assert r["topk25_gpu_bytes"] == r["tiered_gpu_bytes"] + r["topk25_page_cache_bytes"]
    assert r["topk25_gpu_kv_ratio"] == round(r["topk25_gpu_bytes"] / r["dynamic_kv_bytes"], 4)
    assert r["topk25_nocache_tok_s"] > 0
    assert r["topk25_one_gather_layers"] == 2  # 4 layers, the first 2 dense
    for key in ("dynamic_tok_s", "dynamic_nocudnn_tok_s", "topk25_tok_s", "lossless_tok_s",
                "ttft_dynamic_s", "ttft_dynamic_nocudnn_s", "ttft_tiered_s", "ttft_tiered_first_s"):
        assert r[key] > 0
    for key in ("dynamic_host_share", "dynamic_nocudnn_host_share", "topk25_host_share",
                "lossless_host_share"):
        assert 0 < r[key] <= 1.0
    # the ratios are against the faster DynamicCache of the two
    assert r["dynamic_best_tok_s"] == max(r["dynamic_tok_s"], r["dynamic_nocudnn_tok_s"])
    assert r["dynamic_baseline"] in ("dynamic", "dynamic_nocudnn")
    assert r["topk25_vs_dynamic"] == round(r["topk25_tok_s"] / r["dynamic_best_tok_s"], 3)
    assert r["ttft_dynamic_best_s"] == min(r["ttft_dynamic_s"], r["ttft_dynamic_nocudnn_s"])
    assert result["dynamic_floor_tok_s"] > 0 and result["warmup_s"] > 0
    assert r["dynamic_floor_before_tok_s"] == result["dynamic_floor_tok_s"]  # the first context
    # top-K and DynamicCache timed in alternating windows: the median of the pairs' ratios
    tiered, dynamic = r["topk25_paired_windows"]
    assert len(tiered) == len(dynamic) == 2 and min(tiered + dynamic) > 0
    ratios = sorted(t / d for t, d in zip(tiered, dynamic))
    assert r["topk25_paired_ratio"] == round((ratios[0] + ratios[1]) / 2, 4)


def test_kv_prune_show_smoke(tmp_path):
    """bench/kv_prune.py --show (the H200 run) on a tiny CPU model: every configuration runs and
    reports its GPU KV bytes, tok/s and the scorer's cost."""
    bench = bench_module("kv_prune")
    out = tmp_path / "show.json"
    assert bench.main(["--show", "--smoke", "--show-context", "700", "--decode", "20",
                       "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["context"] == 700
    for name in ("dynamic", "dynamic_nocudnn", "tiered_lossless", "tiered_topk25", "pruned",
                 "pruned_topk25", "pruned_all_demoted"):
        assert r[name]["gpu_kv_bytes"] > 0 and r[name]["tok_s"] > 0
        assert r[name]["decode_steps"] == 20
        assert r[name]["pool_new_bytes"] == 0  # no page-locked memory on the CPU
    # DynamicCache with and without cuDNN (bench/kv.py's dynamic_variants), the stronger the
    # baseline
    best = max(("dynamic", "dynamic_nocudnn"), key=lambda n: r[n]["tok_s"])
    assert r["dynamic_baseline"] == best and r["dynamic_best_tok_s"] == r[best]["tok_s"]
    assert r["pruned_vs_dynamic_best_tok_s"] == round(r["pruned"]["tok_s"] / r[best]["tok_s"], 3)
    # what each moved per step: the tiered cache's fetched pages, pruning's recalls (lossless
    # moves more than top-K 25 %)
    tiered = [r[n]["fetched_bytes_per_step"] for n in ("tiered_lossless", "tiered_topk25")]
    assert tiered[0] > tiered[1] > 0
    pruned = [r[n]["recall_bytes_per_step"] for n in ("pruned", "pruned_topk25")]
    assert pruned[0] > pruned[1] > 0
    assert r["pruned_topk25"]["recall_ops_per_step"] <= 2 * 4  # one per level and layer at most
    assert "pruned_vs_tiered_lossless_tok_s" in r and "pruned_topk25_vs_tiered_topk25_tok_s" in r
    # each timed step's ms; pruning's evaluations (every 8 steps: the 8th and 16th of the 22
    # decoded, the first 2 untimed) apart from the median of the other steps
    for name in ("tiered_lossless", "pruned"):
        assert len(r[name]["step_ms"]) == 20 and r[name]["median_step_ms"] > 0
    assert "evaluation_steps" not in r["tiered_lossless"]
    assert r["pruned"]["evaluation_steps"] == 2 and r["pruned"]["evaluation_step_ms"] > 0
    assert r["pruned"]["scorer_gpu_bytes"] == 4 * 768 * 3 * 4  # 722 tokens: 12 chunks of 64
    assert r["dynamic"]["gpu_kv_bytes"] == (700 + 2 + 20) * 4 * 256
    demoted = r["pruned_all_demoted"]
    # threshold 1.0: every page is demoted at the prefill's evaluation and in int4 two later
    assert demoted["level_tokens_layer0"][:2] == [722 - demoted["level_tokens_layer0"][2], 0]
    assert demoted["level_tokens_layer0"][2] > 0 and demoted["recalls"] > 0
    assert demoted["gpu_kv_bytes"] < r["dynamic"]["gpu_kv_bytes"]
    assert r["pruned"]["scorer_ms_per_step"] > 0
    assert r["total_s"] < r["budget_s"] == 100.0


def test_kv_prune_show_times_min_steps_past_the_budget(tmp_path):
    """Every configuration of the Show (those --rows names) runs and times --min-steps decode
    steps even when the budget is spent (none skipped, none cut to one step), and no more; the
    others are reported as not run."""
    bench = bench_module("kv_prune")
    out = tmp_path / "show.json"
    assert bench.main(["--show", "--smoke", "--show-context", "300", "--decode", "12",
                       "--min-steps", "3", "--budget-s", "0.01", "--rows",
                       "pruned,tiered_lossless", "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [r[n]["decode_steps"] for n in ("tiered_lossless", "pruned")] == [3, 3]
    assert [n for n in bench.SHOW_ROWS if "not_run" in r[n]] == [
        "dynamic", "dynamic_nocudnn", "tiered_topk25", "pruned_topk25", "pruned_all_demoted"]
    assert r["pruned_vs_tiered_lossless_tok_s"] > 0 and "dynamic_baseline" not in r


def test_kv_ops_topk_step_host_work_does_not_grow_with_pages(tmp_path):
    """bench/kv_ops.py: a top-K decode step fetches each top-K layer's pages with one
    index_select and no host sync, and the two dense layers' chunks with one ``_foreach_copy_``
    each (one copy per host chunk: 4 then 5 chunks per layer): the same operations at 1,536 and
    4,608 tokens, only the copies in that one call differ."""
    bench = bench_module("kv_ops")
    out = tmp_path / "kv_ops.json"
    assert bench.main(["--contexts", "1536", "4608", "--output", str(out)]) == 0
    short, long = json.loads(out.read_text())["contexts"]
    assert (short["pages_per_layer"], long["pages_per_layer"]) == (31, 63)
    for r in (short, long):
        assert r["topk25"]["syncs"] == 0 and r["topk25"]["index_select"] == 2  # 2 top-K layers
        assert r["lossless"]["syncs"] == 0
    assert long["topk25"]["copies"] - short["topk25"]["copies"] == 2  # one more chunk, 2 layers
    assert long["topk25"]["ops"] == short["topk25"]["ops"]
    assert long["lossless"]["ops"] == short["lossless"]["ops"]


def test_kv_bench_peer_figures(tmp_path):
    # what transformers' offloading cache moves (its whole KV each way a step) and its profiles
    # (run on CUDA only; here with a plain DynamicCache, the same code)
    import argparse

    import torch
    from transformers import DynamicCache

    from kvmodels import cache_kwargs, tiny_model

    bench = bench_module("kv")
    model = tiny_model(layers=2)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(torch.arange(1, 40)[None], **cache_kwargs(model, cache)).logits
    tok = logits[:, -1:].argmax(-1)
    kv = bench.dynamic_kv_bytes(cache)
    args = argparse.Namespace(host_profile=True, output=str(tmp_path / "kv.json"))
    r = {"offload_tok_s": 5.0, "lossless_bound_tok_s": 8.0}
    bench.peer_figures(model, cache, tok, "cpu", args, 39, 2.0, r)
    assert "offload_profile_error" not in r, r
    assert r["offload_h2d_bytes_per_token"] == r["offload_d2h_bytes_per_token"] == kv > 0
    assert r["offload_bound_tok_s"] == round(2.0e9 / kv, 3)
    assert r["offload_vs_bound"] == round(5.0 / r["offload_bound_tok_s"], 3)
    assert r["lossless_bound_vs_offload"] == 1.6
    assert (tmp_path / "kv.offload-39.txt").exists()
    assert "steps" in (tmp_path / "kv.hostprof-offload-39.txt").read_text()


def test_kv_bench_lean(tmp_path):
    # --lean: DynamicCache and top-K (with the paired windows) alone, the rest left out
    bench = bench_module("kv")
    out = tmp_path / "kv.json"
    assert bench.main(["--smoke", "--contexts", "700", "--decode", "2", "--pairs", "1",
                       "--lean", "--output", str(out)]) == 0
    (r,) = json.loads(out.read_text())["contexts"]
    assert r["topk25_vs_dynamic"] == round(r["topk25_tok_s"] / r["dynamic_best_tok_s"], 3)
    assert r["topk25_paired_ratio"] > 0 and len(r["topk25_paired_windows"][0]) == 1
    for key in ("lossless_tok_s", "topk25_nocache_tok_s", "ttft_tiered_s", "ttft_ratio"):
        assert key not in r, key
