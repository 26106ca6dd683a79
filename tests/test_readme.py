"""The README's first command block is what a new user copies: it must work on a fresh box.

Checks the block against the project's own files: the CPU choice of torch is a command of its own
(no multi-GB CUDA build on a CPU box), the apt line names what the extras need to build, the extras
it installs exist and -- without the optional journal binding -- need no system library, CI runs
the same command, and the supported architectures listed are the ones ``pack`` accepts.
"""
from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

from deepseek_flash.store.layout import SUPPORTED_ARCHITECTURES

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def first_command_block() -> list[str]:
    block = re.search(r"```sh\n(.*?)```", README, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines()
            if line.split("#", 1)[0].strip()]


def extras_of(line: str) -> list[str]:
    return re.search(r"\.\[([a-z,]+)\]", line).group(1).split(",")


def test_torch_cpu_and_cuda_choices_are_commands_of_their_own():
    commands = first_command_block()
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in commands
    assert "pip install torch" in commands
    # No other line installs torch implicitly before the choice is made.
    torch_lines = [i for i, c in enumerate(commands) if c.startswith("pip install torch")]
    first_project = next(i for i, c in enumerate(commands) if "pip install -e" in c)
    assert max(torch_lines) < first_project


def test_apt_line_names_what_the_journal_extra_builds_against():
    commands = first_command_block()
    apt = next(c for c in commands if "apt-get install" in c)
    assert {"g++", "pkg-config", "libsystemd-dev"} <= set(shlex.split(apt))


def test_extras_exist_and_only_journal_needs_libsystemd():
    extras = PYPROJECT["project"]["optional-dependencies"]
    test_line = next(c for c in first_command_block() if "pytest" in c)
    wanted = extras_of(test_line)
    assert set(wanted) <= set(extras), f"README installs extras pyproject lacks: {set(wanted) - set(extras)}"
    needing_libsystemd = {name for name, reqs in extras.items()
                          if any(r.lower().startswith("systemd-python") for r in reqs)}
    assert needing_libsystemd == {"journal"}


def test_ci_runs_the_readme_test_command_with_the_same_extras():
    ci = (REPO / ".ci" / "run").read_text()
    test_line = next(c for c in first_command_block() if "pytest" in c)
    ci_install = next(line for line in ci.splitlines() if "pip install" in line and "-e" in line)
    assert extras_of(ci_install) == extras_of(test_line)
    assert "libsystemd-dev" in ci and "pkg-config" in ci
    assert "python3 -m pytest -q tests" in ci and "python3 -m pytest -q tests" in test_line


def test_supported_architectures_are_listed():
    listed = re.search(r"Supported model architectures: (.*?)\n\n", README, re.S).group(1)
    names = [arch.removesuffix("ForCausalLM") for arch in SUPPORTED_ARCHITECTURES]
    assert names == ["Llama", "Qwen2", "Mistral"]
    for name in names:
        assert f"**{name}**" in listed
