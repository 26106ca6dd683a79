"""bench/serve.py's numbers from its records: TTFT quantiles, where each request's time to first token
went (``stages``, ``breakdown``), the garbage collector's pauses in the server (``GcPauses``), the
slowest L0 requests with the forwards they waited on (``worst_l0``), each class's summary and checks
(``summarize``) and the latency CDF plots (``plot``)."""
from __future__ import annotations

import math
import time
from pathlib import Path


def quantile(values, q):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def ms(v):
    return None if v is None else round(v * 1e3, 2)


def ttft_stats(ttft) -> dict:
    """p50/p90/p99/max of TTFTs (s) in ms, and how many there are: the p99 of fewer than 100 is the
    slowest one."""
    return {"ttft_p50_ms": ms(quantile(ttft, 0.5)), "ttft_p90_ms": ms(quantile(ttft, 0.9)),
            "ttft_p99_ms": ms(quantile(ttft, 0.99)), "ttft_max_ms": ms(quantile(ttft, 1.0)),
            "ttft_samples": sum(1 for t in ttft if t is not None)}


STAGES = ("to_server", "parse", "queue", "compute", "hand_off", "to_client")


def stages(rec) -> dict | None:
    """Where one request's time to first token went, ms, summing to it: ``to_server`` (sent by the
    client -> the server's HTTP handler has it: the client's and the server's event loops and the
    socket), ``parse`` (-> the scheduler took it: body, JSON, tokenizer, route), ``queue`` (-> it
    joined the batch), ``compute`` (-> the step that made its first token ended), ``hand_off``
    (-> that token's chunk handed to the HTTP server to write: the engine thread to the server's
    event loop and its backlog), ``to_client`` (-> the client read it: the server's write, the
    socket and the client's event loop).
    From the response's ``flash.timing`` (the server's monotonic clock, the client's too)."""
    t = rec.get("timing")
    if not t or rec.get("ttft") is None or t.get("received_at") is None or None in (
            t.get("queued_ms"), t.get("admitted_ms"), t.get("first_token_ms"), t.get("first_write_ms")):
        return None
    received = (t["received_at"] - rec["sent_at"]) * 1e3
    marks = [0.0, received, received + t["queued_ms"], received + t["admitted_ms"],
             received + t["first_token_ms"], received + t["first_write_ms"], rec["ttft"] * 1e3]
    return {name: round(b - a, 3) for name, a, b in zip(STAGES, marks, marks[1:])}


def breakdown(recs) -> dict:
    """p50 and p99 of each stage (``stages``) over ``recs``, and the stages' mean over the slowest
    1 % (at least one) by time to first token: where the tail's time went."""
    rows = [(r["ttft"], s) for r in recs if (s := stages(r)) is not None]
    if not rows:
        return {"requests": 0}
    rows.sort(key=lambda x: x[0])
    tail = rows[-max(1, len(rows) // 100):]
    out = {"requests": len(rows)}
    for name in STAGES:
        values = [s[name] for _, s in rows]
        out[name] = {"p50": quantile(values, 0.5), "p99": quantile(values, 0.99),
                     "tail_mean": round(sum(s[name] for _, s in tail) / len(tail), 3)}
    out["tail_requests"] = len(tail)
    out["tail_ttft_ms_mean"] = round(sum(t for t, _ in tail) / len(tail) * 1e3, 3)
    return out


class GcPauses:
    """The garbage collector's pauses in this process (the server's) between ``start`` and ``stop``:
    (began, generation, ms) each, the clock ``time.perf_counter`` (the forwards' and the clients').
    A collection holds the interpreter lock throughout, so it stalls the engine thread and the HTTP
    event loop alike; ``summary`` and ``worst_l0`` say whether one fell in a slow request."""

    def __init__(self):
        self.pauses: list = []
        self._began = None

    def _callback(self, phase, info) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.pauses.append((self._began, info["generation"], (time.perf_counter() - self._began) * 1e3))
            self._began = None

    def start(self) -> "GcPauses":
        import gc

        gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        import gc

        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        """Per generation: collections, their total and longest ms."""
        out = {}
        for gen in (0, 1, 2):
            ms_ = [p[2] for p in self.pauses if p[1] == gen]
            out[str(gen)] = {"collections": len(ms_), "ms_total": round(sum(ms_), 3),
                             "ms_max": round(max(ms_), 3) if ms_ else 0.0}
        return out


def worst_l0(recs, forwards, n=3, pauses=()) -> list:
    """The ``n`` L0 requests with the longest time to first token, each with the engine's forwards
    that began between its sending and its first token (ms from its sending, kind, rows, tokens per
    row, attention key positions, ms on the host until the result, ms issuing it) and the garbage
    collector's pauses (``GcPauses``) that overlapped that time: where its wait went."""
    ok = sorted((r for r in recs if r["class"] == "L0" and r.get("ttft") is not None and r.get("sent_at")),
                key=lambda r: -r["ttft"])
    out = []
    for r in ok[:n]:
        lo, hi = r["sent_at"], r["sent_at"] + r["ttft"]
        # The forward running when it arrived began before it: take from the last one before.
        before = [f for f in forwards if f[3] < lo][-1:]
        during = before + [f for f in forwards if lo <= f[3] <= hi]
        # A request that waited seconds (FIFO) saw thousands: the first and the last 20 are kept.
        kept = during if len(during) <= 40 else during[:20] + during[-20:]
        gc_in = [p for p in pauses if p[0] <= hi and p[0] + p[2] / 1e3 >= lo]
        out.append({"ttft_ms": ms(r["ttft"]), "server_ttft_ms": r["server_ttft_ms"], "queue_ms": r["queue_ms"],
                    "stages_ms": stages(r),
                    "forwards_ms": round(sum(f[4] for f in during), 3), "forwards_count": len(during),
                    "forwards": [{"at_ms": round((f[3] - lo) * 1e3, 2), "kind": f[0], "rows": f[1],
                                  "tokens": f[2], "kv": f[6], "ms": f[4], "launch_ms": f[5]} for f in kept],
                    "gc_ms": round(sum(p[2] for p in gc_in), 3),
                    "gc": [{"at_ms": round((p[0] - lo) * 1e3, 2), "generation": p[1], "ms": round(p[2], 3)}
                           for p in gc_in[:20]]})
    return out


def summarize(recs, unloaded_p99_ms):
    out = {}
    for cls in ("L0", "L1", "L2"):
        mine = [r for r in recs if r["class"] == cls]
        ok = [r for r in mine if r["status"] == 200 and r["latency"] is not None]
        refused = [r for r in mine if r["status"] in (429, 503)]
        unfinished = [r for r in mine if r["status"] == "unfinished"]
        lost = [r for r in mine if r not in ok and r not in refused and r not in unfinished]
        entry = {"requests": len(mine), "answered": len(ok), "refused": len(refused), "lost": len(lost),
                 "unfinished": len(unfinished), **ttft_stats([r["ttft"] for r in ok]),
                 # The server's own view (arrival at the scheduler -> first token), without HTTP.
                 "server_ttft_p99_ms": quantile([r["server_ttft_ms"] for r in ok], 0.99),
                 "queue_p99_ms": quantile([r["queue_ms"] for r in ok], 0.99),
                 "latency_p50_ms": ms(quantile([r["latency"] for r in ok], 0.5)),
                 "latency_p99_ms": ms(quantile([r["latency"] for r in ok], 0.99)),
                 "degraded": sum(1 for r in ok if r["degraded"]),
                 "ttft_breakdown": breakdown(ok),
                 "lost_examples": [r["status"] for r in lost[:3]]}
        if cls == "L1":
            by_size = {}
            for r in ok:
                by_size.setdefault(r["max_tokens"], []).append(r["latency"])
            entry["completion_by_weight"] = {
                str(size): {"weight": max(1, size // 64), "requests": len(v), "mean_ms": ms(sum(v) / len(v)),
                            "mean_ms_per_token": round(sum(v) / len(v) / size * 1e3, 3)}
                for size, v in sorted(by_size.items())}
        out[cls] = entry
    l0 = out["L0"]["ttft_p99_ms"]
    out["checks"] = {
        "l0_p99_ttft_ms": l0, "l0_ttft_samples": out["L0"]["ttft_samples"], "unloaded_p99_ttft_ms": unloaded_p99_ms,
        "l0_p99_over_unloaded": None if l0 is None or not unloaded_p99_ms else round(l0 / unloaded_p99_ms, 2),
        "l0_p99_le_2x_unloaded": None if l0 is None else l0 <= 2 * unloaded_p99_ms,
        "l0_p99_lt_150ms": None if l0 is None else l0 < 150.0,
        "l2_degrade_rate": round(out["L2"]["degraded"] / out["L2"]["answered"], 4) if out["L2"]["answered"] else None,
        "nothing_lost": all(out[c]["lost"] == 0 for c in ("L0", "L1", "L2")),
    }
    return out


def plot(results, png_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for cls in ("L0", "L1", "L2"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, style in (("flash", "-"), ("fifo", "--")):
            recs = [r for r in results[mode]["records"] if r["class"] == cls and r["ttft"] is not None]
            for key, color in (("ttft", "tab:blue"), ("latency", "tab:orange")):
                values = sorted(r[key] * 1e3 for r in recs if r[key] is not None)
                if values:
                    ax.step(values, [(i + 1) / len(values) for i in range(len(values))], style, color=color,
                            where="post", label=f"{key} ({mode})")
        ax.set_xscale("log")
        ax.set_xlabel("ms from sending the request")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{cls}: time to first token and to last, scheduler vs FIFO")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        path = png_dir / f"serve-cdf-{cls}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(str(path))
    return written
