"""Lossless mode on the shared trained model (../shared/models/pycode-llama): after a 1,500-token
prompt of its held-out eval code, 64 greedy steps with most KV in host pages give DynamicCache's
tokens and logits."""
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from deepseek_flash.kv import TieredCache

from kvmodels import greedy, reference

MODEL = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "pycode-llama"


@pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason=f"no {MODEL}")
def test_trained_model_lossless_64_steps():
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = torch.from_numpy(np.load(MODEL / "eval_tokens.npy")[:1500].astype(np.int64))[None]
    want_tokens, want_logits = reference(model, ids, None, 64)
    cache = TieredCache.for_model(model)  # the defaults: 512 recent tokens, 32-token pages
    tokens, logits = greedy(model, ids, None, cache, 64)
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() <= 1e-4
    s = cache.stats()
    assert s["page_tokens"] == 32 and s["pages"] == 8 * ((1563 - 4 - 512) // 32)
    assert s["gpu_bytes"] < s["full_bytes"] / 2
