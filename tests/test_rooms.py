"""The rooms of the code stay rooms (STYLE.md 17, 18): the reference imports
no backend and its modules import each other without a circle, at the top of
the file; no module of the reference outgrows one idea (about 400 lines); no
function takes more than about eight arguments by position.

Read from the source with `ast`, nothing run.

    .venv/bin/python -m pytest tests/test_rooms.py -q
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "reference"
MAX_LINES = 400
MAX_POSITIONAL = 9           # ring_backward: q, k, v, out, lse, dout, q_pos, k_pos, comm
BACKENDS = ("mpi_impl", "gpu_impl", "model", "bench", "scripts", "peers")
IMPORT_PATH = re.compile(rf"(?<![\w.])({'|'.join(BACKENDS)})[.:][A-Za-z_]")   # "gpu_impl.fused:FusedStep"


def modules(everywhere=False):
    """The reference's modules (`everywhere`: the kit's too, reference/testing)."""
    return sorted(REFERENCE.rglob("*.py") if everywhere else REFERENCE.glob("*.py"))


def imports_of(path):
    """(reference modules it imports, backends it imports, imports inside functions)."""
    tree = ast.parse(path.read_text())
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    ours, backends, nested = set(), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else \
                [f"{node.module}" if node.module else a.name for a in node.names]
            if node.level:
                ours.update(n.split(".")[0] for n in names)
            else:
                backends.update(n for n in names if n.split(".")[0] in BACKENDS)
        elif isinstance(node, ast.Import):
            backends.update(a.name for a in node.names if a.name.split(".")[0] in BACKENDS)
        else:
            continue
        if id(node) in inner and getattr(node, "level", 0):
            nested.append(node.lineno)
    return ours, backends, nested


def test_the_reference_imports_no_backend_and_nothing_inside_a_function():
    for path in modules():
        ours, backends, nested = imports_of(path)
        assert not backends, f"{path.name} imports {sorted(backends)}"
        assert not nested, f"{path.name} imports a module of the reference inside a function, line {nested}"


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


def test_the_reference_has_no_import_circle():
    graph = {p.stem: {m for m in imports_of(p)[0] if (REFERENCE / f"{m}.py").exists()} for p in modules()}
    done, path = set(), []

    def visit(node):
        assert node not in path, f"import circle: {' -> '.join(path[path.index(node):] + [node])}"
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        path.pop()
        done.add(node)
    for name in graph:
        if name != "__init__":
            visit(name)


def test_no_module_of_the_reference_outgrows_one_idea():
    for path in modules(everywhere=True):
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_LINES, f"{path.name} has {lines} lines (at most {MAX_LINES}: split it by job)"


def test_no_function_of_the_reference_takes_many_arguments_by_position():
    for path in modules(everywhere=True):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = len(node.args.posonlyargs) + len(node.args.args)
                assert n <= MAX_POSITIONAL, f"{path.name}:{node.lineno} {node.name} takes {n} arguments by position"
