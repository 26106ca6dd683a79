"""flash_benchmark: the JSON fields and their sanity, resident and streamed, embedded and through
the real daemon; table output; bad input exits 2 with a message naming the problem."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from deepseek_flash.wire import DEFAULT_STREAM_UNIT, SLOT_ALIGNMENT
from flashd_harness import Daemon, packed_model

from deepseek_flash.cli import main
from deepseek_flash.flash_benchmark import percentile
from deepseek_flash.store import Store

FIELDS = {"model", "model_path", "model_bytes", "device", "controller", "batch_size", "seq_len",
          "new_tokens", "warmup", "repeat", "weight_budget_bytes", "streaming", "sample",
          "avg_latency_ms", "p50_latency_ms", "p95_latency_ms", "p99_latency_ms", "min_latency_ms",
          "max_latency_ms", "tokens_per_s", "prefetch_hit_rate", "prefetch_hits", "prefetch_misses",
          "prefetch_source", "bytes_streamed", "load_ms", "latency_ms", "torch"}
SMALL = ["--batch_size", "2", "--seq_len", "16", "--new_tokens", "3", "--warmup", "1", "--repeat", "4"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return packed_model(tmp_path_factory.mktemp("bench"), "bench-tiny", num_layers=4)


def minimum_budget(path) -> int:
    s = Store.open(path)
    al = lambda n: -(-n // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
    anchors = sum(al(b.length) for b in s.blocks if not b.role.startswith("mlp"))
    slot = max(sum(al(b.length) for b in s.blocks if b.layer == i and b.role.startswith("mlp"))
               for i in range(s.num_layers))
    return anchors + 2 * slot


def bench_json(capsys, *argv) -> dict:
    assert main(["bench", *argv, "--output_format", "json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def check_common(result, store):
    assert set(result) == FIELDS
    assert result["model_bytes"] == Store.open(store).total_bytes
    assert result["device"] == "cpu"
    assert (result["batch_size"], result["seq_len"], result["new_tokens"]) == (2, 16, 3)
    lat = result["latency_ms"]
    assert len(lat) == 4 and all(v > 0 for v in lat)
    assert result["min_latency_ms"] <= result["p50_latency_ms"] <= result["p95_latency_ms"] \
        <= result["p99_latency_ms"] <= result["max_latency_ms"]
    assert result["avg_latency_ms"] == pytest.approx(sum(lat) / 4)
    assert result["tokens_per_s"] == pytest.approx(2 * 3 * 4 / (sum(lat) / 1e3))
    assert result["tokens_per_s"] > 0
    rate = result["prefetch_hit_rate"]
    assert rate is None or 0.0 <= rate <= 1.0


def test_resident_embedded(store, capsys):
    result = bench_json(capsys, "--model", str(store), "--embedded", *SMALL)
    check_common(result, store)
    assert result["controller"] == "embedded"
    # A resident model requests no block while timed: no hit rate (not 100 %).
    assert (result["prefetch_hits"], result["prefetch_misses"], result["prefetch_hit_rate"]) == (0, 0, None)
    assert result["streaming"] is False and result["weight_budget_bytes"] is None
    assert result["bytes_streamed"] == 0
    assert result["prefetch_source"] == "controller"


def test_streamed_embedded_reports_streamed_bytes(store, capsys):
    budget = minimum_budget(store)
    result = bench_json(capsys, "--model", str(store), "--embedded", "--weight_budget", str(budget), *SMALL)
    check_common(result, store)
    assert result["streaming"] is True and result["weight_budget_bytes"] == budget
    assert result["prefetch_source"] == "stream"
    # Every streamed unit passes through a slot once per forward pass: 1 prefill + 2 decode
    # steps (the first token comes from the prefill) per call, 4 calls, 4 layers of one unit each
    # (a whole MLP) or three (its projections, ``stream_unit``'s default).
    passes = 4 * 3
    units = 4 * (3 if DEFAULT_STREAM_UNIT == "projection" else 1)
    assert result["prefetch_hits"] + result["prefetch_misses"] == passes * units
    mlp = sum(b.length for b in Store.open(store).blocks if b.role.startswith("mlp"))
    assert result["bytes_streamed"] >= passes * mlp > 0


def test_through_daemon_and_table(store, tmp_path):
    d = Daemon(tmp_path / "d", {"host_cache_bytes": "64MiB"}).start()
    try:
        r = subprocess.run([sys.executable, "-m", "deepseek_flash.flash_benchmark", "--model", str(store),
                            "--socket", str(d.socket), *SMALL, "--output_format", "table"],
                           check=False, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        table = dict(line.split(None, 1) for line in r.stdout.splitlines())
        assert table["controller"] == "daemon"
        assert float(table["tokens_per_s"]) > 0
        assert table["bytes_streamed"] == "0"
        assert table["prefetch_hit_rate"] == "n/a"
        assert r.stderr == ""          # not a TTY: no progress bar
    finally:
        assert d.stop() == 0
        d.cleanup()


def test_seq_len_beyond_the_model_is_an_error(store, capsys):
    assert main(["bench", "--model", str(store), "--embedded", "--seq_len", "510", "--new_tokens", "3",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--seq_len 510 + --new_tokens 3 = 513 tokens exceeds" in err
    assert "max_position_embeddings 512" in err and "code 500" in err


@pytest.mark.parametrize("argv, needle", [
    (["--batch_size", "0"], "must be >= 1"),
    (["--repeat", "x"], "not an integer"),
    (["--output_format", "xml"], "invalid choice"),
])
def test_bad_flags_exit_2(store, capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--model", str(store), *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_no_daemon_and_unknown_model(store, tmp_path, capsys):
    assert main(["bench", "--model", str(store), "--socket", str(tmp_path / "none.sock"), *SMALL]) == 2
    assert f"no daemon running at {tmp_path / 'none.sock'}" in capsys.readouterr().err
    assert main(["bench", "--model", "no-such-model", "--embedded", *SMALL]) == 2
    assert "UnknownModel, code 400" in capsys.readouterr().err


def test_percentile_is_nearest_rank():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert [percentile(values, q) for q in (50, 95, 99, 100)] == [3.0, 5.0, 5.0, 5.0]
    assert percentile([7.0], 50) == 7.0


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--batch_size", "--seq_len", "--new_tokens", "--warmup", "--repeat",
                 "--output_format", "--device", "--weight_budget", "--socket", "--embedded", "--config",
                 "--seed", "--quiet"):
        assert flag in out
    assert "One latency sample = one generate() call" in out


def test_dash_spellings_and_the_default_seq_len_fitted_to_a_small_model(store, capsys):
    # The tiny model's max_position_embeddings is 512: the default 2048 would not fit.
    assert main(["bench", "--model", str(store), "--embedded", "--batch-size", "1", "--new-tokens", "2",
                 "--warmup", "0", "--repeat", "1", "--output-format", "json", "--quiet"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert (result["batch_size"], result["seq_len"], result["new_tokens"]) == (1, 510, 2)
    assert captured.err == ("note: model bench-tiny has max_position_embeddings 512: --seq_len 510 instead "
                            "of the default 2048 (prompt + 2 new tokens must fit)\n")


def test_a_named_config_file_that_does_not_exist_is_an_error(store, tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert main(["bench", "--model", str(store), "--embedded", "--config", str(missing), *SMALL]) == 2
    err = capsys.readouterr().err
    assert f"{missing}: config file not found [ConfigError, code 500]" in err
