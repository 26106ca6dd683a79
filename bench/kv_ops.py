"""Benchmark (CPU): what one decode step costs the host, counted, not timed -- aten operations
dispatched, host->device-style copies (``copy_`` calls and the tensors of ``_foreach_copy_`` calls,
one operation for many copies) and host syncs (``.tolist``/``.item`` of
a tensor) per decode step, for ``DynamicCache``, the tiered cache's top-K 25 % and its lossless
mode, at two context lengths. An eager step is bound by the host on a fast GPU, so these counts
say what the tiered cache adds to each step; a fetch whose cost grows with the number of pages
shows up as counts that grow with the context.

    python bench/kv_ops.py [--arch llama] [--contexts 2048 8192] [--output kv_ops.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

SHAPE = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, vocab_size=512,
             num_attention_heads=8, num_key_value_heads=2)


def build(arch: str, max_pos: int):
    import torch
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[arch]
    extra = {"sliding_window": None} if arch == "mistral" else {}
    cfg = cls(max_position_embeddings=max_pos, tie_word_embeddings=False, **SHAPE, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def count_step(model, cache, tok, steps=2):
    """Mean aten ops, ``copy_`` calls and host syncs (a tensor's ``tolist``/``item``, or
    ``_local_scalar_dense``) per decode step."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from deepseek_flash.kv import cache_kwargs

    counts = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            counts[name] += 1
            if name == "_foreach_copy_":  # one call, one copy per tensor of its list
                counts["copies_in_foreach"] += len(args[0])
            return func(*args, **(kwargs or {}))

    syncs = [0]
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item")}

    def counting(original):
        def call(self, *a, **k):
            syncs[0] += 1
            return original(self, *a, **k)
        return call

    with torch.no_grad():
        tok = model(tok, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)  # warm
        for name, original in originals.items():
            setattr(torch.Tensor, name, counting(original))
        try:
            with Count():
                for _ in range(steps):
                    tok = model(tok, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
    copies = counts.pop("copies_in_foreach", 0) + counts["copy_"]
    total = sum(counts.values())
    return {"ops": total / steps, "copies": copies / steps,
            "syncs": (syncs[0] + counts["_local_scalar_dense"]) / steps,
            "index_select": counts["index_select"] / steps}, tok


def run(arch, T):
    import torch
    from transformers import DynamicCache

    from deepseek_flash.kv import TieredCache, cache_kwargs

    model = build(arch, T + 64)
    ids = torch.randint(1, SHAPE["vocab_size"], (1, T), generator=torch.Generator().manual_seed(T))
    r = {"context": T}
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        dc = DynamicCache(config=model.config)
        tok = model(ids, **cache_kwargs(model, dc)).logits[:, -1:].argmax(-1)
        r["dynamic"], _ = count_step(model, dc, tok)
        cache = TieredCache.for_model(model, top_k_pages=0.25)
        tok = model(ids, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
        r["pages_per_layer"] = cache.layers[-1].n_pages
        r["topk25"], tok = count_step(model, cache, tok)
        cache.top_k_pages = None
        r["lossless"], _ = count_step(model, cache, tok)
        cache.close()
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=("llama", "qwen2", "mistral"), default="llama")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    result = {"bench": "kv_ops", "arch": args.arch, "layers": SHAPE["num_hidden_layers"],
              "contexts": [run(args.arch, T) for T in args.contexts]}
    text = json.dumps(result, indent=1)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)
    print(f"{'context':>8} {'pages':>6} {'mode':>9} {'ops':>8} {'copies':>7} {'syncs':>6}",
          file=sys.stderr)
    for r in result["contexts"]:
        for mode in ("dynamic", "topk25", "lossless"):
            m = r[mode]
            print(f"{r['context']:>8} {r['pages_per_layer']:>6} {mode:>9} {m['ops']:>8.0f} "
                  f"{m['copies']:>7.0f} {m['syncs']:>6.0f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
