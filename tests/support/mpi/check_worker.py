"""The command line's --check and --repeat fed results it must judge, in one launch.

    mpiexec -n 2 python -m mpi4py tests/support/mpi/check_worker.py TRACE_DIR

Each scenario runs `mpi_impl.cli.main` with a backend that wraps mpi_impl's
ring and spoils one thing (rank 1's results, so that rank 0 must gather them),
and each rank prints "rank R: SCENARIO: status S". The process exits with the
largest status, as ``python -m mpi_impl`` would with any of them.

  correct         the real ring                             -> 0
  correct-noncausal  the real ring, --no-causal             -> 0
  nan-out         one NaN in out                            -> 1
  nan-dq          one NaN in dq, out and lse right          -> 1
  wrong-dk        dk halved, everything else right          -> 1
  no-grads        --backward, but no gradient returned      -> 1
  wrong-lse       lse off by 1e-3                           -> 1
  always-causal   --no-causal, but the ring runs causal     -> 1
  repeat          --repeat 3: canned CPU times per (repeat, round, rank); the
                  trace file TRACE_DIR/repeat.json must hold the critical path
                  of the least time per (round, rank), and the logs the backend
                  returned must still hold their canned times (status 3 if not)
"""

import sys
from dataclasses import replace

import numpy as np

import mpi_impl
from mpi_impl.cli import Backend, main
from reference.masks import CAUSAL

# CPU seconds of each round, [repeat][rank] -> (round 0, round 1), on 2 ranks
CANNED_CPU_S = [[(5.0, 1.0), (1.0, 4.0)],
                [(1.0, 5.0), (4.0, 1.0)],
                [(3.0, 3.0), (2.0, 2.0)]]
ARGS = ["--seq-len", "32", "--heads", "2", "--head-dim", "8", "--dtype", "float64", "--tile-size", "4",
        "--layout", "striped", "--backward", "--check", "--no-warmup"]


def spoiled(scenario, comm, handed=None):
    """A Backend whose results are mpi_impl's, spoiled as `scenario` says on
    rank 1; the logs with canned times it returns are appended to `handed`."""
    on_rank_1 = comm.Get_rank() == 1
    calls = {"forward": 0, "backward": 0}

    def canned(log, kind):
        log.compute_cpu_s = np.array(CANNED_CPU_S[calls[kind]][comm.Get_rank()])
        calls[kind] += 1
        if handed is not None:
            handed.append((log, log.compute_cpu_s.copy()))
        return log

    def forward(q, k, v, **options):
        if scenario == "always-causal":
            options["call"] = replace(options["call"], mask=CAUSAL)       # the plan's call, made causal
        out, lse, log = mpi_impl.ring_attention(q, k, v, **options)
        if scenario == "nan-out" and on_rank_1:
            out = out.copy()
            out[0, 1, 0, 0] = np.nan
        if scenario == "wrong-lse" and on_rank_1:
            lse = lse + 1e-3
        return out, lse, canned(log, "forward") if scenario == "repeat" else log

    def backward(q, k, v, out, lse, dout, **options):
        if scenario == "always-causal":
            options["call"] = replace(options["call"], mask=CAUSAL)
        dq, dk, dv, log = mpi_impl.ring_attention_backward(q, k, v, out, lse, dout, **options)
        if scenario == "nan-dq" and on_rank_1:
            dq = dq.copy()
            dq[0, 2, 1, 3] = np.nan
        if scenario == "wrong-dk" and on_rank_1:
            dk = dk * 0.5
        log = canned(log, "backward") if scenario == "repeat" else log
        return (log,) if scenario == "no-grads" else (dq, dk, dv, log)

    return Backend(f"spoiled ({scenario})", forward, backward)


SCENARIOS = {
    "correct": [], "correct-noncausal": ["--no-causal"], "nan-out": [], "nan-dq": [], "wrong-dk": [],
    "no-grads": [], "wrong-lse": [], "always-causal": ["--no-causal"], "repeat": ["--repeat", "3"],
}


def run(trace_dir):
    from mpi4py import MPI          # here, so that the tests can read this module's tables
    comm = MPI.COMM_WORLD
    statuses = []
    for scenario, extra in SCENARIOS.items():
        argv = ARGS + extra + ["--trace-out", f"{trace_dir}/{scenario}.json"]
        handed = []
        status = main(argv, backend=spoiled(scenario, comm, handed))
        if any(not np.array_equal(log.compute_cpu_s, times) for log, times in handed):
            status = 3          # the command line wrote into a log the backend handed it
        print(f"rank {comm.Get_rank()}: {scenario}: status {status}", flush=True)
        statuses.append(status)
    return max(statuses)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
