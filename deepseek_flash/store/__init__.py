"""The on-disk block store: format, pack, read, verify, inspect, repair (spec: docs/format.md)."""
from .format import BlockInfo, TensorInfo
from .pack import pack
from .reader import Store

__all__ = ["BlockInfo", "Store", "TensorInfo", "pack"]
