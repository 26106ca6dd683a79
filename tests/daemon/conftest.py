"""Packed test models and the real-daemon harness for the controller's tests."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from flashd_harness import big_store, daemon_factory, tiny_store, wide_store  # noqa: F401
