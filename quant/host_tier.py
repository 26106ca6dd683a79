"""An unquantized store served quantized: its linear blocks are quantized as they enter the host tier.

``quantization_scheme: int8_symmetric|int4_symmetric`` on a store packed without ``--quantize``
opens it as a ``QuantizingStore``: to everything above the read path (host tier accounting,
planner, loader, slot ring, clients) it *is* the store that ``pack --quantize`` would have written
-- the same block maps, tensor maps and lengths (``store.layout``'s offsets and ``quantized_info``)
-- so the quantized bytes are what the tiers hold, move and stream. The daemon reads a
quantizable block's source payload (crc32c-checked against the source) into a staging buffer and
``transcode`` writes the quantized payload into the block's host-arena region with the packer's
own codec (``codec.quantized_bytes``, on the CPU): byte for byte the payload of the same block in
a store packed with ``--quantize`` on the CPU. Blocks without quantized tensors (embeddings,
norms, lm_head) are the source blocks themselves and are read straight into the arena.

The block's crc32c is the source's until the first transcode, which records the quantized
payload's (the recovery path checks copies of a block against it).
"""
from __future__ import annotations

from ..fsutil import align_up
from ..store.format import TENSOR_ALIGN, BlockInfo, TensorInfo
from ..store.layout import TensorSpec, quantizable_tensor, quantized_info
from ..store.reader import Store
from .scheme import QuantSpec


def quantized_block(src: BlockInfo, spec: QuantSpec) -> BlockInfo:
    """The block ``pack --quantize`` writes for ``src`` (``src`` itself when nothing in it is
    quantized); ``file``/``offset`` stay the source's, where it is read from."""
    if not any(quantizable_tensor(src.role, t.name) for t in src.tensors):
        return src
    tensors, offset = [], 0
    for t in src.tensors:
        offset = align_up(offset, TENSOR_ALIGN)
        if quantizable_tensor(src.role, t.name):
            info = quantized_info(t.name, TensorSpec(t.name, t.dtype, tuple(t.shape)), offset, spec)
        else:
            info = TensorInfo(name=t.name, dtype=t.dtype, shape=tuple(t.shape), offset=offset,
                              nbytes=t.nbytes, aliases=list(t.aliases))
        tensors.append(info)
        offset = info.end
    return BlockInfo(id=src.id, role=src.role, layer=src.layer, file=src.file, offset=src.offset,
                     length=offset, crc32c=src.crc32c, tensors=tensors, deps=list(src.deps),
                     access_freq=src.access_freq, precision_req=src.precision_req,
                     quant=spec.to_dict(), header_offset=src.header_offset,
                     header_size=src.header_size)


class QuantizingStore(Store):
    """``source`` (an unquantized ``Store``) as the store ``pack --quantize`` would make of it."""

    quantized_at = "host_tier"

    def __init__(self, source: Store, spec: QuantSpec):
        if source.quant is not None:
            raise ValueError(f"{source.path}: already packed {QuantSpec.from_dict(source.quant).label()}")
        self.source = source
        self.spec = spec
        self._sources = {}
        blocks = []
        for b in source.blocks:
            q = quantized_block(b, spec)
            if q is not b:
                self._sources[b.id] = b
            blocks.append(q)
        super().__init__(source.path, blocks, source.model, source.config)

    def source_block(self, info: BlockInfo) -> BlockInfo | None:
        """The source block whose payload ``transcode`` turns into ``info``'s, or None when the
        two are the same bytes (read straight into place)."""
        return self._sources.get(info.id)

    def transcode(self, info: BlockInfo, source, dest) -> int:
        """Write the quantized payload of ``info`` into ``dest`` (its ``length`` bytes, any prior
        content) from ``source``, the source block's payload; returns and records its crc32c."""
        import torch

        from .._core import crc32c
        from .codec import quantized_bytes

        src = self._sources[info.id]
        out = memoryview(dest).cast("B")[:info.length]
        torch.frombuffer(out, dtype=torch.uint8).zero_()
        source = memoryview(source).cast("B")
        by_name = {t.name: t for t in src.tensors}
        for t in info.tensors:
            st = by_name[t.name]
            raw = source[st.offset:st.offset + st.nbytes]
            if t.quant:
                codes, scales = quantized_bytes(t, raw, "cpu")
                out[t.offset:t.offset + len(codes)] = codes
                at = t.quant["scales_offset"]
                out[at:at + len(scales)] = scales
            else:
                out[t.offset:t.offset + t.nbytes] = raw
        info.crc32c = crc32c(out)
        return info.crc32c

    def read_block(self, block_id: int, verify: bool = True) -> bytes:
        """The quantized payload of ``block_id`` (the source block read and transcoded)."""
        info = self.block(block_id)
        src = self._sources.get(block_id)
        if src is None:
            return self.source.read_block(block_id, verify)
        out = bytearray(info.length)
        self.transcode(info, bytearray(self.source.read_block(block_id, verify)), out)
        return bytes(out)


def serving_store(store: Store, scheme: str, granularity: str) -> Store:
    """The store as a model opened with these keys serves it: a packed store as it is (the keys
    checked by ``scheme.check_served``), an unquantized one with a scheme quantized on entering
    the host tier."""
    from .scheme import DEFAULT_GROUP_SIZE, check_served

    if scheme != "none" and store.quant is None:
        return QuantizingStore(store, QuantSpec(scheme, granularity, DEFAULT_GROUP_SIZE))
    check_served(store.quant, scheme, granularity, store.name)
    return store
