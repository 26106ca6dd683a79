"""The controller's configuration: every key, its default, its validation, and where it may be set.

One table (``KEYS``) holds each key's default, parser, allowed values, scope, whether it can be
changed at run time (``tunable``) and whether only a restart changes it (``restart``: a SIGHUP
keeps the running value), so the loader, the per-model overrides, the ``set_tunable`` op, the
reload and the docs all read the same facts. Invalid values raise ``ConfigError`` naming the
key, the value and what is allowed; unknown keys are rejected (a typo must not silently fall
back to a default).

Scopes:
* ``daemon`` -- one value for the whole controller (arena size, sockets, limits, eviction);
* ``model``  -- may also be overridden per model (``"flash_config"`` in the model's config.json)
  and per open (``flash_context``), because it changes how *that* model is served.
A model file can carry only model-scope keys: a checkpoint downloaded from the Hub must not be able
to resize the daemon's cache. A daemon-scope key found there is refused (ConfigError naming
flash.json), so nobody believes in a setting that does nothing.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import paths
from ..errors import ConfigError
from ..sizes import parse_size
from ..wire import DEFAULT_STREAM_UNIT, STREAM_UNITS

log = logging.getLogger("deepseek_flash.config")


def _int_range(lo: int, hi: int) -> Callable[[str, Any], int]:
    def parse(key, value):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigError(f"{key}: {value!r} is not allowed; use an integer in {lo}..{hi}",
                              key=key, value=value, allowed=f"{lo}..{hi}")
        return value
    return parse


def _window(key, value):
    if value == "auto":
        return value
    try:
        return _int_range(0, 64)(key, value)
    except ConfigError:
        raise ConfigError(f"{key}: {value!r} is not allowed; use \"auto\" or an integer in 0..64",
                          key=key, value=value, allowed="\"auto\" | 0..64") from None


def _choice(*allowed: str, implemented: tuple[str, ...] | None = None) -> Callable[[str, Any], str]:
    def parse(key, value):
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not allowed; use one of {', '.join(allowed)}",
                              key=key, value=value, allowed=list(allowed))
        if implemented is not None and value not in implemented:
            raise ConfigError(f"{key}: {value!r} is not implemented yet; this version serves "
                              f"only {', '.join(implemented)}", key=key, value=value,
                              allowed=list(implemented))
        return value
    return parse


def _fraction(lo_open: bool) -> Callable[[str, Any], float]:
    desc = "0 < r <= 1" if lo_open else "0 <= x <= 1"

    def parse(key, value):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
            ok = (0.0 < value <= 1.0) if lo_open else (0.0 <= value <= 1.0)
        if not ok:
            raise ConfigError(f"{key}: {value!r} is not allowed; use a number with {desc}",
                              key=key, value=value, allowed=desc)
        return value
    return parse


def _host_cache(key, value):
    size = parse_size(key, value)
    if size < (1 << 20):
        raise ConfigError(f"{key}: {value!r} is below the minimum of 1 MiB", key=key, value=value,
                          allowed=">= 1MiB")
    return size


def _frame_bytes(key, value):
    size = parse_size(key, value)
    if not (4096 <= size <= (256 << 20)):
        raise ConfigError(f"{key}: {value!r} is not allowed; use 4KiB..256MiB", key=key, value=value,
                          allowed="4KiB..256MiB")
    return size


READ_SHAPE_RANGE = "DEPTHxSIZE: depth 1..1024, size 4KiB..64MiB, a multiple of 4KiB (\"8x4MiB\")"


def read_shape(key, value) -> tuple[int, int]:
    """``"8x4MiB"`` -> (8, 4194304): reads kept in flight, bytes a read; ConfigError naming
    ``key`` for anything else."""
    depth, sep, size = value.partition("x") if isinstance(value, str) else ("", "", "")
    try:
        shape = (int(depth), parse_size(key, size)) if sep and depth.strip().isdigit() else None
    except ConfigError:
        shape = None
    if shape is None or not (1 <= shape[0] <= 1024 and 4096 <= shape[1] <= (64 << 20)
                             and shape[1] % 4096 == 0):
        raise ConfigError(f"{key}: {value!r} is not allowed; use {READ_SHAPE_RANGE}", key=key,
                          value=value, allowed=READ_SHAPE_RANGE)
    return shape


def _read_shape(key, value):
    read_shape(key, value)
    return value.strip()


def _devices(key, value):
    if value is None:
        return None
    if isinstance(value, list):
        out = []
        for item in value:
            if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
                out.append(item)
            elif isinstance(item, str) and re.fullmatch(r"cuda:\d+", item):
                out.append(int(item.split(":")[1]))
            else:
                break
        else:
            return sorted(set(out))
    raise ConfigError(f"{key}: {value!r} is not allowed; use null (every visible GPU) or a list of "
                      f"device indices such as [0, 1] or [\"cuda:0\"]", key=key, value=value,
                      allowed="null | [int | \"cuda:N\", ...]")


def _socket_mode(key, value):
    if isinstance(value, str) and re.fullmatch(r"0?o?[0-7]{3,4}", value):
        value = int(value.replace("o", ""), 8)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0o777:
        raise ConfigError(f"{key}: {value!r} is not allowed; use a file mode such as \"0660\"",
                          key=key, value=value, allowed="0000..0777 (octal string or integer)")
    return value


def _group(key, value):
    if value is None or (isinstance(value, str) and value) or (isinstance(value, int) and value >= 0):
        return value
    raise ConfigError(f"{key}: {value!r} is not allowed; use a group name, gid or null", key=key,
                      value=value, allowed="group name | gid | null")


def _dir_list(key, value):
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        return [str(Path(v).expanduser()) for v in value]
    raise ConfigError(f"{key}: {value!r} is not allowed; use a list of directories", key=key,
                      value=value, allowed="[\"/path\", ...]")


def _kv_page_tokens(key, value):
    if value == "auto" or (type(value) is int and value in (16, 32, 64, 128)):
        return value
    raise ConfigError(f"{key}: {value!r} is not allowed; use \"auto\", 16, 32, 64 or 128", key=key,
                      value=value, allowed="\"auto\" | 16 | 32 | 64 | 128")


def _kv_top_k(key, value):
    if value is None or (type(value) is int and value >= 1) or (
            type(value) is float and 0.0 < value <= 1.0):
        return value
    raise ConfigError(f"{key}: {value!r} is not allowed; use null (every page: lossless), a number "
                      f"of pages >= 1 or a fraction in (0, 1]", key=key, value=value,
                      allowed="null | int >= 1 | 0 < fraction <= 1")


def _kv_prune_threshold(key, value):
    if value is None or (type(value) in (int, float) and 0 <= value <= 1):
        return None if value is None else float(value)
    raise ConfigError(f"{key}: {value!r} is not allowed; use null (pruning off) or a score "
                      f"threshold in [0, 1]", key=key, value=value, allowed="null | 0 <= number <= 1")


def _kv_page_cache(key, value):
    if value == "auto":
        return value
    if value is None or (type(value) in (int, float) and (value == 0 or 1 <= value < float("inf"))):
        return 0.0 if not value else float(value)
    raise ConfigError(f"{key}: {value!r} is not allowed; use 'auto' (every page, within the "
                      f"device budget), null or 0 (off) or a multiple >= 1 of the top-K page "
                      f"count", key=key, value=value, allowed="\"auto\" | null | 0 | number >= 1")


def _optional_size(key, value):
    return None if value is None else parse_size(key, value)


def _optional_dir(key, value):
    if value is None or (isinstance(value, str) and value):
        return None if value is None else str(Path(value).expanduser())
    raise ConfigError(f"{key}: {value!r} is not allowed; use null or a directory", key=key,
                      value=value, allowed="null | \"/path\"")


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")


def _registry(key, value):
    if isinstance(value, dict) and all(isinstance(k, str) and _NAME.fullmatch(k) and ".." not in k
                                       and isinstance(v, str) and v for k, v in value.items()):
        return {k: str(Path(v).expanduser()) for k, v in value.items()}
    raise ConfigError(f"{key}: {value!r} is not allowed; use {{\"name\": \"/path/to/store\"}} with "
                      f"names of letters, digits, '.', '_', '-' and '/'", key=key, value=value,
                      allowed="{name: path}")


@dataclass(frozen=True)
class Key:
    default: Any
    parse: Callable[[str, Any], Any]
    allowed: str
    scope: str            # "daemon" | "model"
    tunable: bool         # may be changed at run time through set_tunable
    help: str
    restart: bool = False  # fixed until a restart: SIGHUP keeps the running value (logged)


def _default_store_roots():
    return [str(paths.state_dir() / "models")]


KEYS: dict[str, Key] = {
    "prefetch_window": Key("auto", _window, "\"auto\" | 0..64", "model", True,
                           "decoder layers loaded ahead of the one being acquired (auto: chosen "
                           "from the plan's slot size and the PCIe link)"),
    "stream_unit": Key(DEFAULT_STREAM_UNIT, _choice(*STREAM_UNITS), " | ".join(STREAM_UNITS),
                       "model", False,
                       "what one streaming slot holds: a streamed layer's whole MLP, or one of its "
                       "projections (gate, up, down; slots a third of the size, so more MLPs stay "
                       "resident under the same weight_budget)"),
    "block_eviction_policy": Key("lru", _choice("lru", "access_frequency_weighted"),
                                 "lru | access_frequency_weighted", "daemon", True,
                                 "which unleased block leaves the host tier first"),
    "eviction_threshold": Key(0.9, _fraction(False), "0 <= x <= 1", "daemon", True,
                              "evict unleased blocks when used > threshold * host_cache_bytes"),
    "unified_memory_ratio": Key(0.8, _fraction(True), "0 < r <= 1", "daemon", False,
                                "ceiling on the share of each GPU's memory the device arena grows to",
                                restart=True),
    "quantization_granularity": Key("per_block", _choice("per_tensor", "per_block"),
                                    "per_tensor | per_block", "model", False,
                                    "scale granularity of a quantized scheme (checked against a "
                                    "quantized store's; used to quantize an unquantized one)"),
    "int4_layout": Key("auto", _choice("auto", "cuda_tiles", "stored"), "auto | cuda_tiles | stored",
                       "model", False,
                       "how the host tier holds int4 weights of a bfloat16 model: cuda_tiles in the "
                       "tile layout of torch's CUDA int4 kernel (derived once as blocks enter the "
                       "host tier), stored as on disk; auto: cuda_tiles when the controller sees "
                       "a CUDA device (decided at the model's first open)"),
    "quantization_scheme": Key("none", _choice("none", "int8_symmetric", "int4_symmetric"),
                               "none | int8_symmetric | int4_symmetric", "model", False,
                               "weight quantization: none serves the store as packed; a scheme "
                               "must match a store packed with --quantize, and quantizes an "
                               "unquantized store as its blocks enter the host tier (group 128)"),
    "error_recovery_mode": Key("strict", _choice("strict", "graceful"), "strict | graceful", "model",
                               True, "strict: a failed block fails its model until it is unloaded; "
                                     "graceful: the read is retried and the model keeps serving"),
    "host_cache_bytes": Key(4 << 30, _host_cache, ">= 1MiB (int or \"8GiB\")", "daemon", False,
                            "size of the shared host arena (the host tier budget)", restart=True),
    "devices": Key(None, _devices, "null | [int | \"cuda:N\"]", "daemon", False,
                   "CUDA devices served (null: every visible device)", restart=True),
    "socket_mode": Key(0o660, _socket_mode, "octal file mode", "daemon", False,
                       "mode of the control socket file", restart=True),
    "socket_group": Key(None, _group, "group name | gid | null", "daemon", False,
                        "group allowed to connect (null: the daemon's own group)"),
    "max_frame_bytes": Key(1 << 20, _frame_bytes, "4KiB..256MiB", "daemon", False,
                           "largest protocol frame accepted or sent", restart=True),
    "read_shape": Key("8x4MiB", _read_shape, READ_SHAPE_RANGE, "daemon", False,
                      "the IO engine's disk reads: how many in flight, of how many bytes each (a "
                      "client's imports still running read one 4 MiB at a time)", restart=True),
    "max_outstanding_requests_per_client": Key(64, _int_range(1, 65536), "1..65536", "daemon", True,
                                               "requests one client may have in flight"),
    "max_leases_per_client": Key(65536, _int_range(1, 1 << 24), "1..16777216", "daemon", True,
                                 "leases one client may hold"),
    "store_roots": Key(None, _dir_list, "[dir, ...]", "daemon", False,
                       "directories where model names are resolved"),
    "models": Key({}, _registry, "{name: path}", "daemon", False,
                  "registered model names and their store paths"),
    # The tiered KV cache (deepseek_flash.kv) runs in the client; these keys reach it through the
    # model's effective flash_config, so TieredCache.for_model of a load_model model uses them.
    "kv_gpu_tokens": Key(512, _int_range(0, 1 << 20), "0..1048576", "model", False,
                         "recent tokens whose KV a TieredCache keeps on the GPU"),
    "kv_sink_tokens": Key(4, _int_range(0, 4096), "0..4096", "model", False,
                          "first tokens whose KV a TieredCache keeps on the GPU for good"),
    "kv_page_tokens": Key("auto", _kv_page_tokens, "\"auto\" | 16 | 32 | 64 | 128", "model", False,
                          "tokens per KV page (auto: 32 up to a 4,096-token prompt, else 64)"),
    "kv_top_k_pages": Key(None, _kv_top_k, "null | int >= 1 | 0 < fraction <= 1", "model", False,
                          "pages attended per layer and step (null: every page, lossless)"),
    "kv_page_cache": Key(1.5, _kv_page_cache, "\"auto\" | null | 0 | number >= 1", "model",
                         False, "top-K: device slots for the chosen pages of each top-K layer: a "
                         "multiple of its top-K page count, or every page (auto), within 25 % "
                         "of the device memory free when made (0: off, every chosen page "
                         "fetched every step)"),
    "kv_host_bytes": Key(None, _optional_size, "null | size (int or \"8GiB\")", "model", False,
                         "host-tier budget of a TieredCache; pages past it spill to kv_spill_dir"),
    "kv_spill_dir": Key(None, _optional_dir, "null | directory", "model", False,
                        "directory for KV pages past kv_host_bytes"),
    "kv_prune_threshold": Key(None, _kv_prune_threshold, "null | 0 <= number <= 1", "model", False,
                              "KV importance pruning: pages scoring below it leave the GPU "
                              "(null: off; the seed's value is 0.15)"),
}

TUNABLE = tuple(k for k, spec in KEYS.items() if spec.tunable)
RESTART_ONLY = tuple(k for k, spec in KEYS.items() if spec.restart)
MODEL_SCOPE = tuple(k for k, spec in KEYS.items() if spec.scope == "model")


class FlashConfig:
    """A validated, immutable set of every key. Build with ``from_dict``/``load``/``override``."""

    __slots__ = ("_values",)

    def __init__(self, values: dict[str, Any] | None = None):
        object.__setattr__(self, "_values", _validate(values or {}))

    @classmethod
    def from_dict(cls, data: dict) -> FlashConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"configuration must be a JSON object, not {type(data).__name__}",
                              key="", value=str(data)[:80], allowed="object")
        return cls(data)

    @classmethod
    def load(cls, path, *, required: bool = False) -> FlashConfig:
        """Read a JSON file; a missing file means defaults (logged), unless ``required`` (a file the
        user named, e.g. ``--config``): then it is a ConfigError. Errors name the file."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            if required:
                raise ConfigError(f"{path}: config file not found", key="config", value=str(path),
                                  allowed="an existing JSON file", path=str(path)) from None
            log.info("config file %s not found; using defaults", path)
            return cls()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}", key="", value=str(path),
                              allowed="a readable JSON file", path=str(path)) from exc
        try:
            data = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON: {exc}", key="", value=str(path),
                              allowed="JSON object", path=str(path)) from exc
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc.message}", path=str(path), **exc.fields) from exc

    def __getattr__(self, key):
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        raise AttributeError("FlashConfig is immutable; use override()")

    def __getitem__(self, key):
        return self._values[key]

    def __eq__(self, other):
        return isinstance(other, FlashConfig) and other._values == self._values

    def __repr__(self):
        return f"FlashConfig({self._values!r})"

    def as_dict(self) -> dict:
        return dict(self._values)

    def override(self, changes: dict, *, scope: str | None = None) -> FlashConfig:
        """A new config with ``changes`` applied; ``scope="model"`` admits model-scope keys only."""
        if not isinstance(changes, dict):
            raise ConfigError(f"overrides must be an object, not {type(changes).__name__}", key="",
                              value=str(changes)[:80], allowed="object")
        if scope == "model":
            for key, value in changes.items():
                if key in KEYS and KEYS[key].scope != "model":
                    raise ConfigError(f"{key} is daemon-wide and cannot be set per model or per open;"
                                      f" set it in flash.json", key=key, value=value,
                                      allowed=list(MODEL_SCOPE))
        merged = dict(self._values)
        merged.update(changes)
        return FlashConfig(merged)

    def model_overrides(self, model_config: dict, model_name: str) -> tuple[FlashConfig, list[str]]:
        """Apply a model's ``flash_config``: (config, []). A daemon-scope key there is a
        ConfigError naming flash.json (the list stays empty; it is kept for the wire's
        ``ignored_overrides``)."""
        flash = model_config.get("flash_config") or {}
        if not isinstance(flash, dict):
            raise ConfigError(f"model {model_name}: flash_config must be an object", key="flash_config",
                              value=str(flash)[:80], allowed="object")
        daemon_keys = [k for k in flash if k in KEYS and KEYS[k].scope != "model"]
        if daemon_keys:
            # Refused, not skipped: a key that silently does nothing is a setting its author
            # believes in. Only the operator's flash.json sets the daemon.
            raise ConfigError(f"model {model_name} config.json flash_config: {', '.join(daemon_keys)} "
                              f"{'is' if len(daemon_keys) == 1 else 'are'} daemon-wide and only "
                              f"flash.json ({paths.config_path()}) can set "
                              f"{'it' if len(daemon_keys) == 1 else 'them'}; remove "
                              f"{'it' if len(daemon_keys) == 1 else 'them'} from the model's config.json",
                              key=daemon_keys[0], value=flash[daemon_keys[0]], allowed=list(MODEL_SCOPE))
        try:
            return self.override(flash, scope="model"), []
        except ConfigError as exc:
            raise ConfigError(f"model {model_name} config.json flash_config: {exc.message}",
                              **exc.fields) from exc

    def tunables(self) -> dict:
        return {k: self._values[k] for k in TUNABLE}


def _validate(data: dict) -> dict:
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ConfigError(f"unknown configuration key {unknown[0]!r}; known keys: {', '.join(KEYS)}",
                          key=unknown[0], value=data[unknown[0]], allowed=list(KEYS))
    values = {}
    for key, spec in KEYS.items():
        if key in data:
            values[key] = spec.parse(key, data[key])
        elif key == "store_roots":
            values[key] = _default_store_roots()
        else:
            values[key] = spec.default
    return values


def check_tunable(key: str, value: Any) -> Any:
    """Validate one run-time change; ConfigError for an unknown or non-tunable key."""
    if key not in KEYS:
        raise ConfigError(f"unknown tunable {key!r}; tunables: {', '.join(TUNABLE)}", key=key,
                          value=value, allowed=list(TUNABLE))
    if not KEYS[key].tunable:
        raise ConfigError(f"{key} is fixed at start; change it in flash.json and restart (or "
                          f"SIGHUP where noted); tunables: {', '.join(TUNABLE)}", key=key, value=value,
                          allowed=list(TUNABLE))
    return KEYS[key].parse(key, value)
