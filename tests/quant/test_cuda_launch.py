"""quant.cuda_launch: the driver structures as cuda.h lays them out, and what a launch passes to
``cuLaunchKernelEx`` (a stand-in for libcuda records it)."""
import ctypes

import pytest
import torch

from deepseek_flash.quant import cuda_gemv, cuda_gemv_emu, cuda_launch


def test_structures_have_the_driver_layout():
    # offsets and sizes of CUlaunchConfig / CUlaunchAttribute on x86-64 (cuda.h of CUDA 12 and 13)
    assert ctypes.sizeof(cuda_launch.LaunchConfig) == 56
    assert [getattr(cuda_launch.LaunchConfig, f).offset for f in ("sharedMemBytes", "hStream", "attrs",
                                                                  "numAttrs")] == [24, 32, 40, 48]
    assert ctypes.sizeof(cuda_launch.LaunchAttribute) == 72
    assert cuda_launch.LaunchAttribute.value.offset == 8


class FakeLib:
    def __init__(self, rc=0):
        self.rc, self.seen = rc, None

    def cuLaunchKernelEx(self, cfg_ref, func, params, extra):
        cfg = ctypes.cast(cfg_ref, ctypes.POINTER(cuda_launch.LaunchConfig)).contents
        attr = cfg.attrs[0]
        p = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        self.seen = dict(grid=(cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ),
                         block=(cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ), smem=cfg.sharedMemBytes,
                         stream=cfg.hStream, n=cfg.numAttrs, attr=(attr.id, attr.value[0]), func=func.value,
                         ptr=ctypes.cast(p[0], ctypes.POINTER(ctypes.c_void_p))[0],
                         int=ctypes.cast(p[1], ctypes.POINTER(ctypes.c_int))[0],
                         dbl=ctypes.cast(p[2], ctypes.POINTER(ctypes.c_double))[0], extra=extra)
        return self.rc


class Stream:
    cuda_stream = 0x1234


class Kernel:
    func = ctypes.c_void_p(0xBEEF)


def test_launch_passes_the_grid_the_attribute_and_each_parameter():
    t = torch.zeros(4)
    lib = FakeLib()
    cuda_launch.launch(Kernel(), (3, 1, 1), (256, 1, 1), [t, 7, 0.25], 1024, Stream(), lib)
    assert lib.seen == dict(grid=(3, 1, 1), block=(256, 1, 1), smem=1024, stream=0x1234, n=1,
                            attr=(cuda_launch.PROGRAMMATIC_STREAM_SERIALIZATION, 1), func=0xBEEF,
                            ptr=t.data_ptr(), int=7, dbl=0.25, extra=None)
    with pytest.raises(RuntimeError, match="CUresult 1"):
        cuda_launch.launch(Kernel(), (1, 1, 1), (32, 1, 1), [t, 1, 1.0], 0, Stream(), FakeLib(rc=1))
    with pytest.raises(TypeError, match="str"):
        cuda_launch.launch(Kernel(), (1, 1, 1), (32, 1, 1), ["x"], 0, Stream(), lib)


def test_pdl_config_runs_the_same_arithmetic_on_the_stand_in(monkeypatch):
    """``Config.PDL``: the same kernel arithmetic (the stand-in has no CUfunction, so it is called
    as before); ``cuda_gemv.PDL`` puts it in the default shapes."""
    from test_cuda_gemv import _case
    N, K = 64, 1024
    x, words, sz, _ = _case(N, K, seed=3)
    kern = cuda_gemv.Kernels(cuda_gemv_emu.emulated_compile)
    plain = cuda_gemv.matmul(x, words, sz, N, K, None, kern)
    monkeypatch.setattr(cuda_gemv, "PDL", 1)
    assert cuda_gemv.default_config(N, K).PDL == 1
    assert torch.equal(cuda_gemv.matmul(x, words, sz, N, K, None, kern), plain)
