"""The model skeleton: a ``transformers`` causal LM built without weight memory, and binding views.

``build_skeleton`` makes the model of a stored config with every parameter on the meta device
(~15 ms for an 8B shape); ``bind_parameters`` then makes each parameter a view of bytes the
controller holds. ``client.model`` (resident layers) and ``client.stream`` (streamed layers) both
bind through here.
"""
from __future__ import annotations

import contextlib
import logging
import threading

log = logging.getLogger("deepseek_flash.client")

_meta = threading.local()          # .depth: this thread is inside meta_parameters()
_install_lock = threading.Lock()
_installed = {"count": 0, "original": None}


def _register_parameter(module, name, param):
    import torch

    if param is not None and getattr(_meta, "depth", 0):
        param = torch.nn.Parameter(param.to("meta"), requires_grad=False)
    _installed["original"](module, name, param)


@contextlib.contextmanager
def meta_parameters():
    """Inside this block, parameters this thread registers go to the meta device; buffers
    (rotary tables) are made for real.

    Buffers are computed from the config in float32 exactly as ``from_pretrained`` computes them,
    which is what keeps logits bit-identical to a plain ``transformers`` load. torch offers no
    per-thread hook for parameter registration, so ``Module.register_parameter`` is wrapped while
    at least one thread is inside the block and the wrapper acts only for those threads: modules
    other threads build meanwhile keep real parameters, and the original method is back once the
    last thread leaves.
    """
    import torch

    with _install_lock:
        if _installed["count"] == 0:
            _installed["original"] = torch.nn.Module.register_parameter
            torch.nn.Module.register_parameter = _register_parameter
        _installed["count"] += 1
    _meta.depth = getattr(_meta, "depth", 0) + 1
    try:
        yield
    finally:
        _meta.depth -= 1
        with _install_lock:
            _installed["count"] -= 1
            if _installed["count"] == 0:
                torch.nn.Module.register_parameter = _installed["original"]
                _installed["original"] = None


def _no_weight_init():
    """transformers' switch that skips initializing weights (they are all replaced by views):
    three quarters of building an 8B skeleton otherwise, even on meta."""
    try:
        from transformers.initialization import no_init_weights     # transformers >= 5
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights  # transformers 4.x
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


# What building a skeleton imports in a process that has not yet imported the model's
# ``transformers`` module (a fresh process): ~2,000 modules in ~4,700 files, ~60k file system calls
# and ~125 MB read -- transformers reads the source of every model of its library to find their
# exported names, and modeling_utils pulls in torch.distributed, torch._dynamo, sympy, scipy. Read
# one after the other while a cold load keeps the disk (or a sandbox's file path) busy, each waits
# behind that load: seconds. ``prefetch_imports`` reads them first, in parallel.
PREFETCH_PACKAGES = ("transformers", "torch", "sympy", "mpmath", "numpy", "safetensors",
                     "huggingface_hub", "tokenizers", "jinja2", "yaml", "regex", "packaging",
                     "filelock", "fsspec", "tqdm", "accelerate", "deepseek_flash",
                     "deepseek_flash.decode", "deepseek_flash.kv", "deepseek_flash.quant")
# Walked besides a recorded manifest (see ``prefetch_imports``).
MANIFEST_WALK = ("transformers",)
PREFETCH_THREADS = 32
PREFETCH_CHUNK = 1 << 20
# Directories no import reads from (C++ headers, libraries, test suites).
SKIP_DIRS = frozenset(("tests", "test", "testing", "include", "lib", "share", "bin", "benchmarks"))


def skeleton_imported(config_dict: dict) -> bool:
    """Whether the ``transformers`` module of this config's architecture is imported already
    (then building the skeleton reads no files)."""
    import sys

    kind = str(config_dict.get("model_type", ""))
    return f"transformers.models.{kind}.modeling_{kind}" in sys.modules


def imports_cached(config_dict: dict) -> bool:
    """Whether the files the skeleton's imports start with -- the architecture's modeling source
    and transformers' ``modeling_utils`` -- are in the page cache (``RWF_NOWAIT`` reads: no disk
    access). False where that cannot be told (no such file, a filesystem without ``RWF_NOWAIT``):
    then the files are read ahead, which costs a fraction of a second when they were cached."""
    import importlib.util
    import os

    kind = str(config_dict.get("model_type", ""))
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations or not hasattr(os, "RWF_NOWAIT"):
        return False
    root = list(spec.submodule_search_locations)[0]
    probe = bytearray(1)
    for rel in (os.path.join("models", kind, f"modeling_{kind}.py"), "modeling_utils.py"):
        try:
            fd = os.open(os.path.join(root, rel), os.O_RDONLY)
        except OSError:
            return False
        try:
            os.preadv(fd, [probe], 0, os.RWF_NOWAIT)
        except OSError:                 # BlockingIOError: not cached; others: cannot tell
            return False
        finally:
            os.close(fd)
    return True


def imports_manifest_path():
    """Where the files a skeleton build imported are recorded for the next fresh process of this
    interpreter: ``$DEEPSEEK_FLASH_CACHE_DIR``, else ``$XDG_CACHE_HOME/deepseek-flash``, else
    ``~/.cache/deepseek-flash``; one file per interpreter (cache tag) and ``sys.prefix``."""
    import hashlib
    import os
    import sys
    from pathlib import Path

    base = os.environ.get("DEEPSEEK_FLASH_CACHE_DIR")
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                            "deepseek-flash")
    prefix = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
    return Path(base) / f"skeleton-imports-{sys.implementation.cache_tag}-{prefix}.txt"


def _module_files(names) -> list:
    """The files an import of the named modules reads, in the order of ``names``: the compiled
    module where there is one (its source is only looked at, not read), else the file loaded."""
    import os
    import sys

    files = {}
    for name in names:
        module = sys.modules.get(name)
        for attr in ("__cached__", "__file__"):
            path = getattr(module, attr, None)
            if isinstance(path, str) and os.path.isabs(path) and os.path.isfile(path):
                files[path] = None
                break
    return list(files)


def record_imports(names) -> int:
    """Add the files of the modules ``names`` (those a skeleton build just imported, in import
    order) to the manifest ``prefetch_imports`` reads next time -- kept in import order, so a read-ahead
    running beside the imports stays ahead of them; returns how many files it lists. Best effort:
    an unwritable cache directory only costs the next fresh process those files' reads."""
    import os

    files = _module_files(names)
    if not files:
        return 0
    path = imports_manifest_path()
    try:
        known = [p for p in path.read_text().split("\n") if p]
    except OSError:
        known = []
    have = set(known)
    added = [f for f in files if f not in have]
    if not added:
        return len(known)
    known += added
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text("\n".join(known) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass
    return len(known)


def _read_ahead_job(packages, threads: int) -> dict | None:
    """What ``prefetch_imports`` reads (see there), as the JSON job of ``client.imports_readahead``; None
    when there is nothing to read."""
    import importlib.util
    import sys

    try:
        recorded = [p for p in imports_manifest_path().read_text().split("\n") if p]
    except OSError:
        recorded = []
    if packages is None:
        packages = MANIFEST_WALK if recorded else PREFETCH_PACKAGES
    roots = []
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            roots.extend(spec.submodule_search_locations)
    if not roots and not recorded:
        return None
    return {"files": recorded, "roots": list(dict.fromkeys(roots)),
            "tag": f".{sys.implementation.cache_tag}.", "skip": sorted(SKIP_DIRS),
            "threads": threads, "chunk": PREFETCH_CHUNK, "walk_pycache": not recorded}


def prefetch_imports(packages=None, threads: int = PREFETCH_THREADS,
                     seen: list | None = None) -> int:
    """Read into the page cache the files a skeleton build imports: those an earlier build of this
    interpreter recorded (``record_imports``, in import order) and, walked by ``threads`` threads,
    each ``.py`` of ``packages`` and each compiled module of this interpreter
    (``__pycache__/*.<cache tag>.pyc``). ``packages`` by default: ``MANIFEST_WALK`` where a
    manifest exists (transformers reads its models' sources as text; they are no modules), else
    ``PREFETCH_PACKAGES`` -- thousands of small reads in flight at once instead of one at a time.
    The bytes are read, not only advised (``POSIX_FADV_WILLNEED`` is ignored by some kernels --
    gVisor's -- which left the first version of this a no-op there). Returns the number of files
    read; ``seen``, if given, gets their paths. Test, header and library directories
    (``SKIP_DIRS``) are skipped; errors are ignored (an import reads what is missing itself).
    In this process; ``start_read_ahead`` does the same in a process of its own."""
    from .imports_readahead import read_ahead

    job = _read_ahead_job(packages, threads)
    if job is None:
        return 0
    files = read_ahead(**job)
    if seen is not None:
        seen.extend(sorted(files))
    return len(files)


class ReadAhead:
    """A ``prefetch_imports`` running as a process of its own (``start_read_ahead``)."""

    def __init__(self, proc, started: float):
        import threading

        self.proc = proc
        self.started = started
        self.files: int | None = None           # read, once it has ended
        self.seconds: float | None = None       # start -> end
        self._done = threading.Event()
        threading.Thread(target=self._reap, daemon=True, name="flash-read-ahead-reaper").start()

    def _reap(self) -> None:
        import time

        try:
            with self.proc.stdout as stdout:
                out = stdout.read()
            self.proc.wait()
            self.files = int(out.strip().splitlines()[-1]) if self.proc.returncode == 0 else None
        except (OSError, ValueError, IndexError):
            self.files = None
        self.seconds = time.perf_counter() - self.started
        self._done.set()

    def wait(self, timeout: float | None = None) -> int | None:
        """Files read (None if the process failed); TimeoutError if still running."""
        if not self._done.wait(timeout):
            raise TimeoutError("the import read-ahead is still running")
        return self.files


def start_read_ahead(packages=None, threads: int = PREFETCH_THREADS) -> ReadAhead | None:
    """``prefetch_imports`` in a process of its own (``python -I -S client/imports_readahead.py``), so that
    it runs beside this process's imports -- and beside a load's disk reads -- without holding
    this interpreter's lock or the load's start. Returns None when there is nothing to read or no
    process could be started (the imports then read their files themselves)."""
    import json
    import os
    import subprocess
    import sys
    import time

    exe = sys.executable
    if not exe or not os.path.basename(exe).lower().startswith(("python", "pypy")):
        # An embedding host (uWSGI, a C++ server): its executable would not run the script.
        log.debug("import read-ahead not started: %r is no Python interpreter", exe)
        return None
    job = _read_ahead_job(packages, threads)
    if job is None:
        return None
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "imports_readahead.py")
    started = time.perf_counter()
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", script], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                close_fds=True)
    except OSError as exc:
        log.debug("import read-ahead not started: %s", exc)
        return None
    try:
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
    except OSError:       # it ended at once; its reaper collects it
        pass
    return ReadAhead(proc, started)


def build_skeleton(config_dict: dict):
    """A ``transformers`` causal LM of the stored config with all parameters on meta."""
    import sys

    fresh = not skeleton_imported(config_dict)
    before = set(sys.modules) if fresh else None
    import transformers

    config = transformers.AutoConfig.for_model(**config_dict)
    with meta_parameters(), _no_weight_init():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.eval()
    if fresh:
        # What this build imported (sys.modules keeps import order), for the next fresh
        # process's read-ahead.
        record_imports([m for m in sys.modules if m not in before])
    return model


def bind_parameters(model, tensors: dict, complete: bool = True, fixed: bool = True) -> None:
    """Make each named parameter of ``model`` the given tensor (a view; never copied).

    A quantized weight (``deepseek_flash.quant.QuantizedTensor``, from a quantized store) swaps its
    ``nn.Linear`` for a ``QuantLinear`` bound to the codes and scales: precision is chosen here,
    at bind time, never in the forward pass. With ``complete`` every parameter must be bound
    afterwards (none left on meta). ``fixed``: the bytes under the views stay the same while bound
    (False for a streaming slot, whose contents change every pass; ``QuantLinear.bind``).
    """
    import torch

    from ..quant import QuantizedTensor
    from ..quant.linear import bind_quantized

    for name, tensor in tensors.items():
        module_name, _, leaf = name.rpartition(".")
        if isinstance(tensor, QuantizedTensor):
            bind_quantized(model, module_name, tensor, fixed)
            continue
        module = model.get_submodule(module_name)
        if leaf not in module._parameters:
            raise KeyError(f"the model has no parameter {name!r}")
        module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
    if not complete:
        return
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise KeyError(f"parameters not served by the store: {missing[:8]}"
                       f"{' ...' if len(missing) > 8 else ''}")


def decoder_parts(model):
    """(embeddings, decoder layers, final norm, lm_head) of a Llama-family causal LM."""
    inner = model.model
    return inner.embed_tokens, list(inner.layers), inner.norm, model.lm_head
