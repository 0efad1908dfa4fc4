"""The public names the README and docs/design.md give still import
(docs/design.md, "Public interface": add beside them, never rename them).

A name is a backquoted dotted name of one of our packages
(`reference.lockstep.ring_attention`, `mpi_impl.RingComm`, `python -m
reference.cost`), or, in design.md's public interface, a backquoted call
(`merge(...)`) or capitalised name (`RingComm`) of the package whose paragraph
it is in, or of a module the same bullet names (`reference.steps`: `get(name)`). They are resolved in a process
of their own (mpi_impl imports mpi4py).

    .venv/bin/python -m pytest tests/project/test_public_names.py -q
"""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("reference", "mpi_impl", "gpu_impl", "model")
DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)")
CALL = re.compile(r"`([A-Za-z_]\w*)\(")                        # `merge((out_a, ...`
CAPITALISED = re.compile(r"`([A-Z]\w*)`")                        # `RingComm`, `LAYOUTS`: never an argument
RESOLVE = """
import importlib, json, sys

def resolves(name):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False

print(json.dumps([names[0] for names in json.loads(sys.argv[1]) if not any(map(resolves, names))]))
"""


def dotted_names(text):
    """Our dotted names in the text's backquotes, read line by line (a fence's backquotes pair up on their own line)."""
    return {m for line in text.splitlines() for quoted in re.findall(r"`([^`]+)`", line) for m in DOTTED.findall(quoted)}


def interface_calls(design):
    """For each backquoted call of the public interface, the names it may be: (package.call, module.call, ...)."""
    section = design.split("## Public interface", 1)[1].split("\n## ", 1)[0]
    found, package = set(), None
    for chunk in re.split(r"\n(?=- |`)", section):
        first = re.match(rf"`({'|'.join(PACKAGES)})`", chunk)
        package = first.group(1) if first else package
        if package:
            places = (package, *sorted(dotted_names(chunk)))
            found |= {tuple(f"{place}.{name}" for place in places)
                      for name in CALL.findall(chunk) + CAPITALISED.findall(chunk)}
    return found


def unresolved(candidates):
    """The first name of each tuple of which no name resolves."""
    proc = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps(sorted(candidates))], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_the_public_names_of_the_readme_and_the_design_import():
    design = (ROOT / "docs" / "design.md").read_text()
    dotted = dotted_names(design) | dotted_names((ROOT / "README.md").read_text())
    calls = interface_calls(design)
    assert {"reference.lockstep.ring_attention", "reference.testing.TOL"} <= dotted, sorted(dotted)
    assert {"reference.attention", "reference.merge", "mpi_impl.ring_attention", "mpi_impl.RingComm",
            "reference.Trace"} <= {c[0] for c in calls}, sorted(calls)
    bad = unresolved({(name,) for name in dotted} | calls)
    assert not bad, f"public names that no longer import: {bad}"


def test_a_renamed_name_is_caught():
    assert unresolved({("reference.merge",), ("reference.merged",), ("reference.gett", "reference.steps.gett"),
                       ("reference.get", "reference.steps.get"), ("reference.nothing.x",)}) \
        == ["reference.gett", "reference.merged", "reference.nothing.x"]
