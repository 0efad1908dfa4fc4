"""gpu_impl: the ring on GPUs, checked against the dense reference; and, on a
machine without a GPU, everything that can be checked without one.

Without a GPU (CI):
- importing gpu_impl needs neither CuPy nor a GPU; calling it says which is missing;
- the transfer path: auto asks the MPI library (MPIX_Query_cuda_support, the
  installed mpich wheel answers 0), cuda-aware from a library that says no
  fails at once; the rank -> GPU mapping from the launcher's environment;
- `mpi_impl.comm.RingComm` with the GPU memory objects (`gpu_impl.transfer`:
  staged through pinned buffers, and device buffers straight to MPI) on a GPU
  made of NumPy whose streams really run later (tests/support/gpu/queued_device.py),
  copies as early or kernels as early as CUDA allows, and whose memory pool
  hands freed memory out again at once, as CuPy's: over a fake MPI of
  threads and on real MPI ranks (tests/support/gpu/batch_worker.py --device queued),
  forward and backward bit for bit equal to the virtual ring's; neither pass
  waits for a round's kernels before its K, V transfer (overlap), and no step
  reads device memory on the host;
- the public functions end to end on that GPU (the collective checks, the
  transfer choice, mpi_impl's path, the trace);
- the fused kernel's CUDA source compiles with nvcc for sm_90 (and NVRTC where
  its library is installed), float32 and float16 blocks, and a syntax error
  fails that check;
- the fused kernel's logic: the same source compiled for the CPU
  (tests/support/gpu/emulate_cuda.cpp: a fiber per CUDA thread, run up to each barrier)
  against the plain step, for random cases, at D = 64 and 128, float16 blocks,
  NaN and inf where the NaN rule decides; its argument checks;
With a GPU (`make gpu-check`): forward and backward against the dense
reference (conftest tolerances per dtype) for random hypothesis cases on 1, 2
and 4 ranks sharing one GPU, through both transfer paths; the fused kernel
against the plain step; the command line.

    .venv/bin/python -m pytest tests/gpu/test_gpu.py -q
"""

import dataclasses
import os
import shutil
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import gpu_impl
from conftest import Case, assert_close, cases
from gpu_impl.steps import fused
from gpu_impl.device import GpuUnavailable, device_for_local_rank, local_rank_from_env
from gpu_impl.transfer import choose_transfer, memory_for
from mpi_impl.comm import RingComm
from mpi_impl.launch import find_mpiexec
from reference import attention, attention_backward, cost, ring
from reference.ring import own_block
from reference.step import ForwardAcc, Queries, ReadableStep, finish_forward
from reference.tiles import any_visible
from reference.layouts import positions, shard, unshard
from reference.masks import CAUSAL, as_mask
from reference.virtual import run_devices

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support" / "gpu"))
from queued_device import POLICIES, CountedStep, QueuedDevice, QueuedStep  # noqa: E402
from strict_comm import ThreadMPI, World  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "support" / "gpu" / "batch_worker.py"
MPIEXEC = find_mpiexec()
NVCC = shutil.which("nvcc")
GXX = shutil.which("g++")
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
_skip_without_gpu = pytest.mark.skipif(GPU_MISSING is not None, reason=f"needs a GPU: {GPU_MISSING}")


def needs_gpu(test):
    """Marked `gpu` (make gpu-check selects these and fails on any skip) and skipped without one."""
    return pytest.mark.gpu(_skip_without_gpu(test))
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

def test_choose_transfer_asks_the_library():
    """auto follows MPI's answer; cuda-aware from a library that says no fails at
    once and says why; staged and cuda-aware-unchecked never ask."""
    assert choose_transfer("auto", 1) == ("cuda-aware", "auto: MPIX_Query_cuda_support() = 1")
    assert choose_transfer("auto", 0) == ("staged", "auto: MPIX_Query_cuda_support() = 0")
    assert choose_transfer("auto", None)[0] == "staged"
    assert "cannot be asked" in choose_transfer("auto", None)[1]
    assert choose_transfer("cuda-aware", 1)[0] == "cuda-aware"
    assert choose_transfer("cuda-aware", None)[0] == "cuda-aware"       # cannot ask: trust the caller
    with pytest.raises(ValueError, match=r"says it is not CUDA-aware \(MPIX_Query_cuda_support\(\) returned 0\)"
                                         r".*transfer='staged'"):
        choose_transfer("cuda-aware", 0)
    assert choose_transfer("staged", 0) == ("staged", "requested")
    assert choose_transfer("cuda-aware-unchecked", 0)[0] == "cuda-aware"
    with pytest.raises(ValueError, match="transfer must be one of"):
        choose_transfer("nccl")


@needs_mpiexec
def test_mpich_wheel_says_it_is_not_cuda_aware():
    """The installed MPI answers through ctypes (here the mpich wheel: 0), so
    auto stages and cuda-aware fails with the reason (a fresh process: asking
    initializes MPI)."""
    code = ("import gpu_impl; print(gpu_impl.mpi_cuda_support()); print(gpu_impl.choose_transfer('auto')[0])\n"
            "try:\n    gpu_impl.choose_transfer('cuda-aware')\nexcept ValueError as e:\n    print('refused:', e)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    answer, path, refusal = proc.stdout.splitlines()[:3]
    assert answer in ("0", "1"), proc.stdout
    if answer == "0":
        assert path == "staged" and refusal.startswith("refused:") and "not CUDA-aware" in refusal


def test_ranks_deal_over_gpus_by_local_rank():
    assert [device_for_local_rank(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]   # the docstring's table
    assert [device_for_local_rank(r, 1) for r in range(4)] == [0, 0, 0, 0]         # 4 ranks share one GPU
    with pytest.raises(GpuUnavailable):
        device_for_local_rank(0, 0)
    with pytest.raises(ValueError, match="local_rank"):
        device_for_local_rank(-1, 2)


def test_local_rank_comes_from_the_launcher_before_mpi():
    assert local_rank_from_env({"OMPI_COMM_WORLD_LOCAL_RANK": "3"}) == 3
    assert local_rank_from_env({"MPI_LOCALRANKID": "2", "SLURM_LOCALID": "5"}) == 2     # Hydra first
    assert local_rank_from_env({"SLURM_LOCALID": "1"}) == 1
    assert local_rank_from_env({"PMI_RANK": "4"}) is None                                 # a global rank
    assert local_rank_from_env({"SLURM_LOCALID": ""}) is None


# -- the ring on a GPU whose streams run later (tests/support/gpu/queued_device.py) ---------

class FakeComm(ThreadMPI):
    """Isend / Irecv between threads (tests/support/strict_comm.py), reading and
    writing buffers outside any stream order, as MPI does: the receiver copies
    the sender's buffer when its receive completes (as late as MPI may read
    it), and the sender's send completes only then."""

    def __init__(self, rank, size, world):
        assert size == world.n
        super().__init__(rank, world)


def fake_world(n):
    """The threads' mailboxes."""
    return World(n)


def _waitall(requests):
    for r in requests:
        r.Wait()


@pytest.fixture
def fake_mpi(monkeypatch):
    """`from mpi4py import MPI` gives what RingComm asks of it for FakeComm
    (MPI.BYTE, MPI.Request.Waitall), and MPI is never started in this process."""
    mpi = types.ModuleType("mpi4py.MPI")
    mpi.BYTE = "BYTE"
    mpi.Request = types.SimpleNamespace(Waitall=_waitall)
    package = types.ModuleType("mpi4py")
    package.MPI = mpi
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)


def run_ring(n, transfer, policy, device_fn):
    """device_fn(rank, RingComm over FakeComm with the transfer's memory object
    on a QueuedDevice, the device) on n threads, the fake cupy installed."""
    boxes = fake_world(n)
    gpus = [QueuedDevice(policy) for _ in range(n)]

    def one(rank, _virtual):
        gpu = gpus[rank]
        with gpu.installed():
            memory = memory_for(transfer, gpu)
            return device_fn(rank, RingComm(FakeComm(rank, n, boxes), memory), gpu)

    # Threads share sys.modules, so the fake cupy is installed once around them
    # all; each thread's calls still go to its own device (installed per thread).
    with gpus[0].installed():
        return run_devices(n, one)


TRANSFER_PATHS = ("staged", "cuda-aware")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("transfer", TRANSFER_PATHS)
def test_ring_comm_passes_blocks_round_the_ring(transfer, policy, fake_mpi):
    """Five rounds on 3 ranks with two tags in flight at once, arrays on the
    device (float16, float32) beside host positions: every rank gets its left
    neighbour's arrays intact, host arrays stay NumPy, device arrays stay on
    the device, and the staged path allocates its buffers in the first rounds only."""
    n, rounds = 3, 5

    def device(rank, ring_comm, gpu):
        xp = gpu.xp
        kv = (xp.full((2, 5), rank, np.float16), np.arange(3, dtype=np.int64) + 10 * rank)
        grads = (xp.full((4,), -rank, np.float32),)
        allocated = []
        for t in range(rounds):
            h1, h2 = ring_comm.start_shift(kv, ring.KV), ring_comm.start_shift(grads, ring.DKV)
            new_kv, new_grads = ring_comm.finish_shift(h1), ring_comm.finish_shift(h2)
            src = (rank - t - 1) % n
            assert gpu.is_device(new_kv[0]) and gpu.is_device(new_grads[0])
            assert type(new_kv[1]) is np.ndarray
            np.testing.assert_array_equal(new_kv[0].get(), np.full((2, 5), src, np.float16))
            np.testing.assert_array_equal(new_kv[1], np.arange(3) + 10 * src)
            np.testing.assert_array_equal(new_grads[0].get(), np.full((4,), -src, np.float32))
            allocated.append(ring_comm.buffer_sets_allocated)
            kv, grads = new_kv, new_grads
        return allocated

    for allocated in run_ring(n, transfer, policy, device):
        assert allocated[1:] == [allocated[1]] * (rounds - 1)      # none after the first rounds


def queued_ring_results(case, transfer, policy, step_name="v1"):
    """reference.ring over RingComm on QueuedDevices: out, lse, dq, dk, dv in
    natural order, and each rank's forward log."""
    q, k, v, dout = case.inputs()
    pos = positions(case.S, case.n_devices, case.layout)
    shards = [shard(x, case.n_devices, case.layout) for x in (q, k, v, dout)]
    scale = case.scale if case.scale is not None else case.D ** -0.5
    kw = dict(mask=as_mask(case.causal), scale=scale, tile_size=case.tile_size)

    def device(j, ring_comm, gpu):
        qj, kj, vj, dj = (gpu.asarray(s[j]) for s in shards)
        out, lse, log = ring.ring_forward(qj, kj, vj, pos[j], pos[j], ring_comm,
                                          step=QueuedStep(gpu, step_name), **kw)
        grads = ring.ring_backward(qj, kj, vj, out, lse, dj, pos[j], pos[j], ring_comm,
                                   step=QueuedStep(gpu, "v1"), **kw)[:3]
        return tuple(x.get() for x in (out, lse) + grads), log

    got = run_ring(case.n_devices, transfer, policy, device)
    results = []
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        axis = 2 if name == "lse" else 1
        results.append(unshard([g[0][i] for g in got], case.layout, axis=axis))
    return results, [g[1] for g in got]


def virtual_ring_results(case):
    """out, lse, dq, dk, dv of the oracle (reference.virtual: the same ring and
    the readable step over VirtualRing), in natural token order."""
    import reference
    q, k, v, dout = case.inputs()
    out, lse = reference.ring_attention(q, k, v, **case.options())
    return (out, lse) + reference.ring_attention_backward(q, k, v, out, lse, dout, **case.options())


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("transfer", TRANSFER_PATHS)
@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases(max_devices=4))
@example(case=Case(layout="striped", n_devices=4, B=1, S=32, Hq=4, Hkv=2, D=8, tile_size=4, causal=True,
                   scale=None, dtype=np.float32, kind="gaussian", seed=5))       # every hazard can show on 4
@example(case=Case(layout="striped", n_devices=4, B=1, S=32, Hq=4, Hkv=2, D=8, tile_size=4, causal=True,
                   scale=None, dtype=np.float16, kind="gaussian", seed=5))       # the step reads float32 copies
def test_ring_on_a_queued_gpu_equals_the_virtual_ring(transfer, policy, fake_mpi, case):
    """reference.ring with RingComm's GPU memory objects, on a GPU whose copies
    run as early (or kernels as early) as CUDA allows and whose pool hands out
    freed memory at once: exactly the virtual ring's results, forward and
    backward. A missing event or a buffer reused too early gives a kernel the
    wrong block here; so does a device buffer allocated after the step was
    queued (float16: the float32 copies the step reads are freed by the host
    while its kernel waits, and an upload into their memory overwrites them)."""
    got, _ = queued_ring_results(case, transfer, policy)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, virtual_ring_results(case)):
        np.testing.assert_array_equal(g, w, err_msg=f"{name} ({transfer}, {policy}) of {case}")


def test_queued_gpu_pool_hands_out_freed_memory_at_once():
    """The fake's pool as CuPy's: memory the host no longer refers to goes to
    the next allocation of its size on its stream at once, though a queued
    kernel (which holds addresses) still reads it; not to another stream; and
    never while the host holds a view of it."""
    gpu = QueuedDevice("copies-early")
    with gpu.installed():
        a = gpu.asarray(np.arange(8, dtype=np.float32))
        seen = []
        held = gpu.pool.by_address(a)
        gpu.queue_kernel(lambda: seen.append(held.copy()))       # reads a when it runs
        address = a.__array_interface__["data"][0]
        view = a[2:]
        del a
        kept = [gpu.empty((8,), np.float32)]
        assert kept[-1].__array_interface__["data"][0] != address        # a view holds it
        del view
        with gpu.copy:
            kept.append(gpu.empty((8,), np.float32))
        assert kept[-1].__array_interface__["data"][0] != address        # another stream's
        b = gpu.empty((4, 2), np.float32)
        assert b.__array_interface__["data"][0] == address and gpu.pool.reused == 1
        b[...] = -1                                                # from the host: runs after the kernel
        assert seen and (seen[0] == np.arange(8)).all()


@pytest.mark.parametrize("transfer", TRANSFER_PATHS)
def test_steps_read_no_device_memory_on_the_host(transfer, fake_mpi):
    """The readable step run from the host as on a GPU (every CuPy call a
    kernel), forward and backward: no host read inside a step, so the host
    never waits in a step for the kernels queued before it. Whether a block
    holds NaN or inf comes with its owner's flag (`reference.step.block_finite`),
    the query side's is found once before the rounds. Results as the virtual ring's."""
    case = Case(layout="striped", n_devices=3, B=1, S=24, Hq=4, Hkv=2, D=4, tile_size=4, causal=True,
                scale=None, dtype=np.float32, kind="gaussian", seed=2)
    q, k, v, dout = case.inputs()
    pos = positions(case.S, 3, case.layout)
    kw = dict(mask=CAUSAL, scale=case.D ** -0.5, tile_size=4)

    def device(j, ring_comm, gpu):
        qj, kj, vj, dj = (gpu.asarray(shard(x, 3, case.layout)[j]) for x in (q, k, v, dout))
        step = CountedStep(gpu, "v1")
        out, lse, _ = ring.ring_forward(qj, kj, vj, pos[j], pos[j], ring_comm, step=step, **kw)
        grads = ring.ring_backward(qj, kj, vj, out, lse, dj, pos[j], pos[j], ring_comm, step=step, **kw)[:3]
        return gpu.host_reads_in_steps, tuple(x.get() for x in (out, lse) + grads)

    got = run_ring(3, transfer, "copies-early", device)
    assert [reads for reads, _ in got] == [0, 0, 0], "a step read device memory on the host"
    for i, (name, want) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), virtual_ring_results(case))):
        axis = 2 if name == "lse" else 1
        np.testing.assert_array_equal(unshard([r[i] for _, r in got], case.layout, axis=axis), want, err_msg=name)


@pytest.mark.parametrize("transfer", TRANSFER_PATHS)
def test_transfers_overlap_the_step(transfer, fake_mpi):
    """Forward and backward, the loop never waits on the host for a round's
    step before that round's K, V transfer completes: when the K, V
    finish_shift starts, the round's kernel is still queued (in the backward
    it comes before the dK, dV shift, whose send waits for the kernel that
    writes dK, dV). And from its first shift on, the loop reads no device
    memory on the host (owner, positions and finiteness flags are NumPy). The
    RoundLog times the step with the device's events."""
    case = Case(layout="striped", n_devices=3, B=1, S=24, Hq=2, Hkv=1, D=4, tile_size=4, causal=True,
                scale=None, dtype=np.float32, kind="gaussian", seed=1)
    q, k, v, dout = case.inputs()
    pos = positions(case.S, 3, case.layout)
    at_finish = []      # (pass, rank, kernels pending, host reads since the pass's first shift)

    def device(j, ring_comm, gpu):
        start, finish, first_read = ring_comm.start_shift, ring_comm.finish_shift, {}

        def watched_start(arrays, tag):
            first_read.setdefault(now[0], gpu.host_reads)
            return start(arrays, tag)

        def watched_finish(shift):
            if shift.tag == ring.KV:
                at_finish.append((now[0], j, gpu.kernels_pending, gpu.host_reads - first_read[now[0]]))
            return finish(shift)
        ring_comm.start_shift, ring_comm.finish_shift = watched_start, watched_finish
        qj, kj, vj, dj = (gpu.asarray(shard(x, 3, case.layout)[j]) for x in (q, k, v, dout))
        kw = dict(mask=CAUSAL, scale=0.5, tile_size=4, step=QueuedStep(gpu))
        now = ["forward"]
        out, lse, log = ring.ring_forward(qj, kj, vj, pos[j], pos[j], ring_comm, **kw)
        now = ["backward"]
        backward_log = ring.ring_backward(qj, kj, vj, out, lse, dj, pos[j], pos[j], ring_comm, **kw)[3]
        return log, backward_log

    logs = run_ring(3, transfer, "copies-early", device)
    assert sorted(p for p, *_ in at_finish) == ["backward"] * 6 + ["forward"] * 6      # 3 ranks, 2 rounds
    for name, rank, pending, reads in at_finish:
        assert pending >= 1, f"{name}, rank {rank}: the step had run before its round's K, V transfer was waited for"
        assert reads == 0, f"{name}, rank {rank}: the loop read device memory on the host"
    for log in (log for both in logs for log in both):
        assert (log.compute_s > 0).all() and log.clock is None          # device times; the log pickles


@pytest.mark.parametrize("transfer", TRANSFER_PATHS)
def test_no_host_wait_in_the_rounds(transfer, fake_mpi):
    """Neither pass waits on the host for a stream (no synchronize) between
    its first shift and its end: a send whose data a kernel or a copy still
    has to write is posted once the memory object's event is reached, asked
    without waiting. In the backward's first round, when the shift that sends
    dK, dV returns, the kernel that wrote them is still queued, so the host goes
    on to queue the next round's step. (In later rounds the host has waited for
    K, V over MPI first, and the fake GPU, asked meanwhile, ran the step, as a
    real one would.) The results are still the virtual ring's."""
    case = Case(layout="striped", n_devices=3, B=1, S=24, Hq=2, Hkv=1, D=4, tile_size=4, causal=True,
                scale=None, dtype=np.float32, kind="gaussian", seed=3)
    q, k, v, dout = case.inputs()
    pos = positions(case.S, 3, case.layout)
    kw = dict(mask=CAUSAL, scale=case.D ** -0.5, tile_size=4)

    def device(j, ring_comm, gpu):
        start, pending_at_dkv = ring_comm.start_shift, []

        def watched_start(arrays, tag):
            shift = start(arrays, tag)
            if tag == ring.DKV:
                pending_at_dkv.append(gpu.kernels_pending)
            return shift
        ring_comm.start_shift = watched_start
        qj, kj, vj, dj = (gpu.asarray(shard(x, 3, case.layout)[j]) for x in (q, k, v, dout))
        out, lse, _ = ring.ring_forward(qj, kj, vj, pos[j], pos[j], ring_comm, step=QueuedStep(gpu), **kw)
        grads = ring.ring_backward(qj, kj, vj, out, lse, dj, pos[j], pos[j], ring_comm, step=QueuedStep(gpu), **kw)
        syncs = list(gpu.host_syncs)
        return syncs, pending_at_dkv, tuple(x.get() for x in (out, lse) + grads[:3])

    got = run_ring(3, transfer, "copies-early", device)
    for rank, (syncs, pending, _) in enumerate(got):
        assert syncs == [], f"rank {rank} waited on the host for the {syncs} stream"
        assert len(pending) == 3 and pending[0] >= 1, \
            f"rank {rank}: the step writing dK, dV had run when their send was started ({pending} kernels queued)"
    for i, (name, want) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), virtual_ring_results(case))):
        axis = 2 if name == "lse" else 1
        np.testing.assert_array_equal(unshard([r[i] for *_, r in got], case.layout, axis=axis), want, err_msg=name)


def test_public_functions_end_to_end_on_a_queued_gpu(monkeypatch, fake_mpi):
    """gpu_impl.ring_attention and ring_attention_backward, everything but the
    GPU: the collective checks, the transfer choice (auto asks MPI, here
    answering 0), mpi_impl's path with the staged memory object on a queued
    GPU, the trace; 3 ranks as threads, results equal to the dense reference.
    With step='fused' the ring must launch the fused kernel (here the readable
    step in its place, counted: CUDA cannot run on NumPy)."""
    from gpu_impl import api, transfer as transfer_module
    calls = []

    def stand_in_for_the_kernel(acc, queries, block, tile, causal):
        calls.append(1)
        ReadableStep().forward(acc, queries, block, causal=causal, tile_size=tile)
    monkeypatch.setattr(fused, "launch_kernel", stand_in_for_the_kernel)
    monkeypatch.setattr(transfer_module, "mpi_cuda_support", lambda: 0)
    monkeypatch.setattr(api, "CupyDevice", lambda cupy, index: _THREAD_GPU.gpu)
    n, layout = 3, "striped"
    gpus = [QueuedDevice(p) for p in ("copies-early", "copies-late", "copies-early")]
    for step_name, dtype in (("auto", np.float64), ("fused", np.float32)):
        case = Case(layout=layout, n_devices=n, B=1, S=12, Hq=4, Hkv=2, D=4, tile_size=2, causal=True,
                    scale=None, dtype=dtype, kind="gaussian", seed=3)
        q, k, v, dout = case.inputs()
        out, lse = attention(q, k, v)
        want = (out, lse) + attention_backward(q, k, v, out, lse, dout)
        boxes, gathered, barrier = fake_world(n), [None] * n, threading.Barrier(n)

        def device(j, _virtual):
            gpu = gpus[j]
            _THREAD_GPU.gpu = gpu
            with gpu.installed():
                return on_gpu(gpu, j)

        def on_gpu(gpu, j):
            comm = ThreadComm(j, n, boxes, gathered, barrier)
            qj, kj, vj, dj = (gpu.asarray(shard(x, n, layout)[j]) for x in (q, k, v, dout))
            o, l, trace = gpu_impl.ring_attention(qj, kj, vj, comm=comm, layout=layout, tile_size=2,
                                                  step=step_name, trace=True)
            grads = gpu_impl.ring_attention_backward(qj, kj, vj, o, l, dj, comm=comm, layout=layout,
                                                     tile_size=2, transfer="staged")
            return tuple(x.get() for x in (o, l) + grads), trace

        with gpus[0].installed():
            results = run_devices(n, device)
        for i, (name, w) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), want)):
            axis = 2 if name == "lse" else 1
            got = unshard([r[0][i] for r in results], layout, axis=axis)
            assert_close(got, w, dtype, what=f"{name}, step {step_name}")
        trace = results[0][1]
        np.testing.assert_array_equal(trace.pairs, cost.predict(12, n, layout, 2).pairs)
    assert len(calls) == n * n          # the fused run: N rounds on each of N ranks


_THREAD_GPU = threading.local()


class ThreadComm(FakeComm):
    """FakeComm plus what `mpi_impl.agree` and RingComm.on ask for: allgather
    (every thread's value, in rank order), Dup and Free."""

    def __init__(self, rank, size, boxes, gathered, barrier):
        super().__init__(rank, size, boxes)
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
@pytest.mark.parametrize("transfer", TRANSFER_PATHS)
@pytest.mark.parametrize("n", [1, 3])
def test_mpi_ranks_on_queued_gpus(n, transfer, tmp_path):
    """RingComm with the GPU memory objects on real MPI ranks, each on a GPU
    made of NumPy whose streams run later: random cases give exactly the
    virtual ring's results; local ranks are 0..n-1 on this one node, from MPI
    and from the launcher's environment alike."""
    batch = draw_cases(n, 6)
    results = run_batch(n, batch, tmp_path, "--device", "queued", "--transfer", transfer)
    for i, case in enumerate(batch):
        for name, want in zip(("out", "lse", "dq", "dk", "dv"), virtual_ring_results(case)):
            np.testing.assert_array_equal(results[f"{i}/{name}"], want, err_msg=f"{name} of {case}")
    np.testing.assert_array_equal(results["local_ranks"], np.arange(n))
    np.testing.assert_array_equal(results["env_local_ranks"], np.arange(n))


@needs_mpiexec
def test_cli_on_queued_gpus_checks_every_layout():
    """python -m gpu_impl on 3 ranks, each on a GPU made of NumPy
    (python tests/support/gpu/queued_device.py -m gpu_impl): every layout forward and backward within the
    check's float64 tolerance with rectangular tiles, the transfer path MPI
    chose and why, the critical path from device time; then --step fused
    without --tile-size runs with the kernel's own tile."""
    worker = (str(Path(__file__).resolve().parents[1] / "support" / "gpu" / "queued_device.py"), "-m", "gpu_impl")
    proc = mpirun(3, *worker, "--seq-len", "48", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                  "--dtype", "float64", "--tile-size", "4x6", "--layout", "all", "--check", "--backward")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "QueuedDevice (NumPy)" in lines[0] and "transfer staged [auto: MPIX_Query_cuda_support() = 0]" in lines[0]
    assert "tile=(4, 6)" in lines[0] and "forward+backward" in lines[0]
    rows = [line.split() for line in lines if line.split()[:1] in (["contiguous"], ["striped"], ["zigzag"])]
    assert [r[0] for r in rows] == ["contiguous", "striped", "zigzag"], proc.stdout
    assert all(float(r[1]) <= 1e-10 for r in rows), proc.stdout
    assert "busiest rank's device time (CUDA events)" in proc.stdout
    proc = mpirun(3, *worker, "--seq-len", "48", "--heads", "2", "--head-dim", "8", "--layout", "striped",
                  "--step", "fused", "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"tile={fused.DEFAULT_TILE}" in proc.stdout and "step fused" in proc.stdout, proc.stdout


def test_cli_tile_sizes():
    """--tile-size takes T or TQxTK; gpu_impl's default is the step's own tile."""
    from gpu_impl.__main__ import parse
    assert parse(["--tile-size", "64x32"])[1].tile_size == (64, 32)
    assert parse(["--tile-size", "96"])[1].tile_size == 96
    assert parse(["--step", "fused"])[1].tile_size == fused.DEFAULT_TILE
    assert parse([])[1].tile_size == 128
    for bad in ("0", "4x0", "4x5x6", "x4", "big"):
        with pytest.raises(SystemExit):
            parse(["--tile-size", bad])


# -- the fused kernel's source -------------------------------------------------------

def nvcc_compile(source, head_dim, tile, out, kv_half=False):
    opts = [o for o in fused.compile_options(head_dim, tile, kv_half) if o != "-std=c++17"]
    return subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-cubin", *opts, "-o", str(out), str(source)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("head_dim, tile, kv_half", [(16, (64, 32), False), (64, fused.DEFAULT_TILE, False),
                                                     (128, (32, 16), True), (128, fused.DEFAULT_TILE, True)])
def test_fused_kernel_compiles_with_nvcc(head_dim, tile, kv_half, tmp_path):
    proc = nvcc_compile(fused.SOURCE, head_dim, tile, tmp_path / "k.cubin", kv_half)
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
# tests/support/gpu/emulate_cuda.cpp (a fiber per CUDA thread, each run up to its
# next barrier), against the plain step. (D, tile, K/V dtype): small square tiles,
# the default tile with an odd head dim, odd rectangular tiles, float16 blocks
# read as they travel, and the head dims of real models, 64 and 128.
EMULATED = [(16, (8, 4), np.float32), (5, fused.DEFAULT_TILE, np.float32), (8, (3, 7), np.float16),
            (64, (16, 8), np.float32), (64, fused.DEFAULT_TILE, np.float16), (128, (8, 4), np.float16),
            (128, fused.DEFAULT_TILE, np.float32)]


@pytest.fixture(scope="module")
def emulated_kernels():
    """{(D, tile, dtype): the fused kernel's library, compiled for the CPU (`emulator.load`)}."""
    import emulator
    if GXX is None:
        pytest.skip("g++ not found")
    libraries = emulator.build_all({
        (head_dim, (tq, tk), dtype): (fused.kernel_source(), [f"-DHEAD_DIM={head_dim}", f"-DTQ={tq}", f"-DTK={tk}",
                                                              f"-DKV_HALF={int(dtype == np.float16)}"], 1)
        for head_dim, (tq, tk), dtype in EMULATED})
    return {key: emulator.load(lib) for key, lib in libraries.items()}


def emulated_attend_block(library, acc, queries, block, *, causal, tile):
    """fused.launch_kernel on the CPU: the same checks, grid and arguments (`emulator.launch_v1`)."""
    import emulator
    emulator.launch_v1(library, acc, queries, block, causal=causal, tile=tile)


def plain_and_emulated(launch, case, tile, inputs=None):
    """Every rank's block accumulated into device 0's queries, round after round,
    by the plain step and by the emulated kernel (K, V as they travel: float16
    blocks stay float16 for the kernel). Returns ((out, lse) plain, (out, lse) kernel)."""
    q, k, v, _ = case.inputs() if inputs is None else inputs
    pos = positions(case.S, case.n_devices, case.layout)
    scale = np.float32(case.scale if case.scale is not None else case.D ** -0.5)
    queries = Queries.prepare(shard(q, case.n_devices, case.layout)[0], case.Hkv, pos[0], scale)
    accs = ForwardAcc.zeros(queries.q), ForwardAcc.zeros(queries.q)
    for j in range(case.n_devices):
        block = own_block(*(shard(x, case.n_devices, case.layout)[j] for x in (k, v)), pos[j], j)
        with np.errstate(invalid="ignore"):                # inf - inf where the inputs hold inf
            ReadableStep().forward(accs[0], queries, ring.as_dtype(block, np.float32), causal=case.causal,
                                   tile_size=tile)
        accs[1].seen |= any_visible(queries.pos, pos[j], case.causal)      # what Step.forward notes
        emulated_attend_block(launch, accs[1], queries, ring.as_dtype(block, np.float32, fused.FusedStep()),
                              causal=case.causal, tile=tile)
    with np.errstate(invalid="ignore", divide="ignore"):
        return tuple(finish_forward(a) for a in accs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("head_dim, tile, dtype", EMULATED)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(max_devices=4, dtypes=(np.float32,)))
def test_fused_kernel_emulated_on_cpu_matches_plain_step(emulated_kernels, head_dim, tile, dtype, case):
    """The fused kernel's source, run on the CPU, gives the plain step's out and
    lse (rows that see no key: out 0, lse -inf, no NaN)."""
    case = dataclasses.replace(case, D=head_dim, dtype=dtype)
    (o0, l0), (o1, l1) = plain_and_emulated(emulated_kernels[head_dim, tile, dtype], case, tile)
    assert not np.isnan(o1).any() and not np.isnan(l1).any()
    assert_close(o1, o0, np.float32, f"out of {case}", factor=case.tolerance_factor)
    assert_close(l1, l0, np.float32, f"lse of {case}", factor=case.tolerance_factor)


def assert_same_nan_rule(got, want, what):
    """NaN exactly where the plain step has NaN (and inf where it has inf), close elsewhere."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"NaN of {what}")
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=f"inf of {what}")
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-4, atol=1e-4, err_msg=what)


def test_fused_kernel_emulated_follows_the_nan_rule(emulated_kernels):
    """Two cases the rule decides (reference/step.py), one query row at
    position 9 seeing keys 0..7 (striped on 2 devices, so two blocks):
    1. a visible key whose weight underflows to 0 and whose V holds NaN: 0 x NaN = NaN;
    2. a first block whose visible scores are all -inf (K = -inf) with NaN in V,
       then finite keys: exp(-inf) x NaN = NaN, not a row skipped.
    And NaN or inf anywhere in q, k, v (hypothesis below) reaches the rows the plain step's reach."""
    head_dim, tile, dtype = EMULATED[0]
    launch = emulated_kernels[head_dim, tile, dtype]
    case = Case(layout="striped", n_devices=2, B=1, S=16, Hq=1, Hkv=1, D=head_dim, tile_size=tile,
                causal=True, scale=1.0, dtype=np.float32, kind="gaussian", seed=0)
    q, k, v, _ = (x.copy() for x in case.inputs())
    underflow = (q.copy(), k.copy(), v.copy(), None)
    underflow[0][0, 8, 0] = 0.0
    underflow[0][0, 8, 0, 0] = 1.0              # query 8 (device 0): its score is k[..., 0]
    underflow[1][0, :, 0, 0] = 0.0
    underflow[1][0, 0, 0, 0] = 1000.0           # key 0 dominates: exp(0 - 1000) = 0 for the others
    underflow[2][0, 2, 0, 0] = np.nan           # key 2 (visible to query 8) holds NaN
    minus_inf = (q.copy(), k.copy(), v.copy(), None)
    minus_inf[0][0, :, 0] = 1.0
    minus_inf[1][0, 0::2, 0] = -np.inf          # device 0's keys (even positions): scores -inf
    minus_inf[2][0, 0::2, 0, 0] = np.nan
    for name, inputs in (("underflow", underflow), ("all -inf block", minus_inf)):
        (o0, l0), (o1, l1) = plain_and_emulated(launch, case, tile, inputs)
        assert np.isnan(o0).any(), f"{name}: the plain step should give NaN here"
        assert_same_nan_rule(o1, o0, f"out, {name}")
        assert_same_nan_rule(l1, l0, f"lse, {name}")


@pytest.mark.timeout(300)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(max_devices=4, dtypes=(np.float32,), kinds=("gaussian",)),
       specials=st.lists(st.tuples(st.sampled_from("qkv"), st.integers(0, 10**6),
                                   st.sampled_from([np.nan, np.inf, -np.inf])), min_size=1, max_size=3))
def test_fused_kernel_emulated_nan_and_inf_reach_what_they_reach(emulated_kernels, case, specials):
    head_dim, tile, dtype = EMULATED[0]
    case = dataclasses.replace(case, D=head_dim)
    q, k, v, dout = case.inputs()
    arrays = dict(q=q, k=k, v=v)
    for which, index, value in specials:
        arrays[which].reshape(-1)[index % arrays[which].size] = value
    (o0, l0), (o1, l1) = plain_and_emulated(emulated_kernels[head_dim, tile, dtype], case, tile,
                                            (q, k, v, dout))
    assert_same_nan_rule(o1, o0, f"out of {case}, {specials}")
    assert_same_nan_rule(l1, l0, f"lse of {case}, {specials}")


def test_fused_kernel_emulated_flushes_subnormals(emulated_kernels):
    """CuPy compiles kernels with -ftz=true, so float32 values below 2^-126 are
    0 on the GPU. The one case of the NaN rule that changes: a weight
    exp(S - m) = exp(-95) = 5.5e-42 at a key whose V is inf gives 0 x inf = NaN
    in the kernel, where NumPy's readable step gives 5.5e-42 x inf = inf. The
    emulator flushes as the GPU does; told not to, it gives the readable step's inf."""
    head_dim, tile, dtype = EMULATED[0]
    launch = emulated_kernels[head_dim, tile, dtype]
    q = np.zeros((1, 1, 1, 1, head_dim), np.float32)
    q[..., 0] = 1.0                                       # scale 1: scores are k[..., 0]
    k = np.zeros((1, 1, 2, head_dim), np.float32)
    k[0, 0, 1, 0] = -95.0
    v = np.ones((1, 1, 2, head_dim), np.float32)
    v[0, 0, 1, 0] = np.inf
    queries, block = Queries(q, np.array([5])), ring.KVBlock(k, v, np.array([0, 1]), np.array([0]))
    outs = {}
    for name, flush in (("readable", None), ("flushed", 1), ("not flushed", 0)):
        acc = ForwardAcc.zeros(q)
        acc.seen[:] = True
        with np.errstate(invalid="ignore"):
            if flush is None:
                ReadableStep().forward(acc, queries, block, causal=True, tile_size=tile)
            else:
                launch.emu_flush_to_zero(flush)
                try:
                    emulated_attend_block(launch, acc, queries, block, causal=True, tile=tile)
                finally:
                    launch.emu_flush_to_zero(1)
            outs[name] = finish_forward(acc)[0][0, 0, 0, 0, 0]
    assert np.isposinf(outs["readable"]) and np.isnan(outs["flushed"]) and np.isposinf(outs["not flushed"])


def test_fused_launch_checks_shapes_and_positions():
    """What the kernel would read out of bounds is refused before a launch."""
    q = np.zeros((1, 2, 8, 2, 4), np.float32)
    k = np.zeros((1, 2, 6, 4), np.float32)
    acc = ForwardAcc.zeros(q)
    good = (Queries(q, np.arange(8)), ring.KVBlock(k, k, np.arange(6), np.array([0])))
    fused.check_launch(acc, *good)
    for bad, message in (((Queries(q, np.arange(7)), good[1]), r"queries.pos has shape \(7,\), expected \(8,\)"),
                         ((good[0], good[1]._replace(pos=np.arange(5))), r"block.pos has shape \(5,\)"),
                         ((good[0], good[1]._replace(v=k[:, :, :5].copy())), r"v has shape"),
                         ((good[0], good[1]._replace(k=np.zeros((1, 1, 6, 4), np.float32))), r"k has shape"),
                         ((good[0], good[1]._replace(v=k.astype(np.float16))), "both float32 or both float16"),
                         ((Queries(q.astype(np.float64), np.arange(8)), good[1]), "float32 q")):
        with pytest.raises(ValueError, match=message):
            fused.check_launch(acc, *bad)
    assert fused.FusedStep.reads_float16


def test_fused_positions_are_uploaded_once():
    """The same positions (equal contents, any array) are uploaded once; other
    positions with the same length and ends are not mistaken for them."""
    kept = fused.DevicePositions()
    a, b = np.array([0, 4, 8]), np.array([0, 4, 8])
    first = kept.get(np, a)
    assert kept.get(np, b) is first and kept.uploads == 1
    other = kept.get(np, np.array([0, 5, 8]))
    assert other is not first and kept.uploads == 2
    np.testing.assert_array_equal(other, [0, 5, 8])


def test_fused_positions_are_kept_per_stream():
    """Two streams of one GPU (the queued GPU's compute and copy streams made
    current in turn) get positions of their own: each uploads its own copy on
    itself, never reads one uploaded on the other stream, and clearing one
    stream's cache leaves the other's arrays alone."""
    gpu = QueuedDevice()
    pos = np.arange(0, 64, 4)
    with gpu.installed():
        cupy = gpu.xp
        fused.POSITIONS.clear()
        on_compute = fused.positions_for(cupy, 0).get(cupy, pos)
        with gpu.copy:
            other = fused.positions_for(cupy, 0)
            on_copy = other.get(cupy, pos)
        assert on_copy is not on_compute and other.uploads == 1
        assert fused.positions_for(cupy, 0).get(cupy, pos) is on_compute       # back on the compute stream
        other._kept.clear()
        assert fused.positions_for(cupy, 0).get(cupy, pos) is on_compute
        fused.POSITIONS.clear()


@pytest.mark.parametrize("version", ["fused", "fused_v2"])
def test_fused_launches_read_positions_uploaded_on_their_stream(version, monkeypatch):
    """Each fused kernel's launch reads position arrays uploaded on the stream
    it is launched on: a launch on another stream (the queued GPU's copy stream
    made current) gets arrays of its own, never those the compute stream's
    launches read (kept per GPU, an upload on one stream would be read on
    another with no event between them)."""
    from gpu_impl.steps import fused_v2
    from reference import steps
    module = {"fused": fused, "fused_v2": fused_v2}[version]
    read = []
    monkeypatch.setattr(module, "_kernel", lambda *config: lambda grid, threads, args, **kw: read.append(args[3]))
    gpu = QueuedDevice()
    q, k = np.zeros((1, 1, 16, 1, 64), np.float32), np.zeros((1, 1, 16, 64), np.float16)
    with gpu.installed():
        fused.POSITIONS.clear()
        queries = Queries(gpu.asarray(q), np.arange(16), scale=1.0)
        block = ring.KVBlock(gpu.asarray(k), gpu.asarray(k), np.arange(16), np.array([0]))
        acc = ForwardAcc.zeros(queries.q)
        for stream in (gpu.compute, gpu.copy, gpu.compute):
            with stream:
                steps.get(version).forward(acc, queries, block, mask=CAUSAL, tile_size=None)
        fused.POSITIONS.clear()
    assert len(read) == 3 and read[2] is read[0] and read[1] is not read[0]


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


# -- the GPU benchmark, without a GPU ----------------------------------------------

@pytest.mark.skipif(GPU_MISSING is None, reason="a GPU is present")
def test_gpu_bench_says_no_gpu(tmp_path):
    """Without a GPU the section says so, and includes gpu-check's results
    from a GPU machine where there are some (a dry run's are not results)."""
    from bench import gpu_bench
    text, pngs = gpu_bench.run(quick=True)
    assert text.startswith("No GPU here") and "make gpu-check" in text and pngs == []
    results = tmp_path / "gpu_check.md"
    results.write_text("Results of `make gpu-check`\n\n### rates: ok\n")
    assert "### rates: ok" in gpu_bench.no_gpu_section("none", results)
    results.write_text("Dry run (nothing measured) of `make gpu-check`\n\n### rates: ok\n")
    assert "### rates" not in gpu_bench.no_gpu_section("none", results)


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
    where the MPI library is not CUDA-aware (cuda-aware-unchecked: MPI would say no)."""
    batch = draw_cases(n, CASES_PER_LAUNCH)
    extra = ["--managed"] if transfer == "cuda-aware" else []
    path = "cuda-aware-unchecked" if transfer == "cuda-aware" else transfer
    results = run_batch(n, batch, tmp_path, "--device", "cupy", "--transfer", path, *extra)
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
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_step_matches_plain_step_at_model_shapes(head_dim, dtype):
    """The fused kernel against the readable step at the head dims of real
    models, grouped-query heads (Hq = 8, Hkv = 2), float16 blocks read as they
    travel, 4 striped blocks of 512 tokens, each with its default tile."""
    import cupy
    from reference import steps
    case = Case(layout="striped", n_devices=4, B=1, S=2048, Hq=8, Hkv=2, D=head_dim, tile_size=None,
                causal=True, scale=None, dtype=dtype, kind="gaussian", seed=head_dim)
    q, k, v, _ = case.inputs()
    pos = positions(case.S, 4, "striped")
    queries = Queries.prepare(cupy.asarray(shard(q, 4, "striped")[1]), 2, pos[1], head_dim ** -0.5)
    accs = ForwardAcc.zeros(queries.q), ForwardAcc.zeros(queries.q)
    for j in range(4):
        block = own_block(*(cupy.asarray(shard(x, 4, "striped")[j]) for x in (k, v)), pos[j], j)
        steps.get("v1").forward(accs[0], queries, ring.as_dtype(block, np.float32), causal=True, tile_size=128)
        fused_step = steps.get("fused")
        steps.get("fused").forward(accs[1], queries, ring.as_dtype(block, np.float32, fused_step),
                                   causal=True, tile_size=None)
    (o0, l0), (o1, l1) = (finish_forward(a) for a in accs)
    assert_close(cupy.asnumpy(o1), cupy.asnumpy(o0), np.float32, f"out, D={head_dim}, {dtype.__name__}")
    assert_close(cupy.asnumpy(l1), cupy.asnumpy(l0), np.float32, f"lse, D={head_dim}, {dtype.__name__}")


@needs_gpu
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq=st.integers(130, 700), n=st.integers(1, 4), group=st.sampled_from([1, 2, 4, 8]))
def test_tensor_core_step_matches_readable_step(seq, n, group):
    """fused_v2, the default step for float16 on GPUs, forward and backward
    against the readable step on the GPU at the head dims it takes (64 and
    128), float16 and bfloat16, causal and a window over documents: sequence
    lengths that are no multiple of any tile, 1 to 4 striped blocks, GQA."""
    import cupy
    from bench import gpu_kernel_check
    seq -= seq % max(n, 1)
    for check in (gpu_kernel_check.check_against_readable, gpu_kernel_check.backward_against_readable):
        ok, table = check(cupy, seq=seq, n=n, hq=2 * group, hkv=2)
        assert ok, table


SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}"""
SPIN_CYCLES = 2_000_000          # about a millisecond


@needs_gpu
@pytest.mark.parametrize("slow", ["kernels", "copies"])
def test_staged_upload_race_probe(slow, fake_mpi, monkeypatch):
    """The staged path's stream order on a real GPU: 3 ranks as threads on one
    GPU (a fake MPI of threads moves the pinned buffers), float16 blocks (the
    step reads float32 copies, whose memory CuPy's pool takes back while the
    step's kernels are still queued), with a spin kernel of about a millisecond
    inside every tile (kernels lag: an upload into memory a queued kernel still
    reads overwrites it) or before every upload (copies lag: a step that does
    not wait for its upload reads the old block). Results must equal the
    virtual ring's within float16's tolerance."""
    import cupy
    from gpu_impl.device import CupyDevice
    from gpu_impl.transfer import StagedBuffers
    from reference import step as step_module
    spin = cupy.RawKernel(SPIN_SOURCE, "spin")
    case = Case(layout="striped", n_devices=3, B=1, S=3 * 256, Hq=4, Hkv=2, D=32, tile_size=64, causal=True,
                scale=None, dtype=np.float16, kind="gaussian", seed=7)
    q, k, v, dout = case.inputs()
    pos = positions(case.S, 3, case.layout)
    boxes = fake_world(3)

    def spun(tile):
        def slow_tile(*args, **kwargs):
            spin((1,), (1,), (np.int64(SPIN_CYCLES),))       # queued before the tile's kernels
            return tile(*args, **kwargs)
        return slow_tile

    if slow == "kernels":
        monkeypatch.setattr(step_module, "forward_tile", spun(step_module.forward_tile))
        monkeypatch.setattr(step_module, "backward_tile", spun(step_module.backward_tile))

    class SlowCopies(CupyDevice):
        def upload(self, host, a, stream):
            with stream:
                spin((1,), (1,), (np.int64(SPIN_CYCLES),))
            super().upload(host, a, stream)

    def device(j, _virtual):
        with cupy.cuda.Stream(non_blocking=True):          # each rank's own compute stream
            dev = (SlowCopies if slow == "copies" else CupyDevice)(cupy, 0)
            ring_comm = RingComm(FakeComm(j, 3, boxes), StagedBuffers(dev))
            qj, kj, vj, dj = (cupy.asarray(shard(x, 3, case.layout)[j]) for x in (q, k, v, dout))
            kw = dict(causal=True, scale=case.D ** -0.5, tile_size=64, step=ReadableStep())
            out, lse, _ = ring.ring_forward(qj, kj, vj, pos[j], pos[j], ring_comm, **kw)
            grads = ring.ring_backward(qj, kj, vj, out, lse, dj, pos[j], pos[j], ring_comm, **kw)[:3]
            return tuple(cupy.asnumpy(x) for x in (out, lse) + grads)

    got = run_devices(3, device)
    for i, (name, want) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), virtual_ring_results(case))):
        axis = 2 if name == "lse" else 1
        assert_close(unshard([g[i] for g in got], case.layout, axis=axis), want, np.float16,
                     what=f"{name}, {slow} slowed")


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

