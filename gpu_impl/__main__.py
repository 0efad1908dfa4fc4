"""The command line of gpu_impl: mpi_impl's, on GPUs, plus the transfer path.

    mpiexec -n 4 python -m mpi4py -m gpu_impl --layout all --check
    mpiexec -n 2 python -m mpi4py -m gpu_impl --seq-len 16384 --transfer cuda-aware --step fused --tile-size 32

Same options and table as ``python -m mpi_impl`` (see `mpi_impl.cli`); each rank
takes the GPU of its local rank, and the table's first line names the GPU,
the transfer path used (and why); its step is `--step` (auto: v1 on CuPy; fused). Without CuPy or a GPU it
says which is missing and exits with status 2.
"""

import functools
import sys

from mpi_impl import cli

from . import api
from .device import GpuUnavailable, require_cupy
from .transfer import TRANSFERS, choose_transfer


def build_parser():
    ap = cli.build_parser(prog="mpiexec -n N python -m mpi4py -m gpu_impl",
                          description=__doc__.split("\n\n")[0])
    ap.add_argument("--transfer", choices=TRANSFERS, default="auto",
                    help="how blocks move between GPUs: auto (= staged: mpi4py cannot ask MPI), "
                         "cuda-aware (device buffers to MPI), staged (through pinned host memory)")
    return ap


def backend(args, comm):
    """mpi_impl.cli's Backend for CuPy on this rank's GPU."""
    cupy = require_cupy()
    index = api.use_local_device(comm)
    path, reason = choose_transfer(args.transfer)
    name = cupy.cuda.runtime.getDeviceProperties(index)["name"].decode()
    opts = dict(transfer=args.transfer)
    return cli.Backend(
        name=f"gpu_impl on {name} (rank 0: GPU {index}), transfer {path} [{reason}]",
        ring_attention=functools.partial(api.ring_attention, **opts),
        ring_attention_backward=functools.partial(api.ring_attention_backward, **opts),
        to_device=cupy.asarray, to_host=cupy.asnumpy,
        synchronize=lambda: cupy.cuda.Device().synchronize(), array_module=cupy)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    from mpi4py import MPI
    try:
        be = backend(args, MPI.COMM_WORLD)
    except GpuUnavailable as e:
        print(e, file=sys.stderr)
        return 2
    return cli.main(argv, be, parser)


if __name__ == "__main__":
    sys.exit(main())
