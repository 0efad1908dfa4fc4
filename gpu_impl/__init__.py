"""Striped Attention on GPUs: the reference ring with CuPy arrays, one MPI rank per GPU.

The ring loop (`reference.ring`), the block step (`reference.step`) and
mpi_impl's checks and `RingComm` run unchanged with CuPy as the array module;
this package adds what GPUs need.

Modules, in reading order:

- `api`: ``ring_attention`` and ``ring_attention_backward`` on this rank's CuPy
  shards: mpi_impl's, with the GPU's checks and memory object;
- `device`: finding CuPy and a GPU, choosing this rank's GPU by local rank
  before MPI starts, its two streams and the verbs the transfers use;
- `transfer`: where the bytes live: device buffers for a CUDA-aware MPI, or
  pinned host memory with the streams ordered by events (the ring's shifts and
  the schemes' all-to-all);
- `__main__`: the command line, mpi_impl's plus ``--transfer``;
- `steps`: the workshop, the fused CUDA kernels as numbered step versions:
  `steps.fused` (version 1, ``step="fused"``, forward) and `steps.fused_v2`
  (version 2, ``step="fused_v2"``, forward and backward on the tensor cores),
  their sources in steps/kernels/.

    mpiexec -n 4 python -m mpi4py -m gpu_impl --layout all --check

    gpu_impl.use_local_device()                      # before `from mpi4py import MPI`
    out, lse = gpu_impl.ring_attention(q, k, v, comm=MPI.COMM_WORLD, layout="striped",
                                       transfer="auto", step="auto")

Importing this package needs neither CuPy nor a GPU; calling it without them
raises `GpuUnavailable` saying which is missing.
"""

from .api import ring_attention, ring_attention_backward
from .device import GpuUnavailable, require_cupy, use_local_device
from .steps import FusedStep, TensorCoreStep    # importing the kernels registers them with reference.steps
from .transfer import TRANSFERS, choose_transfer, mpi_cuda_support

__all__ = ["ring_attention", "ring_attention_backward", "use_local_device", "GpuUnavailable",
           "require_cupy", "FusedStep", "TensorCoreStep", "TRANSFERS", "choose_transfer", "mpi_cuda_support"]
