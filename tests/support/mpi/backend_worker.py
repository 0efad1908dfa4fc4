"""The command line driven by another backend, as gpu_impl drives it.

    mpiexec -n 3 python -m mpi4py tests/support/mpi/backend_worker.py

A stand-in backend (NumPy arrays copied in and out, its own communication
object factory, an extra option) runs `mpi_impl.cli.main` with --check; the
exit status is the check's, and each rank says how many rings it built.
"""

import functools
import sys

import numpy as np
from mpi4py import MPI

import mpi_impl
from mpi_impl.cli import Backend, build_parser, main
from mpi_impl.comm import RingComm

built = []


def make_ring(comm):
    built.append(comm)
    return RingComm.on(comm)


def backend(args):
    ring = functools.partial(mpi_impl.ring_attention, make_ring=make_ring)
    ring_backward = functools.partial(mpi_impl.ring_attention_backward, make_ring=make_ring)
    return Backend(f"stand-in ({args.transfer})", ring, ring_backward, to_device=np.array, to_host=np.array)


if __name__ == "__main__":
    parser = build_parser(prog="stand-in")
    parser.add_argument("--transfer", choices=("staged", "direct"), default="staged")
    status = main(sys.argv[1:], backend=backend, parser=parser)
    print(f"rank {MPI.COMM_WORLD.Get_rank()}: built {len(built)} rings", flush=True)
    sys.exit(status)
