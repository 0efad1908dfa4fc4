"""A GPU made of NumPy whose streams really run later: stream hazards as wrong answers on a CPU.

`QueuedDevice` has `gpu_impl.device.CupyDevice`'s verbs (two streams, events,
device and pinned buffers, asynchronous copies), but nothing queued on a
stream runs when it is queued. Each stream is a FIFO of kernels, copies,
event records and event waits, run in queue order per stream, and the two
streams are interleaved by a policy that is as unkind as CUDA allows:

- ``"copies-early"``: a copy runs as soon as its stream lets it, kernels only
  when something forces them (a host sync, a host read, a copy waiting for
  them). A buffer refilled while a queued kernel still has to read it gives
  that kernel the new data.
- ``"copies-late"``: kernels run as soon as their stream lets them, copies only
  when forced. A kernel that does not wait for the upload of its block reads
  the buffer's old contents.

Device memory comes from a pool that reuses it as CuPy's does (`MemoryPool`):
an array's memory goes back to the pool as soon as the host holds no array on
it, whatever the streams still have queued to read or write there, and the
next allocation of its size on the same stream gets it at once. A launch or a
copy takes the addresses of its arrays, not references (`by_address`), so a
buffer allocated for a copy on another stream, in memory a queued kernel still
reads, gives that kernel the copy's data here as on a GPU.

Device arrays are `DeviceArray` (a NumPy array whose type says "cupy", so that
`reference.layouts.array_module` picks the `fake_cupy` module). Every CuPy
function and every arithmetic operation on a device array called from the host
is a kernel on the compute stream: it runs after everything queued there
before it (the host waits, as for any result it reads). ``a.get()`` is a host
read: it waits for the compute stream, and is counted in ``host_reads`` (and in
``host_reads_in_steps`` while a `CountedStep` runs). A reduction gives a 0-d
device array, as CuPy's, so ``bool(xp.isfinite(x).all())`` is such a read.
It counts what moves between host and device: ``copied_bytes`` by the copy
verbs (``download``, ``upload``: pinned memory), ``pageable_bytes`` the floats
that go through pageable memory (a ``get()``, or ``cupy.asarray`` of host
data), so that a test can hold a path to "no piece through pageable memory".
`QueuedStep` wraps a step: it plans and counts on the host at once (positions
are NumPy) and queues the tiles' work as one kernel, with the positions copied
at launch as a real launch copies its arguments. A "kernel" runs the NumPy
code of the wrapped step when its turn comes. `CountedStep` runs a step from
the host as it is, every CuPy call of it a kernel, and counts its host reads.

    gpu = QueuedDevice("copies-early")
    with gpu.installed():             # sys.modules["cupy"] is fake_cupy(gpu) inside
        ...

Run as a script, it runs a module or a script on such a GPU, one per process
(`install_for_process`: even local ranks copies early, odd ones kernels early;
gpu_impl takes it for CupyDevice, and the readable step stands in for the fused
kernels, forward and backward, since CUDA cannot run on NumPy):

    mpiexec -n 3 python -m mpi4py tests/support/gpu/queued_device.py -m gpu_impl --seq-len 48 --check
    python tests/support/gpu/queued_device.py scripts/gpu_check.py --one-fused-launch
"""

import contextlib
import ctypes
import dataclasses
import runpy
import sys
import threading
import types
from collections import deque

import numpy as np

from reference.step import Step
from reference.steps import get as get_step
from reference.tiles import any_visible, tile_plan

POLICIES = ("copies-early", "copies-late")
_LOCAL = threading.local()      # .stack: the QueuedDevices installed on this thread


def _gpu():
    """This thread's installed QueuedDevice, or None."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def _host(x):
    """The plain NumPy view of a device array (no hooks)."""
    return x.view(np.ndarray) if isinstance(x, DeviceArray) else x


def _device(x):
    """A result of NumPy as a device array: new memory from the installed
    device's pool (a scalar becomes a 0-d array, as CuPy's reductions give),
    a view of device memory as it is."""
    if isinstance(x, np.generic):
        x = np.asarray(x)
    if type(x) is not np.ndarray:
        return x
    gpu = _gpu()
    if gpu is not None and x.base is None:
        pooled = gpu.pool.allocate(x.shape, x.dtype, gpu.current[-1])
        np.copyto(_host(pooled), x)
        return pooled
    return x.view(DeviceArray)


class DeviceArray(np.ndarray):
    """An array in the fake GPU's memory (see the module docstring)."""
    __module__ = "cupy"

    @property
    def device(self):
        return types.SimpleNamespace(id=0)

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        gpu = _gpu()
        if gpu is not None:
            gpu.host_kernel()
        inputs = tuple(_host(x) for x in inputs)
        if out is not None:
            kwargs["out"] = tuple(_host(x) for x in out)
        result = getattr(ufunc, method)(*inputs, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return tuple(_device(r) for r in result) if isinstance(result, tuple) else _device(result)

    def __setitem__(self, key, value):
        """A write from the host is a kernel too (it runs after those queued)."""
        gpu = _gpu()
        if gpu is not None:
            gpu.host_kernel()
        _host(self)[key] = _host(value)

    def astype(self, dtype, *args, copy=True, **kwargs):
        if not copy and np.dtype(dtype) == self.dtype:
            return self                                  # no kernel, as CuPy's
        gpu = _gpu()
        if gpu is not None:
            gpu.host_kernel()
        return _device(_host(self).astype(dtype, *args, copy=copy, **kwargs))

    def get(self, stream=None, out=None, blocking=True):
        """A host read, as CuPy's: waits for the compute stream (a copy into
        pageable memory: counted in ``pageable_bytes`` where it holds floats)."""
        gpu = _gpu()
        if gpu is not None:
            gpu.host_read()
            gpu.count_pageable(self)
        return np.array(_host(self)) if out is None else np.copyto(out, _host(self)) or out

    def __bool__(self):
        gpu = _gpu()
        if gpu is not None:
            gpu.host_read()
        return bool(_host(self))

    def __float__(self):
        return float(self.get())

    def __int__(self):
        return int(self.get())


def fake_cupy():
    """A module named cupy over NumPy: every function is a kernel on the
    compute stream of the calling thread's QueuedDevice."""
    cupy = types.ModuleType("cupy")

    def wrap(fn):
        if not callable(fn) or isinstance(fn, type):
            return fn

        def kernel(*args, **kwargs):
            gpu = _gpu()
            if gpu is not None:
                gpu.host_kernel()
            args = tuple(_host(a) for a in args)
            kwargs = {k: _host(a) for k, a in kwargs.items()}
            result = fn(*args, **kwargs)
            return _device(result) if isinstance(result, (np.ndarray, np.generic)) else result
        return kernel

    def from_host(fn):
        def upload(x, *args, **kwargs):
            gpu = _gpu()
            if gpu is not None and not isinstance(x, DeviceArray):
                gpu.count_pageable(np.asarray(x))
            return wrap(fn)(x, *args, **kwargs)
        return upload

    uploads = {name: from_host(getattr(np, name)) for name in ("asarray", "array", "ascontiguousarray")}
    cupy.__getattr__ = lambda name: uploads[name] if name in uploads else wrap(getattr(np, name))
    cupy.__version__ = "QueuedDevice (NumPy)"
    cupy.ndarray = DeviceArray
    cupy.asnumpy = lambda x: x.get() if isinstance(x, DeviceArray) else np.asarray(x)
    properties = {"name": b"QueuedDevice (NumPy)", "totalGlobalMem": 2**30, "major": 0, "minor": 0}
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, getDeviceProperties=lambda index: properties,
                                    runtimeGetVersion=lambda: 0, driverGetVersion=lambda: 0)
    cupy.cuda = types.SimpleNamespace(runtime=runtime, Device=_Device, get_current_stream=_current_stream)
    return cupy


def _current_stream():
    """cupy.cuda.get_current_stream(): the compute stream unless another is entered."""
    gpu = _gpu()
    return gpu.current[-1] if gpu is not None else None


class _Device:
    """cupy.cuda.Device: use() does nothing, synchronize() waits for both streams."""

    def __init__(self, index=0):
        self.id = index

    def use(self):
        pass

    def synchronize(self):
        gpu = _gpu()
        if gpu is not None:
            gpu.run_until(lambda: not gpu.compute.items and not gpu.copy.items)


FAKE_CUPY = fake_cupy()


class MemoryPool:
    """Device memory handed out as CuPy's pool does: in units of 512 bytes,
    per stream, a block back in the pool as soon as no host object refers to
    it (kernels and copies hold addresses: `by_address`), and the block freed
    last handed out first. New memory is filled with 0xff bytes (NaN, -1)."""
    UNIT = 512

    def __init__(self):
        self.in_use, self.free = [], []     # free: most recently freed last
        self.reused = 0                     # allocations served from freed blocks

    def allocate(self, shape, dtype, stream):
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        size = max(1, -(-nbytes // self.UNIT)) * self.UNIT
        self._collect()
        block = next((b for b in reversed(self.free) if b.size == size and b.stream is stream), None)
        if block is None:
            block = _Block(size, stream)
        else:
            self.free.remove(block)
            self.reused += 1
        self.in_use.append(block)
        return block.memory[:nbytes].view(dtype).reshape(shape).view(DeviceArray)

    def _collect(self):
        """Blocks no host object refers to any more go back to the pool."""
        for block in list(self.in_use):
            if block.unreferenced():
                self.in_use.remove(block)
                self.free.append(block)

    def by_address(self, a):
        """What a launch or a copy holds of device array `a`: the same memory,
        without keeping `a` (or its block) from going back to the pool."""
        if not isinstance(a, DeviceArray):
            return a
        base = a
        while isinstance(base.base, np.ndarray):
            base = base.base
        block = next((b for b in self.in_use if b.memory is base), None)
        if block is None or a.size == 0:
            return _host(a)                         # not pool memory: held as it is
        offset = a.__array_interface__["data"][0] - block.address
        return np.ndarray(a.shape, a.dtype, buffer=block.alias, offset=offset, strides=a.strides)


class _Block:
    """One block of the pool: its memory, owned here for ever, and an alias of
    that memory that does not count as a reference to it."""

    def __init__(self, size, stream):
        self.size, self.stream = size, stream
        self.memory = np.full(size, 0xFF, np.uint8)
        self.address = self.memory.ctypes.data
        self.alias = np.frombuffer((ctypes.c_uint8 * size).from_address(self.address), np.uint8)
        self._baseline = sys.getrefcount(self.memory)

    def unreferenced(self):
        return sys.getrefcount(self.memory) <= self._baseline


class Event:
    def __init__(self):
        self.recorded, self.reached, self.time = False, False, 0


class Stream:
    """A FIFO of ("run", fn), ("record", event), ("wait", event)."""

    def __init__(self, gpu, name):
        self.gpu, self.name, self.items = gpu, name, deque()
        self.ptr = id(self)             # as cupy.cuda.Stream.ptr: which stream, for caches keyed by it

    def runnable(self):
        if not self.items:
            return False
        kind, what = self.items[0]
        return kind != "wait" or what.reached or not what.recorded   # waiting on an unrecorded event: no-op

    def run_one(self):
        kind, what = self.items.popleft()
        if kind == "run":
            self.gpu.clock += 1
            self.gpu.in_kernel += 1
            try:
                what()
            finally:
                self.gpu.in_kernel -= 1
            if self.name == "compute":
                self.gpu.kernels_run += 1
        elif kind == "record":
            what.reached, what.time = True, self.gpu.clock

    def synchronize(self):
        self.gpu.host_syncs.append(self.name)
        self.gpu.run_until(lambda: not self.items)

    def wait_event(self, event):
        self.items.append(("wait", event))
        self.gpu.eager()

    def __enter__(self):
        self.gpu.current.append(self)       # the current stream, as `with cupy.cuda.Stream()`
        return self

    def __exit__(self, *exc):
        self.gpu.current.pop()
        return False


class QueuedDevice:
    """CupyDevice's verbs over NumPy, with streams that run later (module docstring)."""

    def __init__(self, policy="copies-early"):
        assert policy in POLICIES, policy
        self.policy, self.index = policy, 0
        self.compute, self.copy = Stream(self, "compute"), Stream(self, "copy")
        self.clock = self.in_kernel = self.kernels_queued = self.kernels_run = 0
        self.host_reads, self.host_syncs, self.polls = 0, [], 0
        self.pageable_bytes = 0             # floats moved between pageable host memory and the device
        self.copied_bytes = {"download": 0, "upload": 0}    # by the copy verbs (pinned memory)
        self.in_step = self.host_reads_in_steps = 0     # CountedStep's
        self.current = [self.compute]       # the current stream (entered streams on top)
        self.pool = MemoryPool()
        self.xp = FAKE_CUPY

    @contextlib.contextmanager
    def installed(self):
        """Inside, sys.modules["cupy"] is FAKE_CUPY and this thread's device is this one
        (threads share the module; each thread's calls go to its own device)."""
        saved = sys.modules.get("cupy")
        sys.modules["cupy"] = FAKE_CUPY
        _LOCAL.stack = getattr(_LOCAL, "stack", []) + [self]
        try:
            yield self
        finally:
            _LOCAL.stack = _LOCAL.stack[:-1]
            if saved is not FAKE_CUPY:
                if saved is None:
                    sys.modules.pop("cupy", None)
                else:
                    sys.modules["cupy"] = saved

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    # -- scheduling ----------------------------------------------------------------

    def _order(self):
        return (self.copy, self.compute) if self.policy == "copies-early" else (self.compute, self.copy)

    def eager(self):
        """Run the policy's eager stream as far as it goes by itself."""
        if self.in_kernel:
            return
        first = self._order()[0]
        while first.runnable():
            first.run_one()

    def run_until(self, done):
        """Run queued work, the eager stream first, until done()."""
        while not done():
            stream = next((s for s in self._order() if s.runnable()), None)
            assert stream is not None, "deadlock: every stream waits for an event that is never reached"
            stream.run_one()

    def host_kernel(self):
        """A CuPy call from the host: it runs after the compute stream's queue (queue order)."""
        if not self.in_kernel:
            self.run_until(lambda: not self.compute.items)
            self.clock += 1                                 # it takes its time too

    def host_read(self):
        if not self.in_kernel:
            self.host_reads += 1
            self.host_reads_in_steps += bool(self.in_step)
            self.host_kernel()

    def count_pageable(self, x):
        """A copy of x between pageable host memory and the device: counted
        where it moves floats (data, not a mask, positions or a scalar read)."""
        if not self.in_kernel and x.dtype.kind == "f" and x.ndim > 0:
            self.pageable_bytes += x.nbytes

    def queue_kernel(self, fn, stream=None):
        (stream or self.compute).items.append(("run", fn))
        self.kernels_queued += 1
        self.eager()

    @property
    def kernels_pending(self):
        return sum(1 for kind, _ in self.compute.items if kind == "run")

    # -- CupyDevice's verbs --------------------------------------------------------

    def is_device(self, a):
        return isinstance(a, DeviceArray)

    def event(self, stream, timing=False):
        ev = Event()
        ev.recorded = True
        stream.items.append(("record", ev))
        self.eager()
        return ev

    def done(self, event):
        """Asked without waiting: the GPU moves on by one item meanwhile (the
        eager stream's first), as a real one runs while the host asks."""
        self.polls += 1
        if not event.reached and not self.in_kernel:
            stream = next((s for s in self._order() if s.runnable()), None)
            if stream is not None:
                stream.run_one()
        return event.reached

    def wait(self, stream, event):
        stream.wait_event(event)

    def host_wait(self, event):
        self.host_syncs.append("event")
        self.run_until(lambda: event.reached)

    def elapsed(self, start, end):
        self.run_until(lambda: end.reached)
        return (end.time - start.time) * 1e-3          # a kernel "takes" a millisecond

    def empty(self, shape, dtype):
        """From the pool, on the current stream (CupyDevice.empty: the compute stream)."""
        return self.pool.allocate(shape, dtype, self.current[-1])

    def pinned_empty(self, shape, dtype):
        return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -1, dtype)

    def download(self, a, host, stream):
        self.copied_bytes["download"] += a.nbytes
        a = self.pool.by_address(a)
        stream.items.append(("run", lambda: np.copyto(host, a)))
        self.eager()

    def upload(self, host, a, stream):
        self.copied_bytes["upload"] += a.nbytes
        a = self.pool.by_address(a)
        stream.items.append(("run", lambda: np.copyto(a, host)))   # reads `host` when it runs
        self.eager()

    def asarray(self, x):
        """A device copy of host data, made now (as a synchronous upload)."""
        a = self.pool.allocate(np.shape(x), np.asarray(x).dtype, self.current[-1])
        np.copyto(_host(a), x)
        return a

    def by_address(self, obj):
        """A step's argument (a dataclass or a named tuple of arrays) as a launch
        holds it: its device arrays by address (`MemoryPool.by_address`)."""
        if dataclasses.is_dataclass(obj):
            fields = [f.name for f in dataclasses.fields(obj) if f.init]
            return dataclasses.replace(obj, **self._addresses(obj, fields))
        return obj._replace(**self._addresses(obj, obj._fields))

    def _addresses(self, obj, names):
        return {name: self.pool.by_address(getattr(obj, name)) for name in names
                if isinstance(getattr(obj, name), DeviceArray)}

    @contextlib.contextmanager
    def counting_host_reads(self):
        """Host reads from now until the end are counted in host_reads_in_steps."""
        self.in_step += 1
        try:
            yield
        finally:
            self.in_step -= 1


class QueuedStep(Step):
    """A step whose tiles run as one kernel on the QueuedDevice's compute stream."""
    array_modules = ("cupy",)

    def __init__(self, gpu, inner="v1"):
        self.gpu, self.inner = gpu, get_step(inner)
        self.name, self.has_backward = f"queued {self.inner.name}", self.inner.has_backward
        self.has_dropout = self.inner.has_dropout          # its tiles are the inner step's, dropout and all

    def forward(self, acc, queries, block, *, tile_size, mask=None, causal=None, progress=None):
        queries, block, mask = self._with_mask(queries, block, mask, causal)
        plan, counts = self._plan(queries, block, mask, tile_size)
        acc.seen |= any_visible(queries.pos, block.pos, mask)
        acc, queries, launched = (self.gpu.by_address(x) for x in (acc, queries, self._launched(block)))
        self.gpu.queue_kernel(lambda: self.inner.forward_tiles(acc, queries, launched, plan))
        return counts

    def backward(self, grads, queries, rows, block, *, tile_size, mask=None, causal=None, progress=None):
        queries, block, mask = self._with_mask(queries, block, mask, causal)
        plan, counts = self._plan(queries, block, mask, tile_size)
        grads, queries, rows, launched = (self.gpu.by_address(x) for x in
                                          (grads, queries, rows, self._launched(block)))
        self.gpu.queue_kernel(lambda: self.inner.backward_tiles(grads, queries, rows, launched, plan))
        return counts

    @staticmethod
    def _launched(block):
        # a launch copies its arguments: the host values a step reads (the keys'
        # positions, the owner and its finiteness flag), the arrays' addresses
        assert isinstance(block.source, np.ndarray), "a block's owner and flag must be on the host"
        return block._replace(pos=np.array(block.pos), source=np.array(block.source))

    def _plan(self, queries, block, mask, tile_size):
        from reference.step import _count
        assert isinstance(block.pos, np.ndarray), "block positions must be on the host"
        plan, skipped = tile_plan(queries.pos, block.pos, self.tile(tile_size, queries.q.shape[-1]), mask)
        return plan, _count(plan, skipped, queries.pos, block.pos, mask)


class CountedStep(Step):
    """A step run from the host as it is, each of its CuPy calls a kernel on
    the QueuedDevice, its host reads counted in ``gpu.host_reads_in_steps``
    (a step that reads device memory on the host waits there for the GPU)."""

    def __init__(self, gpu, inner="v1"):
        self.gpu, self.inner = gpu, get_step(inner)
        self.name, self.has_backward = f"counted {self.inner.name}", self.inner.has_backward
        self.has_dropout, self.array_modules = self.inner.has_dropout, self.inner.array_modules

    def forward(self, *args, **kwargs):
        with self.gpu.counting_host_reads():
            return self.inner.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        with self.gpu.counting_host_reads():
            return self.inner.backward(*args, **kwargs)


# -- a process on a QueuedDevice ---------------------------------------------------------

_PROCESS_GPU = []      # the installed context of install_for_process, kept for the process's life


def stand_in_for_the_kernel(acc, queries, block, tile, causal):
    """gpu_impl.steps.fused.launch_kernel on NumPy: the readable step does the kernel's work."""
    from reference.step import ReadableStep
    ReadableStep().forward(acc, queries, block, causal=causal, tile_size=tile)


def stand_in_for_the_v2_kernel(acc, queries, block, plan):
    """gpu_impl.steps.fused_v2.launch_kernel on NumPy: the readable step at the
    kernel's tile, on K and V as float32 (from bfloat16's bits where they are uint16)."""
    from gpu_impl.steps.fused_v2 import float32_block
    from reference.step import ReadableStep
    tile = (plan.config.queries(queries.q.shape[3]), plan.config.bn)
    ReadableStep().forward(acc, queries, float32_block(block, None), mask=queries.mask, tile_size=tile)


def stand_in_for_the_v2_backward(grads, queries, rows, block, plan):
    """gpu_impl.steps.fused_v2.launch_backward_kernels on NumPy: the readable step at
    the kernels' tile, on K and V as float32."""
    from gpu_impl.steps.fused_v2 import float32_block
    from reference.step import ReadableStep
    tile = (plan.config.queries(queries.q.shape[3]), plan.config.bn)
    ReadableStep().backward(grads, queries, rows, float32_block(block, None), mask=queries.mask, tile_size=tile)


def install_for_process(policy=None):
    """This process's GPU is a QueuedDevice from now on (policy by local rank
    unless given): `import cupy` gives the fake, gpu_impl's CupyDevice is this
    device, and the fused kernels' launches run the readable step."""
    from gpu_impl import api, device
    from gpu_impl.steps import fused, fused_v2
    gpu = QueuedDevice(policy or POLICIES[(device.local_rank_from_env() or 0) % 2])
    installed = gpu.installed()
    installed.__enter__()
    _PROCESS_GPU.append(installed)
    api.CupyDevice = device.CupyDevice = lambda cupy, index: gpu
    fused.launch_kernel = stand_in_for_the_kernel
    fused_v2.launch_kernel = stand_in_for_the_v2_kernel
    fused_v2.launch_backward_kernels = stand_in_for_the_v2_backward
    return gpu


def main(argv):
    """python tests/support/gpu/queued_device.py (-m MODULE | SCRIPT) [ARGS...]: run it on a QueuedDevice."""
    if not argv or argv[0] == "-m" and len(argv) < 2:
        sys.exit("usage: python tests/support/gpu/queued_device.py (-m MODULE | SCRIPT) [ARGS...]")
    install_for_process()
    if argv[0] == "-m":
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
