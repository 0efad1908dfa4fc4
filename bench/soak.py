"""A soak: thousands of ring calls in one MPI job of 4 ranks, memory and communicators held flat.

Each rank calls `mpi_impl.ring_attention` and `ring_attention_backward` in
turn, through every layout with masks on and off (causal or not, a sliding
window, packed documents, dropout, padding), on small shards, and measures after a
warm-up cycle, half-way and at the end (tests/support/mpi/soak_worker.py): the communicators
`RingComm.on` duplicated and did not free, Python's live memory (tracemalloc,
after a collection), and the resident set. MPICH fails at about the 2,047th
call of a job whose ring calls do not free their duplicates, so a run this
long also catches such a leak by failing. The virtual ring's side: its device
threads and Python's live memory over as many calls in one process.

    python -m bench.soak                  # 2,000 ring calls per rank, each MPI at hand
    python -m bench.soak --calls 5000
    python -m bench.run --only soak
"""

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from . import markdown_table
from .overlap import OPEN_MPI_ENV, ROOT, SINGLE_THREAD, libraries

RANKS = 4
QUICK_CALLS, FULL_CALLS = 2000, 6000


def mpi_soak(mpi, mpiexec, python, calls, tmp, timeout=3600):
    """Every rank's measurements (tests/support/mpi/soak_worker.py), and the job's wall time."""
    import subprocess
    out = Path(tmp) / f"soak_{mpi.replace(' ', '_')}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPIEXEC_TIMEOUT=str(timeout), **SINGLE_THREAD,
               **(OPEN_MPI_ENV if mpi == "Open MPI" else {}))
    cmd = [mpiexec, "-n", str(RANKS), python, "-m", "mpi4py", str(ROOT / "tests" / "support" / "mpi" / "soak_worker.py"),
           str(calls), str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text()), time.perf_counter() - t0


VIRTUAL_MASKS = (dict(causal=True), dict(causal=False), dict(window=5), dict(cu_seqlens=[0, 20, 32, 64]),
                 dict(dropout=0.2, seed=3))


def virtual_soak(calls):
    """Threads alive and Python's live bytes (tracemalloc, after a collection)
    after a warm-up cycle, half-way and at the end of `calls` virtual-ring calls
    (forward and backward count one each), and the seconds they took."""
    import gc
    import tracemalloc

    import reference
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 64, 2, 8)) for _ in range(4))
    configs = [(layout, mask) for layout in ("contiguous", "striped", "zigzag") for mask in VIRTUAL_MASKS]

    def cycle():
        for layout, mask in configs:
            out, lse = reference.ring_attention(q, k, v, n_devices=4, layout=layout, tile_size=4, **mask)
            reference.ring_attention_backward(q, k, v, out, lse, dout, n_devices=4, layout=layout, tile_size=4,
                                              **mask)

    def measure():
        gc.collect()
        return dict(threads=threading.active_count(), traced_bytes=tracemalloc.get_traced_memory()[0])

    tracemalloc.start()
    cycle()
    cycles = max(2, -(-calls // (2 * len(configs))))        # at least `calls` measured, after the warm-up
    start, t0 = measure(), time.perf_counter()
    for i in range(cycles):
        cycle()
        if i == cycles // 2 - 1:
            middle = measure()
    seconds = time.perf_counter() - t0
    end = measure()
    tracemalloc.stop()
    return dict(calls=2 * len(configs) * (cycles + 1), start=start, middle=middle, end=end, seconds=seconds)


def _kib(a, b):
    return f"{(b['traced_bytes'] - a['traced_bytes']) / 1024:+.1f}"


def run(quick=True, *, progress=None, calls=None):
    calls = calls or (QUICK_CALLS if quick else FULL_CALLS)
    say = progress or (lambda msg: None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mpi, mpiexec, python in libraries():
            say(f"{mpi}: {calls} ring calls on each of {RANKS} ranks")
            ranks, wall = mpi_soak(mpi, mpiexec, python, calls, tmp)
            for r in ranks:
                s, m, e = r["start"], r["middle"], r["end"]
                rows.append((mpi, r["rank"], r["calls"], f"{wall:.0f}", f"{s['open_communicators']} / "
                             f"{e['open_communicators']}", _kib(s, m), _kib(m, e),
                             f"{s['resident_bytes'] / 2**20:.1f} / {e['resident_bytes'] / 2**20:.1f}"))
    say(f"virtual ring: {calls} calls")
    virtual = virtual_soak(calls)
    s, m, e = virtual["start"], virtual["middle"], virtual["end"]
    return "\n".join([
        f"One MPI job of {RANKS} ranks per library, each rank making the ring calls counted below (forward "
        "and backward count one each), cycling through contiguous, striped and zigzag with causal, not "
        "causal, a window of 5, three packed documents, dropout 0.2 and padding (seq_len S - 3); 16 tokens "
        "per rank, 2 heads of 8, float64. Measured after a warm-up cycle (start), half-way and at the end; "
        "every call's results equal the first cycle's. Live memory is Python's (tracemalloc, after a "
        "collection: every NumPy buffer and object alive); a leak grows it in the second half too. The "
        f"command: `python -m bench.soak --calls N`, which runs `mpiexec -n {RANKS} python -m mpi4py "
        "tests/support/mpi/soak_worker.py N OUT.json`.",
        "",
        markdown_table(("MPI", "rank", "ring calls", "job wall (s)", "communicators open (start / end)",
                        "live KiB, first half", "live KiB, second half", "resident MiB (start / end)"),
                       rows, "lrrrrrrr"),
        "",
        f"Virtual ring (`reference.ring_attention`, 4 devices as threads, 64 tokens, every layout with the "
        f"same masks but padding, forward and backward), one process: {virtual['calls']} calls in "
        f"{virtual['seconds']:.0f} s; threads alive {s['threads']} at the start, {m['threads']} half-way, "
        f"{e['threads']} at the end; live memory {_kib(s, m)} KiB in the first half, {_kib(m, e)} KiB in "
        "the second.",
    ]), []


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=QUICK_CALLS, help="ring calls per rank (default %(default)s)")
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error("--calls must be at least 1")
    text, _ = run(calls=args.calls, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
