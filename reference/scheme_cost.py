"""The cost of each scheme (`reference.schemes`), per device and round, predicted without attention.

A run of a scheme on N devices has r = N / u rounds (u = 1 for the ring and the
all-gather, u = N for Ulysses), and its trace records, per round t and device
g: the tiles computed and skipped, the visible pairs, the bytes sent and
received, and the bytes of K/V blocks held. `predict_scheme` counts the same
[t, g] arrays from the shapes alone, byte for byte:

- a K/V block is K and V (B, Hkv / u, u c, D) in the input dtype, its
  positions (u c int64) and its owner (2 int32): 2 B Hkv c D e + 8 u c + 8 bytes;
  dK, dV travel in the accumulation dtype (float32, float64 for float64);
- the ring sends and receives one block in every round but the last, and
  holds two then (the one attended to and the one arriving), one in the last;
  the backward adds dK, dV in every round, and the hop home in the last;
- the all-gather moves one block in each of its first N - 1 rounds, before any
  compute, and holds all N in every round; its backward reduce-scatters dK, dV
  in the same rounds, after all compute;
- Ulysses and USP trade (u - 1) / u of q, k, v (and out, dout, lse in the
  backward) in an all-to-all before the ring's first round, and of out, lse
  (dq, dk, dv) after its last; the ring runs on u c tokens of H / u heads.

Time: a round takes its busiest device's compute (4 D flops per (query, key)
entry of the computed tiles forward, 10 D backward, where the step recomputes
the scores), or its ring transfer if longer (they overlap), plus its transfers
that do not overlap (the all-to-all, the all-gather, the reduce-scatter), at
the given link bandwidth and compute rate. `choose` picks the fastest.

    python -m reference.cost --scheme all --n-devices 8 --seq-len 131072 --heads 32 --kv-heads 8
"""

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .heads import accumulate_dtype
from .masks import layout_mask
from .predict import predict_positions
from .schemes import Scheme
from .tiles import Tile, tile_shape

FLOPS_PER_ENTRY = dict(forward=4, backward=10)      # x D, per (query, key) entry of a computed tile
GB, GIB = 10 ** 9, 2 ** 30      # bytes: links are quoted in GB/s (decimal), memory in GiB (binary)


class Moves(NamedTuple):
    """Every message of one pass, one entry each (arrays of one length): sent by
    device `src` in round `sent`, received by device `dst` in round `received`,
    `nbytes` long, `exposed` where no compute overlaps it (an all-to-all, the
    all-gather, the reduce-scatter). Devices are the scheme's ranks 0..N-1;
    which link a message crosses is the machine's to say (its placement of
    those ranks on nodes)."""
    sent: np.ndarray
    received: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    exposed: np.ndarray

    @classmethod
    def of(cls, rows):
        """From (sent, received, src, dst, nbytes, exposed) tuples."""
        cols = list(zip(*rows)) if rows else [()] * 6
        return cls(*(np.asarray(col, dtype=bool if i == 5 else np.int64) for i, col in enumerate(cols)))

    def per_device(self, shape, *, by="src", where=None):
        """(r, N) bytes: sent (by="src", counted in the round sent) or received
        (by="dst", in the round received), of the messages `where` selects (all)."""
        out = np.zeros(shape, dtype=np.int64)
        keep = np.ones(len(self.nbytes), bool) if where is None else where
        rounds = self.sent if by == "src" else self.received
        np.add.at(out, (rounds[keep], getattr(self, by)[keep]), self.nbytes[keep])
        return out


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
    host_bytes: np.ndarray = None   # of bytes_sent and received, a block's positions and owner (host arrays)
    step_shape: StepShape = None    # the shape of each device's step calls

    def staged_copies(self):
        """(downloads, uploads) (r, N): the bytes a GPU whose MPI is not
        CUDA-aware copies between device and pinned host memory (gpu_impl's
        staged path): every device byte it sends first, every one it receives
        after; an all-to-all's own piece is copied on the device, unsent."""
        return self.bytes_sent - self.host_bytes, self.bytes_received - self.host_bytes

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

    def seconds(self, link_bytes_per_s, flops_per_s):
        """Predicted wall seconds: per round the busiest device's compute or
        overlapped transfer, whichever is longer, plus its exposed transfer."""
        check_rates(link_bytes_per_s, flops_per_s)
        moved, exposed = np.maximum(self.bytes_sent, self.bytes_received), self.exposed
        compute = self.work.tile_area * self.flops_per_entry / flops_per_s
        overlapped = (moved - exposed) / link_bytes_per_s
        return float((np.maximum(compute, overlapped) + exposed / link_bytes_per_s).max(axis=1).sum())

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
    ring = predict_positions(ring_pos, tile_size, mask)                # (r, r)
    home = np.arange(n) // u                                           # device g is ring rank g // u
    work = type(ring)(*(getattr(ring, f)[:, home] for f in ("source", "tiles_computed", "tiles_skipped",
                                                            "pairs", "tile_area", "tiles_masked")))
    e, acc = np.dtype(dtype).itemsize, np.dtype(accumulate_dtype(dtype)).itemsize
    block = 2 * B * Hkv * c * D * e + 8 * u * c + 8
    dkv = 2 * B * Hkv * c * D * acc
    rows = ring_moves(scheme, block, dkv if backward else 0)
    held = np.zeros((r, n), dtype=np.int64)
    if scheme.name == "all_gather":
        held[:] = n * block
    else:
        held[:] = np.where(np.arange(r) == r - 1, block, 2 * block)[:, None]
    if u > 1:
        lse = B * Hq * c * acc                                         # lse travels in the accumulation dtype
        if backward:
            before = (3 * B * c * Hq * D + 2 * B * c * Hkv * D) * e + lse
            after = (B * c * Hq * D + 2 * B * c * Hkv * D) * e
        else:
            before = (B * c * Hq * D + 2 * B * c * Hkv * D) * e
            after = B * c * Hq * D * e + lse
        rows += all_to_all_moves(scheme, 0, before) + all_to_all_moves(scheme, r - 1, after)
    flops = FLOPS_PER_ENTRY["backward" if backward else "forward"] * D * B * (Hq // u)
    host = np.zeros((r, n), dtype=np.int64)
    host[:-1] = 8 * u * c + 8                                          # a block's positions and owner
    shape = StepShape(B, Hq // u, Hkv // u, D, u * c, tile_shape(tile_size), np.dtype(dtype).name, backward)
    return SchemeCost(scheme, work, Moves.of(rows), held, flops, host, shape)


def ring_moves(scheme, block, dkv):
    """The ring group's messages: (sent, received, src, dst, nbytes, exposed) rows.
    The ring: a block to the next ring rank in every round but the last,
    overlapped; with `dkv` (the backward) dK, dV after every round, received
    in the next (the last round's, the hop home, in the same round). The
    all-gather: the same blocks, exposed; its reduce-scatter's dK, dV in the
    same rounds."""
    n, u, r = scheme.n, scheme.u, scheme.r
    rows = []
    for g in range(n):
        nxt = (g + u) % n                                              # the next rank of g's ring group
        for t in range(r - 1):
            if scheme.name == "all_gather":
                rows.append((t, t, g, nxt, block + dkv, True))
            else:
                rows.append((t, t, g, nxt, block, False))
        if dkv and r > 1 and scheme.name != "all_gather":
            rows += [(t, min(t + 1, r - 1), g, nxt, dkv, False) for t in range(r)]
    return rows


def all_to_all_moves(scheme, t, nbytes):
    """An all-to-all of `nbytes` per device in round t: each device sends 1 / u
    of it to each other member of its Ulysses group, exposed."""
    piece = nbytes / scheme.u
    rows = []
    for g in range(scheme.n):
        others = [h for h in scheme.ulysses_group(g) if h != g]
        sizes = np.diff(np.round(np.arange(len(others) + 1) * piece)).astype(np.int64)   # adds up exactly
        rows += [(t, t, g, h, int(b), True) for h, b in zip(others, sizes)]
    return rows


def check_shape(**sizes):
    """ValueError naming the first size that is not a positive int, or query
    heads that are not a multiple of key/value heads."""
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    if sizes["Hq"] % sizes["Hkv"]:
        raise ValueError(f"query heads Hq ({sizes['Hq']}) must be a multiple of key/value heads Hkv ({sizes['Hkv']})")


def check_rates(link_bytes_per_s, flops_per_s, memory_bytes=None):
    """ValueError unless the compute rate (and the memory, if given) are finite
    and above 0, and the link above 0 (inf: an infinitely fast link, transfers free)."""
    if not link_bytes_per_s > 0:                         # NaN fails this too
        raise ValueError(f"link_bytes_per_s must be a number above 0 (inf: transfers free), got {link_bytes_per_s!r}")
    for name, value in (("flops_per_s", flops_per_s), ("memory_bytes", memory_bytes)):
        if value is not None and not (np.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number above 0, got {value!r}")


def candidates(n_devices, Hq, Hkv):
    """Every scheme the shapes allow on N devices: the ring, the all-gather,
    Ulysses (where u = N divides the heads) and USP for each u strictly between."""
    found = [Scheme("ring", n_devices, 1), Scheme("all_gather", n_devices, 1)]
    for u in range(2, n_devices + 1):
        if n_devices % u == 0 and Hkv % u == 0:
            found.append(Scheme("ulysses" if u == n_devices else "usp", n_devices, u))
    return found


def choose(costs, link_bytes_per_s, flops_per_s, memory_bytes=None):
    """The SchemeCost predicted fastest (forward plus backward: `costs` maps a
    Scheme to its (forward, backward) pair), among those whose peak K/V bytes
    fit in `memory_bytes` (None: all)."""
    check_rates(link_bytes_per_s, flops_per_s, memory_bytes)
    fits = {s: pair for s, pair in costs.items()
            if memory_bytes is None or max(c.kv_bytes.max() for c in pair) <= memory_bytes}
    if not fits:
        raise ValueError(f"no scheme's K/V blocks fit in {memory_bytes} bytes per device")
    return min(fits, key=lambda s: sum(c.seconds(link_bytes_per_s, flops_per_s) for c in fits[s]))
