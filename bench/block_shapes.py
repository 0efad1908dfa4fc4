"""What one computed tile costs, by the shape of the block it belongs to.

The cost model charges every computed tile the same. In a NumPy step a tile
of a triangular block (striped's shape in every round, and every layout's own
block in round 0) may cost more than a tile of a fully visible block: its
diagonal tiles need the mask, and its ragged rows stack into shorter products.
This measures CPU seconds per computed tile for each shape, forward and
backward, one BLAS thread (held with threadpoolctl), the block attended after
the device's own block (as in rounds t >= 1). The steps and shapes take turns,
repeat after repeat, and each keeps its least time, so that a noisy machine
biases none of them. As `bench.kernel`, it runs with the machine's own BLAS
kernels (without OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE; ``--as-set`` keeps
them) and names the kernels that ran.

    python -m bench.block_shapes --seq-len 8192 --n-devices 4 --steps v3 v4
    python -m bench.block_shapes --seq-len 8192 --n-devices 8 --tile-size 128
"""

import argparse
import sys
import time
from contextlib import nullcontext

import numpy as np

from reference import positions, steps, usage
from reference.cores import blas_description, blas_limit
from reference.ring import own_block
from reference.step import BackwardRows, ForwardAcc, Grads, Queries

SHAPES = ("full (contiguous, j > k)", "triangle (striped, j > k)", "strict triangle (striped, j < k)")


def block_pairs(seq_len, n_devices):
    """{shape: (query positions, key positions)} of one device's round t >= 1."""
    striped, contiguous = (positions(seq_len, n_devices, name) for name in ("striped", "contiguous"))
    return dict(zip(SHAPES, ((contiguous[1], contiguous[0]), (striped[1], striped[0]), (striped[0], striped[1]))))


def timed_block(step, q_pos, k_pos, x, tile_size, backward=False, around=nullcontext):
    """CPU seconds of one step on the block (after the device's own block), and its tiles;
    the step runs inside ``around()`` (`bench.tile_parts` times its passes there)."""
    queries = Queries.prepare(x, x.shape[2], q_pos, x.shape[-1] ** -0.5)
    own, other = own_block(x, x, q_pos, 0), own_block(x, x, k_pos, 1)
    acc = ForwardAcc.zeros(queries.q)
    step.forward(acc, queries, own, causal=True, tile_size=tile_size)           # own block first
    with around():
        seconds, counts = _step(step, queries, acc, other, tile_size, backward)
    return seconds, counts.tiles_computed


def _step(step, queries, acc, other, tile_size, backward):
    start = time.thread_time()
    if backward:
        zeros = np.zeros(queries.q.shape[:-1], np.float32)
        rows = BackwardRows(do=queries.q, lse=zeros, delta=zeros)
        grads = Grads(np.zeros_like(queries.q), np.zeros_like(other.k), np.zeros_like(other.v))
        with np.errstate(over="ignore", invalid="ignore"):
            counts = step.backward(grads, queries, rows, other, causal=True, tile_size=tile_size)
    else:
        counts = step.forward(acc, queries, other, causal=True, tile_size=tile_size)
    return time.thread_time() - start, counts


def measure(step_names, seq_len, n_devices, heads, head_dim, tile_size, repeats=5, backward=False):
    """{(step name, shape): least CPU seconds per computed tile}, steps and shapes taking turns."""
    c = seq_len // n_devices
    x = np.random.default_rng(0).standard_normal((1, c, heads, head_dim), dtype=np.float32)   # (B, c, H, D)
    pairs, best = block_pairs(seq_len, n_devices), {}
    for _ in range(repeats):
        for name in step_names:
            step = steps.get(name, xp=np)
            for shape, (q_pos, k_pos) in pairs.items():
                seconds, tiles = timed_block(step, q_pos, k_pos, x, tile_size, backward)
                best[name, shape] = min(best.get((name, shape), np.inf), seconds / tiles)
    return best


def block_arguments(prog, doc, n_devices=4, tile_size=256):
    """The arguments of a benchmark of one device's blocks (this one, `bench.tile_parts`)."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("--seq-len", type=usage.count, default=8192, help="tokens S (default %(default)s)")
    ap.add_argument("--n-devices", type=usage.count, default=n_devices, help="devices N (default %(default)s)")
    ap.add_argument("--heads", type=usage.count, default=4, help="heads H (default %(default)s)")
    ap.add_argument("--head-dim", type=usage.count, default=64, help="head dim D (default %(default)s)")
    ap.add_argument("--tile-size", type=usage.count, default=tile_size, help="tile size (default %(default)s)")
    ap.add_argument("--repeats", type=usage.count, default=5, help="least of (default %(default)s)")
    ap.add_argument("--as-set", action="store_true",
                    help="keep OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE where set (default: run again without them)")
    ap.add_argument("--unset", default="", help=argparse.SUPPRESS)     # set by the rerun
    return ap


def run_on_one_thread(module, ap, argv, report):
    """``report(args, machine)`` for the options `ap` parses from `argv`, with
    one BLAS thread and the machine's own BLAS kernels: first run again without
    OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE (``--as-set`` keeps them)."""
    from .machine import cpu_name, kernels_note, rerun_with_machine_kernels
    args = ap.parse_args(argv)
    if args.seq_len % args.n_devices or args.seq_len < 2 * args.n_devices:
        ap.error(f"--seq-len ({args.seq_len}) must be a multiple of --n-devices ({args.n_devices}), "
                 "with at least 2 tokens a device")
    if not args.as_set and not args.unset:
        status = rerun_with_machine_kernels(module, sys.argv[1:] if argv is None else argv)
        if status is not None:
            sys.exit(status)
    with blas_limit(1):
        report(args, f"{cpu_name()}, BLAS {blas_description()}{kernels_note(args.unset)}")


def main(argv=None):
    ap = block_arguments("python -m bench.block_shapes", __doc__)
    ap.add_argument("--steps", nargs="+", default=["auto"], choices=steps.names(), metavar="STEP",
                    help=f"step versions, taking turns (default: auto; any of {', '.join(steps.names())})")
    ap.add_argument("--step", dest="steps", nargs=1, choices=steps.names(), help=argparse.SUPPRESS)
    run_on_one_thread("bench.block_shapes", ap, argv, report)


def report(args, machine):
    print(f"S={args.seq_len} N={args.n_devices} c={args.seq_len // args.n_devices} H={args.heads} "
          f"D={args.head_dim} tile={args.tile_size}, least of {args.repeats}; {machine}")
    for backward in (False, True):
        best = measure(args.steps, args.seq_len, args.n_devices, args.heads, args.head_dim, args.tile_size,
                       args.repeats, backward)
        for name in args.steps:
            print(f"{'backward' if backward else 'forward'}, step {steps.get(name, xp=np).label}:")
            base = best[name, SHAPES[0]]
            for shape in SHAPES:
                print(f"  {shape:<34} {best[name, shape] * 1e3:7.3f} ms/tile  x{best[name, shape] / base:.2f}")


if __name__ == "__main__":
    main()
