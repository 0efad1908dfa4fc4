"""The command line's --scheme, --ulysses-degree and --ring-inner: which scheme
runs, where each rank's tokens are, the predicted speedup of each layout, and
the scheme the cost model (`reference.scheme_cost`) would pick for the run's shapes.

    python -m mpi_impl ... --scheme usp --ulysses-degree 2
    python -m mpi_impl ... --scheme double_ring --ring-inner 2
"""

import numpy as np

from reference import usage
from reference.schemes import SCHEMES, Scheme
from reference.scheme_cost import GB, candidates, choose, predict_scheme


def add_scheme_options(ap):
    group = ap.add_argument_group("schemes (reference.schemes)")
    group.add_argument("--scheme", choices=SCHEMES, default="ring",
                       help="ring (the default), all_gather (K, V gathered once), ulysses (heads dealt over all "
                            "ranks by an all-to-all), usp (Ulysses in groups of --ulysses-degree, the ring across), "
                            "double_ring (inner rings of --ring-inner ranks, an outer ring across them)")
    group.add_argument("--ulysses-degree", type=int, default=None, metavar="U",
                       help="ranks per Ulysses group (usp: required; ulysses: all ranks); a multiple or a divisor "
                            "of --kv-heads (each K/V head then copied to the ranks whose query heads read it)")
    group.add_argument("--ring-inner", type=int, default=None, metavar="W",
                       help="ranks per inner ring of the double ring (double_ring: required; a node's ranks)")
    group.add_argument("--link-gbs", type=usage.rate, default=10.0,
                       help="link bandwidth per rank, GB/s each way (1 GB = 10^9 bytes), for the cost model's choice "
                            "printed under the table (default 10: memory copies between processes of one machine)")


def scheme_of(args, n_ranks):
    """The checked Scheme of these options, or ValueError with the option's words."""
    try:
        return Scheme.checked(args.scheme, args.ulysses_degree, n_devices=n_ranks, Hq=args.heads,
                              Hkv=args.kv_heads or args.heads, ring_inner=args.ring_inner)
    except ValueError as e:
        words = str(e).replace("ulysses_degree", "--ulysses-degree").replace("ring_inner", "--ring-inner")
        raise ValueError(words.replace("scheme ", "--scheme ")) from None


def scheme_problem(args, n_ranks):
    """A message for scheme options that cannot run on n_ranks, or None."""
    try:
        scheme_of(args, n_ranks)
    except ValueError as e:
        return str(e)
    return None


def _shape(args, mask):
    return dict(B=args.batch, Hq=args.heads, Hkv=args.kv_heads or args.heads, D=args.head_dim, dtype=args.dtype,
                tile_size=args.tile_size, causal=args.causal, **mask)


def predicted_speedup(args, scheme, layout, mask):
    """Predicted critical-path speedup of `layout` over contiguous under `scheme`
    (the run's, as its plan resolved it), in tiles' work (for the ring:
    `reference.cost.speedup`'s "tiles")."""
    flops = [predict_scheme(scheme, args.seq_len, lay, **_shape(args, mask)).totals()["critical_flops"]
             for lay in ("contiguous", layout)]
    return flops[0] / flops[1]


def choice_line(args, n_ranks, layout, mask, flops_per_s):
    """The scheme the cost model picks for this run's shapes, at --link-gbs and
    `flops_per_s` (the rate this run's critical path measured), with each candidate's prediction."""
    link = args.link_gbs * GB
    costs = {s: tuple(predict_scheme(s, args.seq_len, layout, backward=b, **_shape(args, mask))
                      for b in (False, True)[:1 + bool(args.backward)])
             for s in candidates(n_ranks, args.heads, args.kv_heads or args.heads)}
    best = choose(costs, link, flops_per_s)
    named = ", ".join(f"{s.label} {sum(c.seconds(link, flops_per_s) for c in pair) * 1e3:.0f} ms"
                      for s, pair in costs.items())
    extra = "; dropout not modelled" if mask.get("dropout") else ""
    return (f"cost model's choice ({layout}, link {args.link_gbs:g} GB/s, {flops_per_s / 1e9:.1f} GFLOP/s "
            f"measured): {best.label} [{named}]{extra}")


def measured_rate(args, scheme, layout, mask, critical_cpu_s):
    """FLOP/s of this run's critical path under `scheme`: the cost model's flops over the measured CPU seconds."""
    passes = (False, True)[:1 + bool(args.backward)]
    flops = sum(predict_scheme(scheme, args.seq_len, layout, backward=b, **_shape(args, mask)).totals()["critical_flops"]
                for b in passes)
    return flops / max(critical_cpu_s, np.finfo(float).tiny)


def choice(rows, args, comm, mask):
    """choice_line for the striped row (or the first), at the rate it measured."""
    row = next((r for r in rows if r.layout == "striped"), rows[0])
    rate = measured_rate(args, row.scheme, row.layout, mask, row.critical_cpu_s)
    return choice_line(args, comm.Get_size(), row.layout, mask, rate)
