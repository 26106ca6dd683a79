"""The KV tests import their shared helpers from kvmodels.py beside them."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from kvmodels import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")
