"""Faults that must end an MPI job quickly, with a clear message and a non-zero exit.

    mpiexec -n 3 python tests/mpi/fault_worker.py shapes         # ranks disagree on q's shape
    mpiexec -n 3 python tests/mpi/fault_worker.py bad-input      # one rank's input is invalid
    mpiexec -n 3 python -m mpi4py tests/mpi/fault_worker.py raise   # rank 1 fails in round 0

The first two run without ``-m mpi4py`` on purpose: the agreement check alone
must make every rank raise (no rank is left waiting in a collective). The third
needs ``-m mpi4py``: a failure in the middle of the ring leaves rank 2 waiting
for rank 0's block, which rank 1 never passes on, and only MPI_Abort ends it.
"""

import sys

import numpy as np
from mpi4py import MPI

from mpi_impl import ring_attention
from reference.step import ReadableStep

FAILING_RANK = 1


def inputs(c, hq=2, hkv=2):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((1, c, h, 4)) for h in (hq, hkv, hkv))


class FailingStep(ReadableStep):
    """The readable step, raising in the given round on this rank (the other ranks wait for it)."""

    def __init__(self, round_to_fail=0):
        self.round_to_fail, self.calls = round_to_fail, 0

    def forward_tiles(self, *args):
        self.calls += 1
        if self.calls > self.round_to_fail:
            raise RuntimeError(f"injected failure on rank {FAILING_RANK} in round {self.round_to_fail}")
        return super().forward_tiles(*args)


def main(mode):
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    c = 4
    if mode == "shapes" and rank == FAILING_RANK:
        c = 5                                   # one token more than the others
    q, k, v = inputs(c, hq=3 if mode == "bad-input" and rank == FAILING_RANK else 2)
    step = FailingStep() if mode == "raise" and rank == FAILING_RANK else "v1"
    ring_attention(q, k, v, comm=comm, layout="contiguous", tile_size=2, step=step)
    print(f"rank {rank}: finished without error", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
