"""``deepseek-flash-repair --ssd_device DEV``: repair the stores on one disk, under the disk's lock.

The seeds' operators name a disk, not a store. The stores on it are the ones given, or every store
the configuration knows (``models`` and the directories under ``store_roots``) whose file system
lies on DEV's whole disk. Before touching any of them the repair takes DEV's lock -- an exclusive
``flock`` on ``<runtime dir>/locks/dev-MAJ:MIN.lock`` -- so two repairs of one disk never run at
once, and it refuses while the running daemon has a model open on that disk: the daemon reads
those blocks, and its status tree (``models/*/info`` ``device_disk_devnum``) says so.
"""
from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from ..errors import DeviceError, StoreInUse


def disk_devnum(devnum: str, sysfs: Path = Path("/sys")) -> str:
    """The whole disk's MAJ:MIN for a disk or partition MAJ:MIN (itself when sysfs says nothing)."""
    node = sysfs / "dev" / "block" / devnum
    if not node.exists():
        return devnum
    resolved = node.resolve()
    if (resolved / "partition").exists():
        parent = (resolved.parent / "dev")
        if parent.exists():
            return parent.read_text().strip()
    return devnum


def device_of_node(device: str, sysfs: Path = Path("/sys")) -> str:
    """The whole-disk MAJ:MIN of the block device node ``device`` (``/dev/nvme0n1`` or ``nvme0n1``)."""
    path = Path(device if "/" in device else f"/dev/{device}")
    try:
        st = os.stat(path)
    except OSError as exc:
        raise DeviceError(f"--ssd_device {device}: {exc.strerror}", device=str(path)) from None
    if not stat.S_ISBLK(st.st_mode):
        raise DeviceError(f"--ssd_device {device}: {path} is not a block device", device=str(path))
    return disk_devnum(f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}", sysfs)


def disk_of_path(path: Path, sysfs: Path = Path("/sys")) -> str:
    """The whole-disk MAJ:MIN under the file system holding ``path``."""
    st = os.stat(path)
    return disk_devnum(f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}", sysfs)


def configured_stores(config) -> list[Path]:
    """Every store the configuration names: ``models`` entries, and store directories (those with
    a ``blocks*.dat`` data file) directly under each of ``store_roots``."""
    found: list[Path] = []
    for path in config.models.values():
        found.append(Path(path))
    for root in config.store_roots:
        root = Path(root)
        if root.is_dir():
            found.extend(sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("blocks*.dat"))))
    unique: list[Path] = []
    for path in found:
        if path.is_dir() and all(not os.path.samefile(path, seen) for seen in unique):
            unique.append(path)
    return unique


def daemon_models_on(devnum: str, runtime: Path) -> tuple[str, list[str]]:
    """(pid, model names) of the running daemon's open models whose disk is ``devnum``; ("", [])
    when no daemon runs (a dead daemon's tree does not count)."""
    from ..ops.common import tree_owner

    owner = tree_owner(runtime)
    if not owner.alive:
        return "", []
    names = []
    models = runtime / "models"
    for info in sorted(models.glob("*/info")) if models.is_dir() else []:
        fields = {}
        for line in info.read_text(errors="replace").splitlines():
            key, _, value = line.partition(": ")
            fields[key] = value
        if devnum in (fields.get("device_disk_devnum"), fields.get("device_devnum")):
            names.append(info.parent.name)
    return owner.pid, names


def lock_device(devnum: str, runtime: Path) -> int:
    """DEV's repair lock (an open fd; close it to release); ``StoreInUse`` while another holds it."""
    locks = runtime / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    path = locks / f"dev-{devnum}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreInUse(f"device {devnum}: its lock {path} is held (another repair of this disk "
                         f"is running)", device=devnum, path=str(path)) from None
    return fd


def stores_to_repair(device: str, given: list[Path], config, sysfs: Path = Path("/sys")) -> tuple[str, list[Path]]:
    """(DEV's whole-disk MAJ:MIN, the stores to repair on it); a given store on another disk is an error."""
    devnum = device_of_node(device, sysfs)
    if given:
        for path in given:
            where = disk_of_path(path, sysfs)
            if where != devnum:
                raise DeviceError(f"{path} lies on disk {where}, not on --ssd_device {device} ({devnum})",
                                  device=device, path=str(path))
        return devnum, given
    return devnum, [p for p in configured_stores(config) if disk_of_path(p, sysfs) == devnum]
