"""Finding CuPy and a GPU, choosing this rank's GPU, and the few device verbs
the transfers need.

Nothing here imports CuPy at import time: `require_cupy` does it when a GPU
function is called, and says what is missing (the package, or a CUDA device)
instead of a traceback from deep inside CuPy.

Ranks map to GPUs by *local* rank, the rank among the processes of the same
node, so that ``mpiexec -n 4`` on a machine with one GPU puts all four ranks
on it, and on a node with 4 GPUs gives each rank its own:

    local rank:  0 1 2 3 4 5      n_gpus = 4
    device:      0 1 2 3 0 1

`CupyDevice` holds the two streams of a rank: ``compute`` (the caller's stream:
every kernel of the step runs on it) and ``copy`` (host <-> device copies of the
staged transfer, which must not wait behind queued kernels),
and the verbs `reference.ring`'s communication object needs from a device:
synchronize, allocate, download to pinned host memory, upload.

Legend: ``a`` a device array, ``host`` a NumPy array (pinned where it matters).
"""

INSTALL_HINT = "pip install 'striped-attention[gpu]' (the cupy-cuda13x package)"


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


def local_rank(comm):
    """This rank's index among the ranks on its node (MPI shared-memory split)."""
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_rank()
    finally:
        node.Free()


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

    @property
    def name(self):
        props = self.xp.cuda.runtime.getDeviceProperties(self.index)
        return f"GPU {self.index} ({props['name'].decode()})"

    def synchronize(self):
        """Wait until every kernel queued on the compute stream has finished."""
        self.compute.synchronize()

    def empty_like(self, a):
        return self.xp.empty_like(a)

    def pinned_empty(self, shape, dtype):
        """A NumPy array in page-locked memory: the GPU copies it asynchronously
        at full bandwidth, and MPI reads it like any host buffer."""
        import cupyx
        return cupyx.empty_pinned(shape, dtype=dtype)

    def download(self, a, out):
        """Device -> host into `out`, finished when this returns."""
        a.get(stream=self.copy, out=out, blocking=False)
        self.copy.synchronize()

    def upload(self, host):
        """Host -> a new device array, finished when this returns (so that
        `host` may be reused at once)."""
        a = self.xp.empty(host.shape, dtype=host.dtype)
        a.set(host, stream=self.copy)
        self.copy.synchronize()
        return a

    def byte_view(self, a):
        """The bytes of a contiguous array, for MPI.BYTE messages (float16 has
        no MPI datatype everywhere)."""
        if not a.flags.c_contiguous:       # reshape would copy, and MPI would fill the copy
            raise ValueError("ring buffers must be C-contiguous")
        return a.reshape(-1).view(self.xp.uint8)


class NumpyDevice:
    """CupyDevice's verbs on host memory: NumPy standing in for CuPy, so that the
    transfers (`gpu_impl.transfer`) run, and are tested, on a machine without a
    GPU. `events`, if given, records the order of synchronize, download, upload."""

    def __init__(self, events=None):
        import numpy
        self.xp, self.events, self.pinned_allocations = numpy, events, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def _note(self, what):
        if self.events is not None:
            self.events.append(what)

    def synchronize(self):
        self._note("synchronize")

    def empty_like(self, a):
        return self.xp.empty_like(a)

    def pinned_empty(self, shape, dtype):
        self.pinned_allocations += 1
        return self.xp.empty(shape, dtype=dtype)

    def download(self, a, out):
        self._note("download")
        self.xp.copyto(out, a)

    def upload(self, host):
        self._note("upload")
        return host.copy()

    def byte_view(self, a):
        if not a.flags.c_contiguous:
            raise ValueError("ring buffers must be C-contiguous")
        return a.reshape(-1).view(self.xp.uint8)
