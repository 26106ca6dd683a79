"""Write the controller's state as the status tree -- the user-space /sys/kernel/deepseek_flash.

``StatusTree(root).publish(snapshot)`` turns one snapshot of the controller into small text
files under ``root`` (``/run/deepseek_flash`` under systemd):

```
status                  controller_state, prefetch_hit_rate, semantic_block_count,
                        unified_memory_fabric, config_state, last_reload_error, ...
stats                   counters and gauges: prefetch_miss_count, bytes_read_nvme, ...
devices                 <device>.<field> lines (GPU arenas, NVMe devices)
models/<name>/info      the model's own fields, its plan (plan.<key>) and its clients' tiered
                        KV caches (kv.caches, kv.tokens, kv.gpu_bytes, kv.host_bytes, ...)
models/<name>/blocks    one line per block: <id>: role=... layer=... bytes=... ...
models/<name>/residency where the model's bytes live (tier counts and sizes)
metrics.prom            the numbers above in the Prometheus text format (version 0.0.4)
```

Every file is ``key: value`` lines, so ``cat``, ``grep`` and ``awk -F': '`` read it. A snapshot is
a mapping with the sections ``status``, ``stats``, ``devices`` and ``models``
(``{name: {"blocks": ..., "residency": ..., "plan": ..., <other fields>}}``); any further mapping
section ``X`` becomes the file ``X``. Nested mappings flatten to ``outer.inner`` keys.

Readers never see a partial file: each file is written to a temp file in the same directory,
fsynced and renamed over the old one (``fsutil.atomic_write``). A file is rewritten only when its bytes changed, so a
daemon that publishes every second costs nothing while it is idle. A model or section missing
from the snapshot loses its file or directory.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path

from ..fsutil import atomic_write

CONTROLLER_STATES = ("ACTIVE", "DEGRADED", "STARTING", "STOPPING")
# The files of the tree's fixed sections (a daemon's extensions may add more).
TREE_FILES = ("status", "stats", "devices", "tunables", "metrics.prom")
FABRIC_MODES = ("ENABLED", "HOST_ONLY", "DISABLED")

# Field tables: the order fields appear in, and the HELP text of their metric. Fields a snapshot
# carries beyond these are published too, after the known ones, with a generic HELP line.
STATUS_FIELDS: dict[str, str] = {
    "controller_state": "Controller state (ACTIVE, DEGRADED, STARTING, STOPPING); 1 for the current one.",
    "prefetch_hit_rate": "Fraction of block requests already resident when asked for.",
    "semantic_block_count": "Blocks of all open models (one per semantic unit).",
    "unified_memory_fabric": "GPU fabric mode (ENABLED, HOST_ONLY, DISABLED); 1 for the current one.",
    "config_state": "Configuration state.",
    "last_reload_error": "Error of the last failed configuration reload.",
    "pid": "Process id of deepseek-flashd.",
    "socket": "Control socket of deepseek-flashd.",
}

# name: (Prometheus type, HELP)
STATS_FIELDS: dict[str, tuple[str, str]] = {
    "prefetch_miss_count": ("counter", "Block requests that had to wait for a read."),
    "block_eviction_count": ("counter", "Blocks evicted from the host tier."),
    "fabric_stall_cycles": ("counter", "Times a consumer waited on a GPU copy that was not done."),
    "active_leases": ("gauge", "Leases held by clients now."),
    "connected_clients": ("gauge", "Clients connected to the control socket now."),
    "bytes_read_nvme": ("counter", "Bytes read from the block stores."),
    "bytes_h2d": ("counter", "Bytes copied from host memory to GPUs."),
    "hits": ("counter", "Block requests served from a resident block."),
    "misses": ("counter", "Block requests that found the block absent."),
    "evictions": ("counter", "Blocks evicted from the host tier."),
    "prefetch_issued": ("counter", "Blocks read ahead of use by the prefetcher."),
    "prefetch_used": ("counter", "Prefetched blocks later requested (the prefetch paid off)."),
    "prefetch_dropped": ("counter", "Prefetches dropped for lack of room."),
    "load_errors": ("counter", "Block reads that failed (IO or checksum)."),
    "checksum_errors": ("counter", "Blocks whose bytes failed their crc32c."),
    "leases_granted": ("counter", "Leases granted to clients."),
    "unloads": ("counter", "Models unloaded."),
    "host_bytes_used": ("gauge", "Host arena bytes holding blocks."),
    "host_bytes_total": ("gauge", "Size of the host arena."),
    "resident_blocks": ("gauge", "Blocks resident in the host tier."),
    "loading_blocks": ("gauge", "Blocks being read now."),
    "read_depth": ("gauge", "Disk reads the IO engine keeps in flight now (1 while a client imports)."),
    "read_request_bytes": ("gauge", "Size of each disk read the IO engine issues now."),
    "shallow_read_clients": ("gauge", "Clients whose imports keep the reads shallow now."),
    "open_models": ("gauge", "Models open in the controller."),
    "kv_caches": ("gauge", "Tiered KV caches of connected clients (deepseek_flash.kv) now."),
    "kv_gpu_bytes": ("gauge", "KV bytes the clients' tiered caches hold on GPUs."),
    "kv_host_bytes": ("gauge", "KV bytes the clients' tiered caches hold in host memory."),
    "kv_spilled_bytes": ("gauge", "KV bytes the clients' tiered caches hold in spill files."),
    "kv_pages_fetched": ("counter", "KV pages the clients' tiered caches copied to the device."),
    "kv_level1_tokens": ("gauge", "Tokens x layers the clients' tiered caches hold on the device (pruning level 1)."),
    "kv_level2_tokens": ("gauge", "Tokens x layers the clients' tiered caches hold at full precision off the device (pruning level 2)."),
    "kv_level3_tokens": ("gauge", "Tokens x layers the clients' tiered caches hold compressed to int4 (pruning level 3)."),
    "kv_level3_bytes_saved": ("gauge", "Bytes pruning level 3 saves against full precision, live caches."),
    "kv_demotions": ("counter", "KV pages pruning moved down a level (1 to 2, 2 to 3)."),
    "kv_promotions": ("counter", "KV pages pruning moved back to level 1."),
    "kv_recalls": ("counter", "Demoted KV pages attended for one step (fetched; level 3 decompressed)."),
}

_COUNTER_SUFFIXES = ("_count", "_total", "_cycles")
_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")
_PREFIX = "deepseek_flash_"


class StatusTree:
    """The status tree rooted at ``root``; one publisher per tree."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._lock = threading.Lock()
        self._written: dict[Path, bytes] = {}

    def publish(self, snapshot: Mapping) -> int:
        """Bring the tree in line with ``snapshot``; returns the number of files rewritten."""
        files = render(snapshot)
        with self._lock:
            # models/ always exists, so `ls models` answers "none open" rather than an error.
            (self.root / "models").mkdir(parents=True, exist_ok=True)
            rewritten = 0
            for rel, data in files.items():
                path = self.root / rel
                if self._written.get(path) == data and path.exists():
                    continue
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, data)
                self._written[path] = data
                rewritten += 1
            wanted = {self.root / rel for rel in files}
            for path in [p for p in self._written if p not in wanted]:
                path.unlink(missing_ok=True)
                del self._written[path]
            self._remove_stale_models({rel.split("/")[1] for rel in files if rel.startswith("models/")})
            return rewritten

    def _remove_stale_models(self, keep: set[str]) -> None:
        # Scans the directory rather than only what this object wrote, so a model left behind by
        # a previous daemon run disappears too.
        models = self.root / "models"
        for entry in models.iterdir():
            if entry.name not in keep and entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)

    def reset(self) -> None:
        """Delete the tree files any daemon writes (``TREE_FILES``, ``models/*``), this publisher's
        or a dead predecessor's, before a new daemon publishes its first status."""
        with self._lock:
            for name in TREE_FILES:
                (self.root / name).unlink(missing_ok=True)
            self._written.clear()
            models = self.root / "models"
            if models.is_dir():
                self._remove_stale_models(set())

    def remove(self) -> None:
        """Delete every file this tree published (a clean shutdown leaves no stale state)."""
        with self._lock:
            for path in self._written:
                path.unlink(missing_ok=True)
            self._written.clear()
            models = self.root / "models"
            if models.is_dir():
                shutil.rmtree(models, ignore_errors=True)


def render(snapshot: Mapping) -> dict[str, bytes]:
    """The tree's files for ``snapshot``: relative path -> bytes (pure; publish writes them)."""
    files: dict[str, bytes] = {}
    for section, content in _sections(snapshot).items():
        if section == "models":
            continue
        _check_file_name(section, "section")
        if section == "status":
            content = _status_order(content)
        files[section] = _lines(_flatten(content))
    for name, model in (snapshot.get("models") or {}).items():
        _check_file_name(name, "model")
        info, blocks, residency = _model_parts(name, model)
        files[f"models/{name}/info"] = _lines(info)
        files[f"models/{name}/blocks"] = _lines(blocks)
        files[f"models/{name}/residency"] = _lines(residency)
    files["metrics.prom"] = render_metrics(snapshot).encode()
    return files


def render_metrics(snapshot: Mapping) -> str:
    """The snapshot's numbers in the Prometheus text exposition format (0.0.4)."""
    snapshot = _sections(snapshot)
    families: dict[str, tuple[str, str, list[tuple[dict, float]]]] = {}

    def add(name: str, kind: str, help_text: str, labels: dict, value) -> None:
        metric = metric_name(name, kind)
        samples = families.setdefault(metric, (kind, help_text, []))[2]
        # A field in both status and stats (prefetch_hit_rate) is one series, not two.
        if all(existing != labels for existing, _ in samples):
            samples.append((labels, value))

    status = _status_order(snapshot.get("status") or {})
    for key, value in _flatten(status).items():
        help_text = STATUS_FIELDS.get(key, f"Status field {key}.")
        if key == "controller_state":
            for state in CONTROLLER_STATES:
                add(key, "gauge", help_text, {"state": state}, int(value == state))
        elif key == "unified_memory_fabric":
            for mode in FABRIC_MODES:
                add(key, "gauge", help_text, {"mode": mode}, int(value == mode))
        elif key == "prefetch_hit_rate":
            ratio = _ratio(value)
            if ratio is not None:
                add(key, "gauge", help_text, {}, ratio)
        elif _is_number(value):
            add(key, "gauge", help_text, {}, value)

    for key, value in _flatten(snapshot.get("stats") or {}).items():
        if _is_number(value):
            kind, help_text = STATS_FIELDS.get(key, (_guess_type(key), f"Statistic {key}."))
            add(key, kind, help_text, {}, value)

    for device, fields in (snapshot.get("devices") or {}).items():
        flat = _flatten(fields) if isinstance(fields, Mapping) else {"value": fields}
        for key, value in flat.items():
            if _is_number(value):
                add(f"device_{key}", _guess_type(key), f"Per-device {key} (devices file).",
                    {"device": str(device)}, value)

    for name, model in (snapshot.get("models") or {}).items():
        info, _, residency = _model_parts(name, model)
        for key, value in info.items():
            if _is_number(value):
                add(f"model_{key}", _guess_type(key), f"Per-model {key} (models/<name>/info).",
                    {"model": name}, value)
        for key, value in residency.items():
            if _is_number(value):
                add(f"model_residency_{key}", "gauge",
                    f"Per-model residency {key} (models/<name>/residency).", {"model": name}, value)

    return exposition(families)


def exposition(families: Mapping) -> str:
    """``{metric: (kind, help, [(labels, value), ...])}`` in the Prometheus text format (0.0.4),
    help and label values escaped; the daemon's tree and the HTTP server both export through it."""
    out = []
    for metric, (kind, help_text, samples) in families.items():
        out.append(f"# HELP {metric} {_escape_help(help_text)}")
        out.append(f"# TYPE {metric} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
            out.append(f"{metric}{{{label_text}}} {_number(value)}" if label_text
                       else f"{metric} {_number(value)}")
    return "\n".join(out) + "\n" if out else ""


def metric_name(field: str, kind: str) -> str:
    """The Prometheus name of a tree field: counters end in ``_total`` (``prefetch_miss_count`` ->
    ``deepseek_flash_prefetch_miss_count_total``), and a gauge never does (``host_bytes_total``
    -> ``deepseek_flash_host_bytes_capacity``), so ``rate()`` is only ever applied to counters."""
    name = _PREFIX + _NAME_BAD.sub("_", field)
    if kind == "counter":
        return name if name.endswith("_total") else name + "_total"
    return name[:-len("_total")] + "_capacity" if name.endswith("_total") else name


def format_fields(fields: Mapping, *, status: bool = False) -> str:
    """One mapping as the tree writes it (``status=True``: the status file's order and formats)."""
    return _lines(_flatten(_status_order(fields) if status else fields)).decode()


def parse(text: str) -> dict[str, str]:
    """The ``key: value`` lines of a tree file as a dict (values stay strings)."""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if sep:
            fields[key] = value
        elif line.endswith(":"):
            fields[line[:-1]] = ""
    return fields


# --- rendering helpers ----------------------------------------------------------------------------

def _sections(snapshot: Mapping) -> dict:
    """The snapshot with its top-level plain values moved into ``status``."""
    if not isinstance(snapshot, Mapping):
        raise TypeError(f"status snapshot must be a mapping, got {type(snapshot).__name__}")
    loose = {k: v for k, v in snapshot.items() if not isinstance(v, Mapping)}
    if not loose:
        return dict(snapshot)
    sections = {k: v for k, v in snapshot.items() if isinstance(v, Mapping)}
    sections["status"] = {**loose, **sections.get("status", {})}
    return sections


def _status_order(status: Mapping) -> dict:
    state = status.get("controller_state")
    if state is not None and state not in CONTROLLER_STATES:
        raise ValueError(f"status field controller_state={state!r}: allowed {', '.join(CONTROLLER_STATES)}")
    fabric = status.get("unified_memory_fabric")
    if fabric is not None and fabric not in FABRIC_MODES:
        raise ValueError(f"status field unified_memory_fabric={fabric!r}: allowed {', '.join(FABRIC_MODES)}")
    ordered = {key: status[key] for key in STATUS_FIELDS if key in status}
    ordered.update((key, value) for key, value in status.items() if key not in ordered)
    if "prefetch_hit_rate" in ordered:
        ordered["prefetch_hit_rate"] = _percent(ordered["prefetch_hit_rate"])
    return ordered


def _model_parts(name: str, model: Mapping) -> tuple[dict, dict, dict]:
    """(info, blocks, residency) lines of one model entry.

    The per-block list may come as ``blocks`` or as ``residency`` (a list, or a mapping of block
    id to fields); a ``residency`` mapping of plain values is a summary and is shown as it is.
    Without a summary, residency counts the blocks and bytes in each ``state`` (or ``tier``).
    """
    if not isinstance(model, Mapping):
        raise TypeError(f"status snapshot model {name!r} must be a mapping, got {type(model).__name__}")
    per_block = None
    summary = None
    info: dict = {"name": name}
    for key, value in model.items():
        if key in ("blocks", "residency") and _is_block_list(value):
            per_block = value
        elif key == "residency" and isinstance(value, Mapping):
            summary = value
        else:
            info[key] = value
    block_lines: dict = {}
    if per_block is not None:
        items = per_block.items() if isinstance(per_block, Mapping) else (
            (block.get("id", index) if isinstance(block, Mapping) else index, block)
            for index, block in enumerate(per_block))
        block_lines = {str(block_id): _block_line(block) for block_id, block in items}
        info.setdefault("blocks", len(block_lines))
    if summary is None:
        summary = _residency_summary(per_block.values() if isinstance(per_block, Mapping) else per_block or ())
    return _flatten(info), block_lines, _flatten(summary)


def _is_block_list(value) -> bool:
    if isinstance(value, (list, tuple)):
        return True
    return isinstance(value, Mapping) and bool(value) and all(isinstance(v, Mapping) for v in value.values())


def _residency_summary(blocks) -> dict:
    summary: dict = {}
    for block in blocks:
        if not isinstance(block, Mapping):
            continue
        where = block.get("state", block.get("tier"))
        if where is None:
            continue
        summary[f"{where}_blocks"] = summary.get(f"{where}_blocks", 0) + 1
        size = block.get("bytes")
        if isinstance(size, int):
            summary[f"{where}_bytes"] = summary.get(f"{where}_bytes", 0) + size
    return dict(sorted(summary.items()))


def _block_line(block) -> str:
    if isinstance(block, Mapping):
        return " ".join(f"{k}={_value(v)}" for k, v in _flatten(block).items() if k != "id")
    return _value(block)


def _flatten(mapping: Mapping, prefix: str = "") -> dict:
    flat = {}
    for key, value in mapping.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, full + "."))
        else:
            flat[full] = value
    return flat


def _lines(fields: Mapping) -> bytes:
    out = []
    for key, value in fields.items():
        if "\n" in str(key) or ": " in str(key):
            raise ValueError(f"status tree key {key!r} would break the key: value format")
        out.append(f"{key}: {_value(value)}")
    return ("\n".join(out) + "\n").encode() if out else b""


def _value(value) -> str:
    # "-" for nothing (None, "", []), so no line ends in a dangling "key: ".
    if value is None or value == "" or value == [] or value == ():
        return "-"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return ",".join(_value(v) for v in value)
    # One value per line: a newline inside (an error message) would forge another key.
    return str(value).replace("\n", " ")


def _percent(value) -> str:
    ratio = _ratio(value)
    return _value(value) if ratio is None else f"{ratio * 100:.1f}%"


def _ratio(value) -> float | None:
    if _is_number(value):
        return float(value)
    if isinstance(value, str) and value.endswith("%"):
        try:
            return float(value[:-1]) / 100
        except ValueError:
            return None
    return None


def _is_number(value) -> bool:
    # bool is an int: a flag exports as 0/1.
    return isinstance(value, (int, float))


def _number(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _guess_type(key: str) -> str:
    leaf = key.rsplit(".", 1)[-1]
    return "counter" if leaf.endswith(_COUNTER_SUFFIXES) or leaf.startswith("bytes_") else "gauge"


def _escape_label(value) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _check_file_name(name, what: str) -> None:
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
            or "\0" in name or name.startswith(".")):
        raise ValueError(f"status tree {what} name {name!r} cannot be a file name")
