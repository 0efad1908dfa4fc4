"""Finding CuPy and a GPU, choosing this rank's GPU, and the device verbs the transfers need.

Nothing here imports CuPy at import time: `require_cupy` does it when a GPU
function is called, and says what is missing (the package, or a CUDA device)
instead of a traceback from deep inside CuPy.

Ranks map to GPUs by *local* rank, the rank among the processes of the same
node, so that ``mpiexec -n 4`` on a machine with one GPU puts all four ranks
on it, and on a node with 4 GPUs gives each rank its own:

    local rank:  0 1 2 3 4 5      n_gpus = 4
    device:      0 1 2 3 0 1

Choose the GPU *before* MPI starts (before ``from mpi4py import MPI``): a
CUDA-aware MPI sets up CUDA for the device current at ``MPI_Init``, and with
none chosen every rank would first touch GPU 0. Launchers export the local rank
(`LOCAL_RANK_VARIABLES`), so `use_local_device()` reads it from there; with an
unknown launcher it falls back to asking MPI (`local_rank(comm)`), after init.

`CupyDevice` holds the two streams of a rank: ``compute`` (the caller's stream:
every kernel of the step runs on it) and ``copy`` (host <-> device copies of the
staged transfer, which must not wait behind queued kernels), and the verbs the
ring's memory objects (`gpu_impl.transfer`) use: events to order the streams
and time the step, device and pinned buffers, asynchronous copies.
tests/support/gpu/queued_device.py implements the same verbs on NumPy with streams
that really run later, so that a missing event gives a wrong answer on a CPU.

Legend: ``a`` a device array, ``host`` a NumPy array (pinned where it matters).
"""

import os

INSTALL_HINT = "pip install 'striped-attention[gpu]' (the cupy-cuda13x package)"

# the local rank as launchers export it: Open MPI, MPICH/Hydra, Slurm, PMIx, MVAPICH2, Cray PALS
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
                        "PMIX_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "PALS_LOCAL_RANKID")


class GpuUnavailable(RuntimeError):
    """CuPy is not installed, or it finds no usable CUDA device."""


def require_cupy():
    """Return the cupy module, or raise GpuUnavailable saying what is missing."""
    try:
        import cupy
    except ImportError as e:
        raise GpuUnavailable(f"gpu_impl needs CuPy, which is not installed ({e}); {INSTALL_HINT}") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:       # noqa: BLE001 - CuPy raises its own CUDARuntimeError
        raise GpuUnavailable(f"gpu_impl found no usable CUDA device: {type(e).__name__}: {e} "
                             "(is there a GPU with its NVIDIA driver? see nvidia-smi)") from None
    if n < 1:
        raise GpuUnavailable("gpu_impl found no CUDA device (cupy.cuda.runtime.getDeviceCount() == 0)")
    return cupy


def device_for_local_rank(local_rank, n_gpus):
    """The GPU of a rank: local ranks deal round-robin over the node's GPUs,
    so several ranks share one GPU when there are more ranks than GPUs."""
    if n_gpus < 1:
        raise GpuUnavailable("no CUDA device to map ranks to")
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    return local_rank % n_gpus


def local_rank_from_env(environ=None):
    """This process's local rank as the launcher exported it, or None (no
    launcher, or one that exports none of `LOCAL_RANK_VARIABLES`)."""
    environ = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARIABLES:
        value = environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return None


def local_rank(comm):
    """This rank's index among the ranks on its node (MPI shared-memory split; collective)."""
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_rank()
    finally:
        node.Free()


def use_local_device(comm=None):
    """Make this rank's GPU current and return its index. Call it first, before
    ``from mpi4py import MPI`` and before creating arrays: the local rank comes
    from the launcher's environment; `comm` (collective) is asked only where no
    launcher variable is set."""
    cupy = require_cupy()
    rank = local_rank_from_env()
    if rank is None:
        rank = 0 if comm is None else local_rank(comm)
    index = device_for_local_rank(rank, cupy.cuda.runtime.getDeviceCount())
    cupy.cuda.Device(index).use()
    return index


class CupyDevice:
    """This rank's GPU and its two streams. Use as ``with device: ...`` so that
    every CuPy call inside runs on this GPU.

    The compute stream is the caller's current stream on that GPU: the step's
    kernels queue behind whatever wrote the inputs, and CuPy's memory pool,
    which keeps freed blocks per stream, reuses them call after call (a new
    compute stream per call would strand them). The copy stream is our own."""

    def __init__(self, cupy, index):
        self.xp, self.index = cupy, index
        self.device = cupy.cuda.Device(index)
        with self.device:
            self.compute = cupy.cuda.get_current_stream()
            self.copy = cupy.cuda.Stream(non_blocking=True)

    def __enter__(self):
        self.device.__enter__()
        return self

    def __exit__(self, *exc):
        return self.device.__exit__(*exc)

    def is_device(self, a):
        return isinstance(a, self.xp.ndarray)

    def event(self, stream, timing=False):
        """An event recorded on `stream`: it completes when the work queued
        there so far has. `timing` events can be read by `elapsed`."""
        ev = self.xp.cuda.Event(disable_timing=not timing)
        ev.record(stream)
        return ev

    def done(self, event):
        """Whether `event` has completed, asked without waiting (cudaEventQuery)."""
        return event.done

    def wait(self, stream, event):
        """Work queued on `stream` from now on starts after `event` completes (the host does not wait)."""
        stream.wait_event(event)

    def host_wait(self, event):
        """The host waits until `event` has completed (cudaEventSynchronize):
        only where MPI must read or write memory that queued work uses."""
        event.synchronize()

    def elapsed(self, start, end):
        """Seconds between two timing events (waits for `end`)."""
        end.synchronize()
        return self.xp.cuda.get_elapsed_time(start, end) / 1e3

    def empty(self, shape, dtype):
        """A device buffer. Allocated while the compute stream is current: CuPy's
        pool then hands its memory back only to work ordered after the compute stream."""
        with self.compute:
            return self.xp.empty(shape, dtype=dtype)

    def pinned_empty(self, shape, dtype):
        """A NumPy array in page-locked memory: the GPU copies it asynchronously
        at full bandwidth, and MPI reads it like any host buffer."""
        import cupyx
        return cupyx.empty_pinned(shape, dtype=dtype)

    def download(self, a, host, stream):
        """Queue device -> host (pinned) on `stream`; done when the stream reaches it."""
        a.get(stream=stream, out=host, blocking=False)

    def upload(self, host, a, stream):
        """Queue host (pinned) -> device `a` on `stream`; `host` must stay untouched until done."""
        a.set(host, stream=stream)
