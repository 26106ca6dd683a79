"""RPC latency: acquire/release round trips to a real ``deepseek-flashd`` on warm blocks.

Starts the daemon on a temp runtime dir with a tiny packed model, then runs 1 and 16 client
processes that each time ``acquire(blocks=[b])`` and ``release(lease)`` one request at a time.
The limit, measured in the same run with the same client and message sizes, is a Python
``selectors`` echo server over the same kind of Unix socket: what one event loop and the
transport cost before any controller work (on a VM mostly the cross-CPU wake-ups). Each client
count runs with every ``--spin-us`` (the client's reply polling before it sleeps). Prints JSON.

    python bench/rpc.py [--iterations 4000] [--clients 1 16] [--spin-us 0 40] [--output rpc.json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_P50_US = 50.0
GOAL_P99_US = 500.0


def percentiles(values):
    values = sorted(values)
    n = len(values)
    return {"p50": round(values[n // 2], 1), "p99": round(values[min(n - 1, int(n * 0.99))], 1),
            "mean": round(sum(values) / n, 1), "n": n}


# --- the limit: an echo server --------------------------------------------------------------------

def echo_server(path: str, ready) -> None:
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(64)
    lst.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(lst, selectors.EVENT_READ)
    ready.set()
    while True:
        for key, _ in sel.select():
            if key.fileobj is lst:
                conn, _ = lst.accept()
                conn.setblocking(False)
                sel.register(conn, selectors.EVENT_READ)
                continue
            try:
                data = key.fileobj.recv(1 << 16)
            except BlockingIOError:
                continue
            if not data:
                sel.unregister(key.fileobj)
                key.fileobj.close()
                continue
            key.fileobj.send(data)


def echo_client(path: str, iterations: int, cpus, barrier, out) -> None:
    from deepseek_flash import protocol

    if cpus:
        os.sched_setaffinity(0, cpus)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    reader = protocol.MessageReader(s, 1 << 20)
    msg = protocol.request(1, "acquire", {"model": "tiny", "blocks": [5], "priority": 0, "wait": True})
    for _ in range(200):
        s.sendall(msg)
        reader.read()
    barrier.wait()
    lat = []
    for _ in range(iterations):
        t = time.perf_counter_ns()
        s.sendall(msg)
        reader.read()
        lat.append((time.perf_counter_ns() - t) / 1e3)
    out.put(lat)


# --- the daemon -----------------------------------------------------------------------------------

def rpc_client(path: str, block: int, iterations: int, spin_us: float, cpus, barrier, out) -> None:
    from deepseek_flash.client import Client

    if cpus:
        os.sched_setaffinity(0, cpus)
    c = Client(path, embedded=False, spin_us=spin_us)
    info = c.open_model("tiny")
    for _ in range(200):
        c.release(c.acquire(info, blocks=[block]))
    barrier.wait()
    acq, rel = [], []
    for _ in range(iterations):
        t0 = time.perf_counter_ns()
        lease = c.acquire(info, blocks=[block])
        t1 = time.perf_counter_ns()
        c.release(lease)
        t2 = time.perf_counter_ns()
        acq.append((t1 - t0) / 1e3)
        rel.append((t2 - t1) / 1e3)
    c.close()
    out.put((acq, rel))


def run_group(ctx, target, args_for, n: int):
    barrier = ctx.Barrier(n)
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_for(i), barrier, out)) for i in range(n)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=4000, help="round trips per client (1 client)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--spin-us", type=float, nargs="+", default=[0.0],
                    help="client reply polling before sleeping (Client(spin_us=...)), one row each")
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args(argv)

    from deepseek_flash.store import Store, pack
    from deepseek_flash.testing import make_tiny_model

    ctx = mp.get_context("spawn")
    tmp = Path(tempfile.mkdtemp(prefix="df-rpc-", dir="/tmp"))
    (tmp / "stores").mkdir()
    store_path = pack(make_tiny_model(tmp / "src", num_layers=4), tmp / "stores" / "tiny")
    layer_blocks = [b.id for b in Store.open(store_path).blocks if b.layer >= 0]
    (tmp / "flash.json").write_text(json.dumps({"host_cache_bytes": "64MiB",
                                                "store_roots": [str(tmp / "stores")]}))
    sock = tmp / "rt" / "control.sock"
    env = dict(os.environ, DEEPSEEK_FLASH_RUNTIME_DIR=str(tmp / "rt"), DEEPSEEK_FLASH_SOCKET=str(sock),
               DEEPSEEK_FLASH_CONFIG=str(tmp / "flash.json"))
    env.pop("NOTIFY_SOCKET", None)
    log = open(tmp / "daemon.log", "wb")  # noqa: SIM115 -- the daemon's log for its whole life
    daemon = subprocess.Popen([sys.executable, "-m", "deepseek_flash.daemon.app", "--log-level", "warning"],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"deepseek-flashd did not start: {(tmp / 'daemon.log').read_text()}")
            time.sleep(0.05)

        echo_path = str(tmp / "echo.sock")
        ready = ctx.Event()
        echo = ctx.Process(target=echo_server, args=(echo_path, ready), daemon=True)
        echo.start()
        ready.wait(30)

        # Where the processes run decides most of a round trip on a VM: a wake-up on another CPU
        # costs tens of microseconds, on the same CPU a few. One client runs both placements
        # (server on CPU 0, client on CPU 1 or 0); many clients run where the scheduler puts them.
        all_cpus = sorted(os.sched_getaffinity(0))
        results = []
        for n in args.clients:
            if n == 1 and len(all_cpus) > 1:
                placements = {"cross_cpu": {all_cpus[1]}, "same_cpu": {all_cpus[0]}}
                server_cpus = {all_cpus[0]}
            else:
                placements = {"any": None}
                server_cpus = set(all_cpus)
            for pid in (daemon.pid, echo.pid):
                os.sched_setaffinity(pid, server_cpus)
            iterations = max(500, args.iterations // n)
            for placement, cpus in placements.items():
                echo_lat = run_group(ctx, echo_client,
                                     lambda i, it=iterations, c=cpus: (echo_path, it, c), n)
                limit = percentiles([x for lat in echo_lat for x in lat])
                for spin in args.spin_us:
                    rpc = run_group(ctx, rpc_client,
                                    lambda i, it=iterations, sp=spin, c=cpus:
                                    (str(sock), layer_blocks[i % len(layer_blocks)], it, sp, c), n)
                    row = {"clients": n, "placement": placement, "spin_us": spin,
                           "iterations_per_client": iterations,
                           "acquire_us": percentiles([x for a, _ in rpc for x in a]),
                           "release_us": percentiles([x for _, r in rpc for x in r]),
                           "limit_echo_us": limit}
                    row["acquire_vs_limit_p50"] = round(row["acquire_us"]["p50"] / limit["p50"], 2)
                    row["meets_goal"] = all(row[k]["p50"] < GOAL_P50_US and row[k]["p99"] < GOAL_P99_US
                                            for k in ("acquire_us", "release_us"))
                    results.append(row)
        echo.terminate()
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(30)
        log.close()

    report = {"bench": "rpc", "date": time.strftime("%Y-%m-%d"), "machine": platform.node(),
              "cpus": os.cpu_count(), "python": platform.python_version(),
              "goal_us": {"p50": GOAL_P50_US, "p99": GOAL_P99_US}, "daemon_exit": rc,
              "results": results}
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
