"""Benchmark: decode tok/s of a resident model with ``decode="graphs"`` against the HBM bound.

An 8B-shaped model of ``--arch`` (random bf16 weights on the GPU), 128-token prompt, 256 new
tokens, batch 1 and 8, all in one run:

* the HBM bound: weight bytes read per step (every parameter but the input embedding table, of
  which a step reads one row per sequence) / device-to-device copy bandwidth measured in this run
  (bytes read + written per second, as a copy moves them);
* ``decode.enable`` (what ``load_model(..., decode="graphs")`` installs): tok/s, time to capture,
  memory the graphs hold; and the same step through transformers' modules (``fused`` off,
  variant ``graphs_modules``) to show what the fused forward buys (``--variants`` adds
  ``graphs_transformers_attention`` / ``graphs_transformers_norm``: that path without the packed
  grouped-query attention / the one-kernel norm);
* operations per decode step, fused and through the modules, counted with a dispatch hook on the
  CPU over the same module structure (all layers, narrow widths): what a GPU step launches;
* transformers' eager ``generate()`` (dynamic cache; fewer new tokens, ``--eager-tokens``: its
  rate is flat per token) and the compiled peer: ``generate(cache_implementation="static")``,
  which compiles the decode step with ``torch.compile(mode="reduce-overhead")`` (transformers'
  documented compile path), warmed up before timing;
* greedy tokens of the graphs vs eager ``generate()`` over 64 steps, and the largest logit
  difference over the steps where both saw the same tokens;
* one step under the torch profiler: kernels per step, GPU time by kernel, step time.

Decode tok/s = batch x (N - 1) / (t(generate N) - t(generate 1)): decode steps only, prefill out.

``--int4``: the same model with every projection int4 (g128, tile layout, bound as the host tier
holds it: ``to_int4``) -- the resident int4 decode, against the HBM bound of its codes, scales,
bf16 head and norms; variant ``graphs_unmerged`` runs q, k, v (gate, up) one GEMV each beside the
default merged step (``decode.fused.MERGE_QUANTIZED``). Variants (any model) of the step's attention
(``decode.fused.ATTENTION``), each with its own parity and profile: ``graphs_sdpa`` (torch's),
``graphs_triton_attention`` (``decode.kernels.decode_attention``), ``graphs_rope_attention`` (the
rotary and cache write inside that kernel), ``graphs_flash_attention`` (``decode.flash``: no mask
tensor, the keys a row sees read from the device).

    python bench/decode.py [--arch llama] [--batches 1,8] [--output decode.json]
    python bench/decode.py --int4 --variants graphs,graphs_unmerged --skip-eager --skip-peer
    python bench/decode.py --smoke        # CPU, a tiny model: the same code paths, no bound
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

from _common import copy_bandwidth, emit, save

SHAPES = {
    "llama": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, vocab_size=128256,
                  num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
    "qwen2": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, vocab_size=152064,
                  num_attention_heads=28, num_key_value_heads=4),
    "mistral": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, vocab_size=32768,
                    num_attention_heads=32, num_key_value_heads=8, sliding_window=None),
}
SMOKE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=256,
             num_attention_heads=4, num_key_value_heads=2)


ATTENTION_VARIANTS = ("graphs_sdpa", "graphs_triton_attention", "graphs_rope_attention",
                      "graphs_flash_attention")
# Variants with their own rounding: their own parity and profile (graphs_cuda_gemv / graphs_tinygemm:
# int4 one-row GEMVs through quant.cuda_gemv on / off, whatever its default; graphs_cuda_gemv_a0 /
# graphs_swap: its default shapes with x / two n-tiles as the mma's A operand (cuda_gemv.SWAP);
# graphs_silu_apart / graphs_silu_fused: silu_mul apart from / inside the down GEMV
# (cuda_gemv.FUSE_SILU); graphs_swap_silu: both on; graphs_glu / graphs_glu_apart: silu_mul inside
# the gate|up GEMV's epilogue on / off (cuda_gemv.FUSE_GLU); graphs_flash_glu: that and
# graphs_flash_attention's attention; graphs_ring: the default GEMV shapes streaming their codes
# through a ring of 4 chunks a warp in shared memory (cuda_gemv.RING); graphs_flash_glu_ring: all three;
# graphs_flash_glu_norm: flash + glu and the residual add + norm inside the q|k|v and gate|up GEMVs
# (cuda_gemv.FUSE_NORM); graphs_all: those and the ring; graphs_pdl: the default with every int4 GEMV
# launched with programmatic dependent launch (cuda_gemv.PDL); graphs_g4: the gate|up GEMV in the
# sweep's fastest shape (one gate and one up n-tile a block, 4 CTAs an SM looping over blocks);
# graphs_flash_tuned: decode.flash in the shape FLASH_TUNED="chunk,block,warps,kernel" names)
OWN_ROUNDING = ATTENTION_VARIANTS + ("graphs_cuda_gemv", "graphs_tinygemm", "graphs_cuda_gemv_a0",
                                     "graphs_silu_apart", "graphs_swap", "graphs_silu_fused",
                                     "graphs_swap_silu", "graphs_glu", "graphs_glu_apart",
                                     "graphs_flash_glu", "graphs_ring", "graphs_flash_glu_ring",
                                     "graphs_flash_glu_norm", "graphs_all", "graphs_pdl", "graphs_g4",
                                     "graphs_flash_tuned")


def build(arch: str, shape: dict, device, dtype, layers: int | None = None):
    """A random model made directly on ``device`` (no checkpoint): normal(0, 0.02) weights, unit
    norms, rotary tables computed from the config as ``from_pretrained`` computes them."""
    import torch
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[arch]
    shape = dict(shape)
    if layers:
        shape["num_hidden_layers"] = layers
    config = cls(max_position_embeddings=4096, tie_word_embeddings=False, **shape)
    config.eos_token_id = None                      # random weights: decode every requested token
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device)
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


# The projections --int4 quantizes, grouped as the store's blocks hold them (block roles attn,
# mlp_gate_up, mlp_down): the host tier lays each group's tile-layout codes back to back.
INT4_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
               ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


def to_int4(model, group: int) -> dict:
    """Every decoder projection as int4 (round to nearest, absmax scales per ``group`` columns,
    symmetric: the store's ``int4_symmetric`` codes) in torch's CUDA int4 tile layout, bound as
    ``QuantLinear`` the way a model loaded from a tile-layout host tier is: each block group's codes
    back to back in one buffer (``quant.host_tier.tiled_block``), scales beside them. The head and
    the embedding stay bfloat16, as in the store (``bench/quant.py``'s resident int4 model)."""
    import torch

    from deepseek_flash.quant import QuantizedTensor, QuantSpec, int4pack
    from deepseek_flash.quant.codec import pack_int4
    from deepseek_flash.quant.host_tier import TILES
    from deepseek_flash.quant.linear import bind_quantized

    spec = QuantSpec("int4_symmetric", "per_block", group)
    dtype = next(model.parameters()).dtype
    count = 0
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for owner, names in INT4_GROUPS:
                linears = [getattr(getattr(layer, owner), n) for n in names]
                tiles = []
                for lin in linears:
                    N, K = lin.weight.shape
                    inner, g = int4pack.plan("cuda", torch.bfloat16, spec, N, K)
                    w = lin.weight.float().reshape(N, K // g, g)
                    scales = (w.abs().amax(-1) / 7).clamp_min(1e-8).half()
                    q = torch.round(w / scales.float()[..., None]).clamp_(-8, 7).reshape(N, K)
                    tiles.append((int4pack.cuda_layout(pack_int4(q), inner), (inner, g),
                                  int4pack.scales_and_zeros(scales, spec, (N, K), g, dtype)))
                buffer = torch.cat([t.reshape(-1) for t, _, _ in tiles])
                at = 0
                for name, lin, (t, kernel, sz) in zip(names, linears, tiles):
                    codes = buffer[at:at + t.numel()].view(t.shape)
                    at += t.numel()
                    qt = QuantizedTensor(spec, tuple(lin.weight.shape), codes, sz, dtype, TILES, kernel)
                    bind_quantized(model, f"model.layers.{i}.{owner}.{name}", qt, fixed=True)
                    count += 1
    return {"scheme": "int4_symmetric", "group": group, "layout": TILES, "projections": count}


def weight_bytes_per_step(model) -> int:
    """Every parameter and every quantized layer's codes and scales, less the input embedding
    table (a step reads one row of it) unless it is the head's."""
    from deepseek_flash.quant.linear import QuantLinear

    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, QuantLinear)
                 for t in (m.codes, m.scales))
    return total if embed.data_ptr() == head.data_ptr() else total - embed.numel() * embed.element_size()


def timed(torch, fn, cuda: bool):
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


def decode_rate(torch, generate, ids, mask, new: int, cuda: bool, **kw):
    """(tok/s of decode steps, output of the long call): batch x (new-1) / (t(new) - t(1))."""
    def run(n):
        return timed(torch, lambda: generate(ids, attention_mask=mask, max_new_tokens=n,
                                             do_sample=False, **kw), cuda)
    t1 = min(run(1)[0] for _ in range(3))
    tn, out = run(new)
    return ids.shape[0] * (new - 1) / max(tn - t1, 1e-9), out, tn


def step_profile(torch, decoder, batch: int, out_dir, name: str = "profile") -> dict:
    """Three replays of the last captured graph of ``batch`` under the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    keys = [k for k in decoder.graphs if k[0] == batch]
    if not keys:
        return {"error": "no graph captured"}
    graph = decoder.graphs[keys[-1]]
    st = decoder.states[batch]
    with torch.inference_mode():            # the state tensors were made in inference mode
        saved = st.snapshot()
        st.slot.fill_(keys[-1][1] - 4)      # replays advance the slot: stay inside the graph's window
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
        st.restore(saved)
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0)
        if dev:
            rows.append((e.key, e.count / 3, dev / 3))
    rows.sort(key=lambda r: -r[2])
    kernels = sum(r[1] for r in rows)
    gpu_us = sum(r[2] for r in rows)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
    if out_dir:
        (out_dir / f"{name}_b{batch}.txt").write_text(table)
    return {"kernels_per_step": round(kernels), "kernel_time_us_per_step": round(gpu_us, 1),
            "top": [{"kernel": k[:90], "per_step": round(c, 1), "us": round(us, 1)}
                    for k, c, us in rows[:12]]}


def logit_parity(torch, decoder, ids, mask, steps: int) -> dict:
    """Greedy tokens of the graphs vs eager generate() for ``steps`` steps, and the largest logit
    difference over the steps where both had the same input tokens."""
    eager = decoder.transformers_generate(
        ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, output_logits=True,
        return_dict_in_generate=True)
    eager_logits = torch.stack(eager.logits, dim=1).float()          # (batch, steps, vocab)
    ours_tokens, ours_logits = decoder.generate_with_logits(
        ids, attention_mask=mask, max_new_tokens=steps, do_sample=False)
    new_eager = eager.sequences[:, ids.shape[1]:]
    new_ours = ours_tokens[:, ids.shape[1]:]
    same = (new_eager == new_ours)
    first_diff = [int((~row).nonzero()[0]) if (~row).any() else steps for row in same]
    diffs = []
    for row, k in enumerate(first_diff):
        upto = min(k + 1, steps)                  # step k still had the same inputs
        diffs.append((eager_logits[row, :upto] - ours_logits[row, :upto]).abs().max().item())
    return {"steps": steps, "tokens_identical": bool(same.all()), "first_divergent_step": first_diff,
            "max_logit_diff": max(diffs), "logit_scale": eager_logits.abs().max().item()}


def count_step_ops(arch: str, shape: dict, layers: int | None = None) -> dict:
    """Operations of one decode step (generate(3) - generate(2)) on the CPU, fused and through
    transformers' modules, for ``shape``'s layer structure at narrow widths."""
    import torch

    from deepseek_flash.decode import enable
    from deepseek_flash.decode.fused import OpCounter

    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    narrow = dict(shape, hidden_size=heads * 8, intermediate_size=heads * 16, vocab_size=512)
    res = {}
    for fused in (True, False):
        model = build(arch, narrow, torch.device("cpu"), torch.float32, layers)
        enable(model, capacity=32, fused=fused)
        ids = torch.randint(1, 500, (1, 4), generator=torch.Generator().manual_seed(0))
        counts = {}
        for n in (3, 2, 3):
            with OpCounter() as counter:
                model.generate(ids, max_new_tokens=n, do_sample=False)
            counts[n] = counter.counts
        step = counts[3] - counts[2]
        res["fused" if fused else "modules"] = {
            "total": sum(step.values()), "kv_heads": kv_heads,
            "by_op": dict(sorted(step.items(), key=lambda kv: -kv[1]))}
    return res


def guarded(fn, *args):
    """A diagnostic phase whose failure is recorded, not fatal to the figures around it."""
    try:
        return fn(*args)
    except Exception as exc:   # noqa: BLE001 -- recorded in the JSON
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="llama", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the 8B shape")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--eager-tokens", type=int, default=64)
    parser.add_argument("--parity-steps", type=int, default=64)
    parser.add_argument("--variants", default="graphs,graphs_modules",
                        help="graphs (the default step), graphs_modules, graphs_transformers_attention, "
                             "graphs_transformers_norm")
    parser.add_argument("--skip-eager", action="store_true",
                        help="no eager generate() rates (measured before: they do not change)")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-ops", action="store_true",
                        help="no operations-per-step count (CPU work; the counts do not change)")
    parser.add_argument("--only-peer", action="store_true", help="the compiled peer alone")
    parser.add_argument("--peer-budget-s", type=float, default=240.0,
                        help="skip the compiled peer for further batches once it has used this long")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, few tokens")
    parser.add_argument("--int4", action="store_true",
                        help="the projections as int4 in the tile layout (to_int4): the resident "
                             "int4 model; variant graphs_unmerged runs them one GEMV each")
    parser.add_argument("--output")
    parser.add_argument("--out-dir", help="profile tables go here")
    args = parser.parse_args(argv)

    import pathlib

    import torch
    import transformers

    from deepseek_flash.decode import enable
    from deepseek_flash.decode import fused as fusion
    from deepseek_flash.decode.engine import batch_bucket

    out_dir = pathlib.Path(args.out_dir) if args.out_dir else None
    cuda = not args.smoke
    if args.smoke:
        device, dtype, shape = torch.device("cpu"), torch.float32, SMOKE
        args.prompt, args.new, args.eager_tokens, args.parity_steps = 8, 16, 16, 16
        args.skip_peer = True
    else:
        if not torch.cuda.is_available():
            print("bench/decode.py needs a CUDA device (or --smoke)", file=sys.stderr)
            return 2
        device, dtype, shape = torch.device("cuda:0"), torch.bfloat16, SHAPES[args.arch]
    batches = [int(b) for b in args.batches.split(",")]
    res = {"benchmark": "decode", "arch": args.arch, "date": datetime.date.today().isoformat(),
           "host": platform.node(), "smoke": args.smoke, "prompt": args.prompt, "new_tokens": args.new,
           "eager_new_tokens": args.eager_tokens, "torch": torch.__version__,
           "transformers": transformers.__version__}
    if cuda:
        res["gpu"] = torch.cuda.get_device_name(0)
        res["copy_bandwidth_gbps"] = round(copy_bandwidth(torch) / 1e9, 1)
    if args.int4 and args.smoke:
        shape = dict(shape, hidden_size=128, intermediate_size=256)     # K a multiple of 32
    t = time.perf_counter()
    model = build(args.arch, shape, device, dtype, args.layers)
    if args.int4:
        res["int4"] = to_int4(model, 32 if args.smoke else 128)
        if cuda:
            torch.cuda.empty_cache()
    res["build_s"] = round(time.perf_counter() - t, 2)
    res["weight_bytes_per_step"] = weight_bytes_per_step(model)
    if cuda:
        res["hbm_bound_tok_s_per_seq"] = round(
            res["copy_bandwidth_gbps"] * 1e9 / res["weight_bytes_per_step"], 1)
    save(res, args.output)

    gen = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(1, shape["vocab_size"], (b, args.prompt), generator=gen).to(device)
               for b in batches}
    capacity = args.prompt + args.new
    decoder = None
    default_attention = fusion.ATTENTION
    from deepseek_flash.quant import cuda_gemv
    default_gemv, default_gemv_swap, default_silu, default_glu = (cuda_gemv.ENABLED, cuda_gemv.SWAP,
                                                                  cuda_gemv.FUSE_SILU, cuda_gemv.FUSE_GLU)
    default_ring, default_norm, default_pdl = cuda_gemv.RING, cuda_gemv.FUSE_NORM, cuda_gemv.PDL
    from deepseek_flash.decode import flash
    default_gate_up = cuda_gemv.PINNED[(28672, 4096)]
    default_flash = (flash.CHUNK, flash.BLOCK, flash.WARPS, flash.KERNEL)
    tuned_flash = default_flash
    if os.environ.get("FLASH_TUNED"):      # "chunk,block,warps,kernel", e.g. bench/attention.py's best
        c, b_, w, k = os.environ["FLASH_TUNED"].split(",")
        tuned_flash = (int(c), int(b_), int(w), k)
    known = {"graphs": {}, "graphs_modules": {"fused": False}, "graphs_unmerged": {}, "graphs_sdpa": {},
             "graphs_triton_attention": {}, "graphs_rope_attention": {}, "graphs_flash_attention": {},
             "graphs_cuda_gemv": {}, "graphs_tinygemm": {}, "graphs_cuda_gemv_a0": {},
             "graphs_silu_apart": {}, "graphs_swap": {}, "graphs_silu_fused": {},
             "graphs_swap_silu": {}, "graphs_glu": {}, "graphs_glu_apart": {}, "graphs_flash_glu": {},
             "graphs_ring": {}, "graphs_flash_glu_ring": {}, "graphs_flash_glu_norm": {}, "graphs_all": {},
             "graphs_pdl": {}, "graphs_g4": {}, "graphs_flash_tuned": {},
             "graphs_transformers_attention": {"fused": False, "packed_attention": False},
             "graphs_transformers_norm": {"fused": False, "fused_norm": False}}
    chosen = ["graphs"] + [v for v in args.variants.split(",") if v and v != "graphs"]
    for variant in chosen if not args.only_peer else ():
        options = known[variant]
        if variant not in ("graphs", "graphs_modules", "graphs_unmerged") + OWN_ROUNDING and args.smoke:
            continue
        if decoder is not None:
            decoder.reset()
        fusion.MERGE_QUANTIZED = variant != "graphs_unmerged"
        cuda_gemv.ENABLED = {"graphs_cuda_gemv": True, "graphs_tinygemm": False}.get(variant,
                                                                                  default_gemv)
        cuda_gemv.SWAP = {"graphs_cuda_gemv_a0": 0, "graphs_swap": 1,
                          "graphs_swap_silu": 1}.get(variant, default_gemv_swap)
        cuda_gemv.FUSE_SILU = {"graphs_silu_apart": False, "graphs_silu_fused": True,
                               "graphs_swap_silu": True}.get(variant, default_silu)
        cuda_gemv.FUSE_GLU = {"graphs_glu": True, "graphs_glu_apart": False, "graphs_flash_glu": True,
                              "graphs_flash_glu_ring": True, "graphs_flash_glu_norm": True,
                              "graphs_all": True}.get(variant, default_glu)
        cuda_gemv.RING = {"graphs_ring": 4, "graphs_flash_glu_ring": 4, "graphs_all": 4}.get(variant, default_ring)
        cuda_gemv.FUSE_NORM = {"graphs_flash_glu_norm": True, "graphs_all": True}.get(variant, default_norm)
        cuda_gemv.PINNED[(28672, 4096)] = (2, 1, 1, 4) if variant == "graphs_g4" else default_gate_up
        flash.CHUNK, flash.BLOCK, flash.WARPS, flash.KERNEL = (
            tuned_flash if variant == "graphs_flash_tuned" else default_flash)
        cuda_gemv.PDL = {"graphs_pdl": 1}.get(variant, default_pdl)
        fusion.ATTENTION = {"graphs_sdpa": "sdpa", "graphs_triton_attention": "triton",
                            "graphs_rope_attention": "rope_triton",
                            "graphs_flash_attention": "flash",
                            "graphs_flash_glu": "flash",
                            "graphs_flash_glu_ring": "flash", "graphs_flash_glu_norm": "flash",
                            "graphs_all": "flash", "graphs_flash_tuned": "flash"}.get(variant, default_attention)
        decoder = enable(model, capacity=capacity, **options)
        for b in batches:
            ids = prompts[b]
            mask = torch.ones_like(ids)
            reserved = torch.cuda.memory_reserved() if cuda else 0
            t_first, _ = timed(torch, lambda: model.generate(ids, attention_mask=mask,
                                                             max_new_tokens=args.new,
                                                             do_sample=False), cuda)
            rate, out, tn = decode_rate(torch, model.generate, ids, mask, args.new, cuda)
            stats = decoder.stats()
            entry = {"tok_s": round(rate, 2), "generate_s": round(tn, 3), "first_call_s": round(t_first, 3),
                     "mode": stats["mode"], "eager_reason": stats["eager_reason"], "step": stats["step"],
                     "fused_reason": stats["fused_reason"]}
            if variant != "graphs_modules":
                entry.update(merged=stats["merged"], triton=stats["triton"],
                             captures=stats["captures"], capture_s=round(stats["capture_s"], 3),
                             graph_pool_bytes=stats["graph_pool_bytes"], kv_bytes=stats["kv_bytes"],
                             memory_growth_bytes=(torch.cuda.memory_reserved() - reserved) if cuda else 0)
                if cuda:
                    entry["vs_hbm_bound"] = round(rate / (b * res["hbm_bound_tok_s_per_seq"]), 3)
                    entry["bandwidth_gbps"] = round(rate / b * res["weight_bytes_per_step"] / 1e9, 1)
            res.setdefault(variant, {})[b] = entry
            save(res, args.output)
            if variant == "graphs":
                if cuda:
                    res.setdefault("profile", {})[b] = guarded(step_profile, torch, decoder,
                                                               batch_bucket(b), out_dir)
                res.setdefault("parity", {})[b] = guarded(logit_parity, torch, decoder, ids, mask,
                                                          args.parity_steps)
                save(res, args.output)
            elif variant in OWN_ROUNDING:       # its own rounding: its own parity and profile
                if cuda:
                    entry["profile"] = guarded(step_profile, torch, decoder, batch_bucket(b), out_dir,
                                               variant)
                entry["parity"] = guarded(logit_parity, torch, decoder, ids, mask, args.parity_steps)
                save(res, args.output)
    if not (args.only_peer or args.skip_ops):  # CPU work, after the GPU figures (a cut run keeps those)
        res["ops_per_step"] = guarded(count_step_ops, args.arch, shape, args.layers)
        save(res, args.output)
    fusion.MERGE_QUANTIZED, fusion.ATTENTION = True, default_attention
    cuda_gemv.ENABLED, cuda_gemv.SWAP, cuda_gemv.FUSE_SILU, cuda_gemv.FUSE_GLU = (
        default_gemv, default_gemv_swap, default_silu, default_glu)
    cuda_gemv.RING, cuda_gemv.FUSE_NORM, cuda_gemv.PDL = default_ring, default_norm, default_pdl
    cuda_gemv.PINNED[(28672, 4096)] = default_gate_up
    flash.CHUNK, flash.BLOCK, flash.WARPS, flash.KERNEL = default_flash
    if decoder is not None:
        decoder.reset()
    decoder = enable(model, capacity=capacity)

    for b in batches if not (args.only_peer or args.skip_eager) else ():
        ids = prompts[b]
        mask = torch.ones_like(ids)
        rate, _, _ = decode_rate(torch, decoder.transformers_generate, ids, mask, args.eager_tokens, cuda)
        res.setdefault("eager_generate", {})[b] = {"tok_s": round(rate, 2)}
        save(res, args.output)

    if not args.skip_peer:
        spent = 0.0
        for b in batches:
            if spent > args.peer_budget_s:
                res.setdefault("compiled_peer", {})[b] = {"skipped": f"peer budget spent ({spent:.0f} s)"}
                continue
            ids = prompts[b]
            mask = torch.ones_like(ids)
            kw = {"cache_implementation": "static"}
            t0 = time.perf_counter()
            try:
                for _ in range(2):      # compile + record the graphs at this shape
                    decoder.transformers_generate(ids, attention_mask=mask, max_new_tokens=args.new,
                                                  do_sample=False, **kw)
                warm = time.perf_counter() - t0
                started = time.time()
                rate, out, _ = decode_rate(torch, decoder.transformers_generate, ids, mask, args.new,
                                           cuda, **kw)
                res.setdefault("compiled_peer", {})[b] = {"tok_s": round(rate, 2), "warmup_s": round(warm, 1),
                                                          "timed_from": started, "timed_to": time.time()}
            except Exception as exc:   # noqa: BLE001 -- the peer's failure is a result to record
                res.setdefault("compiled_peer", {})[b] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            spent += time.perf_counter() - t0
            save(res, args.output)

    if args.only_peer:
        emit(res, args.output)
        return 0
    summary = {}
    for b in batches:
        ours = res["graphs"][b]["tok_s"]
        row = {"graphs_tok_s": ours}
        if "graphs_modules" in res:
            row["modules_tok_s"] = res["graphs_modules"][b]["tok_s"]
        if "graphs_unmerged" in res:
            row["unmerged_tok_s"] = res["graphs_unmerged"][b]["tok_s"]
            row["merged_vs_unmerged"] = round(ours / res["graphs_unmerged"][b]["tok_s"], 3)
        for variant in OWN_ROUNDING:
            if variant in res:
                name = variant.removeprefix("graphs_")
                row[f"{name}_tok_s"] = res[variant][b]["tok_s"]
                row[f"vs_{name}"] = round(ours / res[variant][b]["tok_s"], 3)
        if "eager_generate" in res:
            row["eager_tok_s"] = res["eager_generate"][b]["tok_s"]
            row["vs_eager"] = round(ours / res["eager_generate"][b]["tok_s"], 2)
        peer = res.get("compiled_peer", {}).get(b, {})
        if "tok_s" in peer:
            row["peer_tok_s"] = peer["tok_s"]
            row["vs_peer"] = round(ours / peer["tok_s"], 2)
        if cuda:
            row["vs_hbm_bound"] = res["graphs"][b]["vs_hbm_bound"]
        summary[b] = row
    res["summary"] = summary
    if cuda and args.int4:
        res["goals"] = {"int4_resident_batch1>=0.9*hbm_bound": res["graphs"][batches[0]]["vs_hbm_bound"] >= 0.9}
    elif cuda:
        res["goals"] = {"batch1>=0.6*hbm_bound": res["graphs"][batches[0]]["vs_hbm_bound"] >= 0.6,
                        "ahead_of_compiled_peer": (all(r.get("vs_peer", 0) > 1 for r in summary.values())
                                                   if "compiled_peer" in res else "peer not run")}
    emit(res, args.output)
    print(json.dumps(summary), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
