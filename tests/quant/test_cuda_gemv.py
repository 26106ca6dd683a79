"""quant.cuda_gemv: the batch-1 int4 GEMV in CUDA C++. CPU: the kernel's CPU stand-in
(``Emulated``: its index arithmetic and the PTX fragment layout of each ``mma``) against
``gemv.mma_reference`` (the same arithmetic, float32 sums in another order: within a bfloat16 last
place where they differ at all) and against dequantize + matmul, its shapes and refusals, the
source through NVRTC for sm_90 where the library is present, the bench's path; CUDA (marked gpu):
the compiled kernel against the reference and torch's int4 kernel, and inside a CUDA graph."""
from __future__ import annotations

import ctypes
import dataclasses
import ctypes.util
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from deepseek_flash.quant import QuantSpec, cuda_gemv, cuda_gemv_emu, gemv, int4pack
from deepseek_flash.quant.codec import dequantize

CUDA = torch.cuda.is_available()
BF16 = torch.bfloat16
ROOT = Path(__file__).parents[2]


def _case(N, K, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    spec = QuantSpec("int4_symmetric", "per_block", 128)
    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g).to(device)
    scales = (torch.rand(N, K // 128, generator=g) * 0.02 + 1e-3).half().to(device)
    words = int4pack.cuda_layout(codes, 8)
    sz = int4pack.scales_and_zeros(scales, spec, (N, K), 128, BF16)
    W = dequantize(codes, sz[..., 0].t().float(), spec, (N, K), torch.float32)
    x = torch.randn(1, K, generator=g).to(BF16).to(device)
    return x, words, sz, W


def _near(y, ref):
    """``y`` is ``ref`` but where float32 sums in another order round the other way: at most one
    bfloat16 last place apart, in at most 2 % of the outputs (or one)."""
    ulp = 2.0 ** (torch.floor(torch.log2(ref.float().abs().clamp_min(1e-30))) - 7)
    diff = (y.float() - ref.float()).abs()
    return bool((diff <= ulp).all()) and int((diff > 0).sum()) <= max(1, 0.02 * diff.numel())


def _check(y, x, W):
    """Max |y - ref| over its allowance (as tests/quant/test_gemv.py): half a bfloat16 unit in the
    last place of float64 ``x @ W.T``, the weights' own bfloat16 rounding, 2^-14 of sum |x||W|."""
    ref = x.double() @ W.double().t()
    ulp = 2.0 ** (torch.floor(torch.log2(ref.to(BF16).double().abs().clamp_min(1e-30))) - 7)
    rounding = x.double().abs() @ (W.double() - W.to(BF16).double()).abs().t()
    allowance = 0.5 * ulp + rounding + 2.0 ** -14 * (x.double().abs() @ W.double().abs().t())
    return ((y.double() - ref).abs() / allowance).max().item()


@pytest.mark.parametrize("N,K,cfg", [(64, 1024, (2, 8, 1, 1)), (40, 1024, (2, 4, 2, 0)),
                                     (24, 512, (4, 2, 2, 1)), (16, 256, (1, 1, 2, 1)),
                                     (64, 1024, (2, 8, 1, 1, 0, 0, 1)),
                                     (40, 1024, (2, 4, 2, 0, 0, 0, 1)),
                                     (24, 512, (4, 2, 2, 1, 0, 0, 1)),
                                     (72, 2048, None),
                                     (64, 1024, (2, 8, 1, 1, 0, 0, 1, 0, 0, 1)),
                                     (40, 1024, (4, 2, 1, 1, 0, 0, 1, 0, 0, 3))])
def test_emulated_kernel_is_the_reference_arithmetic(N, K, cfg):
    """Every output of the stand-in is ``mma_reference``'s (``_near``; N not a multiple of a
    CTA's rows included: the last CTA re-reads a valid n-tile and stores nothing past N), and is
    within its allowance of float64 dequantize + matmul; one launch, the grid and shared memory
    the config says."""
    x, words, sz, W = _case(N, K, seed=N)
    kern = cuda_gemv.Kernels(cuda_gemv_emu.emulated_compile)
    c = cuda_gemv.Config(*cfg) if cfg else None
    y = cuda_gemv.matmul(x, words, sz, N, K, c, kern)
    assert y.shape == (1, N) and y.dtype == BF16
    assert _near(y, gemv.mma_reference(x, words, sz, 128, N, K))
    assert _check(y, x, W) <= 1
    c = c or cuda_gemv.default_config(N, K)
    (call,) = kern.get(c).calls
    assert call["grid"] == (-(-(N // 8) // c.NT), 1, 1) and call["block"] == (32 * c.W, 1, 1)
    ring = (-(K // 128) % 4) * 4 + c.W * c.R * c.NT * 640 if c.R else 0
    assert call["shared_mem"] == (K // 128) * 260 + c.W * c.NT * 32 + ring
    # G: at most G CTAs an SM (the CPU counts one SM), the blocks looped over; the same kernel
    g = dataclasses.replace(c, G=2)
    assert torch.equal(cuda_gemv.matmul(x, words, sz, N, K, g, kern), y)
    assert kern.get(g) is kern.get(c) and kern.get(c).calls[-1]["grid"] == (
        min(2, -(-(N // 8) // c.NT)), 1, 1)


def test_configs_fit_the_8b_shapes_and_say_why_not():
    for N, K in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1024, 4096)):
        assert cuda_gemv.default_config(N, K).fits(N, K) is None
    assert cuda_gemv.Config(2, 8, 1).fits(64, 512) == "K / 128 = 4 chunks not a multiple of W = 8 warps"
    assert cuda_gemv.Config(2, 4, 4).fits(64, 1024) == "2 chunks a warp not a multiple of U = 4"
    assert cuda_gemv.Config(1, 4, 1, A=1).fits(64, 1024) == "NT = 1 n-tiles with A = 1 (pairs of n-tiles)"
    a = cuda_gemv.SWAP
    assert cuda_gemv.default_config(28672, 4096) == cuda_gemv.Config(2, 8, 1, 1, A=a, G=4)
    assert cuda_gemv.default_config(64, 512) == cuda_gemv.Config(2, 4, 1, 1, A=a)
    # the K split depends on K alone: a merged GEMV sums each row as its projection's own call
    assert {cuda_gemv.default_config(n, 4096).W for n in (1024, 4096, 6144, 14336, 28672)} == {8}
    assert cuda_gemv.default_config(4096, 14336).W == 16
    x, words, sz, _ = _case(64, 512)
    with pytest.raises(ValueError, match="W = 8 warps"):
        cuda_gemv.matmul(x, words, sz, 64, 512, cuda_gemv.Config(2, 8, 1),
                         cuda_gemv.Kernels(cuda_gemv_emu.emulated_compile))


def test_supports_names_what_it_refuses():
    x = torch.zeros(1, 4096, dtype=BF16)
    assert cuda_gemv.supports(x, 4096, 4096, 128) == "device type cpu"
    meta = torch.zeros(1, 4096, dtype=BF16, device="meta")
    assert cuda_gemv.supports(meta, 4096, 4096, 128) == "device type meta"

    class Fake:          # a CUDA tensor's attributes, without a device
        def __init__(self, dtype=BF16, numel=4096):
            self.device, self.dtype, self._n = torch.device("cuda"), dtype, numel

        def numel(self):
            return self._n
    assert cuda_gemv.supports(Fake(), 4096, 4096, 128) is None
    assert cuda_gemv.supports(Fake(torch.float16), 4096, 4096, 128) == "torch.float16 activations"
    assert cuda_gemv.supports(Fake(numel=8192), 4096, 4096, 128) == "2 rows (the kernel takes one)"
    assert cuda_gemv.supports(Fake(), 4096, 4096, 64) == "scale group 64 (the kernel takes 128)"
    assert cuda_gemv.supports(Fake(), 4100, 4096, 128) == "shape 4100 x 4096 (N a multiple of 8, K of 128)"


def test_operands_off_alignment():
    """x at an odd offset is copied (4-byte loads of column pairs) and gives the same bits;
    codes or scales the kernel cannot load as they lie are refused with a ValueError."""
    N, K = 32, 512
    x, words, sz, _ = _case(N, K)
    kern = cuda_gemv.Kernels(cuda_gemv_emu.emulated_compile)
    c = cuda_gemv.Config(1, 4, 1, 1)
    base = torch.zeros(1, K + 1, dtype=BF16)
    base[0, 1:] = x[0]
    xo = base[:, 1:]
    assert xo.data_ptr() % 16
    assert torch.equal(cuda_gemv.matmul(xo, words, sz, N, K, c, kern),
                       cuda_gemv.matmul(x, words, sz, N, K, c, kern))
    with pytest.raises(ValueError, match="contiguous"):
        cuda_gemv.matmul(x, words, sz.transpose(0, 1).contiguous().transpose(0, 1), N, K, c, kern)


def _tile_layer(N, K, seed=0):
    from deepseek_flash.quant import quantize
    from deepseek_flash.quant.codec import QuantizedTensor
    from deepseek_flash.quant.linear import QuantLinear
    spec = QuantSpec("int4_symmetric", "per_block", 128)
    w = (torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05).to(BF16)
    qt = quantize(w, spec)
    qt = QuantizedTensor(spec, (N, K), int4pack.cuda_layout(qt.data, 8),
                         int4pack.scales_and_zeros(qt.scales, spec, (N, K), 128, BF16),
                         BF16, "int4_cuda_tiles", (8, 128))
    return QuantLinear(K, N, qt)


def test_layer_takes_the_kernel_for_one_row_and_falls_back_when_it_cannot_compile(monkeypatch,
                                                                                   caplog):
    """``QuantLinear`` on the tile layout: with ``ENABLED`` and ``supports`` saying yes (as on
    CUDA), a one-row call runs the kernel on the bound codes and scales (the stand-in here: the
    reference's bits); off, or when compiling fails (logged once, not retried), the layer's other
    path runs."""
    lin = _tile_layer(48, 512)
    x = torch.randn(1, 1, 512).to(BF16)
    other = lin(x)
    monkeypatch.setattr(cuda_gemv, "supports", lambda x, N, K, group: None)
    monkeypatch.setattr(cuda_gemv, "KERNELS", cuda_gemv.Kernels(cuda_gemv_emu.emulated_compile))
    monkeypatch.setattr(cuda_gemv, "_failed", [])
    assert cuda_gemv.ENABLED                              # on by default
    monkeypatch.setattr(cuda_gemv, "ENABLED", False)
    assert torch.equal(lin(x), other)
    monkeypatch.setattr(cuda_gemv, "ENABLED", True)
    y = lin(x)
    assert y.shape == (1, 1, 48)
    assert _near(y.view(1, 48), gemv.mma_reference(x.view(1, 512), lin.codes, lin.scales,
                                                         128, 48, 512))
    (c,) = cuda_gemv.KERNELS._cache
    assert cuda_gemv.KERNELS._cache[c].calls[0]["N"] == 48

    def refuse(*a, **k):
        raise RuntimeError("CUDA error: NVRTC_ERROR_COMPILATION")
    monkeypatch.setattr(cuda_gemv, "KERNELS", cuda_gemv.Kernels(refuse))
    assert torch.equal(lin(x), other) and torch.equal(lin(x), other)
    assert cuda_gemv._failed == ["RuntimeError: CUDA error: NVRTC_ERROR_COMPILATION"]
    assert sum("CUDA int4 GEMV is not used" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("N,K,cfg", [(64, 1024, (4, 8, 1, 1, 0, 0, 1)), (48, 512, (2, 4, 1, 1)),
                                     (64, 1024, (2, 8, 1, 1, 0, 0, 1)), (80, 512, (2, 4, 1, 1, 0, 0, 1, 2)),
                                     (80, 512, (4, 2, 2, 1, 0, 0, 1)), (96, 1024, None)])
def test_glu_output_is_the_plain_rows_then_silu_mul(N, K, cfg):
    """``matmul(..., glu=True)`` on gate | up rows: each output is silu(gate row) * (up row) of the
    plain call's bfloat16 rows -- the same bits a row whatever pairs of n-tiles a block takes --
    rounded as ``silu_mul`` rounds (the stand-in's activation: the kernel's ex2 / div formula)."""
    x, words, sz, _ = _case(N, K, seed=N + 1)
    kern = cuda_gemv.Kernels(cuda_gemv_emu.emulated_compile)
    c = cuda_gemv.Config(*cfg) if cfg else None
    plain = cuda_gemv.matmul(x, words, sz, N, K, c, kern).float()
    gate, up = plain[:, :N // 2], plain[:, N // 2:]
    act = (gate / (1.0 + torch.exp2(gate * -1.4426950408889634))).to(BF16)
    want = (act.float() * up).to(BF16)
    y = cuda_gemv.matmul(x, words, sz, N, K, dataclasses.replace(c, GLU=1) if c else None, kern, glu=True)
    assert y.shape == (1, N // 2) and torch.equal(y, want)
    from deepseek_flash.decode import kernels
    near = kernels._ref_silu_mul(gate.to(BF16), up.to(BF16)).float()
    assert (y.float() - near).abs().le(near.abs() * 2 ** -7 + 1e-6).all()     # silu_mul's own exp
    g = dataclasses.replace(c or cuda_gemv.glu_config(N, K), GLU=1)
    (call,) = kern.get(g).calls
    blocks = -(-(N // 16) // (g.NT // 2))
    assert call["grid"] == (min(blocks, g.G) if g.G else blocks, 1, 1)     # the CPU counts one SM
    assert cuda_gemv.glu_config(N, K).GLU == 1


def test_glu_takes_a_merged_gate_up_layer_or_says_none(monkeypatch):
    """``glu(layer, x)``: on by default; a one-row call on a tile-layout layer with group 128
    runs ``matmul(..., glu=True)`` on its codes and scales; a layer it cannot take: None."""
    lin = _tile_layer(96, 512, seed=4)
    x = torch.randn(1, 1, 512, generator=torch.Generator().manual_seed(6)).to(BF16)
    kern = cuda_gemv.Kernels(cuda_gemv_emu.emulated_compile)
    monkeypatch.setattr(cuda_gemv, "_failed", [])
    assert cuda_gemv.FUSE_GLU is True                                            # on by default
    monkeypatch.setattr(cuda_gemv, "FUSE_GLU", False)
    assert cuda_gemv.glu(lin, x) is None                                        # off
    monkeypatch.setattr(cuda_gemv, "FUSE_GLU", True)
    assert cuda_gemv.glu(lin, x) is None                                        # the CPU: supports says no
    monkeypatch.setattr(cuda_gemv, "supports", lambda x, N, K, group: None)
    monkeypatch.setattr(cuda_gemv, "KERNELS", kern)
    y = cuda_gemv.glu(lin, x)
    assert y.shape == (1, 1, 48)
    assert torch.equal(y.view(1, 48), cuda_gemv.matmul(x.view(1, 512), lin.codes, lin.scales, 96, 512,
                                                       None, kern, glu=True))
    assert cuda_gemv.glu(_tile_layer(40, 512), x) is None                       # halves not whole n-tiles


@pytest.mark.parametrize("glu", [False, True])
def test_norm_input_is_add_rms_norm_then_the_product(monkeypatch, glu):
    """``matmul(..., norm=...)`` (the stand-in): the residual plus x written as ``add_rms_norm``
    rounds it, and the product taken with its norm (within the allowance of the reference on the
    reference norm); ``norm_gemv`` off by default, on a layer: ``(y, new residual)``."""
    from deepseek_flash.decode import kernels
    N, K = 96, 512
    x, words, sz, W = _case(N, K, seed=11)
    gen = torch.Generator().manual_seed(12)
    res = torch.randn(1, K, generator=gen).to(BF16)
    nw = (torch.rand(K, generator=gen) + 0.5).to(BF16)
    want_res = res.clone()
    xin = kernels._ref_add_rms_norm(x, want_res, nw, 1e-5)
    kern = cuda_gemv.Kernels(cuda_gemv_emu.emulated_compile)
    res_out = torch.empty_like(res)
    y = cuda_gemv.matmul(x, words, sz, N, K, None, kern, glu=glu, norm=(res, nw, 1e-5, res_out))
    assert torch.equal(res_out, want_res)
    plain = cuda_gemv.matmul(xin, words, sz, N, K, None, kern, glu=glu)
    assert (y.float() - plain.float()).abs().max() <= plain.float().abs().max() * 2 ** -6
    if not glu:
        assert _check(y, xin, W) <= 1.5
    with pytest.raises(ValueError, match="norm operands"):
        cuda_gemv.matmul(x, words, sz, N, K, None, kern, norm=(res[:, :K // 2], nw, 1e-5, res_out))
    lin = _tile_layer(N, K, seed=13)
    monkeypatch.setattr(cuda_gemv, "_failed", [])
    assert cuda_gemv.norm_gemv(lin, x, res, nw, 1e-5) is None                   # off by default
    monkeypatch.setattr(cuda_gemv, "FUSE_NORM", True)
    assert cuda_gemv.norm_gemv(lin, x, res, nw, 1e-5) is None                   # the CPU
    monkeypatch.setattr(cuda_gemv, "supports", lambda x, N, K, group: None)
    monkeypatch.setattr(cuda_gemv, "KERNELS", kern)
    got, new_res = cuda_gemv.norm_gemv(lin, x.view(1, 1, K), res, nw, 1e-5, glu=glu)
    assert got.shape == (1, 1, N // 2 if glu else N) and torch.equal(new_res, want_res)
    assert torch.equal(got.view(1, -1), cuda_gemv.matmul(x, lin.codes, lin.scales, N, K, None, kern, glu=glu,
                                                         norm=(res, nw, 1e-5, torch.empty_like(res))))
    assert cuda_gemv.norm_gemv(lin, x, res.float(), nw, 1e-5) is None           # not bfloat16


def test_glu_refuses_shapes_without_whole_halves():
    assert "GLU over N = 40 rows" in cuda_gemv.Config(2, 4, 1, GLU=1).fits(40, 512)
    assert "GLU over N = 64 rows with NT = 1" in cuda_gemv.Config(1, 4, 1, GLU=1).fits(64, 512)
    assert cuda_gemv.Config(2, 4, 1, A=1, GLU=1).fits(64, 512) is None     # one gate and one up n-tile
    assert cuda_gemv.glu_config(28672, 4096) == cuda_gemv.Config(2, 8, 1, 1, A=cuda_gemv.SWAP, G=4, GLU=1)
    x, words, sz, _ = _case(40, 512)
    with pytest.raises(ValueError, match="GLU over N = 40"):
        cuda_gemv.matmul(x, words, sz, 40, 512, None, cuda_gemv.Kernels(cuda_gemv_emu.emulated_compile),
                         glu=True)


def test_silu_input_is_silu_mul_then_the_product(monkeypatch):
    """``matmul(..., silu=True)`` on gate | up: the bits of ``silu_mul`` then the product (the
    stand-in; the activation rounded to bfloat16, then the product); ``silu_down`` takes a down
    layer and the two halves of one gate|up output where the kernel can, else says None."""
    from deepseek_flash.decode import kernels
    N, K = 48, 512
    _, words, sz, W = _case(N, K)
    gu = (torch.randn(1, 2 * K, generator=torch.Generator().manual_seed(3)) * 2).to(BF16)
    kern = cuda_gemv.Kernels(cuda_gemv_emu.emulated_compile)
    xin = kernels._ref_silu_mul(gu[:, :K], gu[:, K:])
    y = cuda_gemv.matmul(gu, words, sz, N, K, cuda_gemv.Config(2, 4, 1, 1), kern, silu=True)
    assert _near(y, gemv.mma_reference(xin, words, sz, 128, N, K))
    assert _check(y, xin, W) <= 1
    with pytest.raises(ValueError, match="silu: gate and up, 2K"):
        cuda_gemv.matmul(gu[:, :K], words, sz, N, K, None, kern, silu=True)
    down = _tile_layer(N, K, seed=5)
    gate, up = gu.view(1, 1, 2 * K).split([K, K], dim=-1)
    monkeypatch.setattr(cuda_gemv, "_failed", [])
    monkeypatch.setattr(cuda_gemv, "ENABLED", False)
    monkeypatch.setattr(cuda_gemv, "FUSE_SILU", True)
    assert cuda_gemv.silu_down(down, gate, up) is None             # off
    monkeypatch.setattr(cuda_gemv, "ENABLED", True)
    assert cuda_gemv.silu_down(down, gate, up) is None             # the CPU: supports says no
    monkeypatch.setattr(cuda_gemv, "supports", lambda x, N, K, group: None)
    monkeypatch.setattr(cuda_gemv, "KERNELS", kern)
    y = cuda_gemv.silu_down(down, gate, up)
    assert y.shape == (1, 1, N)
    assert torch.equal(y, cuda_gemv.matmul(xin, down.codes, down.scales, N, K, None, kern).view(1, 1, N))
    assert cuda_gemv.silu_down(down, up, gate) is None             # up not right after gate
    assert cuda_gemv.silu_down(down, gate, up.clone()) is None


def _nvrtc():
    """libnvrtc (the pip wheel's, beside its builtins library, or the system's), else None."""
    names = []
    try:
        import nvidia
        for d in nvidia.__path__:
            for sub in ("cu13/lib", "cuda_nvrtc/lib"):
                lib = Path(d) / sub
                names += [str(p) for p in sorted(lib.glob("libnvrtc-builtins.so.*"))
                          if "alt" not in p.name]
                names += [str(p) for p in sorted(lib.glob("libnvrtc.so.*")) if "alt" not in p.name]
    except ImportError:
        pass
    names += ["libnvrtc.so.13", "libnvrtc.so.12"]
    found = None
    for name in names:
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if hasattr(lib, "nvrtcCompileProgram"):
            found = found or lib
    return found


NVRTC = _nvrtc()


@pytest.mark.skipif(NVRTC is None, reason="needs libnvrtc (NVRTC compiles without a GPU)")
def test_source_compiles_with_nvrtc_for_sm_90():
    """What ``torch.cuda._compile_kernel`` does on the device short of loading the module: the
    source with every config of the bench's sweep and the options ``Kernels`` passes compiles
    for sm_90 (no headers needed)."""
    spec = importlib.util.spec_from_file_location("bench_gemv", ROOT / "bench" / "gemv.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seen = []

    def compile(source, name, nvcc_options=()):
        prog = ctypes.c_void_p()
        assert NVRTC.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"gemv.cu", 0,
                                        None, None) == 0
        opts = [b"--gpu-architecture=compute_90"] + [o.encode() for o in nvcc_options]
        rc = NVRTC.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        NVRTC.nvrtcGetProgramLog(prog, log)
        assert rc == 0, log.value.decode()
        NVRTC.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        NVRTC.nvrtcGetPTX(prog, ptx)
        NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))
        seen.append(nvcc_options)
        return ptx.value.decode()

    kern = cuda_gemv.Kernels(compile)
    extra = [cuda_gemv.Config(2, 8, 2, 1, LO=1), cuda_gemv.Config(2, 8, 2, 1, S=1, A=1),
             cuda_gemv.Config(4, 8, 1, 1, A=1, GLU=1), cuda_gemv.Config(2, 8, 1, 1, GLU=1),
             cuda_gemv.Config(4, 8, 1, 1, A=1, GLU=1, R=4), cuda_gemv.Config(4, 8, 1, 1, A=1, GLU=1, NORM=1),
             cuda_gemv.Config(4, 8, 1, 1, A=1, GLU=1, NORM=1, R=4, PDL=1)]
    for c in [bench.sweep_config(t) for t in bench.CUDA_SWEEP] + extra:
        ptx = kern.get(c)
        assert ".entry int4_gemv_m1" in ptx
        assert ("mma.sync.aligned.m16n8k16" in ptx) == (not c.LO)
        assert ("ex2.approx.f32" in ptx) == bool(c.S or c.GLU)
        assert ("sqrt.approx.f32" in ptx) == bool(c.NORM)
        assert ("griddepcontrol.wait" in ptx) == bool(c.PDL)
        assert ("ld.global.nc.L1::no_allocate.v4.u32" in ptx) == (not c.R)
        assert ("cp.async.cg.shared.global" in ptx) == bool(c.R)
    # compiled once per source (G, the grid, is the launch's)
    sources = {dataclasses.replace(bench.sweep_config(t), G=0) for t in bench.CUDA_SWEEP}
    assert len(seen) == len(sources) + 7 and "-DLOADS_ONLY" in seen[-7] and "-DPDL=1" in seen[-1]
    kern.get(bench.sweep_config(bench.CUDA_SWEEP[0]))
    assert len(seen) == len(sources) + 7


def test_gemv_bench_cuda_rows_run_on_the_cpu(tmp_path):
    """``bench/gemv.py --smoke --cuda`` (the CPU stand-in for the compiled kernel): the default
    shape and the sweep run, are checked, and land in the JSON as the device run writes them."""
    spec = importlib.util.spec_from_file_location("bench_gemv", ROOT / "bench" / "gemv.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "gemv.json"
    bench.main(["--smoke", "--output", str(out), "--ms", "1", "--cuda", "--skip-triton",
                "--skip-bf16", "--budget-s", "20", "--shapes", "32x512"])
    (row,) = json.loads(out.read_text())["rows"]
    assert "cuda_error" not in row and row["cuda_check"] <= 1 and row["cuda_us"] > 0
    assert row["cuda_config"] == [2, 4, 1, 1, cuda_gemv.SWAP] and row["tinygemm_us"] > 0
    assert row["cuda_sweep"] and not [v for v in row["cuda_sweep"] if "error" in v]
    assert all(v["check"] <= 1 for v in row["cuda_sweep"] if not v.get("LO"))
    # the default's loads-only twin ((4, 8, ..) won't fit)
    assert [v["cfg"] for v in row["cuda_sweep"] if v.get("LO")] == [[2, 4, 1, 1, cuda_gemv.SWAP]]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_kernel_matches_the_reference_and_tinygemm():
    """The compiled kernel at the 8B shapes (merged q|k|v and gate|up included) and an odd one,
    every config of the bench's sweep that fits: within the allowance of float64 dequantize +
    matmul, the same bits on a second call, within bfloat16 rounding of torch's int4 kernel."""
    spec = importlib.util.spec_from_file_location("bench_gemv", ROOT / "bench" / "gemv.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for N, K in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (264, 1152)):
        x, words, sz, W = _case(N, K, "cuda", seed=N)
        tiny = torch.ops.aten._weight_int4pack_mm(x, words, 128, sz)
        for c in [None] + [bench.sweep_config(t) for t in bench.CUDA_SWEEP]:
            if c is not None and c.fits(N, K):
                continue
            y = cuda_gemv.matmul(x, words, sz, N, K, c)
            assert _check(y, x, W) <= 1, (N, K, c)
            assert torch.equal(y, cuda_gemv.matmul(x, words, sz, N, K, c)), (N, K, c)
            if c is not None and c.R:       # the ring moves the same words: the same bits
                plain = dataclasses.replace(c, R=0)
                assert torch.equal(y, cuda_gemv.matmul(x, words, sz, N, K, plain)), (N, K, c)
            rel = (y.float() - tiny.float()).abs().max() / tiny.float().abs().max()
            assert rel < 1e-2, (N, K, c, rel)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_kernel_in_a_cuda_graph():
    N, K = 6144, 4096
    x, words, sz, _ = _case(N, K, "cuda")
    y = torch.empty(1, N, dtype=BF16, device="cuda")
    cuda_gemv.matmul(x, words, sz, N, K, out=y)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cuda_gemv.matmul(x, words, sz, N, K, out=y)
    x.copy_(torch.randn(1, K, device="cuda").to(BF16))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, cuda_gemv.matmul(x, words, sz, N, K))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_silu_down_matches_silu_mul_then_the_kernel(monkeypatch):
    """On the device: the one-launch silu + down GEMV against ``decode.kernels.silu_mul`` (the
    Triton kernel) then the plain GEMV, at the 8B down shape: the same bits but where the two
    ``ex2.approx`` lowerings differ in a last place (at most 1 % of outputs, each within 2 %)."""
    from deepseek_flash.decode import kernels
    N, K = 4096, 14336
    _, words, sz, W = _case(N, K, "cuda", seed=7)
    gu = (torch.randn(1, 2 * K, device="cuda") * 2).to(BF16)
    y = cuda_gemv.matmul(gu, words, sz, N, K, silu=True)
    xin = kernels.silu_mul(gu[:, :K], gu[:, K:])
    ref = cuda_gemv.matmul(xin, words, sz, N, K)
    assert (y != ref).float().mean().item() <= 0.01
    assert ((y.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-2)).max() < 0.02
    assert _check(y, xin, W) <= 1.5


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_glu_matches_the_plain_kernel_then_silu_mul():
    """On the device, the 8B gate|up shape: ``glu`` against the plain kernel's rows then
    ``silu_mul`` -- the rows' bits the same, the activation's rounding at most a last place apart
    (two ``exp`` lowerings) in at most 1 % of outputs; the same bits twice."""
    from deepseek_flash.decode import kernels
    N, K = 28672, 4096
    x, words, sz, _ = _case(N, K, "cuda", seed=9)
    y = cuda_gemv.matmul(x, words, sz, N, K, glu=True)
    plain = cuda_gemv.matmul(x, words, sz, N, K)
    g4 = dataclasses.replace(cuda_gemv.glu_config(N, K), NT=2, G=4)    # one gate, one up n-tile a block
    assert torch.equal(cuda_gemv.matmul(x, words, sz, N, K, g4, glu=True), y)
    ref = kernels._ref_silu_mul(plain[:, :N // 2], plain[:, N // 2:])
    assert y.shape == (1, N // 2)
    assert (y != ref).float().mean().item() <= 0.01
    assert ((y.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-6).all()
    assert torch.equal(y, cuda_gemv.matmul(x, words, sz, N, K, glu=True))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("glu", [False, True])
def test_cuda_norm_matches_add_rms_norm_then_the_kernel(glu):
    """On the device, the 8B q|k|v (gate|up with ``glu``) shape: the new residual bit for bit
    ``add_rms_norm``'s (Triton's, checked on), the outputs within a bfloat16 step or two of its
    norm then the plain kernel (the norm's float32 sum in another order), the same bits twice."""
    from deepseek_flash.decode import kernels
    assert kernels.check_triton("cuda:0", BF16, dict(hidden=4096, heads=32, kv_heads=8, head_dim=128,
                                                     intermediate=14336)) is None
    N, K = (28672, 4096) if glu else (6144, 4096)
    x, words, sz, _ = _case(N, K, "cuda", seed=14)
    gen = torch.Generator().manual_seed(15)
    res = torch.randn(1, K, generator=gen).to("cuda", BF16)
    nw = (torch.rand(K, generator=gen) + 0.5).to("cuda", BF16)
    want_res = res.clone()
    xin = kernels.add_rms_norm(x, want_res, nw, 1e-5)
    ref = cuda_gemv.matmul(xin, words, sz, N, K, glu=glu)
    res_out = torch.empty_like(res)
    y = cuda_gemv.matmul(x, words, sz, N, K, glu=glu, norm=(res, nw, 1e-5, res_out))
    assert torch.equal(res_out, want_res)
    assert (y.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2 ** -6
    assert (y != ref).float().mean().item() <= 0.05
    again = torch.empty_like(res)
    assert torch.equal(y, cuda_gemv.matmul(x, words, sz, N, K, glu=glu, norm=(res, nw, 1e-5, again)))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_pdl_chain_in_a_graph_gives_the_plain_bits():
    """Programmatic dependent launch (``Config.PDL``, ``cuda_launch``): three GEMVs, each reading
    the one before's output (with a ring, and a norm), eagerly and captured in a graph, give the
    bits of the plain launches."""
    N, K = 4096, 4096
    x, words, sz, _ = _case(N, K, "cuda", seed=16)
    res = torch.randn(1, K, device="cuda").to(BF16)
    nw = torch.rand(K, device="cuda").to(BF16) + 0.5

    def chain(pdl, out):
        c = dataclasses.replace(cuda_gemv.default_config(N, K), PDL=pdl)
        r = dataclasses.replace(c, R=4)
        a = cuda_gemv.matmul(x, words, sz, N, K, c)
        b = cuda_gemv.matmul(a, words, sz, N, K, r)
        new_res = torch.empty_like(res)
        out.copy_(cuda_gemv.matmul(b, words, sz, N, K, c, norm=(res, nw, 1e-5, new_res)))

    want, got = torch.empty(1, N, dtype=BF16, device="cuda"), torch.empty(1, N, dtype=BF16, device="cuda")
    chain(0, want)
    chain(1, got)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain(1, got)
    got.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
