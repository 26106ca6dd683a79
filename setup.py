"""Build and install deepseek-flash.

The repository's top-level folders are the subpackages of one import name, ``deepseek_flash``:

    deepseek_flash/   -> deepseek_flash            public API, CLI, block store (store/), operator verbs
                                                   (ops/) and tools (tools/)
    client/           -> deepseek_flash.client     client library (socket + embedded), model loader
    daemon/           -> deepseek_flash.daemon     the controller: block manager, prefetch, fabric, server
    sysfs_shim/       -> deepseek_flash.sysfs_shim status tree publisher (/run/deepseek_flash)
    serve/            -> deepseek_flash.serve      OpenAI-compatible server, continuous batching, scheduler
    quant/            -> deepseek_flash.quant      quantized weights: codec, scale search, QuantLinear
    decode/           -> deepseek_flash.decode     static KV cache and CUDA-graph decode (generate())
    kv/               -> deepseek_flash.kv         tiered KV cache: BICL pages, top-K selection, spill
    ext/              -> deepseek_flash._core      C++ data plane (pybind11): IO engine, host arena, crc32c
    systemd/, etc/    -> package data              unit files and the default config
"""
import os
from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

PACKAGE_DIRS = {
    "deepseek_flash": "deepseek_flash",
    "deepseek_flash.store": "deepseek_flash/store",
    "deepseek_flash.tools": "deepseek_flash/tools",
    "deepseek_flash.ops": "deepseek_flash/ops",
    "deepseek_flash.client": "client",
    "deepseek_flash.daemon": "daemon",
    "deepseek_flash.sysfs_shim": "sysfs_shim",
    "deepseek_flash.serve": "serve",
    "deepseek_flash.quant": "quant",
    "deepseek_flash.decode": "decode",
    "deepseek_flash.kv": "kv",
    "deepseek_flash.kv.prune": "kv/prune",
}

# Fault injection (IOEngine.inject_fault) is compiled in only for test builds: CI builds with
# DEEPSEEK_FLASH_FAULT_INJECTION=1; an ordinary install -- the daemon's -- has no way to fail a
# read on purpose.
FAULT_INJECTION = os.environ.get("DEEPSEEK_FLASH_FAULT_INJECTION") == "1"

core = Pybind11Extension(
    "deepseek_flash._core",
    sorted(glob("ext/*.cpp")),
    include_dirs=["ext"],
    define_macros=[("FLASH_FAULT_INJECTION", "1")] if FAULT_INJECTION else [],
    cxx_std=17,
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-fvisibility=hidden"],
    libraries=["pthread"],
)

setup(
    packages=list(PACKAGE_DIRS),
    package_dir=PACKAGE_DIRS,
    package_data={"deepseek_flash": ["_core.pyi", "py.typed", "data/*"]},
    ext_modules=[core],
    cmdclass={"build_ext": build_ext},
)
