"""quant.int4pack: our symmetric int4 codes through torch's int4 kernels (tinygemm), and the layer's
choice of kernel by M. CPU: the CPU kernel, and the CUDA tile layout built on the CPU against an
independent transcription of int4mm.cu's packing loop; CUDA (marked gpu): torch's own packing op
and kernel."""
from __future__ import annotations

import logging

import pytest
import torch

from deepseek_flash.quant import QuantSpec, quantize, unpack_int4
from deepseek_flash.quant import int4pack
from deepseek_flash.quant.linear import SMALL_M, QuantLinear

CUDA = torch.cuda.is_available()
GROUPS = (32, 64, 128)
# Max |y - reference| / max |reference| of torch's int4 kernel against dequantize-then-matmul in
# the same dtype. float32: both sides compute code x scale exactly and differ in summation order
# only. float16 / bfloat16: the two sides round differently (the kernel's scale rounded to the
# activation dtype for bfloat16, its own accumulation and output rounding) -- a few units of the
# dtype's last place at the output's magnitude.
TOLERANCE = {torch.float32: 5e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def reference_layout(codes: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """int4mm.cu's ``matrix_to_m16n8k16_Bint4_layout``, one int32 at a time, over the uint8 input
    torchao and gpt-fast give ``_convert_weight_to_int4pack`` (even column in the high nibble)."""
    N, K = codes.shape[0], codes.shape[1] * 2
    q = unpack_int4(codes).to(torch.int64) + 8
    src = (q[:, 0::2] << 4 | q[:, 1::2]).tolist()
    k_outer = K // (inner_k_tiles * 16)
    out = torch.zeros(N // 8, k_outer, 32, inner_k_tiles // 2, dtype=torch.int64)
    for nt in range(N // 8):
        for ko in range(k_outer):
            for t in range(32):
                row = src[nt * 8 + t // 4]
                for inner in range(0, inner_k_tiles, 2):
                    kb = (ko * inner_k_tiles + inner) * 8
                    v = [row[k] for k in (kb + t % 4, kb + t % 4 + 4, kb + 8 + t % 4, kb + 12 + t % 4)]
                    word = ((v[3] & 0xF) << 28 | (v[2] & 0xF) << 24 | (v[1] & 0xF) << 20 |
                            (v[0] & 0xF) << 16 | (v[3] & 0xF0) << 8 | (v[2] & 0xF0) << 4 |
                            (v[1] & 0xF0) | (v[0] & 0xF0) >> 4)
                    out[nt, ko, t, inner // 2] = word - (1 << 32) if word >= 1 << 31 else word
    return out.to(torch.int32)


def weight(N, K, spec, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 0.1
    return quantize(w.to(dtype), spec)


def rel_err(y, ref):
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("inner", (2, 4, 8))
def test_cuda_layout_equals_the_packing_loop_of_int4mm(inner):
    qt = weight(16, 256, QuantSpec("int4_symmetric", "per_block", 32), seed=inner)
    got = int4pack.cuda_layout(qt.data, inner)
    assert got.dtype == torch.int32 and got.shape == (2, 256 // (inner * 16), 32, inner // 2)
    assert torch.equal(got, reference_layout(qt.data, inner))


def test_codes_map_exactly_on_the_kernel_nibble_with_zero_point_0():
    spec = QuantSpec("int4_symmetric", "per_block", 32)
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(16, 2)               # [16, 32]
    from deepseek_flash.quant import pack_int4

    stored = pack_int4(codes)
    assert torch.equal(int4pack.nibbles(stored), (codes + 8).to(torch.uint8))
    scales = torch.full((16, 1), -0.5, dtype=torch.float16)
    sz = int4pack.scales_and_zeros(scales, spec, (16, 32), 32, torch.float32)
    assert sz.shape == (1, 16, 2) and bool((sz[..., 0] == -0.5).all()) and bool((sz[..., 1] == 0).all())
    packed = int4pack.cpu_layout(stored, 2)
    eye = torch.eye(32)
    y = int4pack.matmul(eye, packed, sz, 32)                                  # = W.T exactly
    assert torch.equal(y.T, codes.float() * -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("M", (1, 3, 8, 64))
def test_cpu_kernel_matches_dequantize_then_matmul(M, group, dtype):
    N, K = 48, 384
    spec = QuantSpec("int4_symmetric", "per_block", group)
    qt = weight(N, K, spec, seed=group + M, dtype=dtype)
    inner, kgroup = int4pack.plan("cpu", dtype, spec, N, K)
    assert kgroup == group
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
    y = int4pack.matmul(x, int4pack.cpu_layout(qt.data, inner),
                        int4pack.scales_and_zeros(qt.scales, spec, (N, K), group, dtype), group)
    ref = x @ qt.dequantize(dtype).T
    assert y.dtype == dtype and y.shape == (M, N)
    assert rel_err(y, ref) <= TOLERANCE[dtype]


def test_per_tensor_repeats_the_one_scale():
    spec = QuantSpec("int4_symmetric", "per_tensor")
    qt = weight(32, 192, spec, seed=5, dtype=torch.float32)
    inner, group = int4pack.plan("cpu", torch.float32, spec, 32, 192)
    assert group == 64                     # the largest of 128/64/32 dividing K
    x = torch.randn(2, 192)
    y = int4pack.matmul(x, int4pack.cpu_layout(qt.data, inner),
                        int4pack.scales_and_zeros(qt.scales, spec, (32, 192), group, torch.float32), group)
    assert rel_err(y, x @ qt.dequantize().T) <= TOLERANCE[torch.float32]


def test_plan_names_what_the_kernel_refuses():
    g32 = QuantSpec("int4_symmetric", "per_block", 32)
    assert int4pack.plan("cpu", torch.float32, g32, 24, 64) == \
        "N = 24 output features, not a multiple of 16"
    assert int4pack.plan("cuda", torch.bfloat16, g32, 24, 64) == (4, 32)
    assert int4pack.plan("cuda", torch.float16, g32, 32, 64).startswith("torch.float16 activations")
    assert int4pack.plan("cpu", torch.float32, QuantSpec("int4_symmetric", "per_tensor"), 32, 48) == \
        "K = 48 input features, not a multiple of 32"
    assert int4pack.plan("cpu", torch.float32, QuantSpec("int8_symmetric"), 32, 64).startswith("int8")
    assert int4pack.plan("cuda", torch.bfloat16, g32, 4096, 14336) == (8, 32)


def layer(N, K, spec, dtype, fixed=True, seed=0):
    qt = weight(N, K, spec, seed=seed, dtype=dtype)
    return QuantLinear(K, N, qt, fixed=fixed), qt


@pytest.mark.parametrize("fixed", [True, False], ids=["resident", "slot"])
def test_layer_takes_the_int4_kernel_at_small_m_only_and_keeps_the_layout_when_fixed(fixed, monkeypatch):
    spec = QuantSpec("int4_symmetric", "per_block", 64)
    lin, qt = layer(32, 256, spec, torch.float32, fixed)
    calls = []
    real = int4pack.matmul
    monkeypatch.setattr(int4pack, "matmul", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x = torch.randn(2, 3, 256)
    y = lin(x)
    assert calls == [6]
    assert rel_err(y, x @ qt.dequantize().T) <= TOLERANCE[torch.float32]
    assert lin.derived_nbytes == (32 * 256 // 2 + 256 // 64 * 32 * 2 * 4 if fixed else 0)
    big = torch.randn(SMALL_M + 1, 256)
    assert torch.equal(lin(big), big @ qt.dequantize().T)      # the dequantize path, bit for bit
    assert calls == [6]
    # A slot's bytes change under the views: a fixed layer would keep its old layout (which is
    # why streamed layers are bound with fixed=False); a slot layer sees the new bytes.
    other = weight(32, 256, spec, seed=9, dtype=torch.float32)
    want = x @ (qt if fixed else other).dequantize().T
    lin.codes.copy_(other.data)           # the views' bytes (qt's too) change in place
    lin.scales.copy_(other.scales)
    assert rel_err(lin(x), want) <= TOLERANCE[torch.float32]


def test_refused_shape_takes_the_dequantize_path_logged_once(caplog):
    spec = QuantSpec("int4_symmetric", "per_block", 32)
    lin, qt = layer(24, 64, spec, torch.float32)            # N = 24: the CPU kernel wants 16 | N
    x = torch.randn(1, 64)
    with caplog.at_level(logging.INFO, logger="deepseek_flash.quant.linear"):
        for _ in range(3):
            assert torch.equal(lin(x), x @ qt.dequantize().T)
        layer(24, 64, spec, torch.float32, seed=1)[0](x)
    notes = [r.getMessage() for r in caplog.records if "not a multiple of 16" in r.getMessage()]
    assert len(notes) <= 1              # once per reason and process (an earlier test may have)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("inner", (2, 4, 8))
def test_cuda_layout_equals_torchs_own_packing(inner):
    qt = weight(4096 // 8, 1024, QuantSpec("int4_symmetric", "per_block", 128), seed=inner)
    codes = qt.data.cuda()
    q = unpack_int4(codes).to(torch.int32) + 8
    theirs = torch.ops.aten._convert_weight_to_int4pack((q[:, 0::2] << 4 | q[:, 1::2]).to(torch.uint8),
                                                        inner)
    assert torch.equal(int4pack.cuda_layout(codes, inner), theirs)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("M", (1, 3, 8, 64))
def test_cuda_kernel_matches_dequantize_then_matmul(M, group):
    N, K = 512, 1024
    spec = QuantSpec("int4_symmetric", "per_block", group)
    qt = weight(N, K, spec, seed=group + M)
    inner, kgroup = int4pack.plan("cuda", torch.bfloat16, spec, N, K)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    codes, scales = qt.data.cuda(), qt.scales.cuda()
    y = int4pack.matmul(x, int4pack.cuda_layout(codes, inner),
                        int4pack.scales_and_zeros(scales, spec, (N, K), kgroup, torch.bfloat16), kgroup)
    ref = x @ qt.dequantize(torch.bfloat16).cuda().T
    assert rel_err(y, ref) <= TOLERANCE[torch.bfloat16]
    lin = QuantLinear(K, N, type(qt)(spec, qt.shape, codes, scales, torch.bfloat16))
    assert torch.equal(lin(x), y) if M <= SMALL_M else rel_err(lin(x), ref) <= TOLERANCE[torch.bfloat16]
