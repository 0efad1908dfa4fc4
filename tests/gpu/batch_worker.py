"""gpu_impl's cases on MPI ranks: tests/mpi/batch_worker.py, the one worker for
mpi_impl and gpu_impl, under the name tests/test_gpu.py launches.

    mpiexec -n N python -m mpi4py tests/gpu/batch_worker.py CASES.json INPUTS.npz RESULTS.npz \
        --device numpy|cupy --transfer staged|cuda-aware [--kernel step|fused] [--managed]
"""

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("batch_worker", Path(__file__).resolve().parents[1] / "mpi" / "batch_worker.py")
_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_worker)

sends_follow_synchronize = _worker.sends_follow_synchronize
main = _worker.main

if __name__ == "__main__":
    main(sys.argv[1:])
