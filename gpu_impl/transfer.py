"""Moving blocks between GPUs over MPI: the ring's communication object for gpu_impl.

`reference.ring` asks for two verbs (see its docstring): ``start_shift(arrays,
tag)`` sends a tuple of arrays to rank+1 and receives a same-shaped tuple from
rank-1, ``finish_shift(handle)`` waits for both. `DeviceRing` implements them
for device arrays in one of two ways, chosen once per run:

- ``cuda-aware``: the MPI library reads and writes GPU memory itself, so device
  buffers go straight to ``Isend``/``Irecv``. MPI does not know about CUDA
  streams: the stream that wrote a buffer must be synchronized first.
- ``staged``: each block is copied to pinned host memory, travels as a host
  buffer, and is copied back to the GPU on arrival. Correct with any MPI.

mpi4py cannot ask the MPI library whether it is CUDA-aware, so ``auto`` means
``staged`` unless the caller declares ``cuda-aware``.

Overlap (paper, section 1: in Ring Attention "cross-device communication can be
overlapped with on-device computation"; section 4's TMS assumes it): the ring
calls ``start_shift`` before it queues the step's kernels on the compute stream,
so the messages are in flight while the GPU computes, and ``finish_shift`` after.

    ring = DeviceRing(MPI.COMM_WORLD, device, transfer="staged")
    handle = ring.start_shift((k, v), tag=1)
    k, v = ring.finish_shift(handle)

`device` is a `gpu_impl.device.CupyDevice` (or, in the tests, a NumPy stand-in
with the same verbs); `mpi_comm` anything with Get_rank, Get_size, Isend, Irecv.
"""

from dataclasses import dataclass

from mpi_impl.comm import TAG_STRIDE, byte_view   # MPI tag = ring tag * TAG_STRIDE + index in the tuple

TRANSFERS = ("auto", "cuda-aware", "staged")


def choose_transfer(transfer):
    """(path, reason) for the requested transfer: the path actually used."""
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
    if transfer == "auto":
        return "staged", "auto: mpi4py cannot ask MPI whether it is CUDA-aware, so blocks go " \
                         "through pinned host memory (pass transfer='cuda-aware' to send device buffers)"
    return transfer, "requested"


@dataclass
class _Shift:
    """One shift in flight: its MPI requests, what is sent (kept alive until the
    sends complete: the ring drops its own names for dK, dV once sent, and the
    memory pool must not hand that memory out while MPI still reads it), and
    where the data arrives."""
    requests: list
    sent: tuple
    received: tuple          # device arrays (cuda-aware) or pinned host arrays (staged)
    staged: bool


class DeviceRing:
    """This rank's end of the GPU ring: ``rank``, ``size``, ``start_shift``,
    ``finish_shift``, and ``transfer``, the path in use."""

    def __init__(self, mpi_comm, device, transfer="auto"):
        self.transfer, self.transfer_reason = choose_transfer(transfer)
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self._comm, self._device = mpi_comm, device
        self._pinned = {}      # (tag, "send"|"recv") -> pinned host buffers, reused every round
        self._next, self._prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def start_shift(self, arrays, tag):
        """Post the receive from rank-1 and the send of `arrays` (device arrays,
        C-contiguous) to rank+1; returns the handle for `finish_shift`."""
        # Hazard: MPI (and the staging copy) read memory outside CUDA stream order;
        # the kernels that wrote `arrays` must have finished. Synchronizing before
        # allocating receive buffers also guarantees that memory the pool hands
        # back is no longer read by a queued kernel when MPI writes into it.
        self._device.synchronize()
        if self.transfer == "cuda-aware":
            received = tuple(self._device.empty_like(a) for a in arrays)
            outgoing = arrays
        else:
            outgoing = self._stage_out(arrays, tag)
            received = self._buffers(tag, "recv", arrays)
        view = self._device.byte_view if self.transfer == "cuda-aware" else byte_view
        requests = self._post(outgoing, received, tag, view)
        return _Shift(requests, outgoing, received, staged=self.transfer == "staged")

    def finish_shift(self, handle):
        """Wait for the shift's sends and receives; return the arrays that arrived,
        on the device."""
        for r in handle.requests:
            r.Wait()
        if not handle.staged:
            return handle.received
        # upload copies, so the pinned receive buffers are free for the next round
        return tuple(self._device.upload(h) for h in handle.received)

    def _post(self, outgoing, received, tag, view):
        """Isend every array to rank+1 and Irecv its twin from rank-1, as bytes."""
        requests = []
        for i, (out, into) in enumerate(zip(outgoing, received)):
            mpi_tag = tag * TAG_STRIDE + i
            requests.append(self._comm.Irecv(view(into), source=self._prev, tag=mpi_tag))
            requests.append(self._comm.Isend(view(out), dest=self._next, tag=mpi_tag))
        return requests

    def _stage_out(self, arrays, tag):
        """Device -> pinned host copies of `arrays`, complete on return."""
        host = self._buffers(tag, "send", arrays)
        for a, h in zip(arrays, host):
            self._device.download(a, out=h)
        return host

    def _buffers(self, tag, direction, like):
        """Pinned buffers shaped like `like`, allocated once per tag and reused.
        Safe to reuse: a tag has one shift in flight at a time, and its buffers
        are free once `finish_shift` has waited for it and uploaded."""
        key = (tag, direction)
        want = tuple((a.shape, a.dtype) for a in like)
        have = self._pinned.get(key)
        if have is None or tuple((h.shape, h.dtype) for h in have) != want:
            have = tuple(self._device.pinned_empty(s, d) for s, d in want)
            self._pinned[key] = have
        return have

