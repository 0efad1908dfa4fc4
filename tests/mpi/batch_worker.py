"""Run attention cases on MPI ranks through mpi_impl or gpu_impl: one worker for both.

    mpiexec -n N python -m mpi4py tests/mpi/batch_worker.py CASES.json INPUTS.npz RESULTS.npz \
        [--device mpi|numpy|cupy] [--transfer staged|cuda-aware] [--kernel step|fused] [--managed]
    mpiexec -n N python -m mpi4py tests/mpi/batch_worker.py --serve SOCKET [--transfer ...]

Backends (`--device`, or "backends" in a served request):

mpi     `mpi_impl.ring_attention` and `ring_attention_backward` on NumPy shards;
numpy   the same functions over gpu_impl's communication object
        (`gpu_impl.transfer.DeviceRing`) with `gpu_impl.device.NumpyDevice`
        standing in for the GPU: every data-movement path of gpu_impl without
        one. Each rank records the order of its device and MPI calls, and
        "order_ok" says every send followed a synchronize;
cupy    `gpu_impl.ring_attention` and `ring_attention_backward` on this rank's
        GPU (local rank), CuPy arrays, the chosen transfer and kernel.

Batch mode (one launch, many cases; tests/test_mpi.py, tests/test_gpu.py):
CASES.json lists {"id", "layout", "causal", "scale", "tile_size"}; INPUTS.npz
holds each case's full q, k, v, dout, and optionally the dense reference's out,
lse as "<id>/q" ...; rank 0 writes "<id>/out", "lse", "dq", "dk", "dv"
(unsharded), the forward trace's "<id>/pairs", "tiles_computed", "source",
"bytes_sent", "<id>/inputs_unchanged" (no rank's inputs were written to),
"order_ok" and "local_ranks". Where INPUTS has "<id>/out" and "<id>/lse", the
backward gets them (as tests/test_ring.py does, so that only the backward's
own error is compared); otherwise it gets the forward's own.

Serve mode (tests/test_backends.py): rank 0 connects to SOCKET and answers
requests one at a time (`reference.testing.ProcessGroup`), so that hypothesis
drives the examples and shrinks a failure on one launch of mpiexec. A request
is {"case": {...}, "shards": {"q": [per rank], ...}, "backends": [...]}; the
reply is one {backend: {"out", "lse", "dq", "dk", "dv"}} per rank, each rank's
own shard (or {"error": traceback}).
"""

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import mpi_impl
from reference import shard, unshard
from gpu_impl.transfer import TAG_STRIDE
from reference.testing import serve_requests

AXES = dict(out=1, lse=2, dq=1, dk=1, dv=1)



class RecordingComm:
    """An mpi4py communicator that notes each Isend in a shared event list."""

    def __init__(self, comm, events):
        self._comm, self._events = comm, events

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Isend(self, buf, dest, tag):
        self._events.append(("Isend", tag % TAG_STRIDE))
        return self._comm.Isend(buf, dest=dest, tag=tag)


def sends_follow_synchronize(events):
    """True when every shift (its first array's Isend, index 0) comes after a
    synchronize that no earlier shift used: MPI never reads a buffer that a
    queued kernel may still be writing."""
    ready = False
    for e in events:
        if e == "synchronize":
            ready = True
        elif e == ("Isend", 0):
            if not ready:
                return False
            ready = False
    return True


class StandInRing:
    """gpu_impl's DeviceRing on a duplicate communicator, NumPy standing in for
    CuPy: what `mpi_impl.ring_attention(make_ring=...)` builds and frees."""

    def __init__(self, comm, transfer, events):
        from gpu_impl.device import NumpyDevice
        from gpu_impl.transfer import DeviceRing
        self._dup = comm.Dup()
        self._ring = DeviceRing(RecordingComm(self._dup, events), NumpyDevice(events), transfer)

    def __getattr__(self, name):          # rank, size, start_shift, finish_shift
        return getattr(self._ring, name)

    def free(self):
        self._dup.Free()


def run_backend(device, mine, opts, comm, args, events):
    """One backend's forward and backward on this rank's shard `mine`; returns
    ({name: array}, forward Trace)."""
    q, k, v, dout = (mine[name] for name in ("q", "k", "v", "dout"))
    if device == "cupy":
        import cupy
        import gpu_impl
        q, k, v, dout = (cupy.asarray(x) for x in (q, k, v, dout))
        out, lse, trace = gpu_impl.ring_attention(q, k, v, comm=comm, transfer=args.transfer, kernel=args.kernel,
                                                  trace=True, **opts)
        saved = (cupy.asarray(mine["out"]), cupy.asarray(mine["lse"])) if "out" in mine else (out, lse)
        grads = gpu_impl.ring_attention_backward(q, k, v, *saved, dout, comm=comm, transfer=args.transfer, **opts)
        return dict(zip(AXES, (cupy.asnumpy(x) for x in (out, lse) + grads))), trace
    extra = {}
    if device == "numpy":
        extra = dict(make_ring=lambda c: StandInRing(c, args.transfer, events))
    out, lse, trace = mpi_impl.ring_attention(q, k, v, comm=comm, trace=True, **opts, **extra)
    saved = (mine["out"], mine["lse"]) if "out" in mine else (out, lse)
    grads = mpi_impl.ring_attention_backward(q, k, v, *saved, dout, comm=comm, **opts, **extra)
    return dict(zip(AXES, (out, lse) + grads)), trace


def _options(case):
    tile = tuple(case["tile_size"]) if isinstance(case["tile_size"], list) else case["tile_size"]
    return dict(layout=case["layout"], causal=case["causal"], scale=case["scale"], tile_size=tile)


# -- batch mode --------------------------------------------------------------

def run_case(case, data, comm, args, events):
    n, rank, layout = comm.Get_size(), comm.Get_rank(), case["layout"]
    names = [name for name in ("q", "k", "v", "dout", "out", "lse") if f"{case['id']}/{name}" in data]
    mine = {name: shard(data[f"{case['id']}/{name}"], n, layout, axis=2 if name == "lse" else 1)[rank]
            for name in names}
    saved = {name: x.copy() for name, x in mine.items()}
    results, trace = run_backend(args.device, mine, _options(case), comm, args, events)
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


def run_batch(args, comm, events):
    with open(args.cases) as f:
        cases = json.load(f)
    data = np.load(args.inputs)
    results = {}
    for case in cases:
        results.update(run_case(case, data, comm, args, events))
    return results


# -- serve mode --------------------------------------------------------------

def handle(request, comm, args, events):
    """This rank's part of one served request: {backend: {name: this rank's shard}}."""
    rank = comm.Get_rank()
    mine = {name: arrays[rank] for name, arrays in request["shards"].items()}
    replies = {}
    for device in request["backends"]:
        results, _ = run_backend(device, mine, _options(request["case"]), comm, args, events)
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
    ap.add_argument("--kernel", default="step")
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
    events = []
    if args.serve:
        serve_requests(args.serve, comm.Get_rank(), lambda req: handle(req, comm, args, events),
                       broadcast=share_quietly(comm), gather=lambda x: comm.gather(x, root=0))
        return
    results = run_batch(args, comm, events)
    order_ok = comm.gather(sends_follow_synchronize(events) if args.device == "numpy" else True)
    from gpu_impl.device import local_rank
    ranks = comm.gather(local_rank(comm))
    if comm.Get_rank() == 0:
        results["order_ok"] = np.array(all(order_ok))
        results["local_ranks"] = np.array(ranks)
        np.savez(args.results, **results)


if __name__ == "__main__":
    main()
