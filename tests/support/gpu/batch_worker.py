"""Run a batch of attention cases through gpu_impl's transfers on MPI ranks; rank 0 writes the results.

    mpiexec -n N python -m mpi4py tests/support/gpu/batch_worker.py CASES.json INPUTS.npz RESULTS.npz \
        --device queued|cupy --transfer staged|cuda-aware [--step auto|v1|fused] [--managed]

The file formats are tests/support/mpi/batch_worker.py's: CASES.json lists {"id",
"layout", "causal", "scale", "tile_size"}, INPUTS.npz holds "<id>/q", "k", "v",
"dout"; rank 0 writes "<id>/out", "lse", "dq", "dk", "dv" (unsharded, NumPy)
and the forward trace's "<id>/pairs", "source".

--device cupy   runs `gpu_impl.ring_attention` and `ring_attention_backward` on
                this rank's GPU (local rank), CuPy arrays, the chosen transfer.
--device queued runs the same ring (`reference.ring`) over the same
                `mpi_impl.comm.RingComm` and memory object on a GPU made of NumPy
                whose streams run later (tests/support/gpu/queued_device.py; even ranks
                run copies early, odd ranks kernels early): every data-movement
                path, and its stream order, without a GPU. Rank 0 also writes
                "local_ranks" (MPI's) and "env_local_ranks" (the launcher's).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from gpu_impl.device import local_rank, local_rank_from_env
from gpu_impl.transfer import memory_for
from mpi_impl.comm import RingComm
from reference import ring, shard, unshard
from reference.layouts import positions
from reference.masks import as_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))
from queued_device import POLICIES, QueuedDevice, QueuedStep  # noqa: E402

AXES = dict(out=1, lse=2, dq=1, dk=1, dv=1)


def run_queued(q, k, v, dout, opts, comm, transfer):
    n, rank = comm.Get_size(), comm.Get_rank()
    pos = positions(q.shape[1] * n, n, opts["layout"])[rank]
    kw = dict(mask=as_mask(opts["causal"]), scale=opts["scale"] or q.shape[-1] ** -0.5, tile_size=opts["tile_size"])
    gpu = QueuedDevice(POLICIES[rank % 2])
    with gpu.installed():
        ring_comm = RingComm.on(comm, memory_for(transfer, gpu))
        q, k, v, dout = (gpu.asarray(x) for x in (q, k, v, dout))
        out, lse, log = ring.ring_forward(q, k, v, pos, pos, ring_comm, step=QueuedStep(gpu), **kw)
        dq, dk, dv, _ = ring.ring_backward(q, k, v, out, lse, dout, pos, pos, ring_comm,
                                           step=QueuedStep(gpu), **kw)
        ring_comm.free()
        return tuple(x.get() for x in (out, lse, dq, dk, dv)), log


def run_cupy(q, k, v, dout, opts, comm, transfer, step):
    import cupy
    import gpu_impl
    q, k, v, dout = (cupy.asarray(x) for x in (q, k, v, dout))
    out, lse, log = gpu_impl.ring_attention(q, k, v, comm=comm, transfer=transfer, step=step,
                                            trace="rank", **opts)
    grads = gpu_impl.ring_attention_backward(q, k, v, out, lse, dout, comm=comm, transfer=transfer, **opts)
    return tuple(cupy.asnumpy(x) for x in (out, lse) + grads), log


def run_case(case, data, comm, args):
    n, rank, layout = comm.Get_size(), comm.Get_rank(), case["layout"]
    q, k, v, dout = (shard(data[f"{case['id']}/{name}"], n, layout)[rank] for name in ("q", "k", "v", "dout"))
    tile = tuple(case["tile_size"]) if isinstance(case["tile_size"], list) else case["tile_size"]
    opts = dict(layout=layout, causal=case["causal"], scale=case["scale"], tile_size=tile)
    if args.device == "queued":
        results, log = run_queued(q, k, v, dout, opts, comm, args.transfer)
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
    if "cupy" in (argv or sys.argv):
        import gpu_impl
        gpu_impl.use_local_device()         # before MPI starts (the launcher's local rank)
    ap = argparse.ArgumentParser()
    ap.add_argument("cases"), ap.add_argument("inputs"), ap.add_argument("results")
    ap.add_argument("--device", choices=("queued", "cupy"), required=True)
    ap.add_argument("--transfer", default="auto")
    ap.add_argument("--step", default="auto")
    ap.add_argument("--managed", action="store_true",
                    help="CuPy arrays in managed memory, which any MPI can read: tests the "
                         "cuda-aware path where the MPI library is not CUDA-aware")
    args = ap.parse_args(argv)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if args.device == "cupy":
        import cupy
        if args.managed:
            cupy.cuda.set_allocator(cupy.cuda.MemoryPool(cupy.cuda.malloc_managed).malloc)
    with open(args.cases) as f:
        cases = json.load(f)
    data = np.load(args.inputs)
    results = {}
    for case in cases:
        results.update(run_case(case, data, comm, args))
    ranks, env_ranks = comm.gather(local_rank(comm)), comm.gather(local_rank_from_env())
    if comm.Get_rank() == 0:
        results["local_ranks"] = np.array(ranks)
        results["env_local_ranks"] = np.array([-1 if r is None else r for r in env_ranks])
        np.savez(args.results, **results)


if __name__ == "__main__":
    main()
