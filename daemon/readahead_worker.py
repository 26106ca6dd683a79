"""The reads of ``daemon.imports_ahead``, run in a process of their own (standard library only).

``python -I -S readahead_worker.py`` reads one JSON request on stdin -- ``roots`` (directories to
walk: every file under them read, but for the directories named in ``skip_dirs`` and the file
names ending in one of ``skip_suffixes``), ``dirs`` (to list), ``stat`` (to stat), ``read`` (files to read
whole), ``threads``, ``max_file_bytes``, ``max_bytes`` -- and prints one JSON line of counts. Its
own interpreter: the daemon's start (torch's import, CUDA's context) shares no interpreter lock
with thousands of small reads. Importable as well (``walk``, ``read_ahead``: the daemon's
fallback when no process can be started, and the tests).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

_CHUNK = 1 << 20


def walk(roots, threads: int = 16, skip_dirs=(), skip_suffixes=()) -> list[str]:
    """Every file under the directories ``roots`` (a root that is a file is itself), sorted; a
    directory level at a time, ``threads`` directories at once (one walk on one thread took 6 s on
    the GPU machines). Below a root, directories named in ``skip_dirs`` are not entered and
    files whose names end in one of ``skip_suffixes`` are left out."""
    out, level = [], []
    for root in roots:
        (out if os.path.isfile(root) else level).append(root)
    skip_dirs, skip_suffixes = frozenset(skip_dirs), tuple(skip_suffixes)

    def scan(directory):
        files, dirs = [], []
        try:
            with os.scandir(directory) as entries:
                for e in entries:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            if e.name not in skip_dirs:
                                dirs.append(e.path)
                        elif not (skip_suffixes and e.name.endswith(skip_suffixes)):
                            files.append(e.path)
                    except OSError:
                        continue
        except OSError:
            pass
        return files, dirs

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="flash-imports-walk") as pool:
        while level:
            nxt = []
            for files, dirs in pool.map(scan, level):
                out.extend(files)
                nxt.extend(dirs)
            level = nxt
    return sorted(set(out))


def read_ahead(dirs, stat_only, read, threads: int = 16, max_file_bytes: int = 64 << 20,
               max_bytes: int = 1 << 30) -> dict:
    """List ``dirs``, stat ``stat_only``, read ``read`` whole (``threads`` at a time; a file
    larger than ``max_file_bytes`` skipped, ``max_bytes`` read in all); never raises. Counts."""
    lock = threading.Lock()
    out = {"dirs": 0, "stat": 0, "files": 0, "bytes": 0, "skipped_large": 0, "skipped_budget": 0,
           "missing": 0}
    budget = [max_bytes]

    def add(key, n=1):
        with lock:
            out[key] += n

    def probe(call, key):
        # a directory listed or a file stat-ed (its metadata cached): counted, or missing
        def run(path):
            try:
                call(path)
                add(key)
            except OSError:
                add("missing")
        return run

    buffers = threading.local()

    def read_one(path):
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size > max_file_bytes:
                    add("skipped_large")
                    return
                with lock:
                    if size > budget[0]:
                        out["skipped_budget"] += 1
                        return
                    budget[0] -= size
                buf = getattr(buffers, "buf", None)
                if buf is None:
                    buf = buffers.buf = bytearray(_CHUNK)
                got = 0
                while True:
                    n = f.readinto(buf)
                    if not n:
                        break
                    got += n
            add("files")
            add("bytes", got)
        except OSError:
            add("missing")

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="flash-imports-read") as pool:
        list(pool.map(probe(os.listdir, "dirs"), dirs))
        list(pool.map(probe(os.stat, "stat"), stat_only))
        list(pool.map(read_one, read))
    return out


def serve(request: dict) -> dict:
    """One request (the module docstring's keys) -> its counts, ``walked``: files found under
    ``roots`` (read after ``read``'s)."""
    threads = int(request.get("threads", 16))
    walked = walk(request.get("roots", []), threads, request.get("skip_dirs", ()),
                  request.get("skip_suffixes", ()))
    read = list(request.get("read", [])) + walked
    out = read_ahead(request.get("dirs", []), request.get("stat", []), read, threads,
                     int(request.get("max_file_bytes", 64 << 20)), int(request.get("max_bytes", 1 << 30)))
    out["walked"] = len(walked)
    return out


def main() -> int:
    print(json.dumps(serve(json.loads(sys.stdin.read()))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
