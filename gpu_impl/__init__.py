"""Striped Attention on GPUs: the reference ring with CuPy arrays, one MPI rank per GPU.

The ring loop (`reference.ring`), the block step (`reference.step`) and
mpi_impl's checks and `RingComm` run unchanged with CuPy as the array module;
this package adds what GPUs need: choosing a rank's GPU by local rank before
MPI starts (`device`), where the ring's bytes live, device buffers for a
CUDA-aware MPI or pinned host memory, with the streams ordered by events
(`transfer`), and a fused forward kernel beside the plain step (`fused`,
`kernels/attend_block_v1.cu`).

    mpiexec -n 4 python -m mpi4py -m gpu_impl --layout all --check

    gpu_impl.use_local_device()                      # before `from mpi4py import MPI`
    out, lse = gpu_impl.ring_attention(q, k, v, comm=MPI.COMM_WORLD, layout="striped",
                                       transfer="auto", step="auto")

Importing this package needs neither CuPy nor a GPU; calling it without them
raises `GpuUnavailable` saying which is missing.
"""

from .api import ring_attention, ring_attention_backward
from .device import GpuUnavailable, require_cupy, use_local_device
from .fused import FusedStep            # importing the kernels registers them with reference.steps
from .fused_v2 import TensorCoreStep
from .transfer import TRANSFERS, choose_transfer, mpi_cuda_support

__all__ = ["ring_attention", "ring_attention_backward", "use_local_device", "GpuUnavailable",
           "require_cupy", "FusedStep", "TensorCoreStep", "TRANSFERS", "choose_transfer", "mpi_cuda_support"]
