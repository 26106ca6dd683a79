"""``health``: replay the daemon's read pattern on a device or file and check the storage stack.

Two halves. ``replay`` reads the target the way the daemon does -- block-sized O_DIRECT reads,
``queue_depth`` in flight, through ``_core.IOEngine`` -- opened read only, and measures throughput
and per-request latency. ``describe`` finds the block device(s) behind the target in sysfs (a
file's ``st_dev``, a partition's disk, the slaves of an md/dm device), reads model, serial,
firmware and queue settings, and ``pitfalls`` names the settings known to hurt the daemon (mixed
firmware behind one store, NVMe APST, an IO scheduler other than ``none``, a block-layer queue
shallower than the engine's). Every sysfs read goes through ``sysfs_root`` so tests use a fake tree.

Latency method: each request is submitted as its own engine batch and its submit time recorded;
a loop polls the engine's completion queue (``IOEngine.poll``, no sleep, a ``sched_yield`` when
empty) and stamps each completion when it is seen. A request's latency is therefore
submit -> completion observed, which includes at most one poll iteration (microseconds). As soon as
a request completes a new one is submitted, so ``queue_depth`` requests stay in flight.
"""
from __future__ import annotations

import mmap
import os
import random
import stat
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import DeviceError

PATTERNS = ("flash_workload", "random", "sequential")
# The daemon's engine defaults (daemon reads one block-sized extent per request).
DEFAULT_QUEUE_DEPTH = 32
DEFAULT_BLOCK_SIZE = 1 << 20


# --- the workload ------------------------------------------------------------------------------
@dataclass
class ReplayResult:
    pattern: str
    queue_depth: int
    block_size: int
    duration_s: float
    requests: int
    bytes: int
    backend: str
    direct: bool
    throughput_mb_s: float
    iops: float
    latency_us: dict          # p50, p95, p99, max, mean
    io_completion_variance: float   # variance of per-request latency, us^2
    latency_cv: float         # stddev / mean of per-request latency
    io_completion_variance_pct: float = 0.0   # the seeds' figure: latency_cv as a percentage
    io_completion_verdict: str = ""           # the seeds' thresholds on it (variance_verdict)


# The seeds' reading of io_completion_variance as a coefficient of variation: below 5 % the disk
# completes reads evenly, 5-10 % is worth watching, above 10 % reads stall behind others.
VARIANCE_VERDICTS = ((5.0, "stable"), (10.0, "variable"), (float("inf"), "unstable"))


def variance_verdict(pct: float) -> str:
    """``stable`` (< 5 %), ``variable`` (5-10 %) or ``unstable`` (> 10 %)."""
    return next(word for limit, word in VARIANCE_VERDICTS if pct < limit or limit == float("inf"))


def open_read_only(path: Path) -> tuple[int, int]:
    """(fd, size) of ``path`` opened O_RDONLY; DeviceError naming the path when that fails."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DeviceError(f"{path}: no such device or file", path=str(path)) from None
    except OSError as exc:
        raise DeviceError(f"{path}: cannot stat: {exc.strerror}", path=str(path)) from None
    if not (stat.S_ISBLK(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise DeviceError(f"{path}: not a block device or regular file", path=str(path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise DeviceError(f"{path}: cannot open for reading: {exc.strerror}", path=str(path),
                          errno=exc.errno) from None
    # lseek(SEEK_END) gives a block device's size as well as a file's.
    return fd, os.lseek(fd, 0, os.SEEK_END)


def _direct_allowed(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC))
        return True
    except OSError:
        return False


def _percentile(sorted_values: list, q: float) -> float:
    # Nearest-rank percentile: a value that was actually measured.
    idx = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[idx]


def replay(path, *, pattern: str = "flash_workload", queue_depth: int = DEFAULT_QUEUE_DEPTH,
           block_size: int = DEFAULT_BLOCK_SIZE, duration: float = 5.0, seed: int = 0,
           progress=None) -> ReplayResult:
    """Read ``path`` (read only) for ``duration`` seconds with ``queue_depth`` requests in flight.

    ``flash_workload``/``random``: block-aligned random offsets (the daemon's demand and prefetch
    reads of blocks scattered over the store); ``sequential``: forward, wrapping at the end (a cold
    load). ``progress(seconds)`` is called with the elapsed time as it advances.
    """
    from .. import _core
    from ..io import raise_for

    if pattern not in PATTERNS:
        raise ValueError(f"pattern {pattern!r}: choose from {', '.join(PATTERNS)}")
    if duration <= 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    if queue_depth < 1:
        raise ValueError(f"queue depth must be >= 1, got {queue_depth}")
    if block_size < 4096 or block_size % 4096:
        raise ValueError(f"block size must be a positive multiple of 4096, got {block_size}")
    path = Path(path)
    fd, size = open_read_only(path)
    os.close(fd)
    slots = size // block_size
    if slots < 1:
        raise DeviceError(f"{path}: {size} bytes, smaller than one {block_size}-byte block",
                          path=str(path))
    direct = _direct_allowed(path)
    engine = _core.IOEngine(queue_depth=queue_depth, request_size=block_size, direct=direct)
    buf = mmap.mmap(-1, queue_depth * block_size)
    rng = random.Random(seed)
    next_seq = 0

    def next_offset() -> int:
        nonlocal next_seq
        if pattern == "sequential":
            off = next_seq % slots * block_size
            next_seq += 1
            return off
        return rng.randrange(slots) * block_size

    inflight: dict[int, tuple[int, float]] = {}   # batch -> (slot, submit time)
    latencies: list[float] = []
    total = 0

    def submit(slot: int) -> None:
        req = _core.ReadRequest(str(path), next_offset(), block_size, buf, slot * block_size)
        inflight[engine.submit([req])] = (slot, time.perf_counter())

    start = time.perf_counter()
    deadline = start + duration
    last_tick = start
    try:
        for slot in range(queue_depth):
            submit(slot)
        while inflight:
            done = engine.poll()
            now = time.perf_counter()
            if not done:
                os.sched_yield()
                continue
            for c in done:
                slot, t0 = inflight.pop(c.batch)
                raise_for(c)
                latencies.append((now - t0) * 1e6)
                total += c.bytes
                if now < deadline:
                    submit(slot)
            if progress is not None and now - last_tick >= 0.1:
                progress(min(now, deadline) - last_tick)
                last_tick = min(now, deadline)
        elapsed = time.perf_counter() - start
    finally:
        for batch in list(inflight):
            engine.cancel(batch)
        engine.close()
    if progress is not None and deadline > last_tick:
        progress(deadline - last_tick)
    lat = sorted(latencies)
    mean = statistics.fmean(lat)
    var = statistics.pvariance(lat, mu=mean) if len(lat) > 1 else 0.0
    cv = var ** 0.5 / mean if mean else 0.0
    return ReplayResult(
        pattern=pattern, queue_depth=queue_depth, block_size=block_size,
        duration_s=round(elapsed, 3), requests=len(lat), bytes=total, backend=engine.backend,
        direct=direct, throughput_mb_s=round(total / elapsed / 1e6, 2),
        iops=round(len(lat) / elapsed, 1),
        latency_us={"p50": round(_percentile(lat, 50), 1), "p95": round(_percentile(lat, 95), 1),
                    "p99": round(_percentile(lat, 99), 1), "max": round(lat[-1], 1),
                    "mean": round(mean, 1)},
        io_completion_variance=round(var, 1),
        latency_cv=round(cv, 4),
        io_completion_variance_pct=round(cv * 100, 2),
        io_completion_verdict=variance_verdict(cv * 100))


# --- the storage stack in sysfs ------------------------------------------------------------------
@dataclass
class Disk:
    """One whole disk (a leaf of the stack, or the top device itself)."""

    name: str
    kind: str                 # nvme | scsi | virtio | md | dm | other
    model: str | None = None
    serial: str | None = None
    firmware: str | None = None
    scheduler: str | None = None
    nr_requests: int | None = None
    rotational: bool | None = None
    apst_enabled: bool | None = None   # NVMe only


@dataclass
class StackInfo:
    target: str
    target_kind: str                       # "block device" | "file"
    device: str | None                     # top block device name (the file's or the target's)
    partition: str | None = None
    top: Disk | None = None
    leaves: list = field(default_factory=list)   # Disk, the physical disks under md/dm (or [top])
    notes: list = field(default_factory=list)    # why something could not be found


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _scheduler(text: str | None) -> str | None:
    if text is None:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return text.split()[0] if text.split() else None


def _disk_node(node: Path) -> tuple[Path, str | None]:
    """(whole-disk sysfs dir, partition name or None) of a block node directory."""
    if (node / "partition").exists():
        return node.parent, node.name
    return node, None


def _kind(disk_dir: Path) -> str:
    name = disk_dir.name
    if name.startswith("nvme"):
        return "nvme"
    if name.startswith("md"):
        return "md"
    if name.startswith("dm-") or (disk_dir / "dm").is_dir():
        return "dm"
    if name.startswith("vd"):
        return "virtio"
    if name.startswith("sd"):
        return "scsi"
    return "other"


def _apst(sysfs: Path, disk_dir: Path) -> bool | None:
    # A controller's own latency tolerance overrides the module default; 0 disables APST.
    for candidate in (disk_dir / "device" / "power" / "pm_qos_latency_tolerance_us",
                      sysfs / "module" / "nvme_core" / "parameters" / "default_ps_max_latency_us"):
        value = _read(candidate)
        if value is not None:
            try:
                return int(value) != 0
            except ValueError:
                return None
    return None


def _disk(sysfs: Path, disk_dir: Path) -> Disk:
    kind = _kind(disk_dir)
    dev = disk_dir / "device"
    nr = _read(disk_dir / "queue" / "nr_requests")
    rot = _read(disk_dir / "queue" / "rotational")
    model = _read(dev / "model")
    if kind == "dm":
        model = model or _read(disk_dir / "dm" / "name")
    if kind == "md":
        model = model or _read(disk_dir / "md" / "level")
    return Disk(
        name=disk_dir.name, kind=kind, model=model,
        serial=_read(dev / "serial") or _read(disk_dir / "serial") or _read(dev / "vpd_pg80"),
        firmware=_read(dev / "firmware_rev") or _read(dev / "rev"),
        scheduler=_scheduler(_read(disk_dir / "queue" / "scheduler")),
        nr_requests=int(nr) if nr and nr.isdigit() else None,
        rotational=None if rot is None else rot == "1",
        apst_enabled=_apst(sysfs, disk_dir) if kind == "nvme" else None)


def _leaves(sysfs: Path, disk_dir: Path, seen: set) -> list:
    """Physical disks under ``disk_dir`` (itself when it has no slaves)."""
    slaves_dir = disk_dir / "slaves"
    slaves = sorted(slaves_dir.iterdir()) if slaves_dir.is_dir() else []
    if not slaves:
        return [disk_dir]
    out = []
    for slave in slaves:
        node = _block_dir(sysfs, slave.name)
        if node is None:
            continue
        whole, _part = _disk_node(node)
        if whole in seen:
            continue
        seen.add(whole)
        out.extend(_leaves(sysfs, whole, seen))
    return out


def _block_dir(sysfs: Path, name: str) -> Path | None:
    """The sysfs dir of block node ``name`` (disk or partition), through /sys/class/block."""
    link = sysfs / "class" / "block" / name
    if link.exists():
        return link.resolve()
    direct = sysfs / "block" / name
    return direct.resolve() if direct.exists() else None


def describe(target, sysfs_root="/sys", use_udev: bool | None = None) -> StackInfo:
    """The block device stack behind ``target`` (a block device or any file on one)."""
    target = Path(target)
    sysfs = Path(sysfs_root)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        raise DeviceError(f"{target}: no such device or file", path=str(target)) from None
    if stat.S_ISBLK(st.st_mode):
        kind, devno = "block device", st.st_rdev
    else:
        kind, devno = "file", st.st_dev
    info = StackInfo(target=str(target), target_kind=kind, device=None)
    majmin = f"{os.major(devno)}:{os.minor(devno)}"
    link = sysfs / "dev" / "block" / majmin
    if not link.exists():
        info.notes.append(f"{link} does not exist: no block device behind {target} "
                          f"(a network, overlay or memory file system?)")
        return info
    whole, part = _disk_node(link.resolve())
    info.device, info.partition = whole.name, part
    info.top = _disk(sysfs, whole)
    info.leaves = [_disk(sysfs, d) for d in _leaves(sysfs, whole, {whole})]
    if use_udev is None:
        use_udev = str(sysfs) == "/sys"
    if use_udev:
        _fill_from_udev(info, sysfs, info.notes)
    return info


def _fill_from_udev(info: StackInfo, sysfs: Path, notes: list) -> None:
    """Fill model/serial/firmware that sysfs lacks (SCSI serials live in udev's database)."""
    try:
        import pyudev
    except ImportError:
        notes.append("pyudev is not installed: model/serial from sysfs only")
        return
    try:
        context = pyudev.Context()
        for disk in [info.top, *info.leaves]:
            try:
                dev = pyudev.Devices.from_name(context, "block", disk.name)
            except (pyudev.DeviceNotFoundError, OSError):
                continue
            props = dev.properties
            disk.model = disk.model or props.get("ID_MODEL")
            disk.serial = disk.serial or props.get("ID_SERIAL_SHORT") or props.get("ID_SERIAL")
            disk.firmware = disk.firmware or props.get("ID_REVISION")
    except OSError as exc:   # a container without a udev database: sysfs values stand
        notes.append(f"udev not available ({exc}): model/serial from sysfs only")


def pitfalls(info: StackInfo, queue_depth: int) -> list[str]:
    """Warnings about settings known to hurt the daemon's reads, each naming the device and fix."""
    out = []
    leaves = info.leaves
    if len(leaves) > 1:
        firmware = {d.name: d.firmware for d in leaves}
        if len(set(firmware.values())) > 1:
            listed = ", ".join(f"{n}={f or '?'}" for n, f in firmware.items())
            out.append(f"{info.device}: drives behind one store run different firmware ({listed}); "
                       f"the slowest one paces every striped read -- update them to one version")
    for d in leaves:
        if d.kind == "nvme" and d.apst_enabled:
            out.append(f"{d.name}: NVMe autonomous power-state transitions (APST) are enabled; "
                       f"wake-up latency shows as p99 stalls -- set "
                       f"nvme_core.default_ps_max_latency_us=0 (kernel command line)")
    for d in {d.name: d for d in [info.top, *leaves] if d is not None}.values():
        if d.scheduler is not None and d.scheduler != "none":
            out.append(f"{d.name}: IO scheduler is {d.scheduler}, not none; it reorders and merges "
                       f"the engine's O_DIRECT reads for no gain on flash -- "
                       f"echo none > /sys/block/{d.name}/queue/scheduler")
        if d.nr_requests is not None and d.nr_requests < queue_depth:
            out.append(f"{d.name}: nr_requests is {d.nr_requests}, below the engine's queue depth "
                       f"{queue_depth}; requests wait in the block layer -- raise "
                       f"/sys/block/{d.name}/queue/nr_requests")
        if d.rotational:
            out.append(f"{d.name}: rotational disk; random block reads will be seek-bound")
    return out


def health(target, *, pattern="flash_workload", queue_depth=DEFAULT_QUEUE_DEPTH,
           block_size=DEFAULT_BLOCK_SIZE, duration=5.0, sysfs_root="/sys", progress=None) -> dict:
    """The full report (JSON-ready): device stack, pitfalls and the workload's numbers."""
    # Check the target before spending the duration on it.
    fd, size = open_read_only(Path(target))
    os.close(fd)
    stack = describe(target, sysfs_root)
    result = replay(target, pattern=pattern, queue_depth=queue_depth, block_size=block_size,
                    duration=duration, progress=progress)
    return {"target": str(target), "size_bytes": size, "stack": asdict(stack),
            "pitfalls": pitfalls(stack, queue_depth), "workload": asdict(result)}
