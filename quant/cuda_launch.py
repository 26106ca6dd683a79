"""Launching an NVRTC kernel (``torch.cuda._compile_kernel``'s) with programmatic dependent launch.

``launch(kernel, grid, block, args, shared_mem)`` is the kernel object's own call, through the
driver's ``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``: the
grid may start while the kernel before it in the stream is still running, once every block of
that one has executed ``griddepcontrol.launch_dependents`` (or exited); it must then execute
``griddepcontrol.wait`` before it reads anything that kernel wrote (the int4 GEMV's ``PDL`` mode:
its weights' loads go out before the wait, its input is read after it). Captured into CUDA graphs
as a programmatic edge. The structures are the driver API's (cuda.h, CUDA 12 and 13).
"""
from __future__ import annotations

import ctypes

PROGRAMMATIC_STREAM_SERIALIZATION = 6      # CUlaunchAttributeID


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: the id, padding to 8 bytes, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_ubyte * 64)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def _params(args):
    """The kernel's parameters as torch's launcher passes them: tensors as device pointers, ints
    as C int, floats as C double (kept alive by the returned list)."""
    import torch

    held = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            held.append(ctypes.c_void_p(arg.data_ptr()))
        elif isinstance(arg, bool) or not isinstance(arg, (int, float)):
            raise TypeError(f"kernel argument of type {type(arg).__name__}")
        elif isinstance(arg, int):
            held.append(ctypes.c_int(arg))
        else:
            held.append(ctypes.c_double(arg))
    array = (ctypes.c_void_p * len(held))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in held])
    return held, array


def launch(kernel, grid, block, args, shared_mem: int = 0, stream=None, lib=None) -> None:
    """``kernel(grid=..., block=..., args=..., shared_mem=...)`` with programmatic dependent launch
    (``kernel.func``: the CUfunction; ``lib``: libcuda, torch's by default)."""
    import torch

    if lib is None:
        lib = torch.cuda._utils._get_gpu_runtime_library()
    if stream is None:
        stream = torch.cuda.current_stream()
    attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1                        # programmaticStreamSerializationAllowed
    cfg = LaunchConfig(*grid, *block, shared_mem, ctypes.c_void_p(stream.cuda_stream),
                       ctypes.pointer(attr), 1)
    held, params = _params(args)
    rc = lib.cuLaunchKernelEx(ctypes.byref(cfg), kernel.func, params, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {rc}")
    del held
