"""The operator aliases the seeds name are console scripts that run their verb."""
from __future__ import annotations

import importlib
import json
import tomllib
from pathlib import Path

from deepseek_flash import cli

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_console_script_resolves_to_a_callable():
    for name, target in SCRIPTS.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name
    assert {"deepseek-flash-prune", "deepseek-flash-repair", "deepseek-flash-defrag", "ssd-health-checker",
            "flash-profiler", "deepseek-flashd", "deepseek-flash"} <= set(SCRIPTS)


def test_deepseek_flash_prune_runs_the_prune_verb(tmp_path, capsys):
    from deepseek_flash.store import pack
    from deepseek_flash.testing import make_tiny_model

    assert SCRIPTS["deepseek-flash-prune"] == "deepseek_flash.cli:prune_main"
    store = pack(make_tiny_model(tmp_path / "src", "llama", num_layers=1), tmp_path / "store")
    assert cli.prune_main([str(store), "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["output"] is None and doc["payload_bytes"] > 0
