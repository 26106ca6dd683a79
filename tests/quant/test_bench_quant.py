"""bench/quant.py --smoke: every phase of the GPU show on the CPU with a tiny model (the script
CI can prove; the figures come from the H200 run)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "quant.py"


def test_smoke_runs_every_phase(tmp_path):
    out = tmp_path / "quant.json"
    run = subprocess.run([sys.executable, str(BENCH), "--smoke", "--arch", "qwen2", "--dir",
                          str(tmp_path / "work"), "--batches", "1", "--tokens", "8", "--output", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["mode"] == "smoke" and res["arch"] == "qwen2"
    assert res["store_bytes"]["int4"] < 0.45 * res["store_bytes"]["bf16"]
    assert res["int4_budget"]["streaming"] is False and res["int4_budget"]["streamed_bytes_per_token"] == 0
    assert res["bf16_budget"]["streaming"] is True
    small = res["int4_small_budget"]
    assert small["streaming"] is True and 0 < small["streamed_bytes_per_token"] < res["store_bytes"]["int4"]
    assert small["prefetch_hit_rate"] > 0
    assert res["streamed_tokens_equal_resident"] is True
    profile = res["int4_budget"]["step_profile"]
    assert profile["ops"] >= sum(profile["top_ops"].values()) > 0
    assert 0 < profile["host_issue_ms"] <= profile["step_ms"]
    assert all(r > 0 for phase in ("int4_budget", "bf16_budget", "int4_small_budget")
               for r in res[phase]["tok_s"].values())
    assert "needs" not in res["peer"] and "no GPU" in res["peer"]["not_run"]
    assert set(res["goals"]) == {"int4_fits_budget", "batch1_vs_bf16_streamed>=3",
                                 "small_budget_vs_bound>=0.9"}


def test_smoke_kernel_phase(tmp_path):
    out = tmp_path / "kernel.json"
    run = subprocess.run([sys.executable, str(BENCH), "--smoke", "--kernel", "--output", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["mode"] == "kernel" and res["smoke"] is True and res["small_m"] == 16
    assert {r["shape"] for r in res["kernel"]} == {"q_proj/o_proj", "k_proj/v_proj", "gate/up_proj",
                                                   "down_proj"}
    for row in res["kernel"]:
        assert row["torch_int4_us"] > 0 and row["torch_int4_derived_per_call_us"] > 0
        # bfloat16 outputs against the float32 reference: about half of bfloat16's last place
        # (0.0022-0.0046 measured).
        assert row["torch_int4_max_rel_err"] < 0.01 and row["runtime_int4_g128_max_rel_err"] < 0.01
        assert row["runtime_int8_g128_max_rel_err"] < 0.01


def test_smoke_decode_graphs_phases(tmp_path):
    """--decode graphs --phases: the int4 phases with load_model(..., decode="graphs"); on the CPU
    the static-cache steps run eagerly (the reason recorded) and no call falls back to
    transformers' generate() (the bench's min_new_tokens is honoured by the step)."""
    out = tmp_path / "quant.json"
    run = subprocess.run([sys.executable, str(BENCH), "--smoke", "--dir", str(tmp_path / "work"),
                          "--batches", "1,2", "--tokens", "6", "--decode", "graphs",
                          "--phases", "int4_budget,int4_small_budget", "--output", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["decode"] == "graphs" and res["phases"] == ["int4_budget", "int4_small_budget"]
    assert "bf16_budget" not in res and "peer" not in res and "int4_vs_bf16_streamed" not in res
    assert set(res["store_bytes"]) == {"int4"}
    assert res["streamed_tokens_equal_resident"] is True
    # Everything but the input embedding table: less than the store, more than its int4 layers.
    resident = res["int4_budget"]
    assert 0.3 * res["store_bytes"]["int4"] < resident["weight_bytes_per_step"] < res["store_bytes"]["int4"]
    assert "vs_hbm_bound" not in resident and "weight_bytes_per_step" not in res["int4_small_budget"]
    for phase in ("int4_budget", "int4_small_budget"):
        for b, stats in res[phase]["decoder"].items():
            assert stats["mode"] == "eager" and "CUDA" in stats["eager_reason"]
            assert stats["step"] == "fused" and stats["merged"]["unmerged"] > 0
            # generate(2) once, generate(1) twice, generate(7) twice: 1 + 0 + 12 steps per batch size
            assert stats["fallback_calls"] == 0 and stats["eager_steps"] == 13 * (1 + (b == "2"))
    assert set(res["goals"]) == {"int4_fits_budget", "small_budget_vs_bound>=0.9"}
    assert res["goals"]["int4_fits_budget"] is True and res["int4_small_budget"]["streaming"] is True


class _TimedModel:
    """generate(n) sleeps ``cost[n]`` seconds: a host whose noise makes one token look slower than seven."""

    def __init__(self, cost):
        import types

        self.cost = cost
        self.config = types.SimpleNamespace(vocab_size=32)

    def generate(self, ids, max_new_tokens, **kw):
        import time

        import torch

        time.sleep(self.cost.get(max_new_tokens, 0.0))
        return torch.zeros(ids.shape[0], ids.shape[1] + max_new_tokens, dtype=torch.long)


def test_decode_rate_noise_stops_a_strict_run_and_bounds_a_smoke_one():
    from deepseek_flash.testing import bench_module

    quant = bench_module("quant")
    noisy = _TimedModel({1: 0.3, 7: 0.01})
    try:
        quant.decode_rate(noisy, 2, 6, "cpu")
    except RuntimeError as e:
        assert "timing noise: 7 tokens took" in str(e) and "raise --tokens" in str(e)
    else:
        raise AssertionError("a strict run went on past timing noise")
    rate, out = quant.decode_rate(noisy, 2, 6, "cpu", strict=False)
    # The whole 7-token call's rate (prefill included): 2 x 7 tokens in at least 0.01 s.
    assert out.shape == (2, quant.PROMPT + 7) and 0 < rate <= 2 * 7 / 0.01
