"""bench/serve.py --smoke runs end to end on the CPU: both schedulers, JSON, one CDF PNG per class,
and every request answered or refused with a status."""
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_serve_bench_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("serve", None)
    import serve as bench

    out = tmp_path / "serve.json"
    assert bench.main(["--smoke", "--wave-seconds", "0.4", "--unloaded-requests", "3", "--dir", str(tmp_path),
                       "--output", str(out), "--png-dir", str(tmp_path / "png")]) == 0
    result = json.loads(out.read_text())
    assert result["waves"] == {"short": 2, "medium": 8, "long": 32} and result["l0_tokens"] == 1
    assert result["arrivals"] > 0 and set(result["capacity_rps"]) == {"1", "2", "8", "32"}
    # Two sizes timed (the L0 size and the throughput run's 8 tokens), the others on their line.
    fit = result["capacity_fit"]
    assert set(fit["measured"]) == {"1", "8"}
    assert result["capacity_rps"]["32"] == pytest.approx(4 / (fit["fixed_s"] + 32 * fit["per_token_s"]), rel=0.01)
    assert result["engine_profile"]["one"]["decode_rows_1"]["forwards"] >= 7
    # The unloaded reference: 3 warm-up requests apart, then 3 counted, each TTFT kept in order.
    unloaded = result["unloaded"]
    assert (unloaded["warmup_requests"], unloaded["ttft_samples"]) == (3, 3)
    assert len(unloaded["warmup_ttft_ms"]) == 3 and unloaded["ttft_max_ms"] == max(unloaded["ttft_ms"])
    assert unloaded["ttft_p50_ms"] == sorted(unloaded["ttft_ms"])[1]
    assert unloaded["ttft_p50_ms"] <= unloaded["ttft_p90_ms"] <= unloaded["ttft_p99_ms"] <= unloaded["ttft_max_ms"]
    # The counted requests' forwards apart from the warm-up's: 3 prefills each way.
    assert [result["engine_profile"][k]["prefill"]["forwards"] for k in ("unloaded_warmup", "unloaded")] == [3, 3]
    # The L0 stream from a probe process of its own, the rest from two load processes.
    assert result["client_processes"] == {"l0_probe": 1, "load": 2}
    # What served HTTP: the serve extra's C parser and event loop.
    assert result["http_server"] == {"protocol": "HttpToolsProtocol", "loop": "uvloop.Loop"}
    assert unloaded["ttft_breakdown"]["requests"] == 3
    assert list(result["phase_s"]) == ["model", "warm-up", "unloaded", "one", "full", "capacity", "load flash", "load fifo"]
    for mode in ("flash", "fifo"):
        summary = result[mode]
        counted = sum(summary[c]["answered"] + summary[c]["refused"] + summary[c]["lost"] + summary[c]["unfinished"]
                      for c in ("L0", "L1", "L2"))
        assert counted == result["arrivals"]                 # the same schedule for both
        assert all(summary[c]["unfinished"] == 0 for c in ("L0", "L1", "L2"))
        profile = result["engine_profile"][mode]
        assert profile["prefill"]["forwards"] > 0 and any(k.startswith("decode_rows_") for k in profile)
        assert summary["checks"]["nothing_lost"], summary
        assert summary["L0"]["answered"] > 0 and summary["L0"]["ttft_p99_ms"] > 0
        assert summary["checks"]["l0_ttft_samples"] == summary["L0"]["ttft_samples"] == summary["L0"]["answered"]
        assert summary["checks"]["unloaded_p99_ttft_ms"] == unloaded["ttft_p99_ms"]
        # Where the slowest L0 requests' waits went: the forwards between sending and first token.
        worst = summary["worst_l0"]
        assert worst and worst[0]["ttft_ms"] == summary["L0"]["ttft_max_ms"]
        assert all(f["kind"] in ("prefill", "decode") and f["ms"] > 0 for w in worst for f in w["forwards"])
        assert any(f["kind"] == "prefill" for f in worst[0]["forwards"])       # its own prefill at least
        # Where its time to first token went: the stages add up to it (each rounded to 1 us).
        stages = worst[0]["stages_ms"]
        assert list(stages) == list(bench.STAGES)
        assert sum(stages.values()) == pytest.approx(worst[0]["ttft_ms"], abs=0.02)
        assert all(stages[k] >= 0 for k in ("parse", "queue", "compute", "hand_off"))
        l0 = summary["L0"]["ttft_breakdown"]
        assert l0["requests"] == summary["L0"]["answered"] and l0["tail_requests"] >= 1
        assert all(l0[k]["p50"] <= l0[k]["p99"] for k in bench.STAGES)
        # How the batch decoded (eager on the CPU, and why), how often L2's rule let it join.
        assert summary["decode"] == result["engine_decode"][mode] == {
            "mode": "eager", "reason": "CUDA graphs need a CUDA device (the model is on cpu)", "prefill": None}
        assert 0.0 <= summary["l2_open_step_fraction"] <= 1.0
        # The collector's pauses in the server during the load: counted per generation; the
        # slowest requests' share of them.
        assert set(summary["gc"]) == {"0", "1", "2"} and summary["gc"]["0"]["collections"] > 0
        assert all(g["ms_max"] <= g["ms_total"] for g in summary["gc"].values())
        assert all(w["gc_ms"] == pytest.approx(sum(p["ms"] for p in w["gc"]), abs=0.01) for w in worst)
        assert summary["l0_beside"] == summary["l0_beside_concurrent"] == 0   # no graph on the CPU to go beside
        assert summary["l0_beside_off"] is None
    assert result["fifo"]["degrade_steps"] == {"temperature": 0, "top_p": 0, "max_new_tokens": 0}
    assert result["throughput"]["one"]["tokens"] == 8 and result["throughput"]["full"]["tokens"] == 4 * 8
    pngs = sorted(Path(p).name for p in result["png"])
    assert pngs == ["serve-cdf-L0.png", "serve-cdf-L1.png", "serve-cdf-L2.png"]
    for p in result["png"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sys.modules.pop("serve", None)


def test_the_l0_stream_has_a_client_process_of_its_own(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("serve", None)
    import serve as bench

    arrivals = [(0.0, "L1", 32), (0.1, "L0", 16), (0.2, "L2", 32), (0.3, "L1", 128), (0.4, "L0", 16), (0.5, "L1", 8)]
    assert bench.split_arrivals(arrivals, 2) == [
        [(1, arrivals[1]), (4, arrivals[4])],
        [(0, arrivals[0]), (3, arrivals[3])],
        [(2, arrivals[2]), (5, arrivals[5])]]
    assert bench.split_arrivals(arrivals, 1)[1] == [(i, arrivals[i]) for i in (0, 2, 3, 5)]
    sys.modules.pop("serve", None)


def test_each_requests_ttft_is_split_into_stages_from_the_responses_timing(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import serve_stats as stats

    # Stages from the response's timing: sent at 10.000 s, the handler at 10.002 s, first read 12 ms.
    rec = {"sent_at": 10.0, "ttft": 0.012, "timing": {"received_at": 10.002, "queued_ms": 0.5, "admitted_ms": 1.5,
                                                     "first_token_ms": 6.5, "first_write_ms": 9.0}}
    assert stats.stages(rec) == pytest.approx({"to_server": 2.0, "parse": 0.5, "queue": 1.0, "compute": 5.0,
                                               "hand_off": 2.5, "to_client": 1.0})
    assert stats.stages(dict(rec, timing=dict(rec["timing"], first_write_ms=None))) is None


def test_the_collectors_pauses_are_recorded_and_put_in_the_slow_requests_they_overlap(monkeypatch):
    import gc
    import time

    monkeypatch.syspath_prepend(str(BENCH))
    import serve_stats as stats

    pauses = stats.GcPauses().start()
    gc.disable()                                      # no automatic collection in between
    try:
        began = time.perf_counter()
        gc.collect(2)
        gc.collect(1)
    finally:
        pauses.stop()
        gc.enable()
    gc.collect(0)                                     # after stop: not recorded
    assert [p[1] for p in pauses.pauses] == [2, 1] and all(p[0] >= began and p[2] >= 0 for p in pauses.pauses)
    summary = pauses.summary()
    assert [summary[g]["collections"] for g in ("0", "1", "2")] == [0, 1, 1]
    # A request sent at t=10 s whose first token came 20 ms later: a 15 ms pause from 9.995 s and
    # a 3 ms one at 10.010 s overlap it, one at 10.5 s does not.
    rec = {"class": "L0", "ttft": 0.020, "sent_at": 10.0, "server_ttft_ms": 18.0, "queue_ms": 0.5, "timing": None}
    worst = stats.worst_l0([rec], [], pauses=[(9.995, 2, 15.0), (10.010, 0, 3.0), (10.5, 0, 1.0)])
    assert worst[0]["gc_ms"] == 18.0
    assert worst[0]["gc"] == [{"at_ms": -5.0, "generation": 2, "ms": 15.0}, {"at_ms": 10.0, "generation": 0, "ms": 3.0}]
