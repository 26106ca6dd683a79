"""bench/multigpu.py --smoke: the stream phase's code paths on the CPU (two parts on CPU stand-ins
against a real daemon), JSON out, the split's tokens identical to the one-device run. The
tensor-parallel phase's logic is what tests/client/test_tensor_parallel.py asserts; running its
four extra processes here would double this file's time."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "multigpu.py"


def test_smoke_stream_phase_writes_json_with_identical_tokens(tmp_path):
    out = tmp_path / "multigpu.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--phases", "stream", "--dir",
                           str(tmp_path), "--output", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    stream = res["stream"]
    assert res["devices"] == ["cpu", "cpu"] and "tp" not in res and res["layers"] == 16
    # Twice the total budget: both runs stream, and the split's budgets share the same total.
    assert stream["total_budget_bytes"] * 2 <= stream["model_bytes"] + 1
    assert stream["one_device"]["streamed_bytes_per_token"] > 0
    parts = stream["split"]["parts"]
    assert [p["layers"] for p in parts] == [[0, 7], [8, 15]]
    assert sum(p["budget_bytes"] for p in parts) <= stream["total_budget_bytes"]
    # The budgets checked up front are the ones the parts ran under, each above its minimum.
    budgets = res["budgets"]
    assert budgets["total"] == stream["total_budget_bytes"] >= budgets["one_device_minimum"]
    assert [b["budget"] for b in budgets["split"]] == [p["budget_bytes"] for p in parts]
    assert all(b["budget"] >= b["minimum"] for b in budgets["split"])
    assert all(p["streamed_layers"] > 0 for p in parts)
    assert stream["split"]["tokens_identical_to_one_device"] is True
    ratio = stream["split"]["tok_s"] / stream["one_device"]["tok_s"]
    assert abs(stream["split_vs_one"] - ratio) <= 0.01 * ratio    # from the unrounded rates
    assert set(res["goals"]) == {"split>=1.8*one_device", "split_tokens_identical"}
    assert res["goals"]["split_tokens_identical"] is True
