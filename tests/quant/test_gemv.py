"""quant.gemv: the decode-sized int4/int8 kernels. CPU: which layers take them (``choose``) and that
``QuantLinear`` routes decode rows to them with the operands they read; CUDA (marked gpu): every
output against dequantize + matmul, the split-K fix-up, and the layer inside a CUDA graph."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepseek_flash.quant import QuantSpec, quantize
from deepseek_flash.quant import gemv, int4pack
from deepseek_flash.quant.codec import QuantizedTensor, dequantize
from deepseek_flash.quant.linear import QuantLinear

CUDA = torch.cuda.is_available()
BF16 = torch.bfloat16
ROOT = Path(__file__).parents[2]

# Triton's interpreter (CPU, numpy) runs the kernels against the reference: every layout, split-K
# fix-up and scale group at small shapes. Its bfloat16 dot is wrong, so "dot" is left to CUDA.
_INTERPRETED = r"""
import torch
from deepseek_flash.quant import gemv, int4pack, QuantSpec
from deepseek_flash.quant.codec import dequantize
torch.manual_seed(0)
def ulps(y, x, W):
    ref = x.double() @ W.double().t()
    ulp = 2.0 ** (torch.floor(torch.log2(ref.to(torch.bfloat16).double().abs().clamp_min(1e-30))) - 7)
    return round(((y.double() - ref).abs() / ulp).max().item(), 3)
out = []
for M, N, K, g, cfg in [(1, 72, 1024, 64, dict(kernel="rows", BLOCK_N=16, BLOCK_C=2, SPLIT=4,
                                                ROWS=48)),
                        (1, 40, 768, 32, dict(kernel="rows", BLOCK_N=8, BLOCK_C=2, SPLIT=3,
                                              ROWS=2048)),
                        (1, 40, 512, 128, dict(kernel="rows", BLOCK_N=8, BLOCK_C=4, SPLIT=1,
                                               ROWS=16)),
                        (1, 64, 2048, 128, gemv.rows_config(64, 2048))]:
    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8)
    spec = QuantSpec("int4_symmetric", "per_block", g)
    sz = int4pack.scales_and_zeros((torch.rand(N, K // g) * 0.02 + 1e-3).half(), spec, (N, K), g,
                                   torch.bfloat16)
    W = dequantize(codes, sz[..., 0].t().float(), spec, (N, K), torch.float32)
    x = torch.randn(M, K).to(torch.bfloat16)
    y = gemv.int4_tiles_matmul(x, int4pack.cuda_layout(codes, 8), sz, g, N, K, cfg)
    out.append(ulps(y, x, W))
for M, N, K, g, cfg in [(1, 40, 1024, 0, dict(BLOCK_N=32, BLOCK_W=64, SPLIT=2)),
                        (1, 24, 512, 32, None),
                        (1, 24, 1024, 128, dict(BLOCK_N=8, BLOCK_W=32, SPLIT=2))]:
    codes = torch.randint(-128, 128, (N, K), dtype=torch.int8)
    spec = QuantSpec("int8_symmetric", "per_block" if g else "per_tensor", g or 128)
    scales = ((torch.rand(N, K // g) if g else torch.rand(1)) * 0.02 + 1e-3).half()
    W = dequantize(codes, scales, spec, (N, K), torch.float32)
    x = torch.randn(M, K).to(torch.bfloat16)
    out.append(ulps(gemv.int8_rows_matmul(x, codes, scales, g, N, K, cfg), x, W))
print(out)
"""


def test_choose_takes_decode_rows_on_cuda_only(monkeypatch):
    monkeypatch.setattr(gemv, "INT4_MAX_M", 8)
    monkeypatch.setattr(gemv, "INT8_MAX_M", 1)
    assert gemv.choose("cuda", BF16, 4, 1, 4096, 4096, 128, 8) is None
    assert gemv.choose("cuda", BF16, 4, 8, 1024, 14336, 32, 8) is None
    assert gemv.choose("cuda", BF16, 8, 1, 4096, 4096, 0) is None           # int8 per tensor
    assert gemv.choose("cuda", torch.float16, 8, 1, 4096, 4096, 64) is None
    assert gemv.choose("cpu", BF16, 4, 1, 4096, 4096, 128, 8) == "device type cpu"
    assert gemv.choose("cuda", BF16, 4, 9, 4096, 4096, 128, 8) == "M = 9 rows > 8"
    assert gemv.choose("cuda", BF16, 8, 2, 4096, 4096, 128) == "M = 2 rows > 1"
    assert gemv.choose("cuda", torch.float16, 4, 1, 4096, 4096, 128, 8) == \
        "torch.float16 activations"
    assert gemv.choose("cuda", torch.float32, 8, 1, 4096, 4096, 128) == "torch.float32 activations"
    assert gemv.choose("cuda", BF16, 4, 1, 4096, 4096, 128, 4) == \
        "int4 tile layout with inner_k_tiles 4 (the kernel reads 8)"
    assert gemv.choose("cuda", BF16, 4, 1, 4096, 4160, 64, 8) == \
        "K = 4160 input features, not a multiple of 128"
    assert gemv.choose("cuda", BF16, 8, 1, 4096, 4160, 64) == \
        "K = 4160 input features, not a multiple of 128"
    monkeypatch.setattr(gemv, "INT4_MAX_M", 0)
    assert gemv.choose("cuda", BF16, 4, 1, 4096, 4096, 128, 8) == \
        "off (slower than the default kernels)"


def test_configs_are_a_function_of_the_shape_and_cover_k():
    for N, K in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (256, 128),
                 (264, 1152)):
        rows = gemv.rows_config(N, K)
        assert rows["BLOCK_C"] * rows["SPLIT"] == K // 128            # the slices cover K
        assert rows["BLOCK_C"] & (rows["BLOCK_C"] - 1) == 0 and rows["ROWS"] % rows["BLOCK_N"] == 0
        for M in range(1, 9):                                         # the tensor-core kernel
            mma = gemv.int4_config(M, N, K)
            assert mma == gemv.mma_config(N, K) and mma["kernel"] == "mma"
            assert mma["BC"] * mma["SPLIT"] == K // 128
            assert mma["ROWS"] % (mma["WARPS"] * mma["NT"] * 8) == 0
            assert _cdiv(N, mma["ROWS"]) * mma["ROWS"] >= N > (_cdiv(N, mma["ROWS"]) - 1) * mma["ROWS"]
        for M in range(9, 17):
            dot = gemv.int4_config(M, N, K)
            assert dot["kernel"] == "dot" and (K // 128) % dot["SPLIT"] == 0
        c8 = gemv.int8_config(1, N, K)
        assert (K // 4) % (c8["SPLIT"] * c8["BLOCK_W"]) == 0
    # the 8B shapes: programs of 4 warps where there is work enough, at least 264 warp steps
    assert gemv.mma_config(4096, 4096) == dict(kernel="mma", NT=4, BC=2, WARPS=4, SPLIT=16,
                                               ROWS=128, PF=0, S=1)
    assert gemv.mma_config(1024, 4096) == dict(kernel="mma", NT=4, BC=2, WARPS=1, SPLIT=16,
                                               ROWS=32, PF=0, S=1)
    assert gemv.mma_config(4096, 14336)["SPLIT"] == 56


def _cdiv(a, b):
    return -(-a // b)


def test_kernels_match_the_reference_in_the_interpreter():
    """Every output within one unit in the last bfloat16 place of float64 dequantize + matmul (the
    interpreter's float32 -> bfloat16 conversion truncates; on CUDA it rounds to nearest and the
    gpu tests below hold it to half a unit): int4 gemv/fma with split-K, groups 32/64/128; int8
    per block and per tensor."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    worst = eval(proc.stdout.strip().splitlines()[-1])
    assert len(worst) == 7 and max(worst) <= 1.01, worst


def _compile_sm90(fn, sig, consts, num_warps):
    """Triton's compiler with its bundled ptxas, sm_90 (no device)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(sig, **{k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7, 8)}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


_COMMON = {"x_ptr": "*bf16", "w_ptr": "*i32", "y_ptr": "*bf16", "ws_ptr": "*fp32",
           "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32"}


def test_kernels_compile_for_the_h200_at_the_8b_shapes():
    """The default configurations of the 8B layer shapes compile for sm_90; the int4 batch-1
    kernel loads its weights 16 bytes at a time."""
    pytest.importorskip("triton")
    seen = set()
    for M, N, K in ((1, 4096, 4096), (1, 14336, 4096), (1, 4096, 14336), (8, 1024, 4096)):
        for bits in ((4, 8) if M == 1 else (4,)):
            if bits == 4:
                cfg = gemv.rows_config(N, K) if M == 1 else gemv.int4_config(16, N, K)
            else:
                cfg = gemv.int8_config(M, N, K)
            fn = {(4, "rows"): gemv._int4_tiles_gemv_rows, (4, "dot"): gemv._int4_tiles_dot,
                  (8, None): gemv._int8_rows_gemv}[(bits, cfg.get("kernel"))]
            block = ("BLOCK_C", cfg["BLOCK_C"]) if bits == 4 else ("BLOCK_W", cfg["BLOCK_W"])
            key = (fn, M, cfg["BLOCK_N"], block, cfg["SPLIT"] > 1)
            if key in seen:
                continue
            seen.add(key)
            sig = dict(_COMMON, s_ptr="*bf16" if bits == 4 else "*fp16",
                       **{("chunks_per_split" if bits == 4 else "words_per_split"): "i32"})
            sig["magic"] = "i32"
            consts = {"GROUP": 128, "BLOCK_M": 16 if M > 1 else 1,
                      "BLOCK_N": cfg["BLOCK_N"], block[0]: block[1], "SPLIT": cfg["SPLIT"]}
            if fn is not gemv._int4_tiles_dot:
                consts["STAGES"] = cfg["stages"]
            if fn is gemv._int4_tiles_gemv_rows:
                sig["rows_per_group"] = "i32"
            kernel = _compile_sm90(fn, sig, consts, cfg["num_warps"])
            assert ".entry" in kernel.asm["ptx"]
            if fn is gemv._int4_tiles_gemv_rows:
                assert "ld.global.v4" in kernel.asm["ptx"]           # 16-byte weight loads
    assert len(seen) >= 3


def _mma_kernel(cfg, group=128):
    """The tensor-core kernel compiled for sm_90 with ``cfg``."""
    sp2 = 1 << (cfg["SPLIT"] - 1).bit_length()
    consts = {"ASM": gemv._mma_asm(cfg["NT"], cfg["BC"], group, cfg["PF"], cfg["S"]),
              "S": cfg["S"], "NT": cfg["NT"],
              "BC": cfg["BC"], "GROUP": group, "WARPS": cfg["WARPS"], "SP2": sp2,
              "RB": max(16, min(256, 4096 // sp2))}
    sig = dict(_COMMON, s_ptr="*bf16", rows_per_group="i32", split="i32")
    return _compile_sm90(gemv._int4_tiles_mma, sig, consts, cfg["WARPS"])


def test_tensor_core_kernel_compiles_for_the_h200():
    """ptxas takes the asm of the 8B shapes' configurations: per warp step one 16-byte load per
    (n-tile, chunk), two mma per weight word plus the groups' bias, one predicated store per
    n-tile, the asm once per loop iteration in every thread (never under a branch of its own)."""
    pytest.importorskip("triton")
    for N, K, pf, steps in ((4096, 4096, 0, 1), (1024, 4096, 1, 1), (4096, 4096, 0, 2)):
        cfg = gemv.mma_config(N, K, pf=pf, steps=steps)
        ptx = _mma_kernel(cfg).asm["ptx"]
        assert ptx.count("cp.async.bulk.prefetch.L2.global") == pf * cfg["NT"]
        nt, bc = cfg["NT"], cfg["BC"]
        assert ptx.count("ld.global.nc.L1::no_allocate.v4.u32") == nt * bc * steps
        assert ptx.count("mma.sync.aligned.m16n8k16") == (nt * bc * steps + bc) * 8
        assert ptx.count("st.global.v2.f32") == nt * steps
        assert ptx.count("mov.u32 lane, %laneid;") == 1
        assert ".local" not in ptx


class SimulatedMMA:
    """Stands in for ``gemv._int4_tiles_mma`` on the CPU, launched as Triton launches it
    (``kernel[grid](*args, **constexprs)``): the programs' steps walked as the Triton code walks
    them (the same bases and operands), each warp's asm block executed by ``ptx_warp``, then each
    row group's split-K partials added in order into ``y`` and its counter checked and reset.
    ``partials``: the float32 ``[split, M, N]`` workspace of the last launch (NaN where nothing was
    written)."""

    def __init__(self):
        self.launches = 0
        self.partials = None

    def __getitem__(self, grid):
        return lambda *a, **k: self._run(grid, *a, **k)

    def _run(self, grid, x, words, sz, y, ws, cnt, M, N, K, stride_xm, rows, split, *, ASM, NT, BC,
             GROUP, WARPS, SP2, RB, S, num_warps):
        import numpy as np
        import ptx_warp          # tests/quant, beside this file

        assert grid == (_cdiv(N, rows), split) and num_warps == WARPS
        assert SP2 >= split and SP2 & (SP2 - 1) == 0 and RB * SP2 <= 4096
        assert x.dtype == y.dtype == BF16 and y.shape == (M, N) and ws.numel() >= split * M * N
        assert cnt.numel() >= grid[0] and int(cnt.abs().sum()) == 0
        mem = ptx_warp.Memory(x.numel() * 2 + words.numel() * 4 + sz.numel() * 2
                              + split * M * N * 4 + 8192)
        assert x.stride(-1) == 1 and (x.shape[0] == 1 or x.stride(0) == K)
        xa = mem.put(x.contiguous().view(torch.int16).numpy(), x.data_ptr())
        wa = mem.put(words.contiguous().numpy(), words.data_ptr())
        sa = mem.put(sz.contiguous().view(torch.int16).numpy(), sz.data_ptr())
        oa = mem.put(np.full(split * M * N, np.nan, dtype=np.float32))
        KO = K // 128
        for pid_n in range(grid[0]):
            for pid_k in range(split):
                c0, r0 = pid_k * BC, pid_n * rows
                r1 = min(r0 + rows, N)
                for n0 in range(r0, r1, WARPS * NT * 8 * S):
                    args = [wa + ((n0 // 8) * (KO * 128) + c0 * 128) * 4,
                            sa + (c0 * (128 // GROUP) * N + n0) * 2 * 2,
                            xa + c0 * 128 * 2, oa + (pid_k * M * N + n0) * 4,
                            (r1 - n0) // 8, KO * 512, N * 4, M, stride_xm * 2, WARPS * NT]
                    for w in range(WARPS):
                        ptx_warp.run(ASM, args, mem, w)
        part = torch.from_numpy(mem.get(oa, split * M * N * 4).view(np.float32)
                                .reshape(split, M, N).copy())
        ws.view(-1)[:split * M * N].copy_(part.view(-1))
        tot = part[0].clone()
        for k in range(1, split):
            tot += part[k]
        y.copy_(tot.to(y.dtype))
        self.partials = part
        self.launches += 1


@pytest.fixture
def simulated(monkeypatch):
    sim = SimulatedMMA()
    monkeypatch.setattr(gemv, "_int4_tiles_mma", sim)
    return sim


@pytest.mark.parametrize("M,N,K,group,cfg", [
    (1, 64, 512, 128, None),
    (3, 40, 768, 32, dict(kernel="mma", NT=2, BC=2, WARPS=2, SPLIT=3, ROWS=32, PF=1)),
    (8, 24, 256, 64, dict(kernel="mma", NT=4, BC=1, WARPS=1, SPLIT=2, ROWS=32)),
    (2, 72, 512, 64, dict(kernel="mma", NT=2, BC=2, WARPS=2, SPLIT=2, ROWS=64, S=2)),
    (1, 56, 256, 128, dict(kernel="mma", NT=1, BC=1, WARPS=2, SPLIT=2, ROWS=48, S=3)),
    (5, 48, 1024, 128, dict(kernel="mma", NT=1, BC=4, WARPS=2, SPLIT=2, ROWS=32, PF=1))])
def test_tensor_core_asm_executed_on_the_cpu_matches_the_reference(simulated, M, N, K, group, cfg):
    """``gemv.int4_tiles_matmul`` with the tensor-core kernel's launch simulated (``SimulatedMMA``:
    its asm text executed lane by lane over the programs' steps): every partial sum written once,
    the output within the dequantize + matmul allowance, as is ``gemv.mma_reference`` (the same
    arithmetic in torch). Shapes cover row groups that end inside a step (n-tiles past N re-read the
    last and are not stored), 1..8 rows of x, groups 32/64/128, 1..4 chunks a step and 1..3 steps a
    call (the next step's weights loaded before the step is computed)."""
    torch.manual_seed(M * N)
    cfg = cfg or gemv.mma_config(N, K)
    words, sz, W = _int4_case(N, K, group, "cpu")
    x = torch.randn(M, K).to(BF16)
    y = gemv.int4_tiles_matmul(x, words, sz, group, N, K, cfg)
    assert simulated.launches == 1 and y.dtype == BF16 and y.shape == (M, N)
    part = simulated.partials
    assert part.shape == (cfg["SPLIT"], M, N) and not torch.isnan(part).any()
    assert _check(y, x, W) <= 1
    ref = gemv.mma_reference(x, words, sz, group, N, K, cfg["SPLIT"])
    assert _check(ref, x, W) <= 1
    # the same products: the slices' sums agree to float32 summation order
    assert torch.allclose(part.sum(0), ref.float(), rtol=2e-2, atol=1e-3)


def test_tensor_core_path_on_the_cpu_as_a_layer_and_with_odd_operands(simulated, monkeypatch):
    """The host side of the tensor-core path end to end with its launch simulated: a tile-layout
    ``QuantLinear`` with the kernel on takes it for 1 and 8 rows (the default shape of its size),
    x at an odd element offset is copied first, tiles off 16-byte alignment go to torch's int4
    kernel (``gemv._tinygemm``, on an aligned copy) instead."""
    monkeypatch.setattr(gemv, "choose", lambda *a, **k: None)
    spec = QuantSpec("int4_symmetric", "per_block", 128)
    lin = _layer(64, 512, spec, True)
    W = lin.dequantized_weight(torch.float32)
    for M in (1, 8):
        x = torch.randn(M, 512).to(BF16)
        y = lin(x)
        assert y.shape == (M, 64) and _check(y, x, W) <= 1
    assert simulated.launches == 2
    big = torch.randn(2, 513).to(BF16)
    xo = big[:1, 1:]
    assert xo.data_ptr() % 4 == 2
    assert _check(gemv.int4_tiles_matmul(xo, lin.codes, lin.scales, 128, 64, 512), xo, W) <= 1
    assert simulated.launches == 3
    calls = []
    monkeypatch.setattr(gemv, "_tinygemm", lambda *a: calls.append(a) or "tinygemm")
    buf = torch.empty(lin.codes.numel() + 1, dtype=lin.codes.dtype)
    wo = buf[1:].view(lin.codes.shape)
    wo.copy_(lin.codes)
    assert gemv.int4_tiles_matmul(xo, wo, lin.scales, 128, 64, 512) == "tinygemm"
    # torch's kernel has the same alignment need: it gets an aligned copy of the same words
    assert len(calls) == 1 and simulated.launches == 3
    assert calls[0][1].data_ptr() % 16 == 0 and torch.equal(calls[0][1], wo)


def _layer(N, K, spec, tiles: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * 0.05).to(BF16)
    qt = quantize(w, spec)
    if tiles:
        group = spec.group_size
        qt = QuantizedTensor(spec, (N, K), int4pack.cuda_layout(qt.data, 8),
                             int4pack.scales_and_zeros(qt.scales, spec, (N, K), group, BF16),
                             BF16, "int4_cuda_tiles", (8, group))
    return QuantLinear(K, N, qt)


@pytest.mark.parametrize("bits,tiles", [(4, True), (4, False), (8, False)])
def test_layer_routes_decode_rows_to_the_kernel(monkeypatch, bits, tiles):
    """With ``choose`` saying yes (as it does on CUDA), decode rows reach the kernel with the
    operands it reads: the tile layout and its scales (int4), the stored codes (int8)."""
    spec = QuantSpec("int4_symmetric" if bits == 4 else "int8_symmetric", "per_block", 64)
    lin = _layer(16, 256, spec, tiles)
    calls = []

    def fake(x, w, s, group, N, K, cfg=None):
        calls.append((x.shape, w, s, group, N, K))
        return torch.zeros(x.shape[0], N, dtype=x.dtype)

    monkeypatch.setattr(gemv, "choose", lambda *a, **k: None)
    monkeypatch.setattr(gemv, "int4_tiles_matmul", fake)
    monkeypatch.setattr(gemv, "int8_rows_matmul", fake)
    x = torch.randn(2, 3, 256).to(BF16)
    y = lin(x)
    assert y.shape == (2, 3, 16) and len(calls) == 1
    shape, w, s, group, N, K = calls[0]
    assert (tuple(shape), group, N, K) == ((6, 256), 64, 16, 256)
    if bits == 8:
        assert w is lin.codes and s is lin.scales
    elif tiles:
        assert w is lin.codes and s is lin.scales
    else:       # the layout derived once and kept (on the CPU: the CPU kernel's)
        assert w is lin._int4[(x.device, x.dtype)][2] and s is lin._int4[(x.device, x.dtype)][3]


def test_layer_on_cpu_never_takes_the_kernel(monkeypatch):
    """CPU activations keep their paths (torch's CPU int4 kernel, dequantize)."""
    def boom(*a, **k):
        raise AssertionError("gemv kernel called on the CPU")

    monkeypatch.setattr(gemv, "int4_tiles_matmul", boom)
    monkeypatch.setattr(gemv, "int8_rows_matmul", boom)
    for scheme in ("int4_symmetric", "int8_symmetric"):
        lin = _layer(16, 256, QuantSpec(scheme, "per_block", 128), False)
        x = torch.randn(1, 256).to(BF16)
        ref = x.float() @ lin.dequantized_weight(torch.float32).t()
        assert ((lin(x).float() - ref).abs().max() / ref.abs().max()) < 2e-2


def _check(y, x, W):
    """Max |y - ref| over its allowance: half a bfloat16 unit in the last place of ``ref`` (the
    output's one rounding), the reference's own rounding of each weight to bfloat16 (a kernel may
    round them as dequantize does, or not), and 2^-14 of sum |x||W| (float32 sums in another
    order: an output near zero by cancellation has a tiny last place). ``ref``: float64
    x @ W.T with W exact."""
    ref = x.double() @ W.double().t()
    ulp = 2.0 ** (torch.floor(torch.log2(ref.to(BF16).double().abs().clamp_min(1e-30))) - 7)
    rounding = x.double().abs() @ (W.double() - W.to(BF16).double()).abs().t()
    allowance = 0.5 * ulp + rounding + 2.0 ** -14 * (x.double().abs() @ W.double().abs().t())
    return ((y.double() - ref).abs() / allowance).max().item()


def _int4_case(N, K, group, device="cuda"):
    spec = QuantSpec("int4_symmetric", "per_block", group)
    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=device)
    scales = (torch.rand(N, K // group, device=device) * 0.02 + 1e-3).half()
    words = int4pack.cuda_layout(codes, 8)
    sz = int4pack.scales_and_zeros(scales, spec, (N, K), group, BF16)
    W = dequantize(codes, sz[..., 0].t().float(), spec, (N, K), torch.float32)
    return words, sz, W


def _mma_cases(group, device, shapes, ms=(1, 3, 8)):
    """Every output within its allowance of float64 dequantize + matmul, 1..8 rows, the default
    shape and others (the L2 prefetch, 2 and 4 steps a call), the same bits on a second call (no
    atomics on data, the counters back at zero); on the last shape also the reference of the same
    arithmetic, x at an odd offset (copied), tiles off alignment (torch's int4 kernel)."""
    torch.manual_seed(group)
    for N, K in shapes:
        words, sz, W = _int4_case(N, K, group, device)
        for M in ms:
            x = torch.randn(M, K, device=device).to(BF16)
            cfgs = [None]
            if M != 3:
                cfgs += [gemv.mma_config(N, K, nt=2, bc=4, warps=2, pf=1),
                         gemv.mma_config(N, K, nt=8, bc=1, warps=4, ctas=132, steps=2),
                         gemv.mma_config(N, K, nt=4, bc=2, warps=4, ctas=132, steps=4)]
            for cfg in cfgs:
                y = gemv.int4_tiles_matmul(x, words, sz, group, N, K, cfg)
                assert y.dtype == BF16 and _check(y, x, W) <= 1, (N, K, M, cfg)
                assert torch.equal(y, gemv.int4_tiles_matmul(x, words, sz, group, N, K, cfg))
    x = torch.randn(8, K, device=device).to(BF16)
    ref = gemv.mma_reference(x, words, sz, group, N, K, gemv.mma_config(N, K)["SPLIT"])
    assert _check(ref, x, W) <= 1
    big = torch.randn(2, K + 1, device=device).to(BF16)
    xo = big[:1, 1:]
    assert xo.data_ptr() % 4 == 2
    assert _check(gemv.int4_tiles_matmul(xo, words, sz, group, N, K), xo, W) <= 1
    buf = torch.empty(words.numel() + 1, dtype=words.dtype, device=device)
    wo = buf[1:].view(words.shape)
    wo.copy_(words)
    assert torch.equal(gemv.int4_tiles_matmul(x, wo, sz, group, N, K),
                       gemv._tinygemm(x, words, group, sz))


def test_mma_cases_on_the_cpu(simulated, monkeypatch):
    """The GPU test's own code at small shapes with the launch simulated (and torch's CUDA int4
    kernel replaced by the reference), so it cannot fail on the device for a Python reason."""
    monkeypatch.setattr(gemv, "_tinygemm",
                        lambda x, w, g, sz: gemv.mma_reference(x, w, sz, g, sz.shape[1],
                                                               sz.shape[0] * g))
    _mma_cases(64, "cpu", ((24, 384),), ms=(1, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("group", (32, 64, 128))
def test_mma_kernel_matches_the_reference(group):
    """The tensor-core kernel on the device (``_mma_cases``)."""
    _mma_cases(group, "cuda", ((4096, 4096), (1024, 14336), (264, 1152)))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("group", (32, 64, 128))
def test_cuda_core_int4_kernels_match_the_reference(group):
    torch.manual_seed(group)
    for N, K in ((4096, 4096), (1024, 14336), (264, 1152)):
        words, sz, W = _int4_case(N, K, group)
        for M in (1, 2, 5, 8):
            x = torch.randn(M, K, device="cuda").to(BF16)
            if M == 1:
                cfgs = [gemv.rows_config(N, K), gemv.rows_config(N, K, 32, 8, 264, 3),
                        gemv.rows_config(N, K, 16, 1, 132)]
            else:
                cfgs = [gemv.int4_config(16, N, K),
                        dict(kernel="dot", BLOCK_N=64, BLOCK_C=1, SPLIT=3 if K == 1152 else 4)]
            for cfg in cfgs:
                y = gemv.int4_tiles_matmul(x, words, sz, group, N, K, cfg)
                assert y.dtype == BF16 and _check(y, x, W) <= 1, (N, K, M, cfg)
                # again: the same bits (no atomics on data, the counters back at zero)
                assert torch.equal(y, gemv.int4_tiles_matmul(x, words, sz, group, N, K, cfg))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("granularity,group", [("per_block", 128), ("per_block", 32),
                                               ("per_tensor", 0)])
def test_int8_kernel_matches_the_reference(granularity, group):
    torch.manual_seed(group)
    spec = QuantSpec("int8_symmetric", granularity, group or 128)
    for N, K in ((4096, 4096), (1024, 14336)):
        codes = torch.randint(-128, 128, (N, K), dtype=torch.int8, device="cuda")
        scales = ((torch.rand(N, K // group, device="cuda") if group else
                   torch.rand(1, device="cuda")) * 0.02 + 1e-3).half()
        W = dequantize(codes, scales, spec, (N, K), torch.float32)
        for dtype in (BF16, torch.float16):
            x = torch.randn(1, K, device="cuda").to(dtype)
            y = gemv.int8_rows_matmul(x, codes, scales, group, N, K)
            assert y.dtype == dtype and _check(y, x, W) <= 1, (N, K, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("M", (1, 8))
def test_layer_in_a_cuda_graph_matches_eager_and_tinygemm(monkeypatch, M):
    """With the kernel on, a tile-layout layer's decode call (1 or 8 rows) takes it, replays from
    a graph with the same bits, and agrees with torch's int4 kernel within bf16 rounding."""
    monkeypatch.setattr(gemv, "INT4_MAX_M", 8)
    spec = QuantSpec("int4_symmetric", "per_block", 128)
    lin = _layer(4096, 4096, spec, True).cuda()
    x = torch.randn(M, 4096, device="cuda").to(BF16)
    eager = lin(x)
    tiny = torch.ops.aten._weight_int4pack_mm(x, lin.codes, 128, lin.scales)
    assert not torch.equal(eager, tiny)          # a different kernel ran
    assert ((eager.float() - tiny.float()).abs().max() / tiny.float().abs().max()) < 1e-2
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lin(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = lin(x)
    x.copy_(torch.randn(M, 4096, device="cuda").to(BF16))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, lin(x))


def test_gemv_bench_smoke_runs_every_path_on_the_cpu(simulated, tmp_path):
    """``bench/gemv.py --smoke`` (the CPU, tiny shapes) with the tensor-core launch simulated: the
    default rows at 1 and 8 rows, the sweep and the access-pattern rows all run, and what it
    writes is what the device run writes -- so the device run cannot die on a Python error."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("bench_gemv", ROOT / "bench" / "gemv.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "gemv.json"
    bench.main(["--smoke", "--output", str(out), "--ms", "1,8", "--sweep", "--budget-s", "1.5",
                "--shapes", "24x384"])
    res = json.loads(out.read_text())
    assert [(r["N"], r["K"], r["M"]) for r in res["rows"]] == [(24, 384, 1), (24, 384, 8)]
    for r in res["rows"]:
        assert "int4_error" not in r and r["int4_check"][1] <= 1 and r["int4_us"] > 0
        assert r["tinygemm_us"] > 0 and r["bf16_us"] > 0
        assert r["int4_config"]["kernel"] == "mma"
    sweep = res["rows"][0]["int4_sweep"]
    assert sweep and not [v for v in sweep if "error" in v], sweep
    assert all(v["check"] <= 1 for v in sweep if not v.get("LO"))
    assert sum(1 for v in sweep if v.get("LO")) == 2
    assert "int4_sweep" not in res["rows"][1]


def test_tensor_core_launch_binds_in_tritons_runtime(monkeypatch):
    """The launch ``_mma_matmul`` makes (its positional arguments, constexprs -- the asm text among
    them -- and num_warps), handed to Triton's own runtime binder and compiler for sm_90
    (``warmup``: everything a launch does but the launch), with a stand-in driver that names the
    target: what would fail on the device for a binding reason fails here."""
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class Target:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    launches = []

    class Grab:
        def __getitem__(self, grid):
            return lambda *a, **k: launches.append((grid, a, k))

    real = gemv._int4_tiles_mma
    monkeypatch.setattr(gemv, "_int4_tiles_mma", Grab())
    words, sz, _ = _int4_case(64, 512, 128, "cpu")
    x = torch.randn(2, 512).to(BF16)
    for cfg in (None, gemv.mma_config(64, 512, pf=1), gemv.mma_config(64, 512, steps=2)):
        gemv.int4_tiles_matmul(x, words, sz, 128, 64, 512, cfg)
    monkeypatch.setattr(driver, "_active", Target())      # restored after the test
    for grid, a, k in launches:
        k = dict(k)
        kernel = real.warmup(*a, grid=grid, num_warps=k.pop("num_warps"), **k)
        assert "mma.sync.aligned.m16n8k16" in kernel.asm["ptx"]
    assert len(launches) == 3
