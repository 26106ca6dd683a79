"""Profile a cold GPU load through the daemon: the example the docs show for flash-profiler.

A daemon starts with an empty host arena; a client process connects, and once ``flash-profiler``
watches its pid, the client calls ``load_model`` on ``cuda:0`` with the page cache dropped and
generates a few tokens. The profiler writes the client's per-block load latencies (JSON) and the
heatmap (PNG).

    python bench/profile_cold.py --dir /var/tmp/flash-bench-quick --layers 4 --output-dir OUT
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import LLAMA_8B, drop_caches, write_finite_llama
from load import start_daemon

CLIENT = r"""
import sys, time
import torch
from deepseek_flash.client import Client
from deepseek_flash.client.model import load_model
c = Client(sys.argv[1], embedded=False)
print("ready", flush=True)
assert sys.stdin.readline().strip() == "go"
t = time.perf_counter()
m = load_model(sys.argv[2], device="cuda:0", client=c)
ids = torch.tensor([[1, 2, 3, 4]], device="cuda:0")
out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                 pad_token_id=0)
torch.cuda.synchronize()
print("done", round(time.perf_counter() - t, 3), out[0, 4:].tolist(), flush=True)
m.flash.close()
c.close()
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/var/tmp/flash-bench")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--duration", type=float, default=20.0, help="profiling window, s")
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args(argv)

    from deepseek_flash.store import pack

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.dir)
    src = write_finite_llama(work / "src", **{**LLAMA_8B, "layers": args.layers})
    store_dir = work / "store"
    if not (store_dir / "flash_metadata.bin").exists():
        pack(src, store_dir)
    runtime = Path(tempfile.mkdtemp(prefix="flash-prof-"))
    daemon = start_daemon(runtime, {"host_cache_bytes": "24GiB", "unified_memory_ratio": 0.5,
                                           "devices": [0]})
    try:
        sock = str(runtime / "control.sock")
        from deepseek_flash.client import Client

        with Client(sock, embedded=False) as probe:      # the arena is made at start, in the background
            deadline = time.time() + 120
            while not (probe.status().get("devices") or {}).get("cuda:0", {}).get("arena_bytes") \
                    and time.time() < deadline:
                time.sleep(0.5)
        client = subprocess.Popen([sys.executable, "-c", CLIENT, sock, str(store_dir)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "ready"
        drop_caches()
        prof = subprocess.Popen([sys.executable, "-m", "deepseek_flash.cli", "profile", "--pid",
                                 str(client.pid), "--duration", str(args.duration), "--quiet",
                                 "--output", str(out / "profile.json"), "--plot", str(out / "profile.png"),
                                 "--socket", sock], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The profiler says "profiling pid N" once its window has started.
        line = prof.stderr.readline()
        if "profiling pid" not in line:
            raise SystemExit(f"profiler did not start: {line}{prof.stderr.read()}")
        client.stdin.write("go\n")
        client.stdin.flush()
        done = client.stdout.readline().strip()
        stdout, stderr = prof.communicate(timeout=args.duration + 120)
        client.stdin.close()
        client.wait(60)
        print(done)
        print(stdout.strip(), stderr.strip())
        if prof.returncode:
            return prof.returncode
        doc = json.loads((out / "profile.json").read_text())
        print(json.dumps({"client": done, "sample_count": doc["sample_count"],
                          "bytes_loaded": doc["bytes_loaded"], "overall_latency_us": doc["overall_latency_us"]}))
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(runtime, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
