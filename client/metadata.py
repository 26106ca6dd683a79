"""``importlib.metadata.packages_distributions()`` with the standard library's result and a few
file system calls instead of one per installed file, used while a fresh process imports its model
class (``client.skeleton.Imports``).

transformers (5.x up to at least 5.17) calls ``packages_distributions()`` when its
``utils.import_utils`` is imported. From Python 3.12 on, ``Distribution.files`` keeps only the
listed files that exist, so for every installed distribution without a ``top_level.txt`` (torch,
the CUDA libraries' wheels, ...) that call stats every file its RECORD lists: ~20,000 on the CI
box, more beside a CUDA build of torch. On the GPU machines (gVisor: each call is a trip through
the sandbox) that was ~4 s of the 13.4 s a client's model-class imports took during a cold load
(docs/benchmarks.md, "Cold load after start").

The name a file gives (``importlib.metadata._top_level_inferred``) is a function of its first path
part alone when it has more than one part, of its whole name otherwise; a name is in the result
when at least one of its files exists. So ``_FewStats`` answers the standard library's own
``files`` existence filter with one real ``stat`` per name until one file of that name exists,
then without a call for the name's other files: the same names, in the same per-name order of
distributions, from the standard library's own code reading the same RECORDs.
"""
from __future__ import annotations

import collections
import contextlib
import importlib.metadata as md
import sys
import threading

# Python >= 3.12 filters a distribution's files by their existence (the cost avoided here); the
# standard library's helpers used below are private: without them nothing is replaced.
FILTERS_MISSING = sys.version_info >= (3, 12) and hasattr(md, "_top_level_inferred") \
    and hasattr(md, "_top_level_declared")


def _name_key(path) -> tuple:
    """What a listed file's inferred top-level name depends on (see the module docstring)."""
    parts = path.parts
    return (parts[0], True) if len(parts) > 1 else (str(path), False)


class _Exists:
    """A listed file's location whose ``exists()`` stats only while no file of its name was
    found (``_FewStats``)."""

    __slots__ = ("_dist", "_path")

    def __init__(self, dist: _FewStats, path):
        self._dist, self._path = dist, path

    def exists(self) -> bool:
        key = _name_key(self._path)
        found = self._dist.found
        if key in found:
            return True
        if self._dist.real.locate_file(self._path).exists():
            found.add(key)
            return True
        return False


class _FewStats(md.Distribution):
    """``real`` (a distribution) as the standard library reads it, its files' existence answered
    per name (``_Exists``): ``files`` then lists the same names, with some files of a found name
    not checked."""

    def __init__(self, real):
        self.real = real
        self.found: set = set()
        path = getattr(real, "_path", None)
        if path is not None:
            self._path = path       # the egg-info reader's relative paths start there

    def read_text(self, filename):
        return self.real.read_text(filename)

    def locate_file(self, path):
        if str(path) in ("", "."):
            return self.real.locate_file(path)
        return _Exists(self, path)


def packages_distributions() -> dict[str, list[str]]:
    """``importlib.metadata.packages_distributions()``'s mapping (top-level name -> distribution
    names), each inferred name checked by its files until one exists."""
    out = collections.defaultdict(list)
    for dist in md.distributions():
        for pkg in md._top_level_declared(dist) or md._top_level_inferred(_FewStats(dist)):
            out[pkg].append(dist.metadata["Name"])
    return dict(out)


_lock = threading.Lock()
_active = {"count": 0, "original": None}


@contextlib.contextmanager
def few_stats():
    """Inside the block (any thread), ``importlib.metadata.packages_distributions`` is
    ``packages_distributions`` above, where the standard library filters files by existence and
    its function is in place (not replaced by someone else); the original is back once the last
    block ends."""
    with _lock:
        if _active["count"] == 0:
            current = md.packages_distributions
            if FILTERS_MISSING and getattr(current, "__module__", None) == md.__name__:
                _active["original"] = current
                md.packages_distributions = packages_distributions
        _active["count"] += 1
    try:
        yield
    finally:
        with _lock:
            _active["count"] -= 1
            if _active["count"] == 0 and _active["original"] is not None:
                if md.packages_distributions is packages_distributions:
                    md.packages_distributions = _active["original"]
                _active["original"] = None
