"""The command line: run the ring on MPI ranks for each layout and print what it cost.

    mpiexec -n 4 python -m mpi4py -m mpi_impl --layout all --check
    mpiexec -n 4 python -m mpi4py -m mpi_impl --layout all --check --seq-len 8192 --tile-size 256 --repeat 2   # make demo
    mpiexec -n 2 python -m mpi4py -m mpi_impl --seq-len 8192 --backward --plot timeline.png
    mpiexec -n 4 python -m mpi4py -m mpi_impl --seq-len 3000 --doc-lengths 2000,125x8 --check   # packed documents
    mpiexec -n 4 python -m mpi4py -m mpi_impl --window 256 --dropout 0.1 --backward --check

Every rank makes its own shard of random q, k, v (chunk by chunk from a seed;
only --check builds the whole sequence, on rank 0), runs `ring_attention` (and with ``--backward``
`ring_attention_backward`) for each layout, and rank 0 prints one row per layout:

  max error     with --check: rank 0 gathers the shards and compares with the
                reference (`reference.attention`, or for S > 2048 the NumPy ring on
                one virtual device), scaled by max(1, |ref|)
  critical path sum over rounds of the busiest rank's CPU time in the step
                (`compute_cpu_s`): what the run costs when every rank has a core
  wall          slowest rank, best of --repeat, after one untimed warm-up run
  wall speedup  contiguous over this layout in wall-clock time (crit. speedup: in critical path)
  predicted     the cost model's speedup (`reference.cost`, "tiles", same tile size)

With more ranks than cores, wall time measures the scheduler; read the critical
path. The ranks on one machine share its cores (`reference.cores`): each holds
BLAS (threadpoolctl) to its share, one thread with more ranks than cores or with
worker threads, whatever OPENBLAS_NUM_THREADS says; --threads and --blas-threads
choose otherwise, and the table's first line says what ran.

Another backend reuses the command line with a `Backend` of its own:

    from mpi_impl.cli import Backend, build_parser, main
    parser = build_parser(prog="mpiexec -n N python -m mpi4py -m gpu_impl")
    parser.add_argument("--transfer", choices=("staged", "cuda-aware"), default="staged")
    sys.exit(main(parser=parser, backend=lambda args: Backend("cupy", fwd, bwd, to_device=cupy.asarray,
                                                               to_host=cupy.asnumpy, synchronize=sync)))

with ``fwd``, ``bwd`` taking this package's keyword arguments (``comm``,
``layout``, ``causal``, ``tile_size``, ``trace="rank"``), e.g.
``functools.partial(mpi_impl.ring_attention, make_ring=...)``. What it writes
is read with the library: `reference.trace.read_trace` (--trace-out), and
`reference.plot.plot_timeline` draws --plot; the random shards are
`reference.inputs.make_shard`.
"""

import argparse
import resource
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import numpy as np

from reference import LAYOUTS, attention, attention_backward, cores, cost, positions, steps, unshard
from reference import ring_attention as reference_ring
from reference import ring_attention_backward as reference_ring_backward
from reference.inputs import make_shard
from reference.masks import cu_seqlens_from_lengths, layout_mask, make_mask
from reference.plot import plot_timeline
from reference.testing.compare import TOL
from reference.trace import write_trace

from .attention import gather_trace, ring_attention, ring_attention_backward

DTYPES = ("float16", "bfloat16", "float32", "float64")
DENSE_MAX_SEQ = 2048     # --check uses the dense S x S formula up to here


def check_tolerance(dtype):
    """--check fails above this error, scaled by max(1, |reference|): the
    project's tolerance table (`reference.testing.TOL`) allows |actual -
    expected| <= atol max(1, |expected|) + rtol |expected|, so atol + rtol."""
    tol = TOL[np.dtype(dtype)]
    return tol.atol + tol.rtol


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


def build_parser(prog="mpiexec -n N python -m mpi4py -m mpi_impl", description=None):
    ap = argparse.ArgumentParser(prog=prog, description=description or __doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens S, all ranks together")
    ap.add_argument("--batch", type=int, default=1, help="batch B")
    ap.add_argument("--heads", type=int, default=4, help="query heads Hq")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads Hkv (default: Hq, as --heads)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dim D")
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--tile-size", type=tile_arg, default=128,
                    help="tile side T (T queries by T keys), or TQxTK for a rectangle")
    ap.add_argument("--layout", choices=LAYOUTS + ("all",), default="all")
    ap.add_argument("--step", choices=steps.names(), default="auto",
                    help="block step version (reference.steps): auto is the fastest validated one for the arrays")
    ap.add_argument("--threads", type=int, default=None,
                    help="worker threads per rank, for steps that take them (v3, v4, v5) (default: the rank's share "
                         "of this machine's cores, reference.cores)")
    ap.add_argument("--blas-threads", type=int, default=None,
                    help="BLAS threads per product (default: the rank's share of the cores; 1 with workers)")
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
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
    ap.add_argument("--seed", type=int, default=0)
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


def mask_options(args):
    """The mask keyword arguments of the ring functions, from the parsed options."""
    cu = args.cu_seqlens
    if args.doc_lengths is not None:
        cu = cu_seqlens_from_lengths(args.doc_lengths).tolist()
    return dict(window=args.window, cu_seqlens=cu, dropout=args.dropout, seed=args.seed)


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
    if problem:                 # every rank finds the same problem; one of them says it
        if comm.Get_rank() == 0:
            parser.print_usage(sys.stderr)
            print(f"{parser.prog}: error: {problem}", file=sys.stderr)
        return 2
    try:
        with hold_share(args, backend, comm):
            rows = run(args, backend, comm)
        status = report(rows, args, comm, backend) if comm.Get_rank() == 0 else 0
    except Exception:           # noqa: BLE001 - printed with this rank's name, then the job ends
        abort_job(comm)
        raise                   # where Abort returns (a stand-in communicator)
    # every rank exits with rank 0's verdict: a failed check fails the job
    # whichever rank's exit status the launcher passes on
    return comm.bcast(status, root=0)


def hold_share(args, backend, comm):
    """This rank's share of its machine's cores (`reference.cores`), shared
    with the ranks on the same machine: sets --threads and --blas-threads
    where not given, and returns the BLAS hold to run inside."""
    from mpi4py import MPI
    here = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_here = here.Get_size()
    here.Free()
    step = make_steps(args, backend, comm.Get_size())[0]
    share = cores.share(ranks_here, takes_workers=step.takes_workers, threads=args.threads,
                        blas_threads=args.blas_threads)
    args.threads, args.blas_threads = share.workers, share.blas
    return share.held()


def report(rows, args, comm, backend):
    """Rank 0: print the table, write the trace and the plot; the exit status
    (1 if --check found an error above the tolerance, or NaN)."""
    print(format_table(rows, args, comm.Get_size(), backend.name, busy=backend.busy))
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


def abort_job(comm):
    """End every rank because this one failed, saying which rank and why. Run
    without ``-m mpi4py``, the other ranks would otherwise wait for it forever."""
    import traceback
    from .comm import rank_name
    print(f"{rank_name(comm)} of {comm.Get_size()} failed; ending the job:", file=sys.stderr)
    traceback.print_exc()
    sys.stderr.flush()
    comm.Abort(1)


def check_args(args, n_ranks, backend=NUMPY):
    """A message for options that cannot run on n_ranks of `backend`, or None."""
    for name in ("seq_len", "batch", "heads", "head_dim", "repeat", "threads", "blas_threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if args.kv_heads is not None and (args.kv_heads < 1 or args.heads % args.kv_heads):
        return f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})"
    if args.doc_lengths is not None and sum(args.doc_lengths) != args.seq_len:
        return f"--doc-lengths add up to {sum(args.doc_lengths)} tokens, not --seq-len {args.seq_len}"
    try:
        mask = make_mask(causal=args.causal, seq_len=args.seq_len, **mask_options(args))
    except (TypeError, ValueError) as e:          # the reference's words, with the options' names
        for name in ("window", "cu_seqlens", "dropout"):
            e = str(e).replace(f"{name} must", f"--{name.replace('_', '-')} must")
        return str(e)
    try:                                          # the library's step rules, for this call
        make_steps(args, backend, n_ranks)
    except ValueError as e:
        return f"--step {args.step}: {e}"
    return None


def backend_problem(args, backend):
    """A message for options this backend cannot run, or None."""
    if args.dtype == "bfloat16" and backend.array_module is not np:
        return f"--dtype bfloat16 is NumPy's (ml_dtypes); the {backend.name} backend has no bfloat16 arrays"
    return None


def tile_arg(text):
    """--tile-size: "128" -> 128, "64x32" -> (64, 32) (queries x keys)."""
    parts = text.lower().split("x")
    if len(parts) > 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected a tile side T >= 1 or TQxTK, got {text!r}")
    return int(parts[0]) if len(parts) == 1 else (int(parts[0]), int(parts[1]))


def make_steps(args, backend, n_ranks):
    """(forward Step, backward Step) for --step and --threads, as
    `reference.steps.check_step` finds them for this call (its ValueError
    where the step cannot take it): "auto" from what the call is (float16 on
    CuPy: the tensor-core kernel where it takes the call); a step without a
    backward (the fused kernels) leaves the backward to "auto"."""
    xp = backend.array_module
    call = steps.Call(args.dtype, args.head_dim, args.heads // (args.kv_heads or args.heads), args.tile_size)
    masks = [layout_mask(args.seq_len, n_ranks, layout, causal=args.causal, **mask_options(args))
             for layout in _layouts(args)]
    rules = dict(dropout=bool(args.dropout), plain_mask=all(m.causal_only for m in masks), call=call)
    forward = steps.check_step(args.step, xp, **rules)
    if args.threads and args.threads > 1 and forward.takes_workers:
        forward = steps.get(forward.name, workers=args.threads)
    backward = forward if forward.has_backward else steps.check_step("auto", xp, backward=True, **rules)
    return forward, backward


def _layouts(args):
    return LAYOUTS if args.layout == "all" else (args.layout,)


def run(args, backend, comm):
    """Run every requested layout; return the rows on rank 0, None elsewhere."""
    if args.warmup:
        time_passes(args, _layouts(args)[0], backend, comm)
    rows = [run_layout(args, layout, backend, comm) for layout in _layouts(args)]
    return rows if comm.Get_rank() == 0 else None


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


def time_passes(args, layout, backend, comm):
    """One timed run of the forward (and backward) pass of `layout`."""
    n, rank = comm.Get_size(), comm.Get_rank()
    pos = positions(args.seq_len, n, layout)[rank]
    q, k, v, dout = (backend.to_device(x) for x in inputs(args, pos))
    opts = dict(comm=comm, layout=layout, causal=args.causal, tile_size=args.tile_size, seq_len=args.seq_len,
                **mask_options(args))
    fwd_step, bwd_step = make_steps(args, backend, n)
    comm.Barrier()
    start = time.perf_counter()
    out, lse, fwd_log = backend.ring_attention(q, k, v, trace="rank", step=fwd_step, **opts)
    grads, logs = None, {"forward": fwd_log}
    if args.backward:
        *grads, logs["backward"] = backend.ring_attention_backward(q, k, v, out, lse, dout, trace="rank",
                                                                   step=bwd_step, **opts)
    backend.synchronize()
    wall = comm.allreduce(time.perf_counter() - start, op=_max())
    return Timed(wall, out, lse, grads, logs)


def run_layout(args, layout, backend, comm):
    """--repeat timed runs of `layout`: on rank 0 its Row, None elsewhere."""
    n, rank = comm.Get_size(), comm.Get_rank()
    best, least = None, {}
    for _ in range(args.repeat):
        timed = time_passes(args, layout, backend, comm)
        best = timed if best is None or timed.wall_s < best.wall_s else best   # one run's arrays held, not all
        for kind, log in timed.logs.items():
            busy = getattr(log, backend.busy)
            least[kind] = np.minimum(least.get(kind, busy), busy)
    # The critical path takes the max over ranks of each round's CPU time, and a
    # max of noisy times is biased upwards, most for balanced layouts whose ranks
    # are all near it: each (round, rank) keeps its least CPU time over the repeats.
    traces = {kind: _least_times(gather_trace(log, comm), least[kind], backend.busy, comm)
              for kind, log in best.logs.items()}
    errors = check_errors(args, layout, comm, backend, best.out, best.lse, best.grads) if args.check else {}
    rss = comm.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    if rank != 0:
        return None
    return Row(layout=layout, wall_s=best.wall_s, error=_largest(errors.values()), errors=errors, traces=traces,
               peak_rss_kb=rss, critical_cpu_s=sum(t.critical_path(backend.busy) for t in traces.values()),
               wait_fraction=_wait_fraction(traces.values()),
               predicted=cost.speedup(args.seq_len, n, layout, args.tile_size, "tiles", args.causal,
                                      **mask_options(args)))


def _least_times(trace, least, busy, comm):
    """The best run's Trace with its `busy` times, [t, j], replaced by every
    rank's least over the repeats (`least`, this rank's, (N rounds,)). Collective."""
    return replace(trace, **{busy: np.stack(comm.allgather(least), axis=1)})


def _max():
    from mpi4py import MPI
    return MPI.MAX


def _wait_fraction(traces):
    """Largest, over ranks, of (time waiting for transfers) / (time computing)."""
    wait = sum(t.wait_s.sum(axis=0) for t in traces)              # (N,)
    compute = sum(t.compute_s.sum(axis=0) for t in traces)
    return float((wait / np.maximum(compute, 1e-12)).max())


def _largest(errors):
    """The largest error; NaN if any is NaN, or if there is none (Python's max
    would skip a NaN that is not first, and pass a NaN result)."""
    errors = list(errors)
    return float(np.max(errors)) if errors else float("nan")


def check_errors(args, layout, comm, backend, out, lse, grads):
    """{"out", "lse" (and "dq", "dk", "dv"): error against the reference, scaled by
    max(1, |reference|), NaN if NaN} on rank 0, {} elsewhere. Collective."""
    mine = [backend.to_host(x) for x in (out, lse, *(grads or ()))]
    gathered = comm.gather(mine)
    if comm.Get_rank() != 0:
        return {}
    axes = [1, 2, 1, 1, 1]                   # sequence axis of out, lse, dq, dk, dv
    got = [unshard([g[i] for g in gathered], layout, axis=axes[i], seq_len=args.seq_len)
           for i in range(len(mine))]
    full = np.arange(args.seq_len)
    q, k, v, dout = (x.astype(np.float64) for x in inputs(args, full))   # the reference in float64
    forward, backward = _reference(args.seq_len)
    ref_out, ref_lse = forward(q, k, v, causal=args.causal, **mask_options(args))
    want = [ref_out, ref_lse]
    if grads is not None:
        want += backward(q, k, v, ref_out, ref_lse, dout, causal=args.causal, **mask_options(args))
    names = ("out", "lse", "dq", "dk", "dv")[:len(want)]
    # a result the backend did not return counts as wrong, never as checked
    return {name: _scaled_error(got[i], want[i]) if i < len(got) else float("inf") for i, name in enumerate(names)}


def _reference(seq_len):
    """The dense formula up to DENSE_MAX_SEQ tokens; beyond, where its S x S
    scores would not fit, the NumPy ring on one virtual device (tested against
    the dense formula), whose memory grows linearly with S."""
    if seq_len <= DENSE_MAX_SEQ:
        return attention, attention_backward
    return (partial(reference_ring, n_devices=1, layout="contiguous"),
            partial(reference_ring_backward, n_devices=1, layout="contiguous"))


def _scaled_error(actual, expected):
    """max |actual - expected| / max(1, max |expected|); NaN anywhere gives NaN,
    and a wrong shape gives inf (never a broadcast)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        return float("inf")
    return float(np.abs(actual - expected).max() / max(1.0, np.abs(expected).max()))


# -- output ------------------------------------------------------------------

def format_table(rows, args, n_ranks, backend_name="numpy", busy="compute_cpu_s"):
    """layout | max error | critical path | wall | speedups measured | predicted."""
    base = next((r for r in rows if r.layout == "contiguous"), None)
    passes = "forward+backward" if args.backward else "forward"
    ran = steps_ran(rows)
    lines = [f"{backend_name}: N={n_ranks} ranks, S={args.seq_len}, B={args.batch}, Hq={args.heads}, "
             f"Hkv={args.kv_heads or args.heads}, D={args.head_dim}, {args.dtype}, tile={args.tile_size}, "
             f"{mask_label(args)}, {passes}, best of {args.repeat}, {ran}, "
             f"{args.blas_threads} BLAS thread{'s' if args.blas_threads != 1 else ''} per product",
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
    return "\n".join(lines)


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
