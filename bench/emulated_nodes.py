"""Emulated nodes: every scheme and placement on MPI ranks whose links are emulated, against the cost model.

N = 4 MPI ranks of one machine as 2 nodes of 2 (`mpi_impl.links`: each
transfer held until its bytes have had the time of the link they cross), under
two link settings for which the cost model (`reference.scheme_cost`, on a
`reference.topology.Machine`) picks different schemes. Every scheme the shapes
allow runs in every placement (`reference.topology.placements`), forward and
backward, in one launch per setting; a pass's time is its critical path: from
the first rank's start to the last rank's end, after a barrier. The table puts
it beside the prediction, and the ranking of the schemes and placements
(forward plus backward) measured beside the one predicted.

The links are slow (MB/s) on purpose: the ranks share the machine's cores, so
their compute is slowed by the others (with 4 ranks on 2 cores, by about 2);
with links this slow, a pass is mostly the time its bytes take, which the
emulation holds to the microsecond, and the compute that remains is predicted
from a rate measured in the same launch (the critical path's CPU seconds
against its tile flops, forward and backward apart) times the ranks per core.

    python -m bench.emulated_nodes             # quick: 2 settings, 3 repeats, about 2 minutes
    python -m bench.emulated_nodes --full      # 5 repeats, and 8 ranks as 2 nodes of 4
    python -m bench.run --only nodes
    mpiexec -n 4 python -m mpi4py -m bench.emulated_nodes --worker SPEC.json OUT.json   # one launch
"""

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mpi_impl import ring_attention, ring_attention_backward
from mpi_impl.comm import RingComm
from mpi_impl.cores import wait_quietly
from mpi_impl.groups import placed
from mpi_impl.links import EmulatedLinks
from reference.layouts import shard_at
from reference.scheme_cost import candidates, predict_scheme
from reference.schemes import Scheme
from reference.topology import Link, Machine, placement, placements

from . import markdown_table
from .mpi_scaling import SINGLE_THREAD, ROOT, _mpiexec, _short

SHAPE = dict(S=1024, B=1, Hq=16, Hkv=4, D=64, dtype="float16", tile=128, layout="striped")
SETTINGS = {        # name -> (machine, why the model's winner is what it is)
    "A": (Machine(2, Link(0.002), Link(0.002)),
          "one speed inside and between nodes: Ulysses wins, its two exposed all-to-alls taking less time than "
          "the rings' shifts, which carry every rank's K, V (and the backward's dK, dV) N - 1 times"),
    "B": (Machine(2, Link(0.01), Link(0.002, 5000.0)),
          "inside 5 times between, and 5 ms of latency between nodes: the double ring wins, its one block a "
          "step between nodes travelling through the step's rounds while the inner ring shifts on the fast link"),
}
TARGET = 0.15               # |measured / predicted - 1| at most, per pass
CALL_TOKENS = 64            # a call on this many tokens over free links: what any call costs
QUICK_REPEAT, FULL_REPEAT = 3, 5


def runs_of(machine, n):
    """(Scheme, Placement) of every scheme the shapes allow in every placement on `machine`."""
    return [(s, p) for s in candidates(n, SHAPE["Hq"], SHAPE["Hkv"]) for p in placements(s, machine)]


# -- one launch: the worker, on every rank ------------------------------------------------------

def worker(spec_path, out_path):
    """Every run of the spec, `repeat` times after one untimed round, in turn;
    world rank 0 writes, per run, each pass's times, its critical path's CPU
    seconds, the bytes each scheme rank sent over each link, and the time of
    the same call on CALL_TOKENS tokens over free links (what a call costs
    whatever it computes and moves: its agreement, communicators, rounds)."""
    from mpi4py import MPI

    spec = json.loads(Path(spec_path).read_text())
    world = MPI.COMM_WORLD
    machine = Machine(spec["ranks_per_node"], Link(*spec["intra"]), Link(*spec["inter"]))
    free = Machine(spec["ranks_per_node"], Link(float("inf")), Link(float("inf")))
    runs = [(prepare(world, machine, EmulatedLinks(machine, world.Get_rank()), *run),
             prepare(world, machine, EmulatedLinks(free, world.Get_rank()), *run, seq_len=CALL_TOKENS))
            for run in spec["runs"]]
    found = [{kind: [] for kind in ("forward", "backward", "cpu_forward", "cpu_backward", "call_forward",
                                    "call_backward")} for _ in runs]
    for rep in range(spec["repeat"] + 1):
        for ((rank, shards, opts), small), result in zip(runs, found):
            times, logs = timed(world, shards, opts)
            call = timed(world, *small[1:])[0]
            if rep == 0:                        # untimed: imports, buffers, first-touch pages
                continue
            mine = (rank, {kind: (log.compute_cpu_s, log.sent_intra, log.sent_inter) for kind, log in logs.items()})
            everyone = world.gather(mine)
            if world.Get_rank() != 0:
                continue
            for kind in ("forward", "backward"):
                per_rank = [got[kind] for _, got in sorted(everyone, key=lambda x: x[0])]       # scheme rank order
                result[kind].append(times[kind])
                result["call_" + kind].append(call[kind])
                result["cpu_" + kind].append(float(np.stack([x[0] for x in per_rank], axis=1).max(axis=1).sum()))
                result[kind + "_links"] = [np.stack([x[i] for x in per_rank], axis=1).tolist() for i in (1, 2)]
    if world.Get_rank() == 0:
        Path(out_path).write_text(json.dumps(found))


def prepare(world, machine, links, name, u, w, where, seq_len=None):
    """(scheme rank, its shards, the call's options) of one run: the world's
    ranks placed (`mpi_impl.groups.placed`), rings over the emulated links."""
    scheme = Scheme.checked(name, u if u > 1 else None, n_devices=world.Get_size(), Hq=SHAPE["Hq"], Hkv=SHAPE["Hkv"],
                            ring_inner=w)
    comm = placed(world, placement(scheme, machine, where))
    S, dtype = seq_len or SHAPE["S"], SHAPE["dtype"]
    rng = np.random.default_rng(0)
    q, dout = (rng.standard_normal((1, S, SHAPE["Hq"], SHAPE["D"])).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((1, S, SHAPE["Hkv"], SHAPE["D"])).astype(dtype) for _ in range(2))
    pos = scheme.positions(S, SHAPE["layout"])
    shards = [shard_at(x, pos)[comm.Get_rank()] for x in (q, k, v, dout)]
    opts = dict(comm=comm, layout=SHAPE["layout"], tile_size=SHAPE["tile"], trace="rank", step="auto",
                make_ring=functools.partial(RingComm.on, links=links), scheme=name,
                ulysses_degree=u if u > 1 else None, ring_inner=w)
    return comm.Get_rank(), shards, opts


def timed(world, shards, opts):
    """({"forward": s, "backward": s}, {"forward": RoundLog, ...}): each pass
    from the first rank's start to the last rank's end, after a barrier."""
    from mpi4py import MPI
    q, k, v, dout = shards
    times, logs = {}, {}
    for kind in ("forward", "backward"):
        wait_quietly(world)
        world.Barrier()
        start = time.monotonic()
        if kind == "forward":
            out, lse, logs[kind] = ring_attention(q, k, v, **opts)
        else:
            *_, logs[kind] = ring_attention_backward(q, k, v, out, lse, dout, **opts)
        end = time.monotonic()
        times[kind] = world.allreduce(end, op=MPI.MAX) - world.allreduce(start, op=MPI.MIN)
    return times, logs


# -- the section: launches, predictions, the table -----------------------------------------------

class SharedCores:
    """Compute on ranks that share the cores: tile flops at `rate` (FLOP/s of
    a rank with a core of its own), times `crowding` (ranks per core, at
    least 1: they compute at the same time, in the same rounds)."""

    def __init__(self, rate, crowding):
        self.rate, self.crowding = rate, crowding

    def seconds(self, cost):
        return cost.work.tile_area * cost.flops_per_entry / self.rate * self.crowding


def launch(n, machine, repeat, progress=None, timeout=1200):
    """(runs, their results, the command) of one launch on n ranks."""
    import subprocess
    runs = runs_of(machine, n)
    spec = dict(ranks_per_node=machine.ranks_per_node, repeat=repeat,
                intra=[machine.intra.gbs, machine.intra.latency_us], inter=[machine.inter.gbs, machine.inter.latency_us],
                runs=[(s.name, s.u, s.w, p.name) for s, p in runs])
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / "spec.json", Path(tmp) / "out.json"]
        paths[0].write_text(json.dumps(spec))
        cmd = [_mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "bench.emulated_nodes", "--worker",
               *map(str, paths)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), MPIEXEC_TIMEOUT=str(timeout), **SINGLE_THREAD)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"{_short(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
        if progress:
            progress(f"{n} ranks, {machine.describe(n)} ({time.perf_counter() - start:.0f} s)")
        results = json.loads(paths[1].read_text())
    return runs, results, "OPENBLAS_NUM_THREADS=1 " + _short(cmd[:-2]) + " SPEC.json OUT.json"


def predictions(runs, results, machine, n):
    """{(run index, pass): (predicted s, bytes per link as modelled)}, and the
    compute rates (FLOP/s, forward and backward) measured in the launch. A
    pass's prediction: `SchemeCost.seconds` on the emulated machine, plus the
    time of the same call on CALL_TOKENS tokens over free links (measured)."""
    shape = dict(B=SHAPE["B"], Hq=SHAPE["Hq"], Hkv=SHAPE["Hkv"], D=SHAPE["D"], dtype=SHAPE["dtype"],
                 tile_size=SHAPE["tile"])
    costs = [{kind: predict_scheme(s, SHAPE["S"], SHAPE["layout"], backward=kind == "backward", **shape)
              for kind in ("forward", "backward")} for s, _ in runs]
    crowding = max(1.0, n / len(os.sched_getaffinity(0)))
    rates, found = {}, {}
    for kind in ("forward", "backward"):
        flops = sum(c[kind].totals()["critical_flops"] for c in costs)
        rates[kind] = flops / sum(float(np.median(r["cpu_" + kind])) for r in results)
        for i, ((_, where), cost, result) in enumerate(zip(runs, costs, results)):
            call = float(np.median(result["call_" + kind]))        # measured apart: what any call costs
            seconds = cost[kind].seconds(machine, SharedCores(rates[kind], crowding), where) + call
            on = cost[kind].link_bytes(machine, where)
            same = all(np.array_equal(np.array(result[kind + "_links"][j]), on[name])
                       for j, name in enumerate(("intra", "inter")))
            found[(i, kind)] = (seconds, same)
    return found, rates, crowding


def setting_rows(name, runs, results, predicted):
    """Table rows of one setting, and (measured order, predicted order) of its runs by forward + backward."""
    rows, measured_total, predicted_total = [], {}, {}
    for i, ((scheme, where), result) in enumerate(zip(runs, results)):
        label = f"{scheme.label} {where.name}"
        for kind in ("forward", "backward"):
            times = np.array(result[kind])
            median, (seconds, same) = float(np.median(times)), predicted[(i, kind)]
            measured_total[label] = measured_total.get(label, 0.0) + median
            predicted_total[label] = predicted_total.get(label, 0.0) + seconds
            call = float(np.median(result["call_" + kind]))
            rows.append([name, scheme.label, where.name, kind, f"{median * 1e3:.0f}",
                         f"{times.min() * 1e3:.0f}-{times.max() * 1e3:.0f}", f"{seconds * 1e3:.0f}",
                         f"{call * 1e3:.0f}", f"{median / seconds:.2f}", "yes" if same else "**no**"])
    order = lambda totals: sorted(totals, key=totals.get)    # noqa: E731
    return rows, order(measured_total), order(predicted_total), measured_total, predicted_total


def run(quick=True, progress=None, **_):
    repeat = QUICK_REPEAT if quick else FULL_REPEAT
    plans = [(4, 2)] + ([] if quick else [(8, 4)])
    rows, texts, worst, agree, commands = [], [], 0.0, [], []
    for n, per_node in plans:
        for name, (base, why) in SETTINGS.items():
            machine = Machine(per_node, base.intra, base.inter)
            runs, results, command = launch(n, machine, repeat, progress)
            predicted, rates, crowding = predictions(runs, results, machine, n)
            found, measured, wanted, m_total, p_total = setting_rows(f"{name}, N={n}", runs, results, predicted)
            rows += found
            worst = max(worst, max(abs(float(r[8]) - 1) for r in found))
            agree.append(measured == wanted)
            commands.append(command)
            texts.append(f"- **{name}, N = {n}** ({machine.describe(n)}): {why}. Compute measured at "
                         f"{rates['forward'] / 1e9:.1f} GFLOP/s forward, {rates['backward'] / 1e9:.1f} backward, "
                         f"times {crowding:g} ranks per core. Predicted, forward + backward: "
                         + " < ".join(f"{x} ({p_total[x] * 1e3:.0f} ms)" for x in wanted)
                         + "; measured: " + " < ".join(f"{x} ({m_total[x] * 1e3:.0f} ms)" for x in measured)
                         + f": **{'the same ranking' if measured == wanted else 'a different ranking'}**.")
    headers = ("setting", "scheme", "placement", "pass", "measured ms (median)", "min-max", "predicted ms",
               "of which call ms", "measured / predicted", "bytes per link as modelled")
    text = "\n\n".join([
        f"{plans[0][0]} MPI ranks of this machine as 2 nodes of {plans[0][1]} (`mpi_impl.links`: each transfer "
        "held until its bytes have had the time of the link they cross; world rank m on node m // R), "
        f"S = {SHAPE['S']}, Hq = {SHAPE['Hq']}, Hkv = {SHAPE['Hkv']}, D = {SHAPE['D']}, {SHAPE['dtype']}, "
        f"{SHAPE['layout']}, tile {SHAPE['tile']}, one BLAS thread per rank; every scheme the heads allow in every "
        f"placement, {repeat} repeats after an untimed one, the runs in turn. A pass's time is its critical path: "
        "the first rank's start to the last rank's end, after a barrier. Predicted: `SchemeCost.seconds` on the "
        "emulated machine, compute from the rate the launch measured (the critical path's CPU seconds against "
        "its tile flops) times the ranks per core, plus what the call costs whatever it computes and moves (its "
        "agreement check, communicators, rounds and end notices: the same call on "
        f"{CALL_TOKENS} tokens over free links, measured beside it, the median column `call ms`). The links are slow on purpose: the ranks share 2 cores, "
        "and a link this slow, not the cores, decides how long a pass takes; the emulation holds each "
        "transfer to its link's time, and what the cores add is a small part, predicted from their rate.",
        "\n".join(texts),
        markdown_table(headers, rows, "llll" + "r" * 6),
        ("8 ranks are not run by the quick bench: on 2 cores, 8 ranks compute 4 to a core, so compute, "
         "stretched by the scheduler, is a larger and noisier share of a pass; `--full` runs them as 2 nodes "
         "of 4. " if quick else "") + "Commands: " + "; ".join(f"`{c}`" for c in commands)])
    headlines = [("emulated nodes: measured ranking of schemes and placements = predicted",
                  f"{sum(agree)} of {len(agree)} settings", "every setting"),
                 ("emulated nodes: critical path per pass against its prediction", f"within {worst:.0%}",
                  f"within {TARGET:.0%}")]
    return text, [], headlines


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.emulated_nodes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help=f"{FULL_REPEAT} repeats, and 8 ranks as 2 nodes of 4")
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help="one launch's ranks (under mpiexec)")
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return
    print(run(quick=not args.full, progress=lambda m: print(m, file=sys.stderr, flush=True))[0])


if __name__ == "__main__":
    main()
