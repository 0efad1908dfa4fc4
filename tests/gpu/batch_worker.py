"""Run a batch of attention cases through gpu_impl's transfers on MPI ranks; rank 0 writes the results.

    mpiexec -n N python -m mpi4py tests/gpu/batch_worker.py CASES.json INPUTS.npz RESULTS.npz \
        --device numpy|cupy --transfer staged|cuda-aware [--step auto|v1|fused] [--managed]

The file formats are tests/mpi/batch_worker.py's: CASES.json lists {"id",
"layout", "causal", "scale", "tile_size"}, INPUTS.npz holds "<id>/q", "k", "v",
"dout"; rank 0 writes "<id>/out", "lse", "dq", "dk", "dv" (unsharded, NumPy)
and the forward trace's "<id>/pairs", "source".

--device cupy   runs `gpu_impl.ring_attention` and `ring_attention_backward` on
                this rank's GPU (local rank), CuPy arrays, the chosen transfer.
--device numpy  runs the same ring (`reference.ring`) over the same
                `gpu_impl.transfer.DeviceRing` with `gpu_impl.device.NumpyDevice`
                standing in for the GPU: every data-movement path without one.
                Each rank also records the order of its device and MPI calls,
                and rank 0 writes "order_ok" (1 when every send followed a
                synchronize) and "local_ranks".
"""

import argparse
import json

import numpy as np
from mpi4py import MPI

from gpu_impl.device import NumpyDevice, local_rank
from gpu_impl.transfer import TAG_STRIDE, DeviceRing
from reference import ring, shard, unshard
from reference.layouts import positions

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


def run_numpy(q, k, v, dout, opts, comm, transfer, events):
    n, rank = comm.Get_size(), comm.Get_rank()
    pos = positions(q.shape[1] * n, n, opts["layout"])[rank]
    kw = dict(causal=opts["causal"], scale=opts["scale"] or q.shape[-1] ** -0.5, tile_size=opts["tile_size"])
    dup = comm.Dup()
    device = NumpyDevice(events)
    ring_comm = DeviceRing(RecordingComm(dup, events), device, transfer)
    out, lse, log = ring.ring_forward(q, k, v, pos, pos, ring_comm, **kw)
    dq, dk, dv, _ = ring.ring_backward(q, k, v, out, lse, dout, pos, pos, ring_comm, **kw)
    dup.Free()
    return (out, lse, dq, dk, dv), log


def run_cupy(q, k, v, dout, opts, comm, transfer, step):
    import cupy
    import gpu_impl
    q, k, v, dout = (cupy.asarray(x) for x in (q, k, v, dout))
    out, lse, log = gpu_impl.ring_attention(q, k, v, comm=comm, transfer=transfer, step=step,
                                            trace="rank", **opts)
    grads = gpu_impl.ring_attention_backward(q, k, v, out, lse, dout, comm=comm, transfer=transfer, **opts)
    return tuple(cupy.asnumpy(x) for x in (out, lse) + grads), log


def run_case(case, data, comm, args, events):
    n, rank, layout = comm.Get_size(), comm.Get_rank(), case["layout"]
    q, k, v, dout = (shard(data[f"{case['id']}/{name}"], n, layout)[rank] for name in ("q", "k", "v", "dout"))
    tile = tuple(case["tile_size"]) if isinstance(case["tile_size"], list) else case["tile_size"]
    opts = dict(layout=layout, causal=case["causal"], scale=case["scale"], tile_size=tile)
    if args.device == "numpy":
        results, log = run_numpy(q, k, v, dout, opts, comm, args.transfer, events)
    else:
        results, log = run_cupy(q, k, v, dout, opts, comm, args.transfer, args.step)
    gathered, logs = comm.gather(results), comm.gather(log)
    if rank != 0:
        return {}
    out = {f"{case['id']}/{name}": unshard([g[i] for g in gathered], layout, axis=AXES[name])
           for i, name in enumerate(AXES)}
    out[f"{case['id']}/pairs"] = np.stack([lg.pairs for lg in logs], axis=1)
    out[f"{case['id']}/source"] = np.stack([lg.source for lg in logs], axis=1)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("cases"), ap.add_argument("inputs"), ap.add_argument("results")
    ap.add_argument("--device", choices=("numpy", "cupy"), required=True)
    ap.add_argument("--transfer", default="auto")
    ap.add_argument("--step", default="auto")
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
    with open(args.cases) as f:
        cases = json.load(f)
    data = np.load(args.inputs)
    results, events = {}, []
    for case in cases:
        results.update(run_case(case, data, comm, args, events))
    order_ok = comm.gather(sends_follow_synchronize(events) if args.device == "numpy" else True)
    ranks = comm.gather(local_rank(comm))
    if comm.Get_rank() == 0:
        results["order_ok"] = np.array(all(order_ok))
        results["local_ranks"] = np.array(ranks)
        np.savez(args.results, **results)


if __name__ == "__main__":
    main()
