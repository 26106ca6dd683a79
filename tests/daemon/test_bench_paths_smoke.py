"""bench/paths.py --smoke (CI): the cold load right after a daemon starts, on the CPU with a tiny
model, first with a daemon that never served a client, then after its restart -- the import files
the first client reported are read ahead at the restarted daemon's start and lift the shallow reads."""
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "paths.py"


def test_the_paths_bench_smoke_learns_the_import_files_and_reads_them_ahead_after_a_restart(tmp_path):
    out = tmp_path / "paths.json"
    done = subprocess.run([sys.executable, str(BENCH), "--smoke", "--only", "shared_gpu_cold", "--dir",
                           str(tmp_path), "--beside-engine", "", "--output", str(out)],
                          capture_output=True, text=True, timeout=400,
                          # One small package read ahead without a manifest (the default list: ~400 MB).
                          env=dict(os.environ, OMP_NUM_THREADS="1",
                                   DEEPSEEK_FLASH_IMPORT_PACKAGES="packaging"))
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(out.read_text())
    cold = res["shared_gpu_cold"]
    first, again = cold, cold["after_restart"]
    assert cold["works"] is True and "error" not in first and "error" not in again
    assert first["cache_dropped"] is False           # the smoke never drops this machine's cache
    # First-ever: nothing learned; the packages' files read ahead instead, then full depth.
    assert (first["import_manifest_before"], first["import_manifest_after"]) == (False, True)
    assert first["imports_read_ahead"] is None
    assert first["packages_read_ahead"]["files"] > 10
    assert any("client 1 imports transformers.models.llama.modeling_llama" in ln
               for ln in first["daemon_log_pin"])
    assert any("reads at 8 x 4096 KiB (0 clients importing): import files read ahead for *" in ln
               for ln in first["daemon_log_pin"])
    # After the restart: the first client's files read ahead at start, then full depth.
    assert again["import_manifest_before"] is True and again["packages_read_ahead"] is None
    ahead = again["imports_read_ahead"]
    assert ahead["modules"] == 1 and ahead["files"] > 100 and ahead["bytes"] > 1 << 20
    assert any("reads at 8 x 4096 KiB (0 clients importing): import files read ahead for "
               "transformers.models.llama.modeling_llama" in ln for ln in again["daemon_log_pin"])
    for r in (first, again):
        assert r["request_to_loaded_s"] > 0 and r["phases_ms"]["imports_ms"] > 0
        assert r["vs_best_raw"] == round(r["gbps"] / 1.0, 3)
    assert set(res["goals"]) == {"default_load_beside_other_process", "cold_after_start>=0.95*raw",
                                 "cold_after_restart>=0.95*raw"}


def test_the_gpu_branch_runs_its_readers_other_process_and_both_cold_loads_on_cuda(tmp_path, monkeypatch):
    """The lines of shared_gpu_cold that only the GPU run reaches, on the CPU: the raw readers,
    the other process holding the GPU, both cold loads asked for on cuda:0 with the cache dropped
    and one state directory (the restart), and the CUDA-only helpers (fakes for torch.cuda)."""
    import argparse

    import torch
    from deepseek_flash.testing import bench_module

    bench = bench_module("paths")
    calls = []
    monkeypatch.setattr(bench, "drop_caches", lambda: calls.append("drop") or True)
    monkeypatch.setattr(bench, "python_direct_read",
                        lambda path, n, threads: calls.append(("odirect", n)) or 1.25)
    monkeypatch.setattr(bench, "dd_read", lambda path, n, bs: calls.append(("dd", n, bs)) or 1.0)
    monkeypatch.setattr(bench, "HOG_SCRIPT", "import sys, time; print('held', flush=True); time.sleep(60)")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (7, 9))

    def fake_cold(runtime, store_dir, best, nbytes, device, drop, state, alt=None):
        calls.append(("cold", runtime.name, best, nbytes, device, drop, state) + ((alt,) if alt else ()))
        return {"request_to_loaded_s": 1.0, "vs_best_raw": 0.5}

    monkeypatch.setattr(bench, "cold_in_fresh_process", fake_cold)
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 4096)
    args = argparse.Namespace(smoke=False, raw_bytes="all", hog="1KiB", restart=True, restarts=2,
                              skeleton_alone=False,
                              parallel_imports="", beside_engine="", diagnose=False,
                              alt='{"config": {"read_shape": "32x1MiB"}, "env": {"X": "1"}}',
                              output=str(tmp_path / "o.json"))
    res = {}
    bench.shared_gpu_cold_phase(res, args, tmp_path / "store", data, 1000)
    cold = res["shared_gpu_cold"]
    assert cold["best_raw_gbps"] == 1.25 and cold["gpu_free_with_other_process"] == 7
    assert cold["works"] is True
    state = calls[4][6]
    assert calls == ["drop", ("odirect", 4096), "drop", ("dd", 4096, 4 << 20),
                     ("cold", "first", 1.25, 1000, "cuda:0", True, state),
                     ("cold", "restarted0", 1.25, 1000, "cuda:0", True, state),
                     # --restarts 2: one more sample after a restart, the same state
                     ("cold", "restarted1", 1.25, 1000, "cuda:0", True, state),
                     # --alt: once more after a restart, the same state, the other configuration
                     ("cold", "alt", 1.25, 1000, "cuda:0", True, state,
                      {"config": {"read_shape": "32x1MiB"}, "env": {"X": "1"}})]
    assert cold["after_restart_alt"] == {"alt": {"config": {"read_shape": "32x1MiB"}, "env": {"X": "1"}},
                                         "request_to_loaded_s": 1.0, "vs_best_raw": 0.5}
    assert state.name == "state" and cold["after_restart"] == {"request_to_loaded_s": 1.0, "vs_best_raw": 0.5}
    assert cold["after_restart_more"] == [{"request_to_loaded_s": 1.0, "vs_best_raw": 0.5}]
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: seen.append("sync"))
    monkeypatch.setattr(torch.cuda, "init", lambda: seen.append("init"))
    monkeypatch.setattr(torch, "empty", lambda n, device: seen.append(("empty", n, device)))
    bench._sync("cpu")
    bench._sync("cuda:0")
    bench._cuda_ready("cuda:0")
    assert seen == ["sync", "init", ("empty", 1, "cuda:0")]
