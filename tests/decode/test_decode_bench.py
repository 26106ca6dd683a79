"""bench/decode.py --smoke: the benchmark's code paths on the CPU, JSON out, tokens identical."""
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "decode.py"


def test_smoke_mode_runs_and_reports(tmp_path):
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--batches", "1,3", "--output", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    for b in ("1", "3"):
        assert res["graphs"][b]["mode"] == "eager" and "CUDA" in res["graphs"][b]["eager_reason"]
        assert res["graphs"][b]["tok_s"] > 0 and res["eager_generate"][b]["tok_s"] > 0
        assert res["parity"][b]["tokens_identical"] is True
        assert res["parity"][b]["max_logit_diff"] < 1e-4
        assert res["graphs"][b]["step"] == "fused" and res["graphs_modules"][b]["step"] == "modules"
    # the smoke shape: 2 layers; fused 9 per layer + 33 around them (27 where the attention reads no
    # mask: no mask built), modules 34 + 33
    from deepseek_flash.decode import fused
    around = 33 if fused.uses_mask() else 27
    assert res["ops_per_step"]["fused"]["total"] == 18 + around and res["ops_per_step"]["modules"]["total"] == 101
    assert res["weight_bytes_per_step"] == sum(  # norms + layers + head, the input embedding apart
        n * 4 for n in [2 * (2 * 64 + 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128), 64, 256 * 64])


def test_int4_smoke_merges_the_tile_layout_projections(tmp_path):
    """--int4: every projection int4 in the tile layout as the host tier holds it; the graphs
    variant runs q|k|v and gate|up merged, graphs_unmerged one GEMV each, both with the tokens of
    transformers' generate over the same modules; the bound counts codes and scales."""
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--int4", "--batches", "1",
                           "--variants", "graphs,graphs_unmerged", "--skip-eager", "--skip-ops",
                           "--output", str(out)], capture_output=True, text=True, timeout=300, cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["int4"] == {"scheme": "int4_symmetric", "group": 32, "layout": "int4_cuda_tiles",
                           "projections": 2 * 7}
    merged, alone = res["graphs"]["1"]["merged"], res["graphs_unmerged"]["1"]["merged"]
    assert (merged["quantized"], merged["unmerged"], alone["quantized"], alone["unmerged"]) == (4, 0, 0, 4)
    assert res["parity"]["1"]["tokens_identical"] is True
    assert res["summary"]["1"]["unmerged_tok_s"] > 0
    # hidden 128, intermediate 256: 147456 projection weights a layer at half a byte, (scale, zero)
    # float32 pairs per 32 of them; float32 norms and head, the input embedding apart
    layer = 147456 // 2 + 147456 // 32 * 8 + 2 * 128 * 4
    assert res["weight_bytes_per_step"] == 2 * layer + 128 * 4 + 256 * 128 * 4


def test_streamed_smoke_runs_the_static_ring(tmp_path):
    out = tmp_path / "stream.json"
    bench = BENCH.parent / "decode_stream.py"
    proc = subprocess.run([sys.executable, str(bench), "--smoke", "--dir", str(tmp_path / "w"),
                           "--src", str(tmp_path / "src"),          # a checkpoint outside --dir
                           "--batches", "1,2", "--prompt", "6", "--new", "10", "--output", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert (tmp_path / "src" / "config.json").exists() and not (tmp_path / "w" / "llama-4-smoke" / "src").exists()
    assert res["plan"]["slots"] < res["plan"]["streamed_layers"]
    for b in ("1", "2"):
        row = res["batches"][b]
        assert row["step"] == "fused" and row["first_divergent_step"] == [10] * int(b)
        assert row["new_tokens_returned"] == [10, 10]
        # the warm-up call, two of 1 token, one timed: 9 + 0 + 0 + 9 static steps per batch size
        assert row["ring"]["static_steps"] == 18 * int(b == "1") + 36 * int(b == "2")


def test_attention_bench_smoke_checks_every_case_against_sdpa(tmp_path):
    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, str(BENCH.parent / "attention.py"), "--smoke", "--batches", "2",
                           "--output", str(out)], capture_output=True, text=True, timeout=300, cwd=BENCH.parent,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["batch"], row["length"], row["sdpa_us"] > 0) == (2, 130, True)
    assert [(o["chunk"], o["block"], o["warps"]) for o in row["ours"]] == [(64, 64, 4), (64, 64, 8)]
    assert all(o["max_diff"] < 1e-5 for o in row["ours"])
    assert [(o["chunk"], o["block"], o["warps"], o["kernel"]) for o in row["flash"]] == [
        (256, 64, 4, "dot"), (16, 16, 4, "sum")]
    assert all(o["max_diff"] < 1e-5 for o in row["flash"])
    best = subprocess.run([sys.executable, str(BENCH.parent / "attention.py"), "--best-of", "--batches", "2",
                           "--output", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=BENCH.parent)
    fastest = min(row["flash"], key=lambda o: o["us"])
    assert best.stdout.strip() == f"{fastest['chunk']},{fastest['block']},{fastest['warps']},{fastest['kernel']}"
