"""``pack``: turn a Hugging Face safetensors checkpoint into a block store, crash-safely.

The store is built in ``OUT.tmp-<pid>`` beside OUT, every file and the directory fsynced, then
renamed into place in one step (``renameat2``: NOREPLACE for a new OUT, EXCHANGE for ``--force``),
so a kill at any moment leaves either no store or the old one at OUT -- never a half-written one.
Source shards are mmapped and streamed into the O_DIRECT ``AlignedWriter`` without Python copies;
each payload's crc32c is computed on the way and patched into its header afterwards.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import mmap
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import (
    CorruptSafetensors,
    FlashIOError,
    MissingShard,
    NoSpace,
    NotAModelDirectory,
    StoreExists,
    UnsupportedModel,
)
from ..fsutil import fsync_dir, fsync_path, write_synced
from .format import (
    BLOCK_ALIGN,
    DATA_FILE,
    METADATA_FILE,
    SAFETENSORS_DTYPES,
    BlockInfo,
    crc32c,
    encode_block_header,
    encode_metadata,
)
from .layout import TensorSpec, architecture, plan_blocks
from .readahead import read_ahead

INDEX_FILE = "model.safetensors.index.json"
# Files a loader needs beside the weights (tokenizer, generation defaults, chat template ...).
AUX_PATTERNS = re.compile(r"(config\.json|generation_config\.json|tokenizer.*|special_tokens_map\.json|"
                          r"added_tokens\.json|vocab\..*|merges\.txt|chat_template\..*|"
                          r"preprocessor_config\.json|.*\.tiktoken)")
_MAX_SAFETENSORS_HEADER = 100 << 20
_ZEROS = bytes(BLOCK_ALIGN)
_PAGE = 4096
_CHUNK = 16 << 20   # per source read and per data-file write: large enough to keep the disk busy
_DEPTH = 4          # source reads in flight or waiting to be written


@dataclass
class _Source:
    """One tensor's bytes inside an mmapped shard."""

    path: Path
    mm: mmap.mmap
    fd: int
    start: int
    nbytes: int


def read_safetensors_header(path: Path) -> tuple[dict, int, int]:
    """(tensor entries, data start, file size) of a safetensors file; CorruptSafetensors on any flaw."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptSafetensors(f"{path}: truncated ({size} bytes, no header length)",
                                         path=str(path))
            (hlen,) = struct.unpack("<Q", head)
            if hlen > _MAX_SAFETENSORS_HEADER or 8 + hlen > size:
                raise CorruptSafetensors(f"{path}: header length {hlen} does not fit the "
                                         f"{size}-byte file (truncated or not safetensors)", path=str(path))
            raw = f.read(hlen)
    except OSError as exc:
        raise CorruptSafetensors(f"{path}: cannot read: {exc.strerror}", path=str(path)) from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptSafetensors(f"{path}: header is not valid JSON ({exc})", path=str(path)) from None
    data_start = 8 + hlen
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
                raise ValueError
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CorruptSafetensors(f"{path}: malformed header entry for tensor {name!r}",
                                     path=str(path), tensor=name) from None
        if dtype not in SAFETENSORS_DTYPES:
            raise UnsupportedModel(f"{path}: tensor {name!r} has dtype {dtype}; supported: "
                                   f"{', '.join(SAFETENSORS_DTYPES)}", path=str(path), tensor=name,
                                   dtype=dtype)
        spec = TensorSpec(name, SAFETENSORS_DTYPES[dtype], tuple(shape))
        if end - begin != spec.nbytes:
            raise CorruptSafetensors(f"{path}: tensor {name!r} spans {end - begin} bytes, its "
                                     f"{dtype} shape {shape} needs {spec.nbytes}", path=str(path),
                                     tensor=name)
        if data_start + end > size:
            raise CorruptSafetensors(f"{path}: truncated: tensor {name!r} ends at byte "
                                     f"{data_start + end}, the file has {size}", path=str(path),
                                     tensor=name)
        entries[name] = (spec, data_start + begin)
    return entries, data_start, size


def _load_config(src: Path) -> dict:
    if not src.is_dir():
        raise NotAModelDirectory(f"{src}: not a directory (expected a Hugging Face model directory)",
                                 path=str(src))
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise NotAModelDirectory(f"{src}: no config.json (not a Hugging Face model directory)",
                                 path=str(src))
    try:
        config = json.loads(cfg_path.read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise NotAModelDirectory(f"{cfg_path}: not valid JSON ({exc})", path=str(cfg_path)) from None
    return config


def _shard_plan(src: Path) -> dict[Path, set | None]:
    """shard path -> the names the index assigns to it (None: every tensor in the shard)."""
    index = src / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise ValueError("weight_map is not an object")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise CorruptSafetensors(f"{index}: not a valid safetensors index ({exc})",
                                     path=str(index)) from None
        shards: dict[Path, set] = {}
        for name, shard in weight_map.items():
            shards.setdefault(src / shard, set()).add(name)
        for shard in shards:
            if not shard.is_file():
                raise MissingShard(f"{shard}: shard listed in {index} is missing", path=str(shard),
                                   index=str(index))
        return dict(shards)
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        other = sorted(p.name for p in src.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" (found {', '.join(other)}: convert to safetensors first)" if other else ""
        raise NotAModelDirectory(f"{src}: no *.safetensors weights{hint}", path=str(src))
    return {s: None for s in shards}


class _Shards:
    """Open, validated, mmapped shards and the tensor catalog across them."""

    def __init__(self, src: Path):
        self.specs: dict[str, TensorSpec] = {}
        self.sources: dict[str, _Source] = {}
        self._maps: list[tuple[int, mmap.mmap]] = []
        self._direct_fd: dict[Path, int] = {}
        try:
            for shard, wanted in _shard_plan(src).items():
                entries, _start, size = read_safetensors_header(shard)
                if wanted is not None:
                    missing = sorted(wanted - entries.keys())
                    if missing:
                        raise CorruptSafetensors(f"{shard}: the index places tensor {missing[0]!r} "
                                                 f"here but the shard does not hold it",
                                                 path=str(shard), tensor=missing[0])
                fd = os.open(shard, os.O_RDONLY)
                mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
                self._maps.append((fd, mm))
                try:
                    self._direct_fd[shard] = os.open(shard, os.O_RDONLY | os.O_DIRECT)
                except OSError:
                    # tmpfs and some FUSE file systems refuse O_DIRECT; buffered reads still work.
                    self._direct_fd[shard] = os.dup(fd)
                for name, (spec, start) in entries.items():
                    if wanted is not None and name not in wanted:
                        continue
                    if name in self.specs:
                        raise CorruptSafetensors(f"{shard}: tensor {name!r} also appears in "
                                                 f"{self.sources[name].path}", path=str(shard),
                                                 tensor=name)
                    self.specs[name] = spec
                    self.sources[name] = _Source(shard, mm, fd, start, spec.nbytes)
        except BaseException:
            self.close()
            raise

    def identical(self, a: str, b: str) -> bool:
        import numpy as np
        if self.specs[a] != TensorSpec(a, self.specs[b].dtype, self.specs[b].shape):
            return False
        sa, sb = self.sources[a], self.sources[b]
        return bool(np.array_equal(np.frombuffer(sa.mm, np.uint8, sa.nbytes, sa.start),
                                   np.frombuffer(sb.mm, np.uint8, sb.nbytes, sb.start)))

    def stream(self, blocks: list[BlockInfo], chunk: int = _CHUNK):
        """Yield (block index, tensor name, memoryview) pieces of every tensor, in layout order.

        A reader thread keeps O_DIRECT reads of the next pieces in flight while the caller
        checksums and writes: buffered reads through the page cache cost as much CPU as the
        disk time on virtualized disks, and would evict the caller's page cache for nothing.
        """
        def fill(take, give):
            for i, block in enumerate(blocks):
                for t in block.tensors:
                    src = self.sources[t.name]
                    fd = self._direct_fd[src.path]
                    pos, end = src.start, src.start + src.nbytes
                    while pos < end:
                        buf = take()
                        if buf is None:
                            return
                        base = pos - pos % _PAGE
                        want = min(end - base, chunk)
                        length = want + (-want % _PAGE)
                        with memoryview(buf) as whole, whole[:length] as dest:
                            n = os.preadv(fd, [dest], base)
                        if n < min(length, end - base):
                            raise CorruptSafetensors(f"{src.path}: short read at byte {base} "
                                                     f"(file changed while packing?)",
                                                     path=str(src.path))
                        give(buf, (i, t.name, buf, pos - base, min(want, end - base) - (pos - base)))
                        pos = base + want
                give(None, (i, None, None, 0, 0))

        buffers = [mmap.mmap(-1, chunk + 2 * _PAGE) for _ in range(_DEPTH)]
        # closing(): the reader thread is joined however the caller leaves this generator.
        with contextlib.closing(read_ahead(buffers, fill, "pack-reader")) as items:
            for i, name, buf, lo, n in items:
                if buf is None:
                    yield i, None, None
                    continue
                with memoryview(buf) as whole, whole[lo:lo + n] as piece:
                    yield i, name, piece

    def close(self) -> None:
        for fd, mm in self._maps:
            if mm is not None:
                mm.close()
            os.close(fd)
        for fd in self._direct_fd.values():
            os.close(fd)
        self._maps.clear()
        self._direct_fd.clear()


# --- atomic directory replacement -------------------------------------------------------------
_RENAME_NOREPLACE, _RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(2); False where the C library or file system lacks it (the caller falls back)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _is_store_or_empty(path: Path) -> bool:
    if not path.is_dir():
        return False
    names = {p.name for p in path.iterdir()}
    return not names or METADATA_FILE in names or DATA_FILE in names


def _remove_stale_temps(out: Path) -> None:
    """Delete ``OUT.tmp-<pid>`` left by packs that were killed (their pid no longer runs)."""
    for tmp in out.parent.glob(f"{out.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(tmp, ignore_errors=True)


# --- the packer -------------------------------------------------------------------------------
def _write_blocks(shards: _Shards, blocks: list[BlockInfo], data_path: Path, progress,
                  quant_device="cpu") -> None:
    from .. import _core
    from ..quant.codec import quantized_bytes

    writer = _core.AlignedWriter(str(data_path), buffer_size=_CHUNK)
    headers = []
    try:
        pieces = shards.stream(blocks)
        for block in blocks:
            block.file = DATA_FILE
            block.header_offset = writer.tell()
            header = encode_block_header(block, len(blocks))
            # Header bytes go in after the payload's crc is known; reserve its region now.
            writer.write(bytes(len(header)))
            block.header_size = len(header)
            block.offset = writer.tell()
            crc, pos = 0, 0
            infos = {t.name: t for t in block.tensors}
            gathered: dict[str, bytearray] = {}
            for _i, name, piece in pieces:
                if name is None:
                    break
                t = infos[name]
                if t.quant:
                    # Quantized weights are whole-tensor work: gather the source, then write codes
                    # and scales (each at its own 256-aligned offset).
                    source = gathered.setdefault(name, bytearray())
                    source += piece
                    if len(source) < shards.specs[name].nbytes:
                        continue
                    del gathered[name]
                    parts = zip((t.offset, t.quant["scales_offset"]),
                                quantized_bytes(t, source, quant_device))
                else:
                    parts = ((max(pos, t.offset), piece),)
                for offset, data in parts:
                    if pos < offset:
                        pad = _ZEROS[:offset - pos]
                        writer.write(pad)
                        crc = crc32c(pad, crc)
                        pos = offset
                    crc = crc32c(data, crc)
                    writer.write(data)
                    pos += len(data)
            if pos < block.length:   # a trailing zero-size tensor still owns its aligned offset
                pad = _ZEROS[:block.length - pos]
                writer.write(pad)
                crc = crc32c(pad, crc)
            block.crc32c = crc
            writer.pad_to(BLOCK_ALIGN)
            headers.append((block.header_offset, encode_block_header(block, len(blocks))))
            if progress is not None:
                progress(block.length)
        pieces.close()
    finally:
        writer.close(fsync=False)
    fd = os.open(data_path, os.O_WRONLY)
    try:
        for offset, header in headers:
            os.pwrite(fd, header, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def model_summary(config: dict, arch: str, blocks: list[BlockInfo]) -> dict:
    """The metadata's ``model`` map: derived from config.json and the blocks only, so ``repair``
    rebuilds it byte for byte."""
    return {"architecture": arch, "num_layers": int(config.get("num_hidden_layers", 0)),
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
            "total_bytes": sum(b.length for b in blocks)}


def pack(src, out, *, force: bool = False, progress=None, quant=None, quant_device=None) -> Path:
    """Pack the HF model directory ``src`` into the block store ``out``; returns ``out``.

    ``progress(nbytes)`` is called after each block. ``quant`` (a ``deepseek_flash.quant.QuantSpec``)
    quantizes the linear weights of attention and MLP blocks (docs/format.md, "Quantized tensors");
    the scale search runs on ``quant_device`` (default: the first CUDA device when there is one,
    else the CPU). Raises NotAModelDirectory, MissingShard, CorruptSafetensors, UnsupportedModel,
    StoreExists, NoSpace; on any failure nothing is left beside OUT and an existing OUT is
    untouched.
    """
    src, out = Path(src).absolute(), Path(out).absolute()
    if quant is not None and quant_device is None:
        import torch
        quant_device = "cuda" if torch.cuda.is_available() else "cpu"
    config = _load_config(src)
    arch = architecture(config, src / "config.json")
    if out.exists() or out.is_symlink():
        # Name the refusal --force would give too, so the first message is the last one.
        if not _is_store_or_empty(out):
            raise StoreExists(f"{out}: exists and is not a deepseek-flash store; pack never replaces it "
                              f"(not even with --force): choose another OUT or move it away", path=str(out))
        if not force:
            raise StoreExists(f"{out}: already exists (use --force to replace it)", path=str(out))
    check_output_parent(out)
    _remove_stale_temps(out)
    shards = _Shards(src)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    try:
        blocks = plan_blocks(config, shards.specs, shards.identical, str(src), quant=quant)
        tmp.mkdir()
        _write_blocks(shards, blocks, tmp / DATA_FILE, progress, quant_device)
        model = model_summary(config, arch, blocks)
        write_synced(tmp / METADATA_FILE, encode_metadata(blocks, model))
        for aux in sorted(src.iterdir()):
            if aux.is_file() and AUX_PATTERNS.fullmatch(aux.name):
                shutil.copyfile(aux, tmp / aux.name)
                fsync_path(tmp / aux.name)
        fsync_dir(tmp)
        _install(tmp, out, force)
    except (OSError, FlashIOError) as exc:
        if getattr(exc, "errno", None) == errno.ENOSPC:
            raise NoSpace(f"{out}: no space left on the device while packing (needs about "
                          f"{sum(s.nbytes for s in shards.specs.values()) / 2**30:.2f} GiB); nothing "
                          f"was written to {out}", path=str(out)) from None
        raise
    finally:
        shards.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_output_parent(out: Path) -> None:
    """FlashIOError (ENOENT/ENOTDIR, naming it) when the directory a new store goes in is missing."""
    if not out.parent.is_dir():
        code = errno.ENOTDIR if out.parent.exists() else errno.ENOENT
        raise FlashIOError(f"{out.parent}: the output's parent directory "
                           f"{'is not a directory' if code == errno.ENOTDIR else 'does not exist'} "
                           f"(create it first: mkdir -p {out.parent})", errno=code, path=str(out.parent),
                           offset=-1, block_id=-1)


def _install(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished ``tmp`` to ``out`` in one rename; with force, swap and delete the old store."""
    if out.exists() or out.is_symlink():
        if not force:
            raise StoreExists(f"{out}: appeared while packing (use --force to replace it)", path=str(out))
        if not _renameat2(tmp, out, _RENAME_EXCHANGE):
            # No atomic exchange here: a kill between these two renames leaves the old store at
            # OUT.old-<pid>, complete, for the operator to move back.
            old = out.parent / f"{out.name}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(tmp, out)
            tmp = old
        fsync_dir(out.parent)
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp)
        else:
            tmp.unlink()
        return
    if not _renameat2(tmp, out, _RENAME_NOREPLACE):
        os.rename(tmp, out)
    fsync_dir(out.parent)
