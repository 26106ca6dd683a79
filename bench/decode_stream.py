"""Benchmark: a streamed model (weight budget smaller than the model) decoding with graphs.

A random model of the 8B ``--arch`` layer shape (``--layers`` of them, finite bf16 values, packed
into a store), loaded with ``weight_budget`` below its size so the MLPs of a tail of layers stream
through slots; then in the same run:

* the PCIe bound: streamed bytes per step / pinned host->GPU rate measured here;
* ``load_model(..., decode="graphs")``: tok/s at batch 1 and 8 (the slot ring's copies are part of
  the captured step, ``client.stream.StaticRing``), vs the bound;
* the same model through transformers' ``generate()`` (the ring driven by its per-layer hooks, the
  path measured at 0.99 x the bound before), vs the bound;
* greedy tokens of the two (the first step where they differ: fused kernels may round apart).

Decode tok/s = batch x (N - 1) / (t(generate N) - t(generate 1)), N = ``--new``; the model's eos
id is cleared (random weights: every requested token is decoded) and the JSON records the new
tokens each timed call returned (``new_tokens_returned``).

    python bench/decode_stream.py [--arch llama] [--layers 6] [--budget 2GiB] --dir /var/tmp/x
    python bench/decode_stream.py --arch llama --layers 32 --budget 8GiB --src /var/tmp/x/src-llama
                                   # the 8B model streamed under 8 GiB (``--src``: reuse a
                                   # checkpoint of that shape, e.g. bench/quant.py's)
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time

from _common import ARCH_SHAPES, add_arch_argument, emit, pinned_h2d, save, write_finite_llama


SMOKE = dict(hidden=64, layers=4, intermediate=128, vocab=256, heads=4, kv_heads=2)


def rate(torch, generate, ids, new: int):
    cuda = ids.is_cuda

    def run(n):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t, out
    run(new)
    t1 = min(run(1)[0] for _ in range(2))
    tn, out = run(new)
    returned = out.shape[1] - ids.shape[1]
    if returned != new:
        raise RuntimeError(f"generate(max_new_tokens={new}) returned {returned} new tokens")
    return ids.shape[0] * (new - 1) / max(tn - t1, 1e-9), out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/var/tmp/flash-decode-stream")
    add_arch_argument(parser)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--budget", default="2GiB", help="weight budget on the GPU")
    parser.add_argument("--src", help="checkpoint directory (written there with this shape if absent); "
                                      "default DIR/<arch>-<layers>/src")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, a tiny model under its minimum budget: the same code paths, no bound")
    parser.add_argument("--output")
    args = parser.parse_args(argv)

    import pathlib

    import torch

    from deepseek_flash.client import Client
    from deepseek_flash.client.model import load_model
    from deepseek_flash.sizes import parse_size
    from deepseek_flash.store import Store, pack

    if not args.smoke and not torch.cuda.is_available():
        print("bench/decode_stream.py needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda:0"
    work = pathlib.Path(args.dir) / f"{args.arch}-{args.layers}{'-smoke' if args.smoke else ''}"
    t0 = time.perf_counter()
    shape = SMOKE if args.smoke else dict(ARCH_SHAPES[args.arch], layers=args.layers)
    src = write_finite_llama(pathlib.Path(args.src) if args.src else work / "src", arch=args.arch, **shape)
    store_dir = work / "store"
    work.mkdir(parents=True, exist_ok=True)          # with --src nothing was written under it yet
    if not (store_dir / "flash_metadata.bin").exists():
        pack(src, store_dir)
    store = Store.open(store_dir)
    if args.smoke:
        from deepseek_flash.daemon.planner import resident_minimum

        budget = resident_minimum(store.blocks)
    else:
        budget = parse_size("budget", args.budget)
    res = {"benchmark": "decode_stream", "arch": args.arch, "layers": shape["layers"], "smoke": args.smoke,
           "date": datetime.date.today().isoformat(),
           "gpu": torch.cuda.get_device_name(0) if not args.smoke else None,
           "model_bytes": store.total_bytes, "budget_bytes": budget,
           "prepare_s": round(time.perf_counter() - t0, 1), "prompt": args.prompt, "new_tokens": args.new}
    # The smoke's "bound" is a nominal 1 GB/s: its ratios only prove the arithmetic runs.
    res["pinned_h2d_gbps"] = 1.0 if args.smoke else pinned_h2d(2 << 30)
    save(res, args.output)
    client = Client(embedded=True, config={"host_cache_bytes": (store.total_bytes // (1 << 20) + 1024) << 20})
    model = load_model(store_dir, device=device, client=client, weight_budget=budget,
                       decode="graphs", decode_capacity=args.prompt + args.new)
    model.generation_config.eos_token_id = None     # random weights: decode every requested token
    runtime = model.flash.stream
    if runtime is None:
        print(f"budget {args.budget} holds the whole model: nothing streams", file=sys.stderr)
        return 2
    plan = runtime.plan
    per_step = sum(store.block(b).length for layer in plan.streamed_layers
                   for b in plan.stream_blocks[layer])
    bound = res["pinned_h2d_gbps"] * 1e9 / per_step
    res["plan"] = {"streamed_layers": len(plan.streamed_layers), "slots": plan.n_slots,
                   "streamed_bytes_per_step": per_step}
    res["bound_tok_s_per_seq"] = round(bound, 3)
    decoder = model.flash.decoder
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for b in (int(x) for x in args.batches.split(",")):
        ids = torch.randint(1, vocab, (b, args.prompt), generator=gen).to(device)
        t = time.perf_counter()
        graphs, out_graphs = rate(torch, model.generate, ids, args.new)
        wall = time.perf_counter() - t
        stats = decoder.stats()
        hooks, out_hooks = rate(torch, decoder.transformers_generate, ids, args.new)
        same = out_graphs[:, args.prompt:] == out_hooks[:, args.prompt:]
        first = [int((~row).nonzero()[0]) if (~row).any() else args.new for row in same]
        res.setdefault("batches", {})[b] = {
            "graphs_tok_s": round(graphs, 3), "graphs_vs_bound": round(graphs / (b * bound), 3),
            "hooks_tok_s": round(hooks, 3), "hooks_vs_bound": round(hooks / (b * bound), 3),
            "graphs_vs_hooks": round(graphs / hooks, 3), "first_divergent_step": first,
            "new_tokens_returned": [out_graphs.shape[1] - args.prompt, out_hooks.shape[1] - args.prompt],
            "mode": stats["mode"], "eager_reason": stats["eager_reason"], "step": stats["step"],
            "fused_reason": stats["fused_reason"], "ring": stats["ring"], "merged": stats["merged"],
            "captures": stats["captures"], "capture_s": round(stats["capture_s"], 3),
            "graphs_wall_s": round(wall, 2)}
        save(res, args.output)
    model.flash.close()
    client.close()
    res["goal_graphs>=0.97*bound"] = all(v["graphs_vs_bound"] >= 0.97 for v in res["batches"].values())
    emit(res, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
