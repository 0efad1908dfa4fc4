"""How ranks on one machine share its cores: each rank's share, and waiting without taking a core.

Every rank of a job is a process with its own BLAS, and the ranks on one
machine share its cores: each holds BLAS (and a step's workers) to its share,
``cores // ranks on this machine`` (`reference.cores.share`), inside whatever
outer limit the rank was started with (OPENBLAS_NUM_THREADS=1 is one core).

A rank that waits in a blocking MPI call takes a core while it waits: MPICH
busy-polls (``sched_yield``, thousands of calls a second). With more ranks
than cores, ranks waiting for one rank's long work (rank 0's --check
reference, its table and plot) took the cores from it: the demo spent most
of its time there. `wait_quietly` waits in a nonblocking barrier tested with
a short sleep instead, so a waiting rank leaves the cores to the one that works.

    share = rank_share(comm, takes_workers=True)      # Share(cores=2, devices=4, workers=1, blas=1)
    with share.held():
        ...                                           # this rank's work
    wait_quietly(comm)                                # then every rank, without spinning
"""

import time

from reference import cores

SLEEP_S = (0.0, 0.0001, 0.0005, 0.002)     # between tests of the barrier: at once, then longer, up to 2 ms


def ranks_here(comm):
    """How many ranks of `comm` run on this rank's machine (shared memory). Collective."""
    from mpi4py import MPI
    here = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return here.Get_size()
    finally:
        here.Free()


def rank_share(comm, *, takes_workers=True, threads=None, blas_threads=None):
    """This rank's `reference.cores.Share` of its machine: the machine's
    budget dealt over the ranks on it (`threads`, `blas_threads` choose
    otherwise, within it). Collective."""
    return cores.share(ranks_here(comm), takes_workers=takes_workers, threads=threads, blas_threads=blas_threads)


def wait_quietly(comm):
    """Return when every rank of `comm` has called it, sleeping between tests
    of a nonblocking barrier instead of spinning in a blocking one (module
    docstring); a stand-in communicator without ``Ibarrier`` (or a rank alone)
    returns at once and waits in its next collective. Collective."""
    if comm.Get_size() == 1 or not hasattr(comm, "Ibarrier"):
        return
    request = comm.Ibarrier()
    for pause in _pauses():
        if request.Test():
            return
        time.sleep(pause)


def _pauses():
    yield from SLEEP_S
    while True:
        yield SLEEP_S[-1]
