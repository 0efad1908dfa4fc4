"""The command line's output: one row per layout, the table rank 0 prints, --trace-out, --plot, the verdict.

    row = Row(layout="striped", wall_s=0.28, critical_cpu_s=0.137, predicted=1.58)
    print(format_table([row, ...], args, n_ranks=4, check="float64 reference ... 3.1 s on rank 0"))
"""

import sys
from dataclasses import dataclass, field

import numpy as np

from reference.plot import plot_timeline
from reference.trace import write_trace
from reference.usage import output_problem  # noqa: F401 (the command line's check of its output files)

from .check import check_tolerance


@dataclass
class Row:
    """One layout's result, on rank 0."""
    layout: str
    wall_s: float
    critical_cpu_s: float
    predicted: float
    error: float = float("nan")
    errors: dict = field(default_factory=dict)       # --check: "out", "lse", "dq", ... -> scaled error
    wait_fraction: float = float("nan")
    traces: dict = field(default_factory=dict)       # "forward"/"backward" -> Trace
    peak_rss_kb: list = field(default_factory=list)  # per rank, over the whole process so far
    scheme: object = None                            # the run's `reference.schemes.Scheme` (None: the ring)




def format_table(rows, args, n_ranks, backend_name="numpy", busy="compute_cpu_s", check=""):
    """layout | max error | critical path | wall | speedups measured | predicted;
    `check`: a line under it saying what the check's reference cost."""
    base = next((r for r in rows if r.layout == "contiguous"), None)
    passes = "forward+backward" if args.backward else "forward"
    ran = steps_ran(rows)
    lines = [f"{backend_name}: {_scheme_label(rows)}N={n_ranks} ranks, S={args.seq_len}, B={args.batch}, "
             f"Hq={args.heads}, "
             f"Hkv={args.kv_heads or args.heads}, D={args.head_dim}, {args.dtype}, tile={args.tile_size}, "
             + (f"backward tile={args.backward_tile_size}, " if getattr(args, "backward_tile_size", None) else "")
             + f"{mask_label(args)}, {passes}, best of {args.repeat}, {ran}, "
             f"{args.blas_threads} BLAS thread{'s' if args.blas_threads != 1 else ''} per product"
             + (", waits quiet" if getattr(args, "quiet_waits", False) else ", waits spinning"),
             f"{'layout':<11} {'max error':>9} {'crit. path':>10} {'wall':>9} {'wall speedup':>12} "
             f"{'crit. speedup':>13} {'predicted':>9} {'wait/compute':>12}",
             "-" * 93]
    for r in rows:
        speed = f"{base.wall_s / r.wall_s:>12.2f}" if base else f"{'-':>12}"
        crit = f"{base.critical_cpu_s / r.critical_cpu_s:>13.2f}" if base else f"{'-':>13}"
        err = f"{r.error:>9.1e}" if args.check else f"{'-':>9}"
        lines.append(f"{r.layout:<11} {err} {r.critical_cpu_s * 1e3:>8.1f}ms {r.wall_s * 1e3:>7.1f}ms "
                     f"{speed} {crit} {r.predicted:>9.2f} {r.wait_fraction:>12.1%}")
    what = "CPU time" if busy == "compute_cpu_s" else "device time (CUDA events)"
    lines.append(f"crit. path: sum over rounds of the busiest rank's {what} in the step; "
                 "speedups: contiguous / layout; predicted: reference.cost, tiles")
    if check:
        lines.append(f"check: {check}")
    return "\n".join(lines)


def _scheme_label(rows):
    """'' for the ring; else the scheme and its Ulysses degree, then a comma."""
    scheme = rows[0].scheme if rows else None
    return "" if scheme is None or scheme.name == "ring" else scheme.label + ", "


def mask_label(args):
    """'causal', or 'causal, window 256, 9 documents, dropout 0.1'."""
    parts = ["causal" if args.causal else "not causal"]
    if args.window is not None:
        parts.append(f"window {args.window}")
    docs = args.doc_lengths or (args.cu_seqlens and args.cu_seqlens[1:])
    if docs:
        parts.append(f"{len(docs)} documents")
    if args.dropout:
        parts.append(f"dropout {args.dropout:g}")
    return ", ".join(parts)


def steps_ran(rows):
    """'step v3 (1 worker)' or 'forward step fused, backward step v1': read from the traces."""
    ran = {kind: t.step for r in rows[:1] for kind, t in r.traces.items()}
    if len(set(ran.values())) == 1:
        return f"step {ran['forward']}"
    return ", ".join(f"{kind} step {name}" for kind, name in ran.items())


def run_document(rows, args, n_ranks):
    """What --trace-out writes (`reference.trace.write_trace`): the options, and
    per layout the figures of the table and the traces of its passes."""
    return {"args": vars(args), "n_ranks": n_ranks, "layouts": {
        r.layout: {"wall_s": r.wall_s, "critical_cpu_s": r.critical_cpu_s, "predicted_speedup": r.predicted,
                   "max_error": None if np.isnan(r.error) else r.error, "wait_fraction": r.wait_fraction,
                   "peak_rss_kb": r.peak_rss_kb, **r.traces}
        for r in rows}}


def wait_fraction(traces):
    """Largest, over ranks, of (time waiting for transfers) / (time computing)."""
    wait = sum(t.wait_s.sum(axis=0) for t in traces)              # (N,)
    compute = sum(t.compute_s.sum(axis=0) for t in traces)
    return float((wait / np.maximum(compute, 1e-12)).max())




def largest(errors):
    """The largest error; NaN if any is NaN, or if there is none (Python's max
    would skip a NaN that is not first, and pass a NaN result)."""
    errors = list(errors)
    return float(np.max(errors)) if errors else float("nan")


def report(rows, args, comm, backend, checker, choice=""):
    """Rank 0: print the table, write the trace and the plot; the exit status
    (1 if --check found an error above the tolerance, or NaN)."""
    check = (f"float64 reference ({checker.describe()}) once for every layout, {checker.threads}, "
             f"{checker.seconds:.1f} s on rank 0 while the others slept") if args.check else ""
    print(format_table(rows, args, comm.Get_size(), backend.name, busy=backend.busy, check=check))
    if choice:
        print(choice)
    if args.trace_out:
        write_trace(args.trace_out, run_document(rows, args, comm.Get_size()))
    if args.plot:
        plot_timeline(args.plot, {r.layout: r.traces for r in rows},
                      f"S={args.seq_len}, N={comm.Get_size()}, tile={args.tile_size}")
    tol = check_tolerance(args.dtype)
    failed = [r for r in rows if args.check and not r.error <= tol]     # NaN is not <= tol: it fails
    if failed:
        print("CHECK FAILED: " + ", ".join(
            f"{r.layout} ({', '.join(f'{name} {e:.1e}' for name, e in r.errors.items() if not e <= tol)})"
            for r in failed) + f" above {tol:g}", file=sys.stderr)
        return 1
    return 0
