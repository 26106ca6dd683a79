"""Zero-copy torch views of a block payload: the bytes the daemon loaded become named tensors.

On the hot path (every block the daemon hands out, every layer the loader streams), so the
per-tensor (offset, nbytes, dtype, shape) rows are computed once per block and cached on it.
"""
from __future__ import annotations

import torch

from .format import BlockInfo

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


_STORAGE = {"int8": torch.int8, "int4": torch.uint8}


def _row(t) -> tuple:
    if not t.quant:
        return (t.name, *t.aliases), t.offset, t.nbytes, TORCH_DTYPES[t.dtype], tuple(t.shape), None
    from ..quant import QuantSpec
    q = t.quant
    rows, cols = t.shape
    storage, data_shape = _STORAGE[t.dtype], (rows, cols // 2) if t.dtype == "int4" else (rows, cols)
    layout, kernel = q.get("layout", "rows"), None
    if layout != "rows":
        # The CUDA int4 kernel's tile layout, held by the host tier (quant.host_tier.TiledStore).
        inner = q["inner_k_tiles"]
        storage, data_shape = torch.int32, (rows // 8, cols // (inner * 16), 32, inner // 2)
        kernel = (inner, q["kernel_group"])
    scales = (q["scales_offset"], q["scales_nbytes"], tuple(q["scales_shape"]),
              TORCH_DTYPES[q.get("scales_dtype", "float16")])
    return ((t.name, *t.aliases), t.offset, t.nbytes, storage, data_shape,
            (QuantSpec.from_dict(q), tuple(t.shape), TORCH_DTYPES[q["dtype"]], scales, layout, kernel))


def _spec(block: BlockInfo) -> list:
    spec = block._view_spec
    if spec is None:
        spec = [_row(t) for t in block.tensors]
        block._view_spec = spec
    return spec


def block_tensors(block: BlockInfo, payload) -> dict:
    """{HF name (aliases too): tensor view into ``payload``}; a quantized weight is a
    ``deepseek_flash.quant.QuantizedTensor`` whose codes and scales are views into ``payload``.

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
    for names, offset, nbytes, dtype, shape, quant in _spec(block):
        view = payload[offset:offset + nbytes].view(dtype).view(shape)
        if quant is not None:
            from ..quant import QuantizedTensor
            qspec, logical, compute, (s_off, s_len, s_shape, s_dtype), layout, kernel = quant
            scales = payload[s_off:s_off + s_len].view(s_dtype).view(s_shape)
            view = QuantizedTensor(qspec, logical, view, scales, compute, layout, kernel)
        for name in names:
            out[name] = view
    return out


def range_tensors(block: BlockInfo, ranges: dict) -> dict:
    """``block_tensors`` for a block whose bytes lie in pieces: ``ranges`` maps a payload offset
    to a 1-D uint8 tensor holding the payload's bytes from there (a streaming slot holds one
    projection's weight and scales, ``wire.stream_units``). Every tensor whose bytes (and
    scales) lie wholly inside the pieces gets a view; the others are left out."""
    def piece(offset: int, nbytes: int):
        for start, payload in ranges.items():
            if start <= offset and offset + nbytes <= start + payload.numel():
                return payload[offset - start:offset - start + nbytes]
        return None

    out = {}
    for names, offset, nbytes, dtype, shape, quant in _spec(block):
        data = piece(offset, nbytes)
        if data is None:
            continue
        view = data.view(dtype).view(shape)
        if quant is not None:
            from ..quant import QuantizedTensor
            qspec, logical, compute, (s_off, s_len, s_shape, s_dtype), layout, kernel = quant
            scales = piece(s_off, s_len)
            if scales is None:
                continue
            view = QuantizedTensor(qspec, logical, view, scales.view(s_dtype).view(s_shape), compute,
                                   layout, kernel)
        for name in names:
            out[name] = view
    return out
