"""A block that arrives while its receiver computes, given progress: 2 ranks, no timing.

    mpiexec -n 2 python -m mpi4py tests/support/mpi/progress_worker.py

Both ranks run `reference.ring.ring_forward` on a `RingComm`, with a step that
computes version 1's tiles and then, on rank 1 only, goes on computing tiles
of busy work, calling the `progress` the ring handed it between them, until
its receive has completed. Rank 0's step returns at once, so rank 0 waits in
finish_shift, inside MPI. The block is 4 MiB (K and V of 2048 tokens, 4
heads of 64, float32), far above the eager threshold of MPICH and Open MPI,
so MPI moves it only inside MPI calls on both ranks: unless the ring hands
the step the communication object's progress, it cannot arrive before rank
1's step ends. Rank 1 prints "arrived during the step" (with the tiles it
took), or "did not arrive" if GIVE_UP_TILES tiles pass first (a bound for the
failure, far above the need).
"""

import numpy as np
from mpi4py import MPI

from mpi_impl import RingComm
from reference import ring
from reference.masks import as_mask
from reference.step import ReadableStep

C, HEADS, D = 2048, 4, 64
GIVE_UP_TILES = 200_000         # about a minute of tiles


class BusyUntilArrived(ReadableStep):
    """Version 1, then (rank 1, while a receive is in flight) busy tiles with
    the ring's `progress` between them until the block is there."""

    def __init__(self, ring_comm):
        self.ring_comm, self.tiles = ring_comm, None

    def forward_tiles(self, acc, queries, block, plan, progress):
        super().forward_tiles(acc, queries, block, plan, progress)
        if self.ring_comm.rank != 1 or self.tiles is not None:
            return
        a = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
        for tiles in range(1, GIVE_UP_TILES + 1):
            a = np.tanh(a @ a)          # a tile's work
            progress()
            if self.ring_comm.all_arrived():
                self.tiles = tiles
                return
        self.tiles = 0


def main():
    with RingComm.on(MPI.COMM_WORLD) as ring_comm:
        assert ring_comm.size == 2, "run on 2 ranks"
        rank = ring_comm.rank
        rng = np.random.default_rng(rank)
        q, k, v = (rng.standard_normal((1, C, HEADS, D)).astype(np.float32) for _ in range(3))
        pos = np.arange(C, dtype=np.int64) + C * rank
        step = BusyUntilArrived(ring_comm)
        ring.ring_forward(q, k, v, pos, pos, ring_comm, scale=D ** -0.5, tile_size=1024, step=step,
                          mask=as_mask(False))
        if rank == 1:
            print(f"rank 1: arrived during the step, after {step.tiles} tiles" if step.tiles
                  else f"rank 1: did not arrive during the step ({GIVE_UP_TILES} tiles)", flush=True)
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
