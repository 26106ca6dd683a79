"""Recovery: which block device each model's store lives on, and what to do when it goes away.

At model open, ``DeviceWatch`` maps the store path to its block device (``st_dev`` ->
``/sys/dev/block/MAJ:MIN``, a partition -> its disk) and records model, serial and firmware in the
model's status info. It then follows the device two ways:

* udev events (``pyudev``, imported lazily; tests inject any object with ``poll(timeout)``
  returning events with ``action`` and ``device_number`` or ``sys_name``): ``remove``, or a
  ``change`` that leaves the disk read-only, switches every model on that disk to host-only
  (``BlockManager.set_host_only``); ``add`` or a writable ``change`` switches them back;
* read errors: the block manager reports reads that point at the device (EIO, a vanished or
  vanished file) and switches a graceful model to host-only itself; the watch then probes one
  block of the store every ``probe_interval`` seconds and switches it back once it reads and
  verifies again (a device without udev, a store replaced under the daemon). The probe reads with
  O_DIRECT through the native IO engine: the page cache may still hold the bytes of a device that
  is gone, and a buffered read would call it healthy.

Host-only means: blocks already in the host arena keep being served, new disk reads fail at once
with ``DeviceError``; strict models fail every request until the device returns.
"""
from __future__ import annotations

import logging
import mmap
import os
import select
import threading
from pathlib import Path

log = logging.getLogger("deepseek_flash.recovery")

PROBE_INTERVAL = 1.0


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def block_device_of(path, sysfs: str | os.PathLike = "/sys") -> dict:
    """The disk under ``path``: ``{devnum, disk, node, model, serial, firmware, ro}``; for a file
    system without a block device (tmpfs, overlay, NFS) ``{devnum, disk: ""}`` and why."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    devnum = f"{major}:{minor}"
    sysfs = Path(sysfs)
    link = sysfs / "dev" / "block" / devnum
    if major == 0 or not link.exists():
        return {"devnum": devnum, "disk": "", "node": "",
                "note": "no block device (virtual or network file system)"}
    node_dir = link.resolve()
    partition = node_dir.name if (node_dir / "partition").exists() else ""
    disk_dir = node_dir.parent if partition else node_dir
    disk_devnum = _read(disk_dir / "dev") or devnum
    dev = disk_dir / "device"
    model = _read(dev / "model")
    vendor = _read(dev / "vendor")
    info = {
        "devnum": devnum,
        "disk_devnum": disk_devnum,
        "disk": disk_dir.name,
        "partition": partition,
        "node": f"/dev/{disk_dir.name}",
        "model": " ".join(x for x in (vendor, model) if x) if vendor and vendor not in model else model,
        "serial": _read(dev / "serial") or _read(disk_dir / "serial") or _read(dev / "wwid"),
        "firmware": _read(dev / "firmware_rev") or _read(dev / "rev"),
        "ro": _read(disk_dir / "ro") == "1",
    }
    if not info["model"] or not info["serial"] or not info["firmware"]:
        info.update({k: v for k, v in _udev_ids(disk_devnum).items() if v and not info.get(k)})
    return info


def _udev_ids(devnum: str) -> dict:
    """Model, serial, firmware from the udev database (what sysfs does not say, e.g. for SATA)."""
    try:
        import pyudev
    except ImportError:
        return {}
    try:
        major, minor = (int(x) for x in devnum.split(":"))
        dev = pyudev.Devices.from_device_number(pyudev.Context(), "block", os.makedev(major, minor))
    except Exception:   # noqa: BLE001 -- pyudev raises several types; the ids are optional
        return {}
    props = dev.properties
    return {"model": props.get("ID_MODEL", ""), "serial": props.get("ID_SERIAL_SHORT", ""),
            "firmware": props.get("ID_REVISION", "")}


def udev_monitor():
    """A pyudev monitor of block devices, or None where udev is not reachable (containers)."""
    try:
        import pyudev

        monitor = pyudev.Monitor.from_netlink(pyudev.Context())
        monitor.filter_by("block")
        monitor.start()
        return monitor
    except Exception as exc:   # noqa: BLE001 -- no netlink, no pyudev: probing still works
        log.info("udev monitor unavailable (%s); device loss is detected from read errors only", exc)
        return None


def _event_devnum(device) -> str:
    number = getattr(device, "device_number", 0)
    if number:
        return f"{os.major(number)}:{os.minor(number)}"
    return ""


def _event_readonly(device) -> bool | None:
    """The ``ro`` attribute a change event carries (True/False), or None when it says nothing."""
    attributes = getattr(device, "attributes", None)
    value = None
    if attributes is not None:
        try:
            value = attributes.get("ro")
        except Exception:   # noqa: BLE001 -- a removed device's attributes may be unreadable
            value = None
    if value is None:
        props = getattr(device, "properties", None) or {}
        value = props.get("DISK_RO")
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode()
    return str(value).strip() == "1"


class DeviceWatch:
    """Follows the devices under the open models and switches them host-only and back."""

    def __init__(self, manager, monitor=None, *, probe_interval: float = PROBE_INTERVAL,
                 sysfs: str | os.PathLike = "/sys", use_udev: bool = True):
        self.manager = manager
        self.sysfs = sysfs
        self.probe_interval = probe_interval
        self._monitor = monitor if monitor is not None else (udev_monitor() if use_udev else None)
        self._lost: dict[str, str] = {}        # disk devnum -> why (from udev)
        self._stop = threading.Event()
        self._wake = threading.Event()
        # Wakes a select() on the udev monitor's fd: close() and read errors need not wait out a
        # poll interval.
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.events_seen = 0
        self._engine = None                    # the probe's own IO engine, made at first probe
        manager.on_open(self._opened)
        manager.on_device_error(self._read_error)
        self._thread = threading.Thread(target=self._run, name="flash-recovery", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._poke()
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def _poke(self) -> None:
        self._wake.set()
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass   # already due to wake

    # --- hooks from the block manager ---------------------------------------------------------
    def _opened(self, name: str, path: str) -> None:
        info = block_device_of(path, self.sysfs)
        self.manager.set_device(name, info)
        log.info("model %s is on %s", name, info.get("node") or info.get("note"))
        disk = info.get("disk_devnum")
        if disk and disk in self._lost:
            self.manager.set_host_only(name, self._lost[disk])

    def _read_error(self, name: str, error) -> None:
        self._poke()   # probe soon: the device may be back already

    # --- udev ------------------------------------------------------------------------------------
    def handle_event(self, device) -> list[str]:
        """Apply one udev event; returns the models it switched."""
        self.events_seen += 1
        action = getattr(device, "action", None)
        devnum = _event_devnum(device)
        name = getattr(device, "sys_name", "") or ""
        models = self.manager.device_models()
        hit = {m: d for m, d in models.items()
               if d["device"].get("disk") and (
                   devnum in (d["device"].get("devnum"), d["device"].get("disk_devnum"))
                   or name in (d["device"].get("disk"), d["device"].get("partition")))}
        if not hit:
            return []
        disk = next(iter(hit.values()))["device"].get("disk_devnum")
        readonly = _event_readonly(device) if action == "change" else None
        if action == "remove" or readonly:
            why = f"udev: {name or devnum} {'removed' if action == 'remove' else 'went read-only'}"
            self._lost[disk] = why
            return [m for m in hit if self.manager.set_host_only(m, why)]
        if action == "add" or (action == "change" and readonly is False):
            self._lost.pop(disk, None)
            return [m for m in hit if self.manager.set_host_only(m, None)]
        return []

    # --- loop --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._monitor is not None:
                try:
                    device = self._next_event()
                except Exception as exc:   # noqa: BLE001 -- a broken monitor: fall back to probing
                    log.warning("udev monitor failed (%s); probing only", exc)
                    self._monitor = None
                    continue
                if device is not None:
                    try:
                        self.handle_event(device)
                    except Exception:
                        log.exception("handling udev event %r failed", device)
                    continue
            else:
                self._wake.wait(self.probe_interval)
                self._wake.clear()
            self.probe()

    def _next_event(self):
        """The next udev event, or None after ``probe_interval`` or a wake-up. A monitor with a
        ``fileno`` (pyudev's) is waited on beside the wake pipe; others through ``poll(timeout)``."""
        fileno = getattr(self._monitor, "fileno", None)
        if fileno is None:
            return self._monitor.poll(timeout=self.probe_interval)
        ready, _, _ = select.select([fileno(), self._wake_r], [], [], self.probe_interval)
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 64):
                    pass
            except BlockingIOError:
                pass
        return self._monitor.poll(timeout=0) if fileno() in ready else None

    def probe(self) -> list[str]:
        """Re-read one block of every model made host-only by read errors (not by udev); switch
        back those whose store reads and verifies again. Returns the models switched back."""
        from ..errors import FlashError

        back = []
        for name, d in self.manager.device_models().items():
            if d["host_only"] is None or d["host_only"].startswith("udev:") or not d["probe"]:
                continue
            try:
                self._read_direct(d["path"], d["probe"])
            except (FlashError, OSError) as exc:
                log.debug("model %s still unreadable: %s", name, exc)
                continue
            if self.manager.set_host_only(name, None):
                back.append(name)
        return back

    def _read_direct(self, path: str, block_ids) -> None:
        """Read ``block_ids`` of the store at ``path`` from the disk (O_DIRECT where the file
        system allows it), crc32c-checked; raises the typed error of the first failure."""
        from .._core import IOEngine, ReadRequest
        from ..io import read_all
        from ..store import Store

        store = Store.open(path)
        if self._engine is None:
            self._engine = IOEngine(queue_depth=4)
        blocks = [store.block(b) for b in block_ids]
        buffer = mmap.mmap(-1, sum(-(-b.length // 4096) * 4096 for b in blocks))   # page-aligned
        requests, at = [], 0
        for b in blocks:
            requests.append(ReadRequest(str(store.data_path(b)), b.offset, b.length, buffer, at,
                                        block_id=b.id, expected_crc=b.crc32c))
            at += -(-b.length // 4096) * 4096
        read_all(self._engine, requests)
