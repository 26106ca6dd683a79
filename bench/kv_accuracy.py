"""Accuracy of the tiered KV cache's top-K page selection on the trained model (CPU).

Perplexity: windows of ``--context`` tokens of the model's held-out eval split, batched; the first
``--prefill`` tokens are a dense prefill, every later token is decoded one step at a time
(teacher forcing) and scored. Full attention (``DynamicCache``), the lossless ``TieredCache`` and
top-K at each fraction of the pages with each page score (``quest``, ``windowed``) see the same
tokens; the recent window (``gpu_tokens``) is the default unless ``--gpu-tokens`` lists others.

Retrieval probe: ``--probes`` contexts of ``--context`` tokens of eval code in which one line
``VAR = compute_NAME(x)`` (NAME: three random syllables) sits early (token ~200); the context
ends with ``VAR = compute_`` and the model must continue with NAME. Everything before the last
``--probe-decode`` tokens is prefilled densely; the rest is decoded one token at a time with the
cache under test. Reported: accuracy over NAME's tokens (argmax), and the fraction of probes with
every token right. A row with ``top_k_pages=1`` shows how much the probe needs the early page.

    python bench/kv_accuracy.py [--model ../shared/models/pycode-llama] [--output kv_accuracy.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DynamicCache

from deepseek_flash.kv import TieredCache, cache_kwargs

ROOT = Path(__file__).resolve().parents[1]


def load(model_dir: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def make_cache(model, spec: dict):
    if spec["kind"] == "dynamic":
        return DynamicCache(config=model.config)
    return TieredCache.for_model(model, gpu_tokens=spec["gpu_tokens"],
                                 top_k_pages=spec.get("fraction"), score=spec.get("score", "hybrid"))


@torch.no_grad()
def decode_nll(model, ids: torch.Tensor, prefill: int, spec: dict) -> tuple[float, int]:
    """Sum of next-token NLL over positions prefill..end (decoded one at a time), and count."""
    cache = make_cache(model, spec)
    logits = model(ids[:, :prefill], **cache_kwargs(model, cache), logits_to_keep=1).logits[:, -1]
    total, count = 0.0, 0
    for t in range(prefill, ids.shape[1]):
        total += torch.nn.functional.cross_entropy(logits.float(), ids[:, t], reduction="sum").item()
        count += ids.shape[0]
        if t + 1 < ids.shape[1]:
            logits = model(ids[:, t:t + 1], **cache_kwargs(model, cache)).logits[:, -1]
    return total, count


def perplexity(model, windows: torch.Tensor, prefill: int, spec: dict, batch: int) -> float:
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        s, c = decode_nll(model, windows[i:i + batch], prefill, spec)
        total, count = total + s, count + c
    return math.exp(total / count)


# --- retrieval probe -----------------------------------------------------------------------------
VARS = ["result", "handler", "value", "target", "callback", "reader", "entry", "state"]
CONS, VOWELS = "bcdfghklmnprstvz", "aeiou"


def build_probes(tok, eval_ids: np.ndarray, n: int, context: int, seed: int = 0):
    """[n, context] ids and, per probe, the positions of the answer tokens at the end.

    Each context: 200 tokens of eval code, ``VAR = compute_NAME(x)`` (NAME: three random
    syllables), eval code, and finally ``VAR = compute_NAME`` again: the answer is NAME's tokens,
    which only the early line tells."""
    rng = random.Random(seed)
    probes, answers = [], []
    enc = lambda s: tok.encode(s).ids  # noqa: E731
    for i in range(n):
        var = rng.choice(VARS)
        name = "".join(rng.choice(CONS) + rng.choice(VOWELS) for _ in range(3))
        # one tokenisation of the whole line, so the answer's tokens are those the model would see
        assign = enc(f"\n{var} = compute_{name}(x)\n")
        query = enc(f"\n{var} = compute_")
        upto = enc(f"\n{var} = compute_{name}")
        assert assign[:len(upto)] == upto and upto[:len(query)] == query, (assign, upto, query)
        answer = upto[len(query):]
        head = eval_ids[(i * 7919) % 100000:][:200].tolist()
        fill_len = context - len(head) - len(assign) - len(upto)
        start = 100000 + (i * 3001) % (len(eval_ids) - 100000 - fill_len)
        filler = eval_ids[start:start + fill_len].tolist()
        ids = head + assign + filler + upto
        assert len(ids) == context
        probes.append(ids)
        answers.append(list(range(context - len(answer), context)))
    return torch.tensor(probes, dtype=torch.int64), answers


@torch.no_grad()
def retrieval(model, probes: torch.Tensor, answers, decode: int, spec: dict,
              batch: int) -> tuple[float, float]:
    """(token accuracy over all answer tokens, fraction of probes with every token right)."""
    right = total = exact = 0
    for i in range(0, probes.shape[0], batch):
        ids = probes[i:i + batch]
        start = ids.shape[1] - decode
        cache = make_cache(model, spec)
        logits = model(ids[:, :start], **cache_kwargs(model, cache), logits_to_keep=1).logits[:, -1]
        preds = {}
        for t in range(start, ids.shape[1]):
            preds[t] = logits.argmax(-1)
            if t + 1 < ids.shape[1]:
                logits = model(ids[:, t:t + 1], **cache_kwargs(model, cache)).logits[:, -1]
        for row in range(ids.shape[0]):
            ok = [int(preds[p][row]) == int(ids[row, p]) for p in answers[i + row]]
            right, total, exact = right + sum(ok), total + len(ok), exact + all(ok)
    return right / total, exact / probes.shape[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT.parent / "shared/models/pycode-llama"))
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.125, 0.25, 0.5])
    ap.add_argument("--scores", nargs="+", default=["hybrid", "quest", "windowed", "mass"],
                    help="page scores; the first is run at --fractions, the others at --other-fractions")
    ap.add_argument("--other-fractions", "--windowed-fractions", type=float, nargs="+",
                    default=[0.25], help="fractions the scores after the first are run at")
    ap.add_argument("--no-control", action="store_true", help="leave out the top-1 page row")
    ap.add_argument("--gpu-tokens", type=int, nargs="+", default=[512])
    ap.add_argument("--probes", type=int, default=16)
    ap.add_argument("--probe-decode", type=int, default=32)
    ap.add_argument("--lossless", action="store_true", help="also a lossless TieredCache row")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: a shared machine's cores make more threads spin; 0: torch's default)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    model = load(model_dir)
    eval_ids = np.load(model_dir / "eval_tokens.npy").astype(np.int64)
    windows = torch.from_numpy(eval_ids[:args.windows * args.context].copy()).view(
        args.windows, args.context)
    tok = __import__("tokenizers").Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    probes, answers = build_probes(tok, eval_ids, args.probes, args.context)

    specs = [dict(name="full (DynamicCache)", kind="dynamic")]
    for g in args.gpu_tokens:
        if args.lossless:
            specs.append(dict(name=f"tiered lossless g{g}", kind="tiered", gpu_tokens=g))
        if not args.no_control:
            specs.append(dict(name=f"top-1 page (control) g{g}", kind="tiered", gpu_tokens=g,
                              fraction=1, score=args.scores[0]))
        for score in args.scores:
            for f in (args.fractions if score == args.scores[0] else args.other_fractions):
                specs.append(dict(name=f"top-K {f:.1%} {score} g{g}", kind="tiered",
                                  gpu_tokens=g, fraction=f, score=score))
    rows = []
    base_ppl = base_ret = None
    for spec in specs:
        t = time.perf_counter()
        ppl = perplexity(model, windows, args.prefill, spec, args.batch)
        ret, exact = retrieval(model, probes, answers, args.probe_decode, spec, args.batch)
        if base_ppl is None:
            base_ppl, base_ret = ppl, ret
        row = dict(spec, perplexity=round(ppl, 4), delta_pct=round(100 * (ppl / base_ppl - 1), 3),
                   retrieval=round(ret, 4), retrieval_exact=round(exact, 4),
                   retrieval_vs_full=round(ret / base_ret, 4) if base_ret else None,
                   seconds=round(time.perf_counter() - t, 1))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    goal = [r for r in rows if r.get("fraction") == 0.25 and r.get("gpu_tokens") == 512]
    result = {
        "bench": "kv_accuracy", "date": datetime.date.today().isoformat(),
        "machine": platform.node(), "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "model": model_dir.name, "context": args.context, "prefill": args.prefill,
        "windows": args.windows, "scored_tokens": args.windows * (args.context - args.prefill),
        "probes": args.probes, "probe_decode": args.probe_decode,
        "rows": rows,
        "goals": {"top_k_25pct_ppl_delta_le_1pct": {r["score"]: r["delta_pct"] <= 1.0 for r in goal},
                  "top_k_25pct_retrieval_ge_0.95x": {
                      r["score"]: (r["retrieval_vs_full"] or 0) >= 0.95 for r in goal}},
    }
    text = json.dumps(result, indent=1)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)
    print(f"\n{'config':34} {'ppl':>9} {'delta':>8} {'retrieval':>10} {'exact':>6}",
          file=sys.stderr)
    for r in rows:
        print(f"{r['name']:34} {r['perplexity']:9.4f} {r['delta_pct']:+7.3f}% "
              f"{r['retrieval']:10.3f} {r['retrieval_exact']:6.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
