"""Imports written inside functions (bench sections, scripts, command lines) name what exists.

A module-level import fails on the first test that imports its module; one
inside a function fails only when that function runs, which for a bench
section or a GPU script may be never on this machine. This reads every
``from <project package> import name`` in bench/, scripts/ and the packages,
wherever it sits, and checks the module and the name exist, in a process of
its own: importing every module registers steps and peers that would change
what other tests in this process draw.
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("reference", "mpi_impl", "gpu_impl", "model", "bench", "conformance")

CHECK = """
import importlib, sys
missing = []
for where, module, name in eval(sys.stdin.read()):
    found = importlib.import_module(module)
    if not hasattr(found, name):
        try:
            importlib.import_module(f"{module}.{name}")       # a submodule not yet imported
        except ModuleNotFoundError:
            missing.append(f"{where}: {module} has no {name}")
print("\\n".join(missing))
"""


def our_imports(path):
    """(where, module, name) of each absolute `from <ours> import name` in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in OURS:
            for alias in node.names:
                yield f"{path.relative_to(ROOT)}:{node.lineno}", node.module, alias.name


def test_every_import_of_ours_names_something_that_exists():
    files = sorted(p for folder in ("bench", "scripts") + OURS for p in (ROOT / folder).rglob("*.py"))
    imports = [found for path in files for found in our_imports(path)]
    assert len(imports) > 100, len(imports)
    proc = subprocess.run([sys.executable, "-c", CHECK], input=repr(imports), cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", "imports of names that do not exist:\n" + proc.stdout
