"""The command line's --scheme, --ulysses-degree and --ring-inner, and its
emulated nodes: which scheme runs, where each rank's tokens are, on which
emulated node each rank sits and over which links it sends
(`mpi_impl.links`), the predicted speedup of each layout, and the scheme and
placement the cost model (`reference.scheme_cost`) would pick for the run's
shapes on the machine it runs on: the emulated nodes, or else this machine,
one node whose ranks copy through shared memory at --link-gbs (a stated
figure, not measured).

    python -m mpi_impl ... --scheme usp --ulysses-degree 2
    python -m mpi_impl ... --scheme double_ring --ring-inner 2
    python -m mpi_impl ... --scheme usp --ulysses-degree 2 --ranks-per-node 2 --intra 1 --inter 0.1 \
        --placement ring-in-nodes
"""

import numpy as np

from reference import usage
from reference.schemes import SCHEMES, Scheme
from reference.scheme_cost import candidates, choose, key_seconds, placed, predict_scheme
from reference.topology import PLACEMENTS, Machine, add_machine_options, machine_of, placement, placements

LINK_GBS = 10.0         # shared memory between the processes of one machine: a stated figure


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
    group.add_argument("--link-gbs", type=usage.rate, default=None,
                       help="shared memory between this machine's processes, GB/s each way (1 GB = 10^9 bytes), for "
                            "the cost model's choice printed under the table (default 10: a stated figure for memory "
                            "copies, not measured); without emulated nodes")
    nodes = add_machine_options(ap, named=False)
    nodes.description = ("emulated nodes (mpi_impl.links): world rank m on node m // R, each transfer held until "
                         "the bytes have had the time of the link they cross; the NumPy backend")
    nodes.add_argument("--placement", choices=PLACEMENTS, default="in-order",
                       help="where the scheme's ranks run: in-order (scheme rank g on world rank g), ring-in-nodes "
                            "(USP: each ring group on consecutive ranks, each Ulysses group across nodes)")


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


def emulated(args, scheme):
    """(Machine, Placement) of the emulated nodes, or (None, None) without
    them; ValueError with the options' words."""
    machine = machine_of(args)
    if machine is None:
        if args.placement != "in-order":
            raise ValueError(f"--placement {args.placement} places ranks on emulated nodes: give --ranks-per-node, "
                             "--intra and --inter")
        return None, None
    if args.link_gbs is not None:
        raise ValueError("--link-gbs is the choice's figure for one node; with emulated nodes the choice uses "
                         "--intra and --inter")
    try:
        return machine, placement(scheme, machine, args.placement)
    except ValueError as e:
        raise ValueError(f"--placement: {e}") from None


def nodes_problem(args, n_ranks):
    """A message for emulated-node options that cannot run on n_ranks, or None."""
    try:
        emulated(args, scheme_of(args, n_ranks))
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
    """The scheme and placement the cost model picks for this run's shapes on
    the machine it runs on (the emulated nodes, or one node at --link-gbs) and
    `flops_per_s` (the rate this run's critical path measured), with each
    candidate's prediction."""
    machine, where = machine_here(args, n_ranks)
    costs = placed({s: tuple(predict_scheme(s, args.seq_len, layout, backward=b, **_shape(args, mask))
                             for b in (False, True)[:1 + bool(args.backward)])
                    for s in candidates(n_ranks, args.heads, args.kv_heads or args.heads)}, machine)
    best = choose(costs, machine, flops_per_s)
    named = ", ".join(f"{_label(key, machine)} {key_seconds(key, pair, machine, flops_per_s) * 1e3:.0f} ms"
                      for key, pair in costs.items())
    extra = "; dropout not modelled" if mask.get("dropout") else ""
    return (f"cost model's choice ({layout}; {where}; {flops_per_s / 1e9:.1f} GFLOP/s measured): "
            f"{_label(best, machine)} [{named}]{extra}")


def machine_here(args, n_ranks):
    """(Machine, what it is in words): the emulated nodes, or this machine as one node."""
    machine = machine_of(args)
    if machine is not None:
        return machine, f"emulated {machine.describe(n_ranks)}, this run placed {args.placement}"
    gbs = args.link_gbs or LINK_GBS
    return (Machine.one_node(n_ranks, gbs),
            f"this machine: one node of {n_ranks} ranks, shared memory between processes at {gbs:g} GB/s, "
            f"{'given by --link-gbs' if args.link_gbs else 'a stated figure (--link-gbs), not measured'}")


def _label(key, machine):
    """'usp (u=2)', with its placement where the scheme has more than one on `machine`."""
    scheme, where = key
    return scheme.label + (f" {where.name}" if len(placements(scheme, machine)) > 1 else "")


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
