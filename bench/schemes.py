"""The four schemes on MPI ranks against the scheme cost model (`reference.scheme_cost`).

N = 4 ranks: the ring, the all-gather, Ulysses (u = 4) and USP (u = 2: Ulysses
in pairs, a ring of two across), each in one launch of the command line,

    OPENBLAS_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py -m mpi_impl --scheme NAME [--ulysses-degree 2] \\
        --layout all --seq-len S --heads 4 --head-dim 64 --dtype float32 --tile-size 256 --backward --repeat 2

For each scheme, layout (on the ring dimension) and pass, the table puts the
measured beside the predicted:

- critical path: the sum over rounds of the busiest rank's CPU seconds in the
  step (measured), against the busiest rank's tile flops per round (predicted);
  both as a ratio to the ring's contiguous forward, so that the machine's
  compute rate cancels out;
- bytes sent by the busiest rank and peak K/V bytes held, from the trace,
  against the prediction (equal by construction: tests/oracle/test_schemes.py holds them);
- wall time of forward+backward, against the predicted time at the compute rate
  the ring's contiguous forward measured and a 10 GB/s link (processes of one
  machine copy through shared memory). With more ranks than cores the wall time
  measures the scheduler too: the critical path is the comparison that holds.

    python -m bench.schemes            # quick: S = 4096, about a minute on 2 cores
    python -m bench.schemes --full     # S = 8192
    python -m bench.run --only schemes
"""

import argparse

from reference.scheme_cost import GB, predict_scheme
from reference.schemes import Scheme

from . import markdown_table
from .mpi_scaling import command, launch

N = 4
PLANS = (("ring", None), ("all_gather", None), ("ulysses", None), ("usp", 2))
SHAPE = dict(B=1, Hq=4, Hkv=4, D=64, dtype="float32")
TILE = 256
LINK_GBS = 10                   # processes of one machine: memory copies
LINK = LINK_GBS * GB
SHOWN = ("contiguous", "striped")


def measure(seq_len, progress=None, repeat=2, warmup=True):
    """{(scheme name, u): trace document} of one launch each."""
    docs = {}
    for name, u in PLANS:
        extra = ["--scheme", name] + (["--ulysses-degree", str(u)] if u else []) + ([] if warmup else ["--no-warmup"])
        docs[(name, u)] = launch(command(N, seq_len, TILE, backward=True, repeat=repeat, extra=extra), progress)
    return docs


def rows_of(docs, seq_len):
    """Table rows: measured against predicted, per scheme, layout and pass
    (bytes as integers, formatted by `run`); and the compute rate used."""
    def predicted(scheme, layout, backward):
        return predict_scheme(scheme, seq_len, layout, tile_size=TILE, backward=backward, **SHAPE)

    ring = Scheme.checked("ring", n_devices=N, Hq=SHAPE["Hq"], Hkv=SHAPE["Hkv"])
    base_doc = docs[("ring", None)]["layouts"]["contiguous"]["forward"]
    base_cpu = base_doc.critical_path("compute_cpu_s")
    base_flops = predicted(ring, "contiguous", False).totals()["critical_flops"]
    rate = base_flops / base_cpu
    rows = []
    for (name, u), doc in docs.items():
        scheme = Scheme.checked(name, u, n_devices=N, Hq=SHAPE["Hq"], Hkv=SHAPE["Hkv"])
        for layout in SHOWN:
            entry = doc["layouts"][layout]
            seconds = 0.0
            for backward, kind in ((False, "forward"), (True, "backward")):
                trace, cost = entry[kind], predicted(scheme, layout, backward)
                seconds += cost.seconds(LINK, rate)
                totals = cost.totals()
                rows.append([scheme.label, layout, kind,
                             f"{trace.critical_path('compute_cpu_s') / base_cpu:.2f}",
                             f"{totals['critical_flops'] / base_flops:.2f}",
                             int(trace.bytes_sent.sum(axis=0).max()), totals["bytes_sent"],
                             int(trace.kv_bytes.max()), totals["peak_kv"],
                             f"{entry['wall_s'] * 1e3:.0f}" if backward else "",
                             f"{seconds * 1e3:.0f}" if backward else ""])
    return rows, rate


def _kib(n):
    return f"{n / 1024:.0f}"


def run(quick=True, progress=None, **_):
    seq_len = 4096 if quick else 8192
    docs = measure(seq_len, progress)
    rows, rate = rows_of(docs, seq_len)
    headers = ("scheme", "layout", "pass", "crit. CPU", "predicted", "sent KiB", "predicted",
               "peak K/V KiB", "predicted", "wall ms (f+b)", "predicted")
    text = "\n\n".join([
        f"N = {N} MPI ranks, S = {seq_len}, Hq = Hkv = {SHAPE['Hq']}, D = {SHAPE['D']}, float32, tile {TILE}, "
        "one BLAS thread per rank, best of 2 per layout. `crit. CPU`: the sum over rounds of the busiest "
        "rank's CPU seconds in the step, over the ring's contiguous forward; its `predicted`: the busiest "
        "rank's tile flops per round, over the same. Sent and peak K/V: the busiest rank's, from the trace. "
        f"Predicted wall: the cost model at {rate / 1e9:.1f} GFLOP/s (the ring's contiguous forward, measured) "
        f"and a {LINK_GBS:g} GB/s link.",
        markdown_table(headers, [r[:5] + [_kib(b) for b in r[5:9]] + r[9:] for r in rows], "lll" + "r" * 8),
        "Commands: " + "; ".join(f"`{d['command']}`" for d in docs.values())])
    return text, []


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.schemes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="S = 8192 (default: 4096)")
    args = ap.parse_args(argv)
    print(run(quick=not args.full, progress=print)[0])


if __name__ == "__main__":
    main()
