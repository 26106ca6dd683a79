"""The .pyi stub documents every public name of the native module, and every binding carries a
docstring."""
from __future__ import annotations

import ast
from pathlib import Path

from deepseek_flash import _core

STUB = Path(_core.__file__).with_name("_core.pyi")


def _stub_names():
    tree = ast.parse(STUB.read_text())
    names = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names[node.name] = set()
        elif isinstance(node, ast.AnnAssign):        # module constants (fault_injection)
            names[node.target.id] = set()
        elif isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign):
                    members.add(item.target.id)
            names[node.name] = members
    return names


def test_stub_covers_every_binding():
    stub = _stub_names()
    public = [n for n in dir(_core) if not n.startswith("_")]
    assert sorted(public) == sorted(stub)
    for name in public:
        obj = getattr(_core, name)
        assert obj.__doc__, name
        if isinstance(obj, type):
            for member in (m for m in vars(obj) if not m.startswith("_")):
                assert member in stub[name], f"{name}.{member} missing from _core.pyi"
                assert getattr(obj, member).__doc__, f"{name}.{member} has no docstring"
