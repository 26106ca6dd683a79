"""Packed test models and the real-daemon harness for the controller's tests."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from flashd_harness import Daemon, packed_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory):
    """4 decoder layers of ~148 KiB (norms 4 KiB, attn 48 KiB, gate_up 64 KiB, down 32 KiB)."""
    return packed_model(tmp_path_factory.mktemp("tiny"), "tiny", num_layers=4)


@pytest.fixture(scope="session")
def big_store(tmp_path_factory):
    """Layers of ~3.8 MiB: larger than a 1 MiB host budget."""
    return packed_model(tmp_path_factory.mktemp("big"), "big", num_layers=2, hidden_size=256,
                        intermediate_size=1024)


@pytest.fixture(scope="session")
def wide_store(tmp_path_factory):
    """4 decoder layers of ~964 KiB: two fit in a 2 MiB host budget."""
    return packed_model(tmp_path_factory.mktemp("wide"), "wide", num_layers=4, hidden_size=128,
                        intermediate_size=512)


@pytest.fixture
def daemon_factory(tmp_path):
    started = []

    def make(config: dict | None = None, **kw):
        d = Daemon(tmp_path / f"d{len(started)}", config, **kw)
        started.append(d)
        return d
    yield make
    for d in started:
        d.cleanup()
