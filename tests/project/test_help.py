"""Every command line says what it takes: ``python -m MODULE --help`` (or
``python scripts/NAME.py --help``) exits 0 before any work, names the command
a user types (not the file), and gives every option a line of help.

All the commands are found by reading the source (an ``argparse.ArgumentParser(``
in the file) and run in one process, so the test costs one start-up:
`argparse.ArgumentParser.parse_args` is replaced by one that keeps the
parser and stops, so nothing after the parsing runs.

    .venv/bin/python -m pytest tests/project/test_help.py -q
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ("torch", "jax", "cupy")           # the extras' dependencies, absent from make test
PACKAGES = ("reference", "mpi_impl", "gpu_impl", "model", "bench", "scripts", "conformance")

PROBE = r'''
import argparse, contextlib, io, json, runpy, sys, warnings
warnings.simplefilter("ignore")
found = {}
class Stop(Exception):
    pass
def keep(self, args=None, namespace=None):
    found[current] = self
    raise Stop
argparse.ArgumentParser.parse_args = keep
results = {}
for current, how, target in json.loads(sys.argv[1]):
    sys.argv = [target, "--help"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            if how == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        except (Stop, SystemExit):
            pass
        except Exception as e:
            results[current] = {"error": repr(e)}
            continue
    ap = found.get(current)
    if ap is None:
        results[current] = {"error": "parsed no arguments"}
        continue
    results[current] = {"prog": ap.prog, "silent": [a.option_strings[0] for a in ap._actions
                         if a.option_strings and not a.help and a.help != argparse.SUPPRESS]}
print(json.dumps(results))
'''


def commands():
    """(name, "module" or "path", what runpy runs) for every file a user runs: a
    package's ``__main__.py``, a module with ``if __name__ == "__main__"``, a script."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
                continue                    # a venv inside a package (conformance/.venv): not ours
            if path.name != "__main__.py" and 'if __name__ == "__main__"' not in path.read_text():
                continue
            rel = path.relative_to(ROOT)
            if package == "scripts":
                found.append((str(rel), "path", str(path)))
            else:
                module = ".".join(rel.with_suffix("").parts).removesuffix(".__main__")
                found.append((module, "module", module))
    return found


def test_every_command_line_names_itself_and_helps_every_option():
    found = commands()
    assert {"reference", "reference.tms", "mpi_impl", "model", "bench.run"} <= {name for name, _, _ in found}
    run = subprocess.run([sys.executable, "-c", PROBE, json.dumps(found)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout.splitlines()[-1])
    problems = []
    for name, how, _ in found:
        got = results[name]
        if "error" in got and any(f"No module named '{x}'" in got["error"] for x in OPTIONAL):
            continue                # an extra's command (make conformance), without its extra
        if "error" in got:
            problems.append(f"{name}: {got['error']}")
            continue
        typed = f"python {name}" if how == "path" else f"-m {name}"
        if typed not in got["prog"]:
            problems.append(f"{name}: usage names {got['prog']!r}, not the command ({typed!r})")
        if got["silent"]:
            problems.append(f"{name}: no help for {', '.join(got['silent'])}")
    assert not problems, "\n".join(problems)
