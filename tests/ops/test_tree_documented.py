"""docs/operations.md names every field the real daemon writes to its status tree, so the page
cannot drift from the code: start ``deepseek-flashd``, open a model, read the tree, look up each key."""
from __future__ import annotations

import re
from pathlib import Path

from flashd_harness import assert_eventually, daemon_factory, tiny_store  # noqa: F401

from deepseek_flash.sysfs_shim.publisher import parse

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def documented_names() -> set[str]:
    # A field counts as documented where the page spells it in backticks: `name`.
    return set(re.findall(r"`([a-z_][a-z0-9_.]*)`", DOC.read_text()))


def test_every_status_stats_and_model_field_is_in_operations_md(daemon_factory, tiny_store):  # noqa: F811
    d = daemon_factory({"host_cache_bytes": "64MiB", "models": {"tiny": str(tiny_store)}}).start()
    with d.client() as client:
        client.load("tiny")
    residency = d.runtime / "models" / "tiny" / "residency"
    assert_eventually(lambda: residency.exists() and set(parse(residency.read_text())) == {
        "resident_blocks", "resident_bytes"}, what="models/tiny fully resident in the tree")
    files = {name: parse((d.runtime / name).read_text())
             for name in ("status", "stats", "tunables", "models/tiny/info", "models/tiny/residency")}
    assert len(files["status"]) >= 10 and len(files["stats"]) >= 20
    documented = documented_names()
    missing = {name: sorted(k for k in fields if k not in documented) for name, fields in files.items()}
    assert missing == {name: [] for name in files}, f"fields missing from {DOC}"
    # The per-model view and the controller agree on where blocks are served from.
    assert files["models/tiny/info"]["unified_memory_fabric"] == files["status"]["unified_memory_fabric"]
    assert d.stop() == 0
