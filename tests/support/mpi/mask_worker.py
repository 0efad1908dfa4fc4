"""Run a batch of masked attention cases on MPI ranks; rank 0 writes the unsharded results.

    mpiexec -n N python -m mpi4py tests/support/mpi/mask_worker.py CASES.json INPUTS.npz RESULTS.npz

CASES.json is a list of {"id", "layout", "dtype", "options"}, with "options" the
keyword arguments of `mpi_impl.ring_attention` beyond the arrays and comm
(causal, scale, tile_size, step, window, cu_seqlens, segment_ids, dropout, seed).
INPUTS.npz holds each case's full q, k, v, dout, out, lse in float64 as
"<id>/q" ...; every rank casts them to the case's dtype (bfloat16 too), takes
its shard (`shard` pads a length the layout does not divide), runs the forward
(with the gathered trace) and the backward on the given out and lse, passing
``seq_len`` = S, and rank 0 writes "<id>/out", "<id>/lse", "<id>/dq", "<id>/dk",
"<id>/dv" (in float64, real tokens only) and the trace's "<id>/pairs",
"<id>/tiles_computed".
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from mpi_impl import ring_attention, ring_attention_backward
from reference import shard, unshard

try:
    import ml_dtypes
    DTYPES = {"bfloat16": ml_dtypes.bfloat16}
except ImportError:
    DTYPES = {}


def run_case(case, data, comm):
    n, rank, layout = comm.Get_size(), comm.Get_rank(), case["layout"]
    dtype = DTYPES.get(case["dtype"], case["dtype"])
    full = {name: data[f"{case['id']}/{name}"] for name in ("q", "k", "v", "dout", "out", "lse")}
    S = full["q"].shape[1]
    mine = {name: shard(x if name == "lse" else x.astype(dtype), n, layout, axis=2 if name == "lse" else 1)[rank]
            for name, x in full.items()}
    mine["lse"] = mine["lse"].astype(np.float32 if np.dtype(dtype) != np.float64 else np.float64)
    opts = dict(case["options"])
    if isinstance(opts.get("tile_size"), list):
        opts["tile_size"] = tuple(opts["tile_size"])
    if opts.get("segment_ids") is not None:
        opts["segment_ids"] = np.asarray(opts["segment_ids"])
    opts.update(comm=comm, layout=layout, seq_len=S)
    q, k, v, dout = (mine[name] for name in ("q", "k", "v", "dout"))
    out, lse, trace = ring_attention(q, k, v, trace=True, **opts)
    dq, dk, dv = ring_attention_backward(q, k, v, mine["out"], mine["lse"], dout, **opts)
    gathered = comm.gather((out, lse, dq, dk, dv))
    if rank != 0:
        return {}
    axes = dict(out=1, lse=2, dq=1, dk=1, dv=1)
    result = {f"{case['id']}/{name}": unshard([g[i] for g in gathered], layout, axis=axes[name],
                                              seq_len=S).astype(np.float64)
              for i, name in enumerate(axes)}
    result[f"{case['id']}/dtype"] = np.array(str(out.dtype))
    for name in ("pairs", "tiles_computed"):
        result[f"{case['id']}/{name}"] = getattr(trace, name)
    return result


def main(cases_path, inputs_path, results_path):
    comm = MPI.COMM_WORLD
    with open(cases_path) as f:
        cases = json.load(f)
    data = np.load(inputs_path)
    results = {}
    for case in cases:
        results.update(run_case(case, data, comm))
    if comm.Get_rank() == 0:
        np.savez(results_path, **results)


if __name__ == "__main__":
    main(*sys.argv[1:4])
