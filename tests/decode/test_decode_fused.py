"""decode.fused: the step's own forward -- operations per step, merged projections (view, rebound,
copy, unmerged), and where it steps aside (forward hooks) -- with transformers' tokens throughout."""
import pytest
import torch
from decode_models import left_padded, tiny_model

from deepseek_flash.decode import enable
from deepseek_flash.decode.fused import FusedForward, OpCounter


def greedy(model, ids, mask, n):
    return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=n)


def step_ops(model):
    """Operations of one decode step: generate(3) minus generate(2)."""
    ids = torch.randint(1, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    greedy(model, ids, None, 3)
    counts = {}
    for n in (2, 3):
        with OpCounter() as counter:
            greedy(model, ids, None, n)
        counts[n] = counter.counts
    return counts[3] - counts[2]


def test_fused_step_runs_a_handful_of_operations_per_layer():
    layers = 3
    fused = step_ops(_enabled(tiny_model("llama", num_layers=layers), fused=True))
    modules = step_ops(_enabled(tiny_model("llama", num_layers=layers), fused=False))
    assert fused["deepseek_flash::add_rms_norm"] == 2 * layers + 1
    assert fused["deepseek_flash::silu_mul"] == layers
    assert fused["aten::linear"] == 4 * layers + 1           # q|k|v, o, gate|up, down; head
    from deepseek_flash.decode import fused as fusion
    attention = {"sdpa": "aten::scaled_dot_product_attention", "triton": "deepseek_flash::decode_attention",
                 "rope_triton": "deepseek_flash::rope_attention",
                 "flash": "deepseek_flash::flash_decode_attention"}[fusion.attention()]
    assert fused[attention] == layers
    per_layer = 8 if fusion.attention() == "rope_triton" else 9
    assert fused["deepseek_flash::rope_cache"] == (0 if fusion.attention() == "rope_triton" else layers)
    assert "aten::index_copy_" not in fused or fused["aten::index_copy_"] == 2   # the step's output
    assert modules["aten::linear"] == 7 * layers + 1
    # Beside the layers, the step's own work: masks (none where the attention reads no mask),
    # positions, rotary tables, token choice.
    around = 33 if fusion.uses_mask() else 27
    assert sum(fused.values()) == per_layer * layers + around, sorted(fused.items())
    assert sum(modules.values()) == 34 * layers + 33, sorted(modules.items())


@pytest.mark.parametrize("attention,ops_per_layer,step_ops_", [("triton", 9, 33), ("rope_triton", 8, 33),
                                                               ("flash", 9, 27)])
def test_our_attention_ops_give_the_same_tokens(monkeypatch, attention, ops_per_layer, step_ops_):
    """fused.ATTENTION "triton" (kernels.decode_attention), "rope_triton" (rope_cache +
    decode_attention as one operation, kernels.rope_attention) and "flash" (flash.decode_attention:
    no mask tensor, so the step builds none): the same tokens as sdpa (the CPU runs the same
    arithmetic), with a sliding window and left padding."""
    from deepseek_flash.decode import fused

    layers = 3
    ids, mask = left_padded(2, 6, seed=3)
    want = greedy(_enabled(tiny_model("mistral", num_layers=layers, sliding_window=5)), ids, mask, 12)
    monkeypatch.setattr(fused, "ATTENTION", attention)
    model = _enabled(tiny_model("mistral", num_layers=layers, sliding_window=5))
    assert torch.equal(greedy(model, ids, mask, 12), want)
    ops = step_ops(_enabled(tiny_model("llama", num_layers=layers)))
    op = {"rope_triton": "deepseek_flash::rope_attention", "triton": "deepseek_flash::decode_attention",
          "flash": "deepseek_flash::flash_decode_attention"}[attention]
    assert ops[op] == layers and "aten::scaled_dot_product_attention" not in ops
    assert sum(ops.values()) == ops_per_layer * layers + step_ops_, sorted(ops.items())


def _enabled(model, **options):
    model.generation_config.eos_token_id = None
    enable(model, capacity=32, **options)
    return model


def test_owned_weights_are_rebound_to_the_merged_matrix_with_the_same_logits():
    model = tiny_model("qwen2", num_layers=2)
    ids = torch.randint(1, 200, (2, 5))
    before = model(ids).logits
    fused = FusedForward.build(model)
    assert fused.stats.as_dict() == {"views": 0, "rebound": 4, "copies": 0, "copy_bytes": 0, "unmerged": 0,
                                      "quantized": 0, "quant_copy_bytes": 0}
    attn = model.model.layers[1].self_attn
    merged = fused.layers[1].qkv.weight
    assert attn.q_proj.weight.data_ptr() == merged.data_ptr()
    assert attn.k_proj.weight.data_ptr() == merged.data_ptr() + attn.q_proj.weight.nbytes
    assert torch.equal(fused.layers[1].qkv.bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias,
                                                            attn.v_proj.bias]))
    assert torch.equal(model(ids).logits, before)


def test_side_by_side_weights_are_viewed_and_scattered_ones_copied():
    model = tiny_model("llama", num_layers=2)
    # Layer 0: q, k, v back to back in one buffer (as a store block lays them); layer 1: the same
    # buffer kind but in the order v, k, q -- views of shared memory that cannot be one matrix.
    for i, order in ((0, ("q_proj", "k_proj", "v_proj")), (1, ("v_proj", "k_proj", "q_proj"))):
        attn = model.model.layers[i].self_attn
        parts = [getattr(attn, name).weight.detach() for name in order]
        arena = torch.cat(parts)
        row = 0
        for name, part in zip(order, parts):
            getattr(attn, name).weight.data = arena[row:row + part.shape[0]]
            row += part.shape[0]
    ids, mask = left_padded(2, 6)
    want = greedy(model, ids, mask, 16)
    decoder = enable(model, capacity=32)
    assert torch.equal(greedy(model, ids, mask, 16), want)
    merged = decoder.stats()["merged"]
    q0 = model.model.layers[0].self_attn.q_proj.weight
    assert decoder.fused.layers[0].qkv.weight.data_ptr() == q0.data_ptr()
    assert merged["views"] == 1 and merged["copies"] == 1 and merged["rebound"] == 2
    assert merged["copy_bytes"] == (64 * 64 + 2 * 32 * 64) * 4


def test_a_quantized_style_projection_runs_unmerged():
    class Scaled(torch.nn.Linear):          # not a plain Linear: its own forward must run
        def forward(self, x):
            return super().forward(x) * 1.0

    model = tiny_model("llama", num_layers=2)
    mlp = model.model.layers[1].mlp
    swapped = Scaled(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)
    swapped.weight = mlp.up_proj.weight
    mlp.up_proj = swapped
    ids, mask = left_padded(3, 7)
    want = greedy(model, ids, mask, 24)
    decoder = enable(model, capacity=48)
    assert torch.equal(greedy(model, ids, mask, 24), want)
    assert decoder.stats()["step"] == "fused" and decoder.stats()["merged"]["unmerged"] == 1


def test_forward_hooks_keep_transformers_modules_and_say_why():
    model = tiny_model("mistral", num_layers=2, sliding_window=8)
    seen = []
    model.model.layers[1].mlp.register_forward_hook(lambda m, a, o: seen.append(1))
    ids, mask = left_padded(2, 5)
    want = greedy(model, ids, mask, 20)
    calls = len(seen)
    decoder = enable(model, capacity=32)
    assert torch.equal(greedy(model, ids, mask, 20), want)
    assert len(seen) == 2 * calls                       # the hook ran at every step
    stats = decoder.stats()
    assert stats["step"] == "modules" and "layers.1.mlp has forward hooks" in stats["fused_reason"]


def test_a_fused_step_that_raises_falls_back_to_the_modules_with_the_reason(monkeypatch):
    from deepseek_flash.decode import kernels

    model = tiny_model("llama", num_layers=2)
    ids, mask = left_padded(2, 6)
    want = greedy(model, ids, mask, 12)
    decoder = enable(model, capacity=32)

    def broken(*args):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(kernels, "silu_mul", broken)
    assert torch.equal(greedy(model, ids, mask, 12), want)
    stats = decoder.stats()
    assert stats["step"] == "modules" and "no kernel image" in stats["fused_reason"]
    assert stats["eager_steps"] == 11


def test_auto_attention_is_flash_for_a_resident_model_and_sdpa_for_a_streamed_one(monkeypatch):
    from deepseek_flash.decode import fused

    assert fused.ATTENTION == "auto"
    assert (fused.attention(), fused.attention(streamed=True)) == ("flash", "sdpa")
    assert (fused.uses_mask(), fused.uses_mask(streamed=True)) == (False, True)
    monkeypatch.setattr(fused, "ATTENTION", "sdpa")
    assert (fused.attention(), fused.uses_mask()) == ("sdpa", True)
