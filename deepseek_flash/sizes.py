"""Byte sizes as people type them (``"8GiB"``, ``"512 MiB"``, ``1073741824``)."""
from __future__ import annotations

import re
from typing import Any

from .errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000 ** 2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30, "t": 1 << 40,
          "tb": 1000 ** 4, "tib": 1 << 40}
_ALLOWED = "integer bytes or \"<n>[KiB|MiB|GiB|TiB]\""


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string such as ``"8GiB"``, ``"512 MiB"``, ``"1G"`` (K/M/G = KiB...);
    ConfigError naming ``key`` otherwise."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is not a size; use bytes or e.g. \"8GiB\"",
                          key=key, value=value, allowed=_ALLOWED)
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"{key}: {value!r} is not a size; use bytes or e.g. \"8GiB\"",
                              key=key, value=value, allowed=_ALLOWED)
        return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise ConfigError(f"{key}: {value!r} is not a size", key=key, value=value, allowed=_ALLOWED)
