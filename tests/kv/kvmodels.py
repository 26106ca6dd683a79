"""Tiny random models, greedy runs and the bench scripts as modules, shared by the KV cache tests
(imported as kvmodels)."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import DynamicCache

from deepseek_flash.kv import cache_kwargs
from deepseek_flash.testing import tiny_config


BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name):
    """bench/NAME.py imported as a module (``bench_NAME``), its folder on the path while it loads
    (a bench imports its siblings)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def tiny_model(arch="llama", seed=0, layers=2, **kw):
    cfg = tiny_config(arch, num_layers=layers, **kw)
    cfg.max_position_embeddings = 4096
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def padded_prompt(batch, tokens=900, seed=7):
    """A ``batch`` x ``tokens`` prompt of random ids and its attention mask; with two or more rows
    the second is left-padded by 50 tokens."""
    ids = torch.randint(1, 256, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :50] = 0
    return ids, mask


def greedy(model, ids, mask, cache, steps):
    """Greedy tokens and per-step logits (fp32) of ``generate`` with ``cache``."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                             **cache_kwargs(model, cache), output_logits=True,
                             return_dict_in_generate=True,
                             pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def reference(model, ids, mask, steps):
    return greedy(model, ids, mask, DynamicCache(config=model.config), steps)


