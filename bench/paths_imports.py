"""The client's imports measured for bench/paths.py: the skeleton built in a fresh interpreter,
alone or beside a reader of the model's file (the IO engine at a given shape, or dd), and where
a thread spends its time (``StackSampler``, shared with the cold load's client).

``--only imports`` of bench/paths.py (``imports_phase``) and the diagnostics of its
``shared_gpu_cold`` phase use these; the module docstring of bench/paths.py says what each
measures.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from _common import drop_caches, save
from load import run_script


# Where a thread spends its time: its innermost Python frame every 20 ms (a C call such as a
# file read or stat shows as the frame that made it), and the module whose body runs (an import)
# by package. Shared by this process and the script below.
SAMPLER = r"""
import collections, os, sys, threading, time


class StackSampler:
    def __init__(self, ident, interval=0.02):
        self.ident, self.interval = ident, interval
        self.where, self.module, self.samples = collections.Counter(), collections.Counter(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.wait(self.interval):
            # load_model imports on a thread of its own while the caller waits: sample that one.
            ident = next((t.ident for t in threading.enumerate()
                          if t.name == "flash-skeleton-imports"), self.ident)
            frame = sys._current_frames().get(ident)
            if frame is None:
                continue
            self.samples += 1
            code = frame.f_code
            self.where[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1
            while frame is not None and frame.f_code.co_name != "<module>":
                frame = frame.f_back
            name = "-" if frame is None else (frame.f_globals.get("__name__") or "?")
            self.module[name.split(".")[0]] += 1

    def report(self, top=15):
        share = lambda c: {k: round(v / max(self.samples, 1), 3) for k, v in c.most_common(top)}
        return {"samples": self.samples, "interval_s": self.interval, "where": share(self.where),
                "importing": share(self.module)}
"""
exec(SAMPLER)

SKELETON_ALONE_SCRIPT = SAMPLER + r"""
import importlib, json, sys, time
import torch
from deepseek_flash.client.skeleton import build_skeleton
from deepseek_flash.store import Store
config = Store.open(sys.argv[1]).config
# Optional (argv[2], before run_script's clock): packages imported on threads of their own beside
# the build -- self-contained ones the model class pulls in, to see whether imports overlap here.
ahead = sys.argv[2].split(",") if len(sys.argv) > 3 and sys.argv[2] else []
errors = []
def ahead_import(name):
    try:
        importlib.import_module(name)
    except Exception as exc:
        errors.append(f"{name}: {exc!r}"[:200])
t, c, p = time.perf_counter(), time.thread_time(), time.process_time()
threads = [threading.Thread(target=ahead_import, args=(m,)) for m in ahead]
for th in threads:
    th.start()
with StackSampler(threading.get_ident()) as sampler:
    build_skeleton(config)
for th in threads:
    th.join()
out = {"skeleton_s": round(time.perf_counter() - t, 3),
       "skeleton_cpu_s": round(time.thread_time() - c, 3), "profile": sampler.report(),
       "modules": len(sys.modules)}
if ahead:
    out.update(process_cpu_s=round(time.process_time() - p, 3), imported_ahead=ahead,
               ahead_errors=errors)
print(json.dumps(out))
"""

# Self-contained packages transformers' modeling stack imports (sympy via torch.fx, scipy via the
# detection losses, boto3 via accelerate, trio via the hub client, ...): none imports torch or
# transformers, so importing them on other threads cannot deadlock with the model class's import.
PARALLEL_IMPORTS = "sympy,scipy.optimize,boto3,trio,huggingface_hub,jinja2"

# Reads one file again and again with the daemon's IO engine at a given depth and request size,
# until SIGTERM; prints its rate. Beside a skeleton build: does the engine's read pattern (not the
# disk's rate alone: dd beside it did not slow the imports) slow the client's imports?
ENGINE_READER_SCRIPT = r"""
import json, os, signal, sys, time
from deepseek_flash import _core
import mmap
path, depth, request, fresh = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
EXTENT, DEST = 32 << 20, 256 << 20
size = os.path.getsize(path) // EXTENT * EXTENT
if size == 0:       # nothing to read: refuse rather than loop on no requests until SIGTERM
    sys.exit(f"{path}: {os.path.getsize(path)} bytes, less than one {EXTENT >> 20} MiB extent to read")
dest = _core.HostArena(DEST, "bench-reader")
dest.populate()
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
total, t = 0, time.perf_counter()
with _core.IOEngine("auto", depth, request) as engine:
    print("reading", engine.backend, flush=True)
    while not stop:
        for start in range(0, size, 32 * EXTENT):
            n = min(32, (size - start) // EXTENT)
            # fresh: each pass into newly mapped memory never touched before (as the daemon's
            # reads beyond the host arena land), else into one populated buffer again and again.
            buf = mmap.mmap(-1, DEST) if fresh else dest
            reqs = [_core.ReadRequest(path, start + i * EXTENT, EXTENT, buf, (i * EXTENT) % DEST,
                                      block_id=i) for i in range(n)]
            total += sum(c.bytes for c in engine.wait(engine.submit(reqs)))
            del reqs, buf
            if stop:
                break
    backend = engine.backend
print(json.dumps({"gbps": round(total / (time.perf_counter() - t) / 1e9, 3), "backend": backend,
                  "queue_depth": depth, "request_size": request, "fresh_memory": fresh}), flush=True)
"""


def skeleton_beside_dd(store_dir, data) -> dict:
    """The skeleton built in a fresh interpreter while ``dd`` reads the model's file again and
    again (O_DIRECT, 4 MiB; its own process group, ended as one when the build is done)."""
    reader = subprocess.Popen(["sh", "-c", 'while :; do dd if="$0" of=/dev/null iflag=direct '
                               'bs=4M 2>/dev/null || exit 1; done', str(data)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        result = run_script(SKELETON_ALONE_SCRIPT, store_dir)
        result["dd_still_reading"] = reader.poll() is None
    finally:
        os.killpg(reader.pid, signal.SIGKILL)
        reader.wait()
    return result


def skeleton_beside_engine(store_dir, data, shape: str) -> dict:
    """The skeleton built in a fresh interpreter (page cache dropped first) while a process reads
    the model's file with the IO engine at ``shape``, depth x request size (``32x1MiB``; with
    ``:fresh``, each pass into memory never touched before, as the reads beyond the host arena)."""
    from deepseek_flash.daemon.config import parse_size

    shape, _, memory = shape.partition(":")
    depth, _, size = shape.partition("x")
    depth, request = int(depth), parse_size("request", size)
    drop_caches()
    reader = subprocess.Popen([sys.executable, "-c", ENGINE_READER_SCRIPT, str(data), str(depth),
                               str(request), "1" if memory == "fresh" else "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = reader.stdout.readline().split()
        if first[:1] != ["reading"]:
            return {"error": reader.stderr.read()[-2000:]}
        out = run_script(SKELETON_ALONE_SCRIPT, store_dir)
        out.pop("profile", None)
        out["reader_still_reading"] = reader.poll() is None
    finally:
        reader.terminate()
        try:
            tail, _ = reader.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            reader.kill()
            tail, _ = reader.communicate()
    lines = [ln for ln in tail.strip().splitlines() if ln.startswith("{")]
    out["reader"] = json.loads(lines[-1]) if lines else None
    return out


def imports_phase(res, args, store_dir, data) -> None:
    """``--only imports``: the skeleton's imports alone and beside each reader (see the module
    docstring); nothing else runs."""

    out = res.setdefault("imports", {})
    out["alone_cold"] = {"cache_dropped": drop_caches(), **run_script(SKELETON_ALONE_SCRIPT, store_dir)}
    out["alone_cold"].pop("profile", None)
    save(res, args.output)
    for spec in filter(None, args.beside_engine.split(",")):
        out.setdefault("beside_engine", {})[spec] = skeleton_beside_engine(store_dir, data, spec)
        save(res, args.output)
    drop_caches()
    out["beside_dd"] = skeleton_beside_dd(store_dir, data)
    out["beside_dd"].pop("profile", None)
    save(res, args.output)
