"""Accuracy and memory of KV importance pruning (``TieredCache.for_model(..., prune_threshold=)``)
on the trained model (CPU), against full attention and two eviction baselines at equal GPU KV.

Perplexity as in bench/kv_accuracy.py: ``--windows`` windows of ``--context`` tokens of the
model's held-out eval split (``eval_tokens.npy[0 : windows * context]``), batched by ``--batch``;
the first ``--prefill`` tokens are a dense prefill, every later token is decoded one step at a time
(teacher forcing) and scored. Every configuration sees the same tokens.

* full attention (``DynamicCache``);
* pruning at each ``--thresholds`` value (the seed's ablation {0.10, 0.12, 0.15, 0.18}), with and
  without the compensation factor, for each ``--recall``: ``none`` = lossless recall (the default:
  every demoted page is attended, fetched from the host; level 3 pages come back from int4) or a
  fraction = top-K recall of that fraction of the demoted pages (Quest bound);
* StreamingLLM (sinks + recent) and H2O-style accumulated-attention eviction, each with a budget of
  tokens equal to the GPU KV bytes the pruned cache held (mean over the decoded steps, sampled every
  8 steps, summaries and pruning statistics included) -- per threshold with ``--baselines all``,
  at the default threshold only with ``--baselines default``. The baselines attend only what they
  hold; the pruned cache also attends what it recalls from the host (``pages_fetched_per_step``
  says how much).

GPU KV bytes of the pruned cache: ``stats()["gpu_bytes"]`` (K and V on the device: sinks, recent
window, level-1 pages, and page summaries when top-K recall reads them; the scorer's per-token
statistics are not KV: ``scorer_gpu_bytes_final`` in the JSON), and what full
attention holds at the same instants (``full_bytes``), both sampled every 8 decode steps;
``memory_ratio`` = mean full bytes / mean GPU bytes over those samples.

``--show`` is the H200 run instead (8B shape, random weights, bf16, ``--show-context`` 32K, batch
1): GPU KV bytes and decode tok/s of ``DynamicCache``, the tiered cache alone (lossless and top-K
25 %), pruning at the defaults (threshold 0.15, lossless recall), pruning with top-K 25 % recall,
and with every page demoted (threshold 1.0: the recall-bound end), the MiB each moved to the device
per step and the scorer's cost per step in ms. ``DynamicCache`` runs twice, as bench/kv.py runs it
(``dynamic_variants``: torch's kernel choice, cuDNN included, and cuDNN left out); the stronger is
``dynamic_baseline``. Every configuration runs and times at least ``--min-steps`` (8) decode
steps; ``--budget-s`` (100 s, model build included) bounds the steps past those (up to
``--decode``). Random weights attend almost uniformly, so what they
demote is not what a trained model demotes: the memory a trained model saves is the CPU bench's
figure; the H200 run measures speed and the cost of the levels. ``--show --smoke`` runs that path
on a tiny CPU model.

    python bench/kv_prune.py [--model ../shared/models/pycode-llama] [--output kv_prune.json] [--plot docs/img/kv_prune.png]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_THRESHOLD = 0.15


def _load_model(model_dir: Path):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def make_cache(model, spec: dict):
    from transformers import DynamicCache

    from deepseek_flash.kv import TieredCache
    from deepseek_flash.kv.prune import EvictingCache

    if spec["kind"] == "dynamic":
        model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config)
    if spec["kind"] in ("streaming", "h2o"):
        return EvictingCache.for_model(model, spec["budget"], spec["kind"])
    return TieredCache.for_model(model, prune_threshold=spec["threshold"],
                                 top_k_pages=spec.get("recall"),
                                 prune_compensation=spec.get("compensation", True),
                                 prune_scorer=spec.get("scorer", "attention"))


def gpu_bytes(cache) -> int:
    return cache.stats()["gpu_bytes"] if hasattr(cache, "stats") else cache.gpu_bytes()


def full_bytes(cache) -> int:
    """What full attention holds for the tokens ``cache`` holds now (the same instant)."""
    return cache.stats()["full_bytes"] if hasattr(cache, "stats") else cache.full_bytes()


def cache_kwargs(model, cache):
    from deepseek_flash.kv import cache_kwargs as kw
    return kw(model, cache)


@torch.no_grad()
def decode_nll(model, ids: torch.Tensor, prefill: int, spec: dict):
    """Sum of next-token NLL over positions prefill..end, count, GPU KV byte samples, cache."""
    cache = make_cache(model, spec)
    logits = model(ids[:, :prefill], **cache_kwargs(model, cache), logits_to_keep=1).logits[:, -1]
    total, count, samples = 0.0, 0, []
    for i, t in enumerate(range(prefill, ids.shape[1])):
        total += torch.nn.functional.cross_entropy(logits.float(), ids[:, t], reduction="sum").item()
        count += ids.shape[0]
        if t + 1 < ids.shape[1]:
            logits = model(ids[:, t:t + 1], **cache_kwargs(model, cache)).logits[:, -1]
            if spec["kind"] != "dynamic" and i % 8 == 7:
                samples.append((gpu_bytes(cache), full_bytes(cache)))
    return total, count, samples, cache


def run(model, windows: torch.Tensor, prefill: int, spec: dict, batch: int) -> dict:
    total = count = 0
    samples, stats = [], []
    t0 = time.perf_counter()
    for i in range(0, windows.shape[0], batch):
        s, c, smp, cache = decode_nll(model, windows[i:i + batch], prefill, spec)
        total, count = total + s, count + c
        samples += smp
        if hasattr(cache, "stats"):
            stats.append(cache.stats())
    row = dict(spec, perplexity=math.exp(total / count), seconds=round(time.perf_counter() - t0, 1))
    if samples:
        row["gpu_bytes_mean"] = int(sum(g for g, _ in samples) / len(samples))
        row["full_bytes_mean"] = int(sum(f for _, f in samples) / len(samples))
    if stats:
        st = stats[-1]
        steps = (windows.shape[1] - prefill) * len(stats)
        row.update(full_bytes=st["full_bytes"], gpu_bytes_final=st["gpu_bytes"],
                   host_bytes_final=st["host_bytes"],
                   memory_ratio=round(row["full_bytes_mean"] / row["gpu_bytes_mean"], 3),
                   level_tokens=st["level_tokens"],
                   demotions=sum(s["demotions"] for s in stats),
                   promotions=sum(s["promotions"] for s in stats),
                   recalls=sum(s["recalls"] for s in stats),
                   pages_fetched_per_step=round(sum(s["pages_fetched"] for s in stats) / steps, 2),
                   level3_bytes_saved=st["level3_bytes_saved"],
                   scorer_gpu_bytes_final=st.get("scorer_gpu_bytes", 0))
    return row


def token_bytes(model) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_key_value_heads * head_dim * 4 * cfg.num_hidden_layers  # fp32, all layers


def accuracy(args) -> dict:
    import numpy as np
    import transformers

    model_dir = Path(args.model)
    model = _load_model(model_dir)
    eval_ids = np.load(model_dir / "eval_tokens.npy").astype(np.int64)
    windows = torch.from_numpy(eval_ids[:args.windows * args.context].copy()).view(
        args.windows, args.context)
    rows = []

    def record(row):
        row["delta_pct"] = round(100 * (row["perplexity"] / rows[0]["perplexity"] - 1), 3) if rows else 0.0
        row["perplexity"] = round(row["perplexity"], 4)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        return row

    record(run(model, windows, args.prefill, dict(name="full (DynamicCache)", kind="dynamic"),
               args.batch))
    recalls = [None if r == "none" else float(r) for r in args.recall]
    for recall in recalls:
        for th in args.thresholds:
            both = args.compensation == "both" and (recall is None or args.compensation_all)
            for comp in ((True, False) if both else ((args.compensation != "off"),)):
                rname = "lossless recall" if recall is None else f"top-K {recall:.0%} recall"
                spec = dict(name=f"prune {th:.2f} {'comp' if comp else 'no comp'}, {rname}",
                            kind="prune", threshold=th, recall=recall, compensation=comp,
                            scorer=args.scorer)
                r = record(run(model, windows, args.prefill, spec, args.batch))
                if recall is None and comp and (args.baselines == "all"
                                                or th == DEFAULT_THRESHOLD):
                    budget = max(2, round(r["gpu_bytes_mean"] / (token_bytes(model) * args.batch)))
                    for kind, label in (("streaming", "StreamingLLM"), ("h2o", "H2O")):
                        b = record(run(model, windows, args.prefill,
                                       dict(name=f"{label} at prune {th:.2f}'s GPU bytes",
                                            kind=kind, budget=budget, threshold_matched=th),
                                       args.batch))
                        b["gpu_bytes_mean"] = b.pop("gpu_bytes_mean", None)
    full = rows[0]["perplexity"]
    default = [r for r in rows if r.get("kind") == "prune" and r["threshold"] == DEFAULT_THRESHOLD
               and r["recall"] is None and r["compensation"]]
    goal = {}
    if default:
        d = default[0]
        base = [r for r in rows if r.get("threshold_matched") == DEFAULT_THRESHOLD]
        goal = {"memory_ratio": d["memory_ratio"], "memory_ratio_ge_3": d["memory_ratio"] >= 3.0,
                "ppl_delta_pct": d["delta_pct"], "ppl_delta_le_1pct": d["delta_pct"] <= 1.0,
                "baselines": {r["kind"]: r["perplexity"] for r in base},
                "below_both_baselines": all(d["perplexity"] < r["perplexity"] for r in base)}
    return {
        "bench": "kv_prune", "date": datetime.date.today().isoformat(),
        "machine": platform.node(), "torch": torch.__version__,
        "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "model": model_dir.name, "context": args.context, "prefill": args.prefill,
        "windows": args.windows, "scored_tokens": args.windows * (args.context - args.prefill),
        "scorer": str(args.scorer), "full_perplexity": full, "rows": rows,
        "goal_at_default_threshold": goal,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = result["rows"]
    series = {}
    for r in rows:
        if r.get("kind") == "prune":
            key = (r["recall"], r["compensation"])
            series.setdefault(key, []).append(r)
    for (recall, comp), rs in sorted(series.items(), key=lambda x: (x[0][0] or 0, not x[0][1])):
        rs = sorted(rs, key=lambda r: r["threshold"])
        x = [100 * (1 - 1 / r["memory_ratio"]) for r in rs]
        y = [r["delta_pct"] for r in rs]
        label = (f"prune, {'lossless' if recall is None else f'top-K {recall:.0%}'} recall, "
                 f"{'comp.' if comp else 'no comp.'}")
        ax.plot(x, y, "o-" if comp else "x--", label=label)
        for r, xi, yi in zip(rs, x, y):
            ax.annotate(f"{r['threshold']:.2f}", (xi, yi), textcoords="offset points",
                        xytext=(3, 3), fontsize=7)
    full = rows[0]
    for kind, marker in (("streaming", "s"), ("h2o", "^")):
        pts = [r for r in rows if r.get("kind") == kind]
        if pts:
            xs, ys = [], []
            for r in pts:
                ref = next(p for p in rows if p.get("kind") == "prune" and p["recall"] is None
                           and p["compensation"] and p["threshold"] == r["threshold_matched"])
                xs.append(100 * (1 - 1 / ref["memory_ratio"]))
                ys.append(r["delta_pct"])
            ax.plot(xs, ys, marker, label={"streaming": "StreamingLLM", "h2o": "H2O"}[kind] +
                    " (same GPU bytes)")
    ax.axhline(1.0, color="grey", lw=0.6, ls=":")
    ax.axvline(100 * (1 - 1 / 3), color="grey", lw=0.6, ls=":")
    ax.set_xlabel("GPU KV bytes saved vs full attention (%)")
    ax.set_ylabel("perplexity increase (%)")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_title(f"KV pruning, {result['model']}, context {result['context']} "
                 f"(full ppl {full['perplexity']:.3f})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# --- the H200 run -------------------------------------------------------------------------------
def _bench_kv():
    """bench/kv.py's measuring (bench/kv_steps.py): the model, prefill, sync, the DynamicCache
    variants."""
    spec = importlib.util.spec_from_file_location("bench_kv_steps",
                                                  Path(__file__).parent / "kv_steps.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def show(args) -> dict:
    """8B shape, one context: GPU KV bytes and decode tok/s of DynamicCache (with and without
    cuDNN), the tiered cache alone (lossless and top-K 25 %), pruning at the defaults (lossless
    recall) and with top-K 25 % recall, and every page demoted; the scorer's cost per decode
    step. Each configuration times ``--min-steps`` decode steps, then more up to ``--decode``
    while its share of ``--budget-s`` lasts (``decode_steps`` says how many were timed); one
    that fails is reported as ``"failed"`` with its error, the others still measured."""
    from transformers import DynamicCache

    from deepseek_flash.hostpool import process_pool
    from deepseek_flash.kv import TieredCache

    kv = _bench_kv()
    t_start = time.perf_counter()
    device = "cpu" if args.smoke else "cuda:0"
    ctx = args.show_context
    model = kv.build(args.arch, args.smoke, ctx + args.decode + 64, device)
    ids = torch.randint(0, model.config.vocab_size, (1, ctx), device=device)
    out = {"context": ctx, "decode_steps": args.decode, "budget_s": args.budget_s,
           "build_s": round(time.perf_counter() - t_start, 1)}
    plain = contextlib.nullcontext
    # name -> (a new cache, the attention kernels it runs under)
    caches = {
        # DynamicCache as a default user gets it and with cuDNN left out (bench/kv.py's
        # dynamic_variants: the stronger one is the baseline)
        **{name: (lambda: DynamicCache(config=model.config), ctx)
           for name, ctx in kv.dynamic_variants()},
        # the tiered cache alone, lossless (every page each step) and top-K 25 %
        "tiered_lossless": (lambda: TieredCache.for_model(model), plain),
        "tiered_topk25": (lambda: TieredCache.for_model(model, top_k_pages=0.25), plain),
        # pruning as a user gets it: threshold 0.15, lossless recall of the demoted pages
        "pruned": (lambda: TieredCache.for_model(model, prune_threshold=DEFAULT_THRESHOLD), plain),
        "pruned_topk25": (lambda: TieredCache.for_model(model, top_k_pages=0.25,
                                                        prune_threshold=DEFAULT_THRESHOLD), plain),
        # every page demoted (to int4 after two evaluations): the recall-bound end of pruning
        "pruned_all_demoted": (lambda: TieredCache.for_model(model, top_k_pages=0.25,
                                                             prune_threshold=1.0), plain),
    }
    rows = args.rows.split(",") if args.rows else list(SHOW_ROWS)
    unknown = [r for r in rows if r not in caches]
    if unknown:
        raise SystemExit(f"--rows: unknown {', '.join(unknown)}; known: {', '.join(SHOW_ROWS)}")
    for name in caches:
        if name not in rows:
            out[name] = {"not_run": "left out by --rows"}
    caches = {name: caches[name] for name in SHOW_ROWS if name in rows}
    pool = process_pool()
    for i, (name, (new, attention)) in enumerate(caches.items()):
        # what each configuration does after its decode (stats, scorer timing, freeing) is
        # kept out of the decode's share, so the whole run stays inside the budget
        left = args.budget_s - (time.perf_counter() - t_start) - TAIL_S * (len(caches) - i)
        # each configuration's decode stops at its share of what is left, after at least
        # --min-steps timed steps: every configuration runs, the budget bounds the steps past those
        deadline = time.perf_counter() + max(0.0, left) / (len(caches) - i)
        if name.startswith("dynamic"):
            model.set_attn_implementation("sdpa")
        pool_before = pool.stats()
        t0 = time.perf_counter()
        cache = None
        try:
            cuda = device.startswith("cuda")
            base = torch.cuda.memory_allocated() if cuda else 0
            with attention():
                cache = new()
                tok, ttft = kv.prefill(model, ids, cache, device)
                dynamic = name.startswith("dynamic")
                before = cache.stats() if not dynamic else None
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                t_dec = time.perf_counter()
                tok, steps, tps, step_ms, evaluated = _decode_until(
                    kv, model, cache, tok, args.decode, device, deadline, args.min_steps)
                decode_s = time.perf_counter() - t_dec
            kv_bytes = kv.dynamic_kv_bytes(cache) if dynamic else cache.stats()["gpu_bytes"]
            pool_now = pool.stats()
            out[name] = {"gpu_kv_bytes": kv_bytes, "tok_s": round(tps, 3),
                         # the most GPU memory the decode held above what was allocated before
                         # the cache (the weights): KV held, pages recalled or fetched for a step
                         # (gpu_kv_bytes leaves those out), the step's activations
                         "decode_peak_bytes": ((torch.cuda.max_memory_allocated() - base)
                                               if cuda else None),
                         "ttft_s": round(ttft, 3), "decode_steps": steps,
                         "decode_s": round(decode_s, 2),
                         # page-locked memory this configuration added to the process's pool
                         # (deepseek_flash/hostpool.py): 0 when it reused what an earlier one left
                         "pool_new_bytes": pool_now["reserved_bytes"]
                         - pool_before["reserved_bytes"],
                         "pool_reserved_bytes": pool_now["reserved_bytes"],
                         **_step_split(step_ms, evaluated)}
            if name.startswith("pruned"):
                st = cache.stats()
                out[name].update(level_tokens_layer0=st["level_tokens"][0],
                                 level_tokens_all=[sum(lv[i] for lv in st["level_tokens"])
                                                   for i in range(3)],
                                 demotions=st["demotions"], promotions=st["promotions"],
                                 recalls=st["recalls"], full_bytes=st["full_bytes"],
                                 host_bytes=st["host_bytes"],
                                 scorer_gpu_bytes=st["scorer_gpu_bytes"])
                # what the recalls moved per decode step (the 2 untimed steps included)
                n = steps + 2
                out[name]["recall_bytes_per_step"] = round(
                    (st["recall_bytes"] - before["recall_bytes"]) / n)
                out[name]["recall_ops_per_step"] = round(
                    (st["recall_copies"] - before["recall_copies"]) / n, 1)
                ms = scorer_ms(cache, device)
                out[name]["scorer_ms_per_evaluation"] = ms
                out[name]["scorer_ms_per_step"] = round(ms / cache.prune.every, 3)
                if args.profile_dir and name == "pruned":
                    # a profiler table of the next steps, one evaluation among them
                    left = cache.prune.every - cache.layers[0].prune.steps % cache.prune.every
                    out[name]["profile"] = profile_steps(
                        model, cache, tok, device,
                        Path(args.profile_dir) / f"kv_prune.{name}-{ctx}.txt", steps=left)
            elif not dynamic:
                st = cache.stats()
                out[name]["fetched_bytes_per_step"] = round(
                    (st["pages_fetched"] - before["pages_fetched"]) * st["page_bytes"]
                    / (steps + 2))
        except Exception as exc:  # one configuration failing leaves the others' figures
            out[name] = {"failed": f"{type(exc).__name__}: {exc}"[:500]}
        t_free = time.perf_counter()
        del cache
        kv.free(device)
        out[name]["free_s"] = round(time.perf_counter() - t_free, 2)
        out[name]["seconds"] = round(time.perf_counter() - t0, 1)
    out["total_s"] = round(time.perf_counter() - t_start, 1)
    timed = {n: out[n]["tok_s"] for n, _ in kv.dynamic_variants() if "tok_s" in out[n]}
    if timed:
        best = kv.stronger_dynamic(timed)
        out["dynamic_baseline"], out["dynamic_best_tok_s"] = best, timed[best]
        for name in SHOW_ROWS[2:]:
            if "tok_s" in out[name]:
                out[f"{name}_vs_dynamic_best_tok_s"] = round(out[name]["tok_s"] / timed[best], 3)
    dyn = out["dynamic"].get("gpu_kv_bytes")
    for name in SHOW_ROWS[2:]:
        if dyn and "gpu_kv_bytes" in out[name]:
            out[f"{name}_vs_dynamic_gpu_bytes"] = round(out[name]["gpu_kv_bytes"] / dyn, 4)
    # pruning against the tiered cache alone in the same recall mode
    for pruned, tiered in (("pruned", "tiered_lossless"), ("pruned_topk25", "tiered_topk25")):
        if "tok_s" in out[pruned] and "tok_s" in out[tiered]:
            out[f"{pruned}_vs_{tiered}_tok_s"] = round(out[pruned]["tok_s"]
                                                       / out[tiered]["tok_s"], 3)
    return out


SHOW_ROWS = ("dynamic", "dynamic_nocudnn", "tiered_lossless", "tiered_topk25", "pruned",
             "pruned_topk25",
             "pruned_all_demoted")
TAIL_S = 1.0
"""Seconds the Show keeps per configuration for what follows its decode (stats, scorer timing)."""


def _evaluations(cache) -> int:
    prune = getattr(cache, "prune", None) and cache.layers[0].prune
    return prune.counters["evaluations"] if prune else 0


def _decode_until(kv, model, cache, tok, steps, device, deadline, min_steps=1):
    """Greedy decode of up to ``steps`` timed steps (after 2 untimed), stopping at ``deadline``
    (perf_counter) once ``min_steps`` are timed, each step synchronised (as a generation loop
    that reads its token does):
    the next token, the steps timed, tok/s, each step's ms and whether pruning evaluated the
    levels in it."""
    from deepseek_flash.kv import cache_kwargs as kw

    with torch.no_grad():
        for _ in range(2):
            tok = model(tok, **kw(model, cache)).logits[:, -1:].argmax(-1)
        kv.sync(device)
        t = time.perf_counter()
        done, step_ms, evaluated = 0, [], []
        while done < steps and (done < min_steps or time.perf_counter() < deadline):
            t_step, ev = time.perf_counter(), _evaluations(cache)
            tok = model(tok, **kw(model, cache)).logits[:, -1:].argmax(-1)
            kv.sync(device)
            step_ms.append(round(1e3 * (time.perf_counter() - t_step), 2))
            evaluated.append(_evaluations(cache) > ev)
            done += 1
    return tok, done, done / (time.perf_counter() - t), step_ms, evaluated


def _step_split(step_ms, evaluated) -> dict:
    """Median ms of the steps without an evaluation of the levels and mean ms of those with."""
    plain = sorted(ms for ms, ev in zip(step_ms, evaluated) if not ev)
    evals = [ms for ms, ev in zip(step_ms, evaluated) if ev]
    out = {"step_ms": step_ms}
    if plain:
        out["median_step_ms"] = plain[len(plain) // 2]
    if evals:
        out["evaluation_step_ms"] = round(sum(evals) / len(evals), 2)
        out["evaluation_steps"] = len(evals)
    return out


def print_show(r: dict) -> None:
    print(f"\n{'cache (context ' + str(r['context']) + ')':28} {'GPU KV MiB':>11} {'vs Dynamic':>10} "
          f"{'tok/s':>8} {'steps':>6} {'MiB moved/step':>15} {'scorer ms/step':>15} "
          f"{'median step ms':>15} {'eval step ms':>13}", file=sys.stderr)
    dyn = r["dynamic"].get("gpu_kv_bytes")
    for name in SHOW_ROWS:
        x = r[name]
        if "failed" in x or "not_run" in x:
            print(f"{name:28} {'failed' if 'failed' in x else 'not run'} "
                  f"({x.get('failed') or x.get('not_run')})", file=sys.stderr)
            continue
        ratio = x["gpu_kv_bytes"] / dyn if dyn else float("nan")
        moved = x.get("recall_bytes_per_step", x.get("fetched_bytes_per_step", float("nan")))
        moved /= 2**20
        print(f"{name:28} {x['gpu_kv_bytes'] / 2**20:11.1f} {ratio:10.4f} {x['tok_s']:8.2f} "
              f"{x['decode_steps']:6d} {moved:15.1f} "
              f"{x.get('scorer_ms_per_step', float('nan')):15.3f} "
              f"{x.get('median_step_ms', float('nan')):15.2f} "
              f"{x.get('evaluation_step_ms', float('nan')):13.2f} ttft {x['ttft_s']:.2f} s, "
              f"page-locked {x['pool_new_bytes'] / 2**20:.0f} MiB new, decode peak "
              f"{(x['decode_peak_bytes'] or 0) / 2**20:.0f} MiB", file=sys.stderr)
    if "dynamic_baseline" in r:
        print(f"DynamicCache baseline: {r['dynamic_baseline']} ({r['dynamic_best_tok_s']} tok/s)",
              file=sys.stderr)
    print(f"total {r['total_s']} s (budget {r['budget_s']} s)", file=sys.stderr)


def profile_steps(model, cache, tok, device, path: Path, steps: int) -> dict:
    """A torch profiler over ``steps`` decode steps: two tables to ``path`` -- by host time (an
    eager step is bound by the host: what each operation, sync and allocation costs it) and by
    device time -- and the wall ms per step."""
    from torch.profiler import ProfilerActivity, profile

    from deepseek_flash.kv import cache_kwargs as kw

    kv = _bench_kv()
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    kv.sync(device)
    with torch.no_grad(), profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            tok = model(tok, **kw(model, cache)).logits[:, -1:].argmax(-1)
        kv.sync(device)
        wall = time.perf_counter() - t
    events = prof.key_averages()
    parts = [f"{steps} decode steps (one evaluation among them), {1e3 * wall / steps:.2f} ms "
             f"per step under the profiler\n\nby host time:\n"
             + events.table(sort_by="self_cpu_time_total", row_limit=45)]
    if cuda:
        for key in ("self_device_time_total", "self_cuda_time_total"):
            try:
                parts.append("by device time:\n" + events.table(sort_by=key, row_limit=25))
                break
            except Exception:  # a sort key this torch does not know
                continue
    path.write_text("\n\n".join(parts) + "\n")
    return {"steps": steps, "wall_ms_per_step": round(1e3 * wall / steps, 2), "table": path.name}


def scorer_ms(cache, device, reps: int = 5) -> float:
    """Scoring every layer once as an evaluation does (scorer, compensation, offsets, page
    scores on the device, brought to the host together: ``score_layers``), in ms; per decode
    step that is this / ``prune_every``."""
    from deepseek_flash.kv.prune.state import score_layers

    kv = _bench_kv()
    kv.sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        score_layers([layer.prune for layer in cache.layers])
    kv.sync(device)
    return round(1000 * (time.perf_counter() - t) / reps, 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT.parent / "shared/models/pycode-llama"))
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=1536)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.10, 0.12, 0.15, 0.18])
    ap.add_argument("--recall", nargs="+", default=["none", "0.25"],
                    help="'none' (lossless recall) and/or fractions of the demoted pages")
    ap.add_argument("--compensation", choices=("both", "on", "off"), default="both",
                    help="both: with and without, for lossless recall (top-K recall: with)")
    ap.add_argument("--compensation-all", action="store_true",
                    help="with --compensation both: for top-K recall too")
    ap.add_argument("--baselines", choices=("all", "default"), default="all")
    ap.add_argument("--scorer", default="attention")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 1 for the accuracy run, torch's own default "
                         "for --show, as a user gets it)")
    ap.add_argument("--profile-dir", default=None,
                    help="with --show: a profiler table of the pruned row's steps up to and "
                         "with its next evaluation, written there")
    ap.add_argument("--plot", default=None, help="PNG path for the ablation plot")
    ap.add_argument("--output", default=None)
    ap.add_argument("--show", action="store_true", help="the H200 run (see above)")
    ap.add_argument("--smoke", action="store_true", help="with --show: tiny CPU model")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--show-context", type=int, default=32768)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=100.0,
                    help="with --show: wall-clock bound of the whole run, model build included")
    ap.add_argument("--rows", default=None,
                    help="with --show: the configurations to run, comma-separated (default: all "
                         "of SHOW_ROWS; the others are reported as not run)")
    ap.add_argument("--min-steps", type=int, default=8,
                    help="with --show: decode steps every configuration times, budget or not")
    args = ap.parse_args(argv)
    threads = args.threads if args.threads is not None else (None if args.show else 1)
    if threads:
        torch.set_num_threads(threads)
    result = show(args) if args.show else accuracy(args)
    result.setdefault("bench", "kv_prune_show" if args.show else "kv_prune")
    text = json.dumps(result, indent=1)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)
    if args.show:
        print_show(result)
    else:
        if args.plot:
            plot(result, Path(args.plot))
        print(f"\n{'config':50} {'ppl':>8} {'delta':>8} {'full/gpu':>8} {'fetch/step':>10}",
              file=sys.stderr)
        for r in result["rows"]:
            print(f"{r['name']:50} {r['perplexity']:8.4f} {r['delta_pct']:+7.3f}% "
                  f"{r.get('memory_ratio', float('nan')):8.2f} "
                  f"{r.get('pages_fetched_per_step', float('nan')):10.1f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
