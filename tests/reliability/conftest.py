"""Reliability tests reuse the real-daemon harness and packed models of tests/daemon."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "daemon"))

from flashd_harness import daemon_factory, tiny_store, wide_store  # noqa: F401
