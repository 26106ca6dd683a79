"""Typed errors with stable numeric codes.

Every failure the project reports -- from the C++ core, the store, the daemon or the wire -- is one
of these classes. The numeric ``code`` travels on the socket and the client re-raises the same class
(``error_from_code``), so a caller catches ``BlockChecksumError`` whether the controller runs in its
own process or in the daemon. Codes are part of the wire contract: never renumber, only add.
"""
from __future__ import annotations


class FlashError(Exception):
    """Base of every deepseek-flash error. ``code`` is stable across releases."""

    code = 1

    def __init__(self, message: str, **fields):
        super().__init__(message)
        self.message = message
        self.fields = fields
        for key, value in fields.items():
            setattr(self, key, value)

    def to_wire(self) -> dict:
        return {"code": self.code, "message": self.message, "fields": _plain(self.fields)}


def _plain(fields: dict) -> dict:
    return {k: v if isinstance(v, (str, int, float, bool, type(None), list, tuple)) else str(v)
            for k, v in fields.items()}


# --- store (1xx) -------------------------------------------------------------------------------
class StoreError(FlashError):
    code = 100


class NotAModelDirectory(StoreError):
    code = 101


class MissingShard(StoreError):
    code = 102


class CorruptSafetensors(StoreError):
    code = 103


class UnsupportedModel(StoreError):
    """An architecture, dtype or tensor name the packer does not know."""

    code = 104


class StoreExists(StoreError):
    code = 105


class MetadataError(StoreError):
    """flash_metadata.bin missing, truncated, of wrong magic or of a newer format version."""

    code = 106


class BlockChecksumError(StoreError):
    """A block's bytes do not match its crc32c (``block_id`` names it)."""

    code = 107


class NotAStore(StoreError):
    code = 108


class StoreInUse(StoreError):
    code = 109


# --- native IO (2xx) ---------------------------------------------------------------------------
class FlashIOError(FlashError):
    """An IO failure with ``errno``, ``path``, ``offset`` and ``block_id`` (-1 when none)."""

    code = 200


class ClosedError(FlashIOError):
    """A call on a native object after ``close()`` (``errno`` EBADF; ``path`` its file, if any)."""

    code = 201


class InvalidArgument(FlashError, ValueError):
    """A bad argument to a native call (``errno`` EINVAL; ``path`` the file concerned, if any).
    Also a ValueError, as Python's own bad arguments are."""

    code = 202


class ArenaError(FlashError):
    code = 210


class ArenaFull(ArenaError):
    code = 211


class DeviceError(FlashError):
    """A device (GPU, NVMe) missing, failed or not readable."""

    code = 220


# --- protocol (3xx) ----------------------------------------------------------------------------
class ProtocolError(FlashError):
    code = 300


class MalformedFrame(ProtocolError):
    code = 301


class FrameTooLarge(ProtocolError):
    code = 302


class VersionMismatch(ProtocolError):
    code = 303


class UnknownOperation(ProtocolError):
    code = 304


class PermissionDenied(ProtocolError):
    code = 310


class LimitExceeded(ProtocolError):
    """A per-client limit (outstanding requests, leases) was hit."""

    code = 320


# --- controller (4xx) --------------------------------------------------------------------------
class UnknownModel(FlashError):
    code = 400


class UnknownBlock(FlashError):
    code = 401


class BudgetTooSmall(FlashError):
    """A memory budget cannot hold what must be resident; the message names the sizes."""

    code = 402


class OutOfMemory(FlashError):
    code = 403


class LeaseError(FlashError):
    code = 404


class UnknownClient(FlashError):
    code = 405



class NotResident(FlashError):
    """``acquire(wait=False)`` found blocks not yet in the host tier (their loads were started)."""

    code = 406

# --- configuration (5xx) -----------------------------------------------------------------------
class ConfigError(FlashError):
    """An invalid configuration value: ``key``, ``value`` and ``allowed`` name it."""

    code = 500


class ImportManifestCorrupt(FlashError):
    """The daemon's learned list of the files a client's imports open (its state directory,
    ``daemon/imports_ahead.py``) is unreadable or malformed: ``path`` and ``reason`` name it. The
    daemon logs it and starts without reading ahead; the next client's report rewrites it."""

    code = 501


# --- availability (6xx) ------------------------------------------------------------------------
class DaemonNotRunning(FlashError):
    code = 600


class DaemonAlreadyRunning(FlashError):
    code = 601


class ShuttingDown(FlashError):
    code = 602


# --- store, appended (1xx) ---------------------------------------------------------------------
class NoSpace(StoreError):
    """The file system filled up while writing a store (``path`` names it); nothing was left behind."""

    code = 110


class RepairIncomplete(StoreError):
    """``repair`` could not recover every block; ``bad_blocks`` lists them."""

    code = 111


class StoreTruncated(StoreError):
    """A data file ends before a block its metadata places there (``path``, ``block_id``,
    ``offset``, ``length``): the store is corrupt, its device is not at fault."""

    code = 112


# --- KV cache (7xx) ----------------------------------------------------------------------------
class KVError(FlashError):
    """A tiered KV cache (``deepseek_flash.kv``) could not do what was asked."""

    code = 700


class KVCacheMismatch(KVError):
    """A ``TieredCache`` was given to a model (or an attention layer) it was not built for."""

    code = 701


class KVPageCorrupt(KVError):
    """A spilled KV page failed its crc32c: ``path``, ``layer``, ``page``, ``row``, ``expected``,
    ``actual`` name it."""

    code = 702


class KVSpillFailed(KVError):
    """Pages could not be written to the spill directory (``path``, ``errno``): full, missing or
    read-only. The pages stay on the host tier; the cache is still whole."""

    code = 703


class KVUnsupported(KVError):
    """A model the tiered KV cache cannot serve (sliding-window attention, missing attention
    interface); the message names what is missing."""

    code = 704


class KVCacheBypassed(KVError):
    """A ``TieredCache`` reached the model under a keyword its ``forward`` does not take
    (``cache=`` on a transformers whose keyword is ``past_key_values``, or the reverse): the model
    ran with a cache of its own and the tiered one would have stayed empty. ``keyword`` names the
    keyword given, ``expected`` the model's."""

    code = 705


# --- decode (8xx) ------------------------------------------------------------------------------
class DecodeError(FlashError):
    code = 800


class DecodeCapacityExceeded(DecodeError):
    """A generate() call needs more tokens than the static KV cache holds (``prompt``,
    ``new_tokens``, ``capacity``)."""

    code = 801


# --- several devices (9xx) ---------------------------------------------------------------------
class PlacementError(FlashError, ValueError):
    """A model cannot be placed as asked across devices or processes (base)."""

    code = 900


class DeviceMapError(PlacementError):
    """A ``device_map`` that cannot be executed: an unknown device, a layer missing, repeated or
    out of range, a budget for a device the map does not use; ``device``/``layer`` name it."""

    code = 901


class ShardError(PlacementError):
    """A model a tensor-parallel world cannot split (a dimension not divisible by the world
    size, a quantized store, a rank outside the world); ``dimension``/``world`` name it."""

    code = 902


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def error_from_code(code: int, message: str, fields: dict | None = None) -> FlashError:
    """The typed exception for a wire error (``FlashError`` itself for a code this side lacks)."""
    cls = _BY_CODE.get(code, FlashError)
    err = cls(message, **(fields or {}))
    if cls is FlashError:
        err.code = code
    return err


_BY_CODE = {cls.code: cls for cls in [FlashError, *_all_subclasses(FlashError)]}
assert len(_BY_CODE) == 1 + len(list(_all_subclasses(FlashError))), "duplicate error code"
