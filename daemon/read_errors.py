"""What a failed read does: the pure policy, and the host tier's recovery paths that carry it out.

``read_error_action(error, mode, retries, host_only)`` decides (no state, no IO; table-tested):

* graceful mode re-reads a block once (a flipped bit on the wire, a transient media error);
* a checksum mismatch or a data file that ends early (``StoreTruncated``) quarantines the block:
  its disk copy is bad and is never read again until unload; the device is not at fault;
* an errno that says the device is going away makes a graceful model host-only;
* graceful mode then asks the copy sources (tiers above that may hold a good copy);
* strict mode fails the model.

``Recovery`` applies those decisions to the shared state, serves blocks without the disk (copy
sources, or a typed error at once) and keeps the per-model device state that ``daemon.recovery``
(the device watch) drives.
"""
from __future__ import annotations

import errno
import logging
from dataclasses import dataclass

from ..errors import BlockChecksumError, DeviceError, FlashError, FlashIOError, StoreTruncated
from .host_state import ABSENT, RESIDENT, BlockState, HostState

log = logging.getLogger("deepseek_flash.block_manager")

# Read failures that say the device (or the file system on it) is going away, not one bad block:
# in graceful mode they switch the model to host-only instead of failing block after block.
DEVICE_ERRNOS = frozenset({errno.EIO, errno.ENXIO, errno.ENODEV, errno.ENOENT, errno.ESTALE,
                           errno.EROFS, errno.ENOTCONN, errno.ESHUTDOWN})
# How often graceful mode re-reads a block before it counts as failed.
GRACEFUL_RETRIES = 1


@dataclass(frozen=True)
class ReadAction:
    """What to do about one failed block read."""

    retry: bool = False          # read it from disk once more
    quarantine: bool = False     # never read this block from disk again (until unload)
    device_lost: bool = False    # the error points at the device: tell the device watch
    host_only: bool = False      # switch the model to host-only (no new disk reads)
    try_copies: bool = False     # ask the copy sources for a good copy
    fail_model: bool = False     # every later request for the model fails with this error


RETRY = ReadAction(retry=True)


def read_error_action(error: FlashError, mode: str, retries: int, host_only: bool = False) -> ReadAction:
    """The policy for one failed read of a block that has been retried ``retries`` times, of a
    model in ``mode`` ("strict" | "graceful") that is (or is not yet) ``host_only``."""
    graceful = mode == "graceful"
    if graceful and retries < GRACEFUL_RETRIES and not host_only:
        return RETRY
    corrupt = isinstance(error, (BlockChecksumError, StoreTruncated))
    device_lost = isinstance(error, FlashIOError) and getattr(error, "errno", None) in DEVICE_ERRNOS
    return ReadAction(quarantine=corrupt, device_lost=device_lost,
                      host_only=device_lost and graceful and not host_only,
                      try_copies=graceful, fail_model=not graceful)


class Recovery:
    """The recovery paths of the host tier (under the caller's ``HostState.lock`` where noted)."""

    def __init__(self, state: HostState, residency):
        self.s = state
        self.residency = residency

    def failed_read_locked(self, block: BlockState, error: FlashError, device_errors: list) -> str:
        """Apply the policy to a failed read: "retry" (the caller resubmits it), "served" (a copy
        source filled it: the block is resident) or "failed" (the block is absent again and its
        waiters must fail). Device-level errors are appended to ``device_errors``."""
        s, m = self.s, block.model
        s.counters["load_errors"] += 1
        if isinstance(error, BlockChecksumError):
            s.counters["checksum_errors"] += 1
        action = read_error_action(error, m.config.error_recovery_mode, block.retries,
                                   host_only=bool(m.host_only))
        if action.retry:
            block.retries += 1
            log.warning("retrying %s", error)
            return "retry"
        log.error("%s", error)
        if action.quarantine:
            block.quarantined = True
        if action.device_lost:
            s.counters["device_errors"] += 1
            device_errors.append((m.name, error))
        if action.host_only:
            m.host_only = f"read error: {error}"
            log.error("model %s: switching to host-only (%s)", m.name, error)
        block.error, block.retries = error, 0
        if action.try_copies and s.copy_sources and self.copy_into(block):
            return "served"
        # Whatever landed is not the block: no client may ever see those bytes.
        s.arena.view(block.offset, block.info.length)[:] = bytes(block.info.length)
        s.arena.free(block.offset)
        block.offset, block.state = -1, ABSENT
        if action.fail_model:
            m.failed = error
        return "failed"

    def serve_without_disk_locked(self, m, blocks, wanted, protect) -> None:
        """Make ``blocks`` resident without reading the disk (the model is host-only, or a block
        is quarantined): from a copy source, else a typed error naming the block. Dependencies
        that cannot be served are skipped (they are read along, not leased)."""
        for block in blocks:
            if not (m.host_only or block.quarantined) or block.state != ABSENT:
                continue
            if self.s.copy_sources:
                error = block.error
                self.residency.allocate([block], protect, prefetch=False)
                if self.copy_into(block):
                    continue
                self.residency.drop(block)
                block.error = error
            if block not in wanted:
                continue
            info = block.info
            if block.quarantined and block.error is not None:
                raise type(block.error)(f"{block.error.message} (quarantined: no other tier holds a "
                                        f"good copy)", **block.error.fields)
            raise DeviceError(f"model {m.name}: block {info.id} ({info.role}, layer {info.layer}) is not "
                              f"in the host tier and its device is unavailable ({m.host_only}); "
                              f"serving host-resident blocks only", model=m.name, block_id=info.id,
                              device=m.device.get("node", ""), reason=m.host_only)

    def copy_into(self, block: BlockState) -> bool:
        """Fill the block's arena region from a copy source; True when a verified copy landed."""
        from .._core import crc32c

        dest = self.s.arena.view(block.offset, block.info.length)
        for source in self.s.copy_sources:
            try:
                if not source(block.model.name, block.info, dest):
                    continue
            except Exception:   # a broken tier must not take the recovery path down with it
                log.exception("copy source %r failed for block %s", source, block.info.id)
                continue
            if crc32c(dest) == block.info.crc32c:
                block.state = RESIDENT
                self.s.counters["recovered_blocks"] += 1
                log.warning("model %s: block %s served from another tier's copy (%r)",
                            block.model.name, block.info.id, source)
                return True
            log.error("model %s: copy of block %s from %r failed its crc32c; not served",
                      block.model.name, block.info.id, source)
        dest[:] = bytes(len(dest))
        return False

    # --- device state (driven by daemon.recovery) ---------------------------------------------
    def set_device(self, name: str, device: dict) -> None:
        """Record the block device under a model's store (shown in its status info)."""
        with self.s.lock:
            model = self.s.models.get(name)
            if model is not None:
                model.device = dict(device)
                self.s.generation += 1

    def set_host_only(self, name: str, reason: str | None) -> bool:
        """The device under ``name`` went away (``reason``) or came back (None). Graceful models
        keep serving their host-resident blocks and fail new disk reads fast with DeviceError;
        strict models fail every request with it until the device returns. True if it changed."""
        with self.s.lock:
            m = self.s.models.get(name)
            if m is None:
                return False
            if reason is not None:
                changed = m.host_only is None
                m.host_only = reason
                if m.config.error_recovery_mode == "strict" and m.failed is None:
                    m.failed = DeviceError(f"model {name}: its device is unavailable ({reason})",
                                           model=name, device=m.device.get("node", ""), reason=reason)
                    m.failed_by_device = True
                if not changed:
                    return False
                log.error("model %s: host-only (%s)", name, reason)
            else:
                if m.host_only is None:
                    return False
                m.host_only = None
                if m.failed_by_device:
                    m.failed, m.failed_by_device = None, False
                log.warning("model %s: device back, disk reads resume", name)
            self.s.generation += 1
            return True

    def device_models(self) -> dict:
        """name -> {path, device, host_only, mode, probe} of every open model (for the recovery
        tier); ``probe``: blocks whose reads failed (not quarantined), read to see whether the
        device is back, else the model's first block."""
        with self.s.lock:
            return {m.name: {"path": m.path, "device": dict(m.device), "host_only": m.host_only,
                             "mode": m.config.error_recovery_mode,
                             "probe": [b.info.id for b in m.blocks.values()
                                       if b.error is not None and not b.quarantined][:8]
                             or [next(iter(m.blocks))] if m.blocks else []}
                    for m in self.s.models.values()}

    def degraded_reasons(self) -> list[str]:
        """Why the controller is DEGRADED (empty when it is not)."""
        with self.s.lock:
            return self.degraded_locked()

    def degraded_locked(self) -> list[str]:
        out = []
        for m in self.s.models.values():
            if m.failed is not None:
                out.append(f"model {m.name} failed: {m.failed}")
            if m.host_only is not None and not m.failed_by_device:
                out.append(f"model {m.name} host-only: {m.host_only}")
            bad = sorted(b.info.id for b in m.blocks.values() if b.quarantined)
            if bad:
                out.append(f"model {m.name}: {len(bad)} quarantined block(s) {bad[:8]}")
        return out
