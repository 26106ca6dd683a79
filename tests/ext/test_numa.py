"""NUMA placement: GPU node from a fake sysfs tree, the no-op reasons, the mbind call made, and the
real libnuma on this machine."""
from __future__ import annotations

from deepseek_flash import _core, numa


def _fake_sysfs(root, nodes="0-1", devices=None):
    (root / "devices" / "system" / "node").mkdir(parents=True)
    (root / "devices" / "system" / "node" / "online").write_text(nodes + "\n")
    for bus, node in (devices or {}).items():
        d = root / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return root


class _FakeLib:
    def __init__(self, rc=0):
        self.rc = rc
        self.calls = []

    def mbind(self, addr, size, mode, mask, maxnode, flags):
        self.calls.append((int(_ffi().cast("uintptr_t", addr)), size, mode, mask[0], maxnode, flags))
        return self.rc


def _ffi():
    import cffi

    return cffi.FFI()


def test_gpu_node_from_sysfs(tmp_path):
    root = _fake_sysfs(tmp_path, devices={"0000:3b:00.0": 1, "0000:af:00.0": -1})
    assert numa.gpu_numa_node("00000000:3B:00.0", root) == 1  # NVML spelling
    assert numa.gpu_numa_node("0000:3b:00.0", root) == 1
    assert numa.gpu_numa_node("0000:af:00.0", root) is None   # firmware reports no node
    assert numa.gpu_numa_node("0000:01:00.0", root) is None   # no such device
    assert numa.gpu_numa_node(None, root) is None
    assert numa.online_nodes(root) == [0, 1]
    assert numa.online_nodes(_fake_sysfs(tmp_path / "x", "0,2-3")) == [0, 2, 3]


def test_binds_with_mbind_on_the_gpu_node(tmp_path):
    root = _fake_sysfs(tmp_path, devices={"0000:3b:00.0": 1})
    arena = _core.HostArena(1 << 20)
    lib = _FakeLib()
    placement = numa.place_arena(arena, "0000:3b:00.0", sysfs_root=root, libnuma=(_ffi(), lib))
    assert placement["node"] == 1 and placement["policy"] == "preferred"
    assert lib.calls == [(arena.address, arena.size, numa.MPOL_PREFERRED, 0b10, 65, numa.MPOL_MF_MOVE)]


def test_noop_reasons(tmp_path):
    arena = _core.HostArena(1 << 20)
    single = _fake_sysfs(tmp_path / "one", "0", {"0000:3b:00.0": 0})
    assert numa.place_arena(arena, "0000:3b:00.0", sysfs_root=single) == {
        "node": 0, "policy": "default", "reason": "single NUMA node"}
    two = _fake_sysfs(tmp_path / "two", "0-1", {"0000:3b:00.0": 1, "0000:3c:00.0": 5})
    assert numa.place_arena(arena, None, sysfs_root=two)["reason"] == "no NUMA node known for the device"
    assert "not online" in numa.place_arena(arena, "0000:3c:00.0", sysfs_root=two)["reason"]
    failed = numa.place_arena(arena, "0000:3b:00.0", sysfs_root=two, libnuma=(_ffi(), _FakeLib(rc=-1)))
    assert failed["policy"] == "default" and failed["reason"].startswith("mbind failed")


def test_missing_libnuma_is_a_noop(tmp_path, monkeypatch):
    import cffi

    def refuse(self, name):
        raise OSError(f"cannot load {name}")

    monkeypatch.setattr(cffi.FFI, "dlopen", refuse)
    handle, reason = numa.load_libnuma()
    assert handle is None and "libnuma.so.1 not loadable" in reason
    root = _fake_sysfs(tmp_path, devices={"0000:3b:00.0": 1})
    placement = numa.place_arena(_core.HostArena(1 << 20), "0000:3b:00.0", sysfs_root=root)
    assert placement["policy"] == "default" and "not loadable" in placement["reason"]


def test_this_machine():
    handle, reason = numa.load_libnuma()
    assert handle is not None or "libnuma" in reason
    arena = _core.HostArena(1 << 20)
    nodes = numa.online_nodes()
    placement = numa.bind_to_node(arena.address, arena.size, nodes[0])
    if len(nodes) == 1:
        assert placement == {"node": 0, "policy": "default", "reason": "single NUMA node"}
    elif handle is None:
        assert placement["policy"] == "default" and "libnuma" in placement["reason"]
    else:
        assert placement["policy"] == "preferred", placement
