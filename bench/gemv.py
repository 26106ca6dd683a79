"""Decode-sized weight-only matmuls on CUDA: our int4/int8 GEMV kernels (``quant.gemv``) against
torch's int4 kernel (tinygemm), the Triton int8 kernel (``quant.kernels``), a bfloat16 matmul and
the device-to-device copy rate, all measured in the same run; plus a correctness check of every
shape against the dequantize + matmul reference.

For each 8B llama layer shape (N x K) and batch M in 1/4/8: microseconds per call (median of graph
replays of many calls, rotating over enough weight copies that they never sit in L2) and the bytes
read per second (weights + scales), also as a fraction of the measured copy rate. ``int4`` is the
default configuration of ``gemv.int4_config`` (the tensor-core kernel up to 8 rows); ``--old``
adds the CUDA-core kernels it replaced, ``--sweep`` other shapes of the tensor-core kernel (until
``--budget-s`` seconds into the run), each checked against the reference too. Whether the layers
use these kernels is ``gemv.INT4_MAX_M``: this is where that is decided.

  python bench/gemv.py --output OUT.json [--sweep] [--old] [--shapes 14336x4096,...] [--ms 1,8]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

SHAPES_8B = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]   # q/o, k/v, gate/up, down


SMOKE = False          # --smoke: the CPU, tiny shapes, wall-clock timing (what CI proves runs)


def sync():
    if not SMOKE:
        torch.cuda.synchronize()


def copy_rate(dev) -> float:
    """Device-to-device copy, bytes read + written per second (1 GiB each way)."""
    if SMOKE:
        a = torch.empty(1 << 24, dtype=torch.uint8)
        t = time.perf_counter()
        a.clone()
        return 2 * a.numel() / (time.perf_counter() - t)
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(10):
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    return 2 * (1 << 30) / sorted(ts)[len(ts) // 2]


def time_calls(fns, reps: int = 5) -> float:
    """Seconds per call: the calls ``fns`` (one per weight copy) captured once in a graph,
    ``rounds`` times over, replayed; median of ``reps`` replays."""
    if SMOKE:
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) / len(fns)
    for f in fns:
        f()
    torch.cuda.synchronize()
    rounds = max(1, 64 // len(fns))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return sorted(ts)[len(ts) // 2] / (rounds * len(fns))


def make_int4(N, K, group, copies, dev):
    from deepseek_flash.quant import int4pack
    from deepseek_flash.quant.scheme import QuantSpec
    spec = QuantSpec("int4_symmetric", "per_block", group)
    out = []
    for _ in range(copies):
        codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=dev)
        scales = (torch.rand(N, K // group, device=dev) * 0.02 + 0.001).to(torch.float16)
        out.append((codes, int4pack.cuda_layout(codes, 8),
                    int4pack.scales_and_zeros(scales, spec, (N, K), group, torch.bfloat16), spec))
    return out


def check(y, x, W):
    """(relative error vs float64 x @ W.T with W exact, max |error| over its allowance): half a
    bfloat16 unit in the last place of the reference, its own rounding of each weight to bfloat16,
    and 2^-14 of sum |x||W| for float32 summation order (tests/quant/test_gemv.py holds the kernels
    to <= 1)."""
    ref = x.double() @ W.double().t()
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    ulp = 2.0 ** (torch.floor(torch.log2(ref.to(torch.bfloat16).double().abs().clamp_min(1e-30)))
                  - 7)
    allowance = (0.5 * ulp + x.double().abs() @ (W.double() - W.to(torch.bfloat16).double()).abs().t()
                 + 2.0 ** -14 * (x.double().abs() @ W.double().abs().t()))
    return rel, round(((y.double() - ref).abs() / allowance).max().item(), 3)


def ncopies(nbytes: int) -> int:
    """Weight copies enough that a round of calls never finds its weight in the L2 (2 on the
    smoke run)."""
    return 2 if SMOKE else max(2, math.ceil(400e6 / nbytes))


def tinygemm(x, w, group, s, N, K):
    """torch's int4 kernel (on the CPU smoke run: the reference of the same arithmetic)."""
    if SMOKE:
        from deepseek_flash.quant import gemv
        return gemv.mma_reference(x, w, s, group, N, K)
    return torch.ops.aten._weight_int4pack_mm(x, w, group, s)


# (NT, W, U, P, A[, G[, R]]) of quant.cuda_gemv.Config; the ring (R) shapes first
CUDA_SWEEP = [(2, 8, 1, 1, 1, 0, 4), (2, 8, 1, 1, 1, 0, 2), (4, 8, 1, 1, 1, 0, 4), (4, 8, 1, 1, 1, 0, 2),
              (2, 16, 1, 1, 1, 0, 4), (2, 16, 1, 1, 1, 0, 2), (2, 4, 1, 1, 1, 0, 8), (4, 4, 1, 1, 1, 0, 4),
              (8, 8, 1, 1, 1, 0, 2), (2, 16, 1, 1, 1, 0, 7),
              (2, 8, 1, 1, 1), (2, 16, 1, 1, 1), (4, 8, 1, 1, 1), (4, 4, 2, 1, 1), (2, 4, 2, 1, 1),
              (4, 16, 1, 1, 1), (8, 8, 1, 1, 1), (2, 8, 2, 1, 1), (4, 8, 2, 1, 1),
              (4, 8, 1, 1, 1, 2), (2, 8, 1, 1, 1, 3), (2, 8, 1, 1, 1, 4), (2, 16, 1, 1, 1, 2),
              (2, 8, 4, 1, 1), (2, 16, 2, 1, 1), (2, 8, 4, 1, 0),
              (2, 8, 1, 1, 0), (2, 16, 1, 1, 0), (4, 8, 1, 1, 0)]


def sweep_config(t):
    from deepseek_flash.quant import cuda_gemv
    return cuda_gemv.Config(*t[:4], A=t[4], G=t[5] if len(t) > 5 else 0, R=t[6] if len(t) > 6 else 0)


def cuda_rows(row, x, mats, W, N, K, wbytes, bw, budget_s):
    """The CUDA C++ kernel at batch 1 (on the smoke run: its CPU stand-in): the default shape
    (``cuda_us``, ``cuda_frac``, ``cuda_check``), then the ``CUDA_SWEEP`` shapes that fit, each
    checked, while ``budget_s`` lasts (``cuda_sweep``)."""
    from deepseek_flash.quant import cuda_gemv, cuda_gemv_emu
    kern = cuda_gemv.Kernels(cuda_gemv_emu.emulated_compile) if SMOKE else cuda_gemv.KERNELS
    words0, sz0 = mats[0][1], mats[0][2]
    cfg = cuda_gemv.default_config(N, K)
    row["cuda_config"] = [cfg.NT, cfg.W, cfg.U, cfg.P, cfg.A]
    t_start = time.time()

    def run(c, key):
        y = cuda_gemv.matmul(x, words0, sz0, N, K, c, kern)
        sync()
        chk = check(y, x, W)
        t = time_calls([lambda w=w, s=s: cuda_gemv.matmul(x, w, s, N, K, c, kern)
                        for _, w, s, _ in mats], reps=3)
        return {"us": round(t * 1e6, 2), "frac": round(wbytes / t / bw, 3), "check": chk[1],
                "rel": chk[0]}

    try:
        r = run(cfg, "cuda")
        row["cuda_us"], row["cuda_frac"], row["cuda_check"] = r["us"], r["frac"], r["check"]
    except Exception as exc:                  # NVRTC missing or refusing: record, go on
        row["cuda_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return
    sw = []
    for t in CUDA_SWEEP:
        c = sweep_config(t)
        if c == cfg or c.fits(N, K) or time.time() - t_start > budget_s:
            continue
        try:
            sw.append({"cfg": list(t), **run(c, "sweep")})
        except Exception as exc:
            sw.append({"cfg": list(t), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    # the access pattern alone (loads and stores, no arithmetic; wrong results); on the smoke run a
    # launch that does nothing stands in for it
    kern_lo = cuda_gemv.Kernels(lambda *a, **k: lambda **kw: None) if SMOKE else kern
    for c in (dataclasses.replace(cfg, LO=1), cuda_gemv.Config(4, 8, 1, 1, LO=1)):
        if c.fits(N, K):
            continue
        try:
            t = time_calls([lambda w=w, s=s: cuda_gemv.matmul(x, w, s, N, K, c, kern_lo)
                            for _, w, s, _ in mats], reps=3)
            sw.append({"cfg": [c.NT, c.W, c.U, c.P, c.A], "LO": 1, "us": round(t * 1e6, 2),
                       "frac": round(wbytes / t / bw, 3)})
        except Exception as exc:
            sw.append({"cfg": [c.NT, c.W, c.U, c.P, c.A], "LO": 1,
                       "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    row["cuda_sweep"] = sw


def main(argv=None):
    global SMOKE
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", required=True)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES_8B))
    ap.add_argument("--old", action="store_true",
                    help="also the CUDA-core int4 kernels (rows at M = 1, dot above)")
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="no further sweep variants after this many seconds")
    ap.add_argument("--sweep-ms", default="1")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES_8B))
    ap.add_argument("--ms", default="1,4,8")
    ap.add_argument("--int8", action="store_true", help="also int8 (row layout) kernels")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--int8-sweep", action="store_true")
    ap.add_argument("--cuda", action="store_true",
                    help="also the CUDA C++ batch-1 kernel (quant.cuda_gemv) at M = 1: its default "
                         "shape and a sweep of others (until --budget-s)")
    ap.add_argument("--skip-triton", action="store_true",
                    help="leave out the Triton int4 kernel (quant.gemv)")
    ap.add_argument("--skip-bf16", action="store_true", help="leave out the bf16 matmul")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tiny shapes, wall-clock timing: proves the script runs (CI)")
    args = ap.parse_args(argv)
    SMOKE = args.smoke
    if SMOKE:
        if args.shapes == ",".join(f"{n}x{k}" for n, k in SHAPES_8B):
            args.shapes = "64x512,24x384"
        args.sweep_shapes = args.shapes
    from deepseek_flash.quant import gemv, kernels
    from deepseek_flash.quant.codec import dequantize
    dev = torch.device("cpu" if SMOKE else "cuda")
    torch.manual_seed(0)
    res = {"benchmark": "gemv", "device": "cpu" if SMOKE else torch.cuda.get_device_name(),
           "torch": torch.__version__, "group": args.group, "rows": []}
    t0 = time.time()
    bw = copy_rate(dev)
    res["copy_bandwidth_gbps"] = round(bw / 1e9, 1)
    out = Path(args.output)

    def save():
        out.write_text(json.dumps(res, indent=1))

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    for N, K in shapes:
        wbytes = N * K // 2 + (K // args.group) * N * 4          # codes + bf16 (scale, zero) pairs
        copies = ncopies(wbytes)
        mats = make_int4(N, K, args.group, copies, dev)
        bf = [torch.randn(N, K, device=dev, dtype=torch.bfloat16)
              for _ in range(ncopies(N * K * 2))]
        codes0, words0, sz0, spec = mats[0]
        W = dequantize(codes0, sz0[..., 0].t().float(), spec, (N, K), torch.float32)
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            row = {"N": N, "K": K, "M": M, "int4_bytes": wbytes}
            cfg = gemv.int4_config(M, N, K)
            row["int4_config"] = cfg
            try:        # correctness of the default config, then its time
                if args.skip_triton:
                    raise RuntimeError("skipped (--skip-triton)")
                y = gemv.int4_tiles_matmul(x, words0, sz0, args.group, N, K)
                sync()
                row["int4_check"] = check(y, x, W)
                t = time_calls([lambda w=w, s=s: gemv.int4_tiles_matmul(x, w, s, args.group, N, K)
                                for _, w, s, _ in mats])
                row["int4_us"] = round(t * 1e6, 2)
                row["int4_frac"] = round(wbytes / t / bw, 3)
            except Exception as exc:          # a compiler error: record it, time the others
                row["int4_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                row["int4_check"], row["int4_us"], row["int4_frac"] = [None, -1], -1, -1
            yt = tinygemm(x, words0, args.group, sz0, N, K)
            row["tinygemm_check"] = check(yt, x, W)
            t = time_calls([lambda w=w, s=s: tinygemm(x, w, args.group, s, N, K)
                            for _, w, s, _ in mats])
            row["tinygemm_us"] = round(t * 1e6, 2)
            row["tinygemm_frac"] = round(wbytes / t / bw, 3)
            if not args.skip_bf16:
                t = time_calls([lambda b=b: torch.nn.functional.linear(x, b) for b in bf])
                row["bf16_us"] = round(t * 1e6, 2)
                row["bf16_frac"] = round(N * K * 2 / t / bw, 3)
            res["rows"].append(row)
            save()
            if args.cuda and M == 1 and args.group == 128:
                cuda_rows(row, x, mats, W, N, K, wbytes, bw, args.budget_s - (time.time() - t0))
                save()
            if args.old:              # the CUDA-core kernels of 2026-12-01 (rows / dot)
                ocfg = gemv.rows_config(N, K) if M == 1 else gemv.int4_config(16, N, K)
                yo = gemv.int4_tiles_matmul(x, words0, sz0, args.group, N, K, ocfg)
                sync()
                row["old_check"] = check(yo, x, W)
                t = time_calls([lambda w=w, s=s: gemv.int4_tiles_matmul(
                    x, w, s, args.group, N, K, ocfg) for _, w, s, _ in mats])
                row["old_us"] = round(t * 1e6, 2)
                row["old_frac"] = round(wbytes / t / bw, 3)
                save()
            sweep = (args.sweep and f"{N}x{K}" in args.sweep_shapes.split(",")
                     and str(M) in args.sweep_ms.split(","))
            if sweep:
                sw = []
                variants = [gemv.mma_config(N, K, nt, bc, warps, ctas, pf, steps)
                            for nt, bc, warps, ctas, pf, steps in (
                                (4, 2, 4, 264, 0, 2), (4, 2, 4, 132, 0, 4), (8, 1, 4, 264, 0, 2),
                                (2, 4, 4, 528, 0, 1), (4, 2, 4, 264, 1, 1), (8, 1, 4, 528, 0, 1),
                                (4, 2, 2, 528, 0, 1), (4, 2, 4, 1056, 0, 1), (2, 2, 4, 264, 0, 4),
                                (4, 2, 4, 528, 1, 1))]
                variants = [dict(t) for t in dict.fromkeys(tuple(sorted(v.items()))
                                                           for v in variants)]
                t_sweep = time.time()
                for v in variants:
                    if (v == cfg or time.time() - t0 > args.budget_s
                            or time.time() - t_sweep > args.budget_s / len(shapes)):
                        continue
                    try:
                        yv = gemv.int4_tiles_matmul(x, words0, sz0, args.group, N, K, v)
                        sync()
                        c = check(yv, x, W)
                        t = time_calls([lambda w=w, s=s, v=v: gemv.int4_tiles_matmul(
                            x, w, s, args.group, N, K, v) for _, w, s, _ in mats], reps=3)
                        sw.append({**v, "us": round(t * 1e6, 2), "frac": round(wbytes / t / bw, 3),
                                   "check": c[1], "rel": c[0]})
                    except Exception as exc:           # a config the compiler refuses
                        sw.append({**v, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                # the access pattern alone (LO: the loads and stores, no arithmetic; wrong results)
                for v in (dict(cfg, LO=1), dict(gemv.mma_config(N, K, 4, 2, 4, 264, 0, 2), LO=1)):
                    try:
                        t = time_calls([lambda w=w, s=s, v=v: gemv.int4_tiles_matmul(
                            x, w, s, args.group, N, K, v) for _, w, s, _ in mats], reps=3)
                        sw.append({**v, "us": round(t * 1e6, 2), "frac": round(wbytes / t / bw, 3)})
                    except Exception as exc:
                        sw.append({**v, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                row["int4_sweep"] = sw
                save()
            if args.int8 and M == 1:
                i8 = [(torch.randint(-128, 128, (N, K), dtype=torch.int8, device=dev),
                       (torch.rand(N, K // args.group, device=dev) * 0.02 + 0.001).half())
                      for _ in range(ncopies(N * K))]
                from deepseek_flash.quant.scheme import QuantSpec
                spec8 = QuantSpec("int8_symmetric", "per_block", args.group)
                W8 = dequantize(i8[0][0], i8[0][1], spec8, (N, K), torch.float32)
                b8 = N * K + N * (K // args.group) * 2
                y8 = gemv.int8_rows_matmul(x, i8[0][0], i8[0][1], args.group, N, K)
                sync()
                row["int8_check"] = check(y8, x, W8)
                row["int8_config"] = gemv.int8_config(M, N, K)
                t = time_calls([lambda c=c, s=s: gemv.int8_rows_matmul(x, c, s, args.group, N, K)
                                for c, s in i8])
                row["int8_us"] = round(t * 1e6, 2)
                row["int8_frac"] = round(b8 / t / bw, 3)
                t = time_calls([lambda c=c, s=s: kernels.quant_matmul(x, c, s, 8, args.group, N, K)
                                for c, s in i8])
                row["int8_old_us"] = round(t * 1e6, 2)
                row["int8_old_frac"] = round(b8 / t / bw, 3)
                if sweep and M == 1 and args.int8_sweep:
                    sw = []
                    seen = set()
                    words = K // 4
                    for bn, bwd, nw, st in [(16, 64, 4, 4), (8, 64, 4, 4), (8, 128, 4, 4),
                                            (8, 64, 8, 4)]:
                        for target in (132, 264, 528):
                            sp = 1
                            while (-(-N // bn)) * sp < target and words % (sp * 2 * bwd) == 0 \
                                    and words // (sp * 2) >= 4 * bwd:
                                sp *= 2
                            if (bn, bwd, nw, st, sp) in seen:
                                continue
                            seen.add((bn, bwd, nw, st, sp))
                            v = dict(BLOCK_N=bn, BLOCK_W=bwd, SPLIT=sp, num_warps=nw, stages=st)
                            try:
                                t = time_calls([lambda c=c, s=s, v=v: gemv.int8_rows_matmul(
                                    x, c, s, args.group, N, K, v) for c, s in i8], reps=3)
                                sw.append({**v, "us": round(t * 1e6, 2),
                                           "frac": round(b8 / t / bw, 3)})
                            except Exception as exc:
                                sw.append({**v, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                    row["int8_sweep"] = sw
                del i8
            save()
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("sweep")}), flush=True)
        del mats, bf
        if not SMOKE:
            torch.cuda.empty_cache()
    res["seconds"] = round(time.time() - t0, 1)
    save()
    print(f"copy {res['copy_bandwidth_gbps']} GB/s")
    print(f"{'N':>6} {'K':>6} {'M':>2} | {'int4 us':>8} {'frac':>5} | {'tiny us':>8} {'frac':>5} | "
          f"{'bf16 us':>8} | {'int8 us':>8} {'frac':>5} {'old us':>8} | chk4 tiny chk8")
    for r in res["rows"]:
        print(f"{r['N']:>6} {r['K']:>6} {r['M']:>2} | {r['int4_us']:>8} {r['int4_frac']:>5} | "
              f"{r['tinygemm_us']:>8} {r['tinygemm_frac']:>5} | {r.get('bf16_us', '-'):>8} | "
              f"{r.get('int8_us', '-'):>8} {r.get('int8_frac', '-'):>5} {r.get('int8_old_us', '-'):>8}"
              f" | {r['int4_check'][1]:.2f} {r['tinygemm_check'][1]:.2f} "
              f"{r.get('int8_check', [0, 0])[1]:.2f}")
    for r in res["rows"]:
        if "cuda_us" in r or "cuda_error" in r:
            best = sorted((v for v in r.get("cuda_sweep", []) if "us" in v and not v.get("LO")),
                          key=lambda v: v["us"])
            print(r["N"], r["K"], r["M"], "cuda loads only:",
                  [(v["cfg"], v.get("us"), v.get("frac")) for v in r.get("cuda_sweep", [])
                   if v.get("LO")])
            print(r["N"], r["K"], r["M"], "cuda", r.get("cuda_config"), r.get("cuda_us"),
                  r.get("cuda_frac"), r.get("cuda_check"), r.get("cuda_error", ""), "| best:",
                  [(v["cfg"], v["us"], v["frac"], v["check"]) for v in best[:5]],
                  "| errors:", [v for v in r.get("cuda_sweep", []) if "error" in v][:2])
        if "int4_error" in r:
            print(r["N"], r["K"], r["M"], "int4 error:", r["int4_error"])
        if "old_us" in r:
            print(r["N"], r["K"], r["M"], "old", r["old_us"], r["old_frac"], r["old_check"][1])
        for key in ("int4_sweep", "int8_sweep"):
            if key in r:
                best = sorted((v for v in r[key] if "us" in v and not v.get("LO")),
                              key=lambda v: v["us"])[:3]
                lo = [(v["S"], v["us"], v["frac"]) for v in r[key] if v.get("LO") and "us" in v]
                if lo:
                    print(r["N"], r["K"], r["M"], "loads only (S, us, frac):", lo)
                print(r["N"], r["K"], r["M"], key, [
                    (v.get("NT", v.get("BLOCK_N")), v.get("BC", v.get("BLOCK_W")),
                     v.get("WARPS", v.get("num_warps")), v["SPLIT"], v.get("ROWS"), v.get("PF"),
                     v.get("S"), v["us"], v["frac"], v.get("check")) for v in best])
                bad = [v for v in r[key] if "error" in v or v.get("check", 0) > 1]
                if bad:
                    print("  sweep errors/over allowance:", bad[:2])


if __name__ == "__main__":
    main()
