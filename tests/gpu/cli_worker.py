"""gpu_impl's command line on a GPU made of NumPy whose streams run later: everything but CUDA.

    mpiexec -n 3 python -m mpi4py tests/gpu/cli_worker.py --seq-len 48 --layout all --check

Each rank gets a `QueuedDevice` (tests/gpu/queued_device.py; even local ranks run
copies early, odd ones kernels early) in place of its GPU, and the fused step's
launch runs the readable step in the kernel's place (CUDA cannot run on NumPy);
then `gpu_impl.__main__.main` runs with these arguments: its option handling,
transfer choice (auto asks the real MPI library), mpi_impl's table and --check.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from queued_device import POLICIES, QueuedDevice  # noqa: E402

import gpu_impl.__main__  # noqa: E402
from gpu_impl import api, fused  # noqa: E402
from gpu_impl.device import local_rank_from_env  # noqa: E402
from reference.step import ReadableStep  # noqa: E402


def stand_in_for_the_kernel(acc, queries, block, tile, causal):
    ReadableStep().forward(acc, queries, block, causal=causal, tile_size=tile)


if __name__ == "__main__":
    gpu = QueuedDevice(POLICIES[(local_rank_from_env() or 0) % 2])
    with gpu.installed():
        api.CupyDevice = lambda cupy, index: gpu
        fused.launch_kernel = stand_in_for_the_kernel
        sys.exit(gpu_impl.__main__.main(sys.argv[1:]))
