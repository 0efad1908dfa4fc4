"""RingComm's buffers on a ring of N ranks, checked shift by shift; exits non-zero on failure.

    mpiexec -n 3 python -m mpi4py tests/support/mpi/comm_worker.py

Each rank passes a block around the ring as `reference.ring` does (the block
that arrives is the next one sent) for more rounds than there are ranks, and
checks: the data is the block of rank ``(rank - t) mod N``; a receive buffer is
never an array being sent, nor the block the caller holds; receive buffers
rotate between exactly two sets; a non-contiguous array is refused.
"""

import numpy as np
from mpi4py import MPI

from mpi_impl import RingComm

ROUNDS = 7


def block_of(rank):
    return np.full((2, 3), float(rank)), np.array([rank], dtype=np.int64)


def main():
    ring = RingComm.on(MPI.COMM_WORLD)
    n, block, seen = ring.size, block_of(ring.rank), []
    for t in range(1, ROUNDS + 1):
        shift = ring.start_shift(block, tag=1)
        assert not any(np.shares_memory(r, b) for r in shift.buffers.receive for b in block), \
            f"rank {ring.rank} round {t}: receiving into a buffer being sent"
        arrived = ring.finish_shift(shift)
        expected = block_of((ring.rank - t) % n)
        assert all(np.array_equal(a, e) for a, e in zip(arrived, expected)), \
            f"rank {ring.rank} round {t}: got {arrived}, expected {expected}"
        seen.append(arrived[0].__array_interface__["data"][0])
        block = arrived
    assert ring.buffer_sets_allocated == 2, ring.buffer_sets_allocated
    assert len(set(seen)) == 2 and all(seen[i] != seen[i + 1] for i in range(len(seen) - 1)), seen
    try:
        ring.start_shift((np.zeros((4, 4))[:, ::2],), tag=2)
    except ValueError as e:
        assert "C-contiguous" in str(e), e
    else:
        raise AssertionError("a non-contiguous buffer was accepted")
    ring.close()
    print(f"rank {ring.rank}: buffers ok", flush=True)


if __name__ == "__main__":
    main()
