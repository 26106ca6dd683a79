"""flash-profiler against the real daemon: a client subprocess (its pid known) acquires every layer
inside the window; the profile holds exactly the blocks it loaded, with their latencies; the PNG
is a PNG; samples of other processes and of before the window are left out; bad input exits 2."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from flashd_harness import Daemon, packed_model

from deepseek_flash.store import Store
from deepseek_flash.tools.profiler import percentile, summarize

CLIENT = """
import sys
from deepseek_flash.client import Client
c = Client(sys.argv[1], embedded=False)
m = c.open_model(sys.argv[2])
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "go":
        for layer in range(m.num_layers):
            c.release(c.acquire(m, layer=layer))
        print("done", flush=True)
    elif line.strip() == "quit":
        break
"""


def profiler_cmd(*argv):
    return [sys.executable, "-c", ("import sys; from deepseek_flash.cli import profiler_main; "
            "sys.exit(profiler_main())"), *argv]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return packed_model(tmp_path_factory.mktemp("prof"), "prof-tiny", num_layers=3)


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path / "d", {"host_cache_bytes": "64MiB"}).start()
    yield d
    assert d.stop() == 0
    d.cleanup()


def start_client(daemon, store):
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(daemon.socket), str(store)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def tell(proc, word):
    proc.stdin.write(word + "\n")
    proc.stdin.flush()


def test_profile_of_a_client_that_loads_every_layer(daemon, store, tmp_path):
    s = Store.open(store)
    other = start_client(daemon, store)     # loads everything before the window: not counted
    tell(other, "go")
    assert other.stdout.readline().strip() == "done"
    # Blocks that are resident cause no load: drop them so the profiled client reads from disk.
    with daemon.client() as c:
        tell(other, "quit")
        other.wait(10)
        assert c.unload(s.name)["freed_bytes"] > 0
    client = start_client(daemon, store)
    out, png = tmp_path / "profile.json", tmp_path / "profile.png"
    prof = subprocess.Popen(profiler_cmd("--pid", str(client.pid), "--duration", "2", "--output", str(out),
                                         "--plot", str(png), "--socket", str(daemon.socket)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert f"profiling pid {client.pid}" in prof.stderr.readline()
    tell(client, "go")
    assert client.stdout.readline().strip() == "done"
    stdout, stderr = prof.communicate(timeout=60)
    tell(client, "quit")
    client.wait(10)
    assert prof.returncode == 0, stderr
    assert stdout.splitlines()[-1] == f"wrote {out} and {png}"

    doc = json.loads(out.read_text())
    assert doc["pid"] == client.pid and len(doc["clients"]) == 1
    # The first acquire of layer 0 reads its dependencies (embeddings) too; head and final norm
    # are read with the last layer's window or on their own: every block of the model, once.
    loaded = {b["block"] for b in doc["blocks"]}
    layer_blocks = {b.id for b in s.blocks if b.layer >= 0}
    assert layer_blocks <= loaded <= {b.id for b in s.blocks}
    assert doc["sample_count"] == sum(b["loads"] for b in doc["blocks"]) == len(doc["samples"])
    assert doc["bytes_loaded"] == sum(s.block(b["block"]).length * b["loads"] for b in doc["blocks"])
    for b in doc["blocks"]:
        info = s.block(b["block"])
        assert (b["layer"], b["role"], b["bytes"]) == (info.layer, info.role, info.length)
        lat = b["block_load_latency_us"]
        assert len(lat) == b["loads"] and all(v >= 0 for v in lat)
        assert b["p50_us"] <= b["p95_us"] <= b["p99_us"] == percentile(lat, 99)
    o = doc["overall_latency_us"]
    assert o["count"] == doc["sample_count"]
    assert o["min"] <= o["p50"] <= o["p95"] <= o["p99"] <= o["max"]
    w = doc["window"]
    assert w["duration_s"] == 2.0 and all(w["start"] <= x["time"] <= w["end"] for x in doc["samples"])
    assert {(c["layer"], c["role"]) for c in doc["layer_role_p50_us"]} == \
        {(s.block(b).layer, s.block(b).role) for b in loaded}

    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100


def test_client_with_nothing_to_load_gives_an_empty_profile(daemon, store, tmp_path):
    client = start_client(daemon, store)
    out = tmp_path / "p.json"
    r = subprocess.run(profiler_cmd("--pid", str(client.pid), "--duration", "0.3", "--output", str(out),
                                    "--socket", str(daemon.socket)), check=False, capture_output=True, text=True,
                       timeout=60)
    tell(client, "quit")
    client.wait(10)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["sample_count"] == 0 and doc["blocks"] == [] and doc["overall_latency_us"]["p50"] is None


def test_unknown_pid_is_an_error(daemon, tmp_path):
    out = tmp_path / "p.json"
    r = subprocess.run(profiler_cmd("--pid", str(os.getpid()), "--duration", "1", "--output", str(out),
                                    "--socket", str(daemon.socket)), check=False, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert f"no client of pid {os.getpid()} is connected" in r.stderr
    assert "UnknownClient, code 405" in r.stderr
    assert not out.exists()


@pytest.mark.parametrize("argv, needle", [
    (["--duration", "0"], "must be > 0 seconds"),
    (["--duration", "-3"], "must be > 0 seconds"),
    (["--duration", "soon"], "not a number"),
    (["--pid", "0"], "must be >= 1"),
])
def test_bad_arguments_exit_2(tmp_path, argv, needle):
    base = {"--pid": "1", "--duration": "1", "--output": str(tmp_path / "p.json")}
    base.update(dict(zip(argv[::2], argv[1::2])))
    r = subprocess.run(profiler_cmd(*[x for kv in base.items() for x in kv]), check=False, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and needle in r.stderr


@pytest.mark.parametrize("flag", ["--output", "--plot"])
def test_missing_directory_exits_2(tmp_path, flag):
    paths = {"--output": str(tmp_path / "p.json"), "--plot": str(tmp_path / "p.png")}
    paths[flag] = str(tmp_path / "missing" / "x")
    r = subprocess.run(profiler_cmd("--pid", "1", "--duration", "1", *[x for kv in paths.items() for x in kv],
                                    "--socket", str(tmp_path / "none.sock")),
                       check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"{flag} {tmp_path / 'missing' / 'x'}: directory {tmp_path / 'missing'} does not exist" in r.stderr


def test_no_daemon_exits_2(tmp_path):
    sock = tmp_path / "none.sock"
    r = subprocess.run(profiler_cmd("--pid", "1", "--duration", "1", "--output", str(tmp_path / "p.json"),
                                    "--socket", str(sock)), check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"no daemon running at {sock}" in r.stderr and "DaemonNotRunning, code 600" in r.stderr


def test_summarize_groups_per_block_and_cell():
    rows = [{"time": 1.0 + i, "model": "m", "block": b, "layer": layer, "role": role, "latency_us": lat,
             "bytes": 4096} for i, (b, layer, role, lat) in enumerate(
                 [(1, 0, "attn", 10), (1, 0, "attn", 30), (2, 0, "mlp_down", 5), (0, -1, "embed", 7)])]
    doc = summarize({"pid": 5, "clients": [1], "start": 0.0, "end": 9.0, "duration_s": 9.0, "samples": rows})
    blocks = {b["block"]: b for b in doc["blocks"]}
    assert blocks[1]["block_load_latency_us"] == [10, 30] and blocks[1]["p50_us"] == 10
    assert blocks[1]["p99_us"] == 30 and blocks[1]["loads"] == 2
    assert doc["overall_latency_us"]["p50"] == 7 and doc["overall_latency_us"]["max"] == 30
    assert [(c["layer"], c["role"]) for c in doc["layer_role_p50_us"]] == \
        [(-1, "embed"), (0, "attn"), (0, "mlp_down")]
    assert doc["bytes_loaded"] == 4 * 4096


def test_help_explains_every_flag():
    r = subprocess.run(profiler_cmd("--help"), check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for flag in ("--pid", "--duration", "--output", "--plot", "--socket", "--quiet"):
        assert flag in r.stdout
