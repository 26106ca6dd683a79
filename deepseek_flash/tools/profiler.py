"""Per-block load latencies of one client process, collected from the daemon (``flash-profiler``).

The block manager keeps every completed disk read in a bounded ring (``BlockManager.load_log``:
time, requesting client and its SO_PEERCRED pid, model, block, layer, role, latency, bytes);
latency is the engine submit -> completion seen by the daemon's completion thread, so it
includes queueing behind the other reads of the same batch. The ``profile`` op returns the
entries of one pid after a sequence number; ``collect`` polls it over a window and ``summarize``
turns the samples into per-block and overall nearest-rank percentiles. ``plot`` draws the
median latency per (layer, role) as a heatmap (matplotlib, Agg backend).
"""
from __future__ import annotations

import math
import time

# Forward order of the roles; unknown roles (a future store format) go after these.
ROLE_ORDER = ("embed", "norms", "attn", "mlp_gate_up", "mlp_down", "final_norm", "lm_head")
POLL_INTERVAL_S = 0.2
POLL_LIMIT = 10_000


def percentile(values, q: float):
    """Nearest-rank percentile (a measured value); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def collect(client, pid: int, duration: float, on_poll=None, on_start=None) -> dict:
    """Poll the daemon's ``profile`` op for ``duration`` seconds; the window's raw samples.

    The first call checks that ``pid`` has a connected client (UnknownClient otherwise); later
    calls do not, so a client that exits inside the window keeps its samples. Samples are kept
    when they completed inside [start, start + duration] by the daemon's clock.
    """
    first = client.call("profile", {"pid": pid, "limit": 0})
    start = first["now"]
    fields = first["fields"]
    if on_start is not None:
        on_start(first)
    end = start + duration
    deadline = time.monotonic() + duration
    after = first["last_seq"]    # what completed before the window is not part of it
    samples: list[dict] = []
    while True:
        now = time.monotonic()
        last = now >= deadline
        while True:
            reply = client.call("profile", {"pid": pid, "after": after, "since": start,
                                            "limit": POLL_LIMIT, "require_connected": False})
            rows = reply["samples"]
            for row in rows:
                sample = dict(zip(fields, row))
                if sample["time"] <= end:
                    samples.append(sample)
            if rows:
                after = rows[-1][0]
            if len(rows) < POLL_LIMIT:
                break
        if on_poll is not None:
            on_poll(min(duration, duration - (deadline - time.monotonic())))
        if last:
            break
        time.sleep(min(POLL_INTERVAL_S, max(0.0, deadline - time.monotonic())))
    return {"pid": pid, "start": start, "end": end, "duration_s": duration,
            "clients": first["clients"], "samples": samples}


def _stats(latencies: list) -> dict:
    return {"count": len(latencies), "p50": percentile(latencies, 50),
            "p95": percentile(latencies, 95), "p99": percentile(latencies, 99),
            "min": min(latencies) if latencies else None, "max": max(latencies) if latencies else None,
            "mean": sum(latencies) / len(latencies) if latencies else None}


def _role_key(role: str):
    return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER), role)


def summarize(window: dict) -> dict:
    """The profile document written to ``--output``."""
    samples = window["samples"]
    blocks: dict[tuple, dict] = {}
    for s in samples:
        key = (s["model"], s["block"])
        entry = blocks.setdefault(key, {"model": s["model"], "block": s["block"], "layer": s["layer"],
                                        "role": s["role"], "bytes": s["bytes"], "loads": 0,
                                        "block_load_latency_us": []})
        entry["loads"] += 1
        entry["block_load_latency_us"].append(s["latency_us"])
    per_block = []
    for key in sorted(blocks):
        entry = blocks[key]
        lat = entry["block_load_latency_us"]
        entry.update(p50_us=percentile(lat, 50), p95_us=percentile(lat, 95), p99_us=percentile(lat, 99))
        per_block.append(entry)
    cells: dict[tuple, list] = {}
    for s in samples:
        cells.setdefault((s["layer"], s["role"]), []).append(s["latency_us"])
    heat = [{"layer": layer, "role": role, "p50_us": percentile(lat, 50), "count": len(lat)}
            for (layer, role), lat in sorted(cells.items(), key=lambda kv: (kv[0][0], _role_key(kv[0][1])))]
    all_lat = [s["latency_us"] for s in samples]
    return {
        "pid": window["pid"], "clients": window["clients"],
        "window": {"start": window["start"], "end": window["end"], "duration_s": window["duration_s"]},
        "latency": "engine submit -> completion seen by the daemon's completion thread, microseconds",
        "sample_count": len(samples), "block_count": len(per_block),
        "bytes_loaded": sum(s["bytes"] for s in samples),
        "models": sorted({s["model"] for s in samples}),
        "overall_latency_us": _stats(all_lat),
        "blocks": per_block,
        "layer_role_p50_us": heat,
        "samples": [{k: s[k] for k in ("time", "model", "block", "layer", "role", "latency_us", "bytes")}
                    for s in samples],
    }


def plot(profile: dict, path) -> None:
    """Heatmap of the median load latency per (layer, role) -> PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cells = profile["layer_role_p50_us"]
    layers = sorted({c["layer"] for c in cells})
    roles = sorted({c["role"] for c in cells}, key=_role_key)
    grid = np.full((max(1, len(layers)), max(1, len(roles))), np.nan)
    for c in cells:
        grid[layers.index(c["layer"]), roles.index(c["role"])] = c["p50_us"]
    fig, ax = plt.subplots(figsize=(1.6 * max(3, len(roles)) + 2, 0.35 * max(4, len(layers)) + 1.5))
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(len(roles)), roles, rotation=30, ha="right")
    ax.set_yticks(range(len(layers)), ["outside" if layer < 0 else str(layer) for layer in layers])
    ax.set_xlabel("block role")
    ax.set_ylabel("decoder layer")
    if len(layers) * len(roles) <= 400:
        for (i, j), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7, color="white")
    fig.colorbar(image, ax=ax, label="median block load latency (us)")
    overall = profile["overall_latency_us"]
    ax.set_title(f"pid {profile['pid']}: {profile['sample_count']} block loads in "
                 f"{profile['window']['duration_s']:g} s, p50 {overall['p50'] or 0} us, "
                 f"p99 {overall['p99'] or 0} us", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
