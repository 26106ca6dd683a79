"""Type stub of the C++ data plane ``deepseek_flash._core`` (ext/): crc32c, AlignedWriter,
HostArena, IOEngine. Failures raise deepseek_flash.errors classes (FlashIOError, BlockChecksumError,
ArenaError, ArenaFull); bad arguments raise InvalidArgument (errno EINVAL, also a ValueError) and
calls after close() raise ClosedError (errno EBADF, path); nothing aborts the process."""

from collections.abc import Buffer
from types import TracebackType
from typing import Any

def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of `data`, continuing from `value` (0 to start); SSE4.2 when present.
    crc32c(b, crc32c(a)) == crc32c(a + b). The GIL is released for buffers >= 256 KiB."""

def crc32c_sw(data: Buffer, value: int = 0) -> int:
    """The same with the portable slicing-by-8 table (the fallback; tested against crc32c)."""

def hw_crc32c() -> bool:
    """True when crc32c uses the SSE4.2 instruction."""

fault_injection: bool
"""True in a test build (DEEPSEEK_FLASH_FAULT_INJECTION=1 when building): only then does IOEngine
have inject_fault/clear_faults."""

class AlignedWriter:
    """Sequential writer: O_DIRECT in large aligned chunks written by a background thread (double
    buffering), buffered where O_DIRECT is refused. File length after close = bytes written."""

    direct: bool
    """True when O_DIRECT is in use."""
    closed: bool
    path: str

    def __init__(self, path: str, direct: bool = True, buffer_size: int = 8 << 20) -> None:
        """Create or truncate `path`; each disk write is `buffer_size` (>= 1 MiB, 4 KiB multiple).
        Raises FlashIOError (errno, path) when the file cannot be created."""
    def write(self, data: Buffer) -> int:
        """Append `data` (GIL released); return the file offset at which it starts. A write error
        of the background thread raises FlashIOError here or at close()."""
    def pad_to(self, alignment: int = 4096) -> int:
        """Zero-fill to the next multiple of `alignment`; return the new offset."""
    def tell(self) -> int:
        """Bytes written so far."""
    def close(self, fsync: bool = True) -> None:
        """Flush, cut the file to the exact length, fsync (unless fsync=False), close. Idempotent."""
    def __enter__(self) -> AlignedWriter: ...
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Close; fsync only when the block raised nothing."""

class HostArena:
    """memfd shared memory mapped MAP_SHARED, with a best-fit coalescing allocator of 4 KiB-aligned
    regions. Buffer protocol over the whole arena: numpy.frombuffer(arena, numpy.uint8)."""

    fd: int
    """The memfd (close-on-exec); dup it or send it with SCM_RIGHTS; open while the arena lives."""
    size: int
    used: int
    """Bytes allocated, each allocation rounded up to 4 KiB."""
    address: int
    """Base address of the mapping, for torch.cuda.cudart().cudaHostRegister(address, size, 0)."""
    attached: bool

    def __init__(self, size: int, name: str = "deepseek-flash") -> None:
        """`size` a positive multiple of 4096. Raises ArenaError (errno) when memfd/mmap fail."""
    @staticmethod
    def attach(fd: int, size: int) -> HostArena:
        """Map an arena exported by another process (the fd is duplicated). Alloc/free raise
        ArenaError on an attached arena: the creating process owns the allocator."""
    def alloc(self, nbytes: int) -> int:
        """Offset of a new 4 KiB-aligned region of >= nbytes. Raises ArenaFull (requested,
        largest_free)."""
    def free(self, offset: int) -> None:
        """Free an allocation; free neighbours coalesce. ArenaError for an unknown offset."""
    def allocation_size(self, offset: int) -> int:
        """Bytes reserved at `offset` (0 when not an allocation)."""
    def largest_free(self) -> int: ...
    def stats(self) -> dict[str, Any]:
        """size, used, free, largest_free, free_extents, allocations, fragmentation
        (1 - largest_free / free), attached, fd."""
    def populate(self) -> str:
        """Fault all pages in now (before cudaHostRegister); returns 'madvise' or 'touch'."""
    def view(self, offset: int, length: int) -> memoryview:
        """Writable zero-copy view of [offset, offset + length); keeps the arena alive."""
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...

class ReadRequest:
    """File bytes [offset, offset + length) of `path` into dest[dest_offset:]."""

    path: str
    offset: int
    length: int
    dest: Buffer
    dest_offset: int
    block_id: int
    expected_crc: int | None

    def __init__(self, path: str, offset: int, length: int, dest: Buffer, dest_offset: int = 0,
                 block_id: int = -1, expected_crc: int | None = None) -> None:
        """`dest`: writable contiguous buffer (bytearray, numpy array, memoryview, HostArena)."""

class Completion:
    """The outcome of one ReadRequest."""

    batch: int
    index: int
    """Position of the request in its submitted list."""
    block_id: int
    status: int
    """0, or -errno: -EIO with eof=True when the file ended early, -ECANCELED after cancel()."""
    bytes: int
    crc_checked: bool
    crc_ok: bool
    """False only when expected_crc was given and the landed bytes differ."""
    crc: int | None
    expected_crc: int
    eof: bool
    path: str
    offset: int
    length: int
    error_offset: int
    """File offset of the failed read (-1 when none)."""
    ok: bool
    """status == 0 and crc_ok."""

    def raise_if_failed(self) -> None:
        """Raise FlashIOError (errno, path, offset, block_id; eof=True for a short file) or
        BlockChecksumError (block_id, path, expected, actual); no-op when ok."""
    def error(self, block_id: int | None = None) -> Exception | None:
        """The exception raise_if_failed() would raise, not raised; None when ok. `block_id` names
        the block in it where the request's block_id was a routing token."""

class IOEngine:
    """Batched reads: io_uring through raw syscalls (one ring thread) or a pool of preadv threads;
    O_DIRECT where offset and destination are 4 KiB aligned (unaligned tail via a bounce page,
    misaligned head through the page cache); queue_depth reads in flight of up to request_size;
    short reads continued; files opened once per path (reopened when the path's inode changes)."""

    backend: str
    """'io_uring' or 'threads'."""
    fallback_reason: str
    queue_depth: int
    request_size: int
    direct: bool
    closed: bool

    def __init__(self, backend: str = "auto", queue_depth: int = 32, request_size: int = 1 << 20,
                 direct: bool = True) -> None:
        """backend 'auto' falls back to threads when io_uring_setup fails (ENOSYS, EPERM);
        'io_uring' raises FlashIOError then. request_size: a multiple of 4096."""
    def submit(self, requests: list[ReadRequest]) -> int:
        """Queue the requests as one batch; return its id. Per-extent failures arrive as
        completions, not exceptions."""
    def wait(self, batch: int, timeout: float | None = None) -> list[Completion]:
        """Block (GIL released) until the batch is complete; its completions not yet returned by
        poll(), in request order. TimeoutError leaves the batch pending; InvalidArgument for an
        unknown or already collected batch."""
    def poll(self) -> list[Completion]:
        """Completions finished since the last call, any batch, without blocking."""
    def cancel(self, batch: int) -> int:
        """Cancel the batch's extents not yet fully issued (-ECANCELED); return how many."""
    @property
    def shape(self) -> tuple[int, int]:
        """(depth, request_size) of the reads issued now (``set_shape``)."""
    def set_shape(self, depth: int, request_size: int) -> None:
        """From now on at most ``depth`` reads in flight (1..queue_depth) of at most
        ``request_size`` bytes (a positive multiple of 4096, <= 1 GiB); reads in flight finish as
        issued. InvalidArgument otherwise."""
    def read(self, path: str, offset: int, length: int, dest: Buffer, dest_offset: int = 0,
             block_id: int = -1, expected_crc: int | None = None) -> None:
        """Synchronous read (GIL released). Raises FlashIOError or BlockChecksumError."""
    def inject_fault(self, block_id: int, errno: int = 0, short: int = 0, count: int = 1) -> None:
        """Test builds only (``fault_injection``): the next `count` reads of `block_id` fail with
        `errno` or return at most `short` bytes (the engine continues the read)."""
    def clear_faults(self) -> None: ...
    def forget_files(self) -> None:
        """Close cached descriptors; paths reopen on next use."""
    def stats(self) -> dict[str, Any]:
        """backend, queue_depth, request_size, shape_depth, shape_request_size, peak_in_flight
        (most reads in flight at once since start or the last set_shape), direct, bytes_read,
        extents_done, extents_failed, reads_issued, short_reads, open_files."""
    def close(self) -> None:
        """Finish reads in flight, cancel queued extents, stop threads. Idempotent."""
    def __enter__(self) -> IOEngine: ...
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...
