"""The decode step's attention on CUDA: ``decode.kernels.decode_attention``'s Triton kernels
(split-key flash decoding; a sweep of keys a program, keys a loop step and warps) and
``decode.flash``'s (no mask tensor: the row's first slot and the current slot read from the device;
its own sweep, ``flash``) against torch's sdpa, at the 8B llama's heads (32 query heads over 8 key/value heads of 128), batch 1 and 8, for
several visible lengths, with a left-padded additive mask as the step builds it. Each figure the
median of CUDA-graph replays of 64 calls; each output checked against sdpa (max |difference|).

    python bench/attention.py --output OUT.json [--lengths 256,512,4096] [--batches 1,8]
    python bench/attention.py --smoke --output OUT.json     # CPU, Triton's interpreter: runs
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

SWEEP = [(None, 64, 4), (64, 64, 8), (128, 64, 4), (256, 64, 8), (32, 32, 4)]
# decode.flash: (keys a program, keys a loop step, warps, split kernel); None: its defaults
FLASH_SWEEP = [(None, None, None, None), (16, 16, 4, "sum"), (16, 16, 2, "sum"), (16, 16, 1, "sum"),
               (32, 32, 4, "sum"), (32, 16, 2, "sum"), (64, 16, 4, "sum"), (8, 8, 1, "sum"),
               (16, 16, 4, "dot"), (32, 32, 4, "dot"), (64, 64, 4, "dot"), (128, 64, 4, "dot"),
               (64, 32, 4, "dot"), (256, 64, 4, "dot"), (32, 16, 4, "dot"), (128, 128, 8, "dot")]


def timed(fn, smoke: bool, calls: int = 64) -> float:
    """Seconds per call: ``calls`` calls captured in one graph, median of 5 replays."""
    if smoke:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / calls)
    return sorted(ts)[2]


def best_flash(res: dict, batch: int = 1) -> str:
    """The decode.flash shape with the least total time over ``batch``'s lengths in a result of this
    bench, as bench/decode.py's FLASH_TUNED takes it ("chunk,block,warps,kernel")."""
    totals: dict = {}
    rows = [r for r in res["rows"] if r["batch"] == batch]
    for row in rows:
        for o in row.get("flash", []):
            if "us" in o:
                key = (o["chunk"], o["block"], o["warps"], o["kernel"])
                totals.setdefault(key, []).append(o["us"])
    complete = {k: sum(v) for k, v in totals.items() if len(v) == len(rows)}
    if not complete:
        raise ValueError(f"no decode.flash shape timed at every length of batch {batch}")
    return ",".join(map(str, min(complete, key=complete.get)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", required=True)
    ap.add_argument("--best-of", action="store_true",
                    help="print the fastest decode.flash shape (summed over the lengths) of the first of --batches "
                         "in the result in --output (bench/decode.py's FLASH_TUNED)")
    ap.add_argument("--lengths", default="256,512,1024,4096")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--budget-s", type=float, default=25.0, help="no new case after this many seconds")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--flash-only", action="store_true", help="sdpa and decode.flash, not decode_attention's sweep")
    args = ap.parse_args(argv)
    if args.best_of:
        print(best_flash(json.loads(Path(args.output).read_text()), int(args.batches.split(",")[0])))
        return 0
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from deepseek_flash.decode import flash, kernels

    torch.manual_seed(0)
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    heads, kv_heads, d = (8, 2, 32) if args.smoke else (32, 8, 128)
    lengths = [130] if args.smoke else [int(v) for v in args.lengths.split(",")]
    sweep = [] if args.flash_only else SWEEP[:2] if args.smoke else SWEEP
    flash_sweep = FLASH_SWEEP[:2] if args.smoke else FLASH_SWEEP
    res = {"benchmark": "attention", "device": "cpu" if args.smoke else torch.cuda.get_device_name(),
           "heads": heads, "kv_heads": kv_heads, "head_dim": d, "default_chunk": kernels.ATTENTION_CHUNK,
           "flash_default": [flash.CHUNK, flash.BLOCK, flash.WARPS],
           "rows": []}
    t0 = time.time()
    for b in [int(v) for v in args.batches.split(",")]:
        for length in lengths:
            if time.time() - t0 > args.budget_s:
                break
            q = torch.randn(b, kv_heads, heads // kv_heads, d, device=dev, dtype=dtype)
            cache_k = torch.randn(b, kv_heads, length + 64, d, device=dev, dtype=dtype)
            cache_v = torch.randn(b, kv_heads, length + 64, d, device=dev, dtype=dtype)
            keys, values = cache_k[:, :, :length], cache_v[:, :, :length]
            allowed = torch.ones(b, 1, 1, length, dtype=torch.bool, device=dev)
            for row in range(b):
                allowed[row, ..., :row * 3] = False          # left padding
            allowed[..., length - length // 4:] = False      # slots past the current one
            mask = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill(~allowed, float("-inf"))
            scale = d ** -0.5
            ref = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
            row = {"batch": b, "length": length,
                   "sdpa_us": round(timed(lambda: torch.nn.functional.scaled_dot_product_attention(
                       q, keys, values, attn_mask=mask, scale=scale), args.smoke) * 1e6, 2), "ours": []}
            for chunk, block, warps in sweep:
                try:
                    out = kernels._tri_decode_attention(q, keys, values, mask, scale, chunk, block, warps)
                    diff = (out.float() - ref.float()).abs().max().item()
                    t = timed(lambda: kernels._tri_decode_attention(q, keys, values, mask, scale, chunk,
                                                                    block, warps), args.smoke)
                    row["ours"].append({"chunk": chunk or kernels.ATTENTION_CHUNK, "block": block,
                                        "warps": warps, "us": round(t * 1e6, 2), "max_diff": diff})
                except Exception as exc:   # noqa: BLE001 -- a shape the compiler refuses: recorded
                    row["ours"].append({"chunk": chunk, "block": block, "warps": warps,
                                        "error": f"{type(exc).__name__}: {exc}"[:200]})
            # decode.flash over the same keys: the cache itself, the row's first slot, the slot
            valid_from = torch.arange(b, device=dev) * 3
            slot = torch.tensor([length - length // 4 - 1], device=dev)
            row["flash"] = []
            for chunk, block, warps, kern in flash_sweep:
                shape = {"chunk": chunk or flash.CHUNK, "block": block or flash.BLOCK, "warps": warps or flash.WARPS,
                         "kernel": kern or flash.KERNEL}
                try:
                    call = lambda: flash._tri_decode_attention(q, cache_k, cache_v, valid_from, slot, length,  # noqa: E731
                                                               0, scale, chunk, block, warps, kern)
                    diff = (call().float() - ref.float()).abs().max().item()
                    row["flash"].append({**shape, "us": round(timed(call, args.smoke) * 1e6, 2), "max_diff": diff})
                except Exception as exc:   # noqa: BLE001 -- a shape the compiler refuses: recorded
                    row["flash"].append({**shape, "error": f"{type(exc).__name__}: {exc}"[:200]})
            res["rows"].append(row)
            Path(args.output).write_text(json.dumps(res, indent=1))
    res["seconds"] = round(time.time() - t0, 1)
    Path(args.output).write_text(json.dumps(res, indent=1))
    for row in res["rows"]:
        ours = [o for o in row["ours"] if "us" in o]
        default = ours[0] if ours and row["ours"][0] is ours[0] else None
        best = min(ours, key=lambda o: o["us"]) if ours else None
        print(f"b{row['batch']} L{row['length']}: sdpa {row['sdpa_us']} us | default "
              f"{default and default['us']} us | best {best and (best['chunk'], best['block'], best['warps'], best['us'])}"
              f" | max diff {max((o['max_diff'] for o in ours), default=None)}"
              f" | errors {sum('error' in o for o in row['ours'])}")
        fl = [o for o in row["flash"] if "us" in o]
        best = min(fl, key=lambda o: o["us"]) if fl else None
        print(f"  flash: default {fl and row['flash'][0].get('us')} us | best "
              f"{best and (best['chunk'], best['block'], best['warps'], best['kernel'], best['us'])} | max diff "
              f"{max((o['max_diff'] for o in fl), default=None)} | errors {sum('error' in o for o in row['flash'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
