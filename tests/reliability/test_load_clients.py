"""bench/load_clients.py at CI scale: 64 client processes against one daemon, zero errors, zero
leaked leases, memory back at its baseline (the full 64 x 10 000 run is in docs/reliability.md)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from faults import LOAD_CI_CLIENTS, LOAD_CI_ROUNDS

BENCH = Path(__file__).resolve().parents[2] / "bench" / "load_clients.py"


@pytest.mark.slow
def test_many_client_processes(tiny_store):
    out = subprocess.run([sys.executable, str(BENCH), "--clients", str(LOAD_CI_CLIENTS), "--rounds",
                          str(LOAD_CI_ROUNDS), "--store", str(tiny_store)], capture_output=True,
                         text=True, timeout=600, check=False)
    result = json.loads(out.stdout)
    print(json.dumps(result))
    assert result["round_trips"] == LOAD_CI_CLIENTS * LOAD_CI_ROUNDS
    assert result["connected_at_start"] == LOAD_CI_CLIENTS
    assert result["errors"] == 0 and result["leaked_leases"] == 0 and result["clients_left"] == 0
    assert result["host_bytes_used_after"] == result["host_bytes_used_before"]
    assert result["daemon_rss_anon_after"] - result["daemon_rss_anon_before"] < result["rss_slack"]
    assert result["ok"] and out.returncode == 0, out.stderr
