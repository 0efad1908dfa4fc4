"""Counting one ring pass's tiles and pairs per round and device, for any dealing of positions.

Device j in round t of a ring of N holds the block that started on device
``(j - t) mod N`` (Algorithm 1) and works on the tiles of `reference.tiles`
that are not skipped; `predict_positions` counts them into the same [t, j]
arrays as a run's trace (`reference.trace.Work`). `reference.cost` (the
layouts) and `reference.scheme_cost` (the schemes) build on it.
"""

from dataclasses import dataclass

import numpy as np

from .masks import as_mask, count_visible_pairs
from .tiles import MASKED, SKIP, classify, tile_edges, tile_shape
from .trace import Work

MODES = ("tiles", "pairs")


@dataclass
class Prediction(Work):
    """Predicted per-round, per-device work (`reference.trace.Work`: the
    fields a run's trace records), arrays (N rounds, N devices), with the area
    of the tiles computed."""
    tile_area: np.ndarray     # (query, key) entries in the computed tiles, masked ones included
    tiles_masked: np.ndarray = None     # of the tiles computed, those a mask crosses (the rest are full)

    def work(self, mode="tiles"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        return self.tile_area if mode == "tiles" else self.pairs

    def critical_path(self, mode="tiles"):
        """Sum over rounds of the busiest device's work, counted as `mode`."""
        return int(self.work(mode).max(axis=1).sum())


def predict_positions(pos, tile_size=None, mask=True, sources=None):
    """`predict` for any dealing of positions: `pos` (N, c), device j holding
    positions pos[j]; `mask` a `reference.masks.Mask` or a bool (causal);
    `sources` (N rounds, N devices): the device whose block j holds in round t,
    for another order of the blocks than the ring's (the double ring's)."""
    mask = as_mask(mask)
    n_devices, c = pos.shape
    tile = tq, tk = tile_shape(tile_size)                      # resolved once, for N x N blocks
    sizes_q = np.diff(np.append(tile_edges(c, tq), c))         # (Tq,) rows of each tile
    sizes_k = np.diff(np.append(tile_edges(c, tk), c))         # (Tk,)
    area = sizes_q[:, None] * sizes_k[None, :]                 # (Tq, Tk)
    shape = (n_devices, n_devices)
    p = Prediction(*(np.zeros(shape, dtype=np.int64) for _ in range(6)))
    for t in range(n_devices):
        for j in range(n_devices):
            k = (j - t) % n_devices if sources is None else sources[t, j]
            kinds = classify(pos[j], pos[k], tile, mask)
            p.source[t, j] = k
            p.tiles_skipped[t, j] = (kinds == SKIP).sum()
            p.tiles_computed[t, j] = kinds.size - p.tiles_skipped[t, j]
            p.tile_area[t, j] = area[kinds != SKIP].sum()
            p.tiles_masked[t, j] = (kinds == MASKED).sum()
            p.pairs[t, j] = count_visible_pairs(pos[j], pos[k], mask)
    return p
