"""Measured speed-up of striped and zigzag over contiguous on real MPI processes,
held against the cost model's prediction; waiting time; per-rank memory.

Paper, section 2.2.1: the ring's time is the sum over rounds of its busiest
device, and skipping whole masked tiles turns striped's balance into speed.
Each measurement is one launch of the command line,

    OPENBLAS_NUM_THREADS=1 mpiexec -n N python -m mpi4py -m mpi_impl --layout all \\
        --seq-len S --heads 4 --head-dim 64 --dtype float32 --tile-size 256 [--backward] --trace-out F.json

and this module reads its trace file. Four questions (docs/design.md, "How fast"):

1. N = 2 on 2 cores, one BLAS thread each: wall-clock speed-up over contiguous,
   forward and forward+backward, against `reference.cost.speedup` (tiles mode,
   same tile size). Target: at least 90% of the prediction.
2. N = 4 and 8, more ranks than cores: wall time measures the scheduler, so the
   critical path is rebuilt from each rank's CPU time per round
   (`compute_cpu_s`, sum over rounds of the busiest rank). Target: 90%.
3. Waiting for transfers (`wait_s`) as a fraction of compute, when each rank
   holds at least 4096 tokens. Target: at most 10% (striped, zigzag; contiguous's
   waiting also holds its imbalance: the idle devices wait for the busy one).
4. Per-rank peak memory (getrusage maxrss, gathered) against S and N.

The machine is shared: every figure is a ratio measured in one launch.

    python -m bench.mpi_scaling            # quick: about a minute or two on 2 cores
    python -m bench.mpi_scaling --full     # S = 16384, the longer sweep
    python -m bench.run --only mpi
"""

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mpi_impl.launch import find_mpiexec
from reference.trace import read_trace

from . import RESULTS, markdown_table

ROOT = Path(__file__).resolve().parents[1]
COMPARED = ("striped", "zigzag")
TARGET = 0.9                 # measured speed-up / predicted, at least
WAIT_TARGET = 0.10           # wait / compute, at most
WAIT_MIN_TOKENS = 4096       # per rank, where the wait target applies
SINGLE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Plan:
    """Sizes of each measurement (heads 4, head dim 64, float32 throughout)."""
    speed_seq: int            # N = 2 wall clock; each rank holds speed_seq / 2 tokens
    crit_seq: int             # N = 4, 8 critical path
    crit_ranks: tuple = (4, 8)
    tile: int = 256
    wall_repeat: int = 2      # best of, per layout, for the wall-clock launches
    repeat: int = 3           # critical-path launches: each (round, rank) keeps its least CPU time
    mem_seqs: tuple = ()      # S sweep at N = 2 (the first is the near-empty baseline)
    mem_ranks: tuple = ()     # N sweep at S = speed_seq


QUICK = Plan(speed_seq=8192, crit_seq=8192, mem_seqs=(256, 2048, 4096, 8192), mem_ranks=(1, 2, 4))
FULL = Plan(speed_seq=16384, crit_seq=16384, wall_repeat=3, mem_seqs=(256, 4096, 8192, 16384, 32768),
            mem_ranks=(1, 2, 4, 8))


def command(n, seq_len, tile, *, layout="all", backward=False, repeat=1, extra=()):
    """The mpiexec command line of one launch."""
    args = ["-n", str(n), sys.executable, "-m", "mpi4py", "-m", "mpi_impl", "--layout", layout,
            "--seq-len", str(seq_len), "--heads", "4", "--head-dim", "64", "--dtype", "float32",
            "--tile-size", str(tile), "--repeat", str(repeat)]
    return [_mpiexec()] + args + (["--backward"] if backward else []) + list(extra)


def _mpiexec():
    return find_mpiexec() or "mpiexec"          # not found: the launch says so


def launch(cmd, progress=None, timeout=1800, env=None):
    """Run one launch with one BLAS thread per rank (and `env` added); return its trace document."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        env = dict(os.environ, PYTHONPATH=str(ROOT), MPIEXEC_TIMEOUT=str(timeout), **SINGLE_THREAD, **(env or {}))
        start = time.perf_counter()
        proc = subprocess.run(cmd + ["--trace-out", str(path)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
        if progress:
            progress(f"{_short(cmd)} ({time.perf_counter() - start:.0f} s)")
        doc = read_trace(path)
    doc["command"] = "OPENBLAS_NUM_THREADS=1 " + _short(cmd)
    return doc


def _short(cmd):
    """The command as a reader would type it: mpiexec -n N python -m mpi4py ..."""
    return shlex.join(["mpiexec"] + cmd[1:3] + ["python"] + cmd[4:])


def critical_s(entry, passes):
    """Sum over rounds of the busiest rank's CPU seconds, over the given passes."""
    return sum(entry[p].critical_path("compute_cpu_s") for p in passes)


def wait_fraction(entry):
    """Largest over ranks of wait / compute, forward and backward together."""
    traces = [entry[p] for p in ("forward", "backward") if p in entry]
    wait = sum(t.wait_s.sum(axis=0) for t in traces)
    compute = sum(t.compute_s.sum(axis=0) for t in traces)
    return float((wait / compute).max())


# -- the four measurements ----------------------------------------------------

def wall_speedups(plan, progress):
    """N = 2: (rows, docs) with wall-clock speed-ups, forward and forward+backward."""
    rows, docs = [], {}
    for backward in (False, True):
        doc = launch(command(2, plan.speed_seq, plan.tile, backward=backward, repeat=plan.wall_repeat),
                     progress)
        docs[backward] = doc
        contiguous = doc["layouts"]["contiguous"]
        for layout in COMPARED:
            e = doc["layouts"][layout]
            measured, predicted = contiguous["wall_s"] / e["wall_s"], e["predicted_speedup"]
            crit = contiguous["critical_cpu_s"] / e["critical_cpu_s"]
            rows.append(["forward+backward" if backward else "forward", layout, f"{contiguous['wall_s']:.2f}",
                         f"{e['wall_s']:.2f}", f"{measured:.2f}", f"{crit:.2f}", f"{predicted:.2f}",
                         f"{measured / predicted:.0%}", _verdict(measured / predicted >= TARGET)])
    return rows, docs


def critical_speedups(plan, progress):
    """N = 4, 8: speed-ups from the critical path of per-rank CPU time per round."""
    rows, docs = [], {}
    for n in plan.crit_ranks:
        cmd = command(n, plan.crit_seq, plan.tile, backward=True, repeat=plan.repeat)
        doc = docs[n] = launch(cmd, progress)
        for passes in (("forward",), ("forward", "backward")):
            base = critical_s(doc["layouts"]["contiguous"], passes)
            for layout in COMPARED:
                e = doc["layouts"][layout]
                crit = critical_s(e, passes)
                measured, predicted = base / crit, e["predicted_speedup"]
                rows.append([n, "+".join(passes), layout,
                             f"{base:.2f}", f"{crit:.2f}", f"{measured:.2f}", f"{predicted:.2f}",
                             f"{measured / predicted:.0%}", _verdict(measured / predicted >= TARGET)])
    return rows, docs


def waiting(launches):
    """wait / compute per layout, for every launch where ranks hold >= 4096 tokens."""
    rows = []
    for doc in launches:
        n = doc["n_ranks"]
        c = doc["args"]["seq_len"] // n
        if c < WAIT_MIN_TOKENS:
            continue
        passes = "forward+backward" if doc["args"]["backward"] else "forward"
        for layout, e in doc["layouts"].items():
            f = wait_fraction(e)
            verdict = _verdict(f <= WAIT_TARGET) if layout in COMPARED else "imbalance included"
            rows.append([n, c, passes, layout, f"{f:.1%}", verdict])
    return rows


def memory(plan, progress):
    """Peak RSS per rank (largest over ranks), striped, forward+backward."""
    points = [(2, s) for s in plan.mem_seqs] + [(n, plan.speed_seq) for n in plan.mem_ranks if n != 2]
    peaks = {}
    for n, s in points:
        doc = launch(command(n, s, plan.tile, layout="striped", backward=True), progress)
        peaks[(n, s)] = max(doc["layouts"]["striped"]["peak_rss_kb"]) / 1024       # MiB
    base = peaks[(2, plan.mem_seqs[0])]
    rows = []
    for (n, s), mib in sorted(peaks.items(), key=lambda kv: (kv[0][0] != 2, kv[0][0], kv[0][1])):
        half = peaks.get((n, s // 2))
        growth = f"{mib / half:.2f}" if half else ""
        rows.append([n, s, s // n, f"{mib:.0f}", f"{mib - base:.0f}", growth])
    return rows, peaks


def _verdict(ok):
    return "yes" if ok else "**no**"


# -- output --------------------------------------------------------------------

def run(quick=True, *, results_dir=RESULTS, progress=None, plan=None):
    """Markdown tables and plots of the four measurements."""
    plan = plan or (QUICK if quick else FULL)
    load_before = os.getloadavg()[0]
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    wall_rows, wall_docs = wall_speedups(plan, progress)
    crit_rows, crit_docs = critical_speedups(plan, progress)
    wait_rows = waiting(list(wall_docs.values()) + list(crit_docs.values()))
    mem_rows, peaks = memory(plan, progress)
    pngs = [plot_speedups(wall_rows, crit_rows, results_dir / "mpi_speedup.png"),
            plot_memory(peaks, plan, results_dir / "mpi_memory.png"),
            timeline(plan, results_dir / "mpi_timeline_n2.png", progress)]
    text = "\n\n".join([
        f"{'Quick' if quick else 'Full'} run: {os.cpu_count()} cores, shared (1-minute load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after), so wall times are noisy; "
        f"every speed-up is a ratio of two layouts measured in the same launch. Heads 4, head dim 64, "
        f"float32, causal, tiles of {plan.tile}, one BLAS thread per rank. *predicted*: "
        f"`reference.cost.speedup(S, N, layout, {plan.tile}, \"tiles\")`; *of predicted*: measured / "
        f"predicted, target {TARGET:.0%}.",
        f"### N = 2 processes on 2 cores, S = {plan.speed_seq}: wall-clock speed-up over contiguous",
        "Wall: slowest rank, best of the repeats. *crit. speed-up*: the same ratio from the critical "
        "path of CPU time (next section), immune to other users of the machine.",
        markdown_table(["pass", "layout", "contiguous s", "layout s", "speed-up", "crit. speed-up",
                        "predicted", "of predicted", f">= {TARGET:.0%}"], wall_rows, "llrrrrrrl"),
        "Commands: " + "; ".join(f"`{d['command']}`" for d in wall_docs.values()),
        f"### N = {', '.join(map(str, plan.crit_ranks))} on 2 cores, S = {plan.crit_seq}: "
        "critical path from per-rank CPU time per round",
        "Critical path = sum over rounds of the busiest rank's CPU seconds in the step "
        "(`compute_cpu_s`), which does not count time the rank spent descheduled. Each (round, "
        f"rank) keeps its least CPU time over {plan.repeat} runs: a max over ranks of noisy times "
        "is biased upwards, most for the balanced layouts, whose ranks are all near the max.",
        markdown_table(["N", "pass", "layout", "contiguous s", "layout s", "speed-up", "predicted",
                        "of predicted", f">= {TARGET:.0%}"], crit_rows, "rllrrrrrl"),
        "Commands: " + "; ".join(f"`{d['command']}`" for d in crit_docs.values()),
        f"### Waiting for transfers, ranks holding >= {WAIT_MIN_TOKENS} tokens",
        "Largest over ranks of (seconds in `finish_shift`) / (seconds in the step), from the "
        "launches above. MPI moves a message only inside MPI calls here (no progress thread), so "
        "a block that did not move during the step moves while its receiver waits.",
        markdown_table(["N", "tokens per rank", "pass", "layout", "wait / compute",
                        f"<= {WAIT_TARGET:.0%}"], wait_rows, "rrllrl"),
        "### Per-rank peak memory (striped, forward+backward)",
        f"Largest over ranks of `ru_maxrss`. *above baseline*: minus the S = {plan.mem_seqs[0]}, N = 2 "
        "launch (interpreter, NumPy, MPI). *x S/2*: peak / peak at half the S, same N; target at "
        "most 2.",
        markdown_table(["N", "S", "tokens per rank", "peak MiB", "above baseline MiB", "x S/2"],
                       mem_rows),
        "Plots: " + ", ".join(f"`bench/results/{p.name}`" for p in pngs),
    ])
    heads = [(f"N = 2 ranks, S = {plan.speed_seq}, {r[1]}, {r[0]}: wall speed-up over contiguous, of predicted",
              r[7], f">= {TARGET:.0%}") for r in wall_rows]
    waits = [r for r in wait_rows if r[3] in COMPARED]
    if waits:
        worst = max(waits, key=lambda r: float(r[4].rstrip("%")))
        heads.append((f"wait / compute, largest over striped and zigzag at >= {WAIT_MIN_TOKENS} tokens a rank "
                       f"(N = {worst[0]}, {worst[2]}, {worst[3]})", worst[4], f"<= {WAIT_TARGET:.0%}"))
    return text, pngs, heads


def plot_speedups(wall_rows, crit_rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels, measured, predicted = [], [], []
    for r in wall_rows:
        labels.append(f"N=2 wall\n{r[1]}\n{r[0].replace('forward+backward', 'fwd+bwd')}")
        measured.append(float(r[4]))
        predicted.append(float(r[6]))
    for r in crit_rows:
        labels.append(f"N={r[0]} crit.\n{r[2]}\n{r[1].replace('forward+backward', 'fwd+bwd')}")
        measured.append(float(r[5]))
        predicted.append(float(r[6]))
    fig, ax = plt.subplots(figsize=(max(8, 0.8 * len(labels)), 4))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], predicted, 0.4, label="predicted (cost model, tiles)", color="0.7")
    ax.bar([i + 0.2 for i in x], measured, 0.4, label="measured", color="tab:blue")
    ax.axhline(1, color="k", lw=0.5)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("speed-up over contiguous")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(peaks, plan, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    seqs = [s for s in plan.mem_seqs]
    a.plot(seqs, [peaks[(2, s)] for s in seqs], "o-")
    a.set_xscale("log", base=2)
    a.set_xlabel("S (N = 2)")
    a.set_ylabel("peak RSS per rank, MiB")
    ns = sorted({n for n, s in peaks if s == plan.speed_seq})
    b.plot(ns, [peaks[(n, plan.speed_seq)] for n in ns], "o-")
    b.set_xlabel(f"N (S = {plan.speed_seq})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline(plan, path, progress):
    """The command line's own per-rank, per-round timeline for N = 2, forward+backward."""
    cmd = command(2, plan.speed_seq // 2, plan.tile, backward=True, extra=["--plot", str(path)])
    launch(cmd, progress)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.mpi_scaling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="the longer sweep (S = 16384)")
    args = ap.parse_args(argv)
    text, pngs = run(quick=not args.full, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(text)


if __name__ == "__main__":
    main()
