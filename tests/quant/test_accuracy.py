"""The int4 per_block g128 accuracy goal on the shared trained model (issue goal: <= +2.0 %
perplexity; plain round-to-nearest costs +2.7 % on the full 12 windows).

The same 12 windows of 1024 tokens as bench/accuracy.py (about 15 s on two idle cores): fewer do
not do -- the first 3 alone give +2.66 % (their unquantized perplexity is 11.52, harder text than
the average), so a shorter test would measure a different thing than the goal.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from deepseek_flash.quant import QuantSpec
from deepseek_flash.quant.accuracy import QUANTIZED_WEIGHT, perplexity, quantized_state, window_losses

MODEL = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "pycode-llama"
WINDOWS, CONTEXT = 12, 1024


def test_int4_g128_within_two_percent_of_the_unquantized_model():
    from transformers import AutoModelForCausalLM

    assert (MODEL / "eval_tokens.npy").is_file(), f"the shared model is missing at {MODEL}"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    tokens = torch.from_numpy(np.load(MODEL / "eval_tokens.npy").astype(np.int64))
    original = {k: v.clone() for k, v in model.state_dict().items()}
    base = perplexity(window_losses(model, tokens, WINDOWS, CONTEXT))

    source = {k: v.to(torch.bfloat16) for k, v in original.items()}
    quantized = quantized_state(source, QuantSpec("int4_symmetric", "per_block", 128))
    assert len(quantized) == 8 * 7 and all(QUANTIZED_WEIGHT.fullmatch(k) for k in quantized)
    model.load_state_dict({**original, **quantized})
    ppl = perplexity(window_losses(model, tokens, WINDOWS, CONTEXT))
    delta = ppl / base - 1
    assert 0 < delta <= 0.020, f"int4 g128 perplexity {ppl:.4f} vs {base:.4f}: {delta:+.2%}"
