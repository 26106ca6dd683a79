"""deepseek-flash: a tiered weight store (NVMe -> pinned host RAM -> GPU) serving PyTorch models.

Public API (imported lazily so ``import deepseek_flash`` stays cheap):

* ``deepseek_flash.load_model(name_or_path, device=..., weight_budget=None, ...)``
* ``deepseek_flash.Client`` -- the controller over the socket, or embedded in this process
* ``deepseek_flash.errors`` -- typed exceptions with stable numeric codes
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Client": ("deepseek_flash.client", "Client"),
    "load_model": ("deepseek_flash.client.model", "load_model"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'deepseek_flash' has no attribute {name!r}")
