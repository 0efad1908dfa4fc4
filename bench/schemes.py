"""The four schemes on MPI ranks against the scheme cost model, each tile at its measured cost.

N = 4 ranks: the ring, the all-gather, Ulysses (u = 4) and USP (u = 2: Ulysses
in pairs, a ring of two across), each in launches of the command line

    OPENBLAS_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py -m mpi_impl --scheme NAME [--ulysses-degree 2] \\
        --layout all --seq-len S --heads 4 --head-dim 64 --dtype float32 --tile-size 256 --backward --repeat 5

For each scheme, layout (on the ring dimension) and pass, the table puts the
measured beside the predicted:

- critical path: the sum over rounds of the busiest rank's CPU seconds in the
  step, each (round, rank) its least over a launch's runs; min, median and
  max over the launches. Predicted: each round's full and masked tiles at
  their cost measured just before (`reference.tile_cost`: the step the ranks
  run, at the heads and block each scheme gives a rank, both passes), as
  ranks sharing the cores measure it (`bench.sharing`); beside it the flops
  model (4 D an entry forward, 10 D backward) at the ring's measured rate;
- bytes sent by the busiest rank and peak K/V bytes held, from the trace,
  against the prediction (equal by construction: tests/oracle/test_schemes.py holds them);
- wall time of forward+backward, beside a floor from the cores (the steps'
  predicted CPU time dealt over them, and the exposed transfers at 10 GB/s).

    python -m bench.schemes            # quick: S = 4096, 5 launches a scheme, about four minutes on 2 cores
    python -m bench.schemes --full     # S = 8192, 5 launches a scheme
    python -m bench.run --only schemes
"""

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reference.cores import available_cores
from reference.scheme_cost import GB, predict_scheme
from reference.schemes import Scheme
from reference.tile_cost import TileCosts

from . import RESULTS, markdown_table, sharing
from .mpi_scaling import command, launch

N = 4
PLANS = (("ring", None), ("all_gather", None), ("ulysses", None), ("usp", 2))
SHAPE = dict(B=1, Hq=4, Hkv=4, D=64, dtype="float32")
TILE = 256
LINK_GBS = 10                   # processes of one machine: memory copies
LINK = LINK_GBS * GB
SHOWN = ("contiguous", "striped")
PASSES = ((False, "forward"), (True, "backward"))
TARGET = 0.10                   # |measured / predicted - 1|, at most, per row


@dataclass(frozen=True)
class Plan:
    seq_len: int
    launches: int               # per scheme: the spread is over these
    repeat: int                 # runs per launch: each (round, rank) keeps its least CPU time
    calibration_repeats: int = 7


QUICK = Plan(seq_len=4096, launches=5, repeat=5)
FULL = Plan(seq_len=8192, launches=5, repeat=5)


def schemes():
    return [Scheme.checked(name, u, n_devices=N, Hq=SHAPE["Hq"], Hkv=SHAPE["Hkv"]) for name, u in PLANS]


def predictions(seq_len):
    """{(scheme label, layout, backward): SchemeCost} of every row."""
    return {(s.label, layout, backward): predict_scheme(s, seq_len, layout, tile_size=TILE, backward=backward,
                                                        **SHAPE)
            for s in schemes() for layout in SHOWN for backward, _ in PASSES}


def calibrate(costs, plan, progress=None):
    """TileCosts at every row's StepShape, measured in this process, with the
    Sharing of N ranks on this machine measured at the ring's."""
    tiles = TileCosts.measure([c.step_shape for c in costs.values()], repeats=plan.calibration_repeats)
    if progress:
        progress(f"tile costs measured at {len(tiles.costs) // 2} shapes")
    ring = next(c.step_shape for c in costs.values() if c.scheme.u == 1)
    tiles.sharing = sharing.launch(N, ring, progress=progress)
    return tiles


def measure(seq_len, progress=None, repeat=3, warmup=True, launches=1):
    """{(scheme name, u): [trace document of each launch]}, the launches of all schemes taking turns."""
    docs = {plan: [] for plan in PLANS}
    for _ in range(launches):
        for name, u in PLANS:
            extra = ["--scheme", name] + (["--ulysses-degree", str(u)] if u else []) + ([] if warmup else ["--no-warmup"])
            docs[(name, u)].append(launch(command(N, seq_len, TILE, backward=True, repeat=repeat, extra=extra),
                                          progress))
    return docs


def rows_of(docs, costs, tiles, cores=None):
    """Table rows, measured against predicted, per scheme, layout and pass
    (seconds and bytes as numbers, formatted by `run`), and the flops model's rate."""
    cores = cores or available_cores()
    base = _median(d["layouts"]["contiguous"]["forward"].critical_path("compute_cpu_s") for d in docs[PLANS[0]])
    rate = costs[schemes()[0].label, "contiguous", False].totals()["critical_flops"] / base   # flop/s
    rows = []
    for s, plan in zip(schemes(), PLANS):
        for layout in SHOWN:
            walls = [d["layouts"][layout]["wall_s"] for d in docs[plan]]
            wall = 0.0
            for backward, kind in PASSES:
                cost = costs[s.label, layout, backward]
                trace = docs[plan][0]["layouts"][layout][kind]
                crit = [d["layouts"][layout][kind].critical_path("compute_cpu_s") for d in docs[plan]]
                cpu = tiles.seconds(cost)                                      # (r, N)
                wall += wall_from_cores(cpu, cost, cores)
                totals = cost.totals()
                rows.append(dict(scheme=s.label, layout=layout, kind=kind, measured=crit,
                                 predicted=float(cpu.max(axis=1).sum()), flops=totals["critical_flops"] / rate,
                                 sent=int(trace.bytes_sent.sum(axis=0).max()), sent_predicted=totals["bytes_sent"],
                                 kv=int(trace.kv_bytes.max()), kv_predicted=totals["peak_kv"],
                                 wall=_median(walls) if backward else None, wall_predicted=wall if backward else None))
    return rows, rate


def wall_from_cores(cpu, cost, cores):
    """Predicted wall seconds of one pass whose ranks share `cores`: per round
    the busiest rank's CPU seconds or all ranks' over the cores, whichever is
    longer, plus the transfers no compute hides, at the link."""
    per_round = np.maximum(cpu.max(axis=1), cpu.sum(axis=1) / cores)
    return float(per_round.sum() + cost.exposed.max(axis=1).sum() / LINK)


def _median(values):
    return float(np.median(list(values)))


def off(row):
    """measured (median) / predicted - 1."""
    return _median(row["measured"]) / row["predicted"] - 1


def table(rows):
    headers = ("scheme", "layout", "pass", "crit. ms: min, median, max", "predicted", "off", "flops model",
               "sent KiB", "predicted", "peak K/V KiB", "predicted", "wall ms (f+b)", "floor from the cores")
    out = []
    for r in rows:
        lo, mid, hi = (f(r["measured"]) * 1e3 for f in (min, _median, max))
        wall = [f"{r['wall'] * 1e3:.0f}", f"{r['wall_predicted'] * 1e3:.0f}"] if r["wall"] is not None else ["", ""]
        out.append([r["scheme"], r["layout"], r["kind"], f"{lo:.1f}, {mid:.1f}, {hi:.1f}", f"{r['predicted'] * 1e3:.1f}",
                    f"{off(r):+.0%}", f"{r['flops'] * 1e3:.1f}", _kib(r["sent"]), _kib(r["sent_predicted"]),
                    _kib(r["kv"]), _kib(r["kv_predicted"]), *wall])
    return markdown_table(headers, out, "lll" + "r" * 10)


def _kib(n):
    return f"{n / 1024:.0f}"


def run(quick=True, progress=None, results_dir=RESULTS, plan=None):
    plan = plan or (QUICK if quick else FULL)
    load = [os.getloadavg()[0]]
    costs = predictions(plan.seq_len)
    tiles = calibrate(costs, plan, progress)
    Path(results_dir).mkdir(parents=True, exist_ok=True)
    tiles.save(Path(results_dir) / "tile_costs.json")
    docs = measure(plan.seq_len, progress, repeat=plan.repeat, launches=plan.launches)
    load.append(os.getloadavg()[0])
    rows, rate = rows_of(docs, costs, tiles)
    within = sum(abs(off(r)) <= TARGET for r in rows)
    worst = max(rows, key=lambda r: abs(off(r)))
    text = "\n\n".join([intro(plan, tiles, rate, load), table(rows),
                        f"**{within} of {len(rows)} rows within {TARGET:.0%} of the prediction**; the farthest: "
                        f"{worst['scheme']}, {worst['layout']}, {worst['kind']}, {off(worst):+.1%}.",
                        "Commands: " + "; ".join(f"`{d[0]['command']}`" for d in docs.values())])
    return text, [], [("schemes: critical path against the tile-cost model", f"{within} of {len(rows)} rows",
                       f"within {TARGET:.0%}")]


def intro(plan, tiles, rate, load):
    shapes = sorted({s._replace(backward=False) for s in tiles.costs}, key=lambda s: -s.heads)
    ratios = ", ".join(f"{s.heads} head{'s' if s.heads > 1 else ''} of {s.block} tokens {tiles.backward_ratio(s):.2f}"
                       for s in shapes)
    sh = tiles.sharing
    factors = ", ".join(f"{busy} {sh.factor[busy, False]:.2f} / {sh.factor[busy, True]:.2f}"
                        for busy in range(2, sh.ranks + 1))
    return (f"N = {N} MPI ranks on {sh.cores} cores, S = {plan.seq_len}, Hq = Hkv = {SHAPE['Hq']}, D = {SHAPE['D']}, "
            f"float32, tile {TILE}, one BLAS thread per rank, step {tiles.machine['step']}; {plan.launches} launches "
            f"a scheme, {plan.repeat} runs each; load average {load[0]:.1f} before, {load[1]:.1f} after.\n\n"
            f"`crit. ms`: the sum over rounds of the busiest rank's CPU milliseconds in the step (min, median, max "
            f"over the launches). `predicted`: each round's full and masked tiles at their cost measured on this "
            f"machine just before (`reference.tile_cost`, least of {tiles.machine['repeats']}), times what ranks "
            f"sharing the cores measured (`bench.sharing`): ranks computing at once, forward / backward, {factors}; "
            f"a byte of a ring transfer in flight {sh.copy_s_per_byte * 1e9:.2f} ns. `off`: median / "
            f"predicted - 1. `flops model`: 4 D flops an entry forward, 10 D backward, at {rate / 1e9:.1f} GFLOP/s "
            f"(the ring's contiguous forward, measured). A full tile's backward over its forward, measured: {ratios} "
            f"(the flops model: 2.50). Wall: the slowest rank's forward + backward (median of the launches' best), "
            f"and a floor from the {sh.cores} cores: per round the busiest rank's predicted CPU time or all ranks' "
            f"over the cores, whichever is longer, plus the exposed transfers at {LINK_GBS:g} GB/s; not comparable "
            f"within {TARGET:.0%}: a pass's work outside the step and the scheduler are not in the model.")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.schemes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="S = 8192 (default: 4096)")
    args = ap.parse_args(argv)
    print(run(quick=not args.full, progress=print)[0])


if __name__ == "__main__":
    main()
