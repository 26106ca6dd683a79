"""Benchmark: the paths a user takes besides decoding -- a fresh process, a shared GPU, a fresh daemon.

Default configuration everywhere except the host cache size (the machine's sizing). On a packed
7-8B model (``--arch``; the store ``bench/stream.py`` or ``bench/load.py`` made in --dir):

* attach -- for each ``--host-caches`` size, a fresh ``deepseek-flashd`` holds the model on the
  GPU (loaded by this process); then new processes (torch, transformers and the model's class
  imported, CUDA context made) call ``load_model``: a streaming client (``--budget``) and a
  resident one, ms. The streaming client also times its first forward passes (copies run from
  pageable memory until its background page-locking of the streamed ranges ends) and, after
  closing, what page-locking the daemon's whole host arena costs in a new process (the old way);
* shared_gpu_cold -- another process holds ``--hog`` of GPU memory; ``deepseek-flashd`` starts
  with the default configuration and, right away, a client loads the model onto the GPU with the
  page cache dropped: request -> every layer on the GPU, GB/s vs the best raw reader (dd and the
  Python O_DIRECT reader) of the same file, by default all of it (the bytes the load reads), in
  the same run. The client is this process, which has imported torch but not transformers' model
  class (the user's fresh process; the goal). Where the time went: the load's phases, this
  process's and the daemon's CPU, the daemon's own load time (its log); then, no load running,
  the skeleton built in a fresh interpreter (``skeleton_alone``: the imports' own time on this
  machine; ``skeleton_alone_cold``: the same after dropping the page cache;
  ``skeleton_alone_cold_parallel``: the same with ``--parallel-imports`` packages imported on
  threads beside it -- whether the imports' system calls overlap on the machine;
  ``skeleton_beside_engine``: the same beside a process reading the model's file with the IO
  engine at each ``--beside-engine`` depth x request size, the daemon's ``read_shape``); with
  ``--diagnose`` also again beside ``dd`` reading the model's file (``skeleton_beside_dd``) and
  the cold load again after a fresh daemon start with the class imported
  (``model_class_imported``: the disk -> GPU path alone);
* imports (``--only imports``, no daemon, no GPU work) -- the skeleton's imports in a fresh
  interpreter, page cache dropped: alone, then beside the IO engine reading the model's file at
  each ``--beside-engine`` shape, and beside ``dd`` (4 MiB, one at a time): which read pattern
  slows the client's imports, and each reader's rate.

    python bench/paths.py --arch llama --dir /var/tmp/flash-bench --output paths.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import add_arch_argument, dd_read, drop_caches, emit, gbps, python_direct_read, save
from load import run_script, start_daemon, wait_loaded
from paths_imports import (  # noqa: F401 -- ENGINE_READER_SCRIPT, PARALLEL_IMPORTS: the tests' and --help's
    ENGINE_READER_SCRIPT,
    PARALLEL_IMPORTS,
    SKELETON_ALONE_SCRIPT,
    StackSampler,
    imports_phase,
    skeleton_beside_dd,
    skeleton_beside_engine,
)

ATTACH_SCRIPT = r"""
import sys, time, json
import torch, transformers
from deepseek_flash.client import Client
from deepseek_flash.client.model import load_model
from deepseek_flash.client.skeleton import build_skeleton
from deepseek_flash.cuda import register_host_memory, unregister_host_memory
from deepseek_flash.store import Store
store, sock, budget, forwards = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
build_skeleton(Store.open(store).config)          # the model's transformers class imported
torch.cuda.init()
torch.empty(1, device="cuda:0")
client = Client(socket_path=sock)
t = time.perf_counter()
model = load_model(store, device="cuda:0", client=client,
                   weight_budget=None if budget == "none" else budget)
out = {"load_model_ms": (time.perf_counter() - t) * 1e3, "phases_ms": model.flash.timings}
ids = torch.tensor([[1, 2, 3, 4]], device="cuda:0")
times = []
with torch.no_grad():
    for _ in range(forwards):
        t = time.perf_counter()
        out["token"] = model(ids).logits[0, -1].argmax().item()
        torch.cuda.synchronize()
        times.append(round(time.perf_counter() - t, 3))
out["forward_s"] = times
stream = model.flash.stream
if stream is not None:
    side = stream.host_side
    side._thread.join(timeout=120)
    out["streamed_ranges_pin_s"] = side.pin_seconds
    out["streamed_ranges_pinned_bytes"] = side.pinned_bytes
    out["plan"] = {"slots": stream.n, "window": stream.plan.window,
                   "streamed_layers": len(stream.layers)}
model.flash.close()
if stream is not None:
    # The option not taken: page-lock the daemon's whole host arena in this process.
    t = time.perf_counter()
    ok = register_host_memory(client.arena.address, client.arena.size)
    out["whole_arena_pin_s"] = round(time.perf_counter() - t, 3) if ok else None
    if ok:
        unregister_host_memory(client.arena.address)
client.close()
print(json.dumps(out))
"""

HOG_SCRIPT = r"""
import sys, time, torch
x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print("held", flush=True)
time.sleep(3600)
"""


def attach_phase(res, args, store_dir, nbytes) -> None:
    import torch
    from deepseek_flash.client import Client
    from deepseek_flash.client.model import load_model

    for cache in args.host_caches.split(","):
        runtime = Path(tempfile.mkdtemp(prefix="flash-paths-"))
        daemon = start_daemon(runtime, {"host_cache_bytes": cache})
        entry = res.setdefault("attach", {}).setdefault(cache, {})
        try:
            sock = runtime / "control.sock"
            c = Client(socket_path=str(sock))
            t = time.perf_counter()
            m = load_model(store_dir, device="cuda:0", client=c)
            wait_loaded(m)
            entry["first_load_s"] = round(time.perf_counter() - t, 3)
            m.flash.close()
            c.close()
            del m, c
            torch.cuda.empty_cache()
            fits = args.stream_forwards if _gib(cache) * (1 << 30) >= nbytes else 0
            entry["streaming"] = run_script(ATTACH_SCRIPT, store_dir, sock, args.budget, fits)
            entry["resident"] = run_script(ATTACH_SCRIPT, store_dir, sock, "none", 1)
        except SystemExit as exc:
            entry["error"] = str(exc)[-2000:]
        finally:
            daemon.terminate()
            daemon.wait(60)
            shutil.rmtree(runtime, ignore_errors=True)
        save(res, args.output)


DONE_LINE = re.compile(r"load of \S+ onto \S+ done: (\d+) bytes in ([0-9.]+) s")


def _proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (/proc/PID/stat), None where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _cold_load(runtime: Path, store_dir, best_raw: float, nbytes: int, device: str = "cuda:0",
               drop: bool = True, state: Path | None = None, config: dict | None = None) -> dict:
    """Start ``deepseek-flashd`` with every default, send the load at once (page cache dropped
    just before), time request -> every layer on the GPU -> first token, and say where the time
    went: the load's phases in this process, this process's CPU, the daemon's own load time (its
    log) and CPU. ``state``: the daemon's state directory (its learned import files: the same
    one as an earlier run's is the daemon after a restart); ``device``/``drop``: the smoke's CPU,
    page cache kept."""
    import torch
    from deepseek_flash.client import Client
    from deepseek_flash.client.model import load_model

    state = state or runtime / "state"
    manifest = state / "import-files.json"
    out = {"cache_dropped": drop_caches() if drop else False,
           # Other work on the machine's CPUs slows the client's imports (skeleton phase).
           "loadavg_1min_before": round(os.getloadavg()[0], 2),
           # Learned by an earlier client of a daemon with this state (read ahead at start).
           "import_manifest_before": manifest.exists()}
    t_spawn = time.perf_counter()
    daemon = start_daemon(runtime, config or {}, state=state)   # {}: every key at its default
    failure = None
    try:
        t_ready = time.perf_counter()
        c = Client(socket_path=str(runtime / "control.sock"))
        t_hello = time.perf_counter()
        d_cpu, p_cpu, th_cpu = _proc_cpu_s(daemon.pid), sum(os.times()[:2]), time.thread_time()
        t, t_wall = time.perf_counter(), time.time()
        reads = _ReadsSampler(str(runtime / "control.sock"), t).start()
        with StackSampler(threading.get_ident()) as sampler:
            m = load_model(store_dir, device=device, client=c)
        returned = time.perf_counter() - t
        th_cpu = time.thread_time() - th_cpu
        m.flash.wait_loaded()
        _sync(device)
        loaded = time.perf_counter() - t
        out["reads_timeline"] = reads.stop()
        d_cpu = None if d_cpu is None else _proc_cpu_s(daemon.pid) - d_cpu
        p_cpu = sum(os.times()[:2]) - p_cpu
        with torch.no_grad():
            m(torch.tensor([[1, 2, 3, 4]], device=device)).logits[0, -1].argmax().item()
        _sync(device)
        first_token = time.perf_counter() - t
        # On the daemon log's clock: where its lines fall against the request and `loaded`.
        out["request_at"] = _clock(t_wall)
        out["loaded_at"] = _clock(t_wall + loaded)
        out.update({"daemon_start_to_status_s": round(t_ready - t_spawn, 3),
                    # The user's whole wait: daemon spawned -> every layer on the GPU.
                    "daemon_start_to_hello_s": round(t_hello - t_spawn, 3),
                    "daemon_start_to_loaded_s": round(t - t_spawn + loaded, 3),
                    "load_model_returned_s": round(returned, 3),
                    "request_to_loaded_s": round(loaded, 3), "gbps": gbps(nbytes, loaded),
                    "vs_best_raw": round(gbps(nbytes, loaded) / best_raw, 3),
                    "request_to_first_token_s": round(first_token, 3),
                    "phases_ms": m.flash.timings,
                    "load_model_thread_cpu_s": round(th_cpu, 3),
                    "process_cpu_s_until_loaded": round(p_cpu, 3),
                    "daemon_cpu_s_until_loaded": None if d_cpu is None else round(d_cpu, 3),
                    "load_model_profile": sampler.report()})
        imports = m.flash.imports
        # The skeleton's imports on their own thread (started after open_model): their time.
        out["imports_thread_s"] = None if imports is None else round(imports.seconds or 0, 3)
        out["imports_thread_cpu_s"] = None if imports is None else round(imports.cpu_seconds or 0, 3)
        # How long the daemon read shallow (one 4 MiB read at a time) for these imports.
        out["shallow_read_s"] = m.flash.shallow_read_s
        m.flash.close()
        c.close()
    except Exception as exc:   # noqa: BLE001 -- recorded with the daemon's own account of it
        failure = exc
    finally:
        daemon.terminate()
        daemon.wait(60)
    out["import_manifest_after"] = manifest.exists()
    log = (runtime / "daemon.log").read_text()
    # What the daemon read ahead at start: the learned import files, or (no manifest yet) the
    # packages' files.
    ahead = AHEAD_LINE.search(log)
    out["imports_read_ahead"] = None if ahead is None else {
        "modules": int(ahead.group(1)), "files": int(ahead.group(2)), "bytes": int(ahead.group(3)),
        "seconds": float(ahead.group(4))}
    ahead = PACKAGES_LINE.search(log)
    out["packages_read_ahead"] = None if ahead is None else {
        "files": int(ahead.group(1)), "bytes": int(ahead.group(2)), "seconds": float(ahead.group(3))}
    if failure is not None:
        lines = log.splitlines()
        out["error"] = f"{type(failure).__name__}: {failure}"[-2000:]
        out["daemon_log_errors"] = [ln[-600:] for ln in lines
                                    if " ERROR " in ln or "failed" in ln or "Error" in ln][:20]
        out["daemon_log_tail"] = [ln[-400:] for ln in lines[-40:]]
        return out
    done = DONE_LINE.search(log)
    if done:
        # The daemon's side alone: attach -> every block copied to the GPU.
        seconds = float(done.group(2))
        out["daemon_load_s"] = seconds
        out["daemon_load_gbps"] = gbps(int(done.group(1)), seconds)
        out["daemon_load_vs_best_raw"] = round(out["daemon_load_gbps"] / best_raw, 3)
        # The daemon's side after the request: its attach (CUDA's start) and then its load.
        attach_s = out["phases_ms"].get("attach_ms", 0) / 1e3
        out["daemon_side_after_request_s"] = round(attach_s + seconds, 3)
        out["daemon_side_vs_best_raw"] = round(gbps(nbytes, attach_s + seconds) / best_raw, 3)
    out["daemon_log_pin"] = [ln for ln in log.splitlines()
                             if "page-locked" in ln or "segment" in ln or " done: " in ln
                             or "reads at " in ln or "beyond the host arena" in ln
                             or "faulted in" in ln or "IO engine" in ln or "import" in ln
                             or "ceiling" in ln or "read-ahead" in ln or "opened model" in ln
                             or "compiled" in ln][:40]
    return out


class _ReadsSampler:
    """The daemon's ``bytes_read_nvme`` every ``interval`` s from ``t0`` on (its own connection):
    ``[[seconds after the request, GB read], ...]`` -- the disk's rate through the load."""

    def __init__(self, sock: str, t0: float, interval: float = 0.25):
        self.sock, self.t0, self.interval = sock, t0, interval
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-reads-sampler")

    def start(self) -> _ReadsSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        from deepseek_flash.client import Client

        try:
            with Client(socket_path=self.sock) as c:
                while True:
                    got = c.stats()["bytes_read_nvme"]
                    self.samples.append([round(time.perf_counter() - self.t0, 2), round(got / 1e9, 3)])
                    if self._stop.wait(self.interval):
                        return
        except Exception as exc:   # noqa: BLE001 -- a diagnostic: recorded, never fails the load
            self.samples.append(["error", f"{type(exc).__name__}: {exc}"[:200]])

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(10)
        return self.samples


def _clock(wall: float) -> str:
    """``wall`` (time.time()) as the daemon log stamps its lines: ``2026-12-02 07:46:51,127``."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall)) + f",{int(wall % 1 * 1000):03d}"


AHEAD_LINE = re.compile(r"read ahead the imports of (\d+) modules: (\d+) files \((\d+) bytes\)"
                        r".* in ([0-9.]+) s")
PACKAGES_LINE = re.compile(r"read ahead the packages' files \(no manifest yet\): (\d+) files \((\d+) bytes\)"
                           r".* in ([0-9.]+) s")


def cold_in_fresh_process(runtime: Path, store_dir, best_raw: float, nbytes: int, device: str,
                          drop: bool, state: Path, alt: dict | None = None) -> dict:
    """``_cold_load`` in a new interpreter that has imported torch (and made its CUDA context),
    not the model's transformers class: the user's fresh process, for every cold load of the run
    alike (this one may have imported more). ``alt``: ``{"config": {...}, "env": {...}}``, the
    daemon started with that flash.json and those environment variables instead of the defaults
    (``--alt``; a comparison, never the goal's figure)."""
    spec = json.dumps({"runtime": str(runtime), "store": str(store_dir), "best_raw": best_raw,
                       "nbytes": nbytes, "device": device, "drop": drop, "state": str(state),
                       "alt": alt})
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--cold-client", spec],
                          capture_output=True, text=True, check=False, timeout=600)
    lines = [ln for ln in done.stdout.strip().splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        return {"error": f"cold client exited {done.returncode}: {done.stderr[-3000:]}"}
    return json.loads(lines[-1])


def _sync(device: str) -> None:
    """Wait for ``device``'s work (a CUDA device's; the CPU's is done)."""
    import torch

    if device != "cpu":
        torch.cuda.synchronize()


def _cuda_ready(device: str) -> None:
    """This process's CUDA context made, as the user's process that has used the GPU has it."""
    import torch

    torch.cuda.init()
    torch.empty(1, device=device)


def _cold_client(spec: str) -> int:
    """``--cold-client``: the fresh process of ``cold_in_fresh_process``."""
    import torch  # noqa: F401 -- what a user's process has imported

    import deepseek_flash.client.model  # noqa: F401
    s = json.loads(spec)
    alt = s.get("alt") or {}
    os.environ.update({k: str(v) for k, v in (alt.get("env") or {}).items()})   # the daemon's
    if s["device"] != "cpu":
        _cuda_ready(s["device"])
    out = _cold_load(Path(s["runtime"]), s["store"], s["best_raw"], s["nbytes"], device=s["device"],
                     drop=s["drop"], state=Path(s["state"]), config=alt.get("config") or {})
    print(json.dumps(out))
    return 0


def shared_gpu_cold_phase(res, args, store_dir, data, nbytes) -> None:
    """Raw readers of the model's file (by default all of it: the bytes the load reads), then,
    beside another process holding ``--hog`` of the GPU: (1) the user's path -- a fresh process
    that has imported torch but not the model's transformers class loads the model right after
    the daemon starts (the goal), first with a daemon that never served a client (no learned
    import files), then after a restart of that daemon (the files the first client's imports
    opened are read ahead at start: ``after_restart``); (2) with ``--skeleton-alone`` the same
    skeleton built in a fresh interpreter with no load running (the interpreter's own import time
    on this machine), then beside readers of the model's file; (3) with ``--diagnose`` the cold
    load again after a fresh daemon start, the model class imported now (the disk -> GPU path
    alone). ``--smoke``: a tiny model on the CPU, no other process, no raw readers (1 GB/s), the
    page cache kept."""
    import torch
    from deepseek_flash.daemon.config import parse_size

    out = res.setdefault("shared_gpu_cold", {})
    device = "cpu" if args.smoke else "cuda:0"
    if args.smoke:
        best = out["best_raw_gbps"] = 1.0
    else:
        size = os.path.getsize(data)
        raw = size if args.raw_bytes == "all" else min(size, parse_size("raw", args.raw_bytes))
        drop_caches()
        out["python_odirect_gbps"] = python_direct_read(str(data), raw, threads=8)
        drop_caches()
        out["dd_direct_gbps"] = dd_read(str(data), raw, bs=4 << 20)
        out["raw_bytes_read"] = raw
        best = out["best_raw_gbps"] = max(out["python_odirect_gbps"], out["dd_direct_gbps"])
    hog = None
    if not args.smoke:
        hog = subprocess.Popen([sys.executable, "-c", HOG_SCRIPT, str(parse_size("hog", args.hog))],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runtimes = [Path(tempfile.mkdtemp(prefix="flash-paths-"))]
    state = runtimes[0] / "state"       # one daemon's state: fresh now, kept across its restart
    try:
        if hog is not None:
            if hog.stdout.readline().strip() != "held":
                out["error"] = f"the other process could not hold {args.hog}: {hog.stderr.read()[-2000:]}"
                return
            free, total = torch.cuda.mem_get_info(0)
            out["gpu_free_with_other_process"] = free
            out["gpu_total"] = total
        out.update(cold_in_fresh_process(runtimes[0] / "first", store_dir, best, nbytes, device,
                                         not args.smoke, state))
        out["works"] = "error" not in out
        save(res, args.output)
        for i in range(args.restarts if args.restart else 0):
            # The same daemon (its state) restarted, page cache dropped again, a new client;
            # after_restart, then (--restarts N) more samples of the same in after_restart_more.
            got = cold_in_fresh_process(runtimes[0] / f"restarted{i}", store_dir, best, nbytes,
                                        device, not args.smoke, state)
            if i == 0:
                out["after_restart"] = got
            else:
                out.setdefault("after_restart_more", []).append(got)
            out["works"] = out["works"] and "error" not in got
            save(res, args.output)
        alt = json.loads(args.alt) if getattr(args, "alt", "") else None
        if alt is not None:
            # The same again with another daemon configuration (a comparison in the same run).
            out["after_restart_alt"] = {"alt": alt, **cold_in_fresh_process(
                runtimes[0] / "alt", store_dir, best, nbytes, device, not args.smoke, state, alt)}
            save(res, args.output)
        if args.skeleton_alone:
            out["skeleton_alone"] = run_script(SKELETON_ALONE_SCRIPT, store_dir)
            save(res, args.output)
            # The same with the page cache dropped first, no load running: how much of the
            # imports' time beside the cold load is the cold cache, how much the load beside them.
            out["skeleton_alone_cold"] = {"cache_dropped": drop_caches(),
                                          **run_script(SKELETON_ALONE_SCRIPT, store_dir)}
            save(res, args.output)
        if args.parallel_imports:
            # The same, with self-contained packages imported on threads beside the build: do
            # the imports' system calls overlap on this machine (they hold no interpreter lock)?
            out["skeleton_alone_cold_parallel"] = {
                "cache_dropped": drop_caches(),
                **run_script(SKELETON_ALONE_SCRIPT, store_dir, args.parallel_imports)}
            out["skeleton_alone_cold_parallel"].pop("profile", None)
            save(res, args.output)
        for spec in filter(None, args.beside_engine.split(",")):
            out.setdefault("skeleton_beside_engine", {})[spec] = skeleton_beside_engine(store_dir, data, spec)
            save(res, args.output)
        if not args.diagnose:
            return
        # The same beside a plain reader of the model's file (dd, no daemon): whether any disk
        # stream slows the imports on this machine, or the daemon's load in particular.
        out["skeleton_beside_dd"] = skeleton_beside_dd(store_dir, data)
        save(res, args.output)
        runtimes.append(Path(tempfile.mkdtemp(prefix="flash-paths-")))
        out["model_class_imported"] = _cold_load(runtimes[-1], store_dir, best, nbytes)
    except Exception as exc:   # noqa: BLE001 -- recorded: the run goes on to print its table
        out.setdefault("works", False)
        out["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        for runtime in runtimes:
            shutil.rmtree(runtime, ignore_errors=True)
        save(res, args.output)


SMOKE_STORE_SCRIPT = r"""
import sys
from pathlib import Path
from deepseek_flash.store import pack
from deepseek_flash.testing import make_tiny_model
out = Path(sys.argv[2])
pack(make_tiny_model(out.parent / "src", sys.argv[1], num_layers=2), out)
"""


def _gib(text: str) -> float:
    from deepseek_flash.daemon.config import parse_size

    return parse_size("size", text) / (1 << 30)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/var/tmp/flash-bench")
    add_arch_argument(parser)
    parser.add_argument("--budget", default="8GiB")
    parser.add_argument("--host-caches", default="4GiB,40GiB")
    parser.add_argument("--stream-forwards", type=int, default=6)
    parser.add_argument("--hog", default="100GiB", help="GPU memory another process holds")
    parser.add_argument("--raw-bytes", default="all",
                        help="bytes of the model's file the raw readers read (all: what the load reads)")
    parser.add_argument("--only", choices=("all", "attach", "shared_gpu_cold", "imports"),
                        default="all")
    parser.add_argument("--diagnose", action="store_true",
                        help="shared_gpu_cold: also the skeleton beside dd and a second cold load "
                             "with the model class imported (~40 s more)")
    parser.add_argument("--beside-engine", default="32x1MiB,4x4MiB",
                        help="shared_gpu_cold: the skeleton (cache dropped) beside a process reading "
                             "the model's file with the IO engine at DEPTHxREQUEST, for each "
                             "(the daemon's read_shape is 8x4MiB, formerly 32x1MiB); '' to skip "
                             "(~12 s each)")
    parser.add_argument("--parallel-imports", default="",
                        help="shared_gpu_cold: packages imported on threads beside a cold skeleton "
                             "build (skeleton_alone_cold_parallel; e.g. PARALLEL_IMPORTS' list: "
                             "14.2 s against 12.5 s without on the H200); '' (default) skips it")
    parser.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                        help="shared_gpu_cold: the cold load again after restarting the daemon "
                             "(after_restart: the import files the first client reported read "
                             "ahead at start; ~25 s)")
    parser.add_argument("--restarts", type=int, default=1,
                        help="shared_gpu_cold: cold loads after a restart of the same daemon, each "
                             "one more sample (the first is after_restart, the others "
                             "after_restart_more; ~25 s each)")
    parser.add_argument("--skeleton-alone", action="store_true",
                        help="shared_gpu_cold: the skeleton built alone, warm and cache dropped (~25 s)")
    parser.add_argument("--smoke", action="store_true",
                        help="shared_gpu_cold on the CPU with a tiny model made in --dir (CI)")
    parser.add_argument("--alt", default="",
                        help="shared_gpu_cold: one more cold load after a restart with the daemon "
                             "started with another configuration, JSON {\"config\": {flash.json "
                             "keys}, \"env\": {variables}} (after_restart_alt; ~25 s)")
    parser.add_argument("--cold-client", help=argparse.SUPPRESS)
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    if args.cold_client:
        return _cold_client(args.cold_client)

    import torch

    from deepseek_flash.store import Store

    store_dir = Path(args.dir) / args.arch / "store"
    if args.smoke:
        if args.only != "shared_gpu_cold":
            parser.error("--smoke runs --only shared_gpu_cold")
        store_dir = Path(args.dir) / f"paths-smoke-{args.arch}" / "store"
        if not store_dir.exists():
            # Made in a process of its own: the cold clients' imports must be this run's.
            subprocess.run([sys.executable, "-c", SMOKE_STORE_SCRIPT, args.arch, str(store_dir)], check=True)
    store = Store.open(store_dir)
    nbytes = store.total_bytes
    res = {"benchmark": "paths", "arch": args.arch, "date": datetime.date.today().isoformat(),
           "host": platform.node(),
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "model_bytes": nbytes}
    if args.only in ("all", "attach"):
        attach_phase(res, args, store_dir, nbytes)
    if args.only in ("all", "shared_gpu_cold"):
        shared_gpu_cold_phase(res, args, store_dir, store.data_path(store.blocks[0]), nbytes)
    if args.only == "imports":
        imports_phase(res, args, store_dir, store.data_path(store.blocks[0]))
    goals = {}
    for cache, entry in res.get("attach", {}).items():
        for kind in ("streaming", "resident"):
            if kind in entry:
                goals[f"{kind}_attach<100ms@{cache}"] = entry[kind]["load_model_ms"] < 100
    cold = res.get("shared_gpu_cold", {})
    if "works" in cold:
        goals["default_load_beside_other_process"] = cold["works"]
    if "vs_best_raw" in cold:
        # The first load a daemon ever serves (nothing learned yet), then after its restart.
        goals["cold_after_start>=0.95*raw"] = cold["vs_best_raw"] >= 0.95
    if "vs_best_raw" in cold.get("after_restart", {}):
        goals["cold_after_restart>=0.95*raw"] = cold["after_restart"]["vs_best_raw"] >= 0.95
    for i, more in enumerate(cold.get("after_restart_more", []), 2):
        if "vs_best_raw" in more:
            goals[f"cold_after_restart_{i}>=0.95*raw"] = more["vs_best_raw"] >= 0.95
    res["goals"] = goals
    emit(res, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
