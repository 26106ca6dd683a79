"""The prefetch policy's tests use the daemon tests' packed models."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from flashd_harness import tiny_store  # noqa: F401
