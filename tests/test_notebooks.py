"""The step-through notebooks: each runs from a clean kernel without error, imports
the project, and never re-defines a function or class that the project exports.

The notebooks are jupytext percent files (`notebooks/NN_name.py`);
`scripts/run_notebooks.py` turns each into a notebook in memory and executes it in
a fresh `python3` kernel of this interpreter (nbclient). Every claim in a notebook
is an `assert`, so a wrong claim fails here.

Notebooks teach with the real code: each of 1 to 6 prints the source of what it explains
(`inspect.getsource`), and any excerpt typed into a notebook's text as a ```python block
is checked, line by line, against the project's files.

Run: python -m pytest tests/test_notebooks.py -q      (about a minute; `make notebooks`
     runs the same notebooks and saves them executed as .ipynb)
"""

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("reference", "mpi_impl", "gpu_impl", "model")
CELL_TIMEOUT_S = 120      # one cell; the slowest (the MPI launches of notebook 6) takes ~10 s


def _load_runner():
    spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts" / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runner = _load_runner()
NOTEBOOKS = runner.notebook_paths()


# -- what the project exports ----------------------------------------------------

def public_names(source):
    """Names a module makes public: its `__all__`, and every top-level function,
    class and assignment whose name does not start with an underscore."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                    if target.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                        names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
    return {n for n in names if not n.startswith("_")}


def exported_names():
    """Public names of every module of reference/, mpi_impl/, gpu_impl/ and model/ (read, not imported:
    importing mpi_impl would start MPI, and gpu_impl may want CuPy)."""
    names = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            names |= public_names(path.read_text())
    return names


# -- what a notebook defines ------------------------------------------------------

def defined_functions(source):
    """Functions and classes a notebook defines: `def name`, `class Name`, `name = lambda`.
    Methods are left out: a class may implement a protocol (`start_shift`) by name."""
    tree = ast.parse(source)
    methods = {id(f) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
               for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(node) not in methods:
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def imported_packages(source):
    """Top-level packages a notebook imports."""
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def shown_sources(source):
    """What a notebook passes to `inspect.getsource`, as written (e.g. 'ring.ring_forward')."""
    return [ast.unparse(node.args[0]) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("inspect.getsource", "getsource")
            and node.args]


def python_excerpts(source):
    """Lines of every ```python block in a notebook's markdown (percent format: '# ' comments)."""
    excerpts, inside = [], False
    for line in source.splitlines():
        text = line[2:] if line.startswith("# ") else line[1:] if line.startswith("#") else None
        if text is None:
            inside = False
        elif text.strip() == "```python":
            inside = True
        elif text.strip().startswith("```"):
            inside = False
        elif inside and text.strip():
            excerpts.append(text.strip())
    return excerpts


def project_lines():
    """Every line of the project's Python files, stripped."""
    return {line.strip() for package in PACKAGES for path in (ROOT / package).rglob("*.py")
            for line in path.read_text().splitlines()}


# -- tests --------------------------------------------------------------------------

def test_seven_numbered_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06", "07"]


def test_the_checks_catch_a_redefinition():
    # the checker itself: a notebook that re-defines `positions` and `shard` is caught,
    # a protocol method and an unrelated helper are not
    source = ("def positions(s, n, layout):\n    return None\n"
              "shard = lambda x: x\n"
              "class Watched:\n    def start_shift(self, arrays, tag):\n        pass\n"
              "def helper():\n    pass\n")
    assert defined_functions(source) & exported_names() == {"positions", "shard"}
    assert {"positions", "shard", "ring_attention", "Trace", "predict", "forward_tile",
            "ForwardAcc", "finish_forward", "RingComm"} <= exported_names()
    assert public_names("__all__ = ['a']\ndef b(): pass\ndef _c(): pass\nD = 1\n") == {"a", "b", "D"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_defines_no_exported_function(path):
    clash = defined_functions(path.read_text()) & exported_names()
    assert not clash, f"{path.name} re-defines {sorted(clash)}: import them from the project instead"


@pytest.mark.parametrize("path", NOTEBOOKS[:6], ids=lambda p: p.stem)
def test_notebook_shows_the_code_it_teaches(path):
    assert shown_sources(path.read_text()), f"{path.name} never prints a project function's source"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_code_excerpts_are_the_real_code(path):
    lines = project_lines()
    stale = [line for line in python_excerpts(path.read_text()) if line not in lines]
    assert not stale, f"{path.name} quotes code that is not in the project: {stale}"


def test_the_excerpt_checks_catch_a_stale_excerpt():
    notebook = ("# %% [markdown]\n# ```python\n# handle = comm.start_shift(arrays, tag)   "
                "# send to rank+1, receive from rank-1\n# arrays = comm.finish(handle)\n# ```\n"
                "# ```\n# mpiexec -n 4 python\n# ```\n\n# %%\nprint(inspect.getsource(ring.ring_forward))\n")
    excerpt = python_excerpts(notebook)
    assert len(excerpt) == 2 and excerpt[0] in project_lines() and excerpt[1] not in project_lines()
    assert shown_sources(notebook) == ["ring.ring_forward"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_imports_the_project(path):
    assert imported_packages(path.read_text()) & set(PACKAGES), f"{path.name} imports nothing of the project"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_from_a_clean_kernel(path):
    pytest.importorskip("jupytext")
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    nb = runner.execute(path, timeout=CELL_TIMEOUT_S)     # raises CellExecutionError on any error
    n_code = sum(cell.cell_type == "code" for cell in nb.cells)
    assert n_code >= 5
    assert all(cell.get("execution_count") for cell in nb.cells if cell.cell_type == "code")
