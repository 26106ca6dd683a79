"""Benchmark: decoding a model larger than its GPU weight budget, against the PCIe bound.

Random 7-8B-shaped model (``--arch llama|qwen2|mistral``, bf16, ~15-16 GB), weight budget 8 GiB
(about half of it streams), the controller's default configuration (only the host cache is sized
to hold the model: the one size a user sets for their machine):

* decode tok/s at batch 1 vs the bound: streamed bytes per token / pinned host->GPU rate measured
  in this run (or the fully resident decode rate, if lower), and vs accelerate's
  ``device_map="auto"`` with ``max_memory={0: budget}`` in the same run (each of its tokens timed
  alone after a warm-up; its median token's rate, the spread kept);
* ``--windows default,1,projection``: the default window and others (a window, a ring of
  projections, ``window_context``), one streamed load after the other in the same run
  (``windows`` in the JSON; the first sets the top-level keys);
* batch 1, 4, 16, 32: tok/s vs min(B x batch-1 bound, resident decode rate at batch B);
* prefetch hit rate in steady decode, ``fabric_stall_cycles`` per token;
* time to first token from a cold model (page cache dropped) vs loading the whole model first.

    python bench/stream.py --arch qwen2 --dir /var/tmp/flash-bench [--budget 8GiB] [--output stream.json]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

from _common import add_arch_argument, drop_caches, emit, pinned_h2d, save, write_finite_model

PROMPT = 16


def decode_rate(model, batch: int, tokens: int, device="cuda:0") -> tuple[float, object]:
    """Decode tokens/s (all sequences): (generate N+1) - (generate 1), so prefill is excluded."""
    import torch

    ids = torch.randint(0, 32000, (batch, PROMPT), device=device,
                        generator=torch.Generator(device=device).manual_seed(batch))
    mask = torch.ones_like(ids)

    def gen(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t, out

    gen(2)                                    # warm-up: kernels, allocator, slots primed
    t1, _ = gen(1)
    tn, out = gen(tokens + 1)
    return batch * tokens / max(tn - t1, 1e-9), out


class _StepClock:
    """A logits processor that records when each decode step's logits are ready (the compute
    stream synchronised first): the gaps between calls are per-token decode times. Only the
    stream the logits come from: a device-wide synchronize would also wait for the copies a
    streamed model has already queued for the next pass (~22 ms for qwen2's ring of three) --
    then the link idles while the host starts that pass, which no ``generate`` of a user's
    does (its own per-step check waits on the compute stream alone)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        import torch

        torch.cuda.current_stream(scores.device).synchronize()
        self.times.append(time.perf_counter())
        return scores


def token_times(model, tokens: int, warmup: int, device="cuda:0") -> list[float]:
    """Seconds per decode token at batch 1, each token timed alone: one ``generate`` of
    ``warmup + tokens + 1`` new tokens; the prefill and the first ``warmup`` decode steps
    (allocator, kernels, first offload moves) are left out."""
    import torch
    from transformers import LogitsProcessorList

    ids = torch.randint(0, 32000, (1, PROMPT), device=device,
                        generator=torch.Generator(device=device).manual_seed(1))
    clock = _StepClock()
    n = warmup + tokens + 1
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                   do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    return gaps[warmup:]


def spread(seconds: list[float]) -> dict:
    """tok/s of the median token, the mean, the fastest and slowest token, and the tokens' ms."""
    import statistics

    return {"median_tok_s": round(1 / statistics.median(seconds), 3),
            "mean_tok_s": round(len(seconds) / sum(seconds), 3),
            "fastest_tok_s": round(1 / min(seconds), 3), "slowest_tok_s": round(1 / max(seconds), 3),
            "token_ms": [round(t * 1e3, 1) for t in seconds]}


class _GcPauses:
    """The garbage collector's pauses while it is entered (gc.callbacks): generation and ms."""

    def __enter__(self):
        import gc

        self.pauses, self._t = [], None
        gc.callbacks.append(self._callback)
        return self

    def _callback(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.pauses.append((info["generation"], round((time.perf_counter() - self._t) * 1e3, 2)))

    def __exit__(self, *exc):
        import gc

        gc.callbacks.remove(self._callback)


def copy_idle(trace: list[dict], layers: int) -> dict:
    """Where the copy stream idled in a ``StreamRuntime.copy_trace``: per streamed layer index,
    the mean gap (ms) between the previous copy's end and this copy's start, and per pass the
    copies' busy time and the idle time, over the passes traced whole."""
    by_pass: dict = {}
    prev_end = None
    for c in trace:
        gap = None if prev_end is None else max(0.0, c["start_ms"] - prev_end)
        by_pass.setdefault(c["pass"], {})[c["idx"]] = (gap, c["end_ms"] - c["start_ms"])
        prev_end = c["end_ms"]
    whole = [p for p in by_pass.values() if len(p) == layers and all(g is not None for g, _ in p.values())]
    if not whole:
        return {}
    return {"passes": len(whole),
            "busy_ms_per_pass": round(sum(sum(d for _, d in p.values()) for p in whole) / len(whole), 2),
            "idle_ms_per_pass": round(sum(sum(g for g, _ in p.values()) for p in whole) / len(whole), 2),
            "idle_before_idx_ms": [round(sum(p[i][0] for p in whole) / len(whole), 2)
                                   for i in range(layers)]}


def rebound(run: dict, h2d: float, resident_tok_s: dict) -> None:
    """``run``'s bound and ratios again for a link of ``h2d`` GB/s (the bound: B x that link's
    rate for the run's streamed bytes per token, or the resident rate at B if lower)."""
    link1 = h2d * 1e9 / run["plan"]["streamed_bytes_per_token"]
    run["bound_batch1_tok_s"] = round(min(link1, resident_tok_s.get(1, link1)), 3)
    run["vs_bound"] = {b: round(rate / min(int(b) * link1, resident_tok_s.get(b, int(b) * link1)), 3)
                       for b, rate in run["streamed_tok_s"].items()}
    run["bound_h2d_gbps"] = h2d


def streamed_run(store, store_dir, client, budget, context, batches, tokens, h2d, resident_tok_s,
                 resident_out, device="cuda:0", cudnn: bool = False, first_out=None) -> dict:
    """One streamed load under ``budget`` with ``flash_context`` ``context`` (None: the default
    a user gets): its plan, tok/s per batch against the bound, hit rate, stalls, window decisions,
    the collector's pauses while decoding, where the copy stream idled (batch 1). ``cudnn``: an
    experiment -- the model's attention left to torch's own choice of kernel (cuDNN's included,
    as before ``load_model`` left it out). ``first_out``: {batch: tokens} of an earlier run in
    this process, filled by the first run, compared by the later ones (a plan against another
    where the resident run is skipped)."""
    import torch
    from deepseek_flash.client.model import load_model
    from deepseek_flash.cuda import unwrapped_forward

    res = {"flash_context": context or "default"}
    streamed = load_model(store_dir, device=device, client=client, weight_budget=budget,
                          flash_context=context)
    if cudnn:
        unwrapped_forward(streamed)
        res["attention"] = "torch's choice (cuDNN allowed)"
    runtime = streamed.flash.stream
    plan = runtime.plan
    # What crosses the link per token: every streamed unit's ranges.
    per_token = sum(n for _, layout in runtime.units for *_, n in layout)
    link1 = h2d * 1e9 / per_token
    bound1 = min(link1, resident_tok_s.get(1, link1))
    res["plan"] = {"streamed_layers": len(plan.streamed_layers), "slots": plan.n_slots,
                   "window": plan.window, "unit": plan.unit, "streamed_units": runtime.m,
                   "slot_bytes": plan.slot_bytes, "resident_bytes": plan.resident_bytes,
                   "budget_used_bytes": plan.resident_bytes + plan.n_slots * plan.slot_bytes,
                   "streamed_bytes_per_token": per_token,
                   "layers": list(plan.streamed_layers)}
    res["bound_batch1_tok_s"] = round(bound1, 3)
    res["bound_h2d_gbps"] = h2d
    res["streamed_tok_s"] = {}
    res["tokens_identical_to_resident"] = {}
    res["vs_bound"] = {}
    res["window_decisions_by_batch"] = {}
    res["gc_pauses_ms"] = {}
    for b in batches:
        before = runtime.stats()
        with _GcPauses() as gcp:
            rate, out = decode_rate(streamed, b, tokens, device)
        res["gc_pauses_ms"][b] = gcp.pauses
        after = runtime.stats()
        bound = min(b * link1, resident_tok_s.get(b, b * link1))
        res["streamed_tok_s"][b] = round(rate, 3)
        res["vs_bound"][b] = round(rate / bound, 3)
        if b in resident_out:
            res["tokens_identical_to_resident"][b] = bool(torch.equal(out.cpu(), resident_out[b]))
        if first_out is not None:
            if b in first_out:
                res.setdefault("tokens_identical_to_first_run", {})[b] = bool(
                    torch.equal(out.cpu(), first_out[b]))
            else:
                first_out[b] = out.cpu()
        res["window_decisions_by_batch"][b] = [
            {k: d[k] for k in ("from", "to", "reason")} for d in after["decisions"]
            if d not in before["decisions"]]
        if b == 1:
            hits = after["prefetch_hits"] - before["prefetch_hits"]
            misses = after["prefetch_miss_count"] - before["prefetch_miss_count"]
            passes = after["passes"] - before["passes"]
            res["steady_prefetch_hit_rate"] = round(hits / max(1, hits + misses), 4)
            res["fabric_stall_cycles_per_token"] = int(
                (after["fabric_stall_cycles"] - before["fabric_stall_cycles"]) / max(1, passes))
            res["fabric_stall_us_per_token"] = round(
                (after["fabric_stall_us"] - before["fabric_stall_us"]) / max(1, passes), 1)
            res["prefetch_window_final"] = after["prefetch_window"]
            res["window_decisions"] = after["decisions"][-5:]
            # Each token timed alone too, as accelerate's are: the like-for-like ratio.
            runtime.trace_copies(limit=(tokens + 4) * runtime.m)
            res["batch1_tokens"] = spread(token_times(streamed, tokens, 1, device))
            res["batch1_copy_idle"] = copy_idle(runtime.copy_trace(), runtime.m)
    streamed.flash.close()
    client.unload(streamed.flash.info.name, tier="device")
    # Every view of the arena must go before the next load maps its own.
    del streamed, runtime, plan
    __import__("gc").collect()
    torch.cuda.empty_cache()
    return res


def window_context(name: str) -> dict | None:
    """A ``--windows`` entry as ``flash_context``: "default" / "cudnn" the default a user gets;
    else ``:``-separated parts, each a ``prefetch_window`` (an integer) or a ``stream_unit``
    ("layer", "projection"): "1", "projection", "projection:4"."""
    from deepseek_flash.wire import STREAM_UNITS

    if name in ("default", "cudnn"):
        return None
    context = {}
    for part in name.split(":"):
        if part.isdigit():
            context["prefetch_window"] = int(part)
        elif part in STREAM_UNITS:
            context["stream_unit"] = part
        else:
            raise SystemExit(f"--windows: {part!r} in {name!r} is neither a window nor a stream "
                             f"unit ({', '.join(STREAM_UNITS)})")
    return context


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/var/tmp/flash-bench")
    add_arch_argument(parser)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers for a quick run")
    parser.add_argument("--budget", default="8GiB", help="weight budget on the GPU")
    parser.add_argument("--tokens", type=int, default=24, help="decode steps per measurement")
    parser.add_argument("--batches", default="1,4,16,32")
    parser.add_argument("--host-cache", default="20GiB")
    parser.add_argument("--skip-accelerate", action="store_true")
    parser.add_argument("--windows", default="default",
                        help="streamed runs, one after the other in this run: 'default' (the "
                             "prefetch_window a user gets) and/or explicit windows to compare, "
                             "e.g. 'default,1' (an experiment: the ring has window + 1 slots, out "
                             "of the same budget), 'projection' (stream_unit projection: each slot "
                             "one MLP projection), 'projection:4' (both), 'cudnn' (the default with "
                             "torch's own choice of attention kernel); a name given again runs "
                             "again (its key gets '#2'); the first one sets the top-level results")
    parser.add_argument("--accelerate-tokens", type=int, default=8,
                        help="accelerate's decode tokens, each timed alone (after the warm-up)")
    parser.add_argument("--accelerate-warmup", type=int, default=2)
    parser.add_argument("--skip-resident", action="store_true",
                        help="no fully resident run: the bound is the link's alone (never above "
                             "min(link, resident)), tokens are not compared")
    parser.add_argument("--skip-ttft", action="store_true", help="skip the cold time-to-first-token")
    parser.add_argument("--cleanup", action="store_true", help="delete the checkpoint and store after")
    parser.add_argument("--prepare-only", action="store_true", help="write and pack the model, then stop")
    parser.add_argument("--output")
    args = parser.parse_args(argv)

    import torch
    import transformers
    from deepseek_flash.client import Client
    from deepseek_flash.client.model import load_model
    from deepseek_flash.sizes import parse_size

    from deepseek_flash.store import Store, pack

    work = __import__("pathlib").Path(args.dir) / args.arch
    t0 = time.perf_counter()
    src = write_finite_model(work / "src", args.arch, args.layers)
    store_dir = work / "store"
    if not (store_dir / "flash_metadata.bin").exists():
        pack(src, store_dir)
    store = Store.open(store_dir)
    if args.prepare_only:
        print(f"{args.arch}: {store.total_bytes} bytes packed in {time.perf_counter() - t0:.1f} s")
        return 0
    budget = parse_size("budget", args.budget)
    batches = [int(b) for b in args.batches.split(",")]
    res = {"benchmark": "stream", "arch": args.arch, "date": datetime.date.today().isoformat(),
           "host": platform.node(), "gpu": torch.cuda.get_device_name(0),
           "model_bytes": store.total_bytes, "budget_bytes": budget, "layers": store.num_layers,
           "prepare_s": round(time.perf_counter() - t0, 1)}
    # A checkpoint and store just written (~30 GB) are still being written back meanwhile. (The
    # 22:24 UTC H200 run, which wrote them in the timed process, measured resident decode 27-39 %
    # slower than an earlier run; whether the write-back is why is not known.) Wait for it, so it
    # is not part of any timing.
    t = time.perf_counter()
    os.sync()
    res["sync_before_timing_s"] = round(time.perf_counter() - t, 1)
    h2d = pinned_h2d()
    res["pinned_h2d_gbps"] = h2d
    # Defaults everywhere else: prefetch_window "auto", unified_memory_ratio a ceiling.
    config = {"host_cache_bytes": args.host_cache}
    client = Client(embedded=True, config=config)

    # Fully resident: the decode rate the GPU itself allows at each batch.
    res["resident_tok_s"] = {}
    resident_out = {}
    if not args.skip_resident:
        phase = time.perf_counter()
        resident = load_model(store_dir, device="cuda:0", client=client)
        for b in batches:
            rate, out = decode_rate(resident, b, args.tokens)
            res["resident_tok_s"][b] = round(rate, 2)
            resident_out[b] = out.cpu()
        save(res, args.output)
        resident.flash.close()
        client.unload(resident.flash.info.name, tier="device")
        del resident
        torch.cuda.empty_cache()
        res.setdefault("phase_s", {})["resident"] = round(time.perf_counter() - phase, 1)

    # Streamed under the budget: the default window, then any other asked for, same run.
    res["windows"] = {}
    first_out: dict = {}
    for name in args.windows.split(","):
        phase = time.perf_counter()
        context = window_context(name)
        run = streamed_run(store, store_dir, client, budget, context, batches, args.tokens, h2d,
                           res["resident_tok_s"], resident_out, cudnn=name == "cudnn",
                           first_out=first_out)
        key, again = name, 1
        while key in res["windows"]:
            again += 1
            key = f"{name}#{again}"
        res["windows"][key] = run
        if len(res["windows"]) == 1:
            res.update(run)
        res.setdefault("phase_s", {})[f"streamed_{key}"] = round(time.perf_counter() - phase, 1)
        save(res, args.output)
    client.close()
    del client
    __import__("gc").collect()
    torch.cuda.empty_cache()
    # The link probed again after the streamed runs: the bound uses the faster of the two probes
    # (one 4 GiB copy read 51.1 GB/s on the H200 once while the streamed copies ran at 55.1: a
    # low probe flatters every ratio).
    res["pinned_h2d_gbps_after"] = pinned_h2d()
    if res["pinned_h2d_gbps_after"] > h2d:
        for run in res["windows"].values():
            rebound(run, res["pinned_h2d_gbps_after"], res["resident_tok_s"])
        res.update(next(iter(res["windows"].values())))
    save(res, args.output)

    # Time to first token from a cold model: streamed (lazy) vs the whole model loaded first.
    for name, kwargs in (() if args.skip_ttft else
                         (("streamed_lazy", {"weight_budget": budget}), ("whole_model_first", {}))):
        drop_caches()
        c = Client(embedded=True, config=config)
        c._backend.fabric.pin_host()
        ids = torch.tensor([[1, 2, 3, 4]], device="cuda:0")
        torch.cuda.synchronize()
        t = time.perf_counter()
        m = load_model(store_dir, device="cuda:0", client=c, **kwargs)
        if name == "whole_model_first":
            from load import wait_loaded

            wait_loaded(m)
        with torch.no_grad():
            m(ids).logits[0, -1].argmax().item()
        torch.cuda.synchronize()
        res.setdefault("cold_ttft_s", {})[name] = round(time.perf_counter() - t, 3)
        m.flash.close()
        c.close()
        del m, c
        __import__("gc").collect()
        torch.cuda.empty_cache()
        save(res, args.output)

    # accelerate's offload under the same budget, same run.
    if not args.skip_accelerate:
        phase = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            src, dtype=torch.bfloat16, device_map="auto",
            max_memory={0: budget, "cpu": 200 << 30})
        # What the peer keeps on the GPU under the same max_memory: its resident weights, and
        # its peak while decoding (the offloaded layers it moves in for each pass come on top).
        res["accelerate_gpu_weight_bytes"] = sum(
            p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cuda")
        torch.cuda.reset_peak_memory_stats(0)
        base = torch.cuda.memory_allocated(0)
        seconds = token_times(model, args.accelerate_tokens, args.accelerate_warmup)
        res["accelerate_gpu_peak_above_weights_bytes"] = torch.cuda.max_memory_allocated(0) - base
        # Its rate is its median token's (each token timed alone after a warm-up; the spread is
        # kept): a slow outlier must not flatter the ratio.
        acc = res["accelerate"] = spread(seconds)
        res["accelerate_tok_s"] = acc["median_tok_s"]
        for run in res["windows"].values():
            run["vs_accelerate"] = round(run["streamed_tok_s"][1] / acc["median_tok_s"], 2)
            run["vs_accelerate_range"] = [round(run["streamed_tok_s"][1] / acc["fastest_tok_s"], 2),
                                          round(run["streamed_tok_s"][1] / acc["slowest_tok_s"], 2)]
            run["vs_accelerate_median_tokens"] = round(
                run["batch1_tokens"]["median_tok_s"] / acc["median_tok_s"], 2)
        first = next(iter(res["windows"].values()))
        res["vs_accelerate"] = first["vs_accelerate"]
        res["vs_accelerate_range"] = first["vs_accelerate_range"]
        res.setdefault("phase_s", {})["accelerate"] = round(time.perf_counter() - phase, 1)
        del model
        torch.cuda.empty_cache()
    for run in [res, *res["windows"].values()]:
        run["goals"] = {
            "every_batch>=0.97*bound": all(v >= 0.97 for v in run["vs_bound"].values()),
            "hit_rate>=0.95": run["steady_prefetch_hit_rate"] >= 0.95,
            "vs_accelerate>=7.5": run.get("vs_accelerate", 0) >= 7.5,
        }
    emit(res, args.output)
    if args.cleanup:
        __import__("shutil").rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
