"""Many ring calls in one MPI job: memory and communicators must stay flat.

    mpiexec -n 4 python -m mpi4py tests/support/mpi/soak_worker.py CALLS OUT.json

Each rank makes CALLS calls of `mpi_impl.ring_attention` and
`ring_attention_backward` in turn, cycling through every layout and masks on
and off (causal or not, a sliding window, packed documents, dropout, padding:
a length 3 tokens short of the shards'), on small random shards. After one
warm-up cycle it measures, again half-way and at the
end (a leak grows between the last two; caches fill before the first half):
- the duplicated communicators not freed (`RingComm.on` duplicates the
  caller's for every call; the count is kept by a wrapper of COMM_WORLD);
- Python's traced memory (tracemalloc, after a collection: every NumPy buffer
  and Python object still alive) and the resident set (/proc/self/statm).
Every cycle's results must equal the first cycle's, bit for bit (the same
inputs). Rank 0 writes every rank's measurements to OUT.json. MPICH fails at
about the 2,047th call of a job that leaks its duplicates (its context ids run
out), so a long run also catches a leak by failing.
"""

import gc
import json
import os
import sys
import time
import tracemalloc

import numpy as np
from mpi4py import MPI

from mpi_impl import ring_attention, ring_attention_backward

S_PER_RANK, HEADS, HEAD_DIM = 16, 2, 8
LAYOUTS = ("contiguous", "striped", "zigzag")
MASKS = (dict(causal=True), dict(causal=False), dict(window=5), dict(cu_seqlens=None),
         dict(dropout=0.2, seed=3), dict(seq_len=None))


class CountedComm:
    """COMM_WORLD with the duplicates made of it counted until they are freed."""
    open = 0

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Dup(self):
        CountedComm.open += 1
        return _Duplicate(self._comm.Dup())


class _Duplicate:
    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Free(self):
        CountedComm.open -= 1
        self._comm.Free()


def configurations(n):
    """(layout, mask options) of every call of a cycle."""
    S = S_PER_RANK * n
    for layout in LAYOUTS:
        for mask in MASKS:
            if "cu_seqlens" in mask:
                mask = dict(cu_seqlens=[0, S // 3, S // 2, S])
            if "seq_len" in mask:                       # the last 3 tokens are padding
                mask = dict(seq_len=S - 3)
            yield layout, mask


def one_call(comm, rank, layout, mask, inputs):
    q, k, v, dout = inputs
    out, lse = ring_attention(q, k, v, comm=comm, layout=layout, tile_size=4, **mask)
    grads = ring_attention_backward(q, k, v, out, lse, dout, comm=comm, layout=layout, tile_size=4, **mask)
    return (out, lse) + tuple(grads)


def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure():
    gc.collect()            # what is still alive, not what the collector has yet to reach
    return dict(open_communicators=CountedComm.open, traced_bytes=tracemalloc.get_traced_memory()[0],
                resident_bytes=resident_bytes(), time=time.perf_counter())


def main(calls, out_path):
    world = MPI.COMM_WORLD
    comm, rank, n = CountedComm(world), world.Get_rank(), world.Get_size()
    rng = np.random.default_rng(rank)
    inputs = tuple(rng.standard_normal((1, S_PER_RANK, HEADS, HEAD_DIM)) for _ in range(4))
    cycle = list(configurations(n))
    tracemalloc.start()
    first = [one_call(comm, rank, layout, mask, inputs) for layout, mask in cycle]     # the warm-up cycle
    start, middle, done = measure(), None, 2 * len(cycle)
    while done < calls:
        for i, (layout, mask) in enumerate(cycle):
            got = one_call(comm, rank, layout, mask, inputs)
            assert all(np.array_equal(a, b) for a, b in zip(got, first[i])), f"rank {rank}: call {done} differs"
            done += 2
        if middle is None and done >= calls // 2:
            middle = measure()
    end = measure()
    everyone = world.gather(dict(rank=rank, calls=done, start=start, middle=middle or start, end=end), root=0)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(everyone, f)
    print(f"rank {rank}: {done} ring calls, {end['open_communicators']} communicators open", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
