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
_opens_lock = threading.Lock()
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


def _modeling_module(config_dict: dict) -> str:
    kind = str(config_dict.get("model_type", ""))
    return f"transformers.models.{kind}.modeling_{kind}"


def skeleton_imported(config_dict: dict) -> bool:
    """Whether the ``transformers`` module of this config's architecture is imported already
    (then building the skeleton imports nothing)."""
    import sys

    return _modeling_module(config_dict) in sys.modules


# The files opened while an ``Imports`` thread runs (``record_opens``): an audit hook, installed
# once per process (hooks cannot be removed), that returns at once while nothing records. The
# files are a dict's keys, in the order first opened (the daemon reads them ahead in that order).
_opens = {"on": 0, "files": {}, "installed": False}
_NOT_FILES = ("/proc/", "/dev/", "/sys/")


def _audit(event, args):
    if event == "open" and _opens["on"]:
        path = args[0] if args else None
        if isinstance(path, str) and path.startswith("/") and not path.startswith(_NOT_FILES):
            _opens["files"].setdefault(path)


@contextlib.contextmanager
def record_opens():
    """The absolute paths of the files this process opens inside the block (any thread: the
    imports' own reads, such as transformers' scan of its model sources, are not modules), as the
    keys of a dict filled in place, in the order first opened."""
    import sys

    with _opens_lock:
        if not _opens["installed"]:
            sys.addaudithook(_audit)
            _opens["installed"] = True
        _opens["on"] += 1
    files = _opens["files"]
    try:
        yield files
    finally:
        with _opens_lock:
            _opens["on"] -= 1
            if not _opens["on"]:
                _opens["files"] = {}


class Imports:
    """The imports of a skeleton build, run on a thread of their own (``start_imports``).

    In a process that has not imported the model's ``transformers`` module, building the skeleton
    is almost all imports: ~2,200 modules (``transformers.modeling_utils`` pulls in
    torch.distributed.tensor, torch._dynamo, sympy, scipy, accelerate), 3-4 s of CPU on the CI
    box, ~10.5 s on the GPU machines (gVisor: every file system call of the ~4,700 files opened
    and ~40k stats is a trip through the sandbox). Started right after ``open_model``, they run
    while the attach's round trip and the load's first reads are under way; ``wait`` joins them
    before anything else of transformers is imported on the caller's thread (two threads
    importing the same package tree at once can see each other's half-initialised modules).
    An error is not raised here: the caller's own import then raises it.
    """

    def __init__(self, module: str, bytecode_cache: str | None = None):
        self.module = module
        # The daemon's compiled-module cache (its hello), read where this installation has no
        # compiled files (deepseek_flash.bytecode); whether it was (``prefix``), once done.
        self.bytecode_cache = bytecode_cache
        self.prefix: str | None = None
        self.seconds: float | None = None       # the imports' own time, once done
        self.cpu_seconds: float | None = None   # and this thread's CPU time in it
        self.opened: dict = {}                  # the files opened meanwhile, in order (``record_opens``)
        # What the process had before (imported modules, mapped files): not theirs to report.
        self.before: tuple[set, set] = (set(), set())
        self._thread = threading.Thread(target=self._run, daemon=True, name="flash-skeleton-imports")
        self._thread.start()

    def _run(self) -> None:
        import importlib
        import importlib.util
        import sys
        import time

        from .. import bytecode
        from .metadata import few_stats

        started, cpu = time.perf_counter(), time.thread_time()
        self.before = (set(sys.modules), mapped_files())
        try:
            spec = importlib.util.find_spec(self.module.split(".")[0])
            probes = [spec.origin] if spec is not None and spec.origin else []
            # few_stats: transformers' package-metadata scan at import, without a stat per
            # installed file (client.metadata); prefix_while: compiled modules from the daemon's
            # cache where this installation has none (not compiled again in every process).
            with record_opens() as opened, few_stats(), \
                    bytecode.prefix_while(self.bytecode_cache, probes) as prefix:
                self.prefix = prefix
                importlib.import_module(self.module)
            self.opened = opened
        except Exception as exc:  # noqa: BLE001 -- the caller's import raises it again
            log.debug("importing %s ahead failed: %s", self.module, exc)
        self.cpu_seconds = time.thread_time() - cpu
        self.seconds = time.perf_counter() - started

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()


def imports_module(config_dict: dict | None) -> str | None:
    """The module ``start_imports`` would import for this config: None when there is no config
    or it is imported already."""
    if config_dict is None or skeleton_imported(config_dict):
        return None
    return _modeling_module(config_dict)


def start_imports(config_dict: dict | None, started: Imports | None = None,
                  bytecode_cache: str | None = None) -> Imports | None:
    """Start importing the architecture's ``transformers`` module (see ``Imports``); None when
    it is imported already or ``config_dict`` is None. ``started``: imports begun earlier (for
    another config), kept when they are this config's; otherwise joined first (two threads must not import the package tree at once)."""
    if config_dict is None:
        return started
    if started is not None:
        if started.module == _modeling_module(config_dict):
            return started
        started.wait()
    if skeleton_imported(config_dict):
        return None
    return Imports(_modeling_module(config_dict), bytecode_cache)


# What imports_done may carry at most (the daemon's frames are 1 MiB by default).
MAX_REPORT_BYTES = 512 << 10


def mapped_files(maps_path: str = "/proc/self/maps") -> set[str]:
    """The files mapped into this process (shared libraries, extension modules); empty where
    ``maps_path`` is unreadable."""
    out = set()
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/") and not parts[5].startswith("/dev/"):
                    path = parts[5].strip()
                    if not path.endswith(" (deleted)"):
                        out.add(path)
    except OSError:
        pass
    return out


def imported_files(modules=None, maps_path: str = "/proc/self/maps", opened=(),
                   before=None) -> dict[str, list[str]] | None:
    """The files this process's imports opened, as ``{directory: [name, ...]}`` (what the daemon
    keeps and reads ahead at its next start, ``daemon.imports_ahead``): ``opened``
    (``Imports.opened``, in the order first opened), then each module's source and compiled file
    and extension module, then the shared libraries mapped into the process -- directories and
    names in the order first seen, so the daemon reads the first-needed first -- less what the
    process had before the imports (``before``:
    ``Imports.before``, the module names and mapped files then: torch and its CUDA libraries
    are loaded before a load starts). No file system call but reading ``maps_path``. None when the
    list would exceed ``MAX_REPORT_BYTES`` even without the sources (it is then not reported)."""
    import os
    import sys

    had_modules, had_maps = before if before is not None else ((), ())
    had_modules = set(had_modules)
    files = dict.fromkeys(opened)      # an ordered set: the order first opened
    for name, mod in list((sys.modules if modules is None else modules).items()):
        if name in had_modules:
            continue
        spec = getattr(mod, "__spec__", None)
        for path in (getattr(spec, "cached", None), getattr(mod, "__file__", None)):
            if isinstance(path, str) and os.path.isabs(path):
                files.setdefault(path)
    had_maps = set(had_maps)
    for path in sorted(mapped_files(maps_path)):
        if path not in had_maps:
            files.setdefault(path)
    for candidate in (list(files), [f for f in files if not f.endswith(".py")]):
        grouped: dict[str, list[str]] = {}
        for path in candidate:
            directory, name = os.path.split(path)
            grouped.setdefault(directory, []).append(name)
        size = sum(len(d) + 6 + sum(len(n) + 3 for n in names) for d, names in grouped.items())
        if size <= MAX_REPORT_BYTES:
            return grouped
    return None


def build_skeleton(config_dict: dict, imports: Imports | None = None):
    """A ``transformers`` causal LM of the stored config with all parameters on meta (no weight
    memory is allocated or initialised; buffers such as the rotary tables are computed).
    ``imports``: the ``start_imports`` of this config, joined first."""
    if imports is not None:
        imports.wait()
    import transformers

    config = transformers.AutoConfig.for_model(**config_dict)
    with meta_parameters(), _no_weight_init():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.eval()
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
