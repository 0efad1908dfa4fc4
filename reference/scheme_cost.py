"""The cost of each scheme (`reference.schemes`), per device and round, predicted without attention.

A run of a scheme on N devices has r = N / u rounds (u = 1 for the ring and the
all-gather, u = N for Ulysses); `predict_scheme` counts, per round t and device
g, what its trace records (tiles computed and skipped, visible pairs, bytes
sent and received, K/V bytes held) from the shapes alone, byte for byte:

- a K/V block is K and V (B, Hkv / u, u c, D) in the input dtype, its
  positions (u c int64) and its owner (2 int32): 2 B Hkv c D e + 8 u c + 8 bytes;
  dK, dV travel in the accumulation dtype (float32, float64 for float64);
- the ring shifts one block in every round but the last, holding two then,
  one in the last; the backward adds dK, dV in every round, and the hop home
  after all the compute (exposed);
- the all-gather moves one block in each of its first N - 1 rounds, before any
  compute, and holds all N; its backward reduce-scatters dK, dV after it;
- Ulysses and USP trade (u - 1) / u of q, k, v (and out, dout, lse in the
  backward) in an all-to-all before the ring's first round, and of out, lse
  (dq, dk, dv) after its last; the ring runs on u c tokens of H / u heads
  (K/V heads fewer than u: u / Hkv copies each, dK, dV back unrounded);
- the double ring: its inner ring's blocks, and one a step on its outer ring
  (received w - 1 rounds later); dK, dV after them (`double_ring_moves`).

On a machine (`reference.topology`) each message is charged to the link it
crosses in the round it travels; a round lasts, on its busiest device, its
compute (4 D flops per tile entry forward, 10 D backward, at a FLOP/s rate or
an object's ``seconds(cost)``) or its slowest overlapped link, plus its
exposed transfers (`Moves`). `choose` picks.

    python -m reference.cost --scheme all --n-devices 8 --seq-len 131072 --heads 32 --kv-heads 8
    python -m reference.cost --scheme all --n-devices 16 --seq-len 262144 --machine h100-hdr
"""

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .heads import accumulate_dtype
from .masks import layout_mask
from .moves import Moves, all_to_all_moves, double_ring_moves, held_blocks_of, ring_moves
from .predict import predict_positions
from .schemes import Scheme
from .topology import GB, LINKS, Machine, crossings, placements
from .tiles import Tile, tile_shape

FLOPS_PER_ENTRY = dict(forward=4, backward=10)      # x D, per (query, key) entry of a computed tile
GIB = 2 ** 30                   # bytes: links are quoted in GB/s (decimal, `GB`), memory in GiB (binary)


class StepShape(NamedTuple):
    """What one step call on a device costs besides its tiles' count: the
    heads it holds (Hq / u query heads, Hkv / u key/value heads), its block of
    u c tokens, the tile, the pass (`reference.tile_cost` measures a tile's
    seconds at each)."""
    B: int
    heads: int
    kv_heads: int
    D: int
    block: int
    tile: Tile
    dtype: str
    backward: bool


@dataclass
class SchemeCost:
    """A scheme's predicted work and traffic: arrays (r rounds, N devices), as a
    trace records them, and the messages behind the bytes (`Moves`)."""
    scheme: Scheme
    work: object                # `reference.cost.Prediction` (r, N): tiles, pairs, tile area, source
    moves: Moves
    kv_bytes: np.ndarray
    flops_per_entry: int        # x B x heads per device: the flops of one tile entry on a device
    host_moves: Moves = None    # of the messages, a block's positions and owner (host arrays)
    step_shape: StepShape = None    # the shape of each device's step calls

    def staged_copies(self):
        """(downloads, uploads) (r, N): the bytes a GPU whose MPI is not
        CUDA-aware copies between device and pinned host memory (gpu_impl's
        staged path): every device byte it sends first, every one it receives
        after; an all-to-all's own piece is copied on the device, unsent."""
        shape = self.kv_bytes.shape
        return (self.bytes_sent - self.host_moves.per_device(shape, by="src"),
                self.bytes_received - self.host_moves.per_device(shape, by="dst"))

    @property
    def bytes_sent(self):
        return self.moves.per_device(self.kv_bytes.shape, by="src")

    @property
    def bytes_received(self):
        return self.moves.per_device(self.kv_bytes.shape, by="dst")

    @property
    def exposed(self):
        """Of bytes sent and received (the larger), those no compute overlaps."""
        shape, where = self.kv_bytes.shape, self.moves.exposed
        return np.maximum(self.moves.per_device(shape, by="src", where=where),
                          self.moves.per_device(shape, by="dst", where=where))

    def link_bytes(self, machine, placement=None):
        """{"intra": (r, N), "inter": (r, N)}: the bytes each device sends over
        each link of `machine` (a `reference.topology.Machine`), counted in the
        round sent as the trace counts them, its ranks placed by `placement`
        (None: in order)."""
        inter = self._crossing(machine, placement)
        shape = self.kv_bytes.shape
        return {"intra": self.moves.per_device(shape, by="src", where=~inter),
                "inter": self.moves.per_device(shape, by="src", where=inter)}

    def round_seconds(self, link, compute, placement=None):
        """(r,) predicted wall seconds of each round (module docstring). A link's
        time is its bytes (a device's out or in, the larger) over its bandwidth,
        plus its latency: once in a round for messages that overlap compute
        (they queue), once per message to one peer for exposed ones (each shift
        finished before the next). `link`: a Machine, or bytes/s (every byte
        over one link: `Machine.one_link`); `compute`: FLOP/s, or an object with
        ``seconds(cost) -> (r, N)``."""
        machine, compute = as_machine(link), as_compute(compute)
        busy = np.asarray(compute.seconds(self), dtype=float)
        if busy.shape != self.kv_bytes.shape:
            raise ValueError(f"compute.seconds(cost) must be (rounds, devices) {self.kv_bytes.shape}, got {busy.shape}")
        inter = self._crossing(machine, placement)
        m = self.moves
        spanning = m.departs < m.received
        overlapped, exposed = np.zeros(busy.shape), np.zeros((max(m.phase, default=0) + 1,) + busy.shape)
        for name, on in zip(LINKS, (~inter, inter)):
            for total, flag, phase in [(overlapped, False, None)] + [(exposed[p], True, p) for p in range(len(exposed))]:
                keep = on & (m.exposed == flag) & ~spanning & ((m.phase == phase) if flag else True)
                moved = self._travelling(keep)
                # overlapped messages queue on the link and pay its latency once; exposed
                # ones to one peer go one after another (a shift is finished before the next)
                latencies = self._in_turn(keep) if flag else None
                np.maximum(total, machine.links()[name].seconds(moved, latencies), out=total)
        rounds = (np.maximum(busy, overlapped) + exposed.sum(axis=0)).max(axis=1)
        return self._spanned(rounds, machine, inter)

    def _spanned(self, rounds, machine, inter):
        """`rounds` lengthened where a message travelling several rounds
        (`Moves.departs`) takes longer on its link than they last: its link's
        bytes over those rounds, out or in, plus one latency, and the
        shortfall added to the round it is received in."""
        m, rounds = self.moves, rounds.copy()
        for k in np.argsort(m.received, kind="stable"):
            first, last = m.departs[k], m.received[k]
            if first == last:
                continue
            link = machine.links()[LINKS[int(inter[k])]]
            within = (m.departs >= first) & (m.received <= last) & (inter == inter[k])
            moved = max(m.nbytes[within & (way == device)].sum()             # out of and into the sender,
                        for device in (m.src[k], m.dst[k]) for way in (m.src, m.dst))   # out of and into the receiver
            needed = float(link.seconds(moved)) if moved else 0.0
            rounds[last] += max(0.0, needed - rounds[first:last + 1].sum())
        return rounds

    def _in_turn(self, keep):
        """(r, N) the most messages `keep` selects between the device and any one
        peer in a round (out or in), in the round they travel."""
        r, n = self.kv_bytes.shape
        m, count = self.moves, np.zeros((r, n, n), np.int64)
        np.add.at(count, (m.received[keep], m.src[keep], m.dst[keep]), 1)
        return np.maximum(count.max(axis=2), count.max(axis=1))

    def seconds(self, link, compute, placement=None):
        """Predicted wall seconds of the pass: the sum of `round_seconds`."""
        return float(self.round_seconds(link, compute, placement).sum())

    def _crossing(self, machine, placement):
        """Per message: True where it crosses nodes of `machine` as placed."""
        n = self.kv_bytes.shape[1]
        if placement is not None:
            placement.check(n)
        return crossings(self.moves.src, self.moves.dst, machine, range(n) if placement is None else placement.order)

    def _travelling(self, keep):
        """(r, N) bytes of the messages `keep` selects, each in the round it travels
        (received): per device the larger of its bytes out and in."""
        shape, m = self.kv_bytes.shape, self.moves
        out, into = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
        np.add.at(out, (m.received[keep], m.src[keep]), m.nbytes[keep])
        np.add.at(into, (m.received[keep], m.dst[keep]), m.nbytes[keep])
        return np.maximum(out, into)

    def totals(self):
        """Per device over the run, the busiest: the flops of the critical path
        (the busiest device's each round), bytes sent, peak K/V bytes."""
        return dict(critical_flops=int((self.work.tile_area * self.flops_per_entry).max(axis=1).sum()),
                    bytes_sent=int(self.bytes_sent.sum(axis=0).max()), peak_kv=int(self.kv_bytes.max()))


def predict_scheme(scheme, seq_len, layout, *, B, Hq, Hkv, D, dtype=np.float32, tile_size=None, causal=True,
                   backward=False, **mask_options):
    """The SchemeCost of one pass (forward, or `backward`) of `scheme` (a
    `reference.schemes.Scheme`) on `seq_len` tokens in `layout`, for q
    (B, S, Hq, D) and k, v (B, S, Hkv, D) of `dtype`; mask options as
    `reference.ring_attention` takes them."""
    check_shape(B=B, Hq=Hq, Hkv=Hkv, D=D)
    n, u, r = scheme.n, scheme.u, scheme.r
    mask = layout_mask(seq_len, n, layout, causal=causal, **mask_options)
    pos = scheme.positions(seq_len, layout)                            # (N, c)
    c = pos.shape[1]
    ring_pos = pos.reshape(r, u * c)                                   # ring rank i: its Ulysses group's tokens
    ring = predict_positions(ring_pos, tile_size, mask, sources=scheme.sources())   # (r, r)
    home = np.arange(n) // u                                           # device g is ring rank g // u
    work = type(ring)(*(getattr(ring, f)[:, home] for f in ("source", "tiles_computed", "tiles_skipped",
                                                            "pairs", "tile_area", "tiles_masked")))
    e, acc = np.dtype(dtype).itemsize, np.dtype(accumulate_dtype(dtype)).itemsize
    copies = scheme.kv_copies(Hkv)
    hkv = Hkv * copies                                                 # K/V heads dealt, copies included
    block = 2 * B * hkv * c * D * e + 8 * u * c + 8
    dkv = 2 * B * hkv * c * D * acc
    moves = double_ring_moves if scheme.name == "double_ring" else ring_moves
    rows = moves(scheme, block, dkv if backward else 0)
    if u > 1:
        lse = B * Hq * c * acc                                         # lse travels in the accumulation dtype
        kv_back = 2 * B * c * hkv * D * (acc if copies > 1 else e)    # copies' dK, dV: summed unrounded
        if backward:
            before = (3 * B * c * Hq * D + 2 * B * c * hkv * D) * e + lse
            after = B * c * Hq * D * e + kv_back
        else:
            before = (B * c * Hq * D + 2 * B * c * hkv * D) * e
            after = B * c * Hq * D * e + lse
        rows += all_to_all_moves(scheme, 0, before, 0) + all_to_all_moves(scheme, r - 1, after, 2)
    flops = FLOPS_PER_ENTRY["backward" if backward else "forward"] * D * B * (Hq // u)
    host = Moves.of(moves(scheme, 8 * u * c + 8, 0))                  # a block's positions and owner
    shape = StepShape(B, Hq // u, hkv // u, D, u * c, tile_shape(tile_size), np.dtype(dtype).name, backward)
    return SchemeCost(scheme, work, Moves.of(rows), held_blocks_of(scheme) * block, flops, host, shape)


def check_shape(**sizes):
    """ValueError naming the first size that is not a positive int, or query
    heads that are not a multiple of key/value heads."""
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    if sizes["Hq"] % sizes["Hkv"]:
        raise ValueError(f"query heads Hq ({sizes['Hq']}) must be a multiple of key/value heads Hkv ({sizes['Hkv']})")


class FlopRate:
    """Compute at one rate: a device's tile flops in a round over `flops_per_s`."""

    def __init__(self, flops_per_s):
        if isinstance(flops_per_s, bool) or not isinstance(flops_per_s, (int, float, np.number)) \
                or not (np.isfinite(flops_per_s) and flops_per_s > 0):
            raise ValueError(f"flops_per_s must be a finite number above 0, got {flops_per_s!r}")
        self.flops_per_s = float(flops_per_s)

    def seconds(self, cost):
        """(r, N) compute seconds of `cost` (a SchemeCost)."""
        return cost.work.tile_area * cost.flops_per_entry / self.flops_per_s


def as_machine(link):
    """A `reference.topology.Machine` as it is, or bytes/s as one link for every byte."""
    return link if isinstance(link, Machine) else Machine.one_link(link)


def as_compute(compute):
    """An object with ``seconds(cost)`` as it is, or FLOP/s as a `FlopRate`."""
    return compute if callable(getattr(compute, "seconds", None)) else FlopRate(compute)


def check_rates(link, compute, memory_bytes=None):
    """ValueError unless the link (bytes/s above 0, inf: transfers free; or a
    Machine), the compute (a finite FLOP/s above 0, or an object with
    ``seconds``) and the memory (if given: finite, above 0) can be used."""
    as_machine(link), as_compute(compute)
    if memory_bytes is not None and not (np.isfinite(memory_bytes) and memory_bytes > 0):
        raise ValueError(f"memory_bytes must be a finite number above 0, got {memory_bytes!r}")


def candidates(n_devices, Hq, Hkv):
    """Every scheme the shapes allow on N devices: the ring, the all-gather,
    Ulysses (u = N) and USP for each u strictly between that divides N and
    the query heads, and of whose K/V heads it is a multiple or a divisor (the
    heads then copied), and the double ring for each inner ring size strictly
    between 1 and N that divides N."""
    found = [Scheme("ring", n_devices, 1), Scheme("all_gather", n_devices, 1)]
    for u in range(2, n_devices + 1):
        if n_devices % u == 0 and Hq % u == 0 and (Hkv % u == 0 or u % Hkv == 0):
            found.append(Scheme("ulysses" if u == n_devices else "usp", n_devices, u))
    found += [Scheme("double_ring", n_devices, 1, w) for w in range(2, n_devices) if n_devices % w == 0]
    return found


def placed(costs, machine):
    """`costs` ({Scheme: (forward, backward)}) keyed by (Scheme, Placement):
    each scheme once for each of its placements on `machine` (`reference.topology.placements`)."""
    return {(s, p): pair for s, pair in costs.items() for p in placements(s, machine)}


def key_seconds(key, pair, link, compute):
    """Forward plus backward seconds of a `costs` entry: `key` a Scheme (placed
    in order) or a (Scheme, Placement) pair."""
    placement = key[1] if isinstance(key, tuple) else None
    return sum(c.seconds(link, compute, placement) for c in pair)


def choose(costs, link, compute, memory_bytes=None):
    """The key of `costs` predicted fastest, forward plus backward: `costs`
    maps a Scheme, or a (Scheme, Placement) pair (`placed`), to its (forward,
    backward) SchemeCosts; among those whose peak K/V bytes fit in
    `memory_bytes` (None: all). `link` and `compute` as `SchemeCost.seconds`."""
    check_rates(link, compute, memory_bytes)
    fits = {s: pair for s, pair in costs.items()
            if memory_bytes is None or max(c.kv_bytes.max() for c in pair) <= memory_bytes}
    if not fits:
        raise ValueError(f"no scheme's K/V blocks fit in {memory_bytes} bytes per device")
    return min(fits, key=lambda s: key_seconds(s, fits[s], link, compute))
