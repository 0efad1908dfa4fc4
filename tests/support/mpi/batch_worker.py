"""Run attention cases on MPI ranks through mpi_impl or gpu_impl: one worker for both.

    mpiexec -n N python -m mpi4py tests/support/mpi/batch_worker.py CASES.json INPUTS.npz RESULTS.npz         [--device mpi|numpy|cupy] [--transfer staged|cuda-aware] [--step auto|v1|fused] [--managed]
    mpiexec -n N python -m mpi4py tests/support/mpi/batch_worker.py --serve SOCKET [--transfer ...]

Backends (`--device`, or "backends" in a served request):

mpi     `mpi_impl.ring_attention` and its backward on NumPy shards, with
        `--mpi-step` (auto by default; v1 gives the stand-in's bits);
numpy   the same functions on a GPU made of NumPy whose streams run later
        (tests/support/gpu/queued_device.py), over `RingComm` with the transfer's
        memory object: every data-movement path of gpu_impl, and its stream order;
cupy    `gpu_impl.ring_attention` and its backward on this rank's GPU.

Batch mode (one launch, many cases; tests/mpi/test_mpi.py, tests/gpu/test_gpu.py):
CASES.json lists {"id", "layout", "causal", "scale", "tile_size"}; INPUTS.npz
holds each case's full q, k, v, dout (and optionally the dense reference's
out, lse, which the backward then gets, so that only its own error is
compared) as "<id>/q" ...; rank 0 writes "<id>/out", "lse", "dq", "dk", "dv"
(unsharded), the forward trace's "<id>/pairs", "tiles_computed", "source",
"bytes_sent", "<id>/inputs_unchanged" and "local_ranks".

Serve mode (tests/mpi/test_backends.py): rank 0 connects to SOCKET and answers
requests one at a time (`reference.testing.ProcessGroup`), so that hypothesis
drives and shrinks on one launch. A request is {"case": {...}, "shards": {"q":
[per rank], ...}, "backends": [...]} (the case may name a "scheme" and its
"ulysses_degree" or "ring_inner", and a "dropout" with its "seed"); the reply is one {backend:
{"out", "lse", "dq", "dk", "dv"}} per rank, each rank's own shard (or {"error":
traceback}).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import mpi_impl
from reference import shard, unshard
from reference.testing import serve_requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))     # tests/support/gpu/queued_device.py

AXES = dict(out=1, lse=2, dq=1, dk=1, dv=1)


def run_backend(device, mine, opts, comm, args):
    """One backend's forward and backward on this rank's shard `mine`; returns
    ({name: array}, forward Trace)."""
    q, k, v, dout = (mine[name] for name in ("q", "k", "v", "dout"))
    if device == "cupy":
        import cupy
        import gpu_impl
        q, k, v, dout = (cupy.asarray(x) for x in (q, k, v, dout))
        out, lse, trace = gpu_impl.ring_attention(q, k, v, comm=comm, transfer=args.transfer, step=args.step,
                                                  trace=True, **opts)
        saved = (cupy.asarray(mine["out"]), cupy.asarray(mine["lse"])) if "out" in mine else (out, lse)
        grads = gpu_impl.ring_attention_backward(q, k, v, *saved, dout, comm=comm, transfer=args.transfer, **opts)
        return dict(zip(AXES, (cupy.asnumpy(x) for x in (out, lse) + grads))), trace
    if device == "numpy":
        return _on_queued_gpu(q, k, v, dout, mine, opts, comm, args)
    out, lse, trace = mpi_impl.ring_attention(q, k, v, comm=comm, trace=True, step=args.mpi_step, **opts)
    saved = (mine["out"], mine["lse"]) if "out" in mine else (out, lse)
    grads = mpi_impl.ring_attention_backward(q, k, v, *saved, dout, comm=comm, step=args.mpi_step, **opts)
    return dict(zip(AXES, (out, lse) + grads)), trace


def _on_queued_gpu(q, k, v, dout, mine, opts, comm, args):
    """mpi_impl's functions on this rank's GPU made of NumPy (see the module docstring)."""
    from gpu_impl.transfer import memory_for
    from mpi_impl.comm import RingComm
    from queued_device import POLICIES, QueuedDevice, QueuedStep
    gpu = QueuedDevice(POLICIES[comm.Get_rank() % 2])
    transfer = "staged" if args.transfer == "auto" else args.transfer
    with gpu.installed():
        ring = dict(step=QueuedStep(gpu), make_ring=lambda c: RingComm.on(c, memory_for(transfer, gpu)))
        q, k, v, dout = (gpu.asarray(x) for x in (q, k, v, dout))
        out, lse, trace = mpi_impl.ring_attention(q, k, v, comm=comm, trace=True, **opts, **ring)
        saved = (gpu.asarray(mine["out"]), gpu.asarray(mine["lse"])) if "out" in mine else (out, lse)
        grads = mpi_impl.ring_attention_backward(q, k, v, *saved, dout, comm=comm, **opts, **ring)
        return dict(zip(AXES, (x.get() for x in (out, lse) + grads))), trace


def _options(case):
    tile = tuple(case["tile_size"]) if isinstance(case["tile_size"], list) else case["tile_size"]
    return dict(layout=case["layout"], causal=case["causal"], scale=case["scale"], tile_size=tile,
                scheme=case.get("scheme", "ring"), ulysses_degree=case.get("ulysses_degree"),
                ring_inner=case.get("ring_inner"),
                dropout=case.get("dropout", 0.0), seed=case.get("seed", 0))


# -- batch mode --------------------------------------------------------------

def run_case(case, data, comm, args):
    n, rank, layout = comm.Get_size(), comm.Get_rank(), case["layout"]
    names = [name for name in ("q", "k", "v", "dout", "out", "lse") if f"{case['id']}/{name}" in data]
    mine = {name: shard(data[f"{case['id']}/{name}"], n, layout, axis=2 if name == "lse" else 1)[rank]
            for name in names}
    saved = {name: x.copy() for name, x in mine.items()}
    results, trace = run_backend(args.device, mine, _options(case), comm, args)
    unchanged = all(np.array_equal(saved[name], x, equal_nan=True) for name, x in mine.items())
    unchanged = comm.allreduce(unchanged, op=MPI.LAND)
    gathered = comm.gather(results)
    if rank != 0:
        return {}
    out = {f"{case['id']}/{name}": unshard([g[name] for g in gathered], layout, axis=axis)
           for name, axis in AXES.items()}
    for name in ("pairs", "tiles_computed", "source", "bytes_sent"):
        out[f"{case['id']}/{name}"] = getattr(trace, name)
    out[f"{case['id']}/inputs_unchanged"] = np.array(unchanged)
    return out


def run_batch(args, comm):
    with open(args.cases) as f:
        cases = json.load(f)
    data = np.load(args.inputs)
    results = {}
    for case in cases:
        results.update(run_case(case, data, comm, args))
    return results


# -- serve mode --------------------------------------------------------------

def handle(request, comm, args):
    """This rank's part of one served request: {backend: {name: this rank's shard}}."""
    rank = comm.Get_rank()
    mine = {name: arrays[rank] for name, arrays in request["shards"].items()}
    replies = {}
    for device in request["backends"]:
        results, _ = run_backend(device, mine, _options(request["case"]), comm, args)
        replies[device] = results
    return replies


def share_quietly(comm):
    """broadcast(x) from rank 0 that waits without spinning: idle ranks of a
    served group sleep between polls of a barrier instead of busy-waiting in
    MPI, so that they leave the cores to the test process."""
    def broadcast(x):
        barrier = comm.Ibarrier()
        while not barrier.Test():
            time.sleep(0.002)
        return comm.bcast(x, root=0)
    return broadcast


# -- entry point ------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="?"), ap.add_argument("inputs", nargs="?"), ap.add_argument("results", nargs="?")
    ap.add_argument("--serve", metavar="SOCKET", help="answer requests on this Unix socket (rank 0)")
    ap.add_argument("--device", choices=("mpi", "numpy", "cupy"), default="mpi")
    ap.add_argument("--transfer", default="auto")
    ap.add_argument("--step", default="auto", help="gpu_impl's step (--device cupy)")
    ap.add_argument("--mpi-step", default="auto", help="mpi_impl's step (--device mpi)")
    ap.add_argument("--managed", action="store_true",
                    help="CuPy arrays in managed memory, which any MPI can read: tests the "
                         "cuda-aware path where the MPI library is not CUDA-aware")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    if args.device == "cupy":
        import cupy
        import gpu_impl
        gpu_impl.use_local_device(comm)
        if args.managed:
            cupy.cuda.set_allocator(cupy.cuda.MemoryPool(cupy.cuda.malloc_managed).malloc)
    if args.serve:
        serve_requests(args.serve, comm.Get_rank(), lambda req: handle(req, comm, args),
                       broadcast=share_quietly(comm), gather=lambda x: comm.gather(x, root=0))
        return
    results = run_batch(args, comm)
    from gpu_impl.device import local_rank
    ranks = comm.gather(local_rank(comm))
    if comm.Get_rank() == 0:
        results["local_ranks"] = np.array(ranks)
        np.savez(args.results, **results)


if __name__ == "__main__":
    main()
