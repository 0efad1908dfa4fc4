"""How errors name ranks: 'rank 1', or 'rank 1 of the 3-rank communicator (world rank 2)'.

MPI numbers ranks per communicator, so a message about a sub-communicator's
rank says which world rank it is; `named_rank` puts the rank's name in front of
any error raised inside it (the launcher's line naming the failed rank is
sometimes lost), and a failed transfer raises `RingError`, naming this rank,
the neighbour, the round and the transfer. `abort_job` ends the whole job
from a rank that failed, saying which.
"""

import sys
from contextlib import contextmanager


class RingError(RuntimeError):
    """A transfer of the ring failed; the message names this rank, the
    neighbour, the round and the transfer."""


def rank_name(mpi_comm, rank=None):
    """'rank 1' on the world communicator (or a duplicate of it); on a smaller
    one 'rank 1 of the 3-rank communicator (world rank 2)', since MPI numbers
    ranks per communicator. `rank` defaults to the caller's."""
    rank = mpi_comm.Get_rank() if rank is None else rank
    world = _world_rank(mpi_comm, rank)
    if world is None or (world == rank and mpi_comm.Get_size() == _world_size()):
        return f"rank {rank}"
    return f"rank {rank} of the {mpi_comm.Get_size()}-rank communicator (world rank {world})"


def communicator_name(mpi_comm):
    """'' on the world communicator, ' of the 3-rank communicator' on a smaller one."""
    name = rank_name(mpi_comm, 0)
    return f" of the {mpi_comm.Get_size()}-rank communicator" if " of the " in name else ""


def _world_rank(mpi_comm, rank):
    """`rank` of `mpi_comm` as a rank of MPI.COMM_WORLD, or None for a communicator
    that is not mpi4py's (the tests' stand-ins)."""
    if not type(mpi_comm).__module__.startswith("mpi4py"):    # and never import (initialize) MPI for one
        return None
    from mpi4py import MPI
    group, world = mpi_comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return MPI.Group.Translate_ranks(group, [rank], world)[0]
    finally:
        group.Free()
        world.Free()


def _world_size():
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_size()


@contextmanager
def named_rank(mpi_comm):
    """An exception raised inside carries this rank's name at the start of its
    message (the launcher's line naming the failed rank is sometimes lost),
    keeping its type and traceback."""
    try:
        yield
    except Exception as e:
        name = rank_name(mpi_comm)
        if not isinstance(e, RingError) and not str(e).startswith(name):
            if len(e.args) == 1 and isinstance(e.args[0], str):
                e.args = (f"{name}: {e.args[0]}",)
            if not str(e).startswith(name) and hasattr(e, "add_note"):   # a message built otherwise
                e.add_note(f"raised on {name}")
        raise


@contextmanager
def naming_failure(mpi_comm, peer, doing, said=None):
    """Turn an error of one transfer with neighbour `peer` into a RingError
    that says who failed to move what (`doing`: "round 2: receiving the K/V
    block (array 0 of 2) from"), and why; `said(peer)`: why that neighbour
    left, if it said."""
    from .notices import NeighbourLeft
    try:
        yield
    except Exception as e:      # noqa: BLE001 - mpi4py.MPI.Exception, re-raised with names
        if isinstance(e, NeighbourLeft):
            why = f"{rank_name(mpi_comm, peer)} left the ring ({e})"
        else:
            kind = "MPI error" if type(e).__module__.startswith("mpi4py") else type(e).__name__
            why = f"{kind}: {e}"
            reason = said(peer) if said is not None else None
            if reason is not None:
                why = f"{rank_name(mpi_comm, peer)} left the ring ({reason}); {why}"
        raise RingError(f"{rank_name(mpi_comm)}: {doing} {rank_name(mpi_comm, peer)} failed: {why}") from e


def abort_job(comm):
    """End every rank because this one failed, saying which rank and why. Run
    without ``-m mpi4py``, the other ranks would otherwise wait for it forever."""
    import traceback
    print(f"{rank_name(comm)} of {comm.Get_size()} failed; ending the job:", file=sys.stderr)
    traceback.print_exc()
    sys.stderr.flush()
    comm.Abort(1)
