"""A block that arrives while its receiver computes, given progress: 2 ranks, no timing.

    mpiexec -n 2 python -m mpi4py tests/mpi/progress_worker.py

Rank 0 is idle: it posts its shift and waits in finish_shift, inside MPI.
Rank 1 posts its shift and then computes, tile after tile, calling the
RingComm's progress() between tiles as a step does, until its receive has
completed; then it calls finish_shift. The block is 4 MiB (K and V of 2048
tokens, 4 heads of 64, float32), far above the eager threshold of MPICH and
Open MPI, so MPI moves it only inside MPI calls on both ranks: without
progress it could not arrive before rank 1's finish_shift. Rank 1 prints
"arrived during the step" (with the tiles it took), or "did not arrive" if
GIVE_UP_TILES tiles pass first (a bound for the failure, far above the need).
"""

import numpy as np
from mpi4py import MPI

from mpi_impl import RingComm

C, HEADS, D = 2048, 4, 64
GIVE_UP_TILES = 200_000         # about a minute of tiles


def block(rank):
    k = np.full((1, HEADS, C, D), float(rank), np.float32)
    return k, -k, np.arange(C, dtype=np.int64) + C * rank, np.array([rank], dtype=np.int64)


def main():
    with RingComm.on(MPI.COMM_WORLD) as ring:
        assert ring.size == 2, "run on 2 ranks"
        shift = ring.start_shift(block(ring.rank), tag=1)
        if ring.rank == 1:
            a = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
            for tiles in range(1, GIVE_UP_TILES + 1):
                a = np.tanh(a @ a)          # a tile's work
                ring.progress()
                if ring.all_arrived():
                    print(f"rank 1: arrived during the step, after {tiles} tiles", flush=True)
                    break
            else:
                print(f"rank 1: did not arrive during the step ({GIVE_UP_TILES} tiles)", flush=True)
        got = ring.finish_shift(shift)
        assert all(np.array_equal(g, w) for g, w in zip(got, block(1 - ring.rank))), f"rank {ring.rank}: wrong block"
    print(f"rank {ring.rank}: done", flush=True)


if __name__ == "__main__":
    main()
