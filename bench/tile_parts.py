"""Where a tile's time goes: products, exponentials, masks, copies, by block shape.

`bench.block_shapes` says what a computed tile costs in a full and a
triangular block; this says why. It runs the same blocks (one device's
round t >= 1, one BLAS thread held with threadpoolctl) through a tuned step
with every NumPy call of `reference.step_parts` timed where it is called,
by this thread's CPU time (a loaded machine stretches wall time, not CPU
time), and prints CPU microseconds per computed tile for each kind of pass,
the shapes side by side, the least of the repeats (shapes taking turns).
The timing wrapper costs about a microsecond a call; the totals are within a
few percent of `bench.block_shapes`.

    python -m bench.tile_parts --seq-len 8192 --n-devices 8 --tile-size 128
    python -m bench.tile_parts --seq-len 8192 --n-devices 8 --tile-size 256 --step v3
"""

import argparse
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

from reference import step_parts, steps
from reference.cores import blas_description, blas_limit

from .block_shapes import SHAPES, block_pairs, timed_block

# each NumPy name step_parts calls, and the pass it belongs to
PASSES = {
    "matmul": "products", "masked_product": "products",
    "exp2": "exp2",
    "copyto": "masks applied", "tile_masks": "masks made", "mask_rows": "masks made",
    "augment": "[X, 1] columns", "multiply": "scale and dS", "set_shift": "small passes",
    "maximum": "small passes", "where": "small passes", "isfinite": "small passes",
}


class _Timed:
    """Stands for the `np` module in step_parts: the calls named in PASSES add
    their CPU time to `spent`; everything else is NumPy's own."""

    def __init__(self, spent):
        self._spent = spent

    def __getattr__(self, name):
        fn = getattr(np, name)
        return _timer(fn, PASSES[name], self._spent) if name in PASSES and callable(fn) else fn


def _timer(fn, key, spent):
    clock = time.thread_time

    def timed(*args, **kwargs):
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += clock() - start
    return timed


@contextmanager
def timed_parts(spent):
    """step_parts' NumPy calls and small pieces timed into `spent` {pass: seconds}."""
    saved = {name: getattr(step_parts, name) for name in ("np", "masked_product", "tile_masks", "mask_rows",
                                                          "augment", "set_shift")}
    try:
        step_parts.np = _Timed(spent)
        for name in saved:
            if name != "np":
                setattr(step_parts, name, _timer(saved[name], PASSES[name], spent))
        yield
    finally:
        for name, fn in saved.items():
            setattr(step_parts, name, fn)


def measure(step_name, seq_len, n_devices, heads, head_dim, tile_size, repeats, backward):
    """{shape: {pass: CPU seconds per computed tile, "rest", "total"}} of the least total."""
    c = seq_len // n_devices
    x = np.random.default_rng(0).standard_normal((1, c, heads, head_dim), dtype=np.float32)   # (B, c, H, D)
    step, best = steps.get(step_name, xp=np), {}
    for _ in range(repeats):
        for shape, (q_pos, k_pos) in block_pairs(seq_len, n_devices).items():
            spent = defaultdict(float)
            seconds, tiles = timed_block(step, q_pos, k_pos, x, tile_size, backward, lambda: timed_parts(spent))
            parts = {k: v / tiles for k, v in spent.items()}
            parts["total"] = seconds / tiles
            parts["rest"] = parts["total"] - sum(v for k, v in parts.items() if k != "total")
            if parts["total"] < best.get(shape, {}).get("total", np.inf):
                best[shape] = parts
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.tile_parts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens S (default %(default)s)")
    ap.add_argument("--n-devices", type=int, default=8, help="devices N (default %(default)s)")
    ap.add_argument("--heads", type=int, default=4, help="heads H (default %(default)s)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dim D (default %(default)s)")
    ap.add_argument("--tile-size", type=int, default=128, help="tile size (default %(default)s)")
    ap.add_argument("--step", default="v3", choices=steps.names(), help="step version (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="least of (default %(default)s)")
    ap.add_argument("--as-set", action="store_true",
                    help="keep OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE where set (default: run again without them)")
    ap.add_argument("--unset", default="", help=argparse.SUPPRESS)     # set by the rerun
    args = ap.parse_args(argv)
    from .kernel import cpu_model, kernels_note, rerun_with_machine_kernels
    if not args.as_set and not args.unset:
        status = rerun_with_machine_kernels("bench.tile_parts", sys.argv[1:] if argv is None else argv)
        if status is not None:
            sys.exit(status)
    with blas_limit(1):
        report(args, f"{cpu_model()}, BLAS {blas_description()}{kernels_note(args.unset)}")


def report(args, machine):
    print(f"S={args.seq_len} N={args.n_devices} c={args.seq_len // args.n_devices} H={args.heads} "
          f"D={args.head_dim} tile={args.tile_size}, step {args.step}, least of {args.repeats}; {machine}")
    names = [s.split(" (")[0] for s in SHAPES]
    for backward in (False, True):
        best = measure(args.step, args.seq_len, args.n_devices, args.heads, args.head_dim, args.tile_size,
                       args.repeats, backward)
        print(f"{'backward' if backward else 'forward'}, CPU us per computed tile:")
        print(f"  {'pass':<16}" + "".join(f"{n:>17}" for n in names))
        keys = sorted({k for parts in best.values() for k in parts} - {"total", "rest"}) + ["rest", "total"]
        for key in keys:
            print(f"  {key:<16}" + "".join(f"{best[s].get(key, 0.0) * 1e6:17.1f}" for s in SHAPES))


if __name__ == "__main__":
    main()
