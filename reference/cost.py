"""The cost model: each device's work in each round, predicted without attention.

For a layout, N devices, S tokens and a tile size, device j in round t holds
the block that started on device ``(j - t) mod N`` (Algorithm 1) and works on
the tiles of `reference.tiles` that are not skipped. Counting them gives the
same [t, j] arrays as a run's trace. The run's time is set by the busiest
device of each round, so

    critical path = sum over rounds t of max over devices j of work[t, j]
    speedup of a layout = critical path (contiguous) / critical path (layout)

with work counted two ways: ``"tiles"``, the area of the tiles computed (what
a tiled kernel costs, paper section 2.2.1), and ``"pairs"``, visible (query,
key) pairs only (element-exact skipping, the paper's Work(i, j) of section 2.2).
With pairs, striped's speedup tends to (2N - 1) / N as blocks grow.

Every mask of `reference.masks` is predicted the same way (a sliding window,
packed documents, padding of any S; dropout changes no work), and any dealing
of positions, not only the three layouts (`predict_positions`: e.g. each
document zig-zagged on its own, as some frameworks balance packed documents).

The paper's Theoretical Maximum Speedup (section 4) is in `reference.tms`. With
--scheme: a row per scheme and placement on a machine's nodes (`reference.topology`),
its time per pass, bytes over each link and peak K/V memory, and the choice.

    python -m reference.cost --seq-len 65536 --n-devices 8 --tile-size 512 --window 4096
    python -m reference.cost --scheme all --n-devices 16 --seq-len 262144 --machine h100-hdr
    python -m reference.cost --scheme all --n-devices 4 --ranks-per-node 2 --intra 450 --inter 25 --kv-heads 4
"""

import argparse
import numpy as np

from . import usage
from .layouts import LAYOUTS, positions
from .masks import layout_mask
from .predict import MODES, Prediction, predict_positions  # noqa: F401 (re-exported)
from .scheme_cost import (GB, GIB, SchemeCost, candidates, choose, key_seconds, placed,  # noqa: F401 (re-exported)
                          predict_scheme)
from .schemes import SCHEMES
from .tiles import tile_shape
from .topology import MACHINES, Machine, add_machine_options, machine_of
from .tms import HARDWARE, MODELS, paper_rows, theoretical_max_speedup  # noqa: F401 (re-exported)


def predict(seq_len, n_devices, layout="striped", tile_size=None, causal=True, **mask_options):
    """Per-round, per-device tiles and pairs for one ring pass (forward or backward:
    both visit the same tiles). `mask_options`: those of `reference.ring_attention`
    (window, cu_seqlens, segment_ids; dropout and seed are accepted and change nothing)."""
    mask = layout_mask(seq_len, n_devices, layout, causal=causal, **mask_options)
    return predict_positions(positions(seq_len, n_devices, layout), tile_size, mask)


def speedup(seq_len, n_devices, layout="striped", tile_size=None, mode="tiles", causal=True, **mask_options):
    """Predicted speedup of `layout` over contiguous (Ring Attention), for the same mask."""
    base = predict(seq_len, n_devices, "contiguous", tile_size, causal, **mask_options).critical_path(mode)
    return base / predict(seq_len, n_devices, layout, tile_size, causal, **mask_options).critical_path(mode)


def striped_limit(n_devices):
    """Element-exact striped speedup as blocks grow: (2N - 1) / N."""
    return (2 * n_devices - 1) / n_devices


def paper_work(i, j, c):
    """Paper section 2.2: striped work of query block i against key block j."""
    return c * (c + 1) // 2 if i >= j else c * (c - 1) // 2


def parse_args(argv=None):
    """The options, checked before any work: a usage error names the option."""
    ap = argparse.ArgumentParser(prog="python -m reference.cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=usage.count, default=None,
                    help="tokens S (default 4096, or the documents' total with --doc-lengths)")
    ap.add_argument("--n-devices", type=usage.count, default=4, help="devices N (default 4)")
    ap.add_argument("--tile-size", type=usage.count, default=None, help="tile size (default %(default)s: the kernel's)")
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                    help="causal mask (default; --no-causal: every key visible)")
    ap.add_argument("--window", type=usage.count, default=None, help="sliding window W (default: none)")
    ap.add_argument("--doc-lengths", type=_lengths, default=None,
                    metavar="L0,L1,...", help="packed documents, adding up to --seq-len")
    schemes = ap.add_argument_group("schemes (reference.scheme_cost): with --scheme, their table and the choice")
    schemes.add_argument("--scheme", default=None, metavar="NAME[,NAME...]|all",
                         help="tabulate these schemes (ring, all_gather, ulysses, usp: every degree the heads "
                              "allow; double_ring: every inner ring size) instead of the layouts; 'all' for every one")
    schemes.add_argument("--layout", default="striped", choices=LAYOUTS, help="layout of the ring (default striped)")
    schemes.add_argument("--batch", type=usage.count, default=1, help="batch B (default 1)")
    schemes.add_argument("--heads", type=usage.count, default=32, help="query heads Hq (default 32)")
    schemes.add_argument("--kv-heads", type=usage.count, default=8, help="key/value heads Hkv (default 8)")
    schemes.add_argument("--head-dim", type=usage.count, default=128, help="head dimension D (default 128)")
    schemes.add_argument("--dtype", default="float16", choices=("float16", "float32", "float64"),
                         help="input dtype (default float16; bfloat16 moves the same bytes)")
    schemes.add_argument("--link-gbs", type=usage.rate, default=None,
                         help="one link for every byte, GB/s each way (1 GB = 10^9 bytes; default 25: 200 Gb/s), "
                              "where no nodes are given below")
    schemes.add_argument("--tflops", type=usage.rate, default=None,
                         help="attention compute rate per device, TFLOP/s (default: the machine's, or 400)")
    schemes.add_argument("--memory-gib", type=usage.rate, default=None,
                         help="K/V memory a device may hold, GiB (1 GiB = 2^30 bytes; default: no limit)")
    add_machine_options(ap)
    args = ap.parse_args(argv)
    total = None if args.doc_lengths is None else sum(args.doc_lengths)
    if args.seq_len is None:
        args.seq_len = total or 4096
    elif total is not None and total != args.seq_len:
        ap.error(f"--doc-lengths add up to {total} tokens, not --seq-len {args.seq_len}")
    if args.heads % args.kv_heads:
        ap.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    try:                                    # the library's own checks, before any work
        layout_mask(args.seq_len, args.n_devices, args.layout, **mask_options(args))
        args.plans = None if args.scheme is None else scheme_plans(args)
        args.machine_used = machine_used(args)
    except ValueError as e:
        ap.error(usage.option_words(str(e), ("n_devices", "tile_size", "window")))
    return ap, args


def machine_used(args):
    """The Machine the options describe: nodes (--machine, or --ranks-per-node,
    --intra, --inter), or one link for every byte (--link-gbs, 25 GB/s by default)."""
    machine = machine_of(args)
    if machine is not None and args.link_gbs is not None:
        raise ValueError("--link-gbs is one link for every byte: give it alone, or nodes with --machine or "
                         "--ranks-per-node, --intra and --inter")
    return machine or Machine.one_link((args.link_gbs or 25.0) * GB)


def _lengths(text):
    """--doc-lengths: "100,200" -> [100, 200], each at least 1."""
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"expected document lengths of at least 1 like 100,200, got {text!r}")
    return lengths


def mask_options(args):
    """The mask keyword arguments of `predict` and `predict_scheme`, from the options."""
    mask = dict(causal=args.causal, window=args.window)
    if args.doc_lengths:
        mask["cu_seqlens"] = np.concatenate([[0], np.cumsum(args.doc_lengths)])
    return mask


def main(argv=None):
    ap, args = parse_args(argv)
    mask = mask_options(args)
    if args.scheme is not None:
        try:
            table = scheme_table(args, mask)
        except ValueError as e:             # no scheme fits in --memory-gib
            ap.error(str(e))
        print(table)
        return
    print(f"S={args.seq_len} N={args.n_devices} tile={tuple(tile_shape(args.tile_size))}"
          + "".join(f" {k}={v}" for k, v in (("window", args.window), ("documents", args.doc_lengths)) if v)
          + ("" if args.causal else " not causal"))
    print(f"{'layout':<11} {'crit. tiles':>12} {'crit. pairs':>12} {'speedup tiles':>14} {'speedup pairs':>14}")
    for layout in LAYOUTS:
        p = predict(args.seq_len, args.n_devices, layout, args.tile_size, **mask)
        s = [speedup(args.seq_len, args.n_devices, layout, args.tile_size, m, **mask) for m in MODES]
        print(f"{layout:<11} {p.critical_path('tiles'):>12} {p.critical_path('pairs'):>12} "
              f"{s[0]:>14.3f} {s[1]:>14.3f}")
    print(f"(2N-1)/N limit: {striped_limit(args.n_devices):.3f}")


def scheme_plans(args):
    """The Schemes --scheme names that run on --n-devices with --kv-heads, or ValueError."""
    n, Hkv = args.n_devices, args.kv_heads
    names = SCHEMES if args.scheme == "all" else tuple(x.strip() for x in args.scheme.split(","))
    unknown = [x for x in names if x not in SCHEMES]
    if unknown:
        raise ValueError(f"--scheme: {', '.join(unknown)} is not one of {', '.join(SCHEMES)} or all")
    plans = [s for s in candidates(n, args.heads, Hkv) if s.name in names]
    if not plans:
        raise ValueError(f"none of {', '.join(names)} runs on {n} devices with {args.heads} query heads and {Hkv} "
                         f"key/value heads (a Ulysses degree divides N and the query heads, and is a multiple or "
                         f"a divisor of the key/value heads; a double ring's inner ring divides N, 1 < w < N)")
    return plans


def scheme_table(args, mask):
    """The --scheme table: per scheme and placement, the busiest device's
    critical-path flops (forward), bytes sent over each link and peak K/V
    (forward and backward), and the predicted time of each pass; and the scheme
    and placement the machine and the compute rate pick."""
    n, Hq, Hkv, machine = args.n_devices, args.heads, args.kv_heads, args.machine_used
    shape = dict(B=args.batch, Hq=Hq, Hkv=Hkv, D=args.head_dim, dtype=args.dtype, tile_size=args.tile_size, **mask)
    costs = placed({s: tuple(predict_scheme(s, args.seq_len, args.layout, backward=b, **shape) for b in (False, True))
                    for s in args.plans}, machine)
    tflops = args.tflops or machine.tflops or 400.0
    rate = tflops * 1e12
    lines = [f"S={args.seq_len} N={n} B={args.batch} Hq={Hq} Hkv={Hkv} D={args.head_dim} {args.dtype} "
             f"{args.layout}, {tflops:g} TFLOP/s per device; {machine.describe(n)}",
             f"{'scheme':<12}{'u':>3}{'w':>3} {'placement':<14}{'rounds':>6}{'crit. GFLOP':>12}{'intra f+b':>11}"
             f"{'inter f+b':>11}{'peak K/V':>11}{'fwd ms':>11}{'bwd ms':>11}", "-" * 106]
    for (s, p), (fwd, bwd) in costs.items():
        on = {name: (fwd.link_bytes(machine, p)[name].sum(axis=0) + bwd.link_bytes(machine, p)[name].sum(axis=0)).max()
              for name in ("intra", "inter")}
        peak = max(fwd.totals()["peak_kv"], bwd.totals()["peak_kv"])
        lines.append(f"{s.name:<12}{s.u:>3}{s.w or '-':>3} {p.name:<14}{s.r:>6}{fwd.totals()['critical_flops'] / 1e9:>12.1f}"
                     f"{_size(on['intra']):>11}{_size(on['inter']):>11}{_size(peak):>11}"
                     f" {fwd.seconds(machine, rate, p) * 1e3:>10.3f} {bwd.seconds(machine, rate, p) * 1e3:>10.3f}")
    memory = None if args.memory_gib is None else args.memory_gib * GIB
    best, where = choose(costs, machine, rate, memory)
    lines.append(f"choice: {best.name}" + (f" (ulysses_degree={best.u})" if best.u > 1 else "")
                 + (f" (ring_inner={best.w})" if best.w else "")
                 + f", {where.name} - the least predicted forward + backward time"
                 + ("" if memory is None else f" among those whose K/V fit in {args.memory_gib:g} GiB")
                 + ("" if args.causal else "; not causal"))
    return "\n".join(lines)


def _size(nbytes):
    for unit, size in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


if __name__ == "__main__":
    main()
