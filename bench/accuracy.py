"""Perplexity of every quantization scheme on the shared trained model (CPU, minutes).

    python bench/accuracy.py [--model ../shared/models/pycode-llama] [--windows 12] [--context 1024]

bf16 source weights, float32 compute (the README baselines' setting), the first ``--windows``
windows of ``--context`` tokens of the model's held-out ``eval_tokens.npy``. Each scheme quantizes
every attention and MLP linear weight (not embeddings, norms, lm_head) exactly as ``pack
--quantize`` does; plain round-to-nearest int4 g128 (absmax scale) is measured in the same run as
the baseline the scale search must beat. JSON out (``--output``), a table on stderr; the goals are
checked against the same run's unquantized perplexity.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from deepseek_flash.quant import QuantSpec
from deepseek_flash.quant.accuracy import perplexity, quantized_state, window_losses

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [
    ("int8 per_tensor", QuantSpec("int8_symmetric", "per_tensor"), True),
    ("int8 per_block g128", QuantSpec("int8_symmetric", "per_block", 128), True),
    ("int4 per_tensor", QuantSpec("int4_symmetric", "per_tensor"), True),
    ("int4 per_block g32", QuantSpec("int4_symmetric", "per_block", 32), True),
    ("int4 per_block g64", QuantSpec("int4_symmetric", "per_block", 64), True),
    ("int4 per_block g128", QuantSpec("int4_symmetric", "per_block", 128), True),
    ("int4 per_block g128 round-to-nearest", QuantSpec("int4_symmetric", "per_block", 128), False),
]
# The goals: relative perplexity increase over the unquantized model, at most.
GOALS = {"int8 per_block g128": 0.001, "int4 per_block g128": 0.020}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT.parent / "shared" / "models" / "pycode-llama"))
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--only", action="append", help="a config label (repeatable); default: all")
    ap.add_argument("--output", help="write the JSON here too")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    source = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    original = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.from_numpy(np.load(Path(args.model) / "eval_tokens.npy").astype(np.int64))

    t = time.perf_counter()
    base = perplexity(window_losses(model, tokens, args.windows, args.context))
    rows = [{"config": "bf16", "perplexity": round(base, 4), "delta_pct": 0.0,
             "seconds": round(time.perf_counter() - t, 1)}]
    for label, spec, search in CONFIGS:
        if args.only and label not in args.only:
            continue
        t = time.perf_counter()
        model.load_state_dict({**original, **quantized_state(source, spec, search=search)})
        ppl = perplexity(window_losses(model, tokens, args.windows, args.context))
        row = {"config": label, "perplexity": round(ppl, 4),
               "delta_pct": round((ppl / base - 1) * 100, 3),
               "seconds": round(time.perf_counter() - t, 1)}
        if label in GOALS:
            row["goal_pct"] = GOALS[label] * 100
            row["goal_met"] = ppl / base - 1 <= GOALS[label]
        rows.append(row)
        print(f"{label:40s} {ppl:8.4f} {row['delta_pct']:+7.3f} %", file=sys.stderr, flush=True)
    doc = {"bench": "accuracy", "model": Path(args.model).name, "windows": args.windows,
           "context": args.context, "compute": "float32 cpu", "results": rows}
    text = json.dumps(doc, indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)
    return 0 if all(r.get("goal_met", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
