"""What one computed tile costs, by the shape of the block it belongs to.

The cost model charges every computed tile the same. In the NumPy step a tile
of a triangular block (striped's shape in every round, and every layout's own
block in round 0) costs more than a tile of a fully visible block: its
diagonal tiles need the mask, and its ragged rows stack into shorter products.
This measures CPU seconds per computed tile for each shape, one BLAS thread,
the block attended after the device's own block (as in rounds t >= 1).

    OPENBLAS_NUM_THREADS=1 python -m bench.block_shapes --seq-len 16384 --n-devices 4
"""

import argparse
import time

import numpy as np

from reference import positions, steps
from reference.ring import own_block
from reference.step import ForwardAcc, Queries


def per_tile_seconds(step, q_pos, k_pos, x, tile_size, repeats=3):
    """Best CPU seconds per computed tile of one block, and the tiles computed."""
    best, tiles = float("inf"), 0
    queries = Queries.prepare(x, x.shape[2], q_pos, x.shape[-1] ** -0.5)
    own, other = own_block(x, x, q_pos, 0), own_block(x, x, k_pos, 1)
    for _ in range(repeats):
        acc = ForwardAcc.zeros(queries.q)
        step.forward(acc, queries, own, causal=True, tile_size=tile_size)      # own block first
        start = time.thread_time()
        counts = step.forward(acc, queries, other, causal=True, tile_size=tile_size)
        best, tiles = min(best, time.thread_time() - start), counts.tiles_computed
    return best / tiles, tiles


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.block_shapes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=16384, help="tokens S (default %(default)s)")
    ap.add_argument("--n-devices", type=int, default=4, help="devices N (default %(default)s)")
    ap.add_argument("--heads", type=int, default=4, help="heads H (default %(default)s)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dim D (default %(default)s)")
    ap.add_argument("--tile-size", type=int, default=256, help="tile size (default %(default)s)")
    ap.add_argument("--step", default="auto", choices=steps.NAMES, help="step version (default %(default)s)")
    args = ap.parse_args(argv)
    step = steps.get(args.step, xp=np)
    c = args.seq_len // args.n_devices
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, c, args.heads, args.head_dim), dtype=np.float32)   # (B, c, H, D)
    striped, contiguous = (positions(args.seq_len, args.n_devices, name) for name in ("striped", "contiguous"))
    shapes = {"full (contiguous, j > k)": (contiguous[1], contiguous[0]),
              "triangle (striped, j > k)": (striped[1], striped[0]),
              "strict triangle (striped, j < k)": (striped[0], striped[1])}
    print(f"S={args.seq_len} N={args.n_devices} c={c} H={args.heads} D={args.head_dim} tile={args.tile_size} "
          f"step {step!r}")
    base = None
    for name, (q_pos, k_pos) in shapes.items():
        seconds, tiles = per_tile_seconds(step, q_pos, k_pos, x, args.tile_size)
        base = base or seconds
        print(f"{name:<34} {tiles:>5} tiles  {seconds * 1e3:7.3f} ms/tile  x{seconds / base:.2f}")


if __name__ == "__main__":
    main()
