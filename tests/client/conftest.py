"""The client's tests reuse the daemon tests' packed models and real-daemon harness."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from flashd_harness import daemon_factory, tiny_store, wide_store  # noqa: F401
