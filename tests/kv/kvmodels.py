"""Tiny random models, greedy runs and the bench scripts as modules, shared by the KV cache tests
(imported as kvmodels)."""
import pytest
import torch
import transformers
from transformers import DynamicCache

from deepseek_flash.kv import cache_kwargs
from deepseek_flash.testing import bench_module, tiny_config  # noqa: F401 (bench_module: for the kv tests)




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


