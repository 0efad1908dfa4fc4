"""Where a GPU ring's bytes live: the memory objects `mpi_impl.comm.RingComm` takes.

One `RingComm` posts the Isend/Irecv pairs for every backend (paper, Algorithm
1: "send K_k, V_k to the next device while computing"); what differs on a GPU
is only where MPI reads and writes, so this module gives RingComm one of two
memory objects (three verbs: ``outgoing``, ``receive_like``, ``arrived``; see
`mpi_impl.comm.HostMemory`), chosen once per run:

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
with events instead:
- a block that arrived is uploaded on the copy stream; the compute stream
  waits for that copy (an event) before the step reads it;
- the device buffer an upload refills was read by a step queued before the
  latest ``start_shift``; the copy waits for the event recorded there;
- a device array written by kernels (this rank's own block, dK and dV) is
  downloaded only after the copy stream waits for the compute stream; a block
  this object uploaded itself is already in copy-stream order;
- MPI reads a pinned send buffer when Isend is posted, and writes a pinned
  receive buffer that an earlier upload may still be reading: ``outgoing``
  waits (on the host) for the copy stream. That stream holds copies and their
  waits, so in the forward the host may wait for the step before last (which
  the last upload waited for), never for the step just queued.
Receive buffers are allocated once per tag (two sets, as RingComm's) and
reused round after round, never taken from the pool while kernels run.

``transfer="auto"`` asks the MPI library (`mpi_cuda_support`: MPICH and Open
MPI export ``MPIX_Query_cuda_support``) and sends device buffers only where
it says yes; ``cuda-aware`` asked of a library that says no fails at once.

    memory = StagedBuffers(CupyDevice(cupy, 0))
    ring = RingComm.on(MPI.COMM_WORLD, memory)      # ring.clock times steps with CUDA events
"""

import ctypes

import numpy as np

TRANSFERS = ("auto", "cuda-aware", "staged", "cuda-aware-unchecked")
N_SETS = 2          # device (staged uploads) and pinned send buffer sets per tag, used in turn


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

    def outgoing(self, arrays, tag):
        # Hazard: MPI knows nothing of CUDA streams. It reads `arrays` once Isend
        # is posted, and writes a receive buffer that the previous round's step
        # may still be reading: the kernels queued so far must be done.
        self.device.compute.synchronize()
        return arrays

    def receive_like(self, a):
        if self.device.is_device(a):
            return self.device.empty(a.shape, a.dtype)
        return np.empty(a.shape, dtype=a.dtype)

    def arrived(self, received, tag):
        return received


class StagedBuffers:
    """staged: device arrays travel as pinned host copies (module docstring's hazards)."""

    def __init__(self, device):
        self.device, self.clock = device, EventClock(device)
        self._send, self._uploads = {}, {}        # tag -> its buffer sets, used in turn
        self._ours = set()                        # addresses of the device buffers uploads write
        self._pinned_receives = set()             # addresses of the pinned receive buffers
        self._compute_mark = None                 # event: the compute stream at the latest outgoing

    def outgoing(self, arrays, tag):
        """Pinned copies of the device arrays (host arrays as they are), ready for MPI."""
        dev = self.device
        self._compute_mark = dev.event(dev.compute)
        host = self._next_set(self._send, tag, arrays, dev.pinned_empty)
        waited = False
        for a, h in zip(arrays, host):
            if h is a:
                continue
            if _address(a) not in self._ours and not waited:
                dev.wait(dev.copy, self._compute_mark)        # written by kernels: wait for them
                waited = True
            dev.download(a, h, dev.copy)
        dev.copy.synchronize()          # MPI reads the copies; pinned receives are free again
        return host

    def receive_like(self, a):
        if not self.device.is_device(a):
            return np.empty(a.shape, dtype=a.dtype)
        h = self.device.pinned_empty(a.shape, a.dtype)
        self._pinned_receives.add(_address(h))
        return h

    def arrived(self, received, tag):
        """Upload the pinned arrivals into this tag's next device set; the compute
        stream waits for the copies. Host arrays are handed out as they are."""
        dev = self.device
        staged = [_address(r) in self._pinned_receives for r in received]
        targets = self._next_set(self._uploads, tag, received, self._device_buffer, staged)
        if self._compute_mark is not None:
            dev.wait(dev.copy, self._compute_mark)          # the set's last readers were queued before it
        for r, d in zip(received, targets):
            if d is not r:
                dev.upload(r, d, dev.copy)
        dev.wait(dev.compute, dev.event(dev.copy))          # the step reads them after the copies
        return targets

    def _device_buffer(self, shape, dtype):
        d = self.device.empty(shape, dtype)
        self._ours.add(_address(d))
        return d

    def _next_set(self, sets_by_tag, tag, like, allocate, which=None):
        """This tag's next buffer set shaped like `like`, the sets used in turn.
        Arrays for which `which` is False (default: host arrays) stand for themselves."""
        which = [self.device.is_device(a) for a in like] if which is None else which
        signature = tuple((a.shape, str(a.dtype), w) for a, w in zip(like, which))
        entry = sets_by_tag.get(tag)
        if entry is None or entry["signature"] != signature:
            entry = sets_by_tag[tag] = dict(signature=signature, sets=[], turn=-1)
        entry["turn"] = (entry["turn"] + 1) % N_SETS
        if entry["turn"] == len(entry["sets"]):
            entry["sets"].append(tuple(allocate(a.shape, a.dtype) if w else None for a, w in zip(like, which)))
        buffers = entry["sets"][entry["turn"]]
        return tuple(a if b is None else b for a, b in zip(like, buffers))


def _address(a):
    """Start of an array's memory (host or device)."""
    if hasattr(a, "__cuda_array_interface__"):
        return ("cuda", a.__cuda_array_interface__["data"][0])
    return ("host", a.__array_interface__["data"][0])
