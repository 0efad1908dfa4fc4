"""The cost model: each device's work in each round, predicted without attention.

For a layout, N devices, S tokens and a tile size, device j in round t holds
the block that started on device ``(j - t) mod N`` (Algorithm 1) and works on
the tiles of `reference.tiles` that are not skipped. Counting them gives the
same [t, j] arrays as a run's trace. The run's time is set by the busiest
device of each round, so

    critical path = sum over rounds t of max over devices j of work[t, j]
    speedup of a layout = critical path (contiguous) / critical path (layout)

with work counted two ways: ``"tiles"``, the area of the tiles computed (what
a tiled kernel costs, paper section 2.2.1), and ``"pairs"``, visible (query,
key) pairs only (element-exact skipping, the paper's Work(i, j) of section 2.2).
With pairs, striped's speedup tends to (2N - 1) / N as blocks grow.

Every mask of `reference.masks` is predicted the same way (a sliding window,
packed documents, padding of any S; dropout changes no work), and any dealing
of positions, not only the three layouts (`predict_positions`: e.g. each
document zig-zagged on its own, as some frameworks balance packed documents).

The paper's Theoretical Maximum Speedup for its model configurations (section 4)
is in `reference.tms` and re-exported here.

    python -m reference.cost --seq-len 65536 --n-devices 8 --tile-size 2048
    python -m reference.cost --seq-len 65536 --n-devices 8 --tile-size 512 --window 4096
"""

import argparse
from dataclasses import dataclass

import numpy as np

from .layouts import LAYOUTS, positions
from .masks import as_mask, count_visible_pairs, layout_mask
from .tiles import SKIP, classify, tile_edges, tile_shape
from .trace import Work
from .tms import HARDWARE, MODELS, paper_rows, theoretical_max_speedup  # noqa: F401 (re-exported)

MODES = ("tiles", "pairs")


@dataclass
class Prediction(Work):
    """Predicted per-round, per-device work (`reference.trace.Work`: the
    fields a run's trace records), arrays (N rounds, N devices), with the area
    of the tiles computed."""
    tile_area: np.ndarray     # (query, key) entries in the computed tiles, masked ones included

    def work(self, mode="tiles"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        return self.tile_area if mode == "tiles" else self.pairs

    def critical_path(self, mode="tiles"):
        """Sum over rounds of the busiest device's work, counted as `mode`."""
        return int(self.work(mode).max(axis=1).sum())


def predict(seq_len, n_devices, layout="striped", tile_size=None, causal=True, **mask_options):
    """Per-round, per-device tiles and pairs for one ring pass (forward or backward:
    both visit the same tiles). `mask_options`: those of `reference.ring_attention`
    (window, cu_seqlens, segment_ids; dropout and seed are accepted and change nothing)."""
    mask = layout_mask(seq_len, n_devices, layout, causal=causal, **mask_options)
    return predict_positions(positions(seq_len, n_devices, layout), tile_size, mask)


def predict_positions(pos, tile_size=None, mask=True):
    """`predict` for any dealing of positions: `pos` (N, c), device j holding
    positions pos[j]; `mask` a `reference.masks.Mask` or a bool (causal)."""
    mask = as_mask(mask)
    n_devices, c = pos.shape
    tq, tk = tile_shape(tile_size)
    sizes_q = np.diff(np.append(tile_edges(c, tq), c))         # (Tq,) rows of each tile
    sizes_k = np.diff(np.append(tile_edges(c, tk), c))         # (Tk,)
    area = sizes_q[:, None] * sizes_k[None, :]                 # (Tq, Tk)
    shape = (n_devices, n_devices)
    p = Prediction(*(np.zeros(shape, dtype=np.int64) for _ in range(5)))
    for t in range(n_devices):
        for j in range(n_devices):
            k = (j - t) % n_devices
            kinds = classify(pos[j], pos[k], (tq, tk), mask)
            p.source[t, j] = k
            p.tiles_skipped[t, j] = (kinds == SKIP).sum()
            p.tiles_computed[t, j] = kinds.size - p.tiles_skipped[t, j]
            p.tile_area[t, j] = area[kinds != SKIP].sum()
            p.pairs[t, j] = count_visible_pairs(pos[j], pos[k], mask)
    return p


def speedup(seq_len, n_devices, layout="striped", tile_size=None, mode="tiles", causal=True, **mask_options):
    """Predicted speedup of `layout` over contiguous (Ring Attention), for the same mask."""
    base = predict(seq_len, n_devices, "contiguous", tile_size, causal, **mask_options).critical_path(mode)
    return base / predict(seq_len, n_devices, layout, tile_size, causal, **mask_options).critical_path(mode)


def striped_limit(n_devices):
    """Element-exact striped speedup as blocks grow: (2N - 1) / N."""
    return (2 * n_devices - 1) / n_devices


def paper_work(i, j, c):
    """Paper section 2.2: striped work of query block i against key block j."""
    return c * (c + 1) // 2 if i >= j else c * (c - 1) // 2


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m reference.cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens S (default 4096)")
    ap.add_argument("--n-devices", type=int, default=4, help="devices N (default 4)")
    ap.add_argument("--tile-size", type=int, default=None, help="tile size (default %(default)s: the kernel's)")
    ap.add_argument("--window", type=int, default=None, help="sliding window W (default: none)")
    ap.add_argument("--doc-lengths", type=lambda t: [int(x) for x in t.split(",")], default=None,
                    metavar="L0,L1,...", help="packed documents, adding up to --seq-len")
    args = ap.parse_args(argv)
    mask = dict(window=args.window)
    if args.doc_lengths:
        mask["cu_seqlens"] = np.concatenate([[0], np.cumsum(args.doc_lengths)])
    print(f"S={args.seq_len} N={args.n_devices} tile={tile_shape(args.tile_size)}"
          + "".join(f" {k}={v}" for k, v in (("window", args.window), ("documents", args.doc_lengths)) if v))
    print(f"{'layout':<11} {'crit. tiles':>12} {'crit. pairs':>12} {'speedup tiles':>14} {'speedup pairs':>14}")
    for layout in LAYOUTS:
        p = predict(args.seq_len, args.n_devices, layout, args.tile_size, **mask)
        s = [speedup(args.seq_len, args.n_devices, layout, args.tile_size, m, **mask) for m in MODES]
        print(f"{layout:<11} {p.critical_path('tiles'):>12} {p.critical_path('pairs'):>12} "
              f"{s[0]:>14.3f} {s[1]:>14.3f}")
    print(f"(2N-1)/N limit: {striped_limit(args.n_devices):.3f}")


if __name__ == "__main__":
    main()
