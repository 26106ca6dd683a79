"""bench/kv.py's top-K variants and the peers beside its main figures: the fused step's choice
split in three, the other of the two top-K paths, top-K and DynamicCache in alternating windows,
what transformers' offload moves, and the profiler tables of a context. (Split out of
bench/kv.py; the figures and their names are its.)"""
from __future__ import annotations

from pathlib import Path

from kv_steps import (backends, cache_kwargs, decode, dynamic_kv_bytes, free, hit_rate,
                      host_ms, host_profile, prefill, profile_steps)


def split_timing(model, cache, tok, steps, device, args, r):
    """The fused step with its choice as one program or as three kernels (kv/fused.py
    ``SPLIT``), whichever is not the default: ``topk25_fused_split_*`` / ``topk25_fused_one_*``."""
    from deepseek_flash.kv import fused as kv_fused

    default = kv_fused.SPLIT[0]
    name = "topk25_fused_one" if default else "topk25_fused_split"

    def rebuild():
        for layer in cache.layers:
            layer._fused, layer._fused_holds = None, False

    kv_fused.SPLIT[0] = not default
    rebuild()
    try:
        before = cache.stats()
        tok, r[f"{name}_tok_s"], _ = decode(model, cache, tok, steps, device, args.warmup,
                                            args.repeats)
        s = cache.stats()
        r[f"{name}_hit_rate"] = hit_rate(before, s)
        r[f"{name}_layers"] = sum(layer._fused is not None and layer._fused.split != default
                                  for layer in cache.layers)
    finally:
        kv_fused.SPLIT[0] = default
        rebuild()
    return tok


def fused_layers(cache, r) -> None:
    """Layers the fused step served (kv/fused.py) and layers it failed on (then torch's)."""
    r["fused_layers"] = sum(layer._fused is not None for layer in cache.layers)
    r["fused_failed_layers"] = sum(layer._fused_failed for layer in cache.layers)
    # layers whose fused step replays its graph over the step's own tensors (no copy, kv/fused.py
    # ``go``): the step's tensors came at the addresses of the step before
    r["fused_direct_layers"] = sum(layer._fused is not None and layer._fused.direct is not None
                                   for layer in cache.layers)
    r["fused_builds"] = sum(layer.fused_builds for layer in cache.layers)  # all layers, so far


def fused_timing(model, cache, tok, steps, device, args, r):
    """Top-K decode through the other path than the cache's default (kv/fused.py's Triton
    step when the default is the torch path, and the other way round): ``topk25_fused_*`` or
    ``topk25_torch_*`` -- tok/s, hit rate, host ms, layers served."""
    from deepseek_flash.kv import fused as kv_fused

    default = cache.fused
    name = "topk25_torch" if default else "topk25_fused"
    cache.fused = not default
    before = cache.stats()
    tok, r[f"{name}_tok_s"], r[f"{name}_host_share"] = decode(model, cache, tok, steps, device,
                                                              args.warmup, args.repeats)
    s = cache.stats()
    r[f"{name}_hit_rate"] = hit_rate(before, s)
    tok, r[f"{name}_host_ms"] = host_ms(model, cache, tok, device)
    if not default:
        fused_layers(cache, r)
    r["fused_default"] = default
    r["fused_available"] = kv_fused.available(cache.layers[-1].device)
    cache.fused = default
    return tok


def paired_timing(model, ids, cache, tok, steps, device, args, r):
    """Top-K (``cache``, the defaults) and ``DynamicCache`` without cuDNN (a second cache of the
    same prompt) timed in alternating windows, ``--pairs`` of each: both eager steps are bound by
    the host, whose speed drifts within a run (the 256-token floor and a later top-K window
    differ by up to 2x), so a ratio of windows taken side by side is the fair one.
    ``topk25_paired_ratio``: the median of the pairs' ratios (top-K / DynamicCache);
    ``*_paired_tok_s``: each side's median."""
    import statistics

    from transformers import DynamicCache

    from deepseek_flash.kv.attention import NAME

    with backends():
        model.set_attn_implementation("sdpa")
        dc = DynamicCache(config=model.config)
        dtok, _ = prefill(model, ids, dc, device)
    tiered, dynamic = [], []
    for _ in range(args.pairs):
        with backends():
            model.set_attn_implementation("sdpa")
            dtok, tok_s, _ = decode(model, dc, dtok, steps, device, args.warmup, 1)
        dynamic.append(tok_s)
        model.set_attn_implementation(NAME)
        tok, tok_s, _ = decode(model, cache, tok, steps, device, args.warmup, 1)
        tiered.append(tok_s)
    del dc
    free(device)
    r["topk25_paired_tok_s"] = round(statistics.median(tiered), 4)
    r["dynamic_nocudnn_paired_tok_s"] = round(statistics.median(dynamic), 4)
    r["topk25_paired_ratio"] = round(statistics.median(t / d for t, d in zip(tiered, dynamic)), 4)
    r["topk25_paired_windows"] = [tiered, dynamic]
    return tok


def peer_figures(model, off, tok, device, args, T, h2d, r) -> None:
    """What ``DynamicCache(offloading=True)`` moves and where its step goes: each step every
    layer's whole keys and values go to the device (``prefetch``) and back to the host
    (``offload``), so both directions carry the full KV a token (``offload_h2d_bytes_per_token``,
    the same D2H); its bound is the H2D rate of this run over those bytes; with
    ``--host-profile`` a profiler table of two of its steps (``kv.offload-<T>.txt``: copies,
    kernels, host calls) and Python's profiler over ten (``kv.hostprof-offload-<T>.txt``)."""
    moved = dynamic_kv_bytes(off)
    r["offload_h2d_bytes_per_token"] = r["offload_d2h_bytes_per_token"] = moved
    if h2d:
        r["offload_bound_tok_s"] = round(h2d * 1e9 / moved, 3)
        r["offload_vs_bound"] = round(r["offload_tok_s"] / r["offload_bound_tok_s"], 3)
        if "lossless_bound_tok_s" in r:
            # the most lossless could show against the peer as measured: its own PCIe bound
            r["lossless_bound_vs_offload"] = round(r["lossless_bound_tok_s"]
                                                   / r["offload_tok_s"], 3)
    if args.host_profile and args.output:
        try:
            out = Path(args.output)
            tok = host_profile(model, off, tok, device,
                               out.with_name(f"kv.hostprof-offload-{T}.txt"))
            r["offload_profile"] = profile_steps(model, off, tok, device,
                                                 out.with_name(f"kv.offload-{T}.txt"))
        except Exception as exc:  # a figure lost, not the run
            r["offload_profile_error"] = repr(exc)


def topk_options(args) -> dict:
    """The top-K cache's settings past ``top_k_pages``: the library's defaults, or the
    ``--page-cache`` multiple the run asked for (recorded as ``topk25_page_cache``)."""
    return {} if args.page_cache is None else {"page_cache": args.page_cache}


def past_page_write(model, cache, tok):
    """Decode steps until a page has just been written and the step after it has run (where
    the top-K layers recapture their graphs, every ``page_tokens`` steps): the profiled steps
    that follow are ordinary ones."""
    import torch

    last = cache.layers[-1]
    with torch.no_grad():
        for _ in range(cache.page_tokens + 1):
            before = last.n_pages
            tok = model(tok, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
            if last.n_pages != before:
                return model(tok, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
    return tok


def profile_context(model, T, args, device) -> dict:
    """Profiler tables of 2 decode steps of DynamicCache (cuDNN left out), top-K 25 % and
    lossless at context ``T``, in a pass of their own after every timed figure (a profiler
    leaves the process slower to dispatch for a while: nothing timed comes after it), the tiered
    ones away from a page write (no graph recapture among them)."""
    import torch
    from transformers import DynamicCache

    from deepseek_flash.kv import TieredCache

    ids = torch.randint(1, model.config.vocab_size, (1, T),
                        generator=torch.Generator().manual_seed(T)).to(device)
    path = Path(args.output)
    out = {}
    model.set_attn_implementation("sdpa")
    with backends():
        dc = DynamicCache(config=model.config)
        tok, _ = prefill(model, ids, dc, device)
        tok, _, _ = decode(model, dc, tok, 1, device, 2, 1)
        out["dynamic_nocudnn_profile"] = profile_steps(
            model, dc, tok, device, path.with_suffix(f".dynamic_nocudnn-{T}.txt"))
    del dc
    free(device)
    cache = TieredCache.for_model(model, top_k_pages=0.25, **topk_options(args))
    tok, _ = prefill(model, ids, cache, device)
    tok = past_page_write(model, cache, tok)
    default = cache.fused
    other = "topk25_torch" if default else "topk25_fused"  # kv/fused.py's step, or not
    modes = [("topk25", 0.25, default), ("lossless", None, default)]
    if args.fused:
        modes.insert(1, (other, 0.25, not default))
    for mode, top_k, use_fused in modes:
        cache.top_k_pages, cache.fused = top_k, use_fused
        tok, _, _ = decode(model, cache, tok, 1, device, 2, 1)
        out[f"{mode}_profile"] = profile_steps(model, cache, tok, device,
                                               path.with_suffix(f".{mode}-{T}.txt"))
    cache.fused = default
    cache.close()
    del cache
    free(device)
    return out
