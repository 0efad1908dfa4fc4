"""Every scheme and placement on emulated nodes, one after another in one job: tests/mpi/test_links.py.

    mpiexec -n 4 python -m mpi4py tests/support/mpi/links_worker.py SPEC.json OUT.npz

SPEC.json: the machine (ranks per node, GB/s inside and between nodes), the
shapes, and the runs, each a scheme's keyword arguments (`Scheme.describe()`)
and a placement's name. Each run places the world's ranks
(`mpi_impl.groups.placed`), runs the forward and the backward with rings over
the emulated links (`mpi_impl.links`), and rank 0 writes the traces' bytes
per link and the largest error of out and dq against the dense oracle.
"""

import functools
import json
import sys

import numpy as np
from mpi4py import MPI

from mpi_impl import RingComm, ring_attention, ring_attention_backward
from mpi_impl.groups import placed
from mpi_impl.links import EmulatedLinks
from reference import attention, attention_backward
from reference.layouts import shard_at
from reference.schemes import Scheme
from reference.topology import Link, Machine, placement


def main(spec_path, out_path):
    spec = json.loads(open(spec_path).read())
    world = MPI.COMM_WORLD
    machine = Machine(spec["ranks_per_node"], Link(spec["intra"]), Link(spec["inter"]))
    links = EmulatedLinks(machine, world.Get_rank())
    S, Hq, Hkv, D = spec["S"], spec["Hq"], spec["Hkv"], spec["D"]
    rng = np.random.default_rng(0)
    q, dout = (rng.standard_normal((1, S, Hq, D)) for _ in range(2))
    k, v = (rng.standard_normal((1, S, Hkv, D)) for _ in range(2))
    out, lse = attention(q, k, v)
    dq = attention_backward(q, k, v, out, lse, dout)[0]
    found = {}
    for i, (options, where) in enumerate(spec["runs"]):
        scheme = Scheme.checked(**{"name": options["scheme"], **{k: x for k, x in options.items() if k != "scheme"}},
                                n_devices=world.Get_size(), Hq=Hq, Hkv=Hkv)
        comm = placed(world, placement(scheme, machine, where))
        pos = scheme.positions(S, spec["layout"])
        mine = [shard_at(x, pos)[comm.Get_rank()] for x in (q, k, v, out, dout, dq)]
        call = dict(comm=comm, layout=spec["layout"], tile_size=spec["tile"], trace=True, step="v1",
                    make_ring=functools.partial(RingComm.on, links=links), **options)
        got, got_lse, forward = ring_attention(*mine[:3], **call)
        *grads, backward = ring_attention_backward(*mine[:3], got, got_lse, mine[4], **call)
        error = comm.allreduce(max(np.abs(got - mine[3]).max(), np.abs(grads[0] - mine[5]).max()), op=MPI.MAX)
        for kind, trace in (("forward", forward), ("backward", backward)):
            for name in ("sent_intra", "sent_inter", "bytes_sent"):
                found[f"{i}/{kind}/{name}"] = getattr(trace, name)
        found[f"{i}/error"] = np.array(error)
        comm.Free()
    if world.Get_rank() == 0:
        np.savez(out_path, **found)


if __name__ == "__main__":
    main(*sys.argv[1:3])
