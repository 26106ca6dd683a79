"""Perplexity of a model with its linear weights quantized (the accuracy figure of every scheme).

The weights go through the same ``quantize`` -> ``dequantize`` the packer and the CPU runtime use,
on every ``*_proj`` linear weight of the decoder layers (attention and MLP); embeddings, norms and
``lm_head`` stay as they are, as in a packed store. Compute is float32 on the CPU, the setting of
the shared model's README baselines.
"""
from __future__ import annotations

import math
import re

import torch

from .codec import quantize
from .scheme import QuantSpec

# The linear weights a store quantizes (store/layout.py: attn, mlp_gate_up, mlp_down blocks).
QUANTIZED_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def quantized_state(state: dict, spec: QuantSpec, search: bool = True) -> dict:
    """{name: dequantized float32 weight} for every quantized weight of ``state`` (a state dict
    whose tensors hold the source dtype, as a checkpoint does)."""
    return {name: quantize(w, spec, name, search=search).dequantize(torch.float32)
            for name, w in state.items() if QUANTIZED_WEIGHT.fullmatch(name)}


@torch.no_grad()
def window_losses(model, tokens: torch.Tensor, windows: int, context: int) -> list[float]:
    """Mean next-token loss of each of the first ``windows`` windows of ``context`` tokens, each
    scored on its own (labels = inputs)."""
    if tokens.numel() < windows * context:
        raise ValueError(f"{windows} windows of {context} tokens need {windows * context} tokens, "
                         f"the evaluation set has {tokens.numel()}")
    out = []
    for i in range(windows):
        x = tokens[i * context:(i + 1) * context].unsqueeze(0)
        out.append(float(model(input_ids=x, labels=x).loss))
    return out


def perplexity(losses: list[float]) -> float:
    """exp of the mean loss over all scored tokens (every window scores the same number)."""
    return math.exp(sum(losses) / len(losses))
