"""The client's house rules: it reaches the daemon only through the wire module (and embedded
mode through the controller's factory), and no module of the client or of the shared modules
imports itself back through another."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
# Where each package's files live (setup.py's PACKAGE_DIRS, as far as these tests look).
PACKAGES = {"deepseek_flash.client": ROOT / "client", "deepseek_flash": ROOT / "deepseek_flash"}
# The shared modules both sides import: the client may use them, and they must not import
# either side's internals.
SHARED = ("deepseek_flash.wire", "deepseek_flash.protocol", "deepseek_flash.prefetch",
          "deepseek_flash.cuda", "deepseek_flash.fsutil", "deepseek_flash.sizes",
          "deepseek_flash.errors", "deepseek_flash.paths", "deepseek_flash.bytecode")
# The one entrance into deepseek_flash.daemon a client module may use: embedded mode builds its
# controller like the daemon does.
ALLOWED_DAEMON_IMPORTS = {
    "deepseek_flash.client.embedded": {"deepseek_flash.daemon.factory"},
}


def module_file(name: str) -> Path | None:
    for package, folder in sorted(PACKAGES.items(), key=lambda kv: -len(kv[0])):
        if name == package:
            return folder / "__init__.py"
        if name.startswith(package + "."):
            rest = name[len(package) + 1:].split(".")
            path = folder.joinpath(*rest)
            if path.with_suffix(".py").exists():
                return path.with_suffix(".py")
            if (path / "__init__.py").exists():
                return path / "__init__.py"
    return None


def imports_of(name: str) -> set[str]:
    """Every module ``name`` imports, at any depth of its code (lazy imports count too)."""
    path = module_file(name)
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.add(target)
            for alias in node.names:          # ``from . import stream``: the submodule itself
                if module_file(f"{target}.{alias.name}") is not None:
                    out.add(f"{target}.{alias.name}")
    return {m for m in out if m.startswith("deepseek_flash")}


def client_modules() -> list[str]:
    return sorted("deepseek_flash.client" if p.stem == "__init__" else f"deepseek_flash.client.{p.stem}"
                  for p in (ROOT / "client").glob("*.py"))


def cycles_in(graph: dict[str, list[str]]) -> list[list[str]]:
    state: dict[str, int] = {}            # 1: on the current path, 2: done
    cycles = []

    def visit(m, path):
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_the_analysis_sees_imports_of_every_kind():
    model = imports_of("deepseek_flash.client.model")
    assert {"deepseek_flash.wire", "deepseek_flash.client.skeleton",   # module level, relative
            "deepseek_flash.client"} <= model                           # lazy ``from . import``
    assert "deepseek_flash.client.embedded" in imports_of("deepseek_flash.client")  # lazy
    assert "deepseek_flash.daemon.factory" in imports_of("deepseek_flash.client.embedded")
    assert cycles_in({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]
    assert cycles_in({"a": ["b", "c"], "b": ["c"], "c": []}) == []


@pytest.mark.parametrize("module", client_modules())
def test_the_client_does_not_import_daemon_internals(module):
    daemon = {m for m in imports_of(module) if m == "deepseek_flash.daemon"
              or m.startswith("deepseek_flash.daemon.")}
    assert daemon <= ALLOWED_DAEMON_IMPORTS.get(module, set()), \
        f"{module} imports {sorted(daemon - ALLOWED_DAEMON_IMPORTS.get(module, set()))}"


@pytest.mark.parametrize("module", SHARED)
def test_shared_modules_import_neither_side(module):
    sides = {m for m in imports_of(module)
             if m.startswith(("deepseek_flash.daemon", "deepseek_flash.client"))}
    assert not sides, f"{module} imports {sorted(sides)}"


def test_no_import_cycles_among_the_client_and_the_shared_modules():
    nodes = set(client_modules()) | set(SHARED)
    assert cycles_in({m: sorted(imports_of(m) & nodes - {m}) for m in nodes}) == []
