"""Finding the launcher: the `mpiexec` that starts the ranks, found one way everywhere.

    from mpi_impl.launch import find_mpiexec
    subprocess.run([find_mpiexec(), "-n", "4", sys.executable, "-m", "mpi4py", "-m", "mpi_impl", "--check"])

The mpich wheel (``pip install mpi4py mpich``, the Makefile's venv) puts its
mpiexec beside the Python it is installed into, which is the MPI mpi4py was
built against; a system MPI puts one on PATH. The one beside Python comes
first, so that the launcher and the library agree. Importing this module
needs no MPI (benchmarks, tests and notebooks launch jobs from a process
that never starts MPI itself).
"""

import shutil
import sys
from pathlib import Path

# Open MPI refuses to run as root, and to start more ranks than cores, unless told
# (the Makefile sets the same for MPI=openmpi); MPICH ignores these variables.
OPEN_MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


def find_mpiexec(python=None, given=None):
    """The mpiexec to launch ranks with, or None if there is none: `given` (a
    path or a name on PATH) if set, else the one beside `python` (default: this
    Python), else the one on PATH."""
    if given:
        return str(given) if Path(given).exists() or shutil.which(str(given)) else None
    beside = Path(python or sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")
