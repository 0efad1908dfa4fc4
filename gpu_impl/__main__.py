"""The command line of gpu_impl: mpi_impl's, on GPUs, plus the transfer path.

    mpiexec -n 4 python -m mpi4py -m gpu_impl --layout all --check
    mpiexec -n 4 python -m mpi4py -m gpu_impl --seq-len 16384 --step fused
    mpiexec -n 2 python -m mpi4py -m gpu_impl --seq-len 16384 --transfer staged --step fused --tile-size 32x32

Same options and table as ``python -m mpi_impl`` (see `mpi_impl.cli`). Each rank
takes the GPU of its local rank, read from the launcher's environment before
MPI starts (`gpu_impl.device`). The table's first line names the GPU and the
transfer path used, and why (``--transfer auto`` asks the MPI library); its
critical path sums the step's time on the GPU (CUDA events), and wait/compute
is the GPU's idle time between steps over its time in them. ``--step fused``
without ``--tile-size`` uses the fused kernel's own tile. Without CuPy or a GPU
it says which is missing and exits with status 2.
"""

import functools
import sys

from mpi_impl import cli

from . import api
from .steps import fused
from .device import GpuUnavailable, local_rank_from_env, require_cupy, use_local_device
from .transfer import TRANSFERS, choose_transfer

DEFAULT_TILE = 128      # mpi_impl's


def build_parser():
    ap = cli.build_parser(prog="mpiexec -n N python -m mpi4py -m gpu_impl",
                          description=__doc__.split("\n\n")[0])
    ap.set_defaults(tile_size=None)         # the step's own: see main
    ap.add_argument("--transfer", choices=TRANSFERS, default="auto",
                    help="how blocks move between GPUs: auto (ask MPI whether it is CUDA-aware), "
                         "cuda-aware (device buffers to MPI; fails if MPI says no), staged (through pinned "
                         "host memory), cuda-aware-unchecked (device buffers without asking)")
    return ap


def backend(args, comm, index):
    """The command line's Backend for CuPy on this rank's GPU."""
    cupy = require_cupy()
    path, reason = choose_transfer(args.transfer)
    name = cupy.cuda.runtime.getDeviceProperties(index)["name"].decode()
    opts = dict(transfer=args.transfer)
    return cli.Backend(
        name=f"gpu_impl on {name} (rank 0: GPU {index}), transfer {path} [{reason}]",
        ring_attention=functools.partial(api.ring_attention, **opts),
        ring_attention_backward=functools.partial(api.ring_attention_backward, **opts),
        to_device=cupy.asarray, to_host=cupy.asnumpy,
        synchronize=lambda: cupy.cuda.Device().synchronize(), array_module=cupy, busy="compute_s")


def parse(argv=None):
    """(parser, args), the tile defaulting to the step's own: the fused kernel's
    (fused.DEFAULT_TILE, which fits its shared memory), None for fused_v2 (its
    kernel's, per head dim), else mpi_impl's."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tile_size is None and args.step != "fused_v2":
        args.tile_size = fused.DEFAULT_TILE if args.step == "fused" else DEFAULT_TILE
        parser.set_defaults(tile_size=args.tile_size)      # cli.main parses again
    return parser, args


def main(argv=None):
    parser, args = parse(argv)
    try:
        index = use_local_device() if local_rank_from_env() is not None else None   # before MPI starts
    except GpuUnavailable as e:
        print(e, file=sys.stderr)
        return 2
    from mpi4py import MPI
    try:
        if index is None:                   # a launcher that exports no local rank: ask MPI
            index = use_local_device(MPI.COMM_WORLD)
        be = backend(args, MPI.COMM_WORLD, index)
    except GpuUnavailable as e:
        print(e, file=sys.stderr)
        return 2
    except ValueError as e:                 # e.g. --transfer cuda-aware on an MPI that says no
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    return cli.main(argv, be, parser)


if __name__ == "__main__":
    sys.exit(main())
