"""Where a ring's bytes live: the memory objects `mpi_impl.comm.RingComm` takes, and the host's.

A memory object has four verbs (`HostMemory` below is the default; `gpu_impl.transfer`
adds device buffers ordered with CUDA events, and staging through pinned host memory):

    buffer_set(like) -> BufferSet  for arrays shaped like `like` (called in start_shift)
    outgoing(arrays, buffers) -> what MPI sends (once `ready`)
    ready(buffers) -> True once MPI may read what `outgoing` gave and write `buffers.receive`
                      (asked without waiting: RingComm posts the transfer then)
    arrived(buffers) -> what `finish_shift` hands the caller

A ring tag's `Lane` holds its buffer sets, used in turn (double buffering).
"""

from dataclasses import dataclass, field

from reference.layouts import array_module


@dataclass(eq=False)
class BufferSet:
    """One of a tag's buffer sets (the memory object allocates it)."""
    receive: tuple      # what MPI writes the arriving arrays into
    handed: tuple       # what finish_shift hands the caller: `receive` itself, or device copies of it
    staged: tuple       # where the memory object stages what MPI sends (None: MPI reads the caller's array)
    mark: object = None     # the memory object's own: e.g. an event when the set was taken
    ready: object = None    # the memory object's own: e.g. an event after the copies MPI will read


N_BUFFER_SETS = 2   # buffer sets per tag: one arriving, one held by the caller


@dataclass
class Lane:
    """One ring tag: its buffer sets (used in turn), shifts started, the one in flight."""
    signature: tuple = None
    sets: list = field(default_factory=list)
    turn: int = 0
    started: int = 0
    in_flight: object = None

    def next_set(self, arrays, memory):
        """(the next buffer set shaped like `arrays`, whether it is new): a set
        is allocated at first use; the sets start again when the shapes change."""
        signature = tuple((a.shape, str(a.dtype), array_module(a).__name__) for a in arrays)
        if signature != self.signature:
            self.signature, self.sets, self.turn = signature, [], 0
        new = len(self.sets) < N_BUFFER_SETS
        if new:
            self.sets.append(memory.buffer_set(arrays))
        buffers = self.sets[self.turn]
        self.turn = (self.turn + 1) % N_BUFFER_SETS
        return buffers, new


class HostMemory:
    """MPI reads and writes the arrays themselves: receive buffers are new
    arrays of each array's own module. The four verbs a memory object has:

        buffer_set(like) -> BufferSet  for arrays shaped like `like` (called
                                       in start_shift, before the step runs)
        outgoing(arrays, buffers) -> what MPI sends (the same arrays here, made ready)
        ready(buffers) -> whether MPI may use the buffers now (here always)
        arrived(buffers) -> what `finish_shift` hands the caller
    """
    clock = None

    def buffer_set(self, like):
        received = tuple(array_module(a).empty(a.shape, dtype=a.dtype) for a in like)
        return BufferSet(received, received, (None,) * len(like))

    def outgoing(self, arrays, buffers):
        ready_for_mpi(arrays)
        return arrays

    def ready(self, buffers):
        return True

    def arrived(self, buffers):
        return buffers.receive


def span(a):
    """(memory space, first byte, end) of a C-contiguous array, host or device."""
    if hasattr(a, "__cuda_array_interface__"):
        start, space = a.__cuda_array_interface__["data"][0], "cuda"
    else:
        start, space = a.__array_interface__["data"][0], "host"
    return space, start, start + a.nbytes


def overlap(a, b):
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def overlaps_any(a, arrays):
    """Whether array `a` shares a byte with any of `arrays` (None entries skipped)."""
    return any(overlap(span(a), span(b)) for b in arrays if b is not None)


def byte_view(a):
    """The bytes of a C-contiguous array, as a view: MPI must read and write
    the array itself, never a copy."""
    if not a.flags.c_contiguous:
        raise ValueError(f"ring buffers must be C-contiguous, got an array of shape {a.shape} "
                         f"with strides {a.strides}")
    return a.reshape(-1).view("uint8")


def ready_for_mpi(arrays):
    """Always make sure a GPU buffer is ready before any MPI operation: MPI
    knows nothing of CUDA streams, so kernels writing `arrays`, or still reading
    a receive buffer about to be reused, must have finished."""
    for a in arrays:
        xp = array_module(a)
        if xp.__name__ == "cupy":
            xp.cuda.get_current_stream().synchronize()
            return
