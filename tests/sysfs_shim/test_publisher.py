"""sysfs_shim/publisher.py: exact file contents, atomic replacement, debounce, model removal."""
from __future__ import annotations

import threading

import pytest
from deepseek_flash.sysfs_shim.publisher import StatusTree, parse, render, render_metrics


def snapshot(**over):
    snap = {
        "status": {
            "unified_memory_fabric": "HOST_ONLY",
            "controller_state": "ACTIVE",
            "prefetch_hit_rate": 0.927,
            "semantic_block_count": 1248,
            "config_state": "loaded /etc/deepseek-flash/flash.json",
            "last_reload_error": None,
        },
        "stats": {
            "prefetch_miss_count": 7,
            "block_eviction_count": 3,
            "fabric_stall_cycles": 0,
            "active_leases": 2,
            "connected_clients": 1,
            "bytes_read_nvme": 1 << 30,
            "bytes_h2d": 0,
        },
        "devices": {"cuda:0": {"arena_bytes": 1 << 20, "name": "NVIDIA H200"}},
        "models": {
            "tiny-llama": {
                "path": "/var/lib/deepseek-flash/models/tiny-llama",
                "total_bytes": 98304,
                "blocks": [
                    {"id": 0, "role": "embed", "layer": -1, "bytes": 65536, "access_count": 4, "tier": "host"},
                    {"id": 1, "role": "norms", "layer": 0, "bytes": 32768, "access_count": 0, "tier": "disk"},
                ],
                "residency": {"host_blocks": 1, "host_bytes": 65536, "disk_blocks": 1},
                "plan": {"prefetch_window": 4, "layers": [0, 1]},
            },
        },
    }
    snap.update(over)
    return snap


def test_status_file_has_design_fields_in_design_order():
    files = render(snapshot())
    assert files["status"] == (
        b"controller_state: ACTIVE\n"
        b"prefetch_hit_rate: 92.7%\n"
        b"semantic_block_count: 1248\n"
        b"unified_memory_fabric: HOST_ONLY\n"
        b"config_state: loaded /etc/deepseek-flash/flash.json\n"
        b"last_reload_error: -\n"
    )
    assert files["stats"] == (
        b"prefetch_miss_count: 7\nblock_eviction_count: 3\nfabric_stall_cycles: 0\n"
        b"active_leases: 2\nconnected_clients: 1\nbytes_read_nvme: 1073741824\nbytes_h2d: 0\n"
    )
    assert files["devices"] == b"cuda:0.arena_bytes: 1048576\ncuda:0.name: NVIDIA H200\n"


def test_model_files():
    files = render(snapshot())
    assert files["models/tiny-llama/info"] == (
        b"name: tiny-llama\npath: /var/lib/deepseek-flash/models/tiny-llama\n"
        b"total_bytes: 98304\nplan.prefetch_window: 4\nplan.layers: 0,1\nblocks: 2\n"
    )
    assert files["models/tiny-llama/blocks"] == (
        b"0: role=embed layer=-1 bytes=65536 access_count=4 tier=host\n"
        b"1: role=norms layer=0 bytes=32768 access_count=0 tier=disk\n"
    )
    assert files["models/tiny-llama/residency"] == b"host_blocks: 1\nhost_bytes: 65536\ndisk_blocks: 1\n"


def test_block_manager_shape_top_level_status_and_residency_list():
    # What BlockManager.snapshot() returns: status fields at the top level, a block count in
    # "blocks" and the per-block list in "residency".
    snap = {
        "controller_state": "ACTIVE", "semantic_block_count": 2, "prefetch_hit_rate": 1.0,
        "stats": {"hits": 5, "misses": 1, "prefetch_hit_rate": 0.8333, "host_bytes_used": 4096},
        "models": {"m": {"name": "m", "state": "open", "blocks": 2, "resident_blocks": 1, "error": None,
                         "clients": [1, 3],
                         "residency": [
                             {"id": 0, "role": "embed", "layer": -1, "state": "resident", "bytes": 4096,
                              "refs": 1, "uses": 5, "hot": True},
                             {"id": 1, "role": "lm_head", "layer": -1, "state": "absent", "bytes": 8192,
                              "refs": 0, "uses": 0, "hot": False}]}},
        "tunables": {"prefetch_window": 32},
        "generation": 7,
    }
    files = render(snap)
    assert files["status"] == (b"controller_state: ACTIVE\nprefetch_hit_rate: 100.0%\n"
                               b"semantic_block_count: 2\ngeneration: 7\n")
    assert files["tunables"] == b"prefetch_window: 32\n"
    assert files["models/m/info"] == (b"name: m\nstate: open\nblocks: 2\nresident_blocks: 1\n"
                                      b"error: -\nclients: 1,3\n")
    assert files["models/m/blocks"] == (
        b"0: role=embed layer=-1 state=resident bytes=4096 refs=1 uses=5 hot=1\n"
        b"1: role=lm_head layer=-1 state=absent bytes=8192 refs=0 uses=0 hot=0\n")
    assert files["models/m/residency"] == (b"absent_blocks: 1\nabsent_bytes: 8192\n"
                                           b"resident_blocks: 1\nresident_bytes: 4096\n")
    metrics = files["metrics.prom"].decode().splitlines()
    assert "deepseek_flash_prefetch_hit_rate 1.0" in metrics
    # The stats copy of prefetch_hit_rate does not make a second series.
    assert sum(line.startswith("deepseek_flash_prefetch_hit_rate ") for line in metrics) == 1
    assert "# TYPE deepseek_flash_hits_total counter" in metrics
    assert "# TYPE deepseek_flash_host_bytes_used gauge" in metrics
    assert 'deepseek_flash_model_residency_resident_bytes{model="m"} 4096' in metrics


def test_hit_rate_already_formatted_and_error_text_kept_on_one_line():
    files = render(snapshot(status={"controller_state": "DEGRADED", "prefetch_hit_rate": "50.0%",
                                    "last_reload_error": "flash.json: prefetch_window=-1\nallowed 1..1024"}))
    assert parse(files["status"].decode()) == {
        "controller_state": "DEGRADED", "prefetch_hit_rate": "50.0%",
        "last_reload_error": "flash.json: prefetch_window=-1 allowed 1..1024"}


@pytest.mark.parametrize("field, value", [("controller_state", "RUNNING"), ("unified_memory_fabric", "ON")])
def test_unknown_enum_values_are_rejected(field, value):
    with pytest.raises(ValueError, match=f"{field}='{value}'"):
        render({"status": {field: value}})


@pytest.mark.parametrize("name", ["..", "a/b", ".hidden", ""])
def test_model_names_that_are_not_file_names_are_rejected(name):
    with pytest.raises(ValueError, match="model name"):
        render({"models": {name: {}}})


def test_metrics_text_format():
    text = render_metrics(snapshot())
    lines = text.splitlines()
    # Every family: HELP, TYPE, then its samples, contiguous.
    assert lines[:6] == [
        ("# HELP deepseek_flash_controller_state Controller state (ACTIVE, DEGRADED, STARTING, STOPPING); "
         "1 for the current one."),
        "# TYPE deepseek_flash_controller_state gauge",
        'deepseek_flash_controller_state{state="ACTIVE"} 1',
        'deepseek_flash_controller_state{state="DEGRADED"} 0',
        'deepseek_flash_controller_state{state="STARTING"} 0',
        'deepseek_flash_controller_state{state="STOPPING"} 0',
    ]
    assert "deepseek_flash_prefetch_hit_rate 0.927" in lines
    assert 'deepseek_flash_unified_memory_fabric{mode="HOST_ONLY"} 1' in lines
    assert "# TYPE deepseek_flash_prefetch_miss_count_total counter" in lines
    assert "deepseek_flash_prefetch_miss_count_total 7" in lines
    assert "# TYPE deepseek_flash_active_leases gauge" in lines
    assert "deepseek_flash_bytes_read_nvme_total 1073741824" in lines
    assert 'deepseek_flash_device_arena_bytes{device="cuda:0"} 1048576' in lines
    assert 'deepseek_flash_model_total_bytes{model="tiny-llama"} 98304' in lines
    assert 'deepseek_flash_model_blocks{model="tiny-llama"} 2' in lines
    assert 'deepseek_flash_model_residency_host_bytes{model="tiny-llama"} 65536' in lines
    # Strings (config_state, device name, path) are not numbers and are not exported.
    assert "config_state" not in text and "H200" not in text and "/var/lib" not in text
    names = [line.split()[2] for line in lines if line.startswith("# TYPE")]
    assert len(names) == len(set(names))
    for line in lines:
        if not line.startswith("#"):
            assert line.startswith("deepseek_flash_") and line.split()[0].split("{")[0] in names


def test_metrics_labels_are_escaped():
    text = render_metrics({"models": {'we"ird\\name': {"total_bytes": 1}}})
    assert 'deepseek_flash_model_total_bytes{model="we\\"ird\\\\name"} 1' in text.splitlines()


def test_publish_writes_tree_and_debounces(tmp_path):
    tree = StatusTree(tmp_path / "rt")
    written = tree.publish(snapshot())
    root = tmp_path / "rt"
    assert written == 7
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == [
        "devices", "metrics.prom", "models/tiny-llama/blocks", "models/tiny-llama/info",
        "models/tiny-llama/residency", "stats", "status"]
    assert parse((root / "status").read_text())["controller_state"] == "ACTIVE"
    assert (root / "status").stat().st_mode & 0o777 == 0o644
    inode = (root / "status").stat().st_ino

    assert tree.publish(snapshot()) == 0
    assert (root / "status").stat().st_ino == inode

    snap = snapshot()
    snap["stats"]["prefetch_miss_count"] = 8
    assert tree.publish(snap) == 2  # stats and metrics.prom
    assert (root / "status").stat().st_ino == inode
    assert "prefetch_miss_count: 8" in (root / "stats").read_text()
    # No temp files left behind.
    assert not [p for p in root.rglob(".*")]


def test_file_deleted_behind_the_publishers_back_is_rewritten(tmp_path):
    tree = StatusTree(tmp_path)
    tree.publish(snapshot())
    (tmp_path / "status").unlink()
    assert tree.publish(snapshot()) == 1
    assert (tmp_path / "status").exists()


def test_removed_model_loses_its_directory(tmp_path):
    tree = StatusTree(tmp_path)
    snap = snapshot()
    snap["models"]["second"] = {"blocks": [], "residency": {}}
    tree.publish(snap)
    assert (tmp_path / "models" / "second" / "info").read_text() == "name: second\nblocks: 0\n"
    del snap["models"]["second"]
    tree.publish(snap)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny-llama"]
    tree.publish(snapshot(models={}))
    assert list((tmp_path / "models").iterdir()) == []
    assert 'model="tiny-llama"' not in (tmp_path / "metrics.prom").read_text()


def test_stale_model_from_a_previous_run_is_removed(tmp_path):
    (tmp_path / "models" / "old" ).mkdir(parents=True)
    (tmp_path / "models" / "old" / "info").write_text("name: old\n")
    StatusTree(tmp_path).publish(snapshot())
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny-llama"]


def test_remove_clears_the_tree(tmp_path):
    tree = StatusTree(tmp_path / "rt")
    tree.publish(snapshot())
    (tmp_path / "rt" / "control.sock").write_text("")  # not the tree's: must survive
    tree.remove()
    assert sorted(p.name for p in (tmp_path / "rt").iterdir()) == ["control.sock"]


def _hammer(root):
    """Publish 79 changing snapshots of big files while a thread reads them back; (reads, torn
    files seen, exceptions the reader raised). A torn file may fail the reader's parsing rather
    than its checks: that is collected too, never left to kill the thread unseen."""
    tree = StatusTree(root)
    # Big, changing files make a torn read likely if writes were not atomic.
    def snap(i):
        blocks = [{"id": b, "role": "attn", "layer": b, "bytes": i, "tier": "host"} for b in range(2000)]
        return {"status": {"controller_state": "ACTIVE", "semantic_block_count": i},
                "stats": {"prefetch_miss_count": i},
                "models": {"m": {"blocks": blocks, "residency": {"host_bytes": i}}}}

    tree.publish(snap(0))
    stop = threading.Event()
    bad, errors = [], []
    reads = [0]

    def check():
        status = (root / "status").read_bytes()
        fields = parse(status.decode())
        if set(fields) != {"controller_state", "semantic_block_count"} or not status.endswith(b"\n"):
            bad.append(status)
        blocks = (root / "models" / "m" / "blocks").read_bytes()
        lines = blocks.decode().splitlines()
        values = {line.rsplit("bytes=", 1)[1].split()[0] for line in lines}
        if len(lines) != 2000 or len(values) != 1:
            bad.append(blocks[:200])

    def reader():
        while not stop.is_set():
            try:
                check()
            except Exception as exc:  # noqa: BLE001 -- any failure of a read is the test's finding
                errors.append(exc)
            reads[0] += 1

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(1, 80):
            tree.publish(snap(i))
    finally:
        stop.set()
        thread.join()
    assert parse((root / "status").read_text())["semantic_block_count"] == "79"
    return reads[0], bad, errors


def test_concurrent_reader_never_sees_a_partial_file(tmp_path):
    reads, bad, errors = _hammer(tmp_path)
    assert reads > 10
    assert bad == [] and errors == []


def test_the_reader_check_catches_a_writer_that_is_not_atomic(tmp_path, monkeypatch):
    """The check above can fail: with files written in place, in two halves, it sees torn
    files, whether they fail its checks or its parsing."""
    import time

    from deepseek_flash.sysfs_shim import publisher

    def torn_write(path, data):
        with open(path, "wb") as f:
            f.write(data[:len(data) // 2])
            f.flush()
            time.sleep(0.002)
            f.write(data[len(data) // 2:])

    monkeypatch.setattr(publisher, "atomic_write", torn_write)
    reads, bad, errors = _hammer(tmp_path)
    assert bad or errors


def test_counters_end_in_total_and_gauges_never_do():
    # Prometheus naming: rate() belongs to counters, and a counter is recognised by "_total".
    snap = snapshot()
    snap["stats"].update(host_bytes_total=4096, hits=3, evictions_total=2)
    lines = render_metrics(snap).splitlines()
    types = dict(line.split()[2:4] for line in lines if line.startswith("# TYPE"))
    assert types["deepseek_flash_hits_total"] == "counter"
    assert types["deepseek_flash_evictions_total"] == "counter"        # not ..._total_total
    assert types["deepseek_flash_host_bytes_capacity"] == "gauge"
    assert "deepseek_flash_host_bytes_capacity 4096" in lines
    counters = [name for name, kind in types.items() if kind == "counter"]
    assert len(counters) >= 4
    assert all(name.endswith("_total") for name in counters), counters
    assert not [name for name, kind in types.items() if kind != "counter" and name.endswith("_total")]
