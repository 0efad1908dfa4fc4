"""Execute the step-through notebooks from a clean kernel, and write them as .ipynb.

The notebooks are kept as jupytext percent files, `notebooks/NN_name.py`: plain Python
with `# %%` cell markers, reviewable as text. This script turns each into a notebook
in memory, runs it in a fresh `python3` kernel of this interpreter (nbclient), and
stops at the first cell that raises. With `--write` it saves the executed notebook,
outputs and pictures included, beside the source as `notebooks/NN_name.ipynb` (not
committed; open it in Jupyter).

    python scripts/run_notebooks.py                      # run all seven
    python scripts/run_notebooks.py --write              # run all, save executed .ipynb
    python scripts/run_notebooks.py notebooks/03_the_ring.py
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CELL_TIMEOUT_S = 120


def notebook_paths():
    """The numbered notebooks, in reading order."""
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def execute(path, *, timeout=CELL_TIMEOUT_S):
    """Run the percent file `path` in a fresh kernel, in its own folder (as Jupyter
    would); return the executed notebook. Raises nbclient's CellExecutionError on
    the first failing cell."""
    import jupytext
    from nbclient import NotebookClient
    from traitlets.config import Config

    path = Path(path)
    nb = jupytext.read(path)
    # "python3" resolves to ipykernel's spec for this interpreter (sys.executable),
    # so the kernel sees the same packages as this script. The kernel talks over
    # local sockets in a temporary folder, not TCP (whose kernels warn, unencrypted).
    with tempfile.TemporaryDirectory(prefix="kernel_") as sockets:
        ipc = Config({"KernelManager": {"transport": "ipc", "ip": str(Path(sockets) / "kernel")}})
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", config=ipc,
                                resources={"metadata": {"path": str(path.parent)}})
        client.execute()
    return nb


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", type=Path, help="notebooks to run (default: all)")
    ap.add_argument("--write", action="store_true", help="save each executed notebook as .ipynb beside it")
    ap.add_argument("--timeout", type=int, default=CELL_TIMEOUT_S, help="seconds per cell (default %(default)s)")
    args = ap.parse_args(argv)
    import jupytext

    total = time.perf_counter()
    for path in args.paths or notebook_paths():
        start = time.perf_counter()
        nb = execute(path, timeout=args.timeout)
        if args.write:
            jupytext.write(nb, path.with_suffix(".ipynb"))
        print(f"{path.name:<40} ok  {time.perf_counter() - start:5.1f} s", flush=True)
    print(f"{'all':<40} ok  {time.perf_counter() - total:5.1f} s")


if __name__ == "__main__":
    sys.exit(main())
