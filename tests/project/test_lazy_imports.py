"""Imports written inside functions (bench sections, scripts, command lines) name what exists.

A module-level import fails on the first test that imports its module; one
inside a function fails only when that function runs, which for a bench
section or a GPU script may be never on this machine. This reads every
``from <project package> import name`` in bench/, scripts/ and the packages,
wherever it sits, and checks the module and the name exist.
"""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("reference", "mpi_impl", "gpu_impl", "model", "bench", "conformance")
FILES = sorted(p for folder in ("bench", "scripts") + OURS for p in (ROOT / folder).rglob("*.py"))


def our_imports(path):
    """(line, module, name) of each absolute `from <ours> import name` in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in OURS:
            for alias in node.names:
                yield node.lineno, node.module, alias.name


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_import_of_ours_names_something_that_exists(path):
    for line, module, name in our_imports(path):
        where = f"{path.relative_to(ROOT)}:{line}: from {module} import {name}"
        found = importlib.import_module(module)
        if not hasattr(found, name):
            try:
                importlib.import_module(f"{module}.{name}")       # a submodule not yet imported
            except ModuleNotFoundError:
                pytest.fail(f"{where}: {module} has no {name}")
