"""Benchmark: an 8B-shaped model at 128K context within a 16 GiB GPU budget -- the weights streamed
under a weight budget (``load_model(..., weight_budget=...)``), the KV in the tiered cache
(``TieredCache.for_model``, its defaults), the prompt prefilled in chunks.

Random-weight ``--arch`` 7-8B shape (bf16, ~15-16 GB: it cannot be resident in 16 GiB), written
once to a store under ``--dir`` (bench/_common.py's helpers, as bench/stream.py), loaded by the
embedded controller with the defaults a user gets apart from the budget (and a host cache that
holds the model, the one size a user sets for their machine). In one run:

* the GPU capped at ``--gpu-goal`` (16 GiB): torch's allocator -- which holds the weights' GPU
  arena (embedded controller) as well as the activations and the KV -- limited to the goal minus
  what the process held outside it at the start (the CUDA context); a run that does not fit
  fails with an out-of-memory error, reported in the JSON;
* prefill of ``--context`` tokens in forwards of ``--prefill-chunk`` tokens (each streams the
  weights once; what ``generate(..., prefill_chunk_size=...)`` does), time to first token;
* decode tok/s with top-K 25 % of the pages (``top_k_pages=0.25``; without the top-K page cache,
  ``page_cache=0``: on by default, its slots -- 1.5x the chosen pages of every top-K layer, ~6 GB
  at 128K on this shape -- do not fit the budget), then lossless (every page),
  on the same cache, each against the PCIe bound of its bytes: weights streamed per token (the
  runtime's counter) plus KV pages fetched per token, over the pinned host->GPU rate measured in
  this run;
* GPU memory: torch's peak allocated and reserved, the memory outside torch (CUDA context), the
  reserved peak plus it (``gpu_process_peak_bytes``: what the process held, at most the cap), the
  allocated peak plus it (``gpu_needed_peak_bytes``: what it needed; torch keeps freed blocks
  cached up to its cap), the device's used memory sampled by a thread
  (``gpu_device_used_peak_bytes``, what ``nvidia-smi`` shows) and the KV's share; the goal line
  ``gpu_peak_le_goal`` (held and sampled peaks within the goal, and no error).

``--quantize int8_symmetric --budget none`` is a second row, lossy and not the default: the same
model packed as int8 (per block of 128; +0.02 % perplexity on the trained model,
docs/benchmarks.md), resident (8.6 GB), the KV tiered the same way.

``--smoke`` runs a tiny model on the CPU with everything scaled down (budget, recent window,
prompt, chunk) and checks the plumbing: layers streamed, pages on the host, top-K fetching fewer
pages than lossless, and the lossless greedy tokens identical to the resident model's with a
``DynamicCache`` (what tests/kv/test_kv_16g.py runs).

    python bench/kv_16g.py --dir /var/tmp/flash-bench [--arch llama] [--context 131072]
        [--budget 7GiB] [--output kv16.json]
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import threading
import time
from pathlib import Path

from _common import add_arch_argument, pinned_h2d, save, write_finite_model

GIB = 1 << 30
SMOKE = dict(context=400, prefill_chunk=128, gpu_tokens=64, decode=6, warmup=1, layers=4)


def log(started: float, msg: str) -> None:
    print(f"[{time.perf_counter() - started:7.1f}s] {msg}", file=sys.stderr, flush=True)


class GpuMemory:
    """What the process holds on the GPU. ``cap`` limits torch's allocator (the weights' arena of
    the embedded controller, activations, KV) to ``goal`` minus what was outside it at the start,
    and again after the warm-up (``recap``: the CUDA libraries load kernels and make their handles
    lazily, ~300 MB on the H200 after the start); a thread samples the device's used memory
    (driver level, as ``nvidia-smi``)."""

    def __init__(self, device: str, goal: int, margin: int = 256 << 20, interval: float = 0.05):
        import torch

        self.torch, self.device, self.goal, self.margin = torch, device, goal, margin
        torch.cuda.synchronize(device)
        free, self.total = torch.cuda.mem_get_info(device)
        self.outside_torch = self.total - free - torch.cuda.memory_reserved(device)
        self.cap = goal - self.outside_torch - margin
        torch.cuda.set_per_process_memory_fraction(self.cap / self.total, device)
        torch.cuda.reset_peak_memory_stats(device)
        self.peak_used = self.total - free
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._sample, daemon=True, name="gpu-mem")
        self._thread.start()

    def recap(self) -> None:
        """The cap again, from what is outside torch now (after the warm-up has used every
        kernel and library handle the run needs), with a smaller margin."""
        torch = self.torch
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        outside = self.used() - torch.cuda.memory_reserved(self.device)
        self.outside_torch = max(self.outside_torch, outside)
        self.cap = self.goal - self.outside_torch - self.margin // 2
        torch.cuda.set_per_process_memory_fraction(self.cap / self.total, self.device)

    def used(self) -> int:
        free, total = self.torch.cuda.mem_get_info(self.device)
        return total - free

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.peak_used = max(self.peak_used, self.used())
            except Exception:  # the context is gone (the process is ending)
                return

    def report(self) -> dict:
        torch = self.torch
        used = self.used()
        self.peak_used = max(self.peak_used, used)
        # what the CUDA libraries allocated outside torch since the start counts too
        outside = max(self.outside_torch, used - torch.cuda.memory_reserved(self.device))
        reserved = torch.cuda.max_memory_reserved(self.device)
        return {"gpu_goal_bytes": self.goal, "gpu_torch_cap_bytes": self.cap,
                "gpu_outside_torch_bytes": outside,
                "gpu_torch_peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                "gpu_torch_peak_reserved_bytes": reserved,
                "gpu_process_peak_bytes": outside + reserved,
                # what the process needed at its peak (torch caches freed blocks up to its cap:
                # the reserved peak shows the cap as much as the need)
                "gpu_needed_peak_bytes": outside + torch.cuda.max_memory_allocated(self.device),
                "gpu_device_used_peak_bytes": self.peak_used}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def prepare(args, work: Path):
    """The source checkpoint and its packed store under ``work`` (written once; with
    ``--quantize``, a store of its own)."""
    from deepseek_flash.quant import QuantSpec
    from deepseek_flash.store import pack

    if args.smoke:
        from deepseek_flash.testing import make_tiny_model

        src = work / f"src-smoke-{args.arch}"
        if not (src / "config.json").exists():
            make_tiny_model(src, args.arch, num_layers=SMOKE["layers"], hidden_size=64,
                            intermediate_size=512, max_position_embeddings=1024, seed=3)
        store_dir = work / f"store-smoke-{args.arch}"
    else:
        src = write_finite_model(work / args.arch / "src", args.arch)
        store_dir = work / args.arch / "store"
    quant = None
    if args.quantize:
        quant = QuantSpec(args.quantize, "per_block", 32 if args.smoke else 128)
        store_dir = store_dir.with_name(f"{store_dir.name}-{args.quantize}")
    if not (store_dir / "flash_metadata.bin").exists():
        pack(src, store_dir, quant=quant)
    return src, store_dir


def smoke_budget(store) -> int:
    """The 8B run's budget share scaled to a tiny model: two thirds of its bytes, at least the
    anchors and two slots (every layer's MLP could stream), so that some layers stream."""
    from deepseek_flash.daemon.planner import resident_minimum

    return max(resident_minimum(store.blocks), 2 * store.total_bytes // 3)


def prefill(model, ids, cache, chunk: int, started: float, sync, memory=None):
    """The prompt in forwards of ``chunk`` tokens (as transformers' ``prefill_chunk_size``): the
    first token and the seconds it took."""
    import torch

    from deepseek_flash.kv import cache_kwargs

    sync()
    t = time.perf_counter()
    n = ids.shape[1]
    with torch.no_grad():
        for i, a in enumerate(range(0, n, chunk)):
            logits = model(ids[:, a:a + chunk], **cache_kwargs(model, cache),
                           logits_to_keep=1).logits
            if memory is not None and (i % 4 == 3 or a + chunk >= n):
                sync()
                log(started, f"prefill {min(n, a + chunk)}/{n} tokens, "
                             f"{time.perf_counter() - t:.1f} s, GPU used "
                             f"{memory.used() / GIB:.2f} GiB")
    tok = logits[:, -1].argmax(-1, keepdim=True)
    sync()
    return tok, time.perf_counter() - t


def decode(model, cache, tok, steps: int, warmup: int, sync):
    """``warmup`` untimed then ``steps`` timed greedy steps: (last token, tok/s, the tokens)."""
    import torch

    from deepseek_flash.kv import cache_kwargs

    out = []
    with torch.no_grad():
        for _ in range(warmup):
            tok = model(tok, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
            out.append(tok)
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            tok = model(tok, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
            out.append(tok)
        sync()
        dt = time.perf_counter() - t
    return tok, steps / dt, torch.cat(out, 1)


def timed_mode(name, model, cache, runtime, tok, args, sync, h2d, res):
    """Decode in the cache's current mode; tok/s and the bytes a token moved over PCIe (weights
    streamed + KV pages fetched) against the bound they allow at ``h2d`` GB/s."""
    def streamed():
        if runtime is None:  # resident weights: none cross the link
            return 0, 0
        r = runtime.stats()
        return r["bytes_streamed"], r["passes"]

    s0, r0 = cache.stats(), streamed()
    tok, tok_s, tokens = decode(model, cache, tok, args.decode, args.warmup, sync)
    s1, r1 = cache.stats(), streamed()
    steps = args.decode + args.warmup
    pages = (s1["pages_fetched"] - s0["pages_fetched"]) / steps
    weights = (r1[0] - r0[0]) / max(1, r1[1] - r0[1])
    kv = pages * s1["page_bytes"]
    res[f"{name}_tok_s"] = round(tok_s, 3)
    res[f"{name}_kv_pages_per_token"] = pages
    res[f"{name}_kv_bytes_per_token"] = round(kv)
    res[f"{name}_weight_bytes_per_token"] = round(weights)
    if h2d:
        bound = h2d * 1e9 / (kv + weights)
        res[f"{name}_bound_tok_s"] = round(bound, 3)
        res[f"{name}_vs_bound"] = round(tok_s / bound, 3)
    return tok, tokens


def reference_tokens(src, ids, steps: int):
    """Greedy tokens of the resident model (plain transformers) with a ``DynamicCache``."""
    import torch
    from transformers import DynamicCache

    from deepseek_flash.kv import cache_kwargs
    from deepseek_flash.testing import load_reference

    ref = load_reference(src)
    cache = DynamicCache(config=ref.config)
    out = []
    with torch.no_grad():
        tok = ref(ids, **cache_kwargs(ref, cache), logits_to_keep=1).logits[:, -1:].argmax(-1)
        out.append(tok)
        for _ in range(steps - 1):
            tok = ref(tok, **cache_kwargs(ref, cache)).logits[:, -1:].argmax(-1)
            out.append(tok)
    return torch.cat(out, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/flash-bench", help="where the store is written")
    add_arch_argument(ap)
    ap.add_argument("--context", type=int, default=131072, help="prompt tokens")
    ap.add_argument("--budget", default="7GiB",
                    help="weight budget on the GPU; 'none': the whole model resident")
    ap.add_argument("--quantize", choices=("int8_symmetric", "int4_symmetric"), default=None,
                    help="lossy, not the default: a quantized store (per_block, groups of 128; 32 with --smoke)")
    ap.add_argument("--gpu-goal", default="16GiB", help="what the process may hold on the GPU")
    ap.add_argument("--host-cache", default="20GiB", help="the controller's host cache")
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="tokens per prefill forward")
    ap.add_argument("--decode", type=int, default=8, help="timed decode steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps per mode")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, scaled down")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    started = time.perf_counter()

    import torch
    import transformers

    from deepseek_flash.client import Client
    from deepseek_flash.client.model import load_model
    from deepseek_flash.kv import TieredCache
    from deepseek_flash.sizes import parse_size
    from deepseek_flash.store import Store

    if args.smoke:
        device = "cpu"
        for key in ("context", "prefill_chunk", "decode", "warmup"):
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, SMOKE[key])
    elif not torch.cuda.is_available():
        print("bench/kv_16g.py: no CUDA device (use --smoke on a CPU)", file=sys.stderr)
        return 2
    else:
        device = "cuda:0"
    cuda = device.startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    work = Path(args.dir)
    src, store_dir = prepare(args, work)
    store = Store.open(store_dir)
    if args.budget.lower() == "none":
        budget = None
    else:
        budget = smoke_budget(store) if args.smoke else parse_size("budget", args.budget)
    goal = parse_size("gpu-goal", args.gpu_goal)
    res = {"bench": "kv_16g", "arch": args.arch, "smoke": args.smoke,
           "date": datetime.date.today().isoformat(), "machine": platform.node(),
           "gpu": torch.cuda.get_device_name(0) if cuda else None, "torch": torch.__version__,
           "transformers": transformers.__version__, "quantize": args.quantize,
           "model_bytes": store.total_bytes,
           "budget_bytes": budget, "context": args.context, "prefill_chunk": args.prefill_chunk,
           "decode_steps": args.decode, "prepare_s": round(time.perf_counter() - started, 1)}
    log(started, f"store ready: {store.total_bytes / GIB:.2f} GiB, budget "
                 + ("none (resident)" if budget is None else f"{budget / GIB:.2f} GiB"))
    h2d = pinned_h2d(1 << 30) if cuda else 0.0
    res["pinned_h2d_gbps"] = h2d
    memory = GpuMemory(device, goal) if cuda else None
    client = model = cache = None
    phase = "load"
    raise_after = None

    def checkpoint():
        """The memory figures and the goal line as of now, written with everything measured so
        far (a run stopped by a time limit keeps them)."""
        if memory is not None:
            try:
                res.update(memory.report())
            except Exception as exc:  # a CUDA error left the context unusable
                res["gpu_report_error"] = f"{type(exc).__name__}: {exc}"
        if "gpu_process_peak_bytes" in res:
            res["goals"] = {"gpu_peak_le_goal": res["gpu_process_peak_bytes"] <= goal
                            and res["gpu_device_used_peak_bytes"] <= goal
                            and "error" not in res}
        res["total_s"] = round(time.perf_counter() - started, 1)
        save(res, args.output)

    try:
        config = {"host_cache_bytes": "64MiB" if args.smoke else args.host_cache}
        client = Client(embedded=True, config=config)
        t = time.perf_counter()
        model = load_model(store_dir, device=device, client=client, weight_budget=budget)
        model.flash.wait_loaded()
        if cuda:
            client._backend.fabric.pin_host()  # the host arena page-locked, as a server has it
        res["load_s"] = round(time.perf_counter() - t, 1)
        runtime = model.flash.stream  # None: the whole model resident
        if runtime is not None:
            plan = runtime.plan
            res["plan"] = {"streamed_layers": len(plan.streamed_layers), "slots": plan.n_slots,
                           "slot_bytes": plan.slot_bytes, "resident_bytes": plan.resident_bytes,
                           "budget_used_bytes": plan.resident_bytes
                           + plan.n_slots * plan.slot_bytes}
        else:
            res["plan"] = {"streamed_layers": 0, "resident_bytes": store.total_bytes}
        if memory is not None:
            res["gpu_used_after_load_bytes"] = memory.used()
        checkpoint()
        log(started, f"loaded in {res['load_s']} s: {res['plan']['streamed_layers']} of "
                     f"{store.num_layers} layers streamed"
                     + (f", GPU used {memory.used() / GIB:.2f} GiB" if memory else ""))
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(args.context)
        ids = torch.randint(1, vocab, (1, args.context), generator=gen).to(device)
        if cuda:  # untimed: kernels, streams, the copy ring and the cache's paths once, short
            phase = "warm-up"
            warm = TieredCache.for_model(model, top_k_pages=0.25, page_cache=0)
            tok, _ = prefill(model, ids[:, :1024], warm, 512, started, sync)
            decode(model, warm, tok, 2, 0, sync)
            warm.close()
            del warm
            gc.collect()
            memory.recap()
            log(started, f"warm-up done; torch capped at {memory.cap / GIB:.2f} GiB "
                         f"({memory.outside_torch / GIB:.2f} GiB outside it)")

        phase = "prefill"
        cache_args = {"gpu_tokens": SMOKE["gpu_tokens"]} if args.smoke else {}
        # the top-K page cache (on by default, kv/pagecache.py) would hold ~6 GB of slots at
        # 128K on this shape: left out here, the 16 GiB budget is the goal
        cache = TieredCache.for_model(model, top_k_pages=0.25, page_cache=0, **cache_args)
        tok, res["ttft_s"] = prefill(model, ids, cache, args.prefill_chunk, started, sync, memory)
        res["ttft_s"] = round(res["ttft_s"], 3)
        first = tok
        s = cache.stats()
        res["kv"] = {k: s[k] for k in ("page_tokens", "pages", "gpu_bytes", "host_bytes",
                                       "full_bytes", "mirrored_pages", "arena_fallbacks")}
        if memory is not None:
            res["gpu_used_after_prefill_bytes"] = memory.used()
            res["gpu_torch_peak_allocated_prefill_bytes"] = torch.cuda.max_memory_allocated()
        checkpoint()
        log(started, f"prefill {args.context} tokens: TTFT {res['ttft_s']} s; KV on the GPU "
                     f"{s['gpu_bytes'] / GIB:.2f} GiB of {s['full_bytes'] / GIB:.2f} GiB")

        phase = "decode top-K 25 %"
        tok, topk_tokens = timed_mode("topk25", model, cache, runtime, tok, args, sync, h2d, res)
        # layers whose top-K pages came by one gather over their host chunks (kv/span.py), and
        # whose choice and gather replayed as a captured CUDA graph (kv/graphs.py)
        res["topk25_one_gather_layers"] = sum(x.pages._span is not None for x in cache.layers)
        res["topk25_graph_layers"] = sum(x.graphs.graph is not None for x in cache.layers)
        checkpoint()
        log(started, f"top-K 25 %: {res['topk25_tok_s']} tok/s (bound "
                     f"{res.get('topk25_bound_tok_s')}), one gather in "
                     f"{res['topk25_one_gather_layers']} layers")
        phase = "decode lossless"
        cache.top_k_pages = None
        tok, _ = timed_mode("lossless", model, cache, runtime, tok, args, sync, h2d, res)
        log(started, f"lossless: {res['lossless_tok_s']} tok/s (bound "
                     f"{res.get('lossless_bound_tok_s')})")
        checkpoint()
        s = cache.stats()
        res["kv_gpu_bytes"] = s["gpu_bytes"]
        res["kv_host_bytes"] = s["host_bytes"]
        res["kv_arena_fallbacks"] = s["arena_fallbacks"]
        if runtime is not None:
            res["runtime"] = {k: v for k, v in runtime.stats().items() if k != "decisions"}
        if args.smoke:
            phase = "parity"
            # lossless from the start, on a new cache: the tokens of the resident model
            lossless = TieredCache.for_model(model, **cache_args)
            tok0, _ = prefill(model, ids, lossless, args.prefill_chunk, started, sync)
            _, _, got = decode(model, lossless, tok0, args.decode - 1, 0, sync)
            got = torch.cat((tok0, got), 1).cpu()
            want = reference_tokens(src, ids.cpu(), args.decode)
            res["lossless_tokens_identical_to_resident"] = bool(torch.equal(got, want))
            res["topk25_first_token_identical"] = bool(torch.equal(first.cpu(), want[:, :1]))
            res["lossless_pages"] = lossless.stats()["pages"]
            lossless.close()
        phase = "done"
    except torch.OutOfMemoryError as exc:
        res["error"] = f"out of GPU memory during {phase}: {str(exc).splitlines()[0]}"
        stats = torch.cuda.memory_stats()
        res["oom_memory_stats"] = {k: stats.get(k) for k in (
            "allocated_bytes.all.current", "reserved_bytes.all.current",
            "inactive_split_bytes.all.current", "num_alloc_retries", "num_ooms")}
        log(started, res["error"])
    except Exception as exc:  # reported with what was measured so far
        res["error"] = f"{type(exc).__name__} during {phase}: {exc}"
        log(started, res["error"])
        raise_after = exc
    finally:
        checkpoint()
        if memory is not None:
            memory.close()
    for what in (cache, model and model.flash, client):
        if what is not None:
            try:
                what.close()
            except Exception as exc:  # after a failure: what was measured is written already
                log(started, f"closing {type(what).__name__}: {exc}")
    print(json.dumps(res, indent=1))
    if raise_after is not None:
        raise raise_after
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
