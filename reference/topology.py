"""Machines of nodes: the two links each rank has, and where a scheme's ranks run on them.

A machine is nodes of R ranks. Each rank has two links of its own, each with a
bandwidth a direction (GB/s, 1 GB = 10^9 bytes) and a latency: the one inside
its node (a GPU's NVLink into the node's switch, or shared memory between
processes) and the one between nodes (a GPU's own NIC). A message between two
ranks of one node crosses the first; between nodes, the second. Ranks do not
share a link, so a rank's messages on one link queue behind each other and
never behind another rank's.

A placement runs scheme rank g (`reference.schemes.Scheme`: its Ulysses and
ring groups) on machine rank ``order[g]``, machine rank m being on node
m // R. Every scheme runs "in-order" (scheme rank g on machine rank g: the
ring visits the nodes in turn, a Ulysses group of u consecutive ranks sits in
as few nodes as it can); USP also runs "ring-in-nodes", each ring group on
consecutive machine ranks and each Ulysses group spread across nodes:

    N = 4, u = 2, 2 nodes of 2   in-order        node 0: g0 g1 | node 1: g2 g3   (all-to-all inside, ring across)
                                 ring-in-nodes   node 0: g0 g2 | node 1: g1 g3   (all-to-all across, ring inside)

`reference.scheme_cost` charges each message of a pass to the link it crosses
as placed (`SchemeCost.seconds`, `link_bytes`). The named machines give each
figure's source:

    machine = MACHINES["h100-ndr"]
    print(machine.describe())
    python -m reference.cost --scheme all --machine h100-ndr --n-devices 16 --seq-len 262144
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import usage

GB = 10 ** 9                    # bytes: links are quoted in GB/s (decimal)
LINKS = ("intra", "inter")      # inside a node, between nodes


@dataclass(frozen=True)
class Link:
    """One direction of a rank's link: `gbs` GB/s (inf: free), `latency_us` microseconds."""
    gbs: float
    latency_us: float = 0.0

    def __post_init__(self):
        if isinstance(self.gbs, bool) or not isinstance(self.gbs, (int, float)) or not self.gbs > 0:
            raise ValueError(f"a link's bandwidth must be a number of GB/s above 0 (inf: free), got {self.gbs!r}")
        latency = self.latency_us
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not (math.isfinite(latency)
                                                                                     and latency >= 0):
            raise ValueError(f"a link's latency must be a finite number of microseconds, 0 or more, got {latency!r}")

    @property
    def bytes_per_s(self):
        return self.gbs * GB

    def seconds(self, nbytes, latencies=None):
        """Seconds `nbytes` (an array) take on this link: their bytes over the
        bandwidth, plus the latency `latencies` times (an array like nbytes;
        None: once where any byte moves)."""
        nbytes = np.asarray(nbytes, dtype=float)
        latencies = (nbytes > 0) if latencies is None else np.asarray(latencies)
        return nbytes / self.bytes_per_s + self.latency_us * 1e-6 * latencies

    def describe(self):
        latency = f" + {self.latency_us:g} us" if self.latency_us else ""
        return f"{self.gbs:g} GB/s{latency}"


@dataclass(frozen=True)
class Machine:
    """Nodes of `ranks_per_node` ranks, each rank with an `intra` and an `inter`
    link; `tflops`, a rank's attention compute rate (None: not given); `about`,
    what the machine is and where its figures come from."""
    ranks_per_node: int
    intra: Link
    inter: Link
    name: str = ""
    tflops: float = None
    about: str = ""

    def __post_init__(self):
        r = self.ranks_per_node
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 1:
            raise ValueError(f"ranks_per_node must be a positive int, got {r!r}")
        for name in LINKS:
            if not isinstance(getattr(self, name), Link):
                raise TypeError(f"{name} must be a reference.topology.Link, got {type(getattr(self, name)).__name__}")

    @classmethod
    def one_link(cls, bytes_per_s):
        """Every rank a node of its own, every message over one link of `bytes_per_s`
        (the cost model before nodes: one rate for every byte)."""
        if isinstance(bytes_per_s, bool) or not isinstance(bytes_per_s, (int, float, np.floating)) \
                or not bytes_per_s > 0:
            raise ValueError(f"link_bytes_per_s must be a number above 0 (inf: transfers free), got {bytes_per_s!r}")
        link = Link(float(bytes_per_s) / GB)
        return cls(1, link, link, name=f"one link of {link.gbs:g} GB/s")

    @classmethod
    def one_node(cls, n_ranks, gbs, about=""):
        """`n_ranks` ranks on one node, `gbs` GB/s between any two (processes of one machine)."""
        return cls(n_ranks, Link(gbs), Link(gbs), name=f"one node of {n_ranks} ranks", about=about)

    def node(self, rank):
        return rank // self.ranks_per_node

    def link(self, a, b):
        """'intra' or 'inter': the link a message from machine rank a to b crosses."""
        return "intra" if self.node(a) == self.node(b) else "inter"

    def links(self):
        return {"intra": self.intra, "inter": self.inter}

    def describe(self, n_ranks=None):
        """'2 nodes of 2 ranks, intra 1 GB/s + 50 us, inter 0.1 GB/s + 50 us'."""
        if self.ranks_per_node == 1 and self.intra == self.inter:
            return self.name or f"one link of {self.inter.describe()}"
        nodes = "" if n_ranks is None else f"{-(-n_ranks // self.ranks_per_node)} "
        size = f"{nodes}node{'s' * (nodes != '1 ')} of {self.ranks_per_node} rank{'s' * (self.ranks_per_node > 1)}"
        return (f"{self.name + ': ' if self.name else ''}{size}, intra {self.intra.describe()}, "
                f"inter {self.inter.describe()}")


class Placement(NamedTuple):
    """Scheme rank g runs on machine rank ``order[g]``."""
    name: str
    order: tuple

    def check(self, n):
        """ValueError unless `order` is a permutation of the n scheme ranks."""
        if sorted(self.order) != list(range(n)):
            raise ValueError(f"placement {self.name!r} must put the {n} scheme ranks on machine ranks 0..{n - 1}, "
                             f"each once, got {list(self.order)}")


PLACEMENTS = ("in-order", "ring-in-nodes")


def placements(scheme, machine):
    """The placements worth telling apart for `scheme` on `machine`: in-order
    for every scheme; ring-in-nodes too for USP (1 < u < N) where its ranks
    span nodes whose two links differ (module docstring)."""
    n, u, r = scheme.n, scheme.u, scheme.r
    found = [Placement("in-order", tuple(range(n)))]
    if 1 < u < n and 1 < machine.ranks_per_node < n and machine.intra != machine.inter:
        found.append(Placement("ring-in-nodes", tuple((g % u) * r + g // u for g in range(n))))
    return found


def placement(scheme, machine, name):
    """The placement called `name` for `scheme` on `machine`, or ValueError naming those there are."""
    found = {p.name: p for p in placements(scheme, machine)}
    if name not in found:
        raise ValueError(f"placement {name!r} is not one of {scheme.label}'s on {machine.describe(scheme.n)}: "
                         + ", ".join(found))
    return found[name]


# -- the command lines' options (reference.cost, mpi_impl) ---------------------------------------

NODE_OPTIONS = ("ranks_per_node", "intra", "inter")
LATENCIES = ("intra_latency_us", "inter_latency_us")


def add_machine_options(ap, *, named=True):
    """The options that describe a machine (`machine_of` reads them), in a group of `ap`."""
    group = ap.add_argument_group("nodes and links (reference.topology)")
    if named:
        group.add_argument("--machine", choices=sorted(MACHINES), default=None,
                           help="a named machine, its figures' sources in reference/topology.py (the options "
                                "below change its figures)")
    group.add_argument("--ranks-per-node", type=usage.count, default=None, metavar="R",
                       help="ranks on each node: machine rank m is on node m // R")
    group.add_argument("--intra", type=usage.rate, default=None, metavar="GBS",
                       help="each rank's link inside its node, GB/s a direction (1 GB = 10^9 bytes)")
    group.add_argument("--inter", type=usage.rate, default=None, metavar="GBS",
                       help="each rank's link to other nodes, GB/s a direction")
    group.add_argument("--intra-latency-us", type=usage.microseconds, default=None, metavar="US",
                       help="latency of the link inside a node, microseconds (default 0, or the machine's)")
    group.add_argument("--inter-latency-us", type=usage.microseconds, default=None, metavar="US",
                       help="latency of the link between nodes, microseconds (default 0, or the machine's)")
    return group


def machine_of(args):
    """The Machine the options describe (`add_machine_options`), or None where
    they describe none; ValueError naming the option missing."""
    named = MACHINES.get(getattr(args, "machine", None))
    given = {name: getattr(args, name) for name in NODE_OPTIONS + LATENCIES if getattr(args, name) is not None}
    if named is None and not given:
        return None
    missing = [f"--{name.replace('_', '-')}" for name in NODE_OPTIONS if name not in given]
    if named is None and missing:
        raise ValueError(f"nodes need --ranks-per-node, --intra and --inter together: give {', '.join(missing)} "
                         "too (or --machine NAME)")
    base = named or Machine(1, Link(1.0), Link(1.0))
    intra = Link(given.get("intra", base.intra.gbs), given.get("intra_latency_us", base.intra.latency_us))
    inter = Link(given.get("inter", base.inter.gbs), given.get("inter_latency_us", base.inter.latency_us))
    return Machine(given.get("ranks_per_node", base.ranks_per_node), intra, inter,
                   name=(base.name + (", changed" if given else "")) if named else "",
                   tflops=base.tflops, about=base.about)


def crossings(src, dst, machine, order):
    """Per message (arrays of scheme ranks `src`, `dst`; scheme rank g on machine
    rank ``order[g]``): True where it crosses nodes."""
    node = np.asarray(order) // machine.ranks_per_node
    return node[np.asarray(src, dtype=np.int64)] != node[np.asarray(dst, dtype=np.int64)]


# -- named machines ------------------------------------------------------------------------------
# Sources, by figure:
# - NVLink 4 on an H100 SXM: "the NVLink bidirectional speed of 900 gigabytes per second (GB/s)"
#   between any two of the 8 GPUs through the NVSwitches, NVIDIA's "Introducing NVIDIA HGX H100"
#   (developer.nvidia.com/blog/introducing-nvidia-hgx-h100-an-accelerated-server-platform-for-ai-and-
#   high-performance-computing/): 450 GB/s a direction.
# - One NIC per GPU: a DGX H100 has "eight single-port NVIDIA ConnectX-7 VPI, ... up to 400 Gb/s
#   InfiniBand" (NVIDIA DGX BasePOD reference architecture, "Core Components",
#   docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/latest/
#   core-components.html). NDR is 400 Gb/s, four lanes of 100 Gb/s; HDR four lanes of 50 Gb/s,
#   200 Gb/s; HDR100 two of HDR's lanes, 100 Gb/s (NVIDIA DGX SuperPOD cabling guide, "NDR Overview",
#   docs.nvidia.com/dgx-superpod/design-guide-cabling-data-centers/latest/ndr-overview.html).
#   Bits to bytes: 400 Gb/s = 50 GB/s, 200 Gb/s = 25 GB/s, 100 Gb/s = 12.5 GB/s a direction.
# - Latency: not from a datasheet, an assumed order of magnitude for one MPI or NCCL message
#   (InfiniBand's small-message MPI latency is 1-2 us; NVLink's through a switch a few us).
# - Compute: FlashAttention-2 reaches 35% of an H100's 989 dense BF16 TFLOP/s, FlashAttention-3
#   up to 740 TFLOP/s forward in FP16 (Shah et al. 2024, arXiv 2407.08608, abstract): 400 is
#   between them. The CPU node's is this project's float32 step, about 59 GFLOP/s a core on an
#   AMD EPYC (BENCHMARKS.md, the schemes section), times 32 cores.
# - Shared memory between processes of one machine: 10 GB/s, a stated figure (memory copies), as
#   `bench.schemes` and `mpi_impl`'s choice line use, not measured.

_H100 = ("8 H100 SXM GPUs a node: NVLink 4 at 900 GB/s both ways (NVIDIA, Introducing NVIDIA HGX H100), "
         "one ConnectX-7 port a GPU (NVIDIA DGX BasePOD reference architecture)")
MACHINES = {
    "h100-ndr": Machine(8, Link(450.0, 3.0), Link(50.0, 5.0), name="h100-ndr", tflops=400.0,
                        about=_H100 + " at NDR 400 Gb/s (NVIDIA SuperPOD cabling guide, NDR overview)"),
    "h100-hdr": Machine(8, Link(450.0, 3.0), Link(25.0, 5.0), name="h100-hdr", tflops=400.0,
                        about=_H100 + " at HDR 200 Gb/s (NVIDIA SuperPOD cabling guide, NDR overview)"),
    "cpu-hdr100": Machine(2, Link(10.0, 1.0), Link(6.25, 5.0), name="cpu-hdr100", tflops=1.9,
                          about="2-socket CPU nodes, a rank a socket of 32 cores: shared memory at 10 GB/s "
                                "(stated), one HDR100 port of 100 Gb/s a node shared by its 2 ranks"),
}
