"""deepseek_flash.bytecode: the daemon's compiled-module cache for an installation that ships no
compiled files -- where the files go, when the cache is needed and usable, compiling into it, an
interpreter reading it (and not the source) -- and the client's imports thread reading it."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from deepseek_flash import bytecode


def _package(site, name="flashbc_pkg", value=1):
    """A package without compiled files: ``VALUE = value`` in its module ``m``."""
    pkg = site / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text(f"VALUE = {value}\n")
    return pkg


def test_the_cache_lays_files_out_as_pycache_prefix_does(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "cache"))
    source = "/opt/site/pkg/mod.py"
    assert bytecode.cache_path(str(tmp_path / "cache"), source) == importlib.util.cache_from_source(source)


def test_needed_only_where_the_sources_have_no_compiled_files(tmp_path):
    pkg = _package(tmp_path)
    sources = [str(pkg / "__init__.py"), str(pkg / "m.py")]
    assert bytecode.needed(sources) is True
    assert bytecode.needed([str(tmp_path / "missing.py")]) is False     # nothing to tell by
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / f"m.{sys.implementation.cache_tag}.pyc").write_bytes(b"x")
    assert bytecode.needed(sources) is False


def test_compile_into_compiles_what_is_missing_or_stale_and_an_interpreter_reads_it(tmp_path):
    """Compiled once (a process of its own), then nothing to do; a source changed since is
    compiled again. An interpreter with the cache as its prefix runs the compiled file: its
    source rewritten afterwards with the same size and time still gives the compiled value."""
    site, cache = tmp_path / "site", str(tmp_path / "cache")
    pkg = _package(site)
    sources = [str(pkg / "__init__.py"), str(pkg / "m.py"), str(tmp_path / "gone.py")]
    first = bytecode.compile_into(cache, sources)
    assert first == {"compiled": 2, "failed": 0, "stale": 2}
    assert all(os.path.isfile(bytecode.cache_path(cache, s)) for s in sources[:2])
    assert bytecode.compile_into(cache, sources) == {"compiled": 0, "failed": 0, "stale": 0}
    stat = os.stat(pkg / "m.py")
    (pkg / "m.py").write_text("VALUE = 2\n")                 # same size, same time: not noticed
    os.utime(pkg / "m.py", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    run = subprocess.run([sys.executable, "-B", "-X", f"pycache_prefix={cache}", "-c",
                          "import flashbc_pkg.m as m; print(m.VALUE)"],
                         cwd=site, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "1"                        # the compiled file, not the source
    os.utime(pkg / "m.py", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert bytecode.stale(cache, sources) == [str(pkg / "m.py")]
    assert bytecode.compile_into(cache, sources)["compiled"] == 1


def test_a_broken_source_is_counted_not_raised(tmp_path):
    (tmp_path / "bad.py").write_text("def (:\n")
    assert bytecode.compile_into(str(tmp_path / "cache"), [str(tmp_path / "bad.py")]) == {
        "compiled": 0, "failed": 1, "stale": 1}


def test_the_prefix_is_set_only_inside_where_usable_and_needed(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "pycache_prefix", None)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    os.chmod(cache, 0o755)
    pkg = _package(tmp_path / "site")
    probes = [str(pkg / "__init__.py")]
    with bytecode.prefix_while(str(cache), probes) as used:       # nothing compiled there yet
        assert used is None and sys.pycache_prefix is None
    bytecode.compile_into(str(cache), probes)
    with bytecode.prefix_while(str(cache), probes) as used:
        assert used == str(cache) and sys.pycache_prefix == str(cache)
        with bytecode.prefix_while(str(cache), probes):            # another thread's, nested
            assert sys.pycache_prefix == str(cache)
        assert sys.pycache_prefix == str(cache)
    assert sys.pycache_prefix is None
    with bytecode.prefix_while(None, probes) as used:                  # no cache from the daemon
        assert used is None and sys.pycache_prefix is None
    os.chmod(cache, 0o777)                                             # others may write: never
    with bytecode.prefix_while(str(cache), probes) as used:
        assert used is None and sys.pycache_prefix is None
    os.chmod(cache, 0o755)
    (pkg / "__pycache__").mkdir()                                      # compiled files here: not needed
    (pkg / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc").write_bytes(b"x")
    with bytecode.prefix_while(str(cache), probes) as used:
        assert used is None and sys.pycache_prefix is None
    monkeypatch.setattr(sys, "pycache_prefix", "/the/users/own")       # a prefix set already: kept
    with bytecode.prefix_while(str(cache), [str(tmp_path / "site" / "x.py")]) as used:
        assert used is None and sys.pycache_prefix == "/the/users/own"


def test_the_imports_thread_reads_the_daemons_cache(tmp_path):
    """A fresh process whose installation has no compiled files: ``Imports`` with the daemon's
    cache runs the cache's compiled module (the source rewritten meanwhile, same size and time),
    says so (``prefix``), and leaves no prefix behind; without the cache it runs the source."""
    site, cache = tmp_path / "site", tmp_path / "cache"
    pkg = _package(site)
    bytecode.compile_into(str(cache), [str(pkg / "__init__.py"), str(pkg / "m.py")])
    os.chmod(cache, 0o755)
    stat = os.stat(pkg / "m.py")
    (pkg / "m.py").write_text("VALUE = 2\n")
    os.utime(pkg / "m.py", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(site)!r})
        from deepseek_flash.client.skeleton import Imports
        cache = sys.argv[1] or None
        imports = Imports("flashbc_pkg.m", cache)
        imports.wait()
        import flashbc_pkg.m as m
        print(m.VALUE, imports.prefix == cache, sys.pycache_prefix)
    """)
    for cache_arg, expected in ((str(cache), "1 True None"), ("", "2 True None")):
        run = subprocess.run([sys.executable, "-B", "-c", script, cache_arg],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.strip() == expected


def test_the_clients_bytecode_cache_is_the_daemons_hello(monkeypatch):
    from deepseek_flash.client import Client

    client = object.__new__(Client)
    client._backend = type("B", (), {"hello": {"bytecode_cache": "/var/lib/x/pycache"}})()
    assert client.bytecode_cache == "/var/lib/x/pycache"
    client._backend = type("B", (), {"hello": {}})()
    assert client.bytecode_cache is None
    client._backend = object()                    # embedded: no hello
    assert client.bytecode_cache is None


@pytest.mark.parametrize("needed", [True, False])
def test_the_daemon_keeps_a_cache_only_where_needed_and_compiles_what_it_learns(tmp_path, monkeypatch, needed):
    from deepseek_flash.daemon import imports_ahead

    monkeypatch.setattr(sys, "pycache_prefix", None)
    pkg = _package(tmp_path / "site")
    probes = [str(pkg / "__init__.py")]
    if not needed:
        (pkg / "__pycache__").mkdir()
        (pkg / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc").write_bytes(b"x")
    ahead = imports_ahead.ImportsAhead(tmp_path / "state")
    cache = ahead.use_bytecode_cache(probes)
    if not needed:
        assert cache is None and ahead.bytecode_dir is None and sys.pycache_prefix is None
        ahead.learn("mod", [str(pkg / "m.py")])
        assert not (tmp_path / "state" / "pycache").exists()
        return
    assert cache == str(tmp_path / "state" / "pycache") == ahead.bytecode_dir == sys.pycache_prefix
    assert ahead.learn("mod", [str(pkg / "m.py"), str(pkg / "__init__.py")])
    assert os.path.isfile(bytecode.cache_path(cache, str(pkg / "m.py")))
    assert os.path.isfile(bytecode.cache_path(cache, str(pkg / "__init__.py")))
