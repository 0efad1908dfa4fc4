"""N virtual devices on one machine: wall time against the total tile count.

With more virtual devices than cores (8 threads on 2 cores), the devices take
turns on the cores, so the wall time of a ring tracks the total work of all
devices, not the critical path. Striped computes more tiles in total than
contiguous (its triangular blocks are cut by the diagonal into more computed
tiles), so here the striped-over-contiguous ratio of wall times should follow
the ratio of total tile area that `reference.cost` predicts (about 0.90 at
S = 8192, N = 8, tiles of 128), if a tile costs the same whatever block it is
in. A step whose masked tiles cost more than full ones falls short of it.
The devices share the cores as `reference.cores` decides (one BLAS thread per
product with more devices than cores); the table says what ran.

    python -m bench.virtual_ring --repeats 3                # S = 8192, N = 8, tiles of 128
    python -m bench.virtual_ring --repeats 3 --tile 256 --steps v3 v5
    python -m bench.run --only virtual
"""

import argparse
import os
import sys
import time

import numpy as np

from reference import LAYOUTS, cost, ring_attention, ring_attention_backward, steps, usage

from . import RESULTS, markdown_table

QUICK = dict(seq_len=8192, n_devices=8, tile=128, heads=4, head_dim=64, repeats=2, steps=("v3", "v4", "v5"))
FULL = dict(QUICK, repeats=3, steps=("v1", "v2", "v3", "v4", "v5"))


def total_tile_area(S, N, layout, tile):
    """Sum over rounds and devices of the computed tiles' area (forward; the backward visits the same)."""
    return int(cost.predict(S, N, layout, tile).tile_area.sum())


def wall(step, layout, cfg, inputs):
    """Best wall time of forward + backward over the repeats, least total CPU
    time of the steps (all devices, all rounds: the trace's compute_cpu_s),
    and how the devices shared the cores."""
    q, k, v, dout = inputs
    opts = dict(n_devices=cfg["n_devices"], layout=layout, tile_size=cfg["tile"], step=step)
    best = cpu = float("inf")
    for _ in range(cfg["repeats"]):
        start = time.perf_counter()
        out, lse, fwd = ring_attention(q, k, v, trace=True, **opts)
        *_, bwd = ring_attention_backward(q, k, v, out, lse, dout, trace=True, **opts)
        best = min(best, time.perf_counter() - start)
        cpu = min(cpu, float(fwd.compute_cpu_s.sum() + bwd.compute_cpu_s.sum()))
    return best, cpu, fwd.threads


def run(quick=True, *, results_dir=RESULTS, progress=None, **overrides):
    from .machine import blas_name, cpu_name, kernels_note
    cfg = dict(QUICK if quick else FULL, **overrides)
    say = progress or (lambda msg: print(f"  virtual: {msg}", file=sys.stderr, flush=True))
    S, N, tile = cfg["seq_len"], cfg["n_devices"], cfg["tile"]
    rng = np.random.default_rng(0)
    inputs = tuple(rng.standard_normal((1, S, cfg["heads"], cfg["head_dim"]), dtype=np.float32) for _ in range(4))
    area = {layout: total_tile_area(S, N, layout, tile) for layout in LAYOUTS}
    rows, threads = [], ""
    for name in cfg["steps"]:
        step = steps.get(name)
        times, cpus = {}, {}
        for layout in LAYOUTS:
            say(f"step {step.label}, {layout}")
            times[layout], cpus[layout], threads = wall(step, layout, cfg, inputs)
        for layout in ("striped", "zigzag"):
            measured, by_cpu = times["contiguous"] / times[layout], cpus["contiguous"] / cpus[layout]
            predicted = area["contiguous"] / area[layout]
            rows.append([step.label, layout, f"{times['contiguous']:.2f}", f"{times[layout]:.2f}",
                         f"{measured:.2f}", f"{cpus['contiguous']:.3f}", f"{cpus[layout]:.3f}", f"{by_cpu:.2f}",
                         f"{predicted:.2f}", f"{measured / predicted:.0%}", f"{by_cpu / predicted:.0%}"])
    text = "\n".join([
        f"Made by `python -m bench.virtual_ring --tile {tile} --steps {' '.join(cfg['steps'])}` on {os.cpu_count()} cores ({cpu_name()}), "
        f"BLAS {blas_name()}{kernels_note('')}; {threads}: "
        f"S = {S}, N = {N} virtual devices (threads), tiles of {tile}, H = {cfg['heads']}, D = {cfg['head_dim']}, "
        f"float32, forward + backward, best of {cfg['repeats']}. Predicted: total tile area of contiguous over "
        "the layout's (`reference.cost`); the target is the measured ratio within 5% of it. *CPU*: the steps' "
        "CPU time summed over devices and rounds (the traces' `compute_cpu_s`), least of the repeats: what the "
        "wall time is on cores nobody else uses, and immune to other work on the machine, which changes wall "
        "times (and their ratio: more runnable threads get more of a busy machine).",
        "",
        markdown_table(["step", "layout", "contiguous s", "layout s", "wall contiguous / layout", "CPU contiguous s",
                        "CPU layout s", "CPU contiguous / layout", "predicted (total tile area)",
                        "wall / predicted", "CPU / predicted"], rows, "llrrrrrrrrr"),
    ])
    heads = [(f"{N} virtual devices, S = {S}, tiles of {tile}, step {r[0]}, {r[1]}: CPU speed-up over "
              "contiguous, of predicted", r[10], ">= 90%") for r in rows]
    return text + "\n", [], heads


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.virtual_ring", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="every NumPy step, more repeats")
    ap.add_argument("--seq-len", type=usage.count, default=QUICK["seq_len"], help="tokens S (default %(default)s)")
    ap.add_argument("--n-devices", type=usage.count, default=QUICK["n_devices"],
                    help="virtual devices (default %(default)s)")
    ap.add_argument("--tile", type=usage.count, default=QUICK["tile"], help="tile size (default %(default)s)")
    ap.add_argument("--repeats", type=usage.count, default=QUICK["repeats"], help="best of (default %(default)s)")
    ap.add_argument("--steps", nargs="+", choices=steps.names(), metavar="STEP",
                    help="step versions (default: v3 v4 v5; --full: every NumPy step)")
    args = ap.parse_args(argv)
    chosen = {} if args.steps is None else dict(steps=tuple(args.steps))
    text, _ = run(quick=not args.full, seq_len=args.seq_len, n_devices=args.n_devices, tile=args.tile,
                  repeats=args.repeats, **chosen)
    print(text)


if __name__ == "__main__":
    main()
