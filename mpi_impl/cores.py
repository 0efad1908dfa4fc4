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
The ring's own waits for a block do the same (`wait_any` with ``quiet``) when
its ranks outnumber their machine's cores (`crowded`), and spin otherwise,
where a sleep would only add its latency (BENCHMARKS.md, "Waiting ranks").

    share = rank_share(comm, takes_workers=True)      # Share(cores=2, devices=4, workers=1, blas=1)
    with share.held():
        ...                                           # this rank's work
    wait_quietly(comm)                                # then every rank, without spinning
"""

import os
import time

from reference import cores

SLEEP_S = (0.0, 0.0001, 0.0005, 0.002)     # between tests of the barrier: at once, then longer, up to 2 ms
RING_SLEEP_S = (0.0, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005)     # between tests of a ring transfer: up to 0.5 ms


def ranks_here(comm):
    """How many ranks of `comm` run on this rank's machine (shared memory). Collective."""
    from mpi4py import MPI
    here = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return here.Get_size()
    finally:
        here.Free()


LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")    # the job's ranks here: MPICH's, Open MPI's


def crowded(comm):
    """True when the job's ranks on this rank's machine (as its launcher
    says, else `comm`'s) outnumber the cores this process may use (its
    affinity). Collective where no launcher says."""
    said = next((os.environ[name] for name in LOCAL_SIZE_VARS if os.environ.get(name, "").isdigit()), None)
    here = int(said) if said is not None else ranks_here(comm)
    return here > cores.available_cores()


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
    for pause in _pauses(SLEEP_S):
        if request.Test():
            return
        time.sleep(pause)


def wait_any(requests, *, quiet):
    """The index of a request of `requests` (mpi4py requests) that completed,
    waiting for one: in ``Waitany`` (MPICH spins), or, `quiet`, testing them
    with a short sleep between tests, growing to half a millisecond."""
    first = requests[0]             # its class's Waitany, Testany: mpi4py's, or a stand-in's
    if not quiet:
        return first.Waitany(requests)
    for pause in _pauses(RING_SLEEP_S):
        index, done = first.Testany(requests)
        if done:
            return index
        time.sleep(pause)


def _pauses(pauses):
    yield from pauses
    while True:
        yield pauses[-1]
