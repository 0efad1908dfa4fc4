"""Packed documents and sliding windows: which layout balances them.

Masks come from positions (`reference.masks`), so the cost model predicts any
of them for any dealing of tokens (`reference.cost.predict_positions`). Two
questions:

1. Packed documents (each token sees earlier tokens of its own document).
   Compared: contiguous (Ring Attention), zigzag of the whole sequence, zigzag
   of each document on its own (what PyTorch's and TransformerEngine's context
   parallelism do for packed sequences: every document cut into 2N chunks,
   device r taking chunks r and 2N-1-r of each; it needs every length to be a
   multiple of 2N), and striped, which deals every document round-robin by
   construction. Length mixes: one long document plus many short ones; a
   lognormal mix like packed pre-training data; equal short documents.
2. Sliding windows of W tokens: for which W, S, N does striped (every block
   holds keys near every query, so no round is empty) beat contiguous (rounds
   whose blocks lie outside every window compute nothing)?

Work is the critical path, the sum over rounds of the busiest device's work, in
tiles (the area of the tiles computed: what a tiled kernel pays) and in pairs
(visible pairs: element-exact skipping). "balance" is the critical path over
the perfectly balanced one (total / N). Then the same on real MPI processes:
the command line's measured critical path against the prediction.

    python -m bench.masks                 # quick: about a minute on 2 cores
    python -m bench.run --only masks      # into BENCHMARKS.md
"""

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np

from reference import cost
from reference.masks import cu_seqlens_from_lengths, layout_mask
from reference.tiles import MASKED, classify

from . import markdown_table

LAYOUTS = ("contiguous", "zigzag", "zigzag per document", "striped")


@dataclass(frozen=True)
class Plan:
    seq_len: int = 32768
    n_devices: int = 8
    tile: int = 256
    windows: tuple = (128, 512, 2048, 4096, 8192, 16384, 32768)
    window_ns: tuple = (2, 4, 8, 16)
    window_for_ns: int = 1024
    measured_seq: int = 8192      # N = 2 MPI ranks, one per core
    measured_tile: int = 256


QUICK = Plan()
FULL = Plan(seq_len=131072, tile=512, windows=(512, 2048, 8192, 16384, 32768, 65536, 131072),
            window_ns=(2, 4, 8, 16, 32), window_for_ns=4096, measured_seq=16384)


# -- length mixes (every length a multiple of 2N, for zigzag per document) -----

def _fill(lengths, seq_len, unit):
    """Lengths rounded to `unit`, cut or topped up so that they add up to seq_len."""
    out, total = [], 0
    for x in lengths:
        x = max(unit, int(round(x / unit)) * unit)
        if total + x >= seq_len:
            break
        out.append(x)
        total += x
    out.append(seq_len - total)
    return out


def mixes(seq_len, n_devices, seed=0):
    """{name: document lengths}, each adding up to seq_len, each a multiple of 2N."""
    unit, rng = 2 * n_devices, np.random.default_rng(seed)
    return {
        "one long + short": [seq_len // 2] + _fill(rng.lognormal(np.log(256), 0.8, seq_len), seq_len // 2, unit),
        "lognormal (median 1024)": _fill(rng.lognormal(np.log(1024), 1.2, seq_len), seq_len, unit),
        f"{seq_len // 512} x 512": [512] * (seq_len // 512),
    }


def document_zigzag_positions(lengths, n_devices):
    """(N, S // N): each document cut into 2N chunks, device r holding chunks r
    and 2N-1-r of every document, documents in order."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    per_device = [[] for _ in range(n_devices)]
    for start, length in zip(starts, lengths):
        chunks = (start + np.arange(length)).reshape(2 * n_devices, -1)
        for r in range(n_devices):
            per_device[r] += [chunks[r], chunks[2 * n_devices - 1 - r]]
    return np.stack([np.concatenate(p) for p in per_device])


def predict(layout, seq_len, n_devices, tile, **mask_options):
    if layout == "zigzag per document":
        lengths = np.diff(mask_options["cu_seqlens"])
        mask = layout_mask(seq_len, n_devices, "zigzag", **mask_options)
        return cost.predict_positions(document_zigzag_positions(lengths, n_devices), tile, mask)
    return cost.predict(seq_len, n_devices, layout, tile, **mask_options)


# -- the tables ----------------------------------------------------------------

def documents_table(plan, progress):
    rows = []
    S, n = plan.seq_len, plan.n_devices
    for name, lengths in mixes(S, n).items():
        progress(f"documents: {name}")
        cu = cu_seqlens_from_lengths(lengths)
        pred = {layout: predict(layout, S, n, plan.tile, cu_seqlens=cu) for layout in LAYOUTS}
        for layout in LAYOUTS:
            p = pred[layout]
            base = pred["contiguous"]
            rows.append([f"{name} ({len(lengths)} docs, longest {max(lengths)})", layout,
                         f"{p.critical_path('tiles') / (p.tile_area.sum() / n):.2f}",
                         f"{p.critical_path('pairs') / (p.pairs.sum() / n):.2f}",
                         f"{base.critical_path('tiles') / p.critical_path('tiles'):.2f}",
                         f"{base.critical_path('pairs') / p.critical_path('pairs'):.2f}"])
    return markdown_table(("length mix", "layout", "balance, tiles", "balance, pairs", "speed-up, tiles",
                           "speed-up, pairs"), rows, "llrrrr")


def windows_table(plan, progress):
    rows = []
    S, n = plan.seq_len, plan.n_devices
    for w in plan.windows:
        progress(f"window {w}")
        rows.append(_window_row(S, n, plan.tile, w, str(w)))
    rows_n = []
    for n in plan.window_ns:
        progress(f"window {plan.window_for_ns}, N = {n}")
        rows_n.append(_window_row(S, n, plan.tile, plan.window_for_ns, str(n)))
    head = ("speed-up over contiguous: striped tiles", "striped pairs", "zigzag tiles", "zigzag pairs",
            "contiguous: rounds with nothing to compute")
    return (markdown_table(("W",) + head, rows, "rrrrrr"),
            markdown_table(("N",) + head, rows_n, "rrrrrr"))


def _window_row(S, n, tile, w, label):
    pred = {layout: cost.predict(S, n, layout, tile, window=w) for layout in ("contiguous", "striped", "zigzag")}
    base = pred["contiguous"]
    empty = int((base.tiles_computed.sum(axis=1) == 0).sum())
    return [label] + [f"{base.critical_path(m) / pred[layout].critical_path(m):.2f}"
                      for layout in ("striped", "zigzag") for m in ("tiles", "pairs")] + [f"{empty} of {n}"]


def measured_table(plan, progress):
    """N = 2 ranks: the command line with a document mix and with a window."""
    from .mpi_scaling import command, launch
    S = plan.measured_seq
    lengths = mixes(S, 2)["one long + short"]
    runs = [(f"documents: one long + short ({len(lengths)})", ["--doc-lengths", ",".join(map(str, lengths))]),
            ("window 512", ["--window", "512"])]
    rows, commands = [], []
    for label, extra in runs:
        doc = launch(command(2, S, plan.measured_tile, repeat=3, extra=extra), progress)
        commands.append(doc["command"])
        base = doc["layouts"]["contiguous"]
        for layout in ("striped", "zigzag"):
            e = doc["layouts"][layout]
            measured = base["critical_cpu_s"] / e["critical_cpu_s"]
            rows.append([label, layout, f"{base['critical_cpu_s'] * 1e3:.0f}", f"{e['critical_cpu_s'] * 1e3:.0f}",
                         f"{measured:.2f}", f"{e['predicted_speedup']:.2f}"])
    table = markdown_table(("mask", "layout", "contiguous crit. ms", "layout crit. ms", "measured speed-up",
                            "predicted (tiles)"), rows, "llrrrr")
    return table, commands


def tile_costs(plan, progress, repeat=3):
    """CPU time per computed tile of one block (the fastest NumPy step, one
    thread), by mask and tile kind: what the cost model charges alike."""
    from reference import positions, steps
    from reference.masks import CAUSAL
    from reference.ring import as_dtype, own_block
    from reference.step import ForwardAcc, Queries
    from reference.cores import blas_limit
    S, tile = plan.measured_seq, plan.measured_tile
    c = S // 2
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, c, 4, 64)).astype(np.float32) for _ in range(2))
    step = steps.get("v3")
    cu = cu_seqlens_from_lengths(mixes(S, 2)["one long + short"])
    rows = []
    for name, mask in (("causal", CAUSAL), ("documents", layout_mask(S, 2, "striped", cu_seqlens=cu)),
                       ("window 512", layout_mask(S, 2, "striped", window=512))):
        for layout, (j, src) in (("contiguous", (1, 1)), ("contiguous", (1, 0)), ("striped", (1, 0))):
            progress(f"tile cost: {name}, {layout} block {src} on device {j}")
            pos = positions(S, 2, layout)
            queries = Queries.prepare(q, 4, pos[j], 0.125)
            block = as_dtype(own_block(k, k, pos[src], src), np.float32)
            best = float("inf")
            with blas_limit(1):
                for _ in range(repeat):
                    acc = ForwardAcc.zeros(queries.q)
                    start = time.thread_time()
                    counts = step.forward(acc, queries, block, mask=mask, tile_size=tile)
                    best = min(best, time.thread_time() - start)
            if counts.tiles_computed:
                kinds = classify(pos[j], pos[src], tile, mask)
                rows.append([name, f"{layout}, block {src} on device {j}", counts.tiles_computed,
                             int((kinds == MASKED).sum()), f"{best * 1e3 / counts.tiles_computed:.2f}"])
    return markdown_table(("mask", "block", "tiles computed", "of them masked", "ms per tile"), rows, "llrrr")


def run(quick=True, *, progress=None, plan=None):
    plan = plan or (QUICK if quick else FULL)
    say = progress or (lambda msg: None)
    docs = documents_table(plan, say)
    by_w, by_n = windows_table(plan, say)
    measured, commands = measured_table(plan, say)
    per_tile = tile_costs(plan, say)
    text = f"""## Packed documents and sliding windows

From the cost model (`reference.cost`, exact tile classification from positions), S = {plan.seq_len},
N = {plan.n_devices}, tiles {plan.tile} x {plan.tile}, one ring pass (forward and backward visit the same tiles).
*balance*: critical path over the perfectly balanced one (1.00 is perfect); *speed-up*: contiguous's
critical path over the layout's. Every document length is a multiple of 2N, as per-document zigzag needs.

### Packed documents (`--doc-lengths`, `cu_seqlens`)

{docs}

### Sliding windows against W (S = {plan.seq_len}, N = {plan.n_devices})

{by_w}

### Sliding window W = {plan.window_for_ns} against N (S = {plan.seq_len})

{by_n}

### Measured on MPI processes (N = 2 on 2 cores, S = {plan.measured_seq}, tiles {plan.measured_tile}, forward)

Critical path from each rank's CPU time per round (best of 3 per round and rank); predicted: the cost model,
tiles. The machine was shared with other work while this ran.

{measured}

Commands: {"; ".join(f"`{c}`" for c in commands)}

Striped falls short of its prediction here because the cost model charges every computed tile
alike, while in the NumPy step (`v3`) a masked tile costs up to twice a full one, most when many
of its rows see no key in it (a row that has seen no key yet takes the exact path): under
documents or a window most of striped's computed tiles are masked, while contiguous's long
document is mostly full tiles. CPU time per computed tile of one
block (S = {plan.measured_seq}, N = 2, c = {plan.measured_seq // 2}, Hq = Hkv = 4, D = 64, float32,
tiles {plan.measured_tile}, one thread, best of 3; `python -m bench.masks`):

{per_tile}
"""
    return text, []


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.masks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="S = 131072 and the longer sweeps")
    args = ap.parse_args(argv)
    text, _ = run(quick=not args.full, progress=lambda m: print(m, file=sys.stderr))
    print(text)


if __name__ == "__main__":
    main()
