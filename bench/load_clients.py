"""Many client processes hammering one daemon: N processes x M acquire/release round trips.

Starts its own ``deepseek-flashd`` (temp runtime dir, a tiny packed model unless ``--store``),
warms the model, then runs ``--clients`` worker processes that each connect, open the model, wait
for a common start signal and do ``--rounds`` acquire+release of a resident layer. Reports, as
JSON: round trips per second (all clients) against the limit measured in the same run (one client
alone, the same loop), errors, leases left behind, and the daemon's memory before and after
(anonymous RSS and host arena use) -- the run passes only with zero errors, zero leaked leases and
memory back at its baseline.

    python bench/load_clients.py --clients 64 --rounds 10000 [--store PATH] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Anonymous RSS the daemon may keep after the run (allocator high-water marks, per-connection
# buffers returned to Python's pools rather than the OS).
RSS_SLACK = 16 << 20


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(socket_path: str, model: str, rounds: int) -> int:
    from deepseek_flash.client import Client

    errors = 0
    with Client(socket_path, embedded=False) as c:
        info = c.open_model(model)
        layers = info.num_layers
        print("ready", flush=True)
        sys.stdin.readline()                      # the common start signal
        start = time.perf_counter()
        for i in range(rounds):
            try:
                c.release(c.acquire(info, layer=i % layers))
            except Exception as exc:   # noqa: BLE001 -- counted and reported
                errors += 1
                if errors < 4:
                    print(f"error: {exc!r}", file=sys.stderr, flush=True)
        elapsed = time.perf_counter() - start
    print(json.dumps({"rounds": rounds, "errors": errors, "elapsed_s": elapsed}), flush=True)
    return 0


def start_daemon(workdir: Path, store: Path):
    runtime = workdir / "rt"
    config = workdir / "flash.json"
    config.write_text(json.dumps({"host_cache_bytes": "64MiB", "store_roots": [str(store.parent)],
                                  "prefetch_window": 0, "max_outstanding_requests_per_client": 64}))
    env = dict(os.environ, DEEPSEEK_FLASH_RUNTIME_DIR=str(runtime),
               DEEPSEEK_FLASH_SOCKET=str(runtime / "control.sock"), DEEPSEEK_FLASH_CONFIG=str(config))
    env.pop("NOTIFY_SOCKET", None)
    from deepseek_flash.ops.install_units import daemon_argv

    cmd = daemon_argv()
    log = open(workdir / "daemon.log", "wb")  # noqa: SIM115 -- the daemon's life
    proc = subprocess.Popen([*cmd, "--log-level", "warning"], env=env, stdout=log, stderr=subprocess.STDOUT)
    sock = runtime / "control.sock"
    from deepseek_flash.client import Client

    from deepseek_flash.errors import DaemonNotRunning

    deadline = time.monotonic() + 30
    while True:
        try:
            Client(sock, embedded=False).close()
            return proc, sock
        except DaemonNotRunning:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"deepseek-flashd did not start: {(workdir / 'daemon.log').read_text()}")
            time.sleep(0.05)


def run(clients: int, rounds: int, store: Path | None) -> dict:
    from deepseek_flash.client import Client

    workdir = Path(tempfile.mkdtemp(prefix="dfl-", dir="/tmp"))
    try:
        if store is None:
            from deepseek_flash.store import pack
            from deepseek_flash.testing import make_tiny_model

            src = make_tiny_model(workdir / "src", num_layers=4)
            (workdir / "stores").mkdir()
            store = pack(src, workdir / "stores" / "tiny")
        proc, sock = start_daemon(workdir, store)
        try:
            with Client(sock, embedded=False) as c:
                info = c.open_model(store.name)
                c.load(info)                                   # every layer resident: warm path
                # The limit measured in this run: one client alone, the same loop.
                n = max(1000, min(rounds, 5000))
                t = time.perf_counter()
                for i in range(n):
                    c.release(c.acquire(info, layer=i % info.num_layers))
                single = n / (time.perf_counter() - t)
                before = c.stats()
            rss_before = rss_anon(proc.pid)
            procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(sock), store.name,
                                       str(rounds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True) for _ in range(clients)]
            for p in procs:
                line = p.stdout.readline().strip()
                if line != "ready":
                    raise RuntimeError(f"worker {p.pid} did not start: {line!r}")
            with Client(sock, embedded=False) as c:
                connected = c.stats()["connected_clients"] - 1
            start = time.perf_counter()
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            results = []
            for p in procs:
                out, _ = p.communicate(timeout=3600)
                results.append(json.loads(out.strip().splitlines()[-1]) if p.returncode == 0 else
                               {"rounds": rounds, "errors": rounds, "elapsed_s": 0.0})
            wall = time.perf_counter() - start
            time.sleep(0.5)                                   # disconnects processed
            with Client(sock, embedded=False) as c:
                after = c.stats()
            rss_after = rss_anon(proc.pid)
            total = sum(r["rounds"] for r in results)
            errors = sum(r["errors"] for r in results)
            out = {
                "clients": clients, "rounds_per_client": rounds, "round_trips": total,
                "connected_at_start": connected,
                "errors": errors, "leaked_leases": after["active_leases"],
                "clients_left": after["connected_clients"] - 1,
                "wall_s": round(wall, 2),
                "throughput_rt_per_s": round(total / wall),
                "mean_rt_us_per_client": round(1e6 * sum(r["elapsed_s"] for r in results) / total, 1),
                "limit_single_client_rt_per_s": round(single),
                "ratio_vs_single_client": round(total / wall / single, 3),
                "daemon_rss_anon_before": rss_before, "daemon_rss_anon_after": rss_after,
                "rss_slack": RSS_SLACK,
                "host_bytes_used_before": before["host_bytes_used"],
                "host_bytes_used_after": after["host_bytes_used"],
                "cpus": os.cpu_count(),
            }
            out["ok"] = (errors == 0 and out["leaked_leases"] == 0 and out["clients_left"] == 0
                         and out["connected_at_start"] == clients
                         and rss_after - rss_before < RSS_SLACK
                         and out["host_bytes_used_after"] == out["host_bytes_used_before"])
            return out
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--rounds", type=int, default=10_000)
    p.add_argument("--store", type=Path, default=None, help="a packed store (default: a tiny model)")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args(argv)
    result = run(args.clients, args.rounds, args.store)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
