"""Benchmark: the tiered KV cache on the GPU against a full ``DynamicCache`` and the PCIe bound.

Batch 1, random-weight model of the ``--arch`` 7-8B shape (bf16, resident), contexts ``--contexts``
(8K, 32K, 128K). Per context, in one run:

* GPU bytes held by KV: ``DynamicCache`` vs ``TieredCache`` with the default settings
  (sinks + 512 recent tokens + page summaries; pages fetched for one step are transient and
  reported apart as ``tiered_peak_extra_bytes``, the step's peak allocation above the steady state);
* GPU bytes with top-K: the same plus each top-K layer's page cache (kv/pagecache.py: the slots of
  the pages chosen in the last steps, on by default with ``top_k_pages``; ``topk25_gpu_kv_ratio``),
  its hit rate and the pages that still cross PCIe per token;
* decode tok/s: full ``DynamicCache`` on the GPU -- as a default user gets it (``dynamic_*``:
  torch picks the attention kernel, cuDNN's where present) and with cuDNN's kernel left out
  (``dynamic_nocudnn_*``, as the tiered cache runs: deepseek_flash.cuda.SDPA_BACKENDS); the
  faster of the two (``dynamic_baseline``) is what the ratios and goals use -- vs top-K 25 % of
  the pages (each top-K layer's choice and gather as a captured CUDA graph, the default;
  ``--eager`` adds ``topk25_eager_tok_s`` without; ``topk25_nocache_tok_s``: the same steps with
  the page cache left out; ``topk25_fused_*``: the same steps through kv/fused.py's Triton
  kernels, five per top-K layer, while the torch path is the default -- ``topk25_torch_*`` once
  the fused step is); top-K and the cuDNN-free ``DynamicCache`` also timed in ``--pairs``
  alternating windows (``topk25_paired_ratio``: the median of the pairs' ratios -- both steps are
  bound by a host whose speed drifts within a run, so side-by-side windows compare them fairly)
  vs lossless (every page fetched from the host
  each step) vs ``DynamicCache(offloading=True)`` (transformers' own layer-by-layer offload, with
  cuDNN left out, up to ``--peer-max`` tokens);
* the PCIe bound of the lossless mode: host->GPU bytes per token (every page of every layer) over
  the pinned host->GPU rate measured in this run;
* what the peer moves (``offload_h2d_bytes_per_token``: its whole KV to the device and back each
  step) and its bound at the same rate (``offload_bound_tok_s``);
* time to first token (one forward over the prompt) vs the faster ``DynamicCache`` prefill:
  ``ttft_tiered_s`` with a second cache (the page-locked host memory of the first reused, as in a
  serving process), ``ttft_tiered_first_s`` with the first cache of the context in the process.

Timing is the same for every mode: before the first context every mode runs once at a short
context, untimed (nothing is timed cold); each decode figure is the best of ``--repeats`` windows
of ``--decode`` steps after ``--warmup`` untimed steps, with the share of the window the host spent
queueing (``*_host_share``: near 1.0 the eager step's host work is the bound, not the device) and
the host's time to issue one step with the device idle (``*_host_ms``: DynamicCache, top-K). The
dynamic ``DynamicCache`` decode at a 256-token context (``dynamic_floor_tok_s``) is the eager step
apart from long-context attention; it is taken again before each later context
(``dynamic_floor_before_tok_s``): a process that slowed down shows there.

``--page-cache`` sets the top-K cache's ``page_cache`` (default: the library's, 1.5; ``auto``:
every page; recorded as ``topk25_page_cache``). The measuring itself is in bench/kv_steps.py, the top-K
variants, pairs, peer and profiles in bench/kv_modes.py.

``--smoke`` runs a tiny shape on the CPU (what the test suite runs). ``--lean``: per context the
DynamicCache and top-K figures alone (with the pairs); ``--host-profile``: Python's profiler over
ten decode steps of each mode (``kv.hostprof-<mode>-<context>.txt``), and a profiler table of two
of the offload peer's steps (``kv.offload-<context>.txt``).

    python bench/kv.py [--arch llama] [--contexts 8192 32768 131072] [--output kv.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

from kv_modes import (fused_layers, fused_timing, paired_timing, peer_figures, profile_context,
                      split_timing, topk_options)
from kv_steps import (SHAPES, backends, build, checkpoint, decode, dynamic_kv_bytes,
                      dynamic_variants, floor_tok_s, free, h2d_rate, hit_rate, host_ms,
                      host_profile, prefill, stronger_dynamic)


def run_context(model, T, args, device, h2d, record=True):
    import torch
    from transformers import DynamicCache

    from deepseek_flash.kv import TieredCache

    cuda = device.startswith("cuda")
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (1, T), generator=torch.Generator().manual_seed(T)).to(device)
    steps = args.decode if T < 100000 else max(4, args.decode // 2)
    r = {"context": T, "decode_steps": steps}

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model.set_attn_implementation("sdpa")  # the peers run as transformers runs them
    # DynamicCache twice (dynamic_variants): the stronger one is the baseline the goals use
    for name, ctx in dynamic_variants():
        with ctx():
            dc = DynamicCache(config=model.config)
            tok, r[f"ttft_{name}_s"] = prefill(model, ids, dc, device)
            tok, r[f"{name}_tok_s"], r[f"{name}_host_share"] = decode(
                model, dc, tok, steps, device, args.warmup, args.repeats)
            # the same tokens as the tiered stats below (before host_ms's steps)
            r["dynamic_kv_bytes"] = dynamic_kv_bytes(dc)
            tok, r[f"{name}_host_ms"] = host_ms(model, dc, tok, device)
            if args.host_profile and args.output:
                tok = host_profile(model, dc, tok, device, Path(args.output).with_name(
                    f"kv.hostprof-{name}-{T}.txt"))
        if cuda:
            r["dynamic_peak_bytes"] = torch.cuda.max_memory_allocated()
        del dc
        free(device)
    checkpoint(args, r)
    best = stronger_dynamic({n: r[f"{n}_tok_s"] for n, _ in dynamic_variants()})
    r["dynamic_baseline"] = best
    r["dynamic_best_tok_s"] = r[f"{best}_tok_s"]
    r["ttft_dynamic_best_s"] = min(r["ttft_dynamic_s"], r["ttft_dynamic_nocudnn_s"])

    base = torch.cuda.memory_allocated() if cuda else 0
    cache = TieredCache.for_model(model, top_k_pages=0.25, **topk_options(args))
    # the first tiered cache of this context in the process: its host pages are new page-locked
    # memory (torch keeps it for the next cache: ttft_tiered_s, measured again below)
    tok, r["ttft_tiered_first_s"] = prefill(model, ids, cache, device)
    steady = (torch.cuda.memory_allocated() - base) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = cache.stats()
    tok, r["topk25_tok_s"], r["topk25_host_share"] = decode(model, cache, tok, steps, device,
                                                            args.warmup, args.repeats)
    s = cache.stats()
    n_steps = args.warmup + args.repeats * steps
    # pages that crossed to the device per token: with the page cache (the default with
    # top_k_pages, kv/pagecache.py) the chosen pages that were not in its device slots
    r["topk25_pages_per_token"] = (s["pages_fetched"] - before["pages_fetched"]) / n_steps
    r["topk25_page_cache_hit_rate"] = hit_rate(before, s)
    r["topk25_page_cache_bytes"] = s["page_cache_bytes"]
    r["topk25_page_cache"] = cache.page_cache
    r["topk25_last_step_fetched_bytes"] = s["page_cache_step_fetched_bytes"]
    # what a top-K step must move over PCIe (the chosen pages of the top-K layers, every page of
    # the dense ones) and the rate that allows at the host->GPU rate of this run: the most top-K
    # can reach with its pages on the host, however well the copies overlap
    r["topk25_bytes_per_token"] = round(r["topk25_pages_per_token"] * s["page_bytes"])
    if h2d:
        r["topk25_bound_tok_s"] = round(h2d * 1e9 / r["topk25_bytes_per_token"], 3)
    # layers whose top-K pages came by one gather over their host chunks (kv/span.py); the
    # others (dense layers, or a view that could not be used: logged) copy page runs
    r["topk25_one_gather_layers"] = sum(layer.pages._span is not None for layer in cache.layers)
    # layers whose choice and gather replayed as a captured CUDA graph (kv/graphs.py)
    r["topk25_graph_layers"] = sum(layer.graphs.graph is not None for layer in cache.layers)
    # GPU KV without the page cache (what lossless holds, the goal's figure) and with it
    # (top-K's: the slots of the chosen pages on the device as well)
    r["tiered_gpu_bytes"] = s["gpu_bytes"] - s["page_cache_bytes"]
    r["topk25_gpu_bytes"] = s["gpu_bytes"]
    r["tiered_full_bytes"] = s["full_bytes"]
    r["tiered_host_bytes"] = s["host_bytes"]
    r["tiered_steady_bytes"] = steady
    if cuda:
        r["tiered_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base - steady
        r["tiered_peak_bytes"] = torch.cuda.max_memory_allocated()
    r["gpu_kv_ratio"] = round(r["tiered_gpu_bytes"] / r["dynamic_kv_bytes"], 4)
    r["topk25_gpu_kv_ratio"] = round(s["gpu_bytes"] / r["dynamic_kv_bytes"], 4)
    tok, r["topk25_host_ms"] = host_ms(model, cache, tok, device)  # after the counts above
    if args.host_profile and args.output:
        tok = host_profile(model, cache, tok, device,
                           Path(args.output).with_name(f"kv.hostprof-topk25-{T}.txt"))
    if cache.fused:
        fused_layers(cache, r)
    checkpoint(args, r)
    if args.pairs:
        tok = paired_timing(model, ids, cache, tok, steps, device, args, r)
        checkpoint(args, r)
    if cuda and args.fused:
        # the same top-K steps through kv/fused.py's Triton kernels (the other of the two paths)
        tok = fused_timing(model, cache, tok, steps, device, args, r)
        checkpoint(args, r)
        if cache.fused:
            tok = split_timing(model, cache, tok, steps, device, args, r)
            checkpoint(args, r)
    if args.lean:  # the top-K figures alone: a second sample, or a context where time is short
        cache.close()
        del cache
        free(device)
        return finish(r)
    # the same top-K steps with the page cache left out: every chosen page crosses PCIe each step
    setting, cache.page_cache = cache.page_cache, 0
    before = cache.stats()["pages_fetched"]
    tok, r["topk25_nocache_tok_s"], r["topk25_nocache_host_share"] = decode(
        model, cache, tok, steps, device, args.warmup, args.repeats)
    r["topk25_nocache_pages_per_token"] = (cache.stats()["pages_fetched"] - before) / n_steps
    # the same top-K steps with other page-cache multiples (``--page-cache-multiples``; the
    # goals use the default): tok/s, hit rate and GPU bytes of each
    for multiple in args.page_cache_multiples:
        name = f"topk25_pc{multiple:g}"
        cache.page_cache = 0  # the next step gives the slots back
        tok, _, _ = decode(model, cache, tok, 1, device, 0, 1)
        cache.page_cache = float(multiple)
        before = cache.stats()
        tok, r[f"{name}_tok_s"], _ = decode(model, cache, tok, steps, device, args.warmup,
                                            args.repeats)
        s = cache.stats()
        r[f"{name}_hit_rate"] = hit_rate(before, s)
        r[f"{name}_gpu_kv_ratio"] = round(s["gpu_bytes"] / r["dynamic_kv_bytes"], 4)
    if args.page_cache_multiples:
        cache.page_cache = 0
        tok, _, _ = decode(model, cache, tok, 1, device, 0, 1)
    cache.page_cache = setting
    if args.page_cache_multiples:
        # the default once more, now that it is not the first top-K timed after the prompt (the
        # first ran slower than later multiples in the tenth run: 30.6 vs 38.4 tok/s at 8K)
        tok, r["topk25_again_tok_s"], _ = decode(model, cache, tok, steps, device, args.warmup,
                                                 args.repeats)
    if cuda and args.eager:  # the same top-K steps without the captured graphs (kv/graphs.py)
        cache.select_graphs = False
        tok, r["topk25_eager_tok_s"], _ = decode(model, cache, tok, steps, device, args.warmup,
                                                 args.repeats)
        cache.select_graphs = True
    cache.top_k_pages = None
    tok, r["lossless_tok_s"], r["lossless_host_share"] = decode(model, cache, tok, steps, device,
                                                                args.warmup, args.repeats)
    s = cache.stats()
    # every page of every layer, each step, but the dense layers' kept on the device as well
    moved = (s["pages"] - s["mirrored_pages"]) * s["page_bytes"]
    r["lossless_bytes_per_token"] = moved
    if h2d:
        r["lossless_bound_tok_s"] = round(h2d * 1e9 / moved, 3)
        r["lossless_vs_bound"] = round(r["lossless_tok_s"] / r["lossless_bound_tok_s"], 3)
    cache.close()
    del cache
    free(device)
    # time to first token again with a new cache: the page-locked memory of the first one is
    # reused (as by every cache after the first in a serving process)
    cache = TieredCache.for_model(model, top_k_pages=0.25, **topk_options(args))
    _, r["ttft_tiered_s"] = prefill(model, ids, cache, device)
    cache.close()
    del cache
    free(device)

    if cuda and T <= args.peer_max:
        # transformers' own offload, with cuDNN left out (the stronger of its two ways to run:
        # its steps are the DynamicCache steps plus the layer copies)
        model.set_attn_implementation("sdpa")
        with backends():
            off = DynamicCache(config=model.config, offloading=True)
            tok, r["ttft_offload_s"] = prefill(model, ids, off, device)
            otok, r["offload_tok_s"], r["offload_host_share"] = decode(
                model, off, tok, steps, device, args.warmup, args.repeats)
            peer_figures(model, off, otok, device, args, T, h2d, r)
        r["lossless_vs_offload"] = round(r["lossless_tok_s"] / r["offload_tok_s"], 3)
        del off
        free(device)
    r["topk25_nocache_vs_dynamic"] = round(r["topk25_nocache_tok_s"] / r["dynamic_best_tok_s"], 3)
    r["ttft_ratio"] = round(r["ttft_tiered_s"] / r["ttft_dynamic_best_s"], 3)
    return finish(r)


def finish(r: dict) -> dict:
    """A context's ratios against DynamicCache and its floats rounded."""
    r["topk25_vs_dynamic"] = round(r["topk25_tok_s"] / r["dynamic_best_tok_s"], 3)
    r["topk25_vs_dynamic_default"] = round(r["topk25_tok_s"] / r["dynamic_tok_s"], 3)
    for name in ("topk25_fused", "topk25_torch", "topk25_fused_split", "topk25_fused_one"):
        if f"{name}_tok_s" in r:
            r[f"{name}_vs_dynamic"] = round(r[f"{name}_tok_s"] / r["dynamic_best_tok_s"], 3)
    r["ttft_first_ratio"] = round(r["ttft_tiered_first_s"] / r["ttft_dynamic_best_s"], 3)
    for k, v in list(r.items()):
        if isinstance(v, float):
            r[k] = round(v, 4)
    return r




def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=sorted(SHAPES), default="llama")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--decode", type=int, default=16, help="decode steps timed per mode")
    ap.add_argument("--warmup", type=int, default=4, help="untimed decode steps per mode")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed windows per mode (the best counts)")
    ap.add_argument("--host-profile", action="store_true",
                    help="cProfile of 10 decode steps of DynamicCache and top-K per context "
                         "(kv.hostprof-<mode>-<context>.txt beside --output)")
    ap.add_argument("--lean", action="store_true",
                    help="per context the DynamicCache and top-K figures alone (no lossless, "
                         "offload, page-cache variants or second TTFT)")
    ap.add_argument("--pairs", type=int, default=3,
                    help="alternating windows of top-K and DynamicCache (no cuDNN) per context "
                         "(topk25_paired_ratio; 0: none)")
    ap.add_argument("--peer-max", type=int, default=32768,
                    help="longest context DynamicCache(offloading=True) is run at")
    ap.add_argument("--profile", action="store_true",
                    help="also a torch profiler table of 2 decode steps per mode at the "
                         "--profile-at contexts (next to --output)")
    ap.add_argument("--profile-at", type=int, nargs="+", default=[32768],
                    help="contexts --profile profiles (default 32768)")
    ap.add_argument("--eager", action="store_true",
                    help="also time top-K without its captured CUDA graphs (topk25_eager_tok_s)")
    ap.add_argument("--page-cache", type=lambda v: v if v == "auto" else float(v), default=None,
                    help="the top-K cache's page_cache: a multiple or 'auto' (default: the "
                         "library's, 1.5); the goals' figures are taken with it "
                         "(topk25_page_cache)")
    ap.add_argument("--page-cache-multiples", type=float, nargs="*", default=[],
                    help="also time top-K with these page_cache multiples (topk25_pc<m>_*)")
    ap.add_argument("--no-fused", dest="fused", action="store_false",
                    help="leave out top-K through the other path (kv/fused.py's Triton step "
                         "or the torch path, whichever is not the default: topk25_fused_* / "
                         "topk25_torch_*)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    import torch
    import transformers

    if args.smoke:
        device = "cpu"
        if args.contexts == [8192, 32768, 131072]:
            args.contexts = [600, 1200]
        args.decode = min(args.decode, 4)
        if args.profile_at == [32768]:
            args.profile_at = args.contexts[-1:]
    else:
        if not torch.cuda.is_available():
            print("bench/kv.py: no CUDA device (use --smoke on a CPU)", file=sys.stderr)
            return 2
        device = "cuda:0"
    started = t = time.perf_counter()
    model = build(args.arch, args.smoke, max(args.contexts) + 64, device)
    result = {"bench": "kv", "date": datetime.date.today().isoformat(), "machine": platform.node(),
              "arch": args.arch, "smoke": args.smoke, "torch": torch.__version__,
              "transformers": transformers.__version__, "build_s": round(time.perf_counter() - t, 1),
              "gpu": torch.cuda.get_device_name(0) if device != "cpu" else None,
              "h2d_gbps": h2d_rate(device, 1 << 30), "contexts": []}
    # the floor before anything else ran in the process (no tiered cache, no Triton kernel yet):
    # against dynamic_floor_tok_s, taken after the warm-up, it tells a process slowed by what
    # ran before from a slow host
    if not args.smoke:
        result["dynamic_floor_first_tok_s"] = floor_tok_s(model, args, device)
    # every mode once at a short context, untimed (a few steps each): the first context is not
    # timed cold (kernel selection, allocator growth, the copy stream and pinned pools are all
    # warm by then)
    t = time.perf_counter()
    warm = argparse.Namespace(**{**vars(args), "decode": 2, "warmup": 2, "repeats": 1,
                                 "record": False})
    run_context(model, min(1024, min(args.contexts)), warm, device, result["h2d_gbps"], False)
    result["warmup_s"] = round(time.perf_counter() - t, 1)
    result["dynamic_floor_tok_s"] = floor_tok_s(model, args, device)
    for i, T in enumerate(args.contexts):
        # the 256-token floor again before every context after the first: a later context
        # slower than the first in every mode is then told apart -- the process slowed down (the
        # floor drops too) or the context itself costs more (the floor holds)
        floor = result["dynamic_floor_tok_s"] if i == 0 else floor_tok_s(model, args, device)
        r = run_context(model, T, args, device, result["h2d_gbps"])
        r["dynamic_floor_before_tok_s"] = floor
        result["contexts"].append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
        if args.output:
            Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    by = {r["context"]: r for r in result["contexts"]}
    if 32768 in by:
        r = by[32768]
        result["goals"] = {
            "gpu_kv_le_15pct_at_32k": r["gpu_kv_ratio"] <= 0.15,
            # against the stronger DynamicCache (dynamic_baseline)
            "topk25_ge_1x_dynamic_at_32k": r["topk25_vs_dynamic"] >= 1.0,
            "lossless_ge_0.9x_bound_at_32k": r.get("lossless_vs_bound", 0) >= 0.9,
            "lossless_ge_2x_offload_at_32k": r.get("lossless_vs_offload", 0) >= 2.0,
            "ttft_le_1.1x_at_32k": r["ttft_ratio"] <= 1.1 if "ttft_ratio" in r else None,
        }
        if "topk25_paired_ratio" in r:  # the same figure from side-by-side windows
            result["goals"]["topk25_ge_1x_dynamic_at_32k_paired"] = r["topk25_paired_ratio"] >= 1.0
    result["timed_s"] = round(time.perf_counter() - started, 1)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(f"dynamic floor (256-token context): {result['dynamic_floor_tok_s']} tok/s"
          + (f" (before the warm-up: {result['dynamic_floor_first_tok_s']})"
             if "dynamic_floor_first_tok_s" in result else ""), file=sys.stderr)
    cols = ["context", "gpu_kv_ratio", "topk25_gpu_kv_ratio", "dynamic_tok_s",
            "dynamic_nocudnn_tok_s", "topk25_tok_s", "topk25_nocache_tok_s",
            "topk25_page_cache_hit_rate", "topk25_pages_per_token", "lossless_tok_s",
            "lossless_bound_tok_s", "offload_tok_s", "ttft_dynamic_best_s", "ttft_tiered_s",
            "dynamic_nocudnn_host_ms", "topk25_host_ms"]
    cols += list(dict.fromkeys(k for r in result["contexts"] for k in r
                               if (k.startswith("topk25_pc") and k.endswith(("_tok_s", "_hit_rate")))
                               or k in ("topk25_again_tok_s", "topk25_paired_tok_s",
                                        "dynamic_nocudnn_paired_tok_s", "topk25_paired_ratio")
                               or (k.startswith(("topk25_fused", "topk25_torch"))
                                   and not k.endswith("_layers")
                                   and k.endswith(("_tok_s", "_hit_rate", "_host_ms")))))
    print(" ".join(f"{c:>14}" for c in cols), file=sys.stderr)
    for r in result["contexts"]:
        print(" ".join(f"{str(r.get(c, '-')):>14}" for c in cols), file=sys.stderr)
    print(f"goals: {result.get('goals')}", file=sys.stderr, flush=True)
    # the profiler tables last: a profiler leaves the process slower for a while, and a run cut
    # short by a time limit has every timed figure written already
    if args.profile and args.output:
        for T in args.profile_at:
            if T in by:
                by[T].update(profile_context(model, T, args, device))
        result["total_s"] = round(time.perf_counter() - started, 1)
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
