"""Progress bars for the store's long-running verbs: tqdm on a TTY, silent otherwise or with --quiet."""
from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def byte_progress(total: int, desc: str, quiet: bool):
    """Yield a ``progress(nbytes)`` callable (or None when no bar is shown)."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr, leave=False) as bar:
        yield bar.update
