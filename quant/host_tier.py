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

import dataclasses

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


# --- int4 in the CUDA kernel's tile layout ------------------------------------------------------

TILES = "int4_cuda_tiles"


def tiled_tensor(t: TensorInfo, offset: int) -> TensorInfo | None:
    """The tensor map of ``t`` (stored int4 codes + float16 scales) held in the layout torch's CUDA
    int4 kernel takes, codes at ``offset``; None when that kernel cannot take it (not int4, not a
    bfloat16 model, a shape ``int4pack.plan`` refuses)."""
    import torch

    from . import int4pack

    q = t.quant
    if not q or t.dtype != "int4" or q.get("dtype") != "bfloat16":
        return None
    N, K = t.shape
    plan = int4pack.plan("cuda", torch.bfloat16, QuantSpec.from_dict(q), N, K)
    if isinstance(plan, str):
        return None
    inner, group = plan
    scales_offset = align_up(offset + t.nbytes, TENSOR_ALIGN)
    scales_shape = [K // group, N, 2]
    return TensorInfo(name=t.name, dtype=t.dtype, shape=tuple(t.shape), offset=offset,
                      nbytes=t.nbytes, aliases=list(t.aliases),
                      quant={**q, "layout": TILES, "inner_k_tiles": inner, "kernel_group": group,
                             "scales_dtype": "bfloat16", "scales_shape": scales_shape,
                             "scales_offset": scales_offset, "scales_nbytes": K // group * N * 4})


def tiled_block(info: BlockInfo) -> BlockInfo:
    """``info`` with its int4 tensors in the CUDA tile layout (``info`` itself when none is).

    The tiled tensors' codes come first, back to back in the block's order (each at
    ``TENSOR_ALIGN``), then the other tensors, then the tiled tensors' scales: so the codes of the
    projections one block holds in forward order (q, k, v; gate, up) form one matrix of the tile
    layout, which the decode step reads with one GEMV (``decode.fused.Merged``) through a view."""
    tiled = [tiled_tensor(t, 0) for t in info.tensors]
    if all(t is None for t in tiled):
        return info
    tensors, offset = list(info.tensors), 0
    for i, t in enumerate(tiled):              # the codes
        if t is not None:
            offset = align_up(offset, TENSOR_ALIGN)
            tensors[i] = dataclasses.replace(t, offset=offset)
            offset += t.nbytes
    for i, t in enumerate(info.tensors):       # the others
        if tiled[i] is None:
            offset = align_up(offset, TENSOR_ALIGN)
            quant = dict(t.quant) if t.quant else None
            if quant:
                quant["scales_offset"] += offset - t.offset      # codes and scales move together
            tensors[i] = dataclasses.replace(t, offset=offset, aliases=list(t.aliases), quant=quant)
            offset = tensors[i].end
    for i, t in enumerate(tiled):              # the scales of the codes
        if t is not None:
            offset = align_up(offset, TENSOR_ALIGN)
            tensors[i] = dataclasses.replace(tensors[i], quant={**t.quant, "scales_offset": offset})
            offset += t.quant["scales_nbytes"]
    return BlockInfo(id=info.id, role=info.role, layer=info.layer, file=info.file,
                     offset=info.offset, length=offset, crc32c=info.crc32c, tensors=tensors,
                     deps=list(info.deps), access_freq=info.access_freq,
                     precision_req=info.precision_req, quant=info.quant,
                     header_offset=info.header_offset, header_size=info.header_size)


def tile_payload(info: BlockInfo, base: BlockInfo, source, dest, device: str = "cpu") -> None:
    """Write ``info``'s payload (tile layout) into ``dest`` from ``source``, the payload of
    ``base`` (the same block in the stored layout): codes through ``int4pack.cuda_layout`` (run on
    ``device``: the same integer operations give the same bytes anywhere), scales through
    ``int4pack.scales_and_zeros`` in bfloat16, every other tensor copied."""
    import torch

    from . import int4pack

    out = memoryview(dest).cast("B")[:info.length]
    torch.frombuffer(out, dtype=torch.uint8).zero_()
    source = memoryview(source).cast("B")
    by_name = {t.name: t for t in base.tensors}
    for t in info.tensors:
        bt = by_name[t.name]
        if not (t.quant and t.quant.get("layout") == TILES):
            out[t.offset:t.offset + bt.end - bt.offset] = source[bt.offset:bt.end]
            continue
        N, K = t.shape
        q = bt.quant
        codes = torch.frombuffer(source[bt.offset:bt.offset + bt.nbytes], dtype=torch.uint8)
        at = q["scales_offset"]
        scales = torch.frombuffer(source[at:at + q["scales_nbytes"]], dtype=torch.float16)
        words = int4pack.cuda_layout(codes.view(N, K // 2).to(device), t.quant["inner_k_tiles"]).cpu()
        sz = int4pack.scales_and_zeros(scales.view(tuple(q["scales_shape"])), QuantSpec.from_dict(q),
                                       (N, K), t.quant["kernel_group"], torch.bfloat16)
        out[t.offset:t.offset + t.nbytes] = words.numpy().view("u1").reshape(-1).data
        at = t.quant["scales_offset"]
        out[at:at + t.quant["scales_nbytes"]] = sz.view(torch.int16).numpy().view("u1").reshape(-1).data


class TiledStore(Store):
    """``base`` (a quantized ``Store`` or a ``QuantizingStore``) with its int4 weights held in the
    host tier in the tile layout of torch's CUDA int4 kernel (``int4pack.cuda_layout``) and their
    scales as the kernel's bfloat16 (scale, zero 0) pairs: derived once per block as it enters
    the host tier, so GPU copies, streaming slots and resident views are the kernel's operands
    and nothing is derived per bind or call. Blocks grow by their scales' bytes (about 1.5 % at
    g128). ``device``: where the permutation runs (``cuda`` where there is one: about 30-50 MB/s
    per CPU thread measured on the development VM, tens of seconds for an 8B model on the CPU;
    the result is the same bytes).
    """

    def __init__(self, base: Store, device: str = "cpu"):
        self.base = base
        self.device = device
        self.source = getattr(base, "source", base)
        self.spec = getattr(base, "spec", None)
        self.quantized_at = getattr(base, "quantized_at", "pack")
        self.layout = TILES
        self._tiled = set()
        blocks = []
        for b in base.blocks:
            t = tiled_block(b)
            if t is not b:
                self._tiled.add(b.id)
            blocks.append(t)
        super().__init__(base.path, blocks, base.model, base.config)

    def source_block(self, info: BlockInfo) -> BlockInfo | None:
        """The block read from disk for ``info`` (None: ``info``'s own bytes, read into place)."""
        base_source = getattr(self.base, "source_block", None)
        src = base_source(self.base.block(info.id)) if base_source is not None else None
        if src is None and info.id in self._tiled:
            return self.base.block(info.id)
        return src

    def transcode(self, info: BlockInfo, source, dest) -> int:
        """Write ``info``'s payload into ``dest`` from the payload of its ``source_block``;
        returns and records its crc32c."""
        from .._core import crc32c

        base = self.base.block(info.id)
        base_source = getattr(self.base, "source_block", None)
        if base_source is not None and base_source(base) is not None:
            tmp = bytearray(base.length)
            self.base.transcode(base, source, tmp)
            source = tmp
        if info.id in self._tiled:
            tile_payload(info, base, source, dest, self.device)
        else:
            memoryview(dest).cast("B")[:info.length] = memoryview(source).cast("B")[:info.length]
        info.crc32c = crc32c(memoryview(dest).cast("B")[:info.length])
        return info.crc32c

    def read_block(self, block_id: int, verify: bool = True) -> bytes:
        """The payload of ``block_id`` as the host tier holds it."""
        payload = self.base.read_block(block_id, verify)
        if block_id not in self._tiled:
            return payload
        out = bytearray(self.block(block_id).length)
        tile_payload(self.block(block_id), self.base.block(block_id), payload, out, self.device)
        return bytes(out)


def serving_store(store: Store, scheme: str, granularity: str, int4_layout: str = "stored") -> Store:
    """The store as a model opened with these keys serves it: a packed store as it is (the keys
    checked by ``scheme.check_served``), an unquantized one with a scheme quantized on entering
    the host tier; int4 weights in the CUDA kernel's tile layout (``TiledStore``) when
    ``int4_layout`` is ``cuda_tiles``, or ``auto`` and this process sees a CUDA device."""
    from .scheme import DEFAULT_GROUP_SIZE, check_served

    if scheme != "none" and store.quant is None:
        store = QuantizingStore(store, QuantSpec(scheme, granularity, DEFAULT_GROUP_SIZE))
    else:
        check_served(store.quant, scheme, granularity, store.name)
    if store.quant is None or store.quant["scheme"] != "int4_symmetric" or int4_layout == "stored":
        return store
    from ..cuda import cuda_available

    cuda = cuda_available()
    if int4_layout == "auto" and not cuda:
        return store
    return TiledStore(store, "cuda" if cuda else "cpu")
