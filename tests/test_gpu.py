"""gpu_impl: the ring on GPUs, checked against the dense reference; and, on a
machine without a GPU, everything that can be checked without one.

Without a GPU (CI):
- importing gpu_impl needs neither CuPy nor a GPU; calling it says which is missing;
- the transfer path decision and the rank -> GPU mapping;
- every data-movement path of `gpu_impl.transfer.DeviceRing` (staged through
  pinned buffers, and device buffers straight to MPI) with NumPy standing in
  for CuPy (`gpu_impl.device.NumpyDevice`): over a fake MPI of threads, and on
  real MPI ranks (tests/gpu/batch_worker.py --device numpy), forward and
  backward bit for bit equal to the virtual ring's, and MPI never reading a
  buffer before the device was synchronized;
- the public functions end to end with NumPy dressed as CuPy (a fake `cupy`
  module): the collective checks, CupyDevice's copies, the trace;
- the fused kernel's CUDA source compiles with nvcc for sm_90 (and NVRTC where
  its library is installed), and a syntax error fails that check;
- the fused kernel's logic: the same source compiled for the CPU
  (tests/gpu/emulate_cuda.cpp: a thread per CUDA thread, a barrier per block)
  against the plain step, for random cases.
With a GPU (`make gpu-check`): forward and backward against the dense
reference (conftest tolerances per dtype) for random hypothesis cases on 1, 2
and 4 ranks sharing one GPU, through both transfer paths; the fused kernel
against the plain step; the command line.

    .venv/bin/python -m pytest tests/test_gpu.py -q
"""

import dataclasses
import os
import queue
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import gpu_impl
from conftest import Case, assert_close, cases
from gpu_impl import fused
from gpu_impl.device import GpuUnavailable, NumpyDevice, device_for_local_rank
from gpu_impl.transfer import DeviceRing, choose_transfer
from reference import attention, attention_backward, cost, ring
from reference.ring import own_block
from reference.step import ForwardAcc, Queries, ReadableStep, finish_forward
from reference.tiles import any_visible
from reference.layouts import positions, shard, unshard
from reference.virtual import run_devices

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "gpu" / "batch_worker.py"
MPIEXEC = next((str(p) for p in (Path(sys.executable).parent / "mpiexec",) if p.exists()),
               shutil.which("mpiexec"))
NVCC = shutil.which("nvcc")
GXX = shutil.which("g++")
EMULATOR = Path(__file__).resolve().parent / "gpu" / "emulate_cuda.cpp"
LAUNCH_TIMEOUT_S = 180
CASES_PER_LAUNCH = 8


def _gpu_missing():
    """None where CuPy finds a GPU, else the reason (GpuUnavailable's message)."""
    try:
        gpu_impl.require_cupy()
    except GpuUnavailable as e:
        return str(e)
    return None


GPU_MISSING = _gpu_missing()
needs_gpu = pytest.mark.skipif(GPU_MISSING is not None, reason=f"needs a GPU: {GPU_MISSING}")
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")


# -- without CuPy or a GPU: clear errors ----------------------------------------

def test_import_needs_neither_cupy_nor_mpi4py():
    """`import gpu_impl` in a fresh interpreter where importing cupy fails."""
    code = ("import sys; sys.modules['cupy'] = None; import gpu_impl; "
            "assert 'mpi4py' not in sys.modules; print(gpu_impl.TRANSFERS)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    assert "cuda-aware" in proc.stdout


class OneRank:
    """A communicator of one rank with what `mpi_impl.agree` asks for."""
    def Get_rank(self): return 0
    def Get_size(self): return 1
    def allgather(self, x): return [x]
    def Dup(self): return self
    def Free(self): pass


def test_call_without_cupy_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)          # import cupy raises ImportError
    q = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(GpuUnavailable, match="needs CuPy, which is not installed.*cupy-cuda13x"):
        gpu_impl.ring_attention(q, q, q, comm=OneRank())
    with pytest.raises(GpuUnavailable, match="not installed"):
        gpu_impl.ring_attention_backward(q, q, q, q, np.zeros((1, 2, 4)), q, comm=OneRank())


def _fake_cupy(get_count):
    runtime = types.SimpleNamespace(getDeviceCount=get_count)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))


def test_call_without_gpu_says_so(monkeypatch):
    def no_driver():
        raise RuntimeError("cudaErrorInsufficientDriver")
    q = np.zeros((1, 4, 2, 8), np.float32)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(no_driver))
    with pytest.raises(GpuUnavailable, match="no usable CUDA device: RuntimeError: cudaErrorInsufficientDriver"):
        gpu_impl.ring_attention(q, q, q, comm=OneRank())
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(lambda: 0))
    with pytest.raises(GpuUnavailable, match="found no CUDA device"):
        gpu_impl.require_cupy()


@needs_mpiexec
@pytest.mark.skipif(GPU_MISSING is None, reason="a GPU is present")
def test_cli_without_gpu_exits_with_the_reason():
    proc = mpirun(1, "-m", "gpu_impl", "--seq-len", "16", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu_impl needs CuPy, which is not installed" in proc.stderr \
        or "gpu_impl found no" in proc.stderr, proc.stderr


# -- decisions: transfer path, rank -> GPU ----------------------------------------

def test_choose_transfer():
    assert choose_transfer("auto")[0] == "staged"            # mpi4py cannot ask MPI
    assert "cannot ask" in choose_transfer("auto")[1]
    assert choose_transfer("staged") == ("staged", "requested")
    assert choose_transfer("cuda-aware") == ("cuda-aware", "requested")
    with pytest.raises(ValueError, match="transfer must be one of"):
        choose_transfer("nccl")


def test_ranks_deal_over_gpus_by_local_rank():
    assert [device_for_local_rank(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]   # the docstring's table
    assert [device_for_local_rank(r, 1) for r in range(4)] == [0, 0, 0, 0]         # 4 ranks share one GPU
    with pytest.raises(GpuUnavailable):
        device_for_local_rank(0, 0)
    with pytest.raises(ValueError, match="local_rank"):
        device_for_local_rank(-1, 2)


# -- transfers with NumPy standing in for CuPy, over a fake MPI of threads --------

class FakeRequest:
    def __init__(self, wait=lambda: None):
        self.Wait = wait


class FakeComm:
    """Isend / Irecv between threads: a send copies the bytes into the receiver's
    mailbox for (source, tag); a receive's Wait copies them into its buffer.
    Records ("Isend", index) in `events`, like tests/gpu/batch_worker.py."""

    def __init__(self, rank, size, boxes, events):
        self.rank, self.size, self.boxes, self.events = rank, size, boxes, events

    def Get_rank(self): return self.rank
    def Get_size(self): return self.size

    def Isend(self, buf, dest, tag):
        assert buf.dtype == np.uint8 and buf.ndim == 1
        self.events.append(("Isend", tag % 16))
        self.boxes[dest][(self.rank, tag)].put(buf.copy())
        return FakeRequest()

    def Irecv(self, buf, source, tag):
        def wait():
            buf[...] = self.boxes[self.rank][(source, tag)].get(timeout=10)
        return FakeRequest(wait)


def fake_world(n):
    boxes = [dict() for _ in range(n)]
    for box in boxes:
        for src in range(n):
            for tag in range(64):
                box[(src, tag)] = queue.Queue()
    return boxes


def run_ring(n, transfer, device_fn):
    """device_fn(rank, DeviceRing over FakeComm with a NumpyDevice, events) on n threads."""
    boxes = fake_world(n)

    def one(rank, _virtual):
        events = []
        dev = NumpyDevice(events)
        return device_fn(rank, DeviceRing(FakeComm(rank, n, boxes, events), dev, transfer), dev, events)

    return run_devices(n, one)


def sends_follow_synchronize(events):
    """The batch worker's check of the event order (one definition for both)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_batch_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker.sends_follow_synchronize(events)


@pytest.mark.parametrize("transfer", ["staged", "cuda-aware"])
def test_device_ring_passes_blocks_round_the_ring(transfer):
    """Three rounds on 3 ranks with two tags in flight at once: every rank gets
    its left neighbour's arrays intact (float16 and int64), the staged path
    allocates a pinned (send, recv) pair per array once and hands out copies, the
    cuda-aware path never stages, and every shift follows a synchronize."""
    n, rounds = 3, 3

    def device(rank, ring_comm, dev, events):
        kv = (np.full((2, 5), rank, np.float16), np.arange(3, dtype=np.int64) + 10 * rank)
        grads = (np.full((4,), -rank, np.float32),)
        for t in range(rounds):
            h1, h2 = ring_comm.start_shift(kv, ring.KV), ring_comm.start_shift(grads, ring.DKV)
            new_kv, new_grads = ring_comm.finish_shift(h1), ring_comm.finish_shift(h2)
            src = (rank - t - 1) % n
            np.testing.assert_array_equal(new_kv[0], np.full((2, 5), src, np.float16))
            np.testing.assert_array_equal(new_kv[1], np.arange(3) + 10 * src)
            assert new_kv[0].dtype == np.float16 and new_grads[0].dtype == np.float32
            np.testing.assert_array_equal(new_grads[0], np.full((4,), -src, np.float32))
            pinned = [b for bufs in ring_comm._pinned.values() for b in bufs]
            assert not any(np.shares_memory(a, p) for a in new_kv + new_grads for p in pinned)
            kv, grads = new_kv, new_grads
        return dev.pinned_allocations, events

    for allocations, events in run_ring(n, transfer, device):
        assert sends_follow_synchronize(events), events
        if transfer == "staged":
            assert allocations == 2 * 3                   # (send, recv) x 3 arrays, in round 0 only
            assert events.count("download") == events.count("upload") == rounds * 3
        else:
            assert allocations == 0 and "download" not in events and "upload" not in events


def test_non_contiguous_blocks():
    """Device buffers go to MPI as byte views, which a strided array has not:
    the cuda-aware path refuses it; the staged path copies it into its
    contiguous pinned buffer and delivers it intact."""
    block = np.arange(16.0).reshape(4, 4)[:, ::2]

    def cuda_aware(rank, ring_comm, dev, events):
        with pytest.raises(ValueError, match="C-contiguous"):
            ring_comm.start_shift((block,), ring.KV)

    def staged(rank, ring_comm, dev, events):
        return ring_comm.finish_shift(ring_comm.start_shift((block,), ring.KV))[0]

    run_ring(1, "cuda-aware", cuda_aware)
    np.testing.assert_array_equal(run_ring(1, "staged", staged)[0], block)


def virtual_ring_results(case):
    """out, lse, dq, dk, dv of the oracle (reference.virtual: the same ring and step
    over VirtualRing, with the step the NumPy path chooses), in natural token order."""
    import reference
    q, k, v, dout = case.inputs()
    out, lse = reference.ring_attention(q, k, v, step="auto", **case.options())
    return (out, lse) + reference.ring_attention_backward(q, k, v, out, lse, dout, step="auto",
                                                          **case.options())


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(max_devices=4))
def test_ring_through_device_ring_equals_the_virtual_ring(case):
    """reference.ring over DeviceRing (both paths, NumPy standing in for CuPy)
    gives exactly the virtual ring's results: moving the blocks through pinned
    buffers or as device buffers changes no bit."""
    q, k, v, dout = case.inputs()
    want = virtual_ring_results(case)
    pos = positions(case.S, case.n_devices, case.layout)
    shards = [shard(x, case.n_devices, case.layout) for x in (q, k, v, dout)]
    scale = case.scale if case.scale is not None else case.D ** -0.5
    for transfer in ("staged", "cuda-aware"):
        def device(j, ring_comm, dev, events):
            qj, kj, vj, dj = (s[j] for s in shards)
            kw = dict(causal=case.causal, scale=scale, tile_size=case.tile_size)
            out, lse, _ = ring.ring_forward(qj, kj, vj, pos[j], pos[j], ring_comm, **kw)
            grads = ring.ring_backward(qj, kj, vj, out, lse, dj, pos[j], pos[j], ring_comm, **kw)[:3]
            return (out, lse) + grads
        got = run_ring(case.n_devices, transfer, device)
        for i, (name, w) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), want)):
            axis = 2 if name == "lse" else 1
            np.testing.assert_array_equal(unshard([g[i] for g in got], case.layout, axis=axis), w,
                                          err_msg=f"{name} ({transfer}) of {case}")


# -- the public functions end to end, NumPy dressed as CuPy ----------------------------

class FakeDeviceArray(np.ndarray):
    """A NumPy array that says it is CuPy's (reference.layouts.array_module reads
    the type's module), with the few CuPy methods gpu_impl calls."""
    __module__ = "cupy"
    device = types.SimpleNamespace(id=0)

    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is None:
            return np.array(self)
        np.copyto(out, self)
        return out

    def set(self, arr, stream=None):
        np.copyto(self, arr)


class FakeStream:
    def __init__(self, null=False, non_blocking=False):
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _on_device(obj):
    """NumPy's function `obj`, returning FakeDeviceArray where it returns arrays
    (types such as np.float32 pass through: they are dtypes too)."""
    if not callable(obj) or isinstance(obj, type):
        return obj

    def wrapped(*args, **kwargs):
        result = obj(*args, **kwargs)
        return result.view(FakeDeviceArray) if type(result) is np.ndarray else result
    return wrapped


def fake_cupy_module():
    """A module named cupy: NumPy's functions, device arrays that are FakeDeviceArray."""
    cupy = types.ModuleType("cupy")
    cupy.__getattr__ = lambda name: _on_device(getattr(np, name))
    cupy.ndarray = FakeDeviceArray
    cupy.asarray = lambda x, dtype=None: np.array(x, dtype=dtype).view(FakeDeviceArray)
    cupy.empty = lambda shape, dtype=float: np.empty(shape, dtype).view(FakeDeviceArray)
    cupy.asnumpy = np.asarray
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1,
                                    getDeviceProperties=lambda i: {"name": b"FakeGPU"})
    current = FakeStream()
    cupy.cuda = types.SimpleNamespace(runtime=runtime, Stream=FakeStream, Device=lambda i=0: FakeStream(),
                                      get_current_stream=lambda: current)
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype=float: np.empty(shape, dtype)
    return cupy, cupyx


class ThreadComm(FakeComm):
    """FakeComm plus what `mpi_impl.agree` and gpu_impl.api ask for: allgather
    (every thread's value, in rank order), Dup and Free."""

    def __init__(self, rank, size, boxes, events, gathered, barrier):
        super().__init__(rank, size, boxes, events)
        self.gathered, self.barrier = gathered, barrier

    def allgather(self, x):
        self.barrier.wait()
        self.gathered[self.rank] = x
        self.barrier.wait()
        result = list(self.gathered)
        self.barrier.wait()
        return result

    def Dup(self):
        return self

    def Free(self):
        pass


@pytest.mark.parametrize("transfer, step_name", [("auto", "auto"), ("cuda-aware", "v1"), ("staged", "fused")])
def test_public_functions_end_to_end_with_numpy_dressed_as_cupy(monkeypatch, transfer, step_name):
    """gpu_impl.ring_attention and ring_attention_backward, everything but the GPU:
    the collective checks, CupyDevice's streams and copies, DeviceRing, the
    trace; 3 ranks as threads, results equal to the dense reference. With
    step='fused' the ring must launch the fused kernel (here the readable step
    in its place, counted: CUDA cannot run on NumPy)."""
    import threading
    from reference.step import ReadableStep
    cupy, cupyx = fake_cupy_module()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    calls = []

    def stand_in_for_the_kernel(acc, queries, block, tile, causal):
        calls.append(1)
        ReadableStep().forward(acc, queries, block, causal=causal, tile_size=tile)
    monkeypatch.setattr(fused, "launch_kernel", stand_in_for_the_kernel)
    n, layout = 3, "striped"
    dtype = np.float32 if step_name == "fused" else np.float64
    case = Case(layout=layout, n_devices=n, B=1, S=12, Hq=4, Hkv=2, D=4, tile_size=2, causal=True,
                scale=None, dtype=dtype, kind="gaussian", seed=3)
    q, k, v, dout = case.inputs()
    out, lse = attention(q, k, v)
    want = (out, lse) + attention_backward(q, k, v, out, lse, dout)
    shards = [[cupy.asarray(s) for s in shard(x, n, layout)] for x in (q, k, v, dout)]
    boxes, gathered, barrier = fake_world(n), [None] * n, threading.Barrier(n)

    def device(j, _virtual):
        comm = ThreadComm(j, n, boxes, [], gathered, barrier)
        qj, kj, vj, dj = (s[j] for s in shards)
        o, l, trace = gpu_impl.ring_attention(qj, kj, vj, comm=comm, layout=layout, tile_size=2,
                                              transfer=transfer, step=step_name, trace=True)
        grads = gpu_impl.ring_attention_backward(qj, kj, vj, o, l, dj, comm=comm, layout=layout,
                                                 tile_size=2, transfer=transfer)
        return (o, l) + grads, trace

    results = run_devices(n, device)
    for i, (name, w) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), want)):
        axis = 2 if name == "lse" else 1
        got = unshard([np.asarray(r[0][i]) for r in results], layout, axis=axis)
        assert_close(got, w, dtype, what=name)
    trace = results[0][1]
    np.testing.assert_array_equal(trace.pairs, cost.predict(12, n, layout, 2).pairs)
    assert len(calls) == (n * n if step_name == "fused" else 0)        # N rounds on each of N ranks


# -- real MPI ranks: the batch worker ------------------------------------------------

def mpirun(n, *args, timeout=LAUNCH_TIMEOUT_S):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1", MPIEXEC_TIMEOUT=str(timeout))
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py"] + list(args)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout + 30)


def draw_cases(n, count, dtypes=None):
    """`count` hypothesis cases on n ranks (the conftest strategy, N fixed)."""
    drawn = []
    strategy = cases(max_devices=4) if dtypes is None else cases(max_devices=4, dtypes=dtypes)

    @settings(max_examples=count, database=None, deadline=None,
              suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
    @given(strategy.filter(lambda c: c.n_devices == n))
    def collect(case):
        drawn.append(case)

    collect()
    return list(dict.fromkeys(drawn))


def run_batch(n, batch, tmp_path, *worker_args):
    import json
    spec, data = [], {}
    for i, case in enumerate(batch):
        for name, x in zip(("q", "k", "v", "dout"), case.inputs()):
            data[f"{i}/{name}"] = x
        spec.append(dict(id=str(i), layout=case.layout, causal=case.causal, scale=case.scale,
                         tile_size=list(case.tile_size) if isinstance(case.tile_size, tuple) else case.tile_size))
    paths = [tmp_path / name for name in ("cases.json", "inputs.npz", "results.npz")]
    paths[0].write_text(json.dumps(spec))
    np.savez(paths[1], **data)
    proc = mpirun(n, str(WORKER), *map(str, paths), *worker_args)
    assert proc.returncode == 0, f"batch on {n} ranks failed:\n{proc.stdout}\n{proc.stderr}"
    return np.load(paths[2])


def assert_batch(batch, results):
    for i, case in enumerate(batch):
        q, k, v, dout = case.inputs()
        out, lse = attention(q, k, v, causal=case.causal, scale=case.scale)
        want = (out, lse) + attention_backward(q, k, v, out, lse, dout, causal=case.causal, scale=case.scale)
        for name, w in zip(("out", "lse", "dq", "dk", "dv"), want):
            got = results[f"{i}/{name}"]
            assert got.dtype == w.dtype, f"{case}: {name} dtype {got.dtype} != {w.dtype}"
            factor = case.tolerance_factor if name in ("out", "lse") else case.grad_tolerance_factor
            assert_close(got, w, case.dtype, what=f"{name} of {case}", factor=factor)
        p = cost.predict(case.S, case.n_devices, case.layout, case.tile_size, case.causal)
        np.testing.assert_array_equal(results[f"{i}/source"], p.source)


@needs_mpiexec
@pytest.mark.parametrize("transfer", ["staged", "cuda-aware"])
@pytest.mark.parametrize("n", [1, 3])
def test_mpi_ranks_with_numpy_standing_in(n, transfer, tmp_path):
    """DeviceRing on real MPI ranks, NumPy standing in for CuPy: random cases
    give exactly the virtual ring's results, sends follow a synchronize, local
    ranks are 0..n-1 on this one node."""
    batch = draw_cases(n, 6)
    results = run_batch(n, batch, tmp_path, "--device", "numpy", "--transfer", transfer)
    for i, case in enumerate(batch):
        for name, want in zip(("out", "lse", "dq", "dk", "dv"), virtual_ring_results(case)):
            np.testing.assert_array_equal(results[f"{i}/{name}"], want, err_msg=f"{name} of {case}")
    assert bool(results["order_ok"])
    np.testing.assert_array_equal(results["local_ranks"], np.arange(n))


# -- the fused kernel's source -------------------------------------------------------

def nvcc_compile(source, head_dim, tile, out):
    opts = [o for o in fused.compile_options(head_dim, tile) if o != "-std=c++17"]
    return subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-cubin", *opts, "-o", str(out), str(source)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("head_dim, tile", [(16, (64, 32)), (64, fused.DEFAULT_TILE), (128, (32, 16))])
def test_fused_kernel_compiles_with_nvcc(head_dim, tile, tmp_path):
    proc = nvcc_compile(fused.SOURCE, head_dim, tile, tmp_path / "k.cubin")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "k.cubin").stat().st_size > 0


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_nvcc_check_catches_a_syntax_error(tmp_path):
    """The compile check can fail: the same source with one bracket removed does not compile."""
    broken = tmp_path / "broken.cu"
    broken.write_text(fused.kernel_source().replace("m_r = m_new;\n    }", "m_r = m_new;\n", 1))
    proc = nvcc_compile(broken, 64, fused.DEFAULT_TILE, tmp_path / "k.cubin")
    assert proc.returncode != 0 and "error" in proc.stderr


def test_fused_kernel_compiles_with_nvrtc():
    """NVRTC (CuPy's runtime compiler) needs no GPU, only its library."""
    try:
        from cupy.cuda import nvrtc
    except ImportError as e:
        pytest.skip(f"cupy not installed: {e}")
    try:
        nvrtc.getVersion()
    except Exception as e:      # noqa: BLE001 - CuPy reports a missing library in several ways
        pytest.skip(f"NVRTC library not available: {e}")
    prog = nvrtc.createProgram(fused.kernel_source(), "attend_block_v1.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=sm_90", *fused.compile_options(64, fused.DEFAULT_TILE)])
    except nvrtc.NVRTCError as e:
        pytest.fail(f"NVRTC: {e}\n{nvrtc.getProgramLog(prog)}")
    assert len(nvrtc.getCUBIN(prog)) > 0


# The kernel's logic without a GPU: the same .cu source compiled for the CPU by
# tests/gpu/emulate_cuda.cpp (a std::thread per CUDA thread, a std::barrier per
# block), against the plain step. (D, tile) pairs: small square tiles, the
# default tile with an odd head dim, odd rectangular tiles.
EMULATED = [(16, (8, 4)), (5, fused.DEFAULT_TILE), (8, (3, 7))]


@pytest.fixture(scope="module")
def emulated_kernels(tmp_path_factory):
    """{(D, tile): the fused kernel's launch function, compiled for the CPU}."""
    import ctypes
    if GXX is None:
        pytest.skip("g++ not found")
    kernels = {}
    for head_dim, (tq, tk) in EMULATED:
        lib = tmp_path_factory.mktemp("emulated") / f"attend_d{head_dim}_{tq}x{tk}.so"
        proc = subprocess.run([GXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas",
                               f"-I{ROOT}", f"-DHEAD_DIM={head_dim}", f"-DTQ={tq}", f"-DTK={tk}",
                               f'-DKERNEL="{fused.SOURCE}"', "-o", str(lib), str(EMULATOR)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        kernels[head_dim, (tq, tk)] = ctypes.CDLL(str(lib)).launch_attend_block_v1
    return kernels


def emulated_attend_block(launch, acc, q, k, v, q_pos, k_pos, *, causal, tile):
    """fused.attend_block's launch, on the CPU: the same grid and arguments."""
    import ctypes
    B, Hkv, c, G, D = q.shape
    arrays = [np.ascontiguousarray(x) for x in (q, k, v, q_pos.astype(np.int64), k_pos.astype(np.int64))]
    pointers = [x.ctypes.data_as(ctypes.c_void_p) for x in arrays + [acc.o, acc.m, acc.l]]
    ints = [ctypes.c_int(i) for i in (c, k.shape[2], G, int(causal))]
    grid = [ctypes.c_int(i) for i in ((c + tile[0] - 1) // tile[0], G, B * Hkv)]
    launch(*grid, *pointers, *ints)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("head_dim, tile", EMULATED)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(max_devices=4, dtypes=(np.float32,)))
def test_fused_kernel_emulated_on_cpu_matches_plain_step(emulated_kernels, head_dim, tile, case):
    """The fused kernel's source, run on the CPU, accumulates every rank's block
    into device 0's queries, round after round, to the plain step's out and lse
    (rows that see no key: out 0, lse -inf, no NaN)."""
    case = dataclasses.replace(case, D=head_dim)
    q, k, v, _ = case.inputs()
    pos = positions(case.S, case.n_devices, case.layout)
    scale = np.float32(case.scale if case.scale is not None else case.D ** -0.5)
    queries = Queries.prepare(shard(q, case.n_devices, case.layout)[0], case.Hkv, pos[0], scale)
    accs = ForwardAcc.zeros(queries.q), ForwardAcc.zeros(queries.q)
    for j in range(case.n_devices):
        block = own_block(*(shard(x, case.n_devices, case.layout)[j] for x in (k, v)), pos[j], j)
        ReadableStep().forward(accs[0], queries, block, causal=case.causal, tile_size=tile)
        accs[1].seen |= any_visible(queries.pos, pos[j], case.causal)      # what Step.forward notes
        emulated_attend_block(emulated_kernels[head_dim, tile], accs[1], queries.q, block.k, block.v,
                              pos[0], pos[j], causal=case.causal, tile=tile)
    (o0, l0), (o1, l1) = (finish_forward(a) for a in accs)
    assert not np.isnan(o1).any() and not np.isnan(l1).any()
    assert_close(o1, o0, np.float32, f"out of {case}", factor=case.tolerance_factor)
    assert_close(l1, l0, np.float32, f"lse of {case}", factor=case.tolerance_factor)


def test_fused_options_are_checked():
    assert fused.fused_tile(None, 64) == fused.DEFAULT_TILE
    with pytest.raises(ValueError, match="does not fit step='fused'"):
        fused.fused_tile(256, 128)                          # 2 * 256 * 128 * 4 bytes of shared memory
    with pytest.raises(ValueError, match="tile_size must be"):
        fused.fused_tile(0, 64)
    with pytest.raises(ValueError, match="use step='v1' for float64"):
        fused.check_dtype(np.float64)
    fused.check_dtype(np.float16)


def test_fused_kernel_is_a_registered_forward_only_step():
    """step='fused' names the fused kernel's Step, which has no backward."""
    from reference import steps
    step = steps.get("fused")
    assert isinstance(step, fused.FusedStep) and not step.has_backward
    with pytest.raises(ValueError, match="computes with cupy"):
        steps.check_step("fused", np)


# -- make gpu-check and the benchmark, without a GPU ----------------------------------

@pytest.mark.skipif(GPU_MISSING is None, reason="a GPU is present")
def test_gpu_check_script_fails_clearly_without_gpu():
    """No GPU: the script stops with status 2 and the reason, checking nothing."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--no-install"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no usable GPU here, nothing was checked" in proc.stderr
    assert "GPU tests" not in proc.stdout


@pytest.mark.skipif(GPU_MISSING is None, reason="a GPU is present")
def test_gpu_bench_says_no_gpu():
    from bench import gpu_bench
    text, pngs = gpu_bench.run(quick=True)
    assert text.startswith("No GPU here") and "make gpu-check" in text and pngs == []


class NumpyAsCupy:
    """NumPy under CuPy's names, for the benchmark's GPU formula on a CPU."""
    def __getattr__(self, name):
        return getattr(np, name)

    asnumpy = staticmethod(np.asarray)


def test_gpu_bench_reference_formula_and_table():
    """The benchmark's float64 dense formula equals reference.attention, and its
    table divides as it says: speed-up over contiguous, TFLOP/s on useful FLOPs."""
    from bench import gpu_bench
    gpu_bench.check_dense_gpu(NumpyAsCupy())
    cfg = dict(gpu_bench.QUICK, seq_len=1024, heads=2, head_dim=4, ranks=4)
    doc = {"gpus": 1, "transfer": "staged", "step": "auto",
           "layouts": {"contiguous": {"seconds": 0.004, "max_error": 1e-7},
                       "striped": {"seconds": 0.002, "max_error": 2e-7}}}
    table = gpu_bench.ring_table(doc, cfg, blas32=10.0)
    flops = 4 * 4 * (1024 * 1025 // 2) * 2
    assert gpu_bench.useful_flops(1024, 1, 2, 4) == flops
    striped = next(line for line in table.splitlines() if line.startswith("| striped"))
    cells = [c.strip() for c in striped.strip("|").split("|")]
    assert cells[3] == "2.00" and cells[4] == f"{flops / 0.002 / 1e12:.2f}"


# -- on a GPU ------------------------------------------------------------------------

@needs_gpu
@needs_mpiexec
@pytest.mark.parametrize("transfer", ["staged", "cuda-aware"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_gpu_ring_matches_reference(n, transfer, tmp_path):
    """Random cases (every layout, dtype, GQA, causal or not) on n ranks sharing
    the GPUs: forward and backward equal the dense reference. The cuda-aware
    path runs on managed memory, which any MPI can read, so it is tested even
    where the MPI library is not CUDA-aware."""
    batch = draw_cases(n, CASES_PER_LAUNCH)
    extra = ["--managed"] if transfer == "cuda-aware" else []
    results = run_batch(n, batch, tmp_path, "--device", "cupy", "--transfer", transfer, *extra)
    assert_batch(batch, results)


@needs_gpu
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(max_devices=4, dtypes=(np.float32,)))
def test_fused_step_matches_plain_step(case):
    """The fused kernel against the readable step (reference/step.py on CuPy),
    block after block as in the ring's rounds: the same out and lse. (Both
    steps' tile counts come from the same plan, so they are not compared.)"""
    import cupy
    from reference import steps
    q, k, v, _ = case.inputs()
    pos = positions(case.S, case.n_devices, case.layout)
    scale = case.scale if case.scale is not None else case.D ** -0.5
    queries = Queries.prepare(cupy.asarray(shard(q, case.n_devices, case.layout)[0]), case.Hkv, pos[0], scale)
    tile = fused.fused_tile(case.tile_size if case.tile_size else None, case.D)
    accs = ForwardAcc.zeros(queries.q), ForwardAcc.zeros(queries.q)
    for j in range(case.n_devices):                          # the blocks of every rank, in ring order
        block = own_block(*(cupy.asarray(shard(x, case.n_devices, case.layout)[j]) for x in (k, v)), pos[j], j)
        steps.get("v1").forward(accs[0], queries, block, causal=case.causal, tile_size=tile)
        steps.get("fused").forward(accs[1], queries, block, causal=case.causal, tile_size=tile)
    (o0, l0), (o1, l1) = (finish_forward(a) for a in accs)
    assert_close(cupy.asnumpy(o1), cupy.asnumpy(o0), np.float32, "out", factor=case.tolerance_factor)
    assert_close(cupy.asnumpy(l1), cupy.asnumpy(l0), np.float32, "lse", factor=case.tolerance_factor)


@needs_gpu
@needs_mpiexec
def test_gpu_ring_with_fused_kernel_matches_reference(tmp_path):
    batch = draw_cases(2, CASES_PER_LAUNCH, dtypes=(np.float32, np.float16))
    batch = [c for c in batch if fused_fits(c)]
    results = run_batch(2, batch, tmp_path, "--device", "cupy", "--transfer", "staged", "--step", "fused")
    assert_batch(batch, results)


def fused_fits(case):
    try:
        fused.fused_tile(case.tile_size, case.D)
    except ValueError:
        return False
    return True


@needs_gpu
def test_gpu_calls_leave_their_inputs_untouched():
    """Forward then backward on the same arrays, multi-query heads (Hkv = 1)."""
    import cupy
    rng = np.random.default_rng(0)
    q, dout = (cupy.asarray(rng.standard_normal((1, 8, 2, 4)), dtype=cupy.float32) for _ in range(2))
    k, v = (cupy.asarray(rng.standard_normal((1, 8, 1, 4)), dtype=cupy.float32) for _ in range(2))
    from mpi4py import MPI
    before = [x.copy() for x in (q, k, v, dout)]
    out, lse = gpu_impl.ring_attention(q, k, v, comm=MPI.COMM_SELF)
    gpu_impl.ring_attention_backward(q, k, v, out, lse, dout, comm=MPI.COMM_SELF)
    for x, y in zip((q, k, v, dout), before):
        assert bool((x == y).all())


@needs_gpu
def test_gpu_rejects_numpy_and_float64_fused():
    import cupy
    q = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(TypeError, match="must be a CuPy array"):
        gpu_impl.ring_attention(q, q, q, comm=OneRank())
    qd = cupy.zeros((1, 4, 2, 8), np.float64)
    with pytest.raises(ValueError, match="step must be one of"):
        gpu_impl.ring_attention(qd, qd, qd, comm=OneRank(), step="cublas")
    with pytest.raises(ValueError, match="float64"):
        gpu_impl.ring_attention(qd, qd, qd, comm=OneRank(), step="fused")


@needs_gpu
@needs_mpiexec
def test_cli_on_gpu_checks_every_layout():
    proc = mpirun(2, "-m", "gpu_impl", "--seq-len", "64", "--heads", "2", "--head-dim", "16",
                  "--dtype", "float64", "--tile-size", "8", "--layout", "all", "--check", "--backward")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "transfer staged" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["contiguous"], ["striped"], ["zigzag"])]
    assert [r[0] for r in rows] == ["contiguous", "striped", "zigzag"], proc.stdout
    assert all(float(r[1]) <= 1e-10 for r in rows), proc.stdout

