"""Striped Attention on real processes: one MPI rank per device, K/V blocks on a real ring.

The per-device loop is `reference.ring` (written once, shared with the virtual
devices and the GPUs); this package adds the communication object, the
collective agreement check and a command line (the guide: docs/mpi.md).

    mpiexec -n 4 python -m mpi4py -m mpi_impl --layout all --check

    from mpi_impl import ring_attention, ring_attention_backward
    out, lse = ring_attention(q, k, v, comm=MPI.COMM_WORLD, layout="striped")   # this rank's shard

Modules, in reading order:

    attention     the public functions: this rank's shard in, its shard out; `agree`
    comm          `RingComm`: the ring's three verbs over MPI, double-buffered
    memory        where the ring's bytes live: the host's arrays, or a backend's buffers
    ranks         how errors name ranks, and `RingError`
    notices       the end of a call between neighbours: "done", or why a rank left
    groups        a scheme's communicators, split once per call; a placement's communicator
    links         links emulated on one machine: ranks as nodes, each transfer held for its link's time
    cores         each rank's share of its machine's cores, and waiting without spinning
    launch        finding the `mpiexec` that starts the ranks
    cli           the command line: every layout on MPI ranks, and what it cost
    plan          the command line's run, resolved once per layout: mask, steps, calls
    scheme_args   the command line's --scheme, --ulysses-degree, emulated nodes and the choice line
    check         --check: the results against the float64 reference, on rank 0
    table         the command line's output: the table, --trace-out, --plot
    __main__      `python -m mpi_impl`: the command line
"""

from .attention import agree, gather_trace, ring_attention, ring_attention_backward
from .comm import RingComm

__all__ = ["ring_attention", "ring_attention_backward", "RingComm", "agree", "gather_trace"]
