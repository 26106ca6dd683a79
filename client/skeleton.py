"""The model skeleton: a ``transformers`` causal LM built without weight memory, and binding views.

``build_skeleton`` makes the model of a stored config with every parameter on the meta device
(~15 ms for an 8B shape); ``bind_parameters`` then makes each parameter a view of bytes the
controller holds. ``client.model`` (resident layers) and ``client.stream`` (streamed layers) both
bind through here.
"""
from __future__ import annotations

import contextlib
import threading

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
# ``transformers`` module (a fresh process): a few thousand files -- transformers reads the source
# of every model of its library to find their exported names, and modeling_utils pulls in
# torch.distributed, torch._dynamo, sympy. Read one after the other while a cold load keeps the
# disk's queue full, each waits behind that queue: seconds. ``prefetch_imports`` has them read
# first, in parallel and asynchronously.
PREFETCH_PACKAGES = ("transformers", "torch", "sympy", "mpmath", "numpy", "safetensors",
                     "huggingface_hub", "tokenizers", "jinja2", "yaml", "regex", "packaging",
                     "filelock", "fsspec", "tqdm", "accelerate", "deepseek_flash",
                     "deepseek_flash.decode", "deepseek_flash.kv", "deepseek_flash.quant")
PREFETCH_THREADS = 32
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


def prefetch_imports(packages=PREFETCH_PACKAGES, threads: int = PREFETCH_THREADS) -> int:
    """Ask the kernel to read the Python files of ``packages`` into the page cache: every
    directory listed by ``threads`` threads, each ``.py`` and each compiled module of this
    interpreter (``__pycache__/*.<cache tag>.pyc``) given ``POSIX_FADV_WILLNEED`` -- asynchronous
    readahead, so thousands of small reads are in flight at once instead of one at a time.
    Returns the number of files. Test, header and library directories (``SKIP_DIRS``) are skipped; errors are ignored (an import
    reads what is missing itself)."""
    import importlib.util
    import os
    import queue
    import sys

    tag = f".{sys.implementation.cache_tag}."
    roots = []
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            roots.extend(spec.submodule_search_locations)
    if not roots:
        return 0
    todo: queue.Queue = queue.Queue()
    for root in dict.fromkeys(roots):
        todo.put(root)
    counts = [0] * threads

    def advise(path: str) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOATIME)
        except OSError:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                return False
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
        return True

    def work(k: int) -> None:
        while True:
            directory = todo.get()
            if directory is None:
                todo.task_done()
                return
            try:
                with os.scandir(directory) as entries:
                    for e in entries:
                        name = e.name
                        if e.is_dir(follow_symlinks=False):
                            if name == "__pycache__":
                                with os.scandir(e.path) as compiled:
                                    for c in compiled:
                                        if tag in c.name:
                                            counts[k] += advise(c.path)
                            elif not name.startswith(".") and name not in SKIP_DIRS:
                                todo.put(e.path)
                        elif name.endswith(".py"):
                            counts[k] += advise(e.path)
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
    return sum(counts)


def build_skeleton(config_dict: dict):
    """A ``transformers`` causal LM of the stored config with all parameters on meta."""
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
