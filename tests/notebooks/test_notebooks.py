"""The step-through notebooks: each runs from a clean kernel without error, imports
the project, and never re-defines a function or class that the project exports; each
executed copy committed beside it (`notebooks/NN_name.ipynb`, what a reader sees
without running anything) holds exactly its source's cells, executed, small, and
naming no local path.

The notebooks are jupytext percent files (`notebooks/NN_name.py`);
`scripts/run_notebooks.py` turns each into a notebook in memory and executes it in
a fresh `python3` kernel of this interpreter (nbclient). Every claim in a notebook
is an `assert`, so a wrong claim fails here, but for timings: notebooks 5, 6 and
7 print and draw what they measure, and assert only what the run does, never how
long it took.

Notebooks teach with the real code: each of 1 to 6 and 8 prints the source of what it
explains (`inspect.getsource`), and any excerpt typed into a notebook's text as a ```python
block is checked, line by line, against the project's files. Each ends with exercises, one
of which writes code that a `check_...` function of the notebook tests; notebooks/README.md
and the README's table list every notebook.

Run: python -m pytest tests/notebooks/test_notebooks.py -q      (a few minutes on 2 cores; `make
     notebooks` runs the same notebooks and rewrites the executed copies)
"""

import ast
import base64
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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

def test_nine_numbered_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS] == ["00", "01", "02", "03", "04", "05", "06", "07", "08"]


def test_the_readmes_list_every_notebook():
    listing, table = (ROOT / "notebooks" / "README.md").read_text(), (ROOT / "README.md").read_text()
    for path in NOTEBOOKS:
        assert f"`{path.stem}`" in listing, f"notebooks/README.md does not list {path.stem}"
        assert f"| {path.stem.replace('_', ' ')} |" in table, f"README.md's notebook table has no row for {path.stem}"


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


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if "01" <= p.name[:2] <= "06" or p.name[:2] == "08"],
                         ids=lambda p: p.stem)
def test_notebook_shows_the_code_it_teaches(path):
    assert shown_sources(path.read_text()), f"{path.name} never prints a project function's source"


def code_exercise_checks(source):
    """Names of the `check_...` functions a notebook defines and calls on a function it defines
    (its code-writing exercise: the answer's function handed to the check)."""
    tree = ast.parse(source)
    defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    return {node.func.id for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.startswith("check_")
            and node.func.id in defined and any(isinstance(a, ast.Name) and a.id in defined for a in node.args)}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_ends_with_exercises_that_write_code(path):
    source = path.read_text()
    assert "# ## Exercises" in source, f"{path.name} has no exercises"
    exercises = source[source.index("# ## Exercises"):]
    assert "Write it:" in exercises, f"{path.name} has no exercise that writes code"
    assert code_exercise_checks(exercises), f"{path.name}: no check_... cell runs the written code"


def test_the_exercise_check_finds_a_check():
    notebook = ("# ## Exercises\n# 1. Write it: my_f\ndef my_f(x):\n    return x\n"
                "def check_f(fn):\n    assert fn(1) == 1\n    return True\nprint(check_f(my_f))\n")
    assert code_exercise_checks(notebook) == {"check_f"}
    assert code_exercise_checks(notebook.replace("print(check_f(my_f))", "print(check_f(len))")) == set()


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


# -- the executed copies ------------------------------------------------------------

MAX_PICTURE_BYTES = 120_000       # one picture, as stored (base64 decoded)
MAX_COPY_BYTES = 1_000_000        # one executed notebook


def cells(nb):
    """What a notebook says, cell by cell: (type, source)."""
    return [(cell["cell_type"], "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"])
            for cell in nb["cells"]]


def stale_cells(source_nb, copy_nb):
    """Indices of the cells where the executed copy differs from its source (a cell
    added or removed shows as every index from there on)."""
    a, b = cells(source_nb), cells(copy_nb)
    return [i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]]


def pictures(copy_nb):
    return [base64.b64decode(output["data"]["image/png"]) for cell in copy_nb["cells"]
            for output in cell.get("outputs", []) if "image/png" in output.get("data", {})]


def read_copy(path):
    copy = runner.copy_path(path)
    assert copy.exists(), f"{copy.name} is missing: run `make notebooks` and commit it"
    return json.loads(copy.read_text())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executed_copy_is_its_source(path):
    pytest.importorskip("jupytext")
    copy = read_copy(path)
    stale = stale_cells(runner.source_cells(path), copy)
    assert not stale, (f"{runner.copy_path(path).name} no longer matches {path.name} (cells {stale}): "
                       "run `make notebooks` and commit the copies")
    code = [cell for cell in copy["cells"] if cell["cell_type"] == "code"]
    assert all(cell.get("execution_count") for cell in code), "a code cell of the copy was never run"
    assert not [o for cell in code for o in cell.get("outputs", []) if o["output_type"] == "error"]
    assert pictures(copy), f"{runner.copy_path(path).name} shows no picture"


def test_the_copy_check_catches_an_edit():
    source = {"cells": [{"cell_type": "markdown", "source": "# Title"}, {"cell_type": "code", "source": "x = 1"}]}
    same = {"cells": [{"cell_type": "markdown", "source": ["# Title"]}, {"cell_type": "code", "source": ["x = 1"],
                                                                         "outputs": []}]}
    edited = {"cells": [{"cell_type": "markdown", "source": "# Title"}, {"cell_type": "code", "source": "x = 2"}]}
    assert stale_cells(source, same) == []
    assert stale_cells(source, edited) == [1]
    assert stale_cells(source, {"cells": source["cells"][:1]}) == [1]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executed_copy_is_small(path):
    copy = runner.copy_path(path)
    assert copy.stat().st_size < MAX_COPY_BYTES, f"{copy.name}: {copy.stat().st_size} bytes"
    sizes = [len(png) for png in pictures(read_copy(path))]
    assert all(size < MAX_PICTURE_BYTES for size in sizes), f"{copy.name}: pictures of {sizes} bytes"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executed_copy_names_no_local_path(path):
    text = runner.copy_path(path).read_text()
    for local in (str(ROOT), "/tmp/", "/home/", "/root/", "site-packages"):
        assert local not in text, f"{runner.copy_path(path).name} prints a path of this machine: {local}"
