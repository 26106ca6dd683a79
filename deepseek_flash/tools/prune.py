"""``prune``: find tensors that add nothing (all-zero biases, exact duplicates) and write a copy without them.

What is found (``analyse``), per tensor, by reading every block once (crc-checked):

* ``duplicate``: the same dtype, shape and bytes as a tensor earlier in forward order (e.g. an
  ``lm_head`` equal to the embedding that was not tied);
* ``zero_bias``: a ``*.bias`` whose bytes are all zero (adding +0.0 changes nothing).

What ``--apply OUT`` does with them, in a new store (SRC is only read): a tensor is removed from its
block and its name becomes an **alias** of its twin -- a name served by the same bytes, which every
reader, ``views.block_tensors`` and the loader already resolve -- when the twin's bytes are always
there when the tensor is needed: the twin sits in the same block, or in a hot block (``embed``,
``norms``, ``final_norm``; the daemon keeps those resident). A block left with no tensors is dropped
(the untied ``lm_head`` equal to the embedding: the embedding block serves ``lm_head.weight``, as
``pack`` itself does for checkpoints it reads). A zero bias aliases another all-zero tensor of its
shape in the same block (Qwen2's k and v biases share a shape). Everything else is listed with the
bytes it would save and ``action: keep`` and the reason: an alias into another layer's block would
make a streamed layer read bytes that may have been evicted, and format v1 has no "zeros" marker
that would let a reader materialise a structural bias (Qwen2's q/k/v biases) from nothing.

Blocks keep forward order and get ids 0..M-1 again; ``deps`` and ``access_freq`` follow them.
The copy is built in ``OUT.tmp-<pid>``, fsynced, and renamed to OUT (which must not exist).
"""
from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import StoreExists
from ..fsutil import align_up, fsync_dir, fsync_path, write_synced
from ..store.format import (
    BLOCK_ALIGN,
    DATA_FILE,
    METADATA_FILE,
    TENSOR_ALIGN,
    BlockInfo,
    TensorInfo,
    crc32c,
    encode_block_header,
    encode_metadata,
)
from ..store.pack import AUX_PATTERNS, check_output_parent
from ..store.reader import Store


@dataclass
class Finding:
    kind: str          # "duplicate" | "zero_bias"
    name: str
    block: int
    role: str
    layer: int
    dtype: str
    shape: list
    nbytes: int
    twin: str | None   # the tensor whose bytes it equals (None: a zero bias with no twin)
    twin_block: int | None
    action: str        # "alias" | "drop_block" | "keep"
    reason: str
    saved: int         # payload bytes --apply removes (0 for "keep")


@dataclass
class PruneReport:
    store: str
    blocks: int
    payload_bytes: int
    findings: list = field(default_factory=list)

    @property
    def listed_bytes(self) -> int:
        return sum(f.nbytes for f in self.findings)

    @property
    def saved_bytes(self) -> int:
        return sum(f.saved for f in self.findings)

    def to_dict(self) -> dict:
        from dataclasses import asdict
        return {"store": self.store, "blocks": self.blocks, "payload_bytes": self.payload_bytes,
                "listed_bytes": self.listed_bytes, "saved_bytes": self.saved_bytes,
                "findings": [asdict(f) for f in self.findings]}


def _tensor_bytes(payload: bytes, t: TensorInfo) -> bytes:
    """The bytes of ``t``: for a quantized weight its codes, the zero gap and its scales."""
    return payload[t.offset:t.end]


def _moved(t: TensorInfo, offset: int, aliases: list) -> TensorInfo:
    """``t`` placed at ``offset`` (its scales move with it)."""
    quant = None
    if t.quant:
        quant = {**t.quant, "scales_offset": offset + t.quant["scales_offset"] - t.offset}
    return TensorInfo(t.name, t.dtype, tuple(t.shape), offset, t.nbytes, aliases, quant)


def _aliasable(block: BlockInfo, twin_block: BlockInfo) -> tuple[bool, str]:
    if twin_block.id == block.id:
        return True, "its twin is in the same block"
    if twin_block.hot:
        return True, f"its twin is in hot block {twin_block.id} ({twin_block.role}), always resident"
    return False, (f"its twin is in block {twin_block.id} ({twin_block.role}, layer "
                   f"{twin_block.layer}), which is not kept resident: a streamed layer would read "
                   f"evicted bytes through the alias")


def analyse(store: Store, progress=None) -> PruneReport:
    """Every zero bias and duplicate tensor of ``store``, with what ``apply`` will do about it."""
    report = PruneReport(str(store.path), len(store.blocks), store.total_bytes)
    first: dict[tuple, tuple[BlockInfo, TensorInfo]] = {}   # (dtype, shape, digest) -> first holder
    by_id = {b.id: b for b in store.blocks}
    for block in sorted(store.blocks, key=lambda b: b.id):
        payload = store.read_block(block.id)
        for t in block.tensors:
            data = _tensor_bytes(payload, t)
            key = (t.dtype, tuple(t.shape), hashlib.blake2b(data, digest_size=32).digest())
            zero = t.name.endswith(".bias") and not any(data)
            held = first.get(key)
            if held is None:
                first[key] = (block, t)
                if zero:
                    report.findings.append(Finding(
                        "zero_bias", t.name, block.id, block.role, block.layer, t.dtype,
                        list(t.shape), t.nbytes, None, None, "keep",
                        "no all-zero tensor of this shape in the same or a hot block to alias, and "
                        "format v1 cannot store a bias as 'zeros' (it is structural in the model)", 0))
                continue
            twin_block, twin = held
            twin_payload = payload if twin_block.id == block.id else store.read_block(twin_block.id)
            if _tensor_bytes(twin_payload, twin) != data:   # a digest match is not proof; bytes are
                continue
            ok, why = _aliasable(block, by_id[twin_block.id])
            report.findings.append(Finding(
                "zero_bias" if zero else "duplicate", t.name, block.id, block.role, block.layer,
                t.dtype, list(t.shape), t.nbytes, twin.name, twin_block.id,
                "alias" if ok else "keep", why, 0))
        if progress is not None:
            progress(block.length)
    _plan_savings(store, report)
    return report


def _plan_savings(store: Store, report: PruneReport) -> None:
    """Fill ``saved`` (payload bytes removed) and mark blocks left empty as dropped."""
    aliased = {f.name for f in report.findings if f.action == "alias"}
    for block in store.blocks:
        kept = [t for t in block.tensors if t.name not in aliased]
        new_length = _layout(kept)[1]
        removed = [f for f in report.findings if f.block == block.id and f.action == "alias"]
        if not removed:
            continue
        if not kept:
            for f in removed:
                f.action, f.reason = "drop_block", f"{f.reason}; block {block.id} is left empty and dropped"
        # Attribute the block's shrink to its removed tensors, the last one taking the remainder.
        left = block.length - new_length
        for f in removed[:-1]:
            f.saved = min(f.nbytes, left)
            left -= f.saved
        removed[-1].saved = left


def _layout(tensors: list) -> tuple[list, int]:
    """(new offsets, payload length) of ``tensors`` packed at TENSOR_ALIGN, as pack lays them out."""
    offsets, pos = [], 0
    for t in tensors:
        pos = align_up(pos, TENSOR_ALIGN)
        offsets.append(pos)
        pos += t.end - t.offset
    return offsets, pos


def apply(store: Store, report: PruneReport, out, progress=None) -> Path:
    """Write the pruned copy of ``store`` to ``out`` (new); SRC is only read."""
    from .. import _core

    out = Path(out).absolute()
    if out.exists() or out.is_symlink():
        raise StoreExists(f"{out}: already exists; prune writes a new store", path=str(out))
    check_output_parent(out)
    if out.resolve() == store.path.resolve():
        raise StoreExists(f"{out}: is the source store; prune never modifies it", path=str(out))
    alias = {f.name: f for f in report.findings if f.action in ("alias", "drop_block")}
    # New blocks, forward order, ids renumbered; aliases land on their twins.
    kept_blocks = [b for b in sorted(store.blocks, key=lambda b: b.id)
                   if any(t.name not in alias for t in b.tensors)]
    new_id = {b.id: i for i, b in enumerate(kept_blocks)}
    extra_aliases: dict[str, list] = {}
    for f in alias.values():
        old_t = store.find(f.name)[1]
        extra_aliases.setdefault(f.twin, []).extend([f.name, *old_t.aliases])
    plan = []
    for b in kept_blocks:
        kept = [t for t in b.tensors if t.name not in alias]
        offsets, length = _layout(kept)
        tensors = [_moved(t, off, [*t.aliases, *extra_aliases.get(t.name, [])])
                   for t, off in zip(kept, offsets)]
        nb = BlockInfo(id=new_id[b.id], role=b.role, layer=b.layer, file=DATA_FILE, offset=0,
                       length=length, crc32c=0, tensors=tensors,
                       deps=[new_id[d] for d in b.deps if d in new_id],
                       access_freq=b.access_freq, precision_req=b.precision_req, quant=b.quant)
        plan.append((b, kept, nb))
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        with _core.AlignedWriter(str(tmp / DATA_FILE)) as writer:
            for old, kept, nb in plan:
                src = store.read_block(old.id)
                payload = bytearray(nb.length)
                for t_old, t_new in zip(kept, nb.tensors):
                    payload[t_new.offset:t_new.end] = _tensor_bytes(src, t_old)
                nb.crc32c = crc32c(payload)
                nb.header_offset = writer.tell()
                header = encode_block_header(nb, len(plan))
                nb.header_size = len(header)
                writer.write(header)
                nb.offset = writer.tell()
                writer.write(payload)
                writer.pad_to(BLOCK_ALIGN)
                if progress is not None:
                    progress(old.length)
        blocks = [nb for _o, _k, nb in plan]
        model = dict(store.model, total_bytes=sum(b.length for b in blocks))
        write_synced(tmp / METADATA_FILE, encode_metadata(blocks, model))
        for p in store.path.iterdir():
            if p.is_file() and AUX_PATTERNS.fullmatch(p.name):
                shutil.copyfile(p, tmp / p.name)
                fsync_path(tmp / p.name)
        fsync_dir(tmp)
        if out.exists():
            raise StoreExists(f"{out}: appeared while pruning; left untouched", path=str(out))
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
