"""bench/stream.py's own arithmetic, on the CPU: where the copy stream idled (``copy_idle``) and
the collector's pauses (``_GcPauses``)."""
from __future__ import annotations

import gc

from deepseek_flash.testing import bench_module


def bench_stream():
    return bench_module("stream")


def test_copy_idle_places_each_gap_before_the_copy_that_ended_it():
    stream = bench_stream()
    # Three layers a pass, copies of 2 ms; pass 0 starts the trace (its first gap unknown),
    # pass 1 idles 5 ms before its first layer and 1 ms before its third, pass 2 only 5 ms
    # before the first; pass 3 is cut short.
    trace, t = [], 0.0
    for p, gaps in enumerate([(0, 0, 0), (5, 0, 1), (5, 0, 0), (3,)]):
        for idx, gap in enumerate(gaps):
            t += gap
            trace.append({"pass": p, "idx": idx, "start_ms": t, "end_ms": t + 2.0})
            t += 2.0
    out = stream.copy_idle(trace, 3)
    assert out == {"passes": 2, "busy_ms_per_pass": 6.0, "idle_ms_per_pass": 5.5,
                   "idle_before_idx_ms": [5.0, 0.0, 0.5]}
    assert stream.copy_idle(trace[:3], 3) == {}


def test_gc_pauses_are_recorded_while_entered_only():
    stream = bench_stream()
    with stream._GcPauses() as pauses:
        gc.collect()
    gc.collect()
    assert [g for g, _ in pauses.pauses] == [2] and pauses.pauses[0][1] >= 0


def test_rebound_recomputes_the_ratios_for_a_faster_link():
    stream = bench_stream()
    run = {"plan": {"streamed_bytes_per_token": 10 * 10**9}, "streamed_tok_s": {1: 5.0, 8: 30.0},
           "bound_batch1_tok_s": 5.0, "vs_bound": {1: 1.0, 8: 0.75}}
    # A 60 GB/s link: 6 tok/s at batch 1, 48 at batch 8 -- unless the resident rate is lower.
    stream.rebound(run, 60.0, {8: 40.0})
    assert run["bound_batch1_tok_s"] == 6.0 and run["bound_h2d_gbps"] == 60.0
    assert run["vs_bound"] == {1: round(5 / 6, 3), 8: 0.75}


def test_window_names_become_flash_contexts():
    stream = bench_stream()
    assert stream.window_context("default") is None and stream.window_context("cudnn") is None
    assert stream.window_context("1") == {"prefetch_window": 1}
    assert stream.window_context("projection") == {"stream_unit": "projection"}
    assert stream.window_context("projection:4") == {"stream_unit": "projection", "prefetch_window": 4}
    try:
        stream.window_context("tensor")
    except SystemExit as exc:
        assert "'tensor'" in str(exc) and "layer, projection" in str(exc)
    else:
        raise AssertionError("an unknown part must be refused")


def test_streamed_run_on_the_cpu_compares_plans(tmp_path, monkeypatch):
    """``streamed_run``'s own Python (CUDA-only in the bench) on the CPU, the CUDA calls stubbed:
    whole-MLP slots, then projection slots, whose tokens equal the first run's."""
    import torch
    from deepseek_flash.client import Client
    from deepseek_flash.daemon.planner import resident_minimum
    from deepseek_flash.store import Store, pack
    from deepseek_flash.testing import make_tiny_model

    class Stream:
        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Stream())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    stream = bench_stream()
    src = make_tiny_model(tmp_path / "src", "mistral", num_layers=3, vocab_size=32000, seed=2)
    store_dir = pack(src, tmp_path / "store")
    store = Store.open(store_dir)
    budget = resident_minimum(store.blocks, "layer")
    first: dict = {}
    with Client(embedded=True, config={"host_cache_bytes": "64MiB"}) as client:
        runs = [stream.streamed_run(store, store_dir, client, budget, stream.window_context(name),
                                    [1, 2], 2, 10.0, {}, {}, device="cpu", first_out=first)
                for name in ("layer", "projection")]
    layer, projection = (r["plan"] for r in runs)
    assert (layer["unit"], layer["streamed_units"]) == ("layer", 3)
    assert (projection["unit"], projection["streamed_units"]) == ("projection", 9)
    assert layer["layers"] == projection["layers"] == [0, 1, 2]
    mlp = sum(b.length for b in store.blocks if b.role.startswith("mlp"))
    assert layer["streamed_bytes_per_token"] == projection["streamed_bytes_per_token"] == mlp
    assert runs[1]["tokens_identical_to_first_run"] == {1: True, 2: True}
    assert "tokens_identical_to_first_run" not in runs[0]
    assert runs[1]["steady_prefetch_hit_rate"] > 0 and runs[1]["batch1_copy_idle"] == {}
