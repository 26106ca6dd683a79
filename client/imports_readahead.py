"""Read files into the page cache, many at once: the module files a skeleton build imports.

Standard library only, so that ``client.skeleton.start_read_ahead`` can run this file as a process
of its own (``python -I -S imports_readahead.py``, the work as JSON on stdin, the number of files read on
stdout): its reads then run beside the skeleton's imports without taking this interpreter's lock
from them. ``client.skeleton.prefetch_imports`` calls ``read_ahead`` in-process.
"""
from __future__ import annotations

import json
import os
import queue
import sys
import threading


def read_ahead(files, roots, tag: str, skip, threads: int, chunk: int,
               walk_pycache: bool) -> list[str]:
    """Read every byte of ``files`` (in the given order: the order they are imported) and, walked
    by ``threads`` threads, each ``.py`` under ``roots`` and, with ``walk_pycache``, each compiled
    module of ``__pycache__`` whose name holds ``tag``; directories named in ``skip`` or starting
    with a dot are not entered. The bytes are read, not only advised (``POSIX_FADV_WILLNEED`` is
    ignored by some kernels -- gVisor's). Returns the paths read; errors are ignored (an import
    reads what is missing itself)."""
    todo: queue.Queue = queue.Queue()
    for path in files:                        # files first: most of what the imports need
        todo.put(("file", path))
    for root in dict.fromkeys(roots):
        todo.put(("dir", root))
    skip = frozenset(skip)
    done = [[] for _ in range(threads)]
    seen_lock = threading.Lock()
    seen: set = set()

    def read(path: str, buf: bytearray, mine: list) -> None:
        with seen_lock:
            if path in seen:
                return
            seen.add(path)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOATIME", 0))
        except OSError:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                return
        try:
            while os.readv(fd, [buf]) == len(buf):
                pass
            mine.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)

    def work(k: int) -> None:
        buf = bytearray(chunk)
        mine = done[k]
        while True:
            item = todo.get()
            if item is None:
                todo.task_done()
                return
            kind, path = item
            try:
                if kind == "file":
                    read(path, buf, mine)
                    continue
                with os.scandir(path) as entries:
                    for e in entries:
                        name = e.name
                        if e.is_dir(follow_symlinks=False):
                            if name == "__pycache__":
                                if not walk_pycache:
                                    continue
                                with os.scandir(e.path) as compiled:
                                    for c in compiled:
                                        if tag in c.name:
                                            read(c.path, buf, mine)
                            elif not name.startswith(".") and name not in skip:
                                todo.put(("dir", e.path))
                        elif name.endswith(".py"):
                            read(e.path, buf, mine)
            except OSError:
                pass
            finally:
                todo.task_done()

    workers = [threading.Thread(target=work, args=(k,), name="flash-prefetch-imports", daemon=True)
               for k in range(threads)]
    for w in workers:
        w.start()
    todo.join()
    for _ in workers:
        todo.put(None)
    for w in workers:
        w.join()
    return [p for mine in done for p in mine]


def main() -> int:
    job = json.load(sys.stdin)
    read = read_ahead(job["files"], job["roots"], job["tag"], job["skip"], job["threads"],
                      job["chunk"], job["walk_pycache"])
    print(len(read), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
