"""Helpers shared by the benchmarks: the limits every result is compared against, measured in the
same run (raw O_DIRECT reads, dd, pinned host->GPU copies), page-cache dropping, and the random
8B-shaped checkpoint the GPU benchmarks use."""
from __future__ import annotations

import json
import mmap
import os
import subprocess
import threading
import time
from pathlib import Path

PY_CHUNK = 4 << 20

# The 8B Llama shape of the design's measurements.
LLAMA_8B = dict(hidden=4096, layers=32, intermediate=14336, vocab=128256, heads=32, kv_heads=8)
# The shapes every GPU benchmark runs (``--arch``): Llama-3-8B, Qwen2-7B (q/k/v biases),
# Mistral-7B (v0.3 vocabulary).
ARCH_SHAPES = {
    "llama": LLAMA_8B,
    "qwen2": dict(hidden=3584, layers=28, intermediate=18944, vocab=152064, heads=28, kv_heads=4),
    "mistral": dict(hidden=4096, layers=32, intermediate=14336, vocab=32768, heads=32, kv_heads=8),
}
ARCHS = tuple(ARCH_SHAPES)


def add_arch_argument(parser) -> None:
    parser.add_argument("--arch", choices=ARCHS, default="llama",
                        help="model shape: llama (8B), qwen2 (7B), mistral (7B)")


def write_finite_model(path, arch: str = "llama", layers: int | None = None, **kw) -> Path:
    """``write_finite_llama`` with the 7-8B shape of ``arch`` (``layers`` to cut it short)."""
    shape = dict(ARCH_SHAPES[arch])
    if layers:
        shape["layers"] = layers
    return write_finite_llama(path, arch=arch, **shape, **kw)


def drop_caches() -> bool:
    """Write back and drop the page cache (root only); False where that is not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def dd_read(path: str, size: int, bs: int = 8 << 20, skip: int = 0) -> float:
    """``dd iflag=direct`` of ``size`` bytes from ``skip`` blocks of ``bs`` on, GB/s."""
    t = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "iflag=direct", f"bs={bs}", f"skip={skip}",
                    f"count={size // bs}"], check=True, capture_output=True)
    return gbps(size // bs * bs, time.perf_counter() - t)


def python_direct_read(path: str, size: int, threads: int = 8) -> float:
    """A multi-threaded Python O_DIRECT reader (preadv of 4 MiB chunks), GB/s."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    chunks = size // PY_CHUNK
    next_chunk = iter(range(chunks))
    lock = threading.Lock()

    def worker():
        buf = mmap.mmap(-1, PY_CHUNK)  # page aligned, as O_DIRECT needs
        while True:
            with lock:
                i = next(next_chunk, None)
            if i is None:
                return
            os.preadv(fd, [buf], i * PY_CHUNK)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    t = time.perf_counter()
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    dt = time.perf_counter() - t
    os.close(fd)
    return gbps(chunks * PY_CHUNK, dt)


def pinned_h2d(nbytes: int = 4 << 30, repeat: int = 3, device: int = 0) -> float:
    """Best of ``repeat`` pinned host->GPU copies of ``nbytes``, GB/s."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, gbps(nbytes, time.perf_counter() - t))
    del src, dst
    torch.cuda.empty_cache()
    return best


def copy_bandwidth(torch, nbytes=4 << 30, repeat=5) -> float:
    """Device-to-device copy on cuda:0, bytes read + written per second (best of ``repeat``): the
    HBM limit the decode benchmarks compare against."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / best


def write_finite_llama(path, *, dtype: str = "bfloat16", seed: int = 0, **shape) -> Path:
    """A random Llama checkpoint whose values are small finite numbers (so decoding is
    deterministic and comparable), written as sharded safetensors without building the model."""
    import numpy as np

    from deepseek_flash.store.synth import write_random_llama

    path = Path(path)
    if (path / "config.json").exists():
        return path
    # Random bits make NaNs and huge values; keep sign and mantissa, pin the exponent near 2^-6
    # -- on each tensor's bytes before they are written (no second pass over the files).
    exponent_mask, exponent = {"bfloat16": (0x807F, 0x3C00), "float16": (0x83FF, 0x2000)}[dtype]

    def pin_exponent(data):
        words = data.view(np.uint16)
        np.bitwise_and(words, exponent_mask, out=words)
        np.bitwise_or(words, exponent, out=words)

    write_random_llama(path, dtype=dtype, seed=seed, shard_bytes=4 << 30, transform=pin_exponent,
                       **shape)
    return path


def save(result: dict, output: str | None) -> None:
    """Write what is measured so far (a run cut short keeps its finished phases)."""
    if output:
        Path(output).write_text(json.dumps(result, indent=2) + "\n")


def emit(result: dict, output: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if output:
        Path(output).write_text(text + "\n")
