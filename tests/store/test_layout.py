"""plan_blocks and architecture: pure layout decisions."""
from __future__ import annotations

import pytest

from deepseek_flash import errors
from deepseek_flash.store.layout import TensorSpec, architecture, plan_blocks
from deepseek_flash.store.synth import llama_shapes


def _specs(tied=False):
    shapes = llama_shapes(64, 2, 128, 100, 2, 4, tied)
    return {n: TensorSpec(n, "float16", s) for n, s in shapes.items()}


def test_untied_layout():
    blocks = plan_blocks({"num_hidden_layers": 2}, _specs(), lambda a, b: False, "m")
    assert [b.role for b in blocks] == ["embed"] + ["norms", "attn", "mlp_gate_up", "mlp_down"] * 2 + [
        "final_norm", "lm_head"]
    attn = blocks[2]
    assert [t.offset for t in attn.tensors] == [0, 8192, 12288, 16384]
    assert attn.length == 16384 + 64 * 64 * 2


def test_tied_config_aliases_even_when_lm_head_present():
    blocks = plan_blocks({"num_hidden_layers": 2, "tie_word_embeddings": True}, _specs(),
                         lambda a, b: False, "m")
    assert blocks[-1].role == "final_norm" and blocks[0].tensors[0].aliases == ["lm_head.weight"]


def test_missing_lm_head_is_alias():
    specs = _specs(tied=True)
    blocks = plan_blocks({"num_hidden_layers": 2}, specs, lambda a, b: False, "m")
    assert blocks[0].names == ["model.embed_tokens.weight", "lm_head.weight"]


def test_inv_freq_ignored_unknown_rejected():
    specs = _specs()
    specs["model.norm.weight"] = TensorSpec("model.norm.weight", "float16", (63,))
    blocks = plan_blocks({"num_hidden_layers": 2}, specs, lambda a, b: False, "m")
    assert blocks[-2].length == 126   # an odd-sized tensor needs no padding at the end
    specs["model.layers.0.self_attn.rotary_emb.inv_freq"] = TensorSpec("x", "float32", (16,))
    assert len(plan_blocks({"num_hidden_layers": 2}, specs, lambda a, b: False, "m")) == 11
    specs["model.layers.0.mlp.experts.0.weight"] = TensorSpec("x", "float32", (16,))
    with pytest.raises(errors.UnsupportedModel, match="experts"):
        plan_blocks({"num_hidden_layers": 2}, specs, lambda a, b: False, "m")


def test_architecture():
    assert architecture({"architectures": ["MistralForCausalLM"]}, "c") == "MistralForCausalLM"
    assert architecture({"model_type": "qwen2"}, "c") == "Qwen2ForCausalLM"
    with pytest.raises(errors.UnsupportedModel, match="'PhiForCausalLM'") as info:
        architecture({"architectures": ["PhiForCausalLM"]}, "c")
    assert info.value.code == 104 and info.value.architecture == "PhiForCausalLM"
    with pytest.raises(errors.UnsupportedModel, match="names no architecture"):
        architecture({}, "c")
