"""CUDA mechanisms both ends use: page-locking host memory once, a GPU arena's segments.

Imported lazily (torch is): the controller and the client also run where there is no GPU, and
there ``cuda_available()`` is False and host memory stays pageable.
"""
from __future__ import annotations

import functools
import logging

log = logging.getLogger("deepseek_flash.cuda")

CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


# Attention kernels our CUDA paths let torch's scaled_dot_product_attention choose from: every one
# but cuDNN's. cuDNN's attention (torch's first choice on sm90/sm100 with a recent cuDNN) builds an
# execution plan for every new shape -- ~2 ms of host time per call at decode, where the key length
# grows by one each step, and far more for a new prefill shape -- while the flash and
# memory-efficient kernels need no per-shape set-up. The one place serve, kv and decode take it from.
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


@functools.lru_cache(maxsize=None)
def _sdpa_backend_list() -> tuple:
    from torch.nn.attention import SDPBackend

    return tuple(getattr(SDPBackend, name) for name in SDPA_BACKENDS)


class _SdpaFlags:
    """``torch.nn.attention.sdpa_kernel(list(SDPA_BACKENDS))`` in a few C calls: the same flags
    set on entry (each backend in ``SDPA_BACKENDS`` on, every other off) and the previous ones
    back on exit. ``sdpa_kernel`` is a generator context that reads and writes every flag through
    ``getattr`` both ways (~25 us of host time per use); an eager decode step of a long-context
    model enters it once per layer (kv/compute.py), where the host is the bound."""

    __slots__ = ("saved",)
    getters: tuple = ()
    setters: tuple = ()
    wanted: tuple = ()

    @classmethod
    def bind(cls) -> bool:
        """Resolve torch's flag accessors once; False where this torch names them otherwise."""
        if cls.getters:
            return True
        import torch
        try:
            from torch.nn.attention import _backend_names
            names = list(_backend_names.items())
            getters = tuple(getattr(torch._C, f"_get_{n}_sdp_enabled") for n, _ in names)
            setters = tuple(getattr(torch._C, f"_set_sdp_use_{n}") for n, _ in names)
        except (ImportError, AttributeError):
            return False
        cls.wanted = tuple(backend in SDPA_BACKENDS for _, backend in names)
        cls.setters, cls.getters = setters, getters
        return True

    def __enter__(self):
        saved = tuple(get() for get in self.getters)
        self.saved = saved
        if saved != self.wanted:
            for put, on in zip(self.setters, self.wanted):
                put(on)
        return {}

    def __exit__(self, *exc):
        if self.saved != self.wanted:
            for put, on in zip(self.setters, self.saved):
                put(on)
        return False


def sdpa_backends(device=None):
    """Context manager: torch's SDPA restricted to ``SDPA_BACKENDS`` when ``device`` (a
    ``torch.device``, a string, or None for "CUDA if present") is a CUDA device; a no-op
    elsewhere (no cuDNN attention on a CPU)."""
    import contextlib

    if not (cuda_available() if device is None else _is_cuda(device)):
        return contextlib.nullcontext()
    if _SdpaFlags.bind():
        return _SdpaFlags()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(list(_sdpa_backend_list()))


def _is_cuda(device) -> bool:
    """A ``torch.device`` or a string names CUDA (the string formatted only where there is no
    ``type``: this runs once per layer of an eager step)."""
    kind = getattr(device, "type", None)
    return kind == "cuda" if kind is not None else str(device).split(":")[0] == "cuda"


def attention_without_cudnn(model, device) -> bool:
    """Run every forward of ``model`` (``load_model``'s, as transformers' ``generate`` calls it)
    under ``sdpa_backends(device)``: an eager decode step of an 8B shape otherwise pays cuDNN's
    plan for each layer at each new key length (~2 ms of host time per layer and token on the
    H200 machine: ~60 ms a token, which the copies of a streamed model cannot hide). Wraps the
    instance's ``forward`` (no forward hook: a hooked model could not be captured in a CUDA
    graph); ``unwrapped_forward`` undoes it. False (nothing done) where ``device`` is not CUDA."""
    if not _is_cuda(device) or hasattr(model.forward, "__flash_sdpa__"):
        return False
    forward = model.forward

    @functools.wraps(forward)
    def run(*args, **kwargs):
        with sdpa_backends(device):
            return forward(*args, **kwargs)

    run.__flash_sdpa__ = True
    model.forward = run
    return True


def unwrapped_forward(model) -> None:
    """Undo ``attention_without_cudnn`` (torch then chooses among all its kernels again)."""
    if hasattr(model.forward, "__flash_sdpa__"):
        del model.forward


def nvidia_driver_present() -> bool:
    """Cheap test, without importing torch: is an NVIDIA kernel driver loaded here?"""
    import os

    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _host_register(address: int, size: int) -> int:
    """``cudaHostRegister`` (portable) of one range; the cudaError code."""
    import torch

    cudart = torch.cuda.cudart()
    # cudaHostRegisterPortable: pinned for every device context, not just the current one.
    err = cudart.cudaHostRegister(address, size, 1)
    code = int(getattr(err, "value", err))
    if code != 0:
        # A failed runtime call leaves its error as the thread's "last error", which torch would
        # then report at its next, unrelated kernel launch: consume it here.
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:
            clear()
    return code


def register_host_memory(address: int, size: int) -> bool:
    """Page-lock ``[address, address+size)`` for the GPU once (cudaHostRegister, portable).

    Returns False (and logs why) where CUDA is absent or refuses; copies then run from pageable
    memory, slower but correct.
    """
    if not cuda_available():
        return False
    code = _host_register(address, size)
    if code in (0, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED):
        return True
    log.warning("cudaHostRegister of %d bytes at %#x failed (cudaError %d); host->GPU copies "
                "will be pageable", size, address, code)
    return False


def register_host_range(address: int, size: int) -> bool:
    """Page-lock one range for this process; True only where this call registered it (so the
    caller unregisters exactly what it registered). Already registered or refused: False."""
    if not cuda_available():
        return False
    code = _host_register(address, size)
    if code not in (0, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED):
        log.warning("cudaHostRegister of %d bytes at %#x failed (cudaError %d); copies from it "
                    "stay pageable", size, address, code)
    return code == 0


CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3


@functools.lru_cache(maxsize=None)
def _driver_library():
    """The CUDA driver library (``libcuda.so.1``), or None where it cannot be loaded."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        log.debug("no CUDA driver library to ask about host pointers: %s", exc)
        return None
    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    lib.cuPointerGetAttribute.restype = ctypes.c_int
    return lib


def device_address(address: int) -> int | None:
    """The address kernels read the page-locked host memory at ``address`` through (the driver's
    ``CU_POINTER_ATTRIBUTE_DEVICE_POINTER`` in the current context), or None: memory not
    page-locked or not mapped for the device, no CUDA, or no driver library to ask. Host memory
    that a kernel reads where it is not mapped is a fatal error for the whole CUDA context, so a
    caller that lets kernels read host memory asks here first. (The driver's one-attribute call
    writes exactly one pointer: no structure whose size changes between CUDA versions.)"""
    import ctypes

    if not cuda_available():
        return None
    lib = _driver_library()
    if lib is None:
        return None
    pointer = ctypes.c_uint64(0)
    # a driver error (CUDA_ERROR_INVALID_VALUE: not mapped) is returned, not kept as the
    # thread's last error that torch would report later
    if lib.cuPointerGetAttribute(ctypes.byref(pointer), CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                                 address) != 0:
        return None
    return pointer.value or None


def unregister_host_memory(address: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(address)


class DeviceMemory:
    """A device arena's offset space as segments: ``memory[a:b]`` is the slice of the one
    segment that holds ``[a, b)`` (the daemon never hands out a range across two). The daemon's
    ``GpuArena`` keeps one over its own allocations; a client keeps one over the segments it
    opened through CUDA IPC (``update``), each opened once."""

    def __init__(self):
        self._bases: list[int] = []
        self._segments: dict[int, tuple[int, object, bytes]] = {}   # base -> (size, tensor, key)

    def add(self, base: int, tensor, key: bytes = b"") -> None:
        import bisect

        if base not in self._segments:
            bisect.insort(self._bases, base)
        self._segments[base] = (int(tensor.numel()), tensor, key)

    def remove(self, base: int) -> None:
        if self._segments.pop(base, None) is not None:
            self._bases.remove(base)

    def bases(self) -> list[int]:
        return list(self._bases)

    def __len__(self) -> int:
        return len(self._bases)

    def __getitem__(self, key: slice):
        import bisect

        start, stop = key.start or 0, key.stop
        i = bisect.bisect_right(self._bases, start) - 1
        if i < 0:
            raise IndexError(f"device offset {start} is in no segment")
        base = self._bases[i]
        size, tensor, _ = self._segments[base]
        if stop is None or stop > base + size:
            raise IndexError(f"device range [{start}, {stop}) crosses the end of the segment "
                             f"[{base}, {base + size})")
        return tensor[start - base:stop - base]

    def update(self, desc: dict) -> DeviceMemory:
        """Client side: open the segments of a daemon's arena descriptor not opened yet
        (one cudaIpcOpenMemHandle each) and forget those the daemon released."""
        listed = {seg["base"]: seg for seg in desc["segments"]}
        for base in [b for b in self._bases if b not in listed or
                     self._segments[b][2] != listed[b]["handle"]]:
            self.remove(base)
        for base, seg in listed.items():
            if base not in self._segments:
                self.add(base, _open_segment(desc["device"], seg), seg["handle"])
        return self


def _open_segment(device: int, seg: dict):
    import torch

    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device, seg["handle"], seg["storage_size"], seg["offset"], seg["ref_handle"],
        seg["ref_offset"], seg["event_handle"] or None, seg["event_sync"])
    tensor = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    tensor.set_(storage, 0, (seg["size"],), (1,))
    return tensor


def open_gpu_arena(desc: dict, memory: DeviceMemory | None = None) -> DeviceMemory:
    """Client side: a daemon's GPU arena (its segments opened once each) as ``DeviceMemory``."""
    return (memory or DeviceMemory()).update(desc)


# nvmlDeviceGetPcieLinkMaxSpeed answers with an enum (NVML_PCIE_LINK_MAX_SPEED_*), not a number:
# 1..6 stand for 2500, 5000, 8000, 16000, 32000, 64000 Mbit/s per lane (PCIe generations 1..6).
_NVML_LINK_SPEED_MBPS = {1: 2500, 2: 5000, 3: 8000, 4: 16000, 5: 32000, 6: 64000}


def pcie_capacity(nv, handle) -> float:
    """The device's PCIe link capacity in bytes/s, one direction: per-lane signalling rate, less
    line encoding (8b/10b up to 5 GT/s, 128b/130b from 8 GT/s), times the link width."""
    speed = int(nv.nvmlDeviceGetPcieLinkMaxSpeed(handle))
    mbps = _NVML_LINK_SPEED_MBPS.get(speed, speed)   # a driver that answers in Mbit/s: as is
    encoding = 8 / 10 if mbps <= 5000 else 128 / 130
    return mbps * 1e6 / 8 * encoding * int(nv.nvmlDeviceGetMaxPcieLinkWidth(handle))


@functools.lru_cache(maxsize=None)
def link_bytes_per_s(device: int) -> float | None:
    """PCIe capacity of CUDA ``device`` from NVML (bytes/s), None where NVML cannot tell."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        return pcie_capacity(pynvml, pynvml.nvmlDeviceGetHandleByIndex(device))
    except pynvml.NVMLError as exc:
        log.debug("PCIe link of cuda:%d unknown: %s", device, exc)
        return None
