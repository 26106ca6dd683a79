"""bench/kv.py's measuring: the random-weight model of a shape, one prompt's prefill, decode tok/s
in timed windows, the host's time to issue a step, Python's and torch's profilers over a few
steps, the 256-token floor, the pinned host->GPU rate, and the DynamicCache variants the goals
compare against. (Split out of bench/kv.py; the figures and their names are its.)"""
from __future__ import annotations

import contextlib
import gc
import json
import time
from pathlib import Path

SHAPES = {
    "llama": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                  vocab_size=128256, num_attention_heads=32, num_key_value_heads=8,
                  rope_theta=500000.0),
    "qwen2": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
                  vocab_size=152064, num_attention_heads=28, num_key_value_heads=4,
                  rope_theta=1000000.0),
    "mistral": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                    vocab_size=32768, num_attention_heads=32, num_key_value_heads=8,
                    rope_theta=1000000.0, sliding_window=None),
}
SMOKE = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, vocab_size=256,
             num_attention_heads=4, num_key_value_heads=2)


def build(arch: str, smoke: bool, max_pos: int, device: str):
    import torch
    import transformers

    shape = dict(SMOKE if smoke else SHAPES[arch])
    if arch == "mistral":
        shape["sliding_window"] = None
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[arch]
    cfg = cls(max_position_embeddings=max_pos, tie_word_embeddings=False, **shape)
    dtype = torch.float32 if smoke else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():  # small finite weights: random init can overflow bf16 over 32 layers
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    return model.eval()


def sync(device):
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cache_kwargs(model, cache) -> dict:
    """The cache under the keyword the installed transformers takes (``past_key_values`` up to
    the rename, ``cache`` after): a cache under the other keyword would be ignored and the model
    would run with a fresh cache of its own."""
    from deepseek_flash.kv import cache_kwargs as kwargs_for
    return kwargs_for(model, cache)


def prefill(model, ids, cache, device):
    import torch
    sync(device)
    t = time.perf_counter()
    with torch.no_grad():
        logits = model(ids, **cache_kwargs(model, cache), logits_to_keep=1).logits[:, -1]
    tok = logits.argmax(-1, keepdim=True)
    sync(device)
    return tok, time.perf_counter() - t


def decode(model, cache, tok, steps, device, warmup=4, repeats=2):
    """Decode tok/s: ``warmup`` untimed steps, then the best of ``repeats`` timed windows of
    ``steps`` steps (the same for every mode, so no mode is timed cold). Also the share of a
    window the host spent queueing the steps: near 1.0 the host (Python, launches) is the bound,
    well below it the device is."""
    import torch
    with torch.no_grad():
        for _ in range(warmup):
            tok = model(tok, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
        sync(device)
        best = None
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(steps):
                tok = model(tok, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
            queued = time.perf_counter() - t
            sync(device)
            total = time.perf_counter() - t
            if best is None or total < best[0]:
                best = (total, queued)
    return tok, steps / best[0], round(best[1] / best[0], 3)


def hit_rate(before: dict, after: dict) -> float | None:
    """The page cache's hit rate between two ``cache.stats()`` (None where no top-K page was
    chosen in between)."""
    hits = after["page_cache_hits"] - before["page_cache_hits"]
    misses = after["page_cache_misses"] - before["page_cache_misses"]
    return round(hits / (hits + misses), 4) if hits + misses else None


def host_ms(model, cache, tok, device, tries: int = 3):
    """The host's time to issue one decode step with the device idle before it (a sync first),
    ms, best of ``tries``: what the step costs the host alone, where a window's time is the
    slower of host and device (its launches block only once the device's queue is full)."""
    import torch
    best = None
    with torch.no_grad():
        for _ in range(tries):
            sync(device)
            t = time.perf_counter()
            tok = model(tok, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
            took = time.perf_counter() - t
            best = took if best is None else min(best, took)
    sync(device)
    return tok, round(best * 1e3, 2)


def host_profile(model, cache, tok, device, path: Path, steps: int = 10):
    """Python's profiler (cProfile) over ``steps`` decode steps, the device synchronised after
    each: where the host's time of a step goes, function by function (by own time, then by
    cumulative time), written to ``path``. -> the last token."""
    import cProfile
    import io
    import pstats

    import torch
    prof = cProfile.Profile()
    with torch.no_grad():
        for _ in range(steps):
            sync(device)
            prof.enable()
            tok = model(tok, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
            prof.disable()
    sync(device)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    text.write(f"{steps} steps, the device synchronised after each\n")
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumtime").print_stats(60)
    path.write_text(text.getvalue())
    return tok


def profile_steps(model, cache, tok, device, path: Path, steps: int = 2) -> dict:
    """A torch profiler over ``steps`` decode steps: kernels and device time per step (what the
    device does) against the wall time per step (what the step costs); the table goes to
    ``path``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with torch.no_grad(), profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            tok = model(tok, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
        sync(device)
        wall = time.perf_counter() - t
    events = prof.key_averages()
    kernels = device_us = 0.0
    for e in events:
        on_device = str(getattr(e, "device_type", "")).endswith("CUDA")
        if on_device or (not e.key.startswith("aten::") and "::" not in e.key
                         and getattr(e, "self_device_time_total", 0.0) > 0
                         and getattr(e, "cpu_time_total", 0.0) == 0):
            kernels += e.count  # a kernel or a copy on the device
            device_us += getattr(e, "self_device_time_total", 0.0)
    ops = sum(e.count for e in events if e.key.startswith("aten::"))
    table = None
    keys = (("self_device_time_total", "self_cuda_time_total") if len(activities) > 1 else ())
    for key in (*keys, "self_cpu_time_total"):
        try:
            table = events.table(sort_by=key, row_limit=40)
            break
        except Exception:  # a sort key this torch does not know
            continue
    table = table if table is not None else events.table(row_limit=40)
    if keys:  # and where the host's time goes (launches, graph replays, dispatch)
        try:
            table += ("\n\nby host time:\n"
                      + events.table(sort_by="self_cpu_time_total", row_limit=40))
        except Exception:
            pass
    path.write_text(table + "\n")
    host = {e.key: e for e in events if e.key in ("cudaGraphLaunch", "cudaLaunchKernel")}
    launches = {f"{name}_per_step": host[name].count / steps for name in host}
    launches.update({f"{name}_us_per_call": round(host[name].self_cpu_time_total
                                                  / max(1, host[name].count), 2)
                     for name in host})
    return {**launches, "wall_ms_per_step": round(wall * 1e3 / steps, 2),
            "device_ms_per_step": round(device_us / 1e3 / steps, 2),
            "kernels_per_step": kernels / steps, "aten_ops_per_step": ops / steps,
            "table": path.name}


def floor_tok_s(model, args, device, T=256) -> float:
    """``DynamicCache`` decode tok/s at a short context, cuDNN left out: the eager step's cost apart from
    attention over a long context (the host-bound floor every mode here runs on)."""
    import torch
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    ids = torch.randint(1, model.config.vocab_size, (1, T),
                        generator=torch.Generator().manual_seed(1)).to(device)
    with backends():
        dc = DynamicCache(config=model.config)
        tok, _ = prefill(model, ids, dc, device)
        _, tok_s, _ = decode(model, dc, tok, args.decode, device, args.warmup, args.repeats)
    del dc
    free(device)
    return round(tok_s, 3)


def dynamic_kv_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values) if t is not None)


def h2d_rate(device, nbytes) -> float:
    """Pinned host->device copy rate, GB/s (best of 3)."""
    import torch
    if not device.startswith("cuda"):
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    del src, dst
    return round(best, 2)


def free(device):
    import torch
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def backends():
    """Attention without cuDNN's kernel, as the tiered cache runs it (deepseek_flash/cuda.py)."""
    from deepseek_flash.cuda import sdpa_backends
    return sdpa_backends(None)


def dynamic_variants():
    """``DynamicCache``'s two runs, (name, context manager): as a default user gets it (torch
    picks the attention kernel: cuDNN's where present, which plans every new key length), and
    with cuDNN left out, as our paths run (deepseek_flash.cuda.SDPA_BACKENDS). The stronger one
    (``stronger_dynamic``) is the baseline goals use; bench/kv_prune.py's Show runs the same."""
    return (("dynamic", contextlib.nullcontext), ("dynamic_nocudnn", backends))


def stronger_dynamic(tok_s: dict) -> str:
    """The name of the faster of ``dynamic_variants`` given their tok/s by name."""
    return max(tok_s, key=tok_s.get)


def checkpoint(args, r) -> None:
    """The context's figures so far next to ``--output`` (``<output>.partial.json``): a run cut
    short by a time limit keeps what it measured."""
    if getattr(args, "output", None) and getattr(args, "record", True):
        Path(args.output).with_suffix(".partial.json").write_text(json.dumps(r, indent=1) + "\n")
