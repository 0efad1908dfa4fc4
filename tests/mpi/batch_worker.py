"""Run a batch of attention cases on MPI ranks; rank 0 writes the unsharded results.

    mpiexec -n N python -m mpi4py tests/mpi/batch_worker.py CASES.json INPUTS.npz RESULTS.npz

CASES.json is a list of {"id", "layout", "causal", "scale", "tile_size"}; INPUTS.npz
holds each case's full q, k, v, dout and the dense reference's out, lse as
"<id>/q" ... Every rank takes its own shard, runs `mpi_impl.ring_attention`
(with the gathered trace) and `ring_attention_backward` (on the reference's out
and lse, as tests/test_ring.py does, so that only the backward's own error is
compared), and rank 0 writes "<id>/out", "<id>/lse", "<id>/dq", "<id>/dk",
"<id>/dv" and the forward trace's "<id>/pairs", "<id>/tiles_computed",
"<id>/source", "<id>/bytes_sent", and "<id>/inputs_unchanged" (no rank's
inputs were written to by the forward or backward). The test compares them with the reference.
Launching once for many cases keeps the MPI start-up cost out of each case.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from mpi_impl import ring_attention, ring_attention_backward
from reference import shard, unshard


def run_case(case, data, comm):
    n, rank, layout = comm.Get_size(), comm.Get_rank(), case["layout"]
    mine = {name: shard(data[f"{case['id']}/{name}"], n, layout, axis=2 if name == "lse" else 1)[rank]
            for name in ("q", "k", "v", "dout", "out", "lse")}
    q, k, v, dout = (mine[name] for name in ("q", "k", "v", "dout"))
    tile = tuple(case["tile_size"]) if isinstance(case["tile_size"], list) else case["tile_size"]
    opts = dict(comm=comm, layout=layout, causal=case["causal"], scale=case["scale"], tile_size=tile)
    saved = {name: x.copy() for name, x in mine.items()}
    out, lse, trace = ring_attention(q, k, v, trace=True, **opts)
    # the backward gets the reference's out and lse, so that only its own error is compared
    dq, dk, dv = ring_attention_backward(q, k, v, mine["out"], mine["lse"], dout, **opts)
    unchanged = all(np.array_equal(saved[name], x, equal_nan=True) for name, x in mine.items())
    unchanged = comm.allreduce(unchanged, op=MPI.LAND)
    gathered = comm.gather((out, lse, dq, dk, dv))
    if rank != 0:
        return {}
    axes = dict(out=1, lse=2, dq=1, dk=1, dv=1)
    result = {f"{case['id']}/{name}": unshard([g[i] for g in gathered], layout, axis=axes[name])
              for i, name in enumerate(axes)}
    for name in ("pairs", "tiles_computed", "source", "bytes_sent"):
        result[f"{case['id']}/{name}"] = getattr(trace, name)
    result[f"{case['id']}/inputs_unchanged"] = np.array(unchanged)
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
