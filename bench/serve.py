"""Benchmark: `deepseek-flash serve` under the seed's three waves and a steady L0 stream, with the
scheduler on and off (FIFO) in the same run.

Phases, each against the same model loaded once through ``load_model`` (default settings):

1. **unloaded**: L0 requests one at a time -> time to first token (TTFT) p50/p90/p99/max, the
   reference. After the warm-up (a full batch, then ``UNLOADED_WARMUP`` single requests, whose
   first-time set-up of a shape -- kernels loaded, heuristics chosen -- is not the steady state)
   ``--unloaded-requests`` (200) requests of ``UNLOADED_TOKENS`` tokens each (TTFT is the prefill;
   what follows the first token does not change it), so that the p99 is a quantile, not the one
   slowest request;
2. **throughput**: one request alone vs ``--max-batch`` (16) at once, decode tokens/s; the full-batch
   rate is the measured capacity;
3. **load**, once with the scheduler (``flash``) and once with ``fifo``, same arrival schedule
   (seeded Poisson): three waves -- short (max_tokens 32), medium (128), long (512), each L1:L2 2:1 --
   plus a steady L0 stream (max_tokens 16) throughout. Capacity per request size (requests/s with
   a full batch of that size) comes from two timed full batches -- of the L0 size and of phase 2's
   128 tokens -- as fixed + per-token time; the stream asks for 10 % of it and each wave for 90 %,
   both times ``--load`` (0.9). Requests still running ``--drain-seconds`` after the last arrival
   are closed by the client and counted as unfinished.

The engine's own profile of each phase goes in the JSON (``engine_profile``): forwards by kind and
rows, time to the result on the host and the host's launch time -- which says whether a step was
bound by the device or by Python -- and the seconds each phase ended at (``phase_s``).

Every request is streamed over HTTP (the server runs in this process on 127.0.0.1 with uvicorn;
the clients are asyncio clients in child processes, so their parsing does not take the server's
interpreter lock): in the load phases the L0 stream is sent by a probe process of its own and the
L1/L2 load by ``--load-procs`` (2) others, so an L0 request's time to first token is not the load
generator's event-loop backlog. TTFT is the first server-sent event, latency the last. Each class
also reports where its TTFT went (``ttft_breakdown``: to the server, parse, queue, compute, hand-off
to the event loop and socket, to the client -- ``stages``, from the response's ``flash.timing``;
per request in ``worst_l0``), and so does the unloaded phase; the garbage collector's pauses in the
server during each load phase (``gc``, and those overlapping each of the slowest L0 requests in
``worst_l0``: a collection holds the interpreter lock, stalling the engine and the event loop).
Checks printed beside the results: L0 P99 TTFT <= 2x unloaded P99 and < 150 ms (and FIFO's ratio), L1
completion time per token by weight (fairness), L2 degrade rate < 5 %, 16 concurrent >= 8x one
request, nothing lost (every request answered or refused with a status). JSON to ``--output``, a
latency-CDF PNG per class to ``--png-dir``.

    python bench/serve.py --smoke --output serve.json --png-dir serve-png     # tiny model, CPU
    python bench/serve.py --arch llama --device cuda:0 --output serve.json --png-dir serve-png
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import emit, save
from serve_stats import STAGES, GcPauses, breakdown, ms, plot, summarize, ttft_stats, worst_l0

WAVES = (("short", 32), ("medium", 128), ("long", 512))
L0_TOKENS = 16
# Unloaded reference: single requests sent first and not counted, then --unloaded-requests of
# this many tokens each.
UNLOADED_WARMUP = 10
UNLOADED_TOKENS = 2
# ~0.5B models: big enough for the GPU to matter, quick to make here (the scheduler, not the
# weights, is what this bench measures).
GPU_SHAPES = {
    "llama": dict(arch="llama", hidden_size=1536, num_layers=16, intermediate_size=4096, num_heads=12,
                  num_kv_heads=4),
    "qwen2": dict(arch="qwen2", hidden_size=1536, num_layers=16, intermediate_size=4096, num_heads=12,
                  num_kv_heads=2),
    "mistral": dict(arch="mistral", hidden_size=1536, num_layers=16, intermediate_size=4096, num_heads=12,
                    num_kv_heads=4),
}


def prepare_store(workdir: Path, arch: str, smoke: bool, dtype: str) -> Path:
    """A random model with a byte-level tokenizer that has no end-of-text token (so every request
    runs to its max_tokens), packed into a store."""
    from deepseek_flash.store import pack
    from deepseek_flash.testing import make_tiny_model, make_tiny_tokenizer

    store = workdir / f"serve-{arch}{'-smoke' if smoke else ''}"
    if (store / "flash_metadata.bin").exists():
        return store
    src = workdir / (store.name + "-src")
    shape = {"arch": arch} if smoke else dict(GPU_SHAPES[arch])
    arch_name = shape.pop("arch")
    vocab = 260 if smoke else 32000
    make_tiny_model(src, arch_name, dtype="float32" if smoke else dtype, vocab_size=vocab, eos_token_id=None,
                    bos_token_id=None, pad_token_id=None, max_position_embeddings=1024, **shape)
    make_tiny_tokenizer(src, eos=False)
    return pack(src, store)


def start_server(state):
    from deepseek_flash.serve.app import create_app
    from deepseek_flash.serve.cli import listen, server

    sock = listen("127.0.0.1", 0)
    srv = server(create_app(state), sock, "warning")
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    # What serves HTTP: uvicorn's protocol (httptools or h11) and event loop (uvloop or asyncio).
    state.http_server = {"protocol": srv.config.http_protocol_class.__name__, "loop": state.event_loop}
    return srv, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def one(http, base, model, cls, max_tokens, prompt, t0, rec=None):
    """One streamed completion: a record with status, ttft, latency (s from the scheduled start);
    filled in ``rec`` as it goes, when given."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "flash_context": {"priority_class": cls}}
    rec = {} if rec is None else rec
    rec.update({"class": cls, "max_tokens": max_tokens, "status": None, "ttft": None, "latency": None,
                "tokens": 0, "degraded": False, "server_ttft_ms": None, "queue_ms": None, "timing": None})
    start = time.perf_counter()
    rec["sent_at"] = start          # the clock the server's forwards are stamped with (monotonic)
    try:
        async with http.stream("POST", base + "/v1/completions", json=body) as resp:
            rec["status"] = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                rec["retry_after"] = resp.headers.get("retry-after")
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["status"] = "stream-error"
                    return rec
                if rec["ttft"] is None:
                    rec["ttft"] = time.perf_counter() - start
                choice = chunk["choices"][0]
                if choice.get("finish_reason") is None:
                    rec["tokens"] += 1
                else:
                    rec["degraded"] = chunk["degraded"]
                    rec["server_ttft_ms"] = chunk["flash"]["ttft_ms"]
                    rec["queue_ms"] = chunk["flash"]["queue_ms"]
                    rec["timing"] = chunk["flash"].get("timing")
        rec["latency"] = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 -- a lost request is a result, recorded as such
        rec["status"] = f"lost: {type(exc).__name__}: {exc}"
    return rec


def _run_async(fn, *args):
    return asyncio.run(fn(*args))


def client(pool, fn, *args):
    """Run the load generator ``fn(*args)`` in the client process and return its result."""
    return pool.submit(_run_async, fn, *args).result()


async def unloaded(base, model, n, prompt_len):
    """``n`` L0 requests one at a time: the TTFT quantiles and every TTFT in ms, in order (where an
    outlier fell)."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as http:
        recs = [await one(http, base, model, "L0", UNLOADED_TOKENS, prompt(i, prompt_len), 0) for i in range(n)]
    ttft = [r["ttft"] for r in recs]
    return {"requests": n, **ttft_stats(ttft), "ttft_ms": [ms(t) for t in ttft], "ttft_breakdown": breakdown(recs)}


async def throughput(base, model, concurrency, tokens, prompt_len):
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as http:
        t = time.perf_counter()
        recs = await asyncio.gather(*[one(http, base, model, "L1", tokens, prompt(i, prompt_len), 0)
                                      for i in range(concurrency)])
        dt = time.perf_counter() - t
    total = sum(r["tokens"] for r in recs)
    return {"concurrency": concurrency, "tokens": total, "seconds": round(dt, 3),
            "tokens_per_s": round(total / dt, 2)}


def prompt(i, n):
    return [(7 * i + 3 * j) % 250 + 3 for j in range(n)]


def capacity_fit(max_batch, a, b, sizes):
    """Requests/s with a full batch for every size in ``sizes`` and the two measured ones, from two
    timed full batches ``a`` and ``b`` = (tokens each, seconds): seconds = fixed + per_token x
    tokens, the line through both."""
    (na, ta), (nb, tb) = a, b
    per_token = max(0.0, (tb - ta) / (nb - na)) if nb != na else tb / nb
    fixed = max(0.0, ta - per_token * na)
    capacity = {}
    for n in sorted(set(sizes) | {na, nb}):
        seconds = ta if n == na else tb if n == nb else fixed + per_token * n
        capacity[n] = round(max_batch / seconds, 3)
    return capacity, {"fixed_s": round(fixed, 4), "per_token_s": round(per_token, 5),
                      "measured": {str(na): ta, str(nb): tb}}


def schedule(capacity_rps: dict, load, wave_s, scale, seed):
    """The arrival schedule: (time, class, max_tokens). ``capacity_rps[tokens]`` is the measured rate
    of requests of that size the server completes with a full batch. The steady L0 stream takes 10 %
    of that capacity, each wave 90 % (L1, L1, L2 in turn), both times ``load``."""
    rng = random.Random(seed)
    arrivals = []
    total = wave_s * len(WAVES)
    l0_tokens = max(1, L0_TOKENS // scale)
    t = 0.0
    while True:
        t += rng.expovariate(0.1 * load * capacity_rps[l0_tokens])
        if t >= total:
            break
        arrivals.append((t, "L0", l0_tokens))
    for w, (_, size) in enumerate(WAVES):
        tokens = max(1, size // scale)
        t, k = w * wave_s, 0
        while True:
            t += rng.expovariate(0.9 * load * capacity_rps[tokens])
            if t >= (w + 1) * wave_s:
                break
            arrivals.append((t, "L2" if k % 3 == 2 else "L1", tokens))
            k += 1
    return sorted(arrivals)


async def run_load(base, model, indexed, prompt_len, start_at, stop_at):
    """Send ``indexed`` -- (index, (at, class, max_tokens)) -- each at ``start_at + at`` (the
    ``perf_counter`` clock, CLOCK_MONOTONIC: one clock for every process of the host); requests
    still running at ``stop_at`` are closed by the client and recorded as ``unfinished`` (the
    bench's time limit, not the server's answer). Returns [(index, record)] and when the last
    ended."""
    import httpx

    async with httpx.AsyncClient(timeout=stop_at - start_at + 600,
                                 limits=httpx.Limits(max_connections=None)) as http:
        tasks, records = [], []
        for i, (at, cls, tokens) in indexed:
            delay = start_at + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = {}
            records.append((i, rec))
            tasks.append(asyncio.create_task(one(http, base, model, cls, tokens, prompt(i, prompt_len), start_at, rec)))
        pending = ()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, stop_at - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for (_, rec), task in zip(records, tasks):
        if task in pending:
            rec["status"] = "unfinished"
    return records, time.perf_counter()


def split_arrivals(arrivals, load_procs: int) -> list:
    """The client processes' shares of the schedule, as (index, arrival) lists: every L0 arrival to
    the first (the probe, whose event loop carries nothing else, so an L0 request's time to first
    token is not the load generator's own backlog), the others in turn over ``load_procs``."""
    parts = [[] for _ in range(1 + max(1, load_procs))]
    k = 0
    for i, arrival in enumerate(arrivals):
        if arrival[1] == "L0":
            parts[0].append((i, arrival))
        else:
            parts[1 + k % (len(parts) - 1)].append((i, arrival))
            k += 1
    return parts


# The client processes start sending this long after the schedule is handed out.
START_LEAD_S = 1.0


def load_phase(pool, base, model, arrivals, prompt_len, drain_s, load_procs):
    """One load phase over the client processes (``split_arrivals``), all on one start time: the
    records in schedule order and the phase's wall time (start to the last answer)."""
    start_at = time.perf_counter() + START_LEAD_S
    stop_at = start_at + (arrivals[-1][0] if arrivals else 0.0) + drain_s
    futures = [pool.submit(_run_async, run_load, base, model, part, prompt_len, start_at, stop_at)
               for part in split_arrivals(arrivals, load_procs) if part]
    records, ended = [None] * len(arrivals), start_at
    for future in futures:
        part, last = future.result()
        ended = max(ended, last)
        for i, rec in part:
            records[i] = rec
    return records, ended - start_at


def _ready(seconds):
    import httpx  # noqa: F401 -- imported once per client process, before any phase is timed

    time.sleep(seconds)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(GPU_SHAPES), default="llama")
    parser.add_argument("--model", help="a store (name or directory) instead of the random one")
    parser.add_argument("--dir", default=None, help="where the random model is made (default: a temp dir)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--load", type=float, default=0.9, help="token demand / measured capacity")
    parser.add_argument("--wave-seconds", type=float, default=20.0)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--unloaded-requests", type=int, default=200,
                        help="L0 requests sent one at a time for the unloaded TTFT, after the warm-up")
    parser.add_argument("--drain-seconds", type=float, default=None,
                        help="after the last arrival, how long requests may still run before the "
                             "client closes them (recorded as unfinished; default 4x --wave-seconds, "
                             "at least 30)")
    parser.add_argument("--load-procs", type=int, default=2,
                        help="client processes sending the L1/L2 load; the L0 stream has one of its own")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model on the CPU, max_tokens / 16, short waves: the bench's own test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output")
    parser.add_argument("--png-dir")
    args = parser.parse_args(argv)

    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch

    from deepseek_flash.serve.cli import load, make_state

    scale = 16 if args.smoke else 1
    if args.smoke:
        # The smoke run shares a small CPU with the load generator and the HTTP thread.
        torch.set_num_threads(1)
        args.device = args.device or "cpu"
        args.max_batch = min(args.max_batch, 4)
        args.unloaded_requests = min(args.unloaded_requests, 5)
        args.prompt_len = min(args.prompt_len, 8)
    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    result = {"bench": "serve", "date": datetime.date.today().isoformat(), "host": platform.node(),
              "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
              "arch": args.arch, "smoke": args.smoke, "max_batch": args.max_batch, "load": args.load,
              "torch_threads": torch.get_num_threads(),
              "waves": {name: max(1, size // scale) for name, size in WAVES}, "l0_tokens": max(1, L0_TOKENS // scale)}
    started = time.perf_counter()
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="flash-serve-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    store = args.model or str(prepare_store(workdir, args.arch, args.smoke, args.dtype))
    t = time.perf_counter()
    model, tokenizer = load(store, device=device, embedded=True)
    result["load_model_s"] = round(time.perf_counter() - t, 2)
    max_len = args.prompt_len + max(size for _, size in WAVES) // scale + 8
    results, profiles, phases = {}, {}, {}
    result["phase_s"] = phases

    def phase(name):
        phases[name] = round(time.perf_counter() - started, 2)
    phase("model")
    # Requests still running this long after the last arrival are cut (recorded as unfinished).
    drain = args.drain_seconds if args.drain_seconds is not None else max(30.0, 4 * args.wave_seconds)
    # The client processes: the L0 probe and ``--load-procs`` load generators (``split_arrivals``),
    # each started and with httpx imported before anything is timed; the phases before the load
    # run in one of them.
    procs = 1 + max(1, args.load_procs)
    result["client_processes"] = {"l0_probe": 1, "load": procs - 1}
    pool = ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"))
    for f in [pool.submit(_ready, 0.5) for _ in range(procs)]:
        f.result()
    try:
        for mode in ("flash", "fifo"):
            state = make_state(model, tokenizer, max_batch=args.max_batch, max_model_len=max_len, scheduler=mode)
            # Start-up's warm-up of every attention width (on by default on a CUDA device), seconds.
            result.setdefault("engine_warm_s", {})[mode] = state.engine.warm_s
            # How the batch decodes (CUDA graphs, or eager and why), graphs captured.
            result.setdefault("engine_decode", {})[mode] = state.engine.runner.decode_stats()
            srv, thread, base = start_server(state)
            result["http_server"] = state.http_server
            try:
                name = state.model_name
                if mode == "flash":
                    # Warm-up (allocator, kernels), then the references.
                    client(pool, throughput, base, name, args.max_batch, 4, args.prompt_len)
                    state.engine.runner.profile(reset=True)
                    phase("warm-up")
                    warm = client(pool, unloaded, base, name, min(UNLOADED_WARMUP, args.unloaded_requests),
                                  args.prompt_len)
                    profiles["unloaded_warmup"] = state.engine.runner.profile(reset=True)
                    result["unloaded"] = client(pool, unloaded, base, name, args.unloaded_requests, args.prompt_len)
                    result["unloaded"].update(warmup_requests=warm["requests"], warmup_ttft_ms=warm["ttft_ms"])
                    profiles["unloaded"] = state.engine.runner.profile(reset=True)
                    phase("unloaded")
                    tokens = max(8, 128 // scale)
                    one_tp = client(pool, throughput, base, name, 1, tokens, args.prompt_len)
                    profiles["one"] = state.engine.runner.profile(reset=True)
                    phase("one")
                    full_tp = client(pool, throughput, base, name, args.max_batch, tokens, args.prompt_len)
                    profiles["full"] = state.engine.runner.profile(reset=True)
                    phase("full")
                    result["throughput"] = {"one": one_tp, "full": full_tp,
                                            "ratio": round(full_tp["tokens_per_s"] / one_tp["tokens_per_s"], 2)}
                    # Capacity per request size: requests/s with a full batch of that size (prefill,
                    # HTTP and sampling included -- what a token rate alone would miss). Two full
                    # batches are timed -- the L0 size and the throughput run above -- and the time
                    # of a batch is taken as linear in the tokens asked (a fixed part: prefill and
                    # HTTP; a part per token: the batched decode step) for the other sizes.
                    small = max(1, L0_TOKENS // scale)
                    small_tp = client(pool, throughput, base, name, args.max_batch, small, args.prompt_len)
                    phase("capacity")
                    capacity, fit = capacity_fit(args.max_batch, (small, small_tp["seconds"]),
                                                 (tokens, full_tp["seconds"]),
                                                 [max(1, n // scale) for _, n in WAVES])
                    result["capacity_rps"] = {str(k): v for k, v in capacity.items()}
                    result["capacity_fit"] = fit
                    arrivals = schedule(capacity, args.load, args.wave_seconds, scale, args.seed)
                    result["arrivals"] = len(arrivals)
                    save(result, args.output)
                state.engine.runner.profile(reset=True)
                steps0, open0 = state.engine.stats["steps"], state.engine.stats["l2_open_steps"]
                beside0 = state.engine.stats["l0_beside"]
                concurrent0 = state.engine.stats["l0_beside_concurrent"]
                pauses = GcPauses().start()
                try:
                    recs, wall = load_phase(pool, base, name, arrivals, args.prompt_len, drain, args.load_procs)
                finally:
                    pauses.stop()
                steps = state.engine.stats["steps"] - steps0
                forwards = state.engine.runner.forwards()
                profiles[mode] = state.engine.runner.profile(reset=True)
                phase(f"load {mode}")
                results[mode] = {"records": recs, "wall_s": round(wall, 2),
                                 "summary": summarize(recs, result["unloaded"]["ttft_p99_ms"]),
                                 "metrics_degrade": state.engine.scheduler.snapshot()["degrade_steps"]}
                result[mode] = results[mode]["summary"] | {"wall_s": results[mode]["wall_s"],
                                                           "degrade_steps": results[mode]["metrics_degrade"],
                                                           "worst_l0": worst_l0(recs, forwards,
                                                                                pauses=pauses.pauses),
                                                           # the collector's pauses in the server
                                                           "gc": pauses.summary(),
                                                           # the fraction of steps after which L2's
                                                           # 30 %-idle rule let it join
                                                           "l2_open_step_fraction": round(
                                                               (state.engine.stats["l2_open_steps"] - open0)
                                                               / max(1, steps), 4),
                                                           "decode": state.engine.runner.decode_stats(),
                                                           # L0 prompt forwards run beside the
                                                           # batch's decode graph
                                                           "l0_beside": state.engine.stats[
                                                               "l0_beside"] - beside0,
                                                           # of those, issued while another ran
                                                           # (the second lane)
                                                           "l0_beside_concurrent": state.engine.stats[
                                                               "l0_beside_concurrent"] - concurrent0,
                                                           # why that was switched off (a failure)
                                                           "l0_beside_off": state.engine.l0_beside.reason,
                                                           "l0_second_lane_off": state.engine.l0_beside.second_reason}
                result["engine_profile"] = profiles
                save(result, args.output)
            finally:
                srv.should_exit = True
                thread.join(120)
    finally:
        pool.shutdown()
        model.flash.close()
    flash_l0, fifo_l0 = result["flash"]["checks"]["l0_p99_ttft_ms"], result["fifo"]["checks"]["l0_p99_ttft_ms"]
    result["fifo_l0_p99_over_flash"] = round(fifo_l0 / flash_l0, 2) if flash_l0 and fifo_l0 else None
    result["throughput_16_ge_8x_one"] = result["throughput"]["ratio"] >= 8
    if args.png_dir:
        result["png"] = plot(results, Path(args.png_dir))
    emit(result, args.output)
    u = result["unloaded"]
    print(f"unloaded L0 ttft ({u['ttft_samples']} requests): p50 {u['ttft_p50_ms']} p90 {u['ttft_p90_ms']} "
          f"p99 {u['ttft_p99_ms']} max {u['ttft_max_ms']} ms")
    print(f"{'mode':6} {'L0 ttft p99':>12} {'(max, n)':>16} {'/unloaded p99':>14} {'L1 lat p99':>11} "
          f"{'L2 degraded':>12} lost unfinished")
    for mode in ("flash", "fifo"):
        s = result[mode]
        l0 = s["L0"]
        tail = f"({l0['ttft_max_ms']}, {l0['ttft_samples']})"
        print(f"{mode:6} {l0['ttft_p99_ms']!s:>12} {tail:>16} "
              f"{s['checks']['l0_p99_over_unloaded']!s:>14} {s['L1']['latency_p99_ms']!s:>11} {s['L2']['degraded']!s:>12} "
              f"{sum(s[c]['lost'] for c in ('L0', 'L1', 'L2'))} {sum(s[c]['unfinished'] for c in ('L0', 'L1', 'L2'))}")
    for mode in ("flash", "fifo"):
        for w in result[mode].get("worst_l0", [])[:1]:
            slow = sorted(w["forwards"], key=lambda f: -f["ms"])[:3]
            print(f"{mode} worst L0: ttft {w['ttft_ms']} ms, queue {w['queue_ms']} ms, collector {w['gc_ms']} ms, "
                  f"{len(w['forwards'])} forwards {w['forwards_ms']} ms; slowest: " + ", ".join(
                      f"{f['kind']} rows={f['rows']} tok={f['tokens']} kv={f['kv']} {f['ms']} ms" for f in slow))
    print(f"throughput {args.max_batch} vs 1: {result['throughput']['ratio']}x")
    for mode in ("flash", "fifo"):
        print(f"{mode} decode: {result[mode]['decode']}; steps with L2's rule open: "
              f"{result[mode]['l2_open_step_fraction']}; L2 ttft p50 {result[mode]['L2']['ttft_p50_ms']} ms; "
              f"L0 prompts beside a graph forward: {result[mode]['l0_beside']} "
              f"({result[mode]['l0_beside_concurrent']} beside another L0 prompt)")
        b = result[mode]["L0"]["ttft_breakdown"]
        if b.get("requests"):
            print(f"{mode} L0 ttft stages p50/p99/tail-mean ms: " + ", ".join(
                f"{k} {b[k]['p50']}/{b[k]['p99']}/{b[k]['tail_mean']}" for k in STAGES))
    for name in ("one", "full"):
        for key, p in profiles.get(name, {}).items():
            if key.startswith("decode"):
                print(f"decode step ({name}, {key[len('decode_'):]}): p50 {p['ms_p50']} ms, launch p50 "
                      f"{p['launch_ms_p50']} ms, max {p['ms_max']} ms, {p['forwards']} forwards")
    print("phases (s):", " ".join(f"{k}={v}" for k, v in phases.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
