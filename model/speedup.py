"""The paper's Theoretical Maximum Speedup (section 4) for any model, pair-counted and tile-aware.

TMS times one training step as FLOPs on the critical path: per device and layer,
the linear layers' FLOPs plus the busiest device's attention work in each round,
attention FLOPs weighted by h, the cost of one attention FLOP in units of one
linear-layer FLOP (2 on the paper's A100s, TF32 against bf16):

    F_lin   = c * (8 d^2 + 4 d f + 2 d V / L)            (`Config.linear_flops_per_token`)
    TMS     = (F_lin + 4 d h W(contiguous)) / (F_lin + 4 d h W(layout))

with W the critical path of the ring: the sum over rounds of the busiest device's work
(`reference.cost`). The paper counts W in visible (query, key) pairs ("pairs":
c(c+1)/2 + (N-1) c^2 for Ring Attention, N c(c+1)/2 for striped), which is
`reference.tms.theoretical_max_speedup`. A kernel that skips whole tiles does the
area of the tiles it computes, masked entries included ("tiles"): that is the
tile-aware TMS. At the paper's A100 tiles (2048 queries x 4096 keys) and c = 4096, a
striped block is one column of two tiles, both computed, so striped saves nothing.

Letters: N devices, S = n_seq tokens, c = S // N, d = d_model, f = d_ff,
V vocabulary, L layers, h attention cost factor.

    python -m model.speedup            # the paper's rows, pair-counted and tile-aware
"""

import argparse
from functools import lru_cache

import reference
from reference.cost import HARDWARE, MODELS, paper_rows
from reference.tms import linear_flops_per_token

# Paper section 3.1: the tile sizes it chose after a sweep for Ring Attention.
PAPER_TILES = {"a100": (2048, 4096), "tpuv3": (2048, 2048), "tpuv4": (2048, 2048)}


def critical_work(n_seq, n_devices, layout, tile_size, mode):
    """Sum over rounds of the busiest device's work in one ring pass: pairs or tile area."""
    if mode == "pairs":     # tiles do not change the pairs: one tile per block is cheapest to count
        tile_size = n_seq // n_devices
    tile_size = tuple(tile_size) if isinstance(tile_size, (tuple, list)) else tile_size
    return _predicted(n_seq, n_devices, layout, tile_size).critical_path(mode)


@lru_cache(maxsize=None)
def _predicted(n_seq, n_devices, layout, tile_size):
    return reference.cost.predict(n_seq, n_devices, layout, tile_size)


def tms(linear_flops_per_token, d_model, h, n_seq, n_devices, layout="striped", *,
        tile_size=None, mode="pairs"):
    """TMS of `layout` over contiguous (Ring Attention), per device and layer."""
    linear = n_seq // n_devices * linear_flops_per_token
    per_work = 4 * d_model * h                     # Q K^T and P V: 2 d FLOPs each per pair
    ring = critical_work(n_seq, n_devices, "contiguous", tile_size, mode)
    mine = critical_work(n_seq, n_devices, layout, tile_size, mode)
    return (linear + per_work * ring) / (linear + per_work * mine)


def paper_linear_flops_per_token(model):
    """The paper's F_lin / c for a model of its Table 1."""
    m = MODELS[model]
    return linear_flops_per_token(m["d_model"], m["d_ff"], m["n_vocab"], m["n_layer"])


def tile_aware(row):
    """The tile-aware TMS of one paper row (`reference.cost.paper_rows`), at the paper's tile
    size for its hardware; model parallelism cancels, as in the paper."""
    return tms(paper_linear_flops_per_token(row["model"]), MODELS[row["model"]]["d_model"],
               HARDWARE[row["hardware"]], row["n_seq"], row["seq_parallel"], "striped",
               tile_size=PAPER_TILES[row["hardware"]], mode="tiles")


def paper_rows_tile_aware(tables=None):
    """The rows of bench/paper_tms.csv (of `tables`, default all) with `tile` and
    `tms_tiles`, the tile-aware TMS, added."""
    rows = [r for r in paper_rows() if tables is None or r["table"] in tables]
    for r in rows:
        r["tile"], r["tms_tiles"] = PAPER_TILES[r["hardware"]], tile_aware(r)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m model.speedup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", choices=sorted(HARDWARE), default="a100",
                    help="the accelerator whose rates the paper's TMS uses")
    args = ap.parse_args(argv)
    print(f"{'table':>5} {'model':>5} {'mesh':>5} {'n_seq':>7} {'c':>6} {'TMS':>6} {'tiles':>6} "
          f"{'speed-up':>8} {'/TMS':>5} {'/tiles':>6}")
    for r in paper_rows_tile_aware():
        if r["hardware"] == args.hardware:
            print(f"{r['table']:>5} {r['model']:>5} {r['model_parallel']}x{r['seq_parallel']:<3} "
                  f"{r['n_seq']:>7} {r['n_seq'] // r['seq_parallel']:>6} {r['tms']:>6.2f} "
                  f"{r['tms_tiles']:>6.2f} {r['speedup']:>8.2f} {r['speedup'] / r['tms']:>5.2f} "
                  f"{r['speedup'] / r['tms_tiles']:>6.2f}")


if __name__ == "__main__":
    main()
