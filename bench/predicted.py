"""Predicted speed-up of striped and zigzag over contiguous, from the cost model alone.

Paper sections 2.2 and 2.2.1: the ring's time is the sum over rounds of the busiest
device's work, so a layout's speed-up over contiguous (Ring Attention) is the ratio of
critical paths (`reference.cost.speedup`). Work is counted two ways:

- "pairs": visible (query, key) pairs, element-exact skipping; striped tends to
  (2N - 1) / N as blocks grow (drawn as the limit);
- "tiles": the area of the tiles computed, what a kernel skipping whole tiles
  pays; it needs several tiles per block before the imbalance shows.

Swept against N (2 to 64), the block size c (in tiles) and the tile size, plus the
paper's own tile sizes (section 3.1: 2048 x 4096 on A100, 2048 x 2048 on TPU).
Letters: N devices, S = N c tokens, c tokens per device, T tile size (T x T).
The model costs O(N^2 (c / T)^2) per point, so the quick sweep takes seconds.

    python -m bench.predicted               # prints the markdown, writes the plot
    python -m bench.run --only predicted    # into BENCHMARKS.md
"""

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from reference import usage
from reference.cost import MODES, predict, striped_limit

from . import RESULTS, markdown_table

COMPARED = ("striped", "zigzag")
COLUMNS = [(layout, mode) for layout in COMPARED for mode in MODES]


@dataclass(frozen=True)
class Sweep:
    """The points of each sweep. Block sizes are in tiles, c = block * tile."""
    n_devices: tuple = (2, 4, 8, 16, 32, 64)      # against N, at c = block_for_n * tile
    block_for_n: int = 16
    tile: int = 64                                 # T of the N and block sweeps
    n_fixed: int = 8                               # N of the block and tile sweeps
    block_tiles: tuple = (1, 2, 4, 8, 16, 32)      # against c / T
    c_for_tiles: int = 4096                        # c of the tile sweep
    tile_sizes: tuple = (64, 128, 256, 512, 1024, 2048, 4096)
    paper_blocks: tuple = (4096, 8192, 16384)      # c at the paper's tile sizes


QUICK = Sweep()
FULL = Sweep(n_devices=(2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), block_tiles=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128),
             tile_sizes=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096), paper_blocks=(4096, 8192, 16384, 32768, 65536))

# (label, mesh N, tile (tq, tk)) of the paper's experiments (section 3.1, Tables 3-5, A.1-A.3)
PAPER_TILES = (("A100, 2 x 4", 4, (2048, 4096)), ("A100, 1 x 8", 8, (2048, 4096)),
               ("TPU v4, 2 x 8", 8, (2048, 2048)))


def point(n_devices, c, tile_size):
    """Speed-up over contiguous of each compared layout, each work mode: {(layout, mode): x}."""
    seq_len = n_devices * c                       # zigzag needs c even: S % 2N == 0
    pred = {layout: predict(seq_len, n_devices, layout, tile_size) for layout in ("contiguous",) + COMPARED}
    base = {mode: pred["contiguous"].critical_path(mode) for mode in MODES}
    return {(layout, mode): base[mode] / pred[layout].critical_path(mode) for layout, mode in COLUMNS}


def sweeps(sweep=QUICK, progress=None):
    """Every point of every sweep: {name: [(x, n_devices, speedups)]}."""
    say = progress or (lambda msg: None)
    out = {"N": [], "block": [], "tile": [], "paper": []}
    for n in sweep.n_devices:
        say(f"N = {n}")
        out["N"].append((n, n, point(n, sweep.block_for_n * sweep.tile, sweep.tile)))
    for b in sweep.block_tiles:
        out["block"].append((b, sweep.n_fixed, point(sweep.n_fixed, b * sweep.tile, sweep.tile)))
    say("tile sizes")
    for t in sweep.tile_sizes:
        out["tile"].append((t, sweep.n_fixed, point(sweep.n_fixed, sweep.c_for_tiles, t)))
    say("the paper's tile sizes")
    for label, n, tile in PAPER_TILES:
        for c in sweep.paper_blocks:
            out["paper"].append(((label, c, tile), n, point(n, c, tile)))
    return out


def _cells(n_devices, speedups):
    return [f"{speedups[col]:.3f}" for col in COLUMNS] + [f"{striped_limit(n_devices):.3f}"]


HEAD = [f"{layout} {mode}" for layout, mode in COLUMNS] + ["(2N-1)/N"]


def tables_markdown(res, sweep):
    """The four sweeps as markdown tables."""
    t = sweep.tile
    by_n = [(n, n * sweep.block_for_n * t, *_cells(n, s)) for n, _, s in res["N"]]
    by_block = [(b * t, b, *_cells(n, s)) for b, n, s in res["block"]]
    by_tile = [(f"{x} x {x}", max(sweep.c_for_tiles // x, 1), *_cells(n, s)) for x, n, s in res["tile"]]
    by_paper = [(label, n, f"{tile[0]} x {tile[1]}", c, *_cells(n, s)) for (label, c, tile), n, s in res["paper"]]
    return "\n\n".join([
        f"### Against N (c = {sweep.block_for_n * t} tokens per device, tiles {t} x {t})",
        markdown_table(["N", "S", *HEAD], by_n),
        f"### Against block size (N = {sweep.n_fixed}, tiles {t} x {t})",
        markdown_table(["c", "c / T", *HEAD], by_block),
        f"### Against tile size (N = {sweep.n_fixed}, c = {sweep.c_for_tiles})",
        markdown_table(["tile T", "c / T", *HEAD], by_tile),
        "### At the paper's tile sizes (section 3.1)",
        markdown_table(["hardware, mesh", "N", "tile", "c", *HEAD], by_paper, "lrrr" + "r" * len(HEAD)),
    ])


def plot(res, sweep, path):
    """Three panels (against N, c / T, T), each with the (2N-1)/N limit. Returns the figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3), sharey=True)
    panels = [("N", f"devices N (c = {sweep.block_for_n} tiles of {sweep.tile})"),
              ("block", f"tiles per block side c / T (N = {sweep.n_fixed}, T = {sweep.tile})"),
              ("tile", f"tile size T (N = {sweep.n_fixed}, c = {sweep.c_for_tiles})")]
    styles = {("striped", "pairs"): "C0-o", ("striped", "tiles"): "C0--s",
              ("zigzag", "pairs"): "C1-^", ("zigzag", "tiles"): "C1--v"}
    for ax, (name, xlabel) in zip(axes, panels):
        xs = [x for x, _, _ in res[name]]
        for col in COLUMNS:
            ax.plot(xs, [s[col] for _, _, s in res[name]], styles[col], ms=4, label=" ".join(col))
        ax.plot(xs, [striped_limit(n) for _, n, _ in res[name]], "k:", lw=1.5, label="(2N-1)/N limit")
        ax.set_xscale("log", base=2)
        ax.set(xlabel=xlabel)
        ax.grid(alpha=0.3)
    axes[0].set(ylabel="predicted speed-up over contiguous")
    axes[0].legend(fontsize=8)
    fig.suptitle("Cost model: critical path of contiguous / critical path of the layout")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def run(quick=True, *, results_dir=RESULTS, sweep=None, progress=None):
    """Markdown tables and the plot; `sweep` overrides the quick or full points."""
    sweep = sweep or (QUICK if quick else FULL)
    res = sweeps(sweep, progress)
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    png = results_dir / "predicted_speedup.png"
    plot(res, sweep, png)
    text = "\n\n".join([
        "Predicted by `reference.cost` (no attention is run): speed-up of each layout over "
        "contiguous = critical path of contiguous / critical path of the layout, the critical "
        "path being the sum over rounds of the busiest device's work. *pairs*: visible "
        "(query, key) pairs (element-exact skipping); *tiles*: area of the tiles computed "
        "(whole-tile skipping, what the kernels here do). Striped pairs tend to (2N-1)/N as "
        "blocks grow; tiles need several tiles per block side before skipping pays, so with "
        "one tile per block nothing is saved (the paper's A100 runs at c = 4096 with 2048 x "
        "4096 tiles, section 3.2).",
        tables_markdown(res, sweep),
    ])
    return text + "\n", [png]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.predicted", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="the longer sweep")
    ap.add_argument("--results", type=usage.output_folder, default=str(RESULTS),
                    help="folder for the plot (default %(default)s)")
    args = ap.parse_args(argv)
    text, pngs = run(quick=not args.full, results_dir=args.results,
                     progress=lambda msg: print(f"  predicted: {msg}", file=sys.stderr))
    print(text)
    print("plots:", *pngs, file=sys.stderr)


if __name__ == "__main__":
    main()
