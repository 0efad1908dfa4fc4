"""Train the model on the copy task, over MPI ranks or a virtual ring, and draw the loss curve.

    mpiexec -n 2 python -m mpi4py -m model                       # what `make train` runs
    python -m model --n-devices 4 --layout all --steps 40         # virtual ring, every layout
    python -m model --help

Under `python -m mpi4py` each rank is one device of the ring (`mpi_impl`); otherwise
N virtual devices run in this process (`reference.ring_attention`), or, with
`--backend dense`, the whole sequence goes through `reference.attention`. Rank 0
prints a progress line, the final table, and writes the curve (PNG) and the losses
(.npz). With `--layout all` every layout trains in turn from the same start, and the
largest difference between their curves is printed.
"""

import argparse
import sys
import time

from contextlib import nullcontext

import numpy as np

import reference
from reference import usage
from mpi_impl.cores import rank_share, wait_quietly

from . import train, transformer


def parse_args(argv=None):
    """The options, checked before any work: a usage error names the option."""
    ap = argparse.ArgumentParser(prog="python -m model", description=__doc__.split("\n\n")[0],
                                 formatter_class=usage.Help)
    ap.add_argument("--backend", choices=("auto", "mpi", "virtual", "dense"), default="auto",
                    help="auto: mpi when run as `python -m mpi4py -m model`, else virtual")
    ap.add_argument("--n-devices", type=usage.count, default=2, help="virtual devices (virtual backend)")
    ap.add_argument("--layout", choices=(*reference.LAYOUTS, "all"), default="striped",
                    help="how tokens are dealt to devices; all: each in turn, from the same start")
    ap.add_argument("--steps", type=usage.count, default=300, help="Adam steps")
    ap.add_argument("--seq-len", type=usage.count, default=256, help="tokens per sequence S")
    ap.add_argument("--batch", type=usage.count, default=4, help="sequences per step B")
    ap.add_argument("--period", type=usage.count, default=32, help="copy task: length of the repeated block")
    ap.add_argument("--vocab", type=usage.count, default=16, help="vocabulary V (copy task: random tokens)")
    ap.add_argument("--d-model", type=usage.count, default=64, help="model width d")
    ap.add_argument("--heads", type=usage.count, default=4, help="attention heads H (head dim d / H, even)")
    ap.add_argument("--layers", type=usage.count, default=2, help="transformer blocks L")
    ap.add_argument("--d-ff", type=usage.count, default=256, help="MLP hidden width f")
    ap.add_argument("--lr", type=usage.rate, default=3e-3, help="Adam learning rate (after 20 warm-up steps)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                    help="parameters and activations; float64 makes the layouts' curves equal to 1e-15")
    ap.add_argument("--tile-size", type=usage.count, default=None, help="the ring's tile size (default: the kernel's)")
    ap.add_argument("--seed", type=usage.natural, default=0, help="parameters and batches")
    ap.add_argument("--plot", type=usage.output_file, default="train_loss.png", help="loss curve picture ('' for none)")
    ap.add_argument("--out", type=usage.output_file, default="train_loss.npz",
                    help="the loss curves, an array per layout ('' for none)")
    args = ap.parse_args(argv)
    if args.period >= args.seq_len:
        ap.error(f"--period ({args.period}) must be less than --seq-len ({args.seq_len}): "
                 "a token can be predicted only from an earlier copy")
    if args.d_model % args.heads or (args.d_model // args.heads) % 2:
        ap.error(f"--d-model ({args.d_model}) must be --heads ({args.heads}) times an even head dim")
    return args


def make_replica(args, config, layout, comm):
    opts = dict(ignore_first=args.period - 1)
    if comm is not None:
        return train.mpi(config, comm, layout, tile_size=args.tile_size, **opts)
    if args.backend == "dense":
        return train.dense(config, **opts)
    return train.virtual(config, args.n_devices, layout, tile_size=args.tile_size, **opts)


def main(argv=None):
    args = parse_args(argv)
    comm = None
    if args.backend == "mpi" or (args.backend == "auto" and "mpi4py" in sys.modules):
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    rank = comm.Get_rank() if comm is not None else 0
    n = comm.Get_size() if comm is not None else (1 if args.backend == "dense" else args.n_devices)
    config = transformer.Config(vocab=args.vocab, d_model=args.d_model, n_head=args.heads,
                                n_layer=args.layers, d_ff=args.d_ff)
    layouts = reference.LAYOUTS if args.layout == "all" else (args.layout,)
    for layout in layouts:       # the model shards S as it is: no padding, so S must split into the shards
        unit = reference.layouts.unit(n, layout)
        if args.seq_len % unit:
            raise SystemExit(f"python -m model: error: sequence length {args.seq_len} must be a positive "
                             f"multiple of {'2 * ' if layout == 'zigzag' else ''}n_devices = {unit} for {layout}")
    backend = "mpi" if comm is not None else args.backend if args.backend == "dense" else "virtual"
    if rank == 0:
        print(f"model: {config.as_dict()}, {args.dtype}\ntask: copy a block of {args.period} tokens, "
              f"B={args.batch}, S={args.seq_len}; {backend}, N={n}; {args.steps} Adam steps, lr {args.lr}")
    # each rank holds BLAS (its layers' products and the ring's steps) to its share of the machine's cores
    with rank_share(comm).held() if comm is not None else nullcontext():
        curves, times = run_layouts(args, config, layouts, comm, rank)
    if rank == 0:
        report(args, curves, times, n, backend)
    if comm is not None:
        wait_quietly(comm)          # the others sleep while rank 0 writes the curves and draws them


def run_layouts(args, config, layouts, comm, rank):
    """Train each layout from the same start: ({layout: losses}, {layout: (total s, median step s, ring s)})."""
    curves, times = {}, {}
    for layout in layouts:
        replica = make_replica(args, config, layout, comm)
        params = transformer.init_params(config, args.seed, np.dtype(args.dtype))
        progress = train.Progress(f"{layout:<10} ") if rank == 0 else None
        start = time.perf_counter()
        curves[layout], seconds = train.train(replica, params, steps=args.steps, batch=args.batch,
                                              seq_len=args.seq_len, period=args.period, lr=args.lr,
                                              seed=args.seed, progress=progress)
        times[layout] = (time.perf_counter() - start, np.median(seconds), replica.attn.seconds)
    return curves, times


def report(args, curves, times, n, backend):
    print(f"\n{'layout':<11} {'first loss':>10} {'last loss':>10} {'total':>8} {'median step':>12} {'attention':>10}")
    for layout, losses in curves.items():
        total, median, attn = times[layout]
        print(f"{layout:<11} {losses[0]:>10.4f} {losses[-1]:>10.4f} {total:>7.1f}s {median * 1e3:>10.1f}ms "
              f"{attn / total:>9.0%}")
    print(f"attention: share of the run's wall time inside the ring (forward + backward); "
          f"log(V) = {np.log(args.vocab):.4f}")
    if len(curves) > 1:
        first = next(iter(curves.values()))
        worst = max(np.abs(c - first).max() for c in curves.values())
        print(f"largest difference between the layouts' loss curves: {worst:.2e}")
    if args.out:
        np.savez(args.out, **curves)
        print(f"wrote {args.out}")
    if args.plot:
        title = f"Copy task, S={args.seq_len}, {backend} N={n}, {args.dtype}"
        train.plot_losses({f"{layout}, N={n}": c for layout, c in curves.items()}, args.plot, title)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
