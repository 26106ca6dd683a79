"""Shared fixtures of the store tests: tiny random HF models (made once per session) and packed stores."""
from __future__ import annotations

import glob
import shutil

import pytest

from deepseek_flash.store import pack
from deepseek_flash.testing import make_tiny_model

# (arch, dtype, sharded): every architecture, every dtype, sharded-with-index and single file.
MODEL_CASES = [
    ("llama", "float32", True),
    ("llama", "bfloat16", False),
    ("llama", "float16", False),
    ("qwen2", "bfloat16", False),
    ("qwen2", "float32", True),
    ("mistral", "float16", True),
    ("mistral", "bfloat16", False),
]
SMALL = dict(hidden_size=32, num_layers=2, intermediate_size=64, num_heads=4, num_kv_heads=2,
             vocab_size=96)


def case_id(case) -> str:
    arch, dtype, sharded = case
    return f"{arch}-{dtype}-{'sharded' if sharded else 'single'}"


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(arch, dtype, sharded, **config) -> model dir, cached per argument set."""
    cache = {}

    def make(arch="llama", dtype="float32", sharded=False, **extra):
        key = (arch, dtype, sharded, tuple(sorted(extra.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{arch}-{dtype}") / "model"
            cache[key] = make_tiny_model(path, arch, dtype=dtype, seed=len(cache),
                                         max_shard_size="12KB" if sharded else None,
                                         **{**SMALL, **extra})
        return cache[key]
    return make


@pytest.fixture
def llama_dir(model_factory, tmp_path):
    """A private copy of a sharded fp32 llama (tests may damage it)."""
    dst = tmp_path / "llama"
    shutil.copytree(model_factory("llama", "float32", True), dst)
    return dst


@pytest.fixture
def store_dir(model_factory, tmp_path):
    """A freshly packed private store of a tied Qwen2 (biases, alias) -- tests may damage it."""
    return pack(model_factory("qwen2", "bfloat16", False), tmp_path / "qwen2.flash")


@pytest.fixture
def llama_store(llama_dir, tmp_path):
    return pack(llama_dir, tmp_path / "llama.flash")


def reference_tensors(model_dir) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(glob.glob(f"{model_dir}/*.safetensors")):
        out.update(load_file(f))
    return out
