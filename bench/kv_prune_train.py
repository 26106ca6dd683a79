"""Train the ``"mlp"`` importance scorer of KV pruning (kv/prune/scorers.py, ``MLPScorer``) for one
model, on the CPU in a few minutes.

Data: the model's own held-out eval split (``eval_tokens.npy``), from token ``--start`` on
(100,000 by default: bench/kv_prune.py and bench/kv_accuracy.py measure on the first tokens, so
training and measurement never share a token) -- no training corpus, no generated text. Per window
of ``--context`` tokens: a prefill of ``--prefill`` tokens and ``--observe`` decoded steps through a
``TieredCache`` with pruning at threshold 0 (nothing is demoted, every token attended and
observed); the features of every paged token are taken then (``features(ScoreInput)``: the
attention statistics and key/value norms the cache keeps), and the target is what the token
receives over the next ``--horizon`` decoded steps: its mean attention share relative to a uniform
share, ``y = x / (x + ATTENTION_HALF)`` -- the attention scorer's scale (kv/prune/scorers.py), so a
threshold means the same for both (0.15: a token predicted to receive less than an average share).
Loss: MSE; Adam.

    python bench/kv_prune_train.py [--model ../shared/models/pycode-llama] --output kv_prune_mlp.pt

Put the file beside the model (its directory, or the store of a ``load_model`` model) as
``kv_prune_mlp.pt`` for ``prune_scorer="mlp"``, or pass its path as ``prune_scorer``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


@torch.no_grad()
def collect(model, windows: torch.Tensor, prefill: int, observe: int, horizon: int):
    from deepseek_flash.kv import TieredCache, cache_kwargs
    from deepseek_flash.kv.prune.scorers import features

    cache = TieredCache.for_model(model, prune_threshold=0.0)
    model(windows[:, :prefill], **cache_kwargs(model, cache))
    t = prefill
    for _ in range(observe):
        model(windows[:, t:t + 1], **cache_kwargs(model, cache))
        t += 1
    xs, spans = [], []
    for layer in cache.layers:
        pr, s = layer.prune, layer.sinks
        n = pr.n_pages * cache.page_tokens
        inp = pr.stats.input(layer.index, cache.num_layers, s, s + n, layer.length)
        xs.append(features(inp).reshape(-1, features(inp).shape[-1]).clone())
        spans.append((s, s + n))
    future = [torch.zeros(windows.shape[0], e - s) for s, e in spans]
    for _ in range(horizon):
        model(windows[:, t:t + 1], **cache_kwargs(model, cache))
        t += 1
        for i, layer in enumerate(cache.layers):
            s, e = spans[i]
            future[i] += layer.prune.stats.last[:, s:e]
    ys = []
    for f in future:
        ys.append(scale(f / horizon).reshape(-1))
    return torch.cat(xs), torch.cat(ys)


def scale(x: torch.Tensor) -> torch.Tensor:
    """A relative attention share -> 0..1 as the attention scorer maps it (the uniform share:
    the default threshold 0.15)."""
    from deepseek_flash.kv.prune.scorers import ATTENTION_HALF

    return x / (x + ATTENTION_HALF)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT.parent / "shared/models/pycode-llama"))
    ap.add_argument("--start", type=int, default=100_000)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=640)
    ap.add_argument("--observe", type=int, default=128)
    ap.add_argument("--horizon", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output", default="kv_prune_mlp.pt")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from deepseek_flash.kv.prune import MLPScorer

    t0 = time.perf_counter()
    model_dir = Path(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    need = args.prefill + args.observe + args.horizon
    if need > args.context:
        ap.error(f"prefill + observe + horizon = {need} > context {args.context}")
    eval_ids = np.load(model_dir / "eval_tokens.npy").astype(np.int64)
    span = eval_ids[args.start:args.start + args.windows * args.context]
    windows = torch.from_numpy(span.copy()).view(args.windows, args.context)
    xs, ys = [], []
    for i in range(0, args.windows, args.batch):
        x, y = collect(model, windows[i:i + args.batch], args.prefill, args.observe, args.horizon)
        xs.append(x)
        ys.append(y)
    x, y = torch.cat(xs), torch.cat(ys)
    collected = time.perf_counter() - t0
    # a random 20 % of the samples (from the same windows) is held out to report the fit
    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(x.shape[0], generator=g)
    cut = int(0.8 * x.shape[0])
    tr, va = perm[:cut], perm[cut:]
    torch.manual_seed(args.seed)
    kv_heads = (x.shape[1] - 5) // 2
    mlp = MLPScorer(kv_heads, args.hidden)
    opt = torch.optim.Adam(mlp.parameters(), lr=3e-3)
    for _ in range(args.epochs):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(mlp.forward(x[tr]), y[tr])
        loss.backward()
        opt.step()
    with torch.no_grad():
        val = torch.nn.functional.mse_loss(mlp.forward(x[va]), y[va]).item()
        base = torch.nn.functional.mse_loss(torch.full_like(y[va], y[tr].mean()), y[va]).item()
        # the attention scorer's own prediction of the future, for comparison: its scale of the
        # moving average (feature 0 is log1p(mass))
        m = torch.expm1(x[va, 0])
        att = torch.nn.functional.mse_loss(scale(m), y[va]).item()
        below_true = y[va] < 0.15
        below_pred = mlp.forward(x[va]) < 0.15
        agree = (below_true == below_pred).float().mean().item()
    mlp.save(args.output)
    result = {"bench": "kv_prune_train", "model": model_dir.name, "samples": int(x.shape[0]),
              "data": f"eval_tokens[{args.start}:{args.start + args.windows * args.context}]",
              "features": int(x.shape[1]), "hidden": args.hidden, "epochs": args.epochs,
              "val_mse": round(val, 5), "val_mse_constant": round(base, 5),
              "val_mse_attention_scorer": round(att, 5),
              "val_agreement_below_0.15": round(agree, 4),
              "seconds": round(time.perf_counter() - t0, 1),
              "collect_seconds": round(collected, 1), "output": str(args.output)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
