"""NUMA placement of the host arena: put its pages on the memory node next to the GPU they feed.

The GPU's node comes from sysfs (``/sys/bus/pci/devices/<bus id>/numa_node``); the pages are moved
and bound with ``mbind(MPOL_PREFERRED, MPOL_MF_MOVE)`` from libnuma, loaded at run time through cffi
in ABI mode. Without libnuma or cffi, on a single-node machine, or when the kernel refuses, placement
is a no-op; every call reports what it did as ``{"node", "policy", "reason"}``.
"""
from __future__ import annotations

import os
from pathlib import Path

MPOL_PREFERRED = 1
MPOL_MF_MOVE = 1 << 1

_CDEF = """
int numa_available(void);
int numa_max_node(void);
long mbind(void *addr, unsigned long len, int mode, const unsigned long *nodemask,
           unsigned long maxnode, unsigned flags);
"""


def normalize_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` -> sysfs's ``0000:3b:00.0``."""
    bus_id = bus_id.strip().lower()
    domain, sep, rest = bus_id.partition(":")
    if sep and rest.count(":") == 1 and len(domain) > 4:
        domain = domain[-4:]
    return f"{domain}:{rest}" if sep else bus_id


def gpu_numa_node(pci_bus_id: str | None, sysfs_root: str | os.PathLike = "/sys") -> int | None:
    """The NUMA node of the PCI device ``pci_bus_id`` (None when unknown, not reported, or no id)."""
    if not pci_bus_id:
        return None
    path = Path(sysfs_root) / "bus" / "pci" / "devices" / normalize_bus_id(pci_bus_id) / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def online_nodes(sysfs_root: str | os.PathLike = "/sys") -> list[int]:
    """Online memory nodes from ``devices/system/node/online`` (``[0]`` when the file is absent)."""
    try:
        text = (Path(sysfs_root) / "devices" / "system" / "node" / "online").read_text().strip()
    except OSError:
        return [0]
    nodes: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        nodes.extend(range(int(lo), int(hi or lo) + 1))
    return nodes or [0]


def load_libnuma():
    """``(ffi, lib)`` for libnuma.so.1, or ``(None, reason)`` when it cannot be loaded."""
    try:
        import cffi
    except ImportError:
        return None, "cffi not installed"
    ffi = cffi.FFI()
    ffi.cdef(_CDEF)
    try:
        lib = ffi.dlopen("libnuma.so.1")
    except OSError as exc:
        return None, f"libnuma.so.1 not loadable: {exc}"
    if lib.numa_available() < 0:
        return None, "libnuma reports NUMA unavailable"
    return (ffi, lib), ""


def bind_to_node(address: int, size: int, node: int | None, *, sysfs_root: str | os.PathLike = "/sys",
                 libnuma=None) -> dict:
    """Prefer ``node`` for the pages of ``[address, address + size)`` and move those already there.

    ``libnuma`` is ``(ffi, lib)`` (tests pass a fake); by default it is loaded on demand."""
    def noop(reason: str) -> dict:
        return {"node": node, "policy": "default", "reason": reason}

    if node is None:
        return noop("no NUMA node known for the device")
    nodes = online_nodes(sysfs_root)
    if len(nodes) < 2:
        return noop("single NUMA node")
    if node not in nodes:
        return noop(f"node {node} is not online (online: {nodes})")
    if libnuma is None:
        libnuma, reason = load_libnuma()
        if libnuma is None:
            return noop(reason)
    ffi, lib = libnuma
    bits = 8 * ffi.sizeof("unsigned long")
    mask = ffi.new("unsigned long[]", node // bits + 1)
    mask[node // bits] = 1 << (node % bits)
    rc = lib.mbind(ffi.cast("void *", address), size, MPOL_PREFERRED, mask, (node // bits + 1) * bits + 1,
                   MPOL_MF_MOVE)
    if rc != 0:
        err = ffi.errno
        return noop(f"mbind failed: {os.strerror(err)} [errno {err}]")
    return {"node": node, "policy": "preferred", "reason": "bound with mbind(MPOL_PREFERRED, MPOL_MF_MOVE)"}


def place_arena(arena, pci_bus_id: str | None, *, sysfs_root: str | os.PathLike = "/sys", libnuma=None) -> dict:
    """Bind ``arena`` (a ``HostArena``) to the NUMA node of the GPU at ``pci_bus_id``."""
    node = gpu_numa_node(pci_bus_id, sysfs_root)
    return bind_to_node(arena.address, arena.size, node, sysfs_root=sysfs_root, libnuma=libnuma)
