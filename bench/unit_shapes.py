"""How step v5's forward is cut into units and products, tried against its own cut.

`reference.steps.units.forward_units` stacks neighbouring query tiles up to
``UNIT_ROWS`` rows and computes each key tile they share in one product;
step v5 then joins neighbouring key tiles of a stack that need no mask into
one product (`units.join_full`), as many as keep a group's scores within
its budget (`v5.join_width`: 2 at tiles of 128 with 4 heads, 1 at 256).
A triangular block's stacks are ragged, so it has fewer tiles a product than
a full block, and each product's fixed work weighs more on its tiles
(`bench.tile_parts`). This tries another cut against v5's own, in the same
process, taking turns repeat after repeat (`bench.block_shapes`' blocks and
CPU time per computed tile):

- ``--rows R``: stacks of up to R rows (v5: UNIT_ROWS, 512);
- ``--join W``: up to W full key tiles a product (v5: `join_width`; 1 is the
  cut before joining).

BENCHMARKS.md ("Unit shapes tried") gives what they measured.

    python -m bench.unit_shapes --seq-len 8192 --n-devices 8 --tile-size 128 --join 1
    python -m bench.unit_shapes --seq-len 8192 --n-devices 8 --tile-size 128 --rows 1024
"""

from contextlib import contextmanager

import numpy as np

from reference import steps, usage
from reference.steps import units, v5

from .block_shapes import SHAPES, block_arguments, block_pairs, run_on_one_thread, timed_block


@contextmanager
def cut(rows=None, join=None):
    """Step v5's forward cut into stacks of up to `rows` rows and products of
    up to `join` full key tiles (None: v5's own), meanwhile."""
    own_rows, own_join = units.UNIT_ROWS, v5.join_width
    units.UNIT_ROWS = v5.UNIT_ROWS = rows or own_rows      # (v5 sizes its groups of heads by it)
    if join is not None:
        v5.join_width = lambda *shape: join
    try:
        yield
    finally:
        units.UNIT_ROWS = v5.UNIT_ROWS = own_rows
        v5.join_width = own_join


def main(argv=None):
    ap = block_arguments("python -m bench.unit_shapes", __doc__, n_devices=8, tile_size=128)
    ap.add_argument("--rows", type=usage.count, default=None, help="stacks of up to this many rows (default: v5's)")
    ap.add_argument("--join", type=usage.count, default=None, help="full key tiles a product, at most (default: v5's)")
    run_on_one_thread("bench.unit_shapes", ap, argv, report)


def report(args, machine):
    c = args.seq_len // args.n_devices
    x = np.random.default_rng(0).standard_normal((1, c, args.heads, args.head_dim), dtype=np.float32)
    step, pairs, best = steps.get("v5", xp=np), block_pairs(args.seq_len, args.n_devices), {}
    tried = f"rows {args.rows or units.UNIT_ROWS}, join {args.join or 'as v5'}"
    cuts = {"v5's cut": dict(), tried: dict(rows=args.rows, join=args.join)}
    for r in range(args.repeats):
        for name, how in list(cuts.items())[::1 if r % 2 else -1]:      # each first in turn
            with cut(**how):
                for shape, (q_pos, k_pos) in pairs.items():
                    seconds, tiles = timed_block(step, q_pos, k_pos, x, args.tile_size)
                    best[name, shape] = min(best.get((name, shape), np.inf), seconds / tiles)
    print(f"S={args.seq_len} N={args.n_devices} c={c} H={args.heads} D={args.head_dim} tile={args.tile_size}, "
          f"step {step.label}, forward, least of {args.repeats}; {machine}")
    print(f"  {'block':<34} {'v5 as it is':>15} {tried:>32}  tried / v5's")
    for shape in SHAPES:
        own, other = best["v5's cut", shape], best[tried, shape]
        print(f"  {shape:<34} {own * 1e3:8.3f} ms/tile {other * 1e3:23.3f} ms/tile  {other / own:6.3f}")
    for name in cuts:
        full = best[name, SHAPES[0]]
        print(f"  {name}: a triangular block's tile over a full one's "
              + ", ".join(f"{best[name, shape] / full:.2f}" for shape in SHAPES[1:]))


if __name__ == "__main__":
    main()
