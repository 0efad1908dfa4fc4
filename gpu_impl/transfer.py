"""Where a GPU ring's bytes live: the memory objects `mpi_impl.comm.RingComm` takes (`mpi_impl.memory`).

One `RingComm` posts the Isend/Irecv pairs for every backend (paper, Algorithm
1: "send K_k, V_k to the next device while computing"); what differs on a GPU
is only where MPI reads and writes, so this module gives RingComm one of two
memory objects (three verbs: ``buffer_set``, ``outgoing``, ``arrived``; see
`mpi_impl.memory.HostMemory`), chosen once per run:

- `DeviceBuffers` (``cuda-aware``): the MPI library reads and writes GPU
  memory itself, so device arrays go straight to Isend/Irecv;
- `StagedBuffers` (``staged``): each device array is copied to pinned host
  memory, travels as a host buffer, and is copied back on arrival, on a copy
  stream of its own. Correct with any MPI.

A block's positions and owner are NumPy arrays (see `reference.ring`) and
travel as host buffers either way.

Overlap and its hazards. The step only queues kernels on the compute stream,
and the ring calls ``start_shift`` before queueing them and ``finish_shift``
after, so MPI moves round t+1's block while the GPU computes round t. Nothing
here waits for the compute stream on the host except where MPI itself must
read or write memory that kernels use (cuda-aware), so the streams are ordered
with events instead. The buffers are RingComm's scheme (`mpi_impl.comm`: two
`BufferSet`s per tag, used in turn), each set here holding pinned receive and
send buffers and the device buffers arrivals are uploaded into:
- a set's buffers are allocated in ``start_shift``, when RingComm first takes
  the set, before the round's step is queued; CuPy's pool may hand out memory
  that queued kernels still read (freed by the host, in stream order), so the
  set's ``mark``, an event recorded on the compute stream right after, comes
  after every such kernel;
- a block that arrived is uploaded on the copy stream into the set's device
  buffers, after the copy stream waits for the set's mark: the set's last
  readers (the step of the round before) were queued before it; the compute
  stream waits for the copies (an event) before the step reads them;
- a device array written by kernels (this rank's own block, dK and dV) is
  downloaded only after the copy stream waits for the compute stream; a block
  this object uploaded itself is already in copy-stream order;
- MPI reads a pinned send buffer once Isend is posted, and writes a pinned
  receive buffer that an earlier upload may still be reading: ``outgoing``
  records an event on the copy stream after its downloads (every earlier
  upload is before it: one stream), and RingComm posts the shift's Isend and
  Irecv only once ``ready`` finds that event complete. It asks without
  waiting (an event query), from ``progress`` and while ``finish_shift``
  waits, so the host never waits for a step before queueing the next: in the
  backward, the dK, dV that round t's step writes are downloaded after an
  event of that step and sent when the download is done, while round t+1's
  step is already queued. A pinned send buffer still read by an earlier send
  is RingComm's to wait for (before it hands the set out again).

The schemes' all-to-all (`mpi_impl.groups.AllToAll`, Ulysses and USP) takes
the ring's memory object and moves device pieces the same two ways
(``all_to_all``): the pieces stacked in a device buffer that MPI reads and
writes (cuda-aware), or downloaded asynchronously into pinned host memory on
the copy stream and uploaded from it after the exchange (staged); the rank's
own piece is a device copy, never sent. MPI reads and writes those buffers
outside stream order, so the host waits for the kernels (cuda-aware) or the
downloads (staged) first: the all-to-all is a blocking collective before the
ring's first round or after its last, not inside a round.

``transfer="auto"`` asks the MPI library (`mpi_cuda_support`: MPICH and Open
MPI export ``MPIX_Query_cuda_support``) and sends device buffers only where
it says yes; ``cuda-aware`` asked of a library that says no fails at once.

    memory = StagedBuffers(CupyDevice(cupy, 0))
    ring = RingComm.on(MPI.COMM_WORLD, memory)      # ring.clock times steps with CUDA events
"""

import ctypes

import numpy as np

from mpi_impl.memory import BufferSet, byte_view

TRANSFERS = ("auto", "cuda-aware", "staged", "cuda-aware-unchecked")


# -- which path ---------------------------------------------------------------------

def mpi_cuda_support():
    """1 or 0, as the MPI library under mpi4py answers MPIX_Query_cuda_support(),
    or None when it cannot be asked (no mpi4py, or a library without the function)."""
    try:
        from mpi4py import MPI
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support   # found in libmpi, loaded by mpi4py
    except (ImportError, OSError, AttributeError):
        return None
    query.restype, query.argtypes = ctypes.c_int, []
    return int(query())


ASK = "ask"


def choose_transfer(transfer, cuda_support=ASK):
    """(path, reason): the path used for `transfer`, "cuda-aware" or "staged".
    `cuda_support`: the library's answer (1, 0, or None: it cannot be asked);
    by default `mpi_cuda_support()` is asked, only for "auto" and "cuda-aware"."""
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
    if transfer == "staged":
        return "staged", "requested"
    if transfer == "cuda-aware-unchecked":
        return "cuda-aware", "requested, MPI not asked"
    answer = mpi_cuda_support() if cuda_support == ASK else cuda_support
    said = ("the MPI library cannot be asked (no MPIX_Query_cuda_support)" if answer is None
            else f"MPIX_Query_cuda_support() = {answer}")
    if transfer == "auto":
        return ("cuda-aware" if answer else "staged"), f"auto: {said}"
    if answer == 0:
        raise ValueError("transfer='cuda-aware', but the MPI library says it is not CUDA-aware "
                         "(MPIX_Query_cuda_support() returned 0), so it cannot read GPU memory: use "
                         "transfer='staged' or 'auto' (through pinned host memory), or an MPI built with "
                         "CUDA support; 'cuda-aware-unchecked' skips the question (managed memory)")
    return "cuda-aware", f"requested; {said}"


def memory_for(path, device):
    """The memory object for a path of `choose_transfer`."""
    return DeviceBuffers(device) if path == "cuda-aware" else StagedBuffers(device)


# -- the memory objects ------------------------------------------------------------

class EventClock:
    """The RoundLog's clock on a GPU: events on the compute stream."""

    def __init__(self, device):
        self.device = device

    def mark(self):
        return self.device.event(self.device.compute, timing=True)

    def seconds(self, start, end):
        return self.device.elapsed(start, end)


class DeviceBuffers:
    """cuda-aware: MPI reads and writes device memory. RingComm's receive
    buffers are device arrays (host arrays for host arrays)."""

    def __init__(self, device):
        self.device, self.clock = device, EventClock(device)

    def buffer_set(self, like):
        dev = self.device
        received = tuple(dev.empty(a.shape, a.dtype) if dev.is_device(a) else np.empty(a.shape, a.dtype)
                         for a in like)
        return BufferSet(received, received, (None,) * len(like))

    def outgoing(self, arrays, buffers):
        # Hazard: MPI knows nothing of CUDA streams. It reads `arrays` once Isend
        # is posted, and writes a receive buffer that the previous round's step
        # may still be reading (or that CuPy's pool took back from one): the
        # kernels queued so far must be done, which `ready` asks of this event.
        buffers.ready = self.device.event(self.device.compute)
        return arrays

    def ready(self, buffers):
        return self.device.done(buffers.ready)

    def arrived(self, buffers):
        return buffers.receive

    def all_to_all(self, comm, pieces):
        """`AllToAll`'s exchange in device memory: the pieces stacked into one
        device buffer, read by MPI, the others' written into another."""
        dev, rank = self.device, comm.Get_rank()
        send = dev.xp.stack(pieces)                         # (u, piece...) on the compute stream
        received = dev.empty(send.shape, send.dtype)
        received[rank] = pieces[rank]                       # the rank's own piece: a device copy, never sent
        # Hazard: MPI reads `send` and writes `received` outside stream order: the
        # kernels that wrote them, or still read memory the pool gave `received`, first
        dev.host_wait(dev.event(dev.compute))
        exchange(comm, send, received)
        return list(received)


def exchange(comm, send, received):
    """MPI's all-to-all of rows: row i of `send` to group rank i, rank j's row
    into row j of `received`; the rank's own row is left out (its caller copies
    it on the device). `send` and `received` (u, piece...) C-contiguous, host
    or device, as MPI reads them."""
    from mpi4py import MPI
    rank, row = comm.Get_rank(), send[0].nbytes
    counts = [0 if i == rank else row for i in range(comm.Get_size())]
    displs = [i * row for i in range(comm.Get_size())]
    comm.Alltoallv([byte_view(send), counts, displs, MPI.BYTE], [byte_view(received), counts, displs, MPI.BYTE])


class StagedBuffers:
    """staged: device arrays travel as pinned host copies (module docstring's hazards)."""

    def __init__(self, device):
        self.device, self.clock = device, EventClock(device)
        self._uploaded = []         # the device buffers uploads write (kept: they are compared by identity)
        self._pinned = {}           # (shape, dtype) -> the all-to-all's pinned send and receive buffers

    def buffer_set(self, like):
        """For each device array of `like`: a pinned receive buffer, a device
        buffer it is uploaded into, a pinned send buffer; host arrays travel as
        they are (received into a NumPy array)."""
        dev = self.device
        receive, handed, staged = [], [], []
        for a in like:
            if dev.is_device(a):
                receive.append(dev.pinned_empty(a.shape, a.dtype))
                handed.append(dev.empty(a.shape, a.dtype))
                staged.append(dev.pinned_empty(a.shape, a.dtype))
                self._uploaded.append(handed[-1])
            else:
                receive.append(np.empty(a.shape, dtype=a.dtype))
                handed.append(receive[-1])
                staged.append(None)
        return BufferSet(tuple(receive), tuple(handed), tuple(staged))

    def outgoing(self, arrays, buffers):
        """Pinned copies of the device arrays (host arrays as they are), ready for MPI."""
        dev = self.device
        buffers.mark = dev.event(dev.compute)       # after the set's allocation and every kernel queued so far
        waited, sent = False, []
        for a, pinned in zip(arrays, buffers.staged):
            if pinned is None:
                sent.append(a)
                continue
            if not waited and not any(a is d for d in self._uploaded):
                dev.wait(dev.copy, buffers.mark)        # written by kernels: wait for them
                waited = True
            dev.download(a, pinned, dev.copy)
            sent.append(pinned)
        # MPI reads the copies, and writes pinned receives that earlier uploads read: after this event
        buffers.ready = dev.event(dev.copy) if any(p is not None for p in buffers.staged) else None
        return tuple(sent)

    def ready(self, buffers):
        """Whether the downloads `outgoing` queued, and every upload before them, are done (asked, not waited for)."""
        return buffers.ready is None or self.device.done(buffers.ready)

    def arrived(self, buffers):
        """Upload the pinned arrivals into the set's device buffers; the compute
        stream waits for the copies. Host arrays are handed out as they are."""
        dev = self.device
        dev.wait(dev.copy, buffers.mark)        # the set's last readers were queued before it
        for pinned, d in zip(buffers.receive, buffers.handed):
            if d is not pinned:
                dev.upload(pinned, d, dev.copy)
        dev.wait(dev.compute, dev.event(dev.copy))          # the step reads them after the copies
        return buffers.handed

    def all_to_all(self, comm, pieces):
        """`AllToAll`'s exchange through pinned host memory: the others' pieces
        downloaded on the copy stream, exchanged by MPI, uploaded on the copy
        stream into a device buffer the compute stream waits for; the rank's
        own piece copied on the device. The pinned buffers are kept and reused
        in copy-stream order (a download into them follows every upload from them)."""
        dev, rank = self.device, comm.Get_rank()
        shape, dtype = (len(pieces),) + tuple(pieces[0].shape), pieces[0].dtype
        key = (shape, str(dtype))
        if key not in self._pinned:
            self._pinned[key] = (dev.pinned_empty(shape, dtype), dev.pinned_empty(shape, dtype))
        send, received = self._pinned[key]
        out = dev.empty(shape, dtype)
        out[rank] = pieces[rank]                            # a device copy, never sent
        # after the kernels that wrote the pieces, and those still reading memory the pool gave `out`
        dev.wait(dev.copy, dev.event(dev.compute))
        for i, piece in enumerate(pieces):
            if i != rank:
                dev.download(piece, send[i], dev.copy)
        dev.host_wait(dev.event(dev.copy))                  # MPI reads the copies: they must have landed
        exchange(comm, send, received)
        for i in range(len(pieces)):
            if i != rank:
                dev.upload(received[i], out[i], dev.copy)
        dev.wait(dev.compute, dev.event(dev.copy))          # what reads them waits for the uploads
        return list(out)
