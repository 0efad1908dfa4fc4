"""The ring's communication object on MPI: one rank's two verbs, start_shift and finish_shift.

`reference.ring` runs one device's rounds against a communication object with
``rank``, ``size``, ``start_shift(arrays, tag) -> handle`` (send a tuple of
arrays to rank+1, receive a same-shaped tuple from rank-1) and
``finish_shift(handle) -> arrays``. `RingComm` implements them with mpi4py's
buffer methods: the upper-case ``Isend`` / ``Irecv`` on the raw bytes of
C-contiguous arrays, so nothing is pickled on the hot path (paper, Algorithm 1:
"send K_k, V_k to the next device while computing").

Hazards it handles:
- a send buffer must stay untouched, and alive, until its send completes: the
  handle keeps a reference and `finish_shift` waits for sends as well as receives;
- a receive buffer must not be one a send may still be reading, nor the block
  the caller still holds: each tag rotates through two receive buffer sets
  (double buffering), and a set is taken only if none of its arrays is in an
  unfinished send and it is not the set `finish_shift` handed out last;
- messages of different kinds (K/V blocks and dK/dV accumulators) are in flight
  at once: each array of a shift has its own MPI tag, ``tag * TAG_STRIDE + index``,
  on a communicator of its own (`RingComm.on` duplicates the caller's), so it
  never matches another kind's or the application's messages;
- a transfer that fails (a neighbour that exited, a message larger than its
  buffer) raises `RingError` naming this rank, the neighbour, the round and
  the transfer, instead of MPI's bare error code. Ranks are those of the
  communicator the ring runs on: on a sub-communicator the message says so
  ("rank 1 of the 3-rank communicator (world rank 2)"). `named_rank` puts the
  rank in front of any other error raised inside the ring.

MPI moves the data only inside MPI calls unless the library has an asynchronous
progress thread; a transfer that did not progress during the step finishes in
`finish_shift`, and the ring's RoundLog counts that as wait time.

Where the bytes live is the `memory` object's business (three verbs, below):
`HostMemory`, the default, hands MPI the arrays as they are (NumPy; or CuPy
with a CUDA-aware MPI, after synchronizing the stream) and receives into arrays
of the same module; `gpu_impl.transfer` adds device buffers ordered with CUDA
events, and staging through pinned host memory. A memory object may also carry
a `clock` for the ring's RoundLog (CUDA events on a GPU), exposed as
``RingComm.clock``.

    mpiexec -n 2 python -m mpi4py -c "from mpi4py import MPI; import numpy as np; \\
        from mpi_impl.comm import RingComm; ring = RingComm(MPI.COMM_WORLD); \\
        print(ring.rank, ring.finish_shift(ring.start_shift((np.full(3, ring.rank),), 1)))"
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

from reference import ring
from reference.layouts import array_module

TAG_STRIDE = 16     # MPI tag = ring tag * TAG_STRIDE + index of the array in the tuple
N_BUFFER_SETS = 2   # receive buffer sets per tag: one arriving, one held by the caller
# what each ring tag carries, for error messages
TRANSFERS = {getattr(ring, "KV", 1): "K/V block", getattr(ring, "DKV", 2): "dK/dV block"}


class RingError(RuntimeError):
    """A transfer of the ring failed; the message names this rank, the
    neighbour, the round and the transfer."""


@dataclass
class Shift:
    """One shift in flight: its requests, what is being sent (kept alive until
    the sends complete) and the buffers the data arrives in."""
    tag: int
    requests: list      # [Irecv of array 0, Isend of array 0, Irecv of array 1, ...]
    sent: tuple
    received: tuple
    round: int = 0      # how many shifts with this tag this RingComm started before this one


@dataclass
class _Pool:
    """Receive buffer sets of one tag, and the one the caller holds."""
    signature: tuple
    sets: list = field(default_factory=list)
    held: int = -1


class RingComm:
    """This rank's end of the ring over an mpi4py communicator."""

    def __init__(self, mpi_comm, memory=None):
        self.comm = mpi_comm
        self.memory = memory or HostMemory()
        self.clock = getattr(self.memory, "clock", None)
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self._pools = {}            # tag -> _Pool
        self._in_flight = []        # Shifts started and not finished
        self._started = {}          # tag -> shifts started: the round, in the ring's loops
        self.buffer_sets_allocated = 0

    @classmethod
    def on(cls, mpi_comm, memory=None):
        """A RingComm on a duplicate of `mpi_comm` (collective), so that ring
        messages never meet the caller's. Release it with `free()`."""
        return cls(mpi_comm.Dup(), memory)

    def free(self):
        self.comm.Free()

    def start_shift(self, arrays, tag):
        """Post the receive of the previous rank's arrays and the send of
        `arrays` to the next rank. `arrays` must not be written until
        `finish_shift` returns."""
        arrays = tuple(arrays)
        outgoing = self.memory.outgoing(arrays, tag)       # what MPI reads: ready, on the host or device
        received = self._take_receive_buffers(arrays, tag)
        shift = Shift(tag, [], outgoing, received, round=self._started.get(tag, 0))
        self._started[tag] = shift.round + 1
        for i, (out, into) in enumerate(zip(outgoing, received)):
            mpi_tag, out_bytes, into_bytes = tag * TAG_STRIDE + i, byte_view(out), byte_view(into)
            # receive first, so a matching send never waits in an unexpected-message queue;
            # uint8 views carry their MPI type (bytes) themselves, so this module needs
            # no mpi4py import and runs on the tests' stand-in communicators too
            with self._naming_failure(shift, 2 * i):
                shift.requests.append(self.comm.Irecv(into_bytes, source=self.prev, tag=mpi_tag))
            with self._naming_failure(shift, 2 * i + 1):
                shift.requests.append(self.comm.Isend(out_bytes, dest=self.next, tag=mpi_tag))
        self._in_flight.append(shift)
        return shift

    def finish_shift(self, shift):
        """Wait for the shift's sends and receives; return the arrays that arrived.
        They stay valid until the second `start_shift` after this one with the same tag."""
        # One request at a time (the same as a Waitall: every one must complete),
        # so that a failure is pinned on its transfer.
        for index, request in enumerate(shift.requests):
            with self._naming_failure(shift, index):
                request.Wait()
        self._in_flight.remove(shift)
        pool = self._pools[shift.tag]
        pool.held = next(i for i, s in enumerate(pool.sets) if s is shift.received)
        return self.memory.arrived(shift.received, shift.tag)

    @contextmanager
    def _naming_failure(self, shift, index):
        """Turn an MPI error of request `index` of `shift` into a RingError that
        says who failed to move what, in which round."""
        try:
            yield
        except Exception as e:      # noqa: BLE001 - mpi4py.MPI.Exception, re-raised with names
            receiving, array = index % 2 == 0, index // 2
            peer = rank_name(self.comm, self.prev if receiving else self.next)
            what = TRANSFERS.get(shift.tag, f"tag {shift.tag} message")
            raise RingError(
                f"{rank_name(self.comm)}: round {shift.round}: "
                f"{'receiving' if receiving else 'sending'} the {what} (array {array} of {len(shift.sent)}) "
                f"{'from' if receiving else 'to'} {peer} failed: "
                f"{'MPI error' if type(e).__module__.startswith('mpi4py') else type(e).__name__}: {e}") from e

    def _take_receive_buffers(self, arrays, tag):
        """A free receive buffer set shaped like `arrays` (see the module's hazards)."""
        signature = tuple((a.shape, a.dtype) for a in arrays)
        pool = self._pools.get(tag)
        if pool is None or pool.signature != signature:
            pool = self._pools[tag] = _Pool(signature)
        busy = {_address(a) for s in self._in_flight for a in s.sent + s.received}
        busy |= {_address(a) for a in arrays}
        for i, buffers in enumerate(pool.sets):
            if i != pool.held and not busy & {_address(b) for b in buffers}:
                return buffers
        if len(pool.sets) >= N_BUFFER_SETS:
            # the ring never gets here; another caller holding buffers longer does
            raise RuntimeError(f"tag {tag}: all {N_BUFFER_SETS} receive buffer sets are busy; "
                               "finish a shift before starting the next one")
        buffers = tuple(self.memory.receive_like(a) for a in arrays)
        pool.sets.append(buffers)
        self.buffer_sets_allocated += 1
        return buffers


class HostMemory:
    """MPI reads and writes the arrays themselves: receive buffers are new
    arrays of each array's own module. The three verbs a memory object has:

        outgoing(arrays, tag) -> what MPI sends (the same arrays here, made ready)
        receive_like(a)       -> a buffer MPI may write a twin of `a` into
        arrived(received, tag) -> what `finish_shift` hands the caller
    """
    clock = None

    def outgoing(self, arrays, tag):
        _ready_for_mpi(arrays)
        return arrays

    def receive_like(self, a):
        return array_module(a).empty(a.shape, dtype=a.dtype)

    def arrived(self, received, tag):
        return received


def _address(a):
    """Start of an array's memory (host or device)."""
    if hasattr(a, "__cuda_array_interface__"):
        return ("cuda", a.__cuda_array_interface__["data"][0])
    return ("host", a.__array_interface__["data"][0])


def byte_view(a):
    """The bytes of a C-contiguous array, as a view: MPI must read and write
    the array itself, never a copy."""
    if not a.flags.c_contiguous:
        raise ValueError(f"ring buffers must be C-contiguous, got an array of shape {a.shape} "
                         f"with strides {a.strides}")
    return a.reshape(-1).view("uint8")


def _ready_for_mpi(arrays):
    """Always make sure a GPU buffer is ready before any MPI operation: MPI
    knows nothing of CUDA streams, so kernels writing `arrays`, or still reading
    a receive buffer about to be reused, must have finished."""
    for a in arrays:
        xp = array_module(a)
        if xp.__name__ == "cupy":
            xp.cuda.get_current_stream().synchronize()
            return


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
