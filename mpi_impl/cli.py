"""The command line: run the ring on MPI ranks for each layout and print what it cost.

    mpiexec -n 4 python -m mpi4py -m mpi_impl --layout all --check
    mpiexec -n 4 python -m mpi4py -m mpi_impl --layout all --check --seq-len 8192 --tile-size 256 --repeat 2   # make demo
    mpiexec -n 2 python -m mpi4py -m mpi_impl --seq-len 8192 --backward --plot timeline.png
    mpiexec -n 4 python -m mpi4py -m mpi_impl --seq-len 3000 --doc-lengths 2000,125x8 --check   # packed documents
    mpiexec -n 4 python -m mpi4py -m mpi_impl --window 256 --dropout 0.1 --backward --check
    mpiexec -n 4 python -m mpi4py -m mpi_impl --scheme usp --ulysses-degree 2 --ranks-per-node 2 \
        --intra 1 --inter 0.1 --inter-latency-us 50 --placement ring-in-nodes --backward   # emulated nodes

Every rank makes its own shard of random q, k, v (chunk by chunk from a seed;
only --check builds the whole sequence, on rank 0: `mpi_impl.check`), runs
`ring_attention` (and with ``--backward`` `ring_attention_backward`) for each
layout, on that layout's plan (resolved once, at the start: `mpi_impl.plan`),
and rank 0 prints one row per layout (`mpi_impl.table`):

  max error     with --check: against the float64 reference, scaled by max(1, |ref|)
  critical path sum over rounds of the busiest rank's CPU time in the step
                (`compute_cpu_s`): what the run costs when every rank has a core
  wall          slowest rank, best of --repeat, after one untimed warm-up run
  wall speedup  contiguous over this layout in wall-clock time (crit. speedup: in critical path)
  predicted     the cost model's speedup (`reference.cost`, "tiles", same tile size)

With more ranks than cores, wall time measures the scheduler; read the critical
path. Ranks share the machine's cores (`mpi_impl.cores`, docs/mpi.md); --threads
and --blas-threads choose within a rank's share; the first line says what ran.

Another backend reuses the command line with a `Backend` of its own, whose
forward and backward take this package's keyword arguments (`gpu_impl.__main__`:
``main(parser=build_parser(prog=...), backend=lambda args: Backend("cupy", fwd, bwd, ...))``).
`reference.trace.read_trace` reads --trace-out; `reference.plot.plot_timeline` draws --plot.
"""

import argparse
import functools
import resource
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from reference import LAYOUTS, steps, usage
from reference.inputs import make_shard
from reference.masks import make_mask

from .attention import gather_trace, ring_attention, ring_attention_backward
from .check import Checker
from .comm import RingComm
from .cores import crowded, rank_share, wait_quietly
from .groups import placed
from .links import EmulatedLinks
from .plan import make_plans, mask_options
from .ranks import abort_job
from .scheme_args import (add_scheme_options, choice, emulated, nodes_problem, predicted_speedup, scheme_of,
                          scheme_problem)
from .table import Row, largest, output_problem, report, wait_fraction

DTYPES = ("float16", "bfloat16", "float32", "float64")


def _same(x):
    return x


def _nothing():
    pass


@dataclass(frozen=True)
class Backend:
    """What the command line needs from a backend: its two ring functions (the
    signatures of `mpi_impl.ring_attention` and `ring_attention_backward`, with
    ``trace="rank"`` returning this rank's RoundLog), a NumPy -> backend array
    conversion and back, and a way to wait for queued work before reading a clock."""
    name: str
    ring_attention: Callable
    ring_attention_backward: Callable
    to_device: Callable = _same
    to_host: Callable = _same
    synchronize: Callable = _nothing
    array_module: object = np           # what `--step auto` chooses for
    busy: str = "compute_cpu_s"         # the RoundLog time the critical path sums (a GPU's: compute_s)


NUMPY = Backend("numpy", ring_attention, ring_attention_backward)
WAITS = ("auto", "quiet", "spin")


def build_parser(prog="mpiexec -n N python -m mpi4py -m mpi_impl", description=None):
    ap = argparse.ArgumentParser(prog=prog, description=description or __doc__.split("\n\n")[0],
                                 formatter_class=usage.Help)
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens S, all ranks together")
    ap.add_argument("--batch", type=int, default=1, help="batch B")
    ap.add_argument("--heads", type=int, default=4, help="query heads Hq")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads Hkv (default: Hq, as --heads)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dim D")
    ap.add_argument("--dtype", choices=DTYPES, default="float32", help="q, k, v dtype (float16 and bfloat16 accumulate in float32)")
    ap.add_argument("--tile-size", type=tile_arg, default=128,
                    help="tile side T (T queries by T keys), or TQxTK for a rectangle")
    ap.add_argument("--backward-tile-size", type=tile_arg, default=None, metavar="TILE_SIZE",
                    help="the backward's tile, where it differs (a fused forward's own tile, a large one behind it)")
    ap.add_argument("--layout", choices=LAYOUTS + ("all",), default="all", help="how tokens are dealt to ranks; all: each in turn")
    ap.add_argument("--step", choices=steps.names(), default="auto",
                    help="block step version (reference.steps): auto is the fastest validated one for the arrays")
    ap.add_argument("--threads", type=int, default=None,
                    help="worker threads per rank (at least 1), for steps that take them (v3, v4, v5); default: "
                         "the rank's share of its machine's cores (mpi_impl.cores), never more than its own limit")
    ap.add_argument("--blas-threads", type=int, default=None,
                    help="BLAS threads per product (default: the rank's share of the cores; 1 with workers)")
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                    help="causal mask (--no-causal: every key visible)")
    ap.add_argument("--window", type=int, default=None,
                    help="sliding window W: a query sees the previous W tokens, itself included")
    docs = ap.add_mutually_exclusive_group()
    docs.add_argument("--cu-seqlens", type=_int_list, default=None, metavar="0,L0,L0+L1,...,S",
                      help="packed documents: their boundaries (flash-attn's cu_seqlens), from 0 to --seq-len")
    docs.add_argument("--doc-lengths", type=_lengths, default=None, metavar="L,LxK,...",
                      help="packed documents by length, LxK meaning K documents of L tokens; "
                           "they must add up to --seq-len (e.g. 2048,128x16)")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="attention dropout probability, keyed on --seed and global positions")
    ap.add_argument("--backward", action="store_true", help="also run the backward pass")
    ap.add_argument("--check", action="store_true",
                    help="compare with the reference on rank 0: the dense formula up to S = 2048, the NumPy "
                         "ring on one virtual device beyond; "
                         "exit 1 above the dtype's tolerance")
    ap.add_argument("--repeat", type=int, default=1, help="runs per layout: the fastest wall time is reported, and the "
                         "critical path takes each round and rank's least CPU time")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="one untimed run first, so that the first layout timed does not pay for "
                         "imports, BLAS start-up and first-touch page faults")
    ap.add_argument("--trace-out", metavar="FILE.json", help="write every rank's per-round trace")
    ap.add_argument("--plot", metavar="FILE.png", help="draw the per-rank, per-round timeline")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random q, k, v (and of dropout)")
    ap.add_argument("--waits", choices=WAITS, default="auto",
                    help="how a rank waits for a block: quiet (tested with a short sleep, leaving the cores to "
                         "the ranks that compute), spin (in MPI's wait), auto (quiet when the ranks on this "
                         "machine outnumber its cores); NumPy backend only")
    add_scheme_options(ap)
    return ap


def _int_list(text):
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _lengths(text):
    """'2048,128x16' -> [2048, 128, 128, ...]."""
    try:
        out = []
        for part in text.split(","):
            length, _, count = part.partition("x")
            out += [int(length)] * (int(count) if count else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected lengths like 2048,128x16, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"document lengths must be positive, got {text!r}")
    return out


def main(argv=None, backend=NUMPY, parser=None):
    """Parse, run every layout, print the table on rank 0; returns the exit status.
    `backend` is a Backend, or a function of the parsed arguments returning one
    (for options a backend adds to `parser`, such as a transfer path)."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if not isinstance(backend, Backend):
        backend = backend(args)
    problem = backend_problem(args, backend) or check_args(args, comm.Get_size(), backend)
    if not problem:
        try:
            plans = make_plans(args, backend, comm.Get_size())      # each layout's run, resolved once
        except ValueError as e:
            problem = str(e)
    if problem:                 # every rank finds the same problem; one of them says it
        if comm.Get_rank() == 0:
            parser.print_usage(sys.stderr)
            print(f"{parser.prog}: error: {problem}", file=sys.stderr)
        return 2
    comm, backend = ring_over(args, comm, backend)
    try:
        with hold_share(args, plans, comm):
            rows, checker = run(args, plans, backend, comm)
        status = report(rows, args, comm, backend, checker, choice(rows, args, comm, mask_options(args))) if comm.Get_rank() == 0 else 0
    except Exception:           # noqa: BLE001 - printed with this rank's name, then the job ends
        abort_job(comm)
        raise                   # where Abort returns (a stand-in communicator)
    # every rank exits with rank 0's verdict: a failed check fails the job
    # whichever rank's exit status the launcher passes on; the others sleep
    # while rank 0 prints, writes and draws
    wait_quietly(comm)
    return comm.bcast(status, root=0)


def ring_over(args, comm, backend):
    """(communicator, backend) of the run: on emulated nodes, the placed
    communicator (scheme rank g on world rank order[g], `mpi_impl.groups.placed`)
    and rings over the emulated links (`mpi_impl.links`); with --waits quiet or
    spin, rings that wait so; else as they came."""
    machine, where = emulated(args, scheme_of(args, comm.Get_size()))
    links = None
    if machine is not None:
        links = EmulatedLinks(machine, comm.Get_rank())
        comm = placed(comm, where)
    if backend is NUMPY and (args.waits != "auto" or links is not None):
        quiet = None if args.waits == "auto" else args.waits == "quiet"
        make_ring = functools.partial(RingComm.on, quiet=quiet, links=links)
        backend = replace(NUMPY, ring_attention=functools.partial(ring_attention, make_ring=make_ring),
                          ring_attention_backward=functools.partial(ring_attention_backward, make_ring=make_ring))
    return comm, backend


def hold_share(args, plans, comm):
    """This rank's share of its machine's cores (`mpi_impl.cores.rank_share`),
    within the rank's own budget (OPENBLAS_NUM_THREADS included): sets
    --threads and --blas-threads where not given, gives the plans' steps that
    take workers that many, and returns the hold to run inside."""
    share = rank_share(comm, takes_workers=plans[0].forward.step.takes_workers, threads=args.threads,
                       blas_threads=args.blas_threads)
    args.threads, args.blas_threads = share.workers, share.blas
    for step in {call.step for plan in plans for call in (plan.forward, plan.backward) if call is not None}:
        if step.takes_workers:
            step.workers = share.workers            # the plan's own steps (`make_steps`)
    args.quiet_waits = crowded(comm) if args.waits == "auto" else args.waits == "quiet"   # as RingComm.on decides
    return share.held()


def check_args(args, n_ranks, backend=NUMPY):
    """A message for options that cannot run on n_ranks of `backend`, or None."""
    for name in ("seq_len", "batch", "heads", "head_dim", "repeat", "threads", "blas_threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    problem = scheme_problem(args, n_ranks) or nodes_problem(args, n_ranks)
    if problem:
        return problem
    if args.kv_heads is not None and (args.kv_heads < 1 or args.heads % args.kv_heads):
        return f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})"
    if args.doc_lengths is not None and sum(args.doc_lengths) != args.seq_len:
        return f"--doc-lengths add up to {sum(args.doc_lengths)} tokens, not --seq-len {args.seq_len}"
    try:
        make_mask(causal=args.causal, seq_len=args.seq_len, **mask_options(args))
    except (TypeError, ValueError) as e:          # the reference's words, with the options' names
        for name in ("window", "cu_seqlens", "dropout", "seed"):
            e = str(e).replace(f"{name} must", f"--{name.replace('_', '-')} must")
        return str(e)
    for option, path in (("--trace-out", args.trace_out), ("--plot", args.plot)):
        problem = output_problem(option, path)
        if problem:
            return problem
    return None


def backend_problem(args, backend):
    """A message for options this backend cannot run, or None."""
    if args.dtype == "bfloat16" and backend.array_module is not np:
        return f"--dtype bfloat16 is NumPy's (ml_dtypes); the {backend.name} backend has no bfloat16 arrays"
    if args.waits != "auto" and backend.array_module is not np:
        return f"--waits {args.waits} is the NumPy backend's; the {backend.name} backend waits as RingComm.on decides"
    if args.ranks_per_node is not None and backend.array_module is not np:
        return f"--ranks-per-node: emulated nodes are the NumPy backend's, not the {backend.name} backend's"
    return None


def tile_arg(text):
    """--tile-size: "128" -> 128, "64x32" -> (64, 32) (queries x keys)."""
    parts = text.lower().split("x")
    if len(parts) > 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected a tile side T >= 1 or TQxTK, got {text!r}")
    return int(parts[0]) if len(parts) == 1 else (int(parts[0]), int(parts[1]))


def run(args, plans, backend, comm):
    """Run every layout's plan; return (the rows on rank 0, None elsewhere; the Checker)."""
    checker = Checker(args, inputs, mask_options)
    if args.warmup:
        say(comm, f"warm-up: one untimed run of {plans[0].layout} ...")
        time_passes(args, plans[0], backend, comm)
    rows = [run_layout(args, plan, backend, comm, checker) for plan in plans]
    return (rows if comm.Get_rank() == 0 else None), checker


def say(comm, text):
    """A progress line from rank 0, on stderr (the table is stdout's)."""
    if comm.Get_rank() == 0:
        print(text, file=sys.stderr, flush=True)


# -- one layout --------------------------------------------------------------

def shapes(args):
    hkv = args.kv_heads or args.heads
    B, S, D = args.batch, args.seq_len, args.head_dim
    return (B, S, args.heads, D), (B, S, hkv, D)


def inputs(args, pos):
    """q, k, v, dout for the tokens at `pos`, NumPy."""
    sq, skv = shapes(args)
    return tuple(make_shard(args.seed, i, s, pos, args.dtype) for i, s in enumerate((sq, skv, skv, sq)))


@dataclass
class Timed:
    """One timed run of the passes, on this rank."""
    wall_s: float       # the slowest rank's
    out: object
    lse: object
    grads: object       # (dq, dk, dv), or None without --backward
    logs: dict          # "forward" (and "backward") -> this rank's RoundLog


def time_passes(args, plan, backend, comm):
    """One timed run of the forward (and backward) pass of a layout's `plan`."""
    q, k, v, dout = (backend.to_device(x) for x in inputs(args, plan.positions[comm.Get_rank()]))
    wait_quietly(comm)          # ranks still busy (rank 0's check) are waited for asleep,
    comm.Barrier()              # then every rank starts the clock together
    start = time.perf_counter()
    out, lse, fwd_log = backend.ring_attention(q, k, v, comm=comm, call=plan.forward, trace="rank")
    grads, logs = None, {"forward": fwd_log}
    if plan.backward is not None:
        *grads, logs["backward"] = backend.ring_attention_backward(q, k, v, out, lse, dout, comm=comm,
                                                                   call=plan.backward, trace="rank")
    backend.synchronize()
    wall = comm.allreduce(time.perf_counter() - start, op=_max())
    return Timed(wall, out, lse, grads, logs)


def run_layout(args, plan, backend, comm, checker):
    """--repeat timed runs of a layout's `plan`: on rank 0 its Row, None elsewhere."""
    best, least = None, {}
    for _ in range(args.repeat):
        timed = time_passes(args, plan, backend, comm)
        best = timed if best is None or timed.wall_s < best.wall_s else best   # one run's arrays held, not all
        for kind, log in timed.logs.items():
            busy = getattr(log, backend.busy)
            least[kind] = np.minimum(least.get(kind, busy), busy)
    # The critical path takes the max over ranks of each round's CPU time, and a
    # max of noisy times is biased upwards, most for balanced layouts whose ranks
    # are all near it: each (round, rank) keeps its least CPU time over the repeats.
    traces = {kind: _least_times(gather_trace(log, comm), least[kind], backend.busy, comm)
              for kind, log in best.logs.items()}
    errors = checker.errors(plan.positions, comm, backend, best.out, best.lse, best.grads) if args.check else {}
    wait_quietly(comm)          # the others sleep while rank 0 computes the reference
    rss = comm.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    if comm.Get_rank() != 0:
        return None
    return Row(layout=plan.layout, wall_s=best.wall_s, error=largest(errors.values()), errors=errors, traces=traces,
               peak_rss_kb=rss, critical_cpu_s=sum(t.critical_path(backend.busy) for t in traces.values()),
               wait_fraction=wait_fraction(traces.values()),
               predicted=predicted_speedup(args, plan.scheme, plan.layout, mask_options(args)), scheme=plan.scheme)


def _least_times(trace, least, busy, comm):
    """The best run's Trace with its `busy` times, [t, j], replaced by every
    rank's least over the repeats (`least`, this rank's, (N rounds,)). Collective."""
    return replace(trace, **{busy: np.stack(comm.allgather(least), axis=1)})


def _max():
    from mpi4py import MPI
    return MPI.MAX
