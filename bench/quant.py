"""Benchmark: quantized weights (int4 per_block g128) against bf16 and a 4-bit peer, JSON out.

    python bench/quant.py --dir /var/tmp/flash-bench [--arch llama] [--output quant.json]
    python bench/quant.py --kernel [--arch llama] [--output kernel.json]   # the matmuls alone
    python bench/quant.py --smoke [--arch qwen2] [--kernel]   # CPU, tiny model, same phases
    bash bench/gpu_quant.sh OUTDIR [ARCH]                      # the H200 run: tests, kernel, show
    python bench/quant.py --decode graphs --phases int4_budget,int4_small_budget --tokens 48
                                   # int4 with load_model(..., decode="graphs"), all else default

Model: a random 7-8B-shaped checkpoint of ``--arch`` (bf16), packed as it is and with ``--quantize int4_symmetric``
(per_block, group 128), both with the default settings. Phases, each against a limit measured in
the same run:

* sizes: store bytes, bytes streamed per token under each budget;
* ``--budget`` (8 GiB): the int4 model fits whole -- decode tok/s at batch 1 and 8 vs the bf16
  model streamed under the same budget (goal: >= 3x at batch 1);
* ``--small-budget`` (3 GiB): int4 streamed -- tok/s vs min(pinned H2D / int4 bytes per token,
  the resident int4 rate), goal >= 0.9;
* the peer: the same checkpoint in plain ``transformers`` with every linear layer but lm_head
  swapped for torch's own int4 weight-only kernel (``_weight_int4pack_mm``, the tinygemm kernel
  gpt-fast and torchao's int4 weight-only use; round-to-nearest asymmetric, group 128), resident,
  same prompt: tok/s and GPU memory beside ours (``torch.cuda.max_memory_allocated`` over the
  phase: the arena's blocks, the int4 layers' derived kernel layouts -- ``derived_bytes``, 0 when
  the host tier holds the kernel's tile layout (``int4_layout``) -- and activations);
* ``step_profile`` of our resident int4 model and of the peer (the peer's also beside our
  embedded controller, before it is closed): aten ops per batch-1 decode step, host ms to issue
  the step vs the synced step, the threads alive.

``--decode eager|graphs|auto`` loads every model with that ``load_model(..., decode=...)`` and
nothing else changed (without it: ``load_model``'s default); each phase then records the
decoder's ``stats()`` (mode, the step, captures, capture time, the graphs' pool), and on a GPU
the resident int4 phase its HBM bound -- weight bytes read per step (every parameter and int4
buffer but the input embedding table) / device-to-device copy bandwidth measured in the same run
-- and tok/s against it (goal >= 0.9). ``--phases`` runs a subset of int4_budget, bf16_budget,
int4_small_budget, peer (comparisons need both their phases), and int4_budget_tinygemm: the
resident phase with the decode rows on torch's int4 kernel instead of ``quant.gemv``'s (run
first; what the default kernel choice is measured against).

``--kernel``: each linear shape of the model at M = 1, 8, 16, 32, 128: a bf16 ``F.linear``, our
Triton kernel (int4 g128, int8 g128), torch's int4 kernel on our int4 codes (its layout derived
once, and derived on every call as a streamed layer does), and ``QuantLinear`` itself (the
runtime's choice by M, ``quant.linear.SMALL_M``): microseconds, effective GB/s of weight bytes,
and the max relative error against the float32 reference (dequantized weights, float32 matmul).
``--smoke`` runs every phase on the CPU with a tiny model (budgets scaled to the model: the whole
int4 store, and the smallest budget that streams; ``--kernel`` with the tiny model's shapes and
the CPU kernels), so CI proves the script.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import platform
import sys
import time
from pathlib import Path

from _common import ARCH_SHAPES, ARCHS, copy_bandwidth, emit, pinned_h2d, save, write_finite_model

PROMPT = 16
GROUP = 128
SMOKE_SHAPE = dict(hidden=256, intermediate=512, heads=4, kv_heads=2)


def decode_rate(model, batch: int, tokens: int, device: str, strict: bool = True) -> tuple[float, object]:
    """Decode tokens/s over all sequences: (generate N+1) - (generate 1), prefill excluded.

    When noise makes N+1 tokens look no slower than one, a ``strict`` run stops; otherwise (the
    CPU smoke runs, whose rates mean nothing) the rate of the whole N+1-token call, prefill
    included, stands in: lower than the true rate, never higher."""
    import torch

    g = torch.Generator().manual_seed(batch)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, PROMPT), generator=g).to(device)
    mask = torch.ones_like(ids)

    def sync():
        if device != "cpu":
            torch.cuda.synchronize()

    def gen(n):
        sync()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t, out

    gen(2)
    t1 = min(gen(1)[0] for _ in range(2))
    tn, out = min((gen(tokens + 1) for _ in range(2)), key=lambda r: r[0])
    if tn <= t1:
        if not strict:
            print(f"timing noise: {tokens + 1} tokens took {tn:.4f} s, one took {t1:.4f} s; "
                  f"the whole call's rate stands in", file=sys.stderr)
            return batch * (tokens + 1) / tn, out
        raise RuntimeError(f"timing noise: {tokens + 1} tokens took {tn:.4f} s, one took {t1:.4f} s; "
                           f"raise --tokens")
    return batch * tokens / (tn - t1), out


# --- the peer: torch's int4 weight-only kernel, gpt-fast's handler -----------------------------
class TinyGemmInt4Linear:
    """Factory of an ``nn.Module`` running ``torch.ops.aten._weight_int4pack_mm`` (CUDA, bf16)."""

    @staticmethod
    def quantize(weight, group: int = GROUP, inner_k_tiles: int = 8):
        """gpt-fast's ``group_quantize_tensor`` (asymmetric, round-to-nearest) + packing."""
        import torch

        w = weight.float().reshape(-1, group)
        wmax, wmin = w.amax(1, keepdim=True), w.amin(1, keepdim=True)
        scales = (wmax - wmin).clamp(min=1e-6) / 15
        zeros = wmin + scales * 8
        q = ((w - wmin) / scales).round().clamp(0, 15).to(torch.int32).reshape(weight.shape)
        packed_u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, inner_k_tiles)
        sz = torch.cat([scales.reshape(weight.shape[0], -1, 1), zeros.reshape(weight.shape[0], -1, 1)],
                       2).transpose(0, 1).contiguous().to(torch.bfloat16)
        return packed, sz

    @classmethod
    def module(cls, linear, group: int = GROUP):
        import torch
        from torch import nn

        packed, sz = cls.quantize(linear.weight.data, group)
        out_features, bias = linear.out_features, linear.bias
        # Nothing below refers to ``linear``: its bf16 weight is freed once the module is swapped.

        class Int4(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("packed", packed)
                self.register_buffer("sz", sz)
                self.bias = bias

            def forward(self, x):
                shape = x.shape
                y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, shape[-1]), self.packed, group,
                                                       self.sz)
                y = y.reshape(*shape[:-1], out_features)
                return y if self.bias is None else y + self.bias
        return Int4()


def peer_model(src, device: str):
    """Plain transformers, bf16, every decoder linear swapped for the tinygemm int4 module."""
    import torch
    import transformers
    from torch import nn

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16,
                                                              device_map=device)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name != "lm_head":
                setattr(module, child_name, TinyGemmInt4Linear.module(child))
    torch.cuda.empty_cache()
    return model.eval()


def step_profile(model, device: str, steps: int = 8) -> dict:
    """One batch-1 decode step (prompt 16, cache filled): aten ops dispatched, and milliseconds
    of host time to issue it (returned without a sync) beside the whole step (synced) -- where
    the host time is the step time, per-op CPU overhead limits decode, not the GPU."""
    import collections

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT),
                        generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    issue, total = [], []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        with Count() as count:
            model(nxt, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            sync()
            t = time.perf_counter()
            model(nxt, past_key_values=cache, use_cache=True)
            issue.append(time.perf_counter() - t)
            sync()
            total.append(time.perf_counter() - t)
    import threading

    return {"ops": sum(count.ops.values()), "top_ops": dict(count.ops.most_common(6)),
            "threads": sorted(t.name for t in threading.enumerate()),
            "host_issue_ms": round(1e3 * sorted(issue)[steps // 2], 3),
            "step_ms": round(1e3 * sorted(total)[steps // 2], 3)}


# --- kernel microbenchmark ---------------------------------------------------------------------
def _timer(device: str):
    """Microseconds per call of ``fn``: triton's ``do_bench`` on CUDA, best of a few on the CPU."""
    if device != "cpu":
        from triton.testing import do_bench

        return lambda fn: round(do_bench(fn) * 1e3, 2)

    def cpu(fn, repeat: int = 5):
        fn()
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return round(best * 1e6, 2)
    return cpu


def kernel_bench(res: dict, output, shape: dict, device: str, ms) -> None:
    import torch
    import torch.nn.functional as F

    from deepseek_flash.quant import QuantSpec, QuantizedTensor, int4pack, kernels, quantize
    from deepseek_flash.quant.linear import SMALL_M, QuantLinear

    h, inter = shape["hidden"], shape["intermediate"]
    kv = h // shape["heads"] * shape["kv_heads"]
    shapes = {"q_proj/o_proj": (h, h), "k_proj/v_proj": (kv, h), "gate/up_proj": (inter, h),
              "down_proj": (h, inter)}
    specs = {"int4_g128": QuantSpec("int4_symmetric", "per_block", GROUP),
             "int8_g128": QuantSpec("int8_symmetric", "per_block", GROUP)}
    bench = _timer(device)
    res["small_m"] = SMALL_M
    rows = []
    torch.manual_seed(0)
    for label, (N, K) in shapes.items():
        w = (torch.randn(N, K, device=device) * 0.02).to(torch.bfloat16)
        qts = {}
        for k, spec in specs.items():
            q = quantize(w, spec)
            qts[k] = QuantizedTensor(spec, q.shape, q.data.to(device), q.scales.to(device), torch.bfloat16)
        int4 = qts["int4_g128"]
        plan = int4pack.plan(device, torch.bfloat16, int4.spec, N, K)
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            row = {"shape": label, "N": N, "K": K, "M": M}
            row["bf16_us"] = bench(lambda: F.linear(x, w))
            for k, qt in qts.items():
                spec = qt.spec
                ref = x.float() @ qt.dequantize(torch.float32).T
                if device != "cpu":
                    fn = lambda: kernels.quant_matmul(x, qt.data, qt.scales, spec.bits,  # noqa: E731
                                                      spec.group_size, N, K)
                    row[f"triton_{k}_max_rel_err"] = float((fn().float() - ref).abs().max() / ref.abs().max())
                    row[f"triton_{k}_us"] = bench(fn)
                    row[f"triton_{k}_weight_gbps"] = round(qt.nbytes / (row[f"triton_{k}_us"] * 1e-6) / 1e9, 1)
                layer = QuantLinear(K, N, qt)
                row[f"runtime_{k}_us"] = bench(lambda: layer(x))
                row[f"runtime_{k}_max_rel_err"] = float((layer(x).float() - ref).abs().max() / ref.abs().max())
            if isinstance(plan, tuple):
                inner, group = plan
                packed = int4pack.layout(int4.data, inner)
                sz = int4pack.scales_and_zeros(int4.scales, int4.spec, (N, K), group, torch.bfloat16)
                ref = x.float() @ int4.dequantize(torch.float32).T
                y = int4pack.matmul(x, packed, sz, group)
                row["torch_int4_max_rel_err"] = float((y.float() - ref).abs().max() / ref.abs().max())
                row["torch_int4_us"] = bench(lambda: int4pack.matmul(x, packed, sz, group))
                row["torch_int4_derived_per_call_us"] = bench(lambda: int4pack.matmul(
                    x, int4pack.layout(int4.data, inner),
                    int4pack.scales_and_zeros(int4.scales, int4.spec, (N, K), group, torch.bfloat16), group))
            else:
                row["torch_int4_refused"] = plan
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
            res["kernel"] = rows
            save(res, output)


# --- the show ----------------------------------------------------------------------------------
def free(*objs) -> None:
    import torch

    for o in objs:
        flash = getattr(o, "flash", None)
        if flash is not None:
            flash.close()
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def streamed_bytes(model) -> int:
    """Bytes a pass streams, as the host tier holds the blocks (the model's served block list)."""
    runtime = model.flash.stream
    if runtime is None:
        return 0
    plan = runtime.plan
    length = {b.id: b.length for b in model.flash.info.blocks}
    return sum(length[b] for layer in plan.streamed_layers for b in plan.stream_blocks[layer])


def step_weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter and every quantized layer's codes
    and scales, less the input embedding table (a step reads one row of it) unless it is tied."""
    from deepseek_flash.quant.linear import QuantLinear

    seen, total = set(), 0
    tensors = list(model.parameters()) + [t for m in model.modules() if isinstance(m, QuantLinear)
                                          for t in (m.codes, m.scales)]
    for t in tensors:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = getattr(head, "weight", None) is not None and head.weight.data_ptr() == embed.data_ptr()
    return total if tied else total - embed.numel() * embed.element_size()


DECODE_STATS = ("mode", "eager_reason", "step", "fused_reason", "merged", "captures", "capture_s",
                "replays", "eager_steps", "fallback_calls", "last_fallback", "graph_pool_bytes",
                "kv_bytes")
PHASES = ("int4_budget", "bf16_budget", "int4_small_budget", "peer", "int4_budget_tinygemm")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/flash-bench")
    ap.add_argument("--arch", default="llama", choices=ARCHS)
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--small-budget", default="3GiB")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--host-cache", default="24GiB")
    ap.add_argument("--kernel", action="store_true", help="the matmul microbenchmark only")
    ap.add_argument("--decode", choices=("eager", "graphs", "auto"), default=None,
                    help="load_model(..., decode=...) for every model (default: load_model's own)")
    ap.add_argument("--phases", default=",".join(PHASES), help="a subset of " + ",".join(PHASES))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model (CI)")
    ap.add_argument("--output")
    args = ap.parse_args(argv)

    import torch

    from deepseek_flash.client import Client
    from deepseek_flash.client.model import load_model
    from deepseek_flash.daemon.planner import resident_minimum
    from deepseek_flash.quant import QuantSpec
    from deepseek_flash.sizes import parse_size
    from deepseek_flash.store import Store, pack

    device = "cpu" if args.smoke else "cuda:0"
    phases = [p for p in args.phases.split(",") if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        ap.error(f"--phases: unknown {sorted(unknown)}; known: {', '.join(PHASES)}")
    res = {"benchmark": "quant", "date": datetime.date.today().isoformat(), "host": platform.node(),
           "device": "cpu" if args.smoke else torch.cuda.get_device_name(0), "arch": args.arch,
           "mode": "kernel" if args.kernel else ("smoke" if args.smoke else "show"),
           "smoke": args.smoke, "decode": args.decode or "load_model default", "phases": phases}
    if args.kernel:
        if args.smoke:
            kernel_bench(res, args.output, SMOKE_SHAPE, "cpu", (1, 8, 16, 32))
        else:
            kernel_bench(res, args.output, ARCH_SHAPES[args.arch], "cuda", (1, 8, 16, 32, 128))
        emit(res, args.output)
        return 0

    work = Path(args.dir)
    if args.smoke:
        from deepseek_flash.testing import make_tiny_model
        src = work / f"src-{args.arch}"
        if not (src / "config.json").exists():
            make_tiny_model(src, args.arch, dtype="bfloat16", hidden_size=SMOKE_SHAPE["hidden"],
                            num_layers=4, intermediate_size=SMOKE_SHAPE["intermediate"],
                            num_heads=SMOKE_SHAPE["heads"], num_kv_heads=SMOKE_SHAPE["kv_heads"],
                            vocab_size=512)
        config = {"host_cache_bytes": "256MiB", "unified_memory_ratio": 0.05}
    else:
        src = write_finite_model(work / f"src-{args.arch}", args.arch)
        config = {"host_cache_bytes": args.host_cache, "unified_memory_ratio": 0.6}
    stores = {}
    needed = [("bf16", None)] if "bf16_budget" in phases else []
    needed.append(("int4", QuantSpec("int4_symmetric", "per_block", GROUP)))
    for name, quant in needed:       # the bf16 store only for its phase
        path = work / f"store-{args.arch}-{name}"
        if not (path / "flash_metadata.bin").exists():
            t = time.perf_counter()
            pack(src, path, quant=quant)
            res[f"pack_{name}_s"] = round(time.perf_counter() - t, 1)
        stores[name] = Store.open(path)
    int4, bf16 = stores["int4"], stores.get("bf16")
    res["store_bytes"] = {k: s.total_bytes for k, s in stores.items()}
    if bf16 is not None:
        res["store_ratio_int4_vs_bf16"] = round(int4.total_bytes / bf16.total_bytes, 4)
    if args.smoke:
        # A budget that holds the int4 model whole (twice its bytes: the tile layout's scales and
        # the planner's margins fit) and lets the bf16 one stream, at least.
        budget = max(2 * int4.total_bytes, resident_minimum(bf16.blocks) if bf16 is not None else 0)
        small = resident_minimum(int4.blocks)
        h2d = None
    else:
        budget, small = parse_size("budget", args.budget), parse_size("small", args.small_budget)
        h2d = pinned_h2d()
    res.update(budget_bytes=budget, small_budget_bytes=small, pinned_h2d_gbps=h2d)
    if device != "cpu":
        res["copy_bandwidth_gbps"] = round(copy_bandwidth(torch) / 1e9, 1)
    batches = [int(b) for b in args.batches.split(",")]
    client = Client(embedded=True, config=config)
    if device != "cpu":
        client._backend.fabric.arena(0)       # page-lock the host arena once, as the daemon does
    save(res, args.output)

    def run(store, weight_budget, label):
        from deepseek_flash.quant.linear import derived_nbytes

        if device != "cpu":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        # What is still allocated as the phase starts (the previous phases' models freed: 0 but
        # for the embedded controller's own buffers); the phase's peak includes it.
        start = torch.cuda.memory_allocated() if device != "cpu" else None
        decode = {"decode": args.decode} if args.decode else {}
        model = load_model(store.path, device=device, client=client, weight_budget=weight_budget,
                           **decode)
        per_token = streamed_bytes(model)
        rates, outs, decoder_stats, graph_profile = {}, {}, {}, None
        decoder = model.flash.decoder
        for b in batches:
            rate, out = decode_rate(model, b, args.tokens, device, strict=not args.smoke)
            rates[b], outs[b] = round(rate, 3), out.cpu()
            if b == batches[0] and device != "cpu" and decoder is not None and decoder.graphs \
                    and label == "int4_budget":
                # One replayed step of the first batch size under the torch profiler (before a
                # larger batch replaces the graphs): where the step's time goes.
                from decode import guarded, step_profile as graph_step_profile

                out_dir = Path(args.output).parent if args.output else None
                graph_profile = guarded(graph_step_profile, torch, decoder, min(decoder.states),
                                        out_dir, "int4_profile")
            if model.flash.decoder is not None:
                st = model.flash.decoder.stats()
                decoder_stats[b] = {k: (round(st[k], 3) if isinstance(st[k], float) else st[k])
                                    for k in DECODE_STATS}
        profile = step_profile(model, device) if label == "int4_budget" else None
        res[label] = {"tok_s": rates, "streamed_bytes_per_token": per_token,
                      "streaming": model.flash.stream is not None,
                      "derived_bytes": derived_nbytes(model),
                      "gpu_peak_bytes": torch.cuda.max_memory_allocated() if device != "cpu" else None,
                      "gpu_allocated_at_start_bytes": start}
        if profile is not None:
            res[label]["step_profile"] = profile
        if decoder_stats:
            res[label]["decoder"] = decoder_stats
        if graph_profile is not None:
            res[label]["graph_step_profile"] = graph_profile
        if model.flash.stream is None:
            per_step = res[label]["weight_bytes_per_step"] = step_weight_bytes(model)
            if device != "cpu":
                bound = res["copy_bandwidth_gbps"] * 1e9 / per_step
                res[label].update(hbm_bound_tok_s_per_seq=round(bound, 1),
                                  vs_hbm_bound={b: round(r / (b * bound), 3) for b, r in rates.items()})
        if model.flash.stream is not None:
            res[label]["prefetch_hit_rate"] = round(model.flash.stream.stats()["prefetch_hit_rate"], 4)
        save(res, args.output)
        name = model.flash.info.name
        del decoder                 # it holds the model: the phase's memory must go with it
        free(model)
        del model
        free()      # collected once its last reference is gone, before the next phase measures
        if device != "cpu":
            client.unload(name, tier="device")
        return rates, outs

    int4_res = bf16_res = small_res = None
    if "int4_budget_tinygemm" in phases:
        # The resident phase again with the decode rows on torch's int4 kernel (tinygemm) instead
        # of ours (``quant.gemv.INT4_MAX_M`` 0 for the phase): the two kernels in one run.
        from deepseek_flash.quant import gemv

        saved, gemv.INT4_MAX_M = gemv.INT4_MAX_M, 0
        try:
            run(int4, budget, "int4_budget_tinygemm")
        finally:
            gemv.INT4_MAX_M = saved
    if "int4_budget" in phases:
        int4_res, int4_out = run(int4, budget, "int4_budget")
    if "bf16_budget" in phases:
        bf16_res, _ = run(bf16, budget, "bf16_budget")
    if "int4_small_budget" in phases:
        small_res, small_out = run(int4, small, "int4_small_budget")
        per_token = res["int4_small_budget"]["streamed_bytes_per_token"]
        limits = ([h2d * 1e9 / max(per_token, 1)] if h2d is not None else []) + (
            [int4_res[1]] if int4_res is not None else [])
        if limits:     # the smoke run without the resident phase has no limit to compare with
            bound = min(limits)
            res["int4_small_budget"]["bound_batch1_tok_s"] = round(bound, 3)
            res["int4_small_budget"]["vs_bound"] = round(small_res[1] / bound, 3)
    if int4_res is not None and small_res is not None:
        res["streamed_tokens_equal_resident"] = all(torch.equal(small_out[b], int4_out[b]) for b in batches)
    if int4_res is not None and bf16_res is not None:
        res["int4_vs_bf16_streamed"] = {b: round(int4_res[b] / bf16_res[b], 2) for b in batches}
    if "peer" not in phases:
        client.close()
    elif device == "cpu":
        client.close()
        res["peer"] = {"not_run": "torch's int4 weight-only kernel (_weight_int4pack_mm) is the "
                                  "CUDA peer; the smoke run has no GPU"}
    else:
        base = torch.cuda.memory_allocated()
        peer = peer_model(src, device)
        mem = torch.cuda.memory_allocated() - base
        # The peer's step once beside our embedded controller (its threads, arena and mappings in
        # this process) and once without: tells the process apart from the model.
        beside = step_profile(peer, device)
        client.close()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        rates = {b: round(decode_rate(peer, b, args.tokens, device)[0], 3) for b in batches}
        res["peer"] = {"kind": "transformers + torch _weight_int4pack_mm (tinygemm), int4 g128 RTN "
                               "asymmetric, resident", "tok_s": rates, "gpu_weight_bytes": mem,
                       "gpu_peak_bytes": torch.cuda.max_memory_allocated(),
                       "step_profile": step_profile(peer, device),
                       "step_profile_beside_controller": beside}
        if int4_res is not None:
            res["int4_vs_peer"] = {b: round(int4_res[b] / rates[b], 2) for b in batches}
        del peer
        free()
    goals = {}
    if int4_res is not None:
        goals["int4_fits_budget"] = not res["int4_budget"]["streaming"]
        if "vs_hbm_bound" in res["int4_budget"]:
            goals["int4_resident_batch1_vs_hbm_bound>=0.9"] = res["int4_budget"]["vs_hbm_bound"][batches[0]] >= 0.9
    if "int4_vs_bf16_streamed" in res:
        goals["batch1_vs_bf16_streamed>=3"] = res["int4_vs_bf16_streamed"][batches[0]] >= 3
    if "vs_bound" in res.get("int4_small_budget", {}):
        goals["small_budget_vs_bound>=0.9"] = res["int4_small_budget"]["vs_bound"] >= 0.9
    res["goals"] = goals
    emit(res, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
