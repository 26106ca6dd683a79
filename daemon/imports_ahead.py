"""Reading ahead, at daemon start, the files a client's imports open (a learned manifest).

A fresh client process that loads a model imports its ``transformers`` class (``client.skeleton``):
thousands of modules, each a few file system calls. Right after the daemon starts, with the page
cache cold, those small reads wait behind the load's own deep reads on the same disk; the read
pipeline protects them by reading shallow (``reads.SHALLOW_SHAPE``) until the client says its
imports are done, and both sides lose (docs/benchmarks.md, "Cold load right after start").

So the daemon learns which files those imports open and reads them at start:

* ``imports_done`` carries ``files``: the client's imported modules' files (compiled ``.pyc`` and
  sources, extension modules, the shared libraries mapped into the process) and every other file
  its imports opened (an audit hook while they ran: transformers' scan of its model sources,
  package metadata), grouped by
  directory, for the module it imported (``imports_module`` of its ``attach``). ``learn`` keeps
  them in ``import-files.json`` under the state directory, one list per module (the latest
  client's; at most ``MAX_MODULES`` modules, ``MAX_FILES`` files each); it writes only when a list
  changed.
* The daemon's own start: once its CUDA is up (torch imported), ``learn_own`` keeps the files
  its modules were loaded from as the entry ``OWN``, read first at the next start -- after a
  restart its torch import, beside the load's deep reads, finds them cached as the first start's
  package walk left them. ``OWN`` is no client's module: it never makes a client warm.
* At start (``start``, thread ``flash-imports-ahead``) the manifest's files are read -- by a
  process of its own (``daemon/readahead_worker.py``, ``python -I -S``: the daemon's own start,
  torch's import and CUDA's context, shares no interpreter lock with them), ``THREADS``
  at a time, in the order the client's imports first opened them: every directory they sit in
  listed, every file read whole unless
  larger than ``MAX_FILE_BYTES`` or already mapped into the daemon (torch's own libraries: the
  pages a client touches are those the daemon touched), ``MAX_BYTES`` in all. Then
  ``on_warm(modules)`` (``ReadPipeline.imports_read_ahead``): a client importing one of those
  modules no longer keeps the load's reads shallow.

No manifest yet (the first load the daemon ever serves) or an unreadable one
(``ImportManifestCorrupt``, logged): the start reads every file of ``FALLBACK_PACKAGES`` instead
(the packages such an import pulls in, where installed; ``DEEPSEEK_FLASH_IMPORT_PACKAGES``
replaces the list, '' for none: then the reads stay shallow while the client imports, as
without this). Files gone since are skipped; a load never fails for any of it. The read itself
never raises: a file that cannot be read is counted and skipped.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from .. import bytecode
from ..errors import ConfigError, ImportManifestCorrupt
from .readahead_worker import read_ahead, serve, walk  # noqa: F401 -- read_ahead: the API here too

log = logging.getLogger("deepseek_flash.imports_ahead")

MANIFEST_NAME = "import-files.json"
VERSION = 1
MAX_MODULES = 16
MAX_FILES = 20000              # files of one module's imports kept
MAX_FILE_BYTES = 64 << 20      # a larger file (a GPU library) is not read ahead
MAX_BYTES = 1 << 30            # bytes read ahead at start, in all
# Files read at once at start: the reads of small files are latency-bound on the GPU machines'
# disks (16 threads: 6,456 files and 1,282 directories in 2.27 s, 0.17 GB/s); the count is
# ``DEEPSEEK_FLASH_IMPORT_THREADS`` where set.
THREADS = 48
THREADS_ENV = "DEEPSEEK_FLASH_IMPORT_THREADS"
_CHUNK = 1 << 20
# Without a manifest (a daemon's first start): every file of the packages a transformers model
# class's import pulls in, where installed -- torch's too: a client has torch imported before it
# loads, but the model class's import pulls in parts of it that were not (torch._dynamo, torch.fx,
# torch.distributed, ...), and the optional packages transformers imports when it finds them
# installed (torchvision, pandas, sklearn, narwhals, ...). ``DEEPSEEK_FLASH_IMPORT_PACKAGES``
# (comma-separated, '' for none) replaces the list. A client importing any module then counts
# as warm (``ANY_MODULE``). Left out of the walk: what no import reads -- C/C++ headers and
# sources, stubs, static libraries, and the directories ``WALK_SKIP_DIRS`` (headers, tests, and
# the shared libraries under ``lib``/``bin``: torch's own are mapped by the client and the daemon
# already, the others are loaded when used, not at import).
FALLBACK_PACKAGES = ("transformers", "torch", "sympy", "mpmath", "scipy", "numpy", "accelerate",
                     "huggingface_hub", "safetensors", "tokenizers", "jinja2", "markupsafe", "networkx",
                     "regex", "yaml", "filelock", "fsspec", "packaging", "tqdm", "trio", "botocore",
                     "requests", "urllib3", "torchvision", "triton", "pandas", "sklearn", "narwhals",
                     "joblib", "threadpoolctl", "PIL", "rich", "pygments", "dateutil", "pytz",
                     "typing_extensions", "psutil")
WALK_SKIP_DIRS = ("include", "lib", "bin", "share", "tests", "test")
WALK_SKIP_SUFFIXES = (".h", ".hpp", ".cuh", ".c", ".cc", ".cpp", ".cu", ".pyi", ".a", ".td", ".inc",
                      ".pxd", ".pyx")
PACKAGES_ENV = "DEEPSEEK_FLASH_IMPORT_PACKAGES"
ANY_MODULE = "*"
# The manifest's entry for the daemon's own start (``learn_own``): read first at the next start.
OWN = "<deepseek-flashd>"
WORKER = str(Path(__file__).with_name("readahead_worker.py"))


def fallback_packages(environ=None) -> tuple[str, ...]:
    """The packages read ahead without a manifest: ``PACKAGES_ENV`` if set, else the default."""
    value = (os.environ if environ is None else environ).get(PACKAGES_ENV)
    if value is None:
        return FALLBACK_PACKAGES
    return tuple(p.strip() for p in value.split(",") if p.strip())


def read_threads(environ=None) -> int:
    """Files read at once at start: ``THREADS_ENV`` if set (1..256), else ``THREADS``;
    ``ConfigError`` naming the variable for anything else."""
    value = (os.environ if environ is None else environ).get(THREADS_ENV)
    if value is None:
        return THREADS
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if not 1 <= threads <= 256:
        raise ConfigError(f"{THREADS_ENV}: {value!r} is not allowed; use an integer in 1..256",
                          key=THREADS_ENV, value=value, allowed="1..256")
    return threads


def package_roots(packages) -> list[str]:
    """The installed directories (or single-file modules) of ``packages``, found without
    importing them; one not installed is skipped."""
    import importlib.util

    out = []
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        out.extend(list(spec.submodule_search_locations or []) or ([spec.origin] if spec.origin else []))
    return out


def package_files(packages, threads: int = THREADS) -> list[str]:
    """The files the start reads of ``packages`` (their installed directories walked as without
    a manifest), sorted."""
    return walk(package_roots(packages), threads, WALK_SKIP_DIRS, WALK_SKIP_SUFFIXES)


def flatten(grouped: dict) -> list[str]:
    """``{directory: [name, ...]}`` -> absolute paths, in its order (a client lists them in the
    order its imports first opened them), each once; anything else in it is dropped (a relative
    directory, a name with a slash, a non-string)."""
    out: dict[str, None] = {}
    for directory, names in grouped.items():
        if not isinstance(directory, str) or not os.path.isabs(directory) or not isinstance(names, list):
            continue
        for name in names:
            if isinstance(name, str) and name and "/" not in name and name not in (".", ".."):
                out.setdefault(os.path.join(directory, name))
    return list(out)


def group(files) -> dict[str, list[str]]:
    """Absolute paths -> ``{directory: [name, ...]}`` (the manifest's and the wire's form), the
    directories and names in the order first seen, each path once."""
    out: dict[str, list[str]] = {}
    for path in dict.fromkeys(files):
        directory, name = os.path.split(path)
        out.setdefault(directory, []).append(name)
    return out


def load_manifest(path: Path) -> dict[str, list[str]]:
    """The manifest at ``path``: module -> its files, in the order kept; {} when there is none yet.
    ``ImportManifestCorrupt`` when it cannot be read or is not one."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ImportManifestCorrupt(f"import manifest {path} unreadable: {exc}", path=str(path),
                                    reason=str(exc)) from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ImportManifestCorrupt(f"import manifest {path} is not JSON: {exc}", path=str(path),
                                    reason="not JSON") from exc
    if (not isinstance(data, dict) or data.get("version") != VERSION
            or not isinstance(data.get("modules"), dict)):
        raise ImportManifestCorrupt(f"import manifest {path} is not a version {VERSION} manifest",
                                    path=str(path), reason="not a manifest")
    out = {}
    for module, grouped in data["modules"].items():
        if not isinstance(module, str) or not isinstance(grouped, dict):
            raise ImportManifestCorrupt(f"import manifest {path}: entry {module!r} is malformed",
                                        path=str(path), reason="malformed entry")
        out[module] = flatten(grouped)[:MAX_FILES]
    return out


def save_manifest(path: Path, manifest: dict[str, list[str]]) -> None:
    """Write ``manifest`` to ``path`` atomically (a temporary file renamed over it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": VERSION,
                               "modules": {m: group(f) for m, f in manifest.items()}}),
                   encoding="utf-8")
    os.replace(tmp, path)


def own_mapped_files() -> set[str]:
    """The files mapped into this process (/proc/self/maps); empty where unreadable."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return {parts[5].strip() for parts in (line.split(maxsplit=5) for line in f)
                    if len(parts) == 6 and parts[5].startswith("/")}
    except OSError:
        return set()


def own_module_files(modules=None) -> list[str]:
    """The files this process's imported modules were loaded from, in the order imported: each
    module's compiled file and its own file (source or extension module: an installation without
    compiled files reads the source); no file system call (a compiled file named here may not
    exist: ``learn`` keeps only those that do)."""
    import sys

    out: dict[str, None] = {}
    for mod in list((sys.modules if modules is None else modules).values()):
        for path in (getattr(getattr(mod, "__spec__", None), "cached", None), getattr(mod, "__file__", None)):
            if isinstance(path, str) and os.path.isabs(path):
                out.setdefault(path)
    return list(out)


def plan(manifest: dict[str, list[str]], mapped=frozenset(), cache: str | None = None):
    """What the start does for ``manifest``: (directories to list, files to stat, files to read);
    the directories sorted, the files in the manifest's order -- the daemon's own start's
    (``OWN``) first: its torch import begins at once -- (each module's in the order its
    client's imports first opened them: the workers read the first-needed first). Every file is
    read whole -- sources too: transformers reads its model sources' text at import (a scan of
    ``transformers/models``), compiled or not -- except one mapped into the daemon already
    (``mapped``); nothing is only stat-ed now. ``cache``: the compiled-module cache
    (``deepseek_flash.bytecode``): each source's compiled file there is read right before it."""
    order = ([OWN] if OWN in manifest else []) + [m for m in manifest if m != OWN]
    files = list(dict.fromkeys(f for m in order for f in manifest[m]))
    dirs, read = set(), []
    for path in files:
        directory = os.path.dirname(path)
        dirs.add(directory)
        if os.path.basename(directory) == "__pycache__":
            dirs.add(os.path.dirname(directory))
        if cache is not None and path.endswith(".py"):
            read.append(bytecode.cache_path(cache, path))
        if path not in mapped:
            read.append(path)
    return sorted(dirs), [], list(dict.fromkeys(read))


def run_worker(request: dict, timeout: float = 300.0) -> dict:
    """``request`` served by ``daemon/readahead_worker.py`` in a process of its own (``python -I
    -S``: no interpreter lock shared with the daemon's start); in this process where that
    process cannot be started or fails (logged). Counts, ``in_process`` saying where."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-I", "-S", WORKER], input=json.dumps(request),
                              capture_output=True, text=True, timeout=timeout, check=False)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode == 0 and lines:
            return {**json.loads(lines[-1]), "in_process": False}
        why = f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    log.warning("the read-ahead process failed (%s); reading in the daemon", why)
    return {**serve(request), "in_process": True}


class ImportsAhead:
    """The learned manifest of one daemon (``state_dir``) and its read at start (module docstring).
    ``on_warm(modules)``: called once the manifest's files were read ahead."""

    def __init__(self, state_dir: Path, on_warm=None, threads: int | None = None):
        """``on_warm(modules)`` gets the manifest's modules, or ``[ANY_MODULE]`` after the
        fallback packages were read. The reads run in a process of their own (``run_worker``),
        ``threads`` files at a time (None: ``read_threads()``)."""
        self.path = Path(state_dir) / MANIFEST_NAME
        self.on_warm = on_warm
        self.threads = read_threads() if threads is None else threads
        self.manifest: dict[str, list[str]] = {}
        self.result: dict | None = None     # the start's counts, once done
        # The compiled-module cache (``deepseek_flash.bytecode``) where the installation ships
        # none: ``use_bytecode_cache``.
        self.bytecode_dir: str | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> ImportsAhead:
        self._thread = threading.Thread(target=self._run, name="flash-imports-ahead", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.run()
        except Exception:  # noqa: BLE001 -- reading ahead is an optimisation: never fatal
            log.exception("reading the import files ahead failed; loads read shallow while clients import")
        finally:
            self.done.set()

    def run(self) -> dict | None:
        """Load the manifest, read its files, report the modules warm; the counts (None: no
        manifest, or an unreadable one -- logged)."""
        try:
            manifest = load_manifest(self.path)
        except ImportManifestCorrupt as exc:
            log.warning("%s; starting without reading ahead (the next client's report rewrites it)", exc)
            manifest = {}
        with self._lock:
            # A client's report that came in meanwhile is newer than the file.
            self.manifest = {**manifest, **self.manifest}
            manifest = dict(self.manifest)
        started = time.monotonic()
        modules = sorted(m for m in manifest if m != OWN)
        if modules:
            dirs, stat_only, read = plan(manifest, own_mapped_files(), self.bytecode_dir)
            request = {"dirs": dirs, "stat": stat_only, "read": read}
            what = f"the imports of {len(modules)} modules"
        else:
            # No client's list yet (the daemon's own, if any, is read first).
            own = plan({OWN: manifest[OWN]}, own_mapped_files(), self.bytecode_dir)[2] if OWN in manifest else []
            packages = fallback_packages()
            roots = package_roots(packages)
            if not roots and not own:
                log.info("no import manifest yet (%s) and no package to read: nothing read ahead; the "
                         "first client's imports keep the reads shallow and teach it", self.path)
                return None
            log.info("no import manifest yet (%s): reading ahead the files of %s", self.path,
                     ", ".join(packages))
            request = {"roots": roots, "skip_dirs": WALK_SKIP_DIRS, "skip_suffixes": WALK_SKIP_SUFFIXES,
                       "read": own}
            modules = [ANY_MODULE] if roots else []
            what = "the packages' files (no manifest yet)"
        request.update(threads=self.threads, max_file_bytes=MAX_FILE_BYTES, max_bytes=MAX_BYTES)
        counts = run_worker(request)
        counts["seconds"] = round(time.monotonic() - started, 3)
        counts["modules"] = modules
        self.result = counts
        log.info("read ahead %s: %d files (%d bytes), %d stat-ed, %d directories "
                 "in %.2f s (%d missing, %d too large, %d over the budget; %d at a time)", what,
                 counts["files"], counts["bytes"], counts["stat"], counts["dirs"], counts["seconds"],
                 counts["missing"], counts["skipped_large"], counts["skipped_budget"], self.threads)
        if self.on_warm is not None:
            self.on_warm(modules)
        return counts

    def learn(self, module: str, files: list[str]) -> bool:
        """A client's imports of ``module`` opened ``files``: kept for the next start (and, with a
        compiled-module cache, their sources compiled there). Whether the manifest changed (then
        it was written). Never raises: a failed write is logged."""
        # Only what exists here (an audit "open" is also a failed open): none opened in vain at start.
        files = [f for f in dict.fromkeys(files) if os.path.isfile(f)][:MAX_FILES]
        changed = self._keep(module, files)
        if self.bytecode_dir is not None:
            self.compile(files)
        return changed

    def _keep(self, module: str, files: list[str]) -> bool:
        with self._lock:
            if self.manifest.get(module) == files:
                return False
            self.manifest.pop(module, None)
            self.manifest[module] = files
            while len(self.manifest) > MAX_MODULES:
                self.manifest.pop(next(m for m in self.manifest if m != OWN))
            snapshot = dict(self.manifest)
            try:
                save_manifest(self.path, snapshot)
            except OSError as exc:
                log.warning("import manifest %s not written: %s", self.path, exc)
                return False
        log.info("import manifest: %d files of %s's imports kept for the next start", len(files), module)
        return True

    def use_bytecode_cache(self, probes=None) -> str | None:
        """Where this installation lacks the compiled files of torch and transformers (``probes``:
        their ``__init__.py``): this daemon reads its modules' compiled files from the cache in its
        state directory from now on (its own imports, torch's first), keeps the compiled files of
        what its start and its clients import there (``learn``), and tells its clients (the hello
        reply); the cache's path, None where not needed."""
        if probes is None:
            probes = [os.path.join(root, "__init__.py") for root in package_roots(("torch", "transformers"))]
        if not bytecode.needed(probes):
            return None
        cache = str(self.path.parent / bytecode.CACHE_NAME)
        try:
            bytecode.use_for_this_process(cache)
        except OSError as exc:
            log.warning("no compiled-module cache at %s: %s", cache, exc)
            return None
        self.bytecode_dir = cache
        log.info("this installation has no compiled files for %s: compiled modules kept and read in %s",
                 ", ".join(probes), cache)
        return cache

    def compile(self, files) -> dict:
        """The sources among ``files`` compiled into the cache where missing or stale (a process
        of its own); counts (logged)."""
        started = time.monotonic()
        counts = bytecode.compile_into(self.bytecode_dir, files)
        if counts.get("stale") or counts.get("error"):
            log.info("compiled-module cache: %s in %.2f s", counts, time.monotonic() - started)
        return counts

    def learn_own(self) -> bool:
        """The modules this daemon has imported (torch's, once CUDA is up: ``Fabric.prepare``'s
        ``on_cuda``) kept as ``OWN``, read first at the next start: after a restart its torch
        import finds its files cached, as the first start's package walk left them. Whether the
        manifest changed."""
        return self.learn(OWN, own_module_files())

    def close(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
