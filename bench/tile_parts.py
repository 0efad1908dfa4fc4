"""Where a tile's time goes: products, exponentials, masks, copies, by block shape.

`bench.block_shapes` says what a computed tile costs in a full and a
triangular block; this says why. It runs the same blocks (one device's
round t >= 1, one BLAS thread held with threadpoolctl) through a tuned step
with every NumPy call of `reference.steps.parts` timed where it is called,
by this thread's CPU time (a loaded machine stretches wall time, not CPU
time), and prints CPU microseconds per computed tile for each kind of pass,
the shapes side by side, the least of the repeats (shapes taking turns).
The timing wrapper costs about a microsecond a call, some 20% of a tile of
128: read the passes against each other, and a tile's cost from
`bench.block_shapes`.

    python -m bench.tile_parts --seq-len 8192 --n-devices 8 --tile-size 128
    python -m bench.tile_parts --seq-len 8192 --n-devices 8 --tile-size 256 --step v3
"""

import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

from reference import steps
from reference.steps import parts, tile_masks

from .block_shapes import SHAPES, block_arguments, block_pairs, run_on_one_thread, timed_block

# each NumPy name parts calls, and the pass it belongs to
PASSES = {
    "matmul": "products", "masked_product": "products",
    "exp2": "exp2",
    "copyto": "masks applied", "weigh": "masks applied", "tile_masks": "masks made", "mask_rows": "masks made",
    "augment": "[X, 1] columns", "multiply": "scale and dS", "set_shift": "small passes",
    "maximum": "small passes", "where": "small passes", "isfinite": "small passes",
}


class _Timed:
    """Stands for the `np` module in parts and tile_masks: the calls
    named in PASSES add their CPU time to `spent`; everything else is NumPy's own."""

    def __init__(self, spent, stack):
        self._spent, self._stack = spent, stack

    def __getattr__(self, name):
        fn = getattr(np, name)
        return _timer(fn, PASSES[name], self._spent, self._stack) if name in PASSES and callable(fn) else fn


def _timer(fn, key, spent, stack):
    """fn, its own CPU time added to spent[key]: the time of timed calls
    inside it (`weigh` calls tile_masks and np.multiply) goes to theirs."""
    clock = time.thread_time

    def timed(*args, **kwargs):
        stack.append(0.0)                                # the inner calls' time
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = clock() - start
            spent[key] += elapsed - stack.pop()
            if stack:
                stack[-1] += elapsed
    return timed


PIECES = ("masked_product", "tile_masks", "mask_rows", "augment", "set_shift", "weigh")


@contextmanager
def timed_parts(spent):
    """parts' and tile_masks' NumPy calls and small pieces timed into `spent` {pass: seconds}."""
    saved = [(module, name, getattr(module, name)) for module in (parts, tile_masks)
             for name in ("np",) + PIECES if hasattr(module, name)]
    stack = []                                           # the timed calls under way (one thread)
    try:
        for module, name, fn in saved:
            setattr(module, name, _Timed(spent, stack) if name == "np" else _timer(fn, PASSES[name], spent, stack))
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


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
    ap = block_arguments("python -m bench.tile_parts", __doc__, n_devices=8, tile_size=128)
    ap.add_argument("--step", default="v3", choices=steps.names(), help="step version (default %(default)s)")
    run_on_one_thread("bench.tile_parts", ap, argv, report)


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
