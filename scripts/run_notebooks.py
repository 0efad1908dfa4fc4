"""Execute the step-through notebooks from a clean kernel, and write their executed copies.

The notebooks are written as jupytext percent files, `notebooks/NN_name.py`: plain
Python with `# %%` cell markers, reviewable as text. This script turns each into a
notebook in memory, runs it in a fresh `python3` kernel of this interpreter
(nbclient), and stops at the first cell that raises. With `--write` it saves the
executed notebook, outputs and pictures included, beside the source as
`notebooks/NN_name.ipynb`: the copies committed to the repository, so that a reader
sees every picture without running anything (`tests/notebooks/test_notebooks.py` fails when a
copy's cells are no longer its source's).

    python scripts/run_notebooks.py                      # run all, report wall and CPU time
    python scripts/run_notebooks.py --write              # run all, save the executed copies
    python scripts/run_notebooks.py --timings notebooks/03_the_ring.py   # and its slowest cells
"""

import argparse
import base64
import io
import os
import resource
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CELL_TIMEOUT_S = 120
PNG = "image/png"
# The kernels compute with one BLAS thread: the notebooks' arrays are small, and where
# the cores are busy (tests run beside other work) several BLAS threads spin, waiting for
# each other, and a cell takes ten times as long. (Notebooks 6 and 7 give their MPI ranks
# one thread each themselves.)
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def notebook_paths():
    """The numbered notebooks, in reading order."""
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def copy_path(path):
    """Where the executed copy of the percent file `path` lives."""
    return Path(path).with_suffix(".ipynb")


def source_cells(path):
    """The percent file `path` as a notebook, with cell ids numbered in order (jupytext
    draws random ones), so that an executed copy changes only where its source or its
    outputs do."""
    import jupytext
    nb = jupytext.read(path)
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:03d}"
    return nb


def execute(path, *, timeout=CELL_TIMEOUT_S):
    """Run the percent file `path` in a fresh kernel, in its own folder (as Jupyter
    would); return the executed notebook. Raises nbclient's CellExecutionError on
    the first failing cell."""
    from nbclient import NotebookClient
    from traitlets.config import Config

    path = Path(path)
    nb = source_cells(path)
    # "python3" resolves to ipykernel's spec for this interpreter (sys.executable),
    # so the kernel sees the same packages as this script. The kernel talks over
    # local sockets in a temporary folder, not TCP (whose kernels warn, unencrypted).
    with tempfile.TemporaryDirectory(prefix="kernel_") as sockets:
        ipc = Config({"KernelManager": {"transport": "ipc", "ip": str(Path(sockets) / "kernel")}})
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", config=ipc,
                                resources={"metadata": {"path": str(path.parent)}})
        client.execute(env=dict(os.environ, **ONE_THREAD))
    return nb


def cell_seconds(nb):
    """[(seconds, first line), ...] of each executed code cell, from nbclient's timestamps."""
    out = []
    for cell in nb.cells:
        stamps = cell.metadata.get("execution", {})
        if "iopub.execute_input" in stamps and "shell.execute_reply" in stamps:
            start, end = (datetime.fromisoformat(stamps[k].replace("Z", "+00:00"))
                          for k in ("iopub.execute_input", "shell.execute_reply"))
            first = next((line for line in cell.source.splitlines() if line.strip()), "")
            out.append(((end - start).total_seconds(), first))
    return out


def small_png(data):
    """A PNG (base64) re-encoded with a palette of 256 colours (plots have few; a
    colour map's gradient loses nothing one can see), or left as it is if smaller."""
    from PIL import Image
    raw = base64.b64decode(data)
    rgb = Image.open(io.BytesIO(raw)).convert("RGB")
    buffer = io.BytesIO()
    rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        buffer, format="PNG", optimize=True)
    return base64.b64encode(min(raw, buffer.getvalue(), key=len)).decode("ascii")


def for_the_repository(nb):
    """The executed notebook as committed: nbclient's timestamps dropped (they would
    change every copy on every run) and pictures re-encoded small."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        for output in cell.get("outputs", []):
            if PNG in output.get("data", {}):
                output["data"][PNG] = small_png(output["data"][PNG])
    return nb


def write_copy(nb, path):
    import nbformat
    nbformat.write(for_the_repository(nb), copy_path(path))


def children_cpu_s():
    """CPU seconds of every finished child process (the kernels, and what they launched)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python scripts/run_notebooks.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", type=Path, help="notebooks to run (default: all)")
    ap.add_argument("--write", action="store_true", help="save each executed notebook as .ipynb beside it")
    ap.add_argument("--timings", action="store_true", help="print each notebook's three slowest cells")
    ap.add_argument("--timeout", type=int, default=CELL_TIMEOUT_S, help="seconds per cell (default %(default)s)")
    args = ap.parse_args(argv)

    total, total_cpu = time.perf_counter(), children_cpu_s()
    print(f"{'notebook':<40} {'wall':>7} {'CPU':>7}  (CPU: the kernel and every process it started)")
    for path in args.paths or notebook_paths():
        start, cpu = time.perf_counter(), children_cpu_s()
        nb = execute(path, timeout=args.timeout)
        wall = time.perf_counter() - start
        print(f"{path.name:<40} {wall:6.1f}s {children_cpu_s() - cpu:6.1f}s", flush=True)
        if args.timings:
            for seconds, first in sorted(cell_seconds(nb), reverse=True)[:3]:
                print(f"    {seconds:6.1f}s  {first[:70]}")
        if args.write:
            write_copy(nb, path)
    print(f"{'all':<40} {time.perf_counter() - total:6.1f}s {children_cpu_s() - total_cpu:6.1f}s")
    if args.write:
        print(f"executed copies written beside their sources in {NOTEBOOKS}: NN_name.ipynb for each NN_name.py "
              "(git diff notebooks/ shows what changed)")


if __name__ == "__main__":
    sys.exit(main())
