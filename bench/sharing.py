"""What ranks sharing one machine's cores add to a step's CPU time, measured in one launch.

A rank's CPU time in the step (`compute_cpu_s`, the critical path's) is its
time alone only while it has a core and its caches to itself. With more ranks
than cores, with idle ranks waking to test for their next block, and with a
K/V block in flight that MPI moves inside the step's `progress` calls, it is
more. This launch measures it on one `StepShape`'s full block
(`reference.tile_cost.Calibration`), forward and backward, in phases that
take turns repeat after repeat:

- alone: rank 0 runs the step while the others sleep;
- busy = 1 .. N: ranks 0 .. busy - 1 run it at once, the others waiting as a
  ring's idle ranks wait for a block (`mpi_impl.cores.wait_any`);
- shift: all N in N rounds of a ring, back to back: each sends on the block
  it attends to, and receives the next.

In each group of 5 repeats (the runs a launch of the schemes keeps its least
of), a phase's time is the busiest rank's least, as a critical path takes it;
``factor[busy]`` is phase busy over alone, and the shift's extra time over
phase N, per byte a round sends and receives, what a byte in flight costs;
each the median over the groups: a `reference.tile_cost.Sharing`, which rank
0 writes as JSON.

    mpiexec -n 4 python -m mpi4py -m bench.sharing --heads 4 --block 1024 --out sharing.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from reference import steps, usage
from reference.cores import blas_limit
from reference.ring import KV
from reference.scheme_cost import StepShape
from reference.step import ForwardAcc, Grads, KVBlock
from reference.tile_cost import Calibration, Sharing
from reference.tiles import Tile

from .mpi_scaling import ROOT, SINGLE_THREAD, _mpiexec

PASSES = (False, True)          # forward, backward
GROUP = 5                       # repeats a launch of the schemes' takes its least over


class Rank:
    """One rank's calibration block, both passes ready to run again and again."""

    def __init__(self, shape, step, rank):
        cal = Calibration.of(shape, np.random.default_rng(rank))
        self.queries, own, self.block = cal.blocks("contiguous")
        self.acc = ForwardAcc.zeros(self.queries.q)
        self.step, self.tile = step, shape.tile
        for b in (own, self.block):                     # the own block first, as in round 1
            step.forward(self.acc, self.queries, b, tile_size=self.tile, causal=True)
        self.rows = cal.rows(self.acc, self.queries)
        dq = np.zeros_like(self.queries.q)
        self.moved = 2 * sum(a.nbytes for a in self.block)        # a ring round's block, sent and received
        self.grads = Grads(dq, np.zeros_like(self.block.k, dtype=dq.dtype), np.zeros_like(self.block.v, dtype=dq.dtype))

    def run(self, backward, block=None, progress=None):
        """CPU seconds of one step on `block` (default: the full block; accumulating: the sums only grow)."""
        block = self.block if block is None else block
        start = time.thread_time()
        if backward:
            self.step.backward(self.grads, self.queries, self.rows, block, tile_size=self.tile,
                               causal=True, progress=progress)
        else:
            self.step.forward(self.acc, self.queries, block, tile_size=self.tile, causal=True, progress=progress)
        return time.thread_time() - start


def phases(comm, ring, rank, repeats):
    """{(phase, backward): this rank's CPU seconds, one per repeat (NaN where it
    did not compute)}: "alone" (rank 0, the others asleep), 1..N busy (the
    others waiting as a ring's idle ranks do), "shift" (all, N rounds of a
    ring back to back: the block held sent on while the step attends to it,
    the next one received; their mean)."""
    from mpi_impl.cores import wait_any, wait_quietly
    n, me, times, held = comm.Get_size(), comm.Get_rank(), {}, rank.block

    def timed(key, busy, block=None, progress=None):
        wait_quietly(comm)
        comm.Barrier()
        times.setdefault(key, []).append(rank.run(key[1], block, progress) if me < busy else np.nan)

    for _ in range(repeats):
        for backward in PASSES:
            timed(("alone", backward), 1)
            wait_quietly(comm)
            for busy in range(1, n + 1):
                timed((busy, backward), busy)
                wait_any([comm.Ibarrier()], quiet=True)     # as a ring's idle rank waits for its next block
            wait_quietly(comm)
            comm.Barrier()
            rounds = []
            for _ in range(n):                              # a ring's rounds, back to back
                shift = ring.start_shift(held, KV)          # K, V, positions, owner: a ring's block
                rounds.append(rank.run(backward, held, ring.progress))
                held = KVBlock(*ring.finish_shift(shift))
            times.setdefault(("shift", backward), []).append(float(np.mean(rounds)))
    wait_quietly(comm)
    return times


def sharing_of(times, moved, cores, group=GROUP):
    """The Sharing from every rank's `phases` (rank order) and the bytes a
    rank sends and receives in a round: in each group of `group` repeats (a
    launch's runs), a phase's time is the busiest rank's least (a critical
    path's); each factor, and the shift's extra seconds, the median over the
    groups, its cost per byte the mean of the two passes'."""
    n = len(times)
    per_rank = {key: np.array([t[key] for t in times]) for key in times[0]}      # (N, repeats)
    groups = range(0, len(per_rank["alone", False][0]) - group + 1, group)

    def least(key):
        return [np.nanmax(per_rank[key][:, g:g + group].min(axis=1)) for g in groups]

    def ratio(top, bottom):
        return float(np.median(np.array(least(top)) / np.array(least(bottom))))

    factor = {(busy, b): ratio((busy, b), ("alone", b)) for busy in range(1, n + 1) for b in PASSES}
    extra = [np.median(np.array(least(("shift", b))) - np.array(least((n, b)))) for b in PASSES]   # seconds a round
    return Sharing(cores=cores, ranks=n, factor=factor, copy_s_per_byte=float(np.mean(extra)) / moved)


def measure(shape, repeats, *, step="auto"):
    """This launch's Sharing on rank 0 (None elsewhere). Collective."""
    from mpi4py import MPI

    from mpi_impl.comm import RingComm
    from reference.cores import available_cores
    comm = MPI.COMM_WORLD
    with blas_limit(1), RingComm.on(comm) as ring:
        rank = Rank(shape, steps.get(step, xp=np), comm.Get_rank())
        times = comm.gather(phases(comm, ring, rank, repeats))
    return None if times is None else sharing_of(times, rank.moved, available_cores())


def launch(n, shape, repeats=3 * GROUP, progress=None):
    """Run this module on `n` ranks with one BLAS thread each; its Sharing."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sharing.json"
        cmd = [_mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "bench.sharing", *arguments(shape),
               "--repeats", str(repeats), "--out", str(out)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), **SINGLE_THREAD),
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
        if progress:
            progress(f"mpiexec -n {n} python -m mpi4py -m bench.sharing ({time.perf_counter() - start:.0f} s)")
        return Sharing.of_dict(json.loads(out.read_text()))


def arguments(shape):
    """The command-line options of a StepShape."""
    return ["--heads", str(shape.heads), "--kv-heads", str(shape.kv_heads), "--head-dim", str(shape.D),
            "--block", str(shape.block), "--tile-size", str(shape.tile.tq), "--dtype", shape.dtype]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="mpiexec -n N python -m mpi4py -m bench.sharing",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=usage.count, default=4, help="query heads a rank holds (default %(default)s)")
    ap.add_argument("--kv-heads", type=usage.count, default=None, help="key/value heads a rank holds (default: --heads)")
    ap.add_argument("--head-dim", type=usage.count, default=64, help="head dim D (default %(default)s)")
    ap.add_argument("--block", type=usage.count, default=1024, help="tokens of a block (default %(default)s)")
    ap.add_argument("--tile-size", type=usage.count, default=256, help="tile size (default %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="dtype (default %(default)s)")
    ap.add_argument("--repeats", type=usage.count, default=3 * GROUP,
                    help=f"repeats, in groups of {GROUP} (default %(default)s)")
    ap.add_argument("--out", required=True, help="JSON file rank 0 writes")
    args = ap.parse_args(argv)
    if args.repeats < GROUP:
        ap.error(f"--repeats ({args.repeats}) must be at least {GROUP}, a group")
    kv = args.kv_heads or args.heads
    if args.heads % kv:
        ap.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({kv})")
    shape = StepShape(1, args.heads, kv, args.head_dim, args.block, Tile(args.tile_size, args.tile_size),
                      args.dtype, False)
    found = measure(shape, args.repeats)
    if found is not None:
        Path(args.out).write_text(json.dumps(found.as_dict(), indent=1) + "\n")


if __name__ == "__main__":
    main()
