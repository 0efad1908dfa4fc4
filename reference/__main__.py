"""Run the virtual-device ring for each layout and print its per-device work.

    python -m reference                       # S=64, N=4, tiles of 4
    python -m reference --seq-len 256 --n-devices 8 --tile-size 8
    python -m reference --seq-len 8192 --n-devices 8 --tile-size 128 --step auto --threads 1 --blas-threads 1

Each table shows, per round and device, the visible (query, key) pairs and the
tiles computed out of all tiles of the block held: contiguous leaves some
devices idle while one does a full block; striped gives every device about
half a block every round.
"""

import argparse

import numpy as np

from . import cores, cost, steps, usage
from .dense import attention
from .layouts import LAYOUTS
from .virtual import ring_attention


def parse_args(argv=None):
    """The options, checked before any work (with the library's own checks): a usage error names the option."""
    ap = argparse.ArgumentParser(prog="python -m reference", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=usage.count, default=64, help="tokens S (default %(default)s)")
    ap.add_argument("--n-devices", type=usage.count, default=4, help="virtual devices N (default %(default)s)")
    ap.add_argument("--tile-size", type=usage.count, default=4, help="tile size (default %(default)s)")
    ap.add_argument("--heads", type=usage.count, default=2, help="query heads (default %(default)s)")
    ap.add_argument("--head-dim", type=usage.count, default=16, help="head dim D (default %(default)s)")
    ap.add_argument("--layout", choices=LAYOUTS + ("all",), default="all", help="how tokens are dealt to devices")
    ap.add_argument("--step", choices=steps.names(), default=steps.DEFAULT, help="block step (default %(default)s)")
    ap.add_argument("--threads", type=usage.count, default=None,
                    help="worker threads per device, for steps that take them (default: the devices' share of "
                         "the cores, reference.cores)")
    ap.add_argument("--blas-threads", type=usage.count, default=None,
                    help="BLAS threads per product (default: the devices' share of the cores)")
    ap.add_argument("--seed", type=usage.natural, default=0, help="seed of the random q, k, v")
    args = ap.parse_args(argv)
    try:
        cores.for_devices(steps.get(args.step, xp=np), args.n_devices, threads=args.threads,
                          blas_threads=args.blas_threads)
    except ValueError as e:
        ap.error(usage.option_words(str(e), ("threads", "blas_threads")))
    return args


def main(argv=None):
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    q, k, v = (rng.standard_normal((1, args.seq_len, args.heads, args.head_dim)) for _ in range(3))
    ref_out, _ = attention(q, k, v)
    layouts = LAYOUTS if args.layout == "all" else (args.layout,)
    summary = []
    for layout in layouts:
        out, _, trace = ring_attention(q, k, v, n_devices=args.n_devices, layout=layout,
                                       tile_size=args.tile_size, trace=True, step=args.step,
                                       threads=args.threads, blas_threads=args.blas_threads)
        err = float(np.abs(out - ref_out).max())
        print(trace.table(f"\n{layout}: S={args.seq_len}, N={args.n_devices}, tile={args.tile_size}, "
                          f"max error vs dense {err:.1e}; step {trace.step}; {trace.threads}"))
        summary.append((layout, err, trace.critical_path("pairs"),
                        cost.speedup(args.seq_len, args.n_devices, layout, args.tile_size, "tiles")))
    print(f"\n{'layout':<11} {'max error':>10} {'critical pairs':>15} {'predicted speedup (tiles)':>26}")
    for layout, err, crit, s in summary:
        print(f"{layout:<11} {err:>10.1e} {crit:>15} {s:>26.2f}")


if __name__ == "__main__":
    main()
