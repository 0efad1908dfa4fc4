"""The rooms of the code stay rooms (docs/style.md, rules 17 and 18), read from the source with `ast`, nothing run:

- the reference imports no backend, names none in a string, and imports its own
  modules at the top of the file, never inside a function;
- no package has an import circle among its modules, and no package imports one
  that sits above it (the reference is at the bottom, then the backends, then
  the model, the benchmarks and the scripts);
- no module of `reference/`, `mpi_impl/`, `gpu_impl/`, `bench/`, `scripts/`,
  `model/` outgrows one idea (about 400 lines);
- no function takes more than about nine arguments by position.

    .venv/bin/python -m pytest tests/project/test_rooms.py -q
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "reference"
MAX_LINES = 400
MAX_POSITIONAL = 9           # ring_backward: q, k, v, out, lse, dout, q_pos, k_pos, comm
BACKENDS = ("mpi_impl", "gpu_impl", "model", "bench", "scripts", "conformance")
IMPORT_PATH = re.compile(rf"(?<![\w.])({'|'.join(BACKENDS)})[.:][A-Za-z_]")   # "gpu_impl.fused:FusedStep"
# the packages from the bottom up: each may import those before it, never one after it
LEVELS = ("reference", "mpi_impl", "gpu_impl", "model", "bench", "scripts")
CAPPED = ("reference", "mpi_impl", "gpu_impl", "bench", "scripts", "model")


def modules(package="reference", everywhere=False):
    """A package's modules (the reference's kit, reference/testing, only `everywhere`)."""
    paths = sorted((ROOT / package).rglob("*.py"))
    return [p for p in paths if everywhere or "testing" not in p.relative_to(ROOT).parts]


def dotted(path):
    """reference/steps/v5.py -> 'reference.steps.v5'; reference/steps/__init__.py -> 'reference.steps'."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path):
    """What a module imports: (absolute dotted name, line, inside a function, relative).
    ``from . import x`` names the module ``pkg.x``; ``from .m import f``, ``pkg.m``."""
    tree = ast.parse(path.read_text())
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    package = dotted(path).split(".") if path.name == "__init__.py" else dotted(path).split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            head = ".".join(x for x in (base, node.module or "") if x)
            names = [f"{head}.{a.name}" if our_module(f"{head}.{a.name}") else head for a in node.names]
        else:
            continue
        found += [(name, node.lineno, id(node) in inner, bool(getattr(node, "level", 0))) for name in set(names)]
    return found


def our_module(name):
    """The path of our module `name` (or of the package it names), else None."""
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def test_the_reference_imports_no_backend_and_nothing_inside_a_function():
    for path in modules():
        for name, line, inside, relative in imported(path):
            assert name.split(".")[0] not in BACKENDS, f"{path.name}:{line} imports {name}"
            assert not (inside and relative), \
                f"{path.name} imports a module of the reference inside a function, line {line}"


def strings(path):
    """The string constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


def test_the_reference_names_no_backend_in_a_string():
    """An import path in a string ("gpu_impl.fused:FusedStep") is an upward import in disguise."""
    for path in modules(everywhere=True):
        named = [s for s in strings(path) if IMPORT_PATH.search(s)]
        assert not named, f"{path.name} names a backend in a string: {named}"


def graph(package):
    """Module -> our modules of `package` it imports at the top of the file."""
    edges = {}
    for path in modules(package, everywhere=True):
        targets = {dotted(our_module(name)) for name, _, inside, _ in imported(path)
                   if not inside and our_module(name) and name.split(".")[0] == package}
        edges[dotted(path)] = targets - {dotted(path)}
    return edges


def circle(edges):
    """One import circle of `edges` as a list of names, or None."""
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node):] + [node]
        if node not in done:
            path.append(node)
            for nxt in sorted(edges.get(node, ())):
                found = visit(nxt)
                if found:
                    return found
            path.pop()
            done.add(node)
        return None
    return next(filter(None, (visit(name) for name in sorted(edges))), None)


def test_no_package_has_an_import_circle():
    for package in CAPPED:
        found = circle(graph(package))
        assert found is None, f"import circle: {' -> '.join(found)}"


def test_no_package_imports_one_above_it():
    for level, package in enumerate(LEVELS):
        above = LEVELS[level + 1:]
        for path in modules(package, everywhere=True):
            for name, line, _, _ in imported(path):
                assert name.split(".")[0] not in above, \
                    f"{path.relative_to(ROOT)}:{line} imports {name}, which sits above {package}"


def test_no_module_outgrows_one_idea():
    for package in CAPPED:
        for path in modules(package, everywhere=True):
            lines = len(path.read_text().splitlines())
            assert lines <= MAX_LINES, \
                f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES}: split it by job)"


def test_no_function_takes_many_arguments_by_position():
    for package in CAPPED:
        for path in modules(package, everywhere=True):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = len(node.args.posonlyargs) + len(node.args.args)
                    assert n <= MAX_POSITIONAL, \
                        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} takes {n} arguments by position"
