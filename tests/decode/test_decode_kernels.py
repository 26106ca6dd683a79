"""decode.kernels: the fused ops' CPU path equals transformers' modules exactly (fp32), and the
Triton kernels (run by Triton's interpreter on the CPU) equal the CPU path."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from decode_models import tiny_model
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from deepseek_flash.decode import kernels

ROOT = Path(__file__).parents[2]


def test_add_rms_norm_is_the_residual_add_then_transformers_norm():
    model = tiny_model("llama")
    norm = model.model.layers[0].post_attention_layernorm
    torch.manual_seed(0)
    norm.weight.data.normal_()
    x, residual = torch.randn(3, 1, 64), torch.randn(3, 1, 64)
    want_residual = residual + x
    want = norm(want_residual)
    got = kernels.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
    assert torch.equal(residual, want_residual)           # updated in place
    assert torch.equal(got, want)
    alone = kernels.add_rms_norm(None, residual, norm.weight, norm.variance_epsilon)
    assert torch.equal(alone, want) and torch.equal(residual, want_residual)


def test_rope_cache_rotates_like_transformers_and_writes_the_slot():
    torch.manual_seed(1)
    b, heads, kv_heads, d, cap = 2, 4, 2, 16, 8
    qkv = torch.randn(b, 1, (heads + 2 * kv_heads) * d)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    angle = torch.randn(b, 1, d)
    cos, sin = angle.cos(), angle.sin()
    keys, values = torch.zeros(b, kv_heads, cap, d), torch.zeros(b, kv_heads, cap, d)
    got = kernels.rope_cache(q, k, v, cos, sin, torch.tensor([5]), keys, values)
    qh = q.reshape(b, 1, heads, d).transpose(1, 2)
    kh = k.reshape(b, 1, kv_heads, d).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(qh, kh, cos, sin)
    assert got.shape == (b, kv_heads, heads // kv_heads, d)
    assert torch.equal(got, want_q.reshape(b, kv_heads, heads // kv_heads, d))
    assert torch.equal(keys[:, :, 5], want_k[:, :, 0])
    assert torch.equal(values[:, :, 5], v.reshape(b, kv_heads, d))
    others = [s for s in range(cap) if s != 5]
    assert not keys[:, :, others].any() and not values[:, :, others].any()


def test_silu_mul_is_the_mlp_activation():
    model = tiny_model("qwen2")
    mlp = model.model.layers[0].mlp
    gate, up = torch.randn(2, 1, 128), torch.randn(2, 1, 128)
    assert torch.equal(kernels.silu_mul(gate, up), mlp.act_fn(gate) * up)


def test_triton_kernels_equal_the_cpu_path_in_the_interpreter():
    pytest.importorskip("triton")
    script = ("import torch\nfrom deepseek_flash.decode import kernels as k\n"
              "for dt in (torch.float32, torch.bfloat16):\n"
              "    print(dt, k._self_check(torch.device('cpu'), dt))\n")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["torch.float32 None", "torch.bfloat16 None"]


def test_a_disagreeing_kernel_turns_triton_off_with_the_reason(monkeypatch):
    monkeypatch.setattr(kernels, "BACKEND", kernels._Backend())
    monkeypatch.setattr(kernels, "_self_check", lambda device, dtype: "rope_cache disagrees")
    assert kernels.check_triton("cpu", torch.float32) == (
        "triton is not installed" if kernels.triton is None else "rope_cache disagrees")
    assert kernels.BACKEND.triton is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernels_compile_and_agree_on_cuda_at_the_8b_shape():
    backend = kernels._Backend()
    saved, kernels.BACKEND = kernels.BACKEND, backend
    try:
        dims = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336)
        for dtype in (torch.bfloat16, torch.float32):
            assert kernels.check_triton("cuda:0", dtype, dims) is None
        assert backend.triton is True
    finally:
        kernels.BACKEND = saved


def test_triton_kernels_compile_for_the_h200():
    """Triton's compiler with its bundled ptxas, sm_90 (the H200), at the 8B shape and a tiny fp32
    one: catches what the interpreter does not (e.g. branches whose values differ in type)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_(fn, dtype, names, constexprs):
        sig = {n: t.replace("T", dtype) for n, t in names.items()}
        sig.update({n: "constexpr" for n in constexprs})
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert ".entry" in kernel.asm["ptx"]

    ptrs = lambda *n: {k: "*T" for k in n}           # noqa: E731
    ints = lambda *n: {k: "i32" for k in n}          # noqa: E731
    for dtype, (heads, kv, half, n, inter) in (("bf16", (32, 8, 64, 4096, 14336)),
                                               ("fp32", (4, 2, 8, 64, 128))):
        for has_x in (True, False):
            compile_(kernels._add_rms_norm_kernel, dtype,
                     {**ptrs("x_ptr", "res_ptr", "w_ptr", "out_ptr"),
                      **ints("x_stride", "res_stride", "out_stride", "n"), "eps": "fp32"},
                     {"HAS_X": has_x, "BLOCK": triton.next_power_of_2(n)})
        compile_(kernels._rope_cache_kernel, dtype,
                 {**ptrs("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr"), "slot_ptr": "*i64",
                  **ptrs("kc_ptr", "vc_ptr", "qo_ptr"),
                  **ints("q_stride", "k_stride", "v_stride", "cs_stride", "c_row", "c_head", "c_pos")},
                 {"HEADS": heads, "KV_HEADS": kv, "HALF": half, "BLOCK": half})
        compile_(kernels._silu_mul_kernel, dtype,
                 {**ptrs("g_ptr", "u_ptr", "out_ptr"), **ints("g_stride", "u_stride", "n")}, {"BLOCK": 1024})
        group, d = heads // kv, 2 * half
        for has_mask, rope in ((True, False), (False, False), (True, True)):
            compile_(kernels._attention_split_kernel, dtype,
                     {**ptrs("q_ptr", "k_ptr", "v_ptr", "m_ptr"), "o_ptr": "*fp32", "ml_ptr": "*fp32",
                      **ptrs("qr_ptr", "kr_ptr", "vr_ptr", "cos_ptr", "sin_ptr"), "slot_ptr": "*i64",
                      **ints("L", "G", "KVH", "SPLITS", "q_sb", "q_sh", "q_sg", "k_sb", "k_sh", "k_sl",
                             "v_sb", "v_sh", "v_sl", "m_sb", "m_sl", "qr_stride", "kr_stride", "vr_stride",
                             "cs_stride"), "scale": "fp32"},
                     {"HAS_MASK": has_mask, "ROPE": rope, "CHUNK": kernels.ATTENTION_CHUNK, "BLOCK_L": 64,
                      "G_PAD": max(16, triton.next_power_of_2(group)), "D": d})
        compile_(kernels._argmax_part_kernel, "fp32", {"x_ptr": "*fp32", "val_ptr": "*fp32", "idx_ptr": "*i32",
                                                       **ints("n", "x_stride", "PARTS")},
                 {"BLOCK": kernels.ARGMAX_BLOCK})
        compile_(kernels._argmax_final_kernel, "fp32", {"val_ptr": "*fp32", "idx_ptr": "*i32", "out_ptr": "*i64",
                                                        "PARTS": "i32"}, {"BLOCK": 64})
        compile_(kernels._attention_combine_kernel, dtype,
                 {"o_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*T",
                  **ints("G", "KVH", "SPLITS", "out_sb", "out_sh", "out_sg")},
                 {"G_PAD": max(16, triton.next_power_of_2(group)), "D": d})


def test_decode_attention_is_sdpa_on_the_cpu_and_the_kernel_takes_only_its_case():
    torch.manual_seed(2)
    q, keys, values = torch.randn(2, 2, 4, 32), torch.randn(2, 2, 9, 32), torch.randn(2, 2, 9, 32)
    mask = torch.zeros(2, 1, 1, 9).masked_fill(torch.rand(2, 1, 1, 9) > 0.7, float("-inf"))
    mask[..., -1] = 0
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.2)
    assert torch.equal(kernels.decode_attention(q, keys, values, mask, 0.2), want)
    assert kernels._attention_fits(q, keys, values, mask) and kernels._attention_fits(q, keys, values, None)
    assert not kernels._attention_fits(q, keys, values, mask == 0)                 # a boolean mask
    assert not kernels._attention_fits(q, keys, values, torch.zeros(2, 1, 4, 9))   # several queries
    odd = torch.randn(2, 2, 4, 48)
    assert not kernels._attention_fits(odd, odd, odd, None)                       # head size 48


def test_greedy_is_argmax_with_ties_to_the_first_and_nan_first():
    logits = torch.randn(3, 300)
    logits[0, 7] = logits[0, 250] = 9.0
    logits[1, 40] = float("nan")
    assert kernels.greedy(logits).tolist() == [7, 40, int(logits[2].argmax())]
