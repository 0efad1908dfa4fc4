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
  never matches another kind's or the application's messages.

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

from dataclasses import dataclass, field

from reference.layouts import array_module

TAG_STRIDE = 16     # MPI tag = ring tag * TAG_STRIDE + index of the array in the tuple
N_BUFFER_SETS = 2   # receive buffer sets per tag: one arriving, one held by the caller


@dataclass
class Shift:
    """One shift in flight: its requests, what is being sent (kept alive until
    the sends complete) and the buffers the data arrives in."""
    tag: int
    requests: list
    sent: tuple
    received: tuple


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
        from mpi4py import MPI
        arrays = tuple(arrays)
        outgoing = self.memory.outgoing(arrays, tag)       # what MPI reads: ready, on the host or device
        received = self._take_receive_buffers(arrays, tag)
        requests = []
        for i, (out, into) in enumerate(zip(outgoing, received)):
            mpi_tag = tag * TAG_STRIDE + i
            # receive first, so a matching send never waits in an unexpected-message queue
            requests.append(self.comm.Irecv([byte_view(into), MPI.BYTE], source=self.prev, tag=mpi_tag))
            requests.append(self.comm.Isend([byte_view(out), MPI.BYTE], dest=self.next, tag=mpi_tag))
        shift = Shift(tag, requests, outgoing, received)
        self._in_flight.append(shift)
        return shift

    def finish_shift(self, shift):
        """Wait for the shift's sends and receives; return the arrays that arrived.
        They stay valid until the second `start_shift` after this one with the same tag."""
        from mpi4py import MPI
        MPI.Request.Waitall(shift.requests)
        self._in_flight.remove(shift)
        pool = self._pools[shift.tag]
        pool.held = next(i for i, s in enumerate(pool.sets) if s is shift.received)
        return self.memory.arrived(shift.received, shift.tag)

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
