"""CUDA mechanisms both ends use: page-locking host memory once, opening a daemon's GPU arena.

Imported lazily (torch is): the controller and the client also run where there is no GPU, and
there ``cuda_available()`` is False and host memory stays pageable.
"""
from __future__ import annotations

import logging

log = logging.getLogger("deepseek_flash.cuda")

CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def register_host_memory(address: int, size: int) -> bool:
    """Page-lock ``[address, address+size)`` for the GPU once (cudaHostRegister, portable).

    Returns False (and logs why) where CUDA is absent or refuses; copies then run from pageable
    memory, slower but correct.
    """
    if not cuda_available():
        return False
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
    if code == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
        return True
    if code != 0:
        log.warning("cudaHostRegister of %d bytes at %#x failed (cudaError %d); host->GPU copies "
                    "will be pageable", size, address, code)
        return False
    return True


def unregister_host_memory(address: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(address)


def open_gpu_arena(desc: dict):
    """Client side: map a daemon's GPU arena (one cudaIpcOpenMemHandle) as a uint8 tensor."""
    import torch

    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        desc["device"], desc["handle"], desc["size"], desc["offset"], desc["ref_handle"],
        desc["ref_offset"], desc["event_handle"] or None, desc["event_sync"])
    tensor = torch.empty(0, dtype=torch.uint8, device=f"cuda:{desc['device']}")
    tensor.set_(storage, 0, (desc["arena_size"],), (1,))
    return tensor
