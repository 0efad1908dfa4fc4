"""Striped Attention on real processes: one MPI rank per device, K/V blocks on a real ring.

The per-device loop is `reference.ring` (written once, shared with the virtual
devices and the GPUs); this package adds the communication object (`RingComm`:
non-blocking buffer sends and receives of raw bytes, double-buffered, a tag per
message kind), the collective agreement check, and a command line.

    mpiexec -n 4 python -m mpi4py -m mpi_impl --layout all --check

    from mpi_impl import ring_attention, ring_attention_backward
    out, lse = ring_attention(q, k, v, comm=MPI.COMM_WORLD, layout="striped")   # this rank's shard

Modules: `comm` (the three verbs over MPI), `attention` (the public functions),
`cli` (the command line, reusable by other backends), `plan` (its run, resolved
once per layout), `launch` (finding mpiexec).
"""

from .attention import agree, gather_trace, ring_attention, ring_attention_backward
from .comm import RingComm

__all__ = ["ring_attention", "ring_attention_backward", "RingComm", "agree", "gather_trace"]
