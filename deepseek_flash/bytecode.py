"""A compiled-module cache for an installation that ships no bytecode (the daemon keeps it:
``daemon.imports_ahead``; its clients read it: ``client.skeleton``; standard library only).

Where the packages were installed without their compiled files (``uv pip install`` does not
compile by default) and the interpreter may not write them (``PYTHONDONTWRITEBYTECODE``, a
read-only environment), every fresh process compiles every module it imports from source: on the
GPU machines the daemon's torch import and a client's model-class imports (~2,200 modules) each
paid seconds of CPU for it, at every start (docs/benchmarks.md, "Cold load after start").

The daemon keeps compiled files of the sources its own start and its clients' imports read, in
``CACHE_NAME`` under its state directory -- laid out as ``sys.pycache_prefix`` expects, so an
interpreter whose ``sys.pycache_prefix`` names it reads them where they match their source (the
interpreter's own timestamp check; a stale or missing one is compiled as before, never trusted):

* ``needed(sources)``: whether the installation lacks the compiled files of ``sources`` (one
  ``stat`` each of a few of them);
* ``compile_into(cache, sources)``: a process of its own (``python -I -S``, this file) compiles
  the sources whose compiled file there is missing or older than the source, ``WORKERS`` at once
  (never fails a start or a load; counts);
* the daemon itself reads its cache (``sys.pycache_prefix``) from its start on where ``needed``
  (``use_for_this_process``), and tells its clients where the cache is (the hello reply's
  ``bytecode_cache``); a client's skeleton imports read it where its own installation lacks the
  compiled files too (``client.skeleton``).
"""
from __future__ import annotations

import json
import os
import sys

CACHE_NAME = "pycache"
WORKERS = 8
PROBES = 8          # sources ``needed`` checks


def _standard_cache(source: str) -> str:
    """Where the interpreter keeps ``source``'s compiled file without a prefix (``__pycache__``)."""
    head, name = os.path.split(source)
    base = name.rpartition(".")[0]
    return os.path.join(head, "__pycache__", f"{base}.{sys.implementation.cache_tag}.pyc")


def cache_path(cache: str, source: str) -> str:
    """``source``'s compiled file in ``cache`` as ``sys.pycache_prefix`` lays it out."""
    head, name = os.path.split(os.path.abspath(source))
    base = name.rpartition(".")[0]
    return os.path.join(cache, head.lstrip(os.sep), f"{base}.{sys.implementation.cache_tag}.pyc")


def needed(sources) -> bool:
    """Whether the installation lacks compiled files of ``sources`` (absolute ``.py`` paths): none
    of the first ``PROBES`` that exist has one in its ``__pycache__``."""
    probed = 0
    for source in sources:
        if not source.endswith(".py") or not os.path.isfile(source):
            continue
        if os.path.isfile(_standard_cache(source)):
            return False
        probed += 1
        if probed >= PROBES:
            break
    return probed > 0


def stale(cache: str, sources) -> list[str]:
    """The ``.py`` files of ``sources`` whose compiled file in ``cache`` is missing or older."""
    out = []
    for source in dict.fromkeys(sources):
        if not source.endswith(".py"):
            continue
        try:
            src = os.stat(source).st_mtime
        except OSError:
            continue
        try:
            if os.stat(cache_path(cache, source)).st_mtime >= src:
                continue
        except OSError:
            pass
        out.append(source)
    return out


def _compile_one(job):
    import py_compile

    source, target = job
    try:
        py_compile.compile(source, cfile=target, doraise=True)
        return True
    except (py_compile.PyCompileError, OSError, ValueError, SyntaxError):
        return False


def compile_sources(cache: str, sources, workers: int = WORKERS) -> dict:
    """Compile ``sources`` into ``cache`` (``workers`` processes at once); counts."""
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(s, cache_path(cache, s)) for s in sources]
    if not jobs:
        return {"compiled": 0, "failed": 0}
    if workers <= 1 or len(jobs) < 32:
        done = [_compile_one(j) for j in jobs]
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            done = list(pool.map(_compile_one, jobs, chunksize=16))
    return {"compiled": sum(done), "failed": len(done) - sum(done)}


def compile_into(cache: str, sources, timeout: float = 600.0) -> dict:
    """The sources of ``sources`` whose compiled file in ``cache`` is missing or stale compiled
    there by a process of its own (this file); counts, or ``error`` where that process failed."""
    import subprocess

    todo = stale(cache, sources)
    if not todo:
        return {"compiled": 0, "failed": 0, "stale": 0}
    try:
        done = subprocess.run([sys.executable, "-I", "-S", __file__],
                              input=json.dumps({"cache": cache, "sources": todo}),
                              capture_output=True, text=True, timeout=timeout, check=False)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode == 0 and lines:
            return {**json.loads(lines[-1]), "stale": len(todo)}
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}", "stale": len(todo)}
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "stale": len(todo)}


def use_for_this_process(cache: str) -> None:
    """This interpreter reads (and, where it may write, writes) compiled files in ``cache``."""
    os.makedirs(cache, mode=0o755, exist_ok=True)
    sys.pycache_prefix = cache


def usable(cache) -> bool:
    """Whether ``cache`` (the daemon's, from its hello) may be read by this process: a directory
    that no one but its owner may write (compiled code is run from it)."""
    import stat

    try:
        st = os.stat(cache)
    except (OSError, TypeError, ValueError):
        return False
    return stat.S_ISDIR(st.st_mode) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _holds(cache: str, sources) -> bool:
    """Whether ``cache`` has the compiled file of the first of ``sources``."""
    first = next((s for s in sources if s.endswith(".py")), None)
    return first is not None and os.path.isfile(cache_path(cache, first))


_prefix = {"count": 0, "saved": None}


def prefix_while(cache, probe_sources):
    """A context manager: inside it (any thread) ``sys.pycache_prefix`` is ``cache`` where that is
    ``usable``, no prefix was set already, this installation lacks the compiled files of
    ``probe_sources`` (``needed``) and ``cache`` holds the first one's (an empty cache would only
    hide the standard library's own); the prefix is taken away again once the last block ends."""
    import contextlib
    import threading

    lock = _prefix.setdefault("lock", threading.Lock())

    @contextlib.contextmanager
    def block():
        with lock:
            if _prefix["count"] == 0:
                if (cache is not None and sys.pycache_prefix is None and usable(cache)
                        and needed(probe_sources) and _holds(cache, probe_sources)):
                    _prefix["saved"] = cache
                    sys.pycache_prefix = cache
            _prefix["count"] += 1
        try:
            yield _prefix["saved"]
        finally:
            with lock:
                _prefix["count"] -= 1
                if _prefix["count"] == 0 and _prefix["saved"] is not None:
                    if sys.pycache_prefix == _prefix["saved"]:
                        sys.pycache_prefix = None
                    _prefix["saved"] = None

    return block()


def main() -> int:
    request = json.loads(sys.stdin.read())
    print(json.dumps(compile_sources(request["cache"], request["sources"],
                                     int(request.get("workers", WORKERS)))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
