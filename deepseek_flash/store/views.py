"""Zero-copy torch views of a block payload: the bytes the daemon loaded become named tensors.

On the hot path (every block the daemon hands out, every layer the loader streams), so the
per-tensor (offset, nbytes, dtype, shape) rows are computed once per block and cached on it.
"""
from __future__ import annotations

import torch

from .format import BlockInfo

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _spec(block: BlockInfo) -> list:
    spec = block._view_spec
    if spec is None:
        spec = [((t.name, *t.aliases), t.offset, t.nbytes, _TORCH_DTYPES[t.dtype], tuple(t.shape))
                for t in block.tensors]
        block._view_spec = spec
    return spec


def block_tensors(block: BlockInfo, payload) -> dict:
    """{HF name (aliases too): tensor view into ``payload``}.

    ``payload`` is a 1-D uint8 torch tensor (CPU or CUDA) or any buffer holding exactly this
    block's payload (at least ``block.length`` bytes). A read-only buffer gives read-only views.
    """
    if not isinstance(payload, torch.Tensor):
        mv = memoryview(payload)
        if mv.readonly:
            # torch warns on read-only buffers; the store's payloads are never written through views.
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                payload = torch.frombuffer(mv, dtype=torch.uint8)
        else:
            payload = torch.frombuffer(mv, dtype=torch.uint8) if mv.nbytes else torch.empty(0, dtype=torch.uint8)
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"block {block.id}: payload must be a 1-D uint8 tensor, got "
                         f"{payload.dtype} of shape {tuple(payload.shape)}")
    if payload.numel() < block.length:
        raise ValueError(f"block {block.id}: payload holds {payload.numel()} bytes, the block "
                         f"needs {block.length}")
    out = {}
    for names, offset, nbytes, dtype, shape in _spec(block):
        view = payload[offset:offset + nbytes].view(dtype).view(shape)
        for name in names:
            out[name] = view
    return out
