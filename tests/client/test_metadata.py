"""client.metadata: the standard library's packages_distributions() mapping with one stat per
inferred name instead of one per listed file, and its use while a model class is imported."""
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deepseek_flash.client import metadata
from deepseek_flash.client.skeleton import Imports


def _dist(site: Path, name: str, files: dict, record_only=(), top_level=None) -> None:
    """A dist-info in ``site`` whose RECORD lists ``record_only`` (not written: files gone since
    the install), then ``files`` (written)."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    listed = [*record_only, *files, f"{info.name}/METADATA", f"{info.name}/RECORD"]
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in listed))
    if top_level is not None:
        (info / "top_level.txt").write_text("\n".join(top_level) + "\n")


@pytest.fixture
def site(tmp_path):
    site = tmp_path / "site"
    # alpha: a package whose first-listed file is gone, another package all gone, a module kept
    # and a module gone; no top_level.txt (the names are inferred from the files).
    _dist(site, "alpha", {"alpha/core.py": "", "alpha/sub/x.py": "", "alone.py": ""},
          record_only=["alpha/__init__.py", "vanished/__init__.py", "vanished/y.py", "gone_mod.py"])
    # beta: every file present, many of one package (the case that cost a stat each).
    _dist(site, "beta", {f"beta/m{i}.py": "" for i in range(50)})
    # gamma: declares its names (top_level.txt): never inferred.
    _dist(site, "gamma", {"gamma/__init__.py": ""}, top_level=["gamma", "gamma_extra"])
    return site


def _filtered_names(dist) -> set:
    """The names ``_top_level_inferred`` gives ``dist``'s files that pass Python 3.12's
    existence filter (``path.locate().exists()``), whatever this interpreter's version."""
    class Files:
        files = [p for p in dist.files if p.locate().exists()]

    return set(md._top_level_inferred(Files()))


def test_the_existence_filter_gives_the_same_names_with_one_stat_a_name(site, monkeypatch):
    dists = {d.metadata["Name"]: d for d in md.distributions(path=[str(site)])}
    calls = []
    real_stat = os.stat

    def counting_stat(path, *a, **k):
        calls.append(str(path))
        return real_stat(path, *a, **k)

    for name in ("alpha", "beta"):
        monkeypatch.setattr(os, "stat", counting_stat)
        calls.clear()
        few = _filtered_names(metadata._FewStats(dists[name]))
        few_calls = len(calls)
        calls.clear()
        every = _filtered_names(dists[name])
        every_calls = len(calls)
        monkeypatch.setattr(os, "stat", real_stat)
        assert few == every
        if name == "alpha":
            # The gone package and module are left out, the package with a gone first file kept.
            assert every == {"alpha", "alone"}
            # alpha/__init__ (gone) then alpha/core; vanished: both; gone_mod; alone; METADATA.
            assert few_calls == 7 and every_calls == 9
        else:
            assert every == {"beta"}
            assert few_calls == 2 and every_calls == 52     # beta's first file, the dist-info's


def test_the_mapping_equals_the_standard_librarys(site, monkeypatch):
    """Here (this interpreter's own filter) on the test's site dir and on the installed
    environment: the same names, the same distributions in the same order."""
    monkeypatch.syspath_prepend(str(site))
    assert metadata.packages_distributions() == md.packages_distributions()
    got = metadata.packages_distributions()
    assert got["alpha"] == ["alpha"] and got["alone"] == ["alpha"] and got["beta"] == ["beta"]
    assert got["gamma_extra"] == ["gamma"]
    # Python >= 3.12 leaves out the names whose files are all gone; earlier versions keep them.
    assert ("vanished" in got) is ("gone_mod" in got) is (not metadata.FILTERS_MISSING)


SCRIPT = textwrap.dedent("""
    import importlib.metadata as md, importlib.util, json, sys
    spec = importlib.util.spec_from_file_location("few", sys.argv[1])
    few = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(few)
    sys.path.insert(0, sys.argv[2])
    print(json.dumps({"filters": few.FILTERS_MISSING, "few": few.packages_distributions(),
                      "std": md.packages_distributions()}))
""")


@pytest.mark.parametrize("version", ["3.12", "3.13"])
def test_the_mapping_equals_the_standard_librarys_on_python_312_and_later(site, version):
    """Where that interpreter is installed: its standard library filters files by existence (the
    cost avoided), and the mapping is the same (the module needs nothing but the standard
    library)."""
    # On PATH, or installed beside this interpreter (pyenv's versions, /usr/bin).
    found = [shutil.which(f"python{version}"),
             *map(str, Path(sys.base_prefix).parent.glob(f"{version}*/bin/python{version}")),
             f"/usr/bin/python{version}"]
    python = next((p for p in found if p and os.path.exists(p) and subprocess.run(
        [p, "-c", ""], capture_output=True).returncode == 0), None)
    if python is None:
        pytest.skip(f"no python{version} here")
    done = subprocess.run([python, "-I", "-c", SCRIPT, metadata.__file__, str(site)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["filters"] is True
    assert out["few"] == out["std"]
    assert out["few"]["alpha"] == ["alpha"] and "vanished" not in out["few"]


def test_few_stats_replaces_the_function_only_inside_and_only_where_it_filters(monkeypatch):
    original = md.packages_distributions
    monkeypatch.setattr(metadata, "FILTERS_MISSING", False)
    with metadata.few_stats():
        assert md.packages_distributions is original          # nothing to save: untouched
    monkeypatch.setattr(metadata, "FILTERS_MISSING", True)
    with metadata.few_stats():
        assert md.packages_distributions is metadata.packages_distributions
        with metadata.few_stats():                             # nested (another thread's)
            assert md.packages_distributions is metadata.packages_distributions
        assert md.packages_distributions is metadata.packages_distributions
    assert md.packages_distributions is original


def test_few_stats_leaves_a_replacement_made_by_someone_else(monkeypatch):
    monkeypatch.setattr(metadata, "FILTERS_MISSING", True)

    def theirs():
        return {}

    monkeypatch.setattr(md, "packages_distributions", theirs)
    with metadata.few_stats():
        assert md.packages_distributions is theirs
    assert md.packages_distributions is theirs


def test_the_imports_thread_imports_with_few_stats(tmp_path, monkeypatch):
    """A module imported by ``Imports`` that calls packages_distributions() at import (as
    transformers' import_utils does) gets this module's function; afterwards the original is back."""
    monkeypatch.setattr(metadata, "FILTERS_MISSING", True)
    (tmp_path / "calls_metadata_at_import.py").write_text(
        "import importlib.metadata\n"
        "FUNCTION = importlib.metadata.packages_distributions\n"
        "MAPPING = FUNCTION()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    original = md.packages_distributions
    imports = Imports("calls_metadata_at_import")
    imports.wait()
    module = sys.modules.pop("calls_metadata_at_import")
    assert module.FUNCTION is metadata.packages_distributions
    assert module.MAPPING == original()
    assert md.packages_distributions is original
