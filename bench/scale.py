"""Long sequences on MPI ranks: time, share of the machine's sgemm rate, memory per rank.

One head, D = 64, striped, forward and backward, on N ranks of this machine
(one BLAS thread each), for a few sequence lengths so that the growth shows.
Every rank makes its own shard of the random inputs (`reference.inputs.make_shard`,
chunk by chunk from a seed); rank 0 then checks the result on a sample of
query rows against float64 dense attention computed on those rows only (the
dense formula with positions, `reference.attention(q[rows], k, v, q_pos=rows)`):
out, lse and dq. Reported per length:

    wall          slowest rank, forward + backward
    crit. path    sum over rounds of the busiest rank's CPU time in the step
    useful rate   (4 + 10) D FLOPs per visible pair, over the wall time
    of sgemm      that rate over the machine's float32 matmul rate (all cores)
    peak RSS      per rank, the largest; and its growth beyond the interpreter
                  and imports per 1,000 tokens held (linear in tokens: constant)

    python -m bench.scale                                     # 65,536 .. 262,144 tokens, 8 ranks
    python -m bench.scale --seq-lens 786432 --ranks 16        # the paper's longest sequence
    python -m bench.run --only scale
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mpi_impl.launch import find_mpiexec
from reference import steps, usage

from . import RESULTS, markdown_table

ROOT = Path(__file__).resolve().parents[1]
QUICK = dict(seq_lens=(65536, 131072, 262144), ranks=8, tile=512)
FULL = dict(seq_lens=(65536, 131072, 262144), ranks=8, tile=512)
HEAD_DIM, CHECK_ROWS, SEED = 64, 16, 0
SLOWEST = 0.02          # a launch running below this share of the sgemm rate is taken as hung


# -- one launch: the worker, on every rank --------------------------------------

def worker(args):
    """Run forward + backward on this rank's shard; rank 0 checks sampled rows and writes a JSON line."""
    from mpi4py import MPI

    import mpi_impl
    from reference.inputs import make_shard
    from reference import positions, steps
    comm = MPI.COMM_WORLD
    n, rank, S = comm.Get_size(), comm.Get_rank(), args.seq_len
    say = (lambda msg: print(f"  scale S={S}: {msg}", file=sys.stderr, flush=True)) if rank == 0 else (lambda m: None)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # the interpreter and imports
    pos = positions(S, n, "striped")[rank]
    shape = (1, S, 1, HEAD_DIM)
    q, k, v, dout = (make_shard(SEED, i, shape, pos, np.float32) for i in range(4))
    step = steps.get(args.step, xp=np)
    opts = dict(comm=comm, layout="striped", tile_size=args.tile, step=step, trace="rank")
    say(f"{n} ranks, {S // n} tokens each, step {step.label}: forward")
    comm.Barrier()
    start = time.perf_counter()
    out, lse, fwd = mpi_impl.ring_attention(q, k, v, **opts)
    say(f"forward done in {time.perf_counter() - start:.1f} s; backward")
    dq, _, _, bwd = mpi_impl.ring_attention_backward(q, k, v, out, lse, dout, **opts)
    wall = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    cpu = comm.gather(np.stack([fwd.compute_cpu_s, bwd.compute_cpu_s]))       # (2, N rounds) per rank
    rss = comm.gather((baseline, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    rows = np.unique(np.linspace(0, S - 1, CHECK_ROWS).astype(np.int64))      # global positions checked
    mine = np.isin(pos, rows)
    found = comm.gather((pos[mine], out[:, mine], lse[:, :, mine], dq[:, mine]))
    if rank != 0:
        return
    say("checking sampled rows against float64 dense")
    error = check(found, rows, S)
    crit = np.max(np.stack(cpu), axis=0).sum()          # per pass and round, the busiest rank; summed
    with open(args.worker, "w") as f:
        json.dump(dict(seq_len=S, ranks=n, tile=args.tile, step=step.label, wall_s=wall,
                       critical_s=float(crit), rss=rss, error=error), f)


def check(found, rows, S):
    """Largest error of out, lse and dq on the sampled rows, each over max(1, |reference|)."""
    from reference.inputs import make_shard
    from reference import attention, attention_backward
    got_pos = np.concatenate([p for p, *_ in found])
    order = np.argsort(got_pos)
    got = [np.concatenate([x[i] for x in found], axis=axis)[(slice(None),) * axis + (order,)]
           for i, axis in ((1, 1), (2, 2), (3, 1))]
    assert (got_pos[order] == rows).all()
    everything = np.arange(S)
    # the float32 inputs the ranks had, in float64
    q, k, v, dout = (make_shard(SEED, i, (1, S, 1, HEAD_DIM), everything, np.float32).astype(np.float64)
                     for i in range(4))
    out, lse = attention(q[:, rows], k, v, q_pos=rows, k_pos=everything)
    dq = attention_backward(q[:, rows], k, v, out, lse, dout[:, rows], q_pos=rows, k_pos=everything)[0]
    return max(float(np.abs(g - w).max() / max(1.0, np.abs(w).max())) if np.isfinite(g).all() else np.inf
               for g, w in zip(got, (out, lse, dq)))


# -- the driver ------------------------------------------------------------------

def launch(S, ranks, tile, step, say, timeout_s):
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "scale.json"
        cmd = [find_mpiexec() or "mpiexec", "-n", str(ranks), sys.executable, "-m", "mpi4py",
               "-m", "bench.scale", "--worker", str(result), "--seq-len", str(S), "--tile", str(tile),
               "--step", step]
        env = dict(os.environ, PYTHONPATH=str(ROOT), MPIEXEC_TIMEOUT=str(timeout_s), OPENBLAS_NUM_THREADS="1",
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        say(f"launching {ranks} ranks for S = {S} (given up after {timeout_s / 60:.0f} min)")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout_s + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"scale worker failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout}")
        return json.loads(result.read_text())


def useful_flops(S, D=HEAD_DIM):
    """(4 + 10) D FLOPs per visible pair, causal, one head."""
    return 14 * D * S * (S + 1) // 2


def run(quick=True, *, results_dir=RESULTS, progress=None, seq_lens=None, ranks=None, tile=None, step="auto",
        matmul_n=None):
    from .machine import blas_name, cpu_name, matmul_rate
    cfg = dict(QUICK if quick else FULL)
    cfg.update({k: v for k, v in dict(seq_lens=seq_lens, ranks=ranks, tile=tile).items() if v})
    say = progress or (lambda msg: print(f"  scale: {msg}", file=sys.stderr, flush=True))
    say("sgemm rate, all cores")
    rate = matmul_rate(5, matmul_n) if matmul_n else matmul_rate(5)
    results = [launch(S, cfg["ranks"], cfg["tile"], step, say, timeout_s=int(max(600, useful_flops(S) / (SLOWEST * rate))))
               for S in cfg["seq_lens"]]
    rows = []
    for r in results:
        useful = useful_flops(r["seq_len"]) / r["wall_s"]
        per_rank = r["seq_len"] // r["ranks"]
        peak = max(p for _, p in r["rss"])
        growth = max(p - b for b, p in r["rss"])                 # beyond the interpreter and imports
        rows.append([f"{r['seq_len']:,}", r["ranks"], f"{r['wall_s']:.1f}", f"{r['critical_s']:.1f}",
                     f"{useful / 1e9:.0f}", f"{useful / rate:.0%}", f"{peak / 2**20:.0f}",
                     f"{growth / 2**10 / (per_rank / 1000):.0f}", f"{r['error']:.1e}"])
    text = "\n".join([
        f"Made by `python -m bench.scale --seq-lens {' '.join(map(str, cfg['seq_lens']))} --ranks {cfg['ranks']} "
        f"--tile {cfg['tile']}` on {os.cpu_count()} cores ({cpu_name()}), BLAS {blas_name()}, one BLAS thread "
        f"per rank; step {results[0]['step']}; striped, one head, D = {HEAD_DIM}, float32, forward + backward. "
        f"sgemm rate of the machine (all cores, measured first): {rate / 1e9:.0f} GFLOP/s. Errors: out, lse and "
        f"dq of {CHECK_ROWS} sampled query rows against float64 dense attention on those rows.",
        "",
        markdown_table(["S", "ranks", "wall s", "crit. path s", "useful GFLOP/s", "of sgemm", "peak RSS MiB / rank",
                        "growth KiB / 1k tokens", "error"], rows),
    ])
    return text + "\n", []


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", type=usage.count, nargs="+", help="tokens S (default: 65536 131072 262144)")
    ap.add_argument("--ranks", type=usage.count, help="MPI ranks (default 8)")
    ap.add_argument("--tile", type=usage.count, help="tile size (default 512)")
    ap.add_argument("--step", default="auto", choices=steps.names(), help="step version (default: auto)")
    ap.add_argument("--worker", metavar="OUT.json", help=argparse.SUPPRESS)
    ap.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    bad = [s for s in args.seq_lens or () if s % (args.ranks or 8)]
    if bad:
        ap.error(f"every --seq-lens must be a positive multiple of --ranks, got {bad}")
    text, _ = run(seq_lens=args.seq_lens, ranks=args.ranks, tile=args.tile, step=args.step)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
