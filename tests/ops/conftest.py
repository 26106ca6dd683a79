"""The operator verbs' tests reuse the controller tests' real-daemon harness."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
