"""Ways to spread attention over devices around the ring's loop, and their composition: what moves, and when.

The ring (paper, Algorithm 1; `reference.ring`) passes K, V blocks round a ring
while each device computes, so a device holds two blocks at a time. Beside it:

- **all-gather** of K, V (Llama 3's context parallelism): every block goes
  round the ring first and is kept, then the device attends its queries to all
  of them; the backward reduce-scatters dK, dV round the same ring. The ring's
  bytes, but a device holds all N blocks and nothing overlaps the transfers.
- **Ulysses** (DeepSpeed-Ulysses): an all-to-all trades the device's sequence
  shard of every head for the whole sequence of H/u heads; attention runs on
  the device alone; a second all-to-all trades back. Query heads a multiple of
  u; K/V heads a multiple of u, or a divisor (MQA included): each then sent to
  the u / Hkv ranks reading it (`kv_copies`), its dK, dV summed back (`sum_copies`).
- **USP** (Ulysses x ring): Ulysses inside groups of u consecutive ranks, and
  the ring across the r = N / u groups, on the head shard each rank holds; the
  layout deals tokens over the r ring ranks (`reference.layouts.ulysses_positions`).
- **the double ring** (LoongTrain): the ring as inner rings of w ranks and an
  outer ring across them (`reference.double_ring`: the ring's loop, three rings).

The per-device step and the ring loop are the ring's; these functions add the
moves around them. A communication object per group: the ring group's three
verbs (`start_shift`, `progress`, `finish_shift`), and the Ulysses group's one,
``all_to_all(pieces) -> pieces`` (piece i to and from group rank i).

    scheme = Scheme.checked("usp", ulysses_degree=2, n_devices=4, Hq=8, Hkv=4)
    out, lse, log = forward(q, k, v, group_pos, comms, scheme=scheme, scale=..., tile_size=..., step=..., mask=...)

Shapes: q (B, c, Hq, D), k, v (B, c, Hkv, D) this device's shard; after the
all-to-all (B, u c, H / u, D) (K/V heads: Hkv x copies / u); lse (B, Hq, c).
"""

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import double_ring
from .heads import accumulate_dtype
from .layouts import array_module, positions, ulysses_positions
from .ring import (DKV, KV, as_dtype, begin_backward, end_backward, end_forward, new_kv_grads, own_block,
                   ring_backward, ring_forward, turn)
from .step import ForwardAcc, Grads, KVBlock, Queries
from .trace import RoundLog

SCHEMES = ("ring", "all_gather", "ulysses", "usp", "double_ring")


@dataclass(frozen=True)
class Scheme:
    """A scheme on N devices with Ulysses degree u (1 for the ring, the
    all-gather and the double ring, N for Ulysses): r = N / u ring ranks of u
    devices each; the double ring's inner rings of w ranks (None otherwise)."""
    name: str
    n: int
    u: int
    w: int = None

    @property
    def r(self):
        return self.n // self.u

    @property
    def m(self):
        """The double ring's groups: N / w."""
        return self.n // self.w

    @classmethod
    def checked(cls, name, ulysses_degree=None, *, n_devices, Hq, Hkv, ring_inner=None):
        """The Scheme, or a clear ValueError: an unknown name, u not dividing N,
        query heads not a multiple of u, K/V heads neither a multiple nor a
        divisor of it, a degree or inner ring the scheme does not take."""
        if name not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {name!r}")
        u, w = _checked_int("ulysses_degree", ulysses_degree), _checked_int("ring_inner", ring_inner)
        if w is not None and name != "double_ring":
            raise ValueError(f"ring_inner={w} applies to scheme 'double_ring', not {name!r}")
        if name in ("ring", "all_gather", "double_ring"):
            if u not in (None, 1):
                raise ValueError(f"ulysses_degree={u} applies to scheme 'ulysses' or 'usp', not {name!r}")
            u = 1
        elif name == "ulysses":
            if u not in (None, n_devices):
                raise ValueError(f"scheme 'ulysses' spreads heads over all {n_devices} devices (ulysses_degree "
                                 f"{n_devices}); for ulysses_degree={u} with a ring across groups, use scheme='usp'")
            u = n_devices
        elif u is None:
            raise ValueError("scheme 'usp' needs ulysses_degree=u: Ulysses in groups of u devices, the ring "
                             "across the N / u groups")
        if n_devices % u:
            raise ValueError(f"ulysses_degree ({u}) must divide the number of devices ({n_devices})")
        if Hq % u or (Hkv % u and u % Hkv):
            raise ValueError(f"scheme {name!r} deals heads over {u} devices: query heads ({Hq}) must be a multiple "
                             f"of ulysses_degree ({u}), and key/value heads ({Hkv}) a multiple of it or a divisor "
                             f"(each then replicated to the ranks whose query heads read it)")
        if name == "double_ring":
            if w is None:
                raise ValueError("scheme 'double_ring' needs ring_inner=w: inner rings of w consecutive devices "
                                 "(one node's), an outer ring across the N / w of them")
            if n_devices % w:
                raise ValueError(f"ring_inner ({w}) must divide the number of devices ({n_devices})")
        return cls(name, int(n_devices), int(u), w)

    def positions(self, seq_len, layout):
        """(N, c): the global positions each device holds (its query shard)."""
        if self.u == 1:
            return positions(seq_len, self.n, layout)
        return ulysses_positions(seq_len, self.r, self.u, layout)

    def ring_group(self, g):
        """Device g's ring group: the ranks of its Ulysses rank, one per ring rank (its ring rank's order)."""
        return tuple(g % self.u + i * self.u for i in range(self.r))

    def ulysses_group(self, g):
        """Device g's Ulysses group: u consecutive ranks."""
        return tuple((g // self.u) * self.u + i for i in range(self.u))

    def double_ring_groups(self, g):
        """The double ring's three rings of device g, members in ring order:
        (inner, outer, home) (`reference.double_ring.groups`)."""
        return double_ring.groups(g, self.w, self.m)

    def sources(self):
        """(r, r): the ring rank whose block ring rank i holds in round t:
        (i - t) mod r (Algorithm 1), or the double ring's order."""
        t, i = np.ogrid[:self.r, :self.r]
        if self.name == "double_ring":
            return np.vectorize(double_ring.source)(i, t, self.w, self.m)
        return (i - t) % self.r

    def kv_copies(self, Hkv):
        """How many copies of each K/V head the all-to-all deals: u / Hkv where
        the K/V heads are fewer than u (a copy to each rank reading it), else 1."""
        return 1 if Hkv % self.u == 0 else self.u // Hkv

    def describe(self):
        return dict(scheme=self.name, ulysses_degree=self.u, **({"ring_inner": self.w} if self.w else {}))

    @property
    def label(self):
        """As tables print it: "ring", "all_gather", "ulysses (u=4)", "usp (u=2)", "double_ring (w=2)"."""
        return self.name + (f" (u={self.u})" if self.u > 1 else "") + (f" (w={self.w})" if self.w else "")


def _checked_int(name, value):
    """`value` as an int (None stays None), or a ValueError naming it."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return None if value is None else int(value)


class Comms(NamedTuple):
    """One device's communication objects: its ring group's and its Ulysses group's."""
    ring: object
    ulysses: object = None


def device_comms(scheme, g, group):
    """Device g's Comms under `scheme`, `group(members)` making its end of the
    ring of `members` (global ranks in ring order): the double ring's three
    rings as one ring (`reference.double_ring.DoubleRing`), or its ring group."""
    if scheme.name == "double_ring":
        ring = double_ring.DoubleRing(*(group(members) for members in scheme.double_ring_groups(g)))
    else:
        ring = group(scheme.ring_group(g))
    return Comms(ring, group(scheme.ulysses_group(g)))


# -- the per-device passes ---------------------------------------------------------

def forward(q, k, v, group_pos, comms, *, scheme, scale, tile_size, step, mask):
    """This device's (out (B,c,Hq,D), lse (B,Hq,c), RoundLog) under `scheme`.
    `group_pos`: the positions of the device's ring rank (its Ulysses group's
    shards in group order; its own shard's with u = 1)."""
    opts = dict(scale=scale, tile_size=tile_size, step=step, mask=mask)
    if scheme.name == "all_gather":
        return gather_forward(q, k, v, group_pos, comms.ring, **opts)
    if scheme.u == 1:
        return ring_forward(q, k, v, group_pos, group_pos, comms.ring, **opts)
    heads, copies = held_heads(comms.ulysses, q.shape[2]), scheme.kv_copies(k.shape[2])
    (q,) = to_heads(comms.ulysses, (q,))
    k, v = to_heads(comms.ulysses, (k, v), copies=copies)
    out, lse, log = ring_forward(q, k, v, group_pos, group_pos, comms.ring, heads=heads, **opts)
    (out,) = to_tokens(comms.ulysses, (out,))
    (lse,) = to_tokens(comms.ulysses, (lse,), seq_axis=2, head_axis=1)
    log.tally()                                # the all-to-all back, counted in the ring's last round
    return out, lse, log


def backward(q, k, v, out, lse, dout, group_pos, comms, *, scheme, scale, tile_size, step, mask):
    """This device's (dq, dk, dv, RoundLog) under `scheme`; arguments as `forward`.
    A K/V head's copies (`kv_copies`) return their dK, dV in the accumulation
    dtype and are summed in it, then rounded once to k's dtype."""
    opts = dict(scale=scale, tile_size=tile_size, step=step, mask=mask)
    if scheme.name == "all_gather":
        return gather_backward(q, k, v, out, lse, dout, group_pos, comms.ring, **opts)
    if scheme.u == 1:
        return ring_backward(q, k, v, out, lse, dout, group_pos, group_pos, comms.ring, **opts)
    heads, copies, kv_dtype = held_heads(comms.ulysses, q.shape[2]), scheme.kv_copies(k.shape[2]), k.dtype
    q_h, out, dout = to_heads(comms.ulysses, (q, out, dout))
    k_h, v_h = to_heads(comms.ulysses, (k, v), copies=copies)
    (lse,) = to_heads(comms.ulysses, (lse,), seq_axis=2, head_axis=1)
    grads_dtype = accumulate_dtype(kv_dtype) if copies > 1 else None
    dq, dk, dv, log = ring_backward(q_h, k_h, v_h, out, lse, dout, group_pos, group_pos, comms.ring, heads=heads,
                                    kv_grads_dtype=grads_dtype, **opts)
    (dq,) = to_tokens(comms.ulysses, (dq,))
    dk, dv = (x.astype(kv_dtype, copy=False) for x in to_tokens(comms.ulysses, (dk, dv), copies=copies))
    log.tally()
    return dq, dk, dv, log


# -- Ulysses: the all-to-all -------------------------------------------------------

def to_heads(a2a, arrays, *, seq_axis=1, head_axis=2, copies=1):
    """Each array's sequence shard of every head -> the group's whole sequence
    (its shards in group order) of this device's H x copies / u heads; with
    `copies`, each head repeated that many times first (K/V heads fewer than
    u: head h to the ranks of pieces h x copies ..)."""
    xp = array_module(arrays[0])
    out = []
    for x in arrays:
        x = xp.repeat(x, copies, axis=head_axis) if copies > 1 else x         # (B, c, H copies, D)
        pieces = np.array_split(np.arange(x.shape[head_axis]), a2a.size)
        got = a2a.all_to_all([_take(x, head_axis, p) for p in pieces])   # piece i: group rank i's heads
        out.append(xp.concatenate(got, axis=seq_axis))                   # (B, u c, H copies / u, D)
    return out


def held_heads(a2a, n_heads):
    """The global numbers of the query heads `to_heads` leaves on this device (piece a2a.rank)."""
    return np.array_split(np.arange(n_heads), a2a.size)[a2a.rank]


def to_tokens(a2a, arrays, *, seq_axis=1, head_axis=2, copies=1):
    """The inverse of `to_heads`: this device's heads of the group's sequence
    -> its own sequence shard of every head, each head's `copies` summed."""
    xp = array_module(arrays[0])
    out = []
    for x in arrays:
        pieces = np.array_split(np.arange(x.shape[seq_axis]), a2a.size)
        got = a2a.all_to_all([_take(x, seq_axis, p) for p in pieces])    # piece i: group rank i's tokens
        out.append(sum_copies(xp.concatenate(got, axis=head_axis), copies))   # (B, c, H, D)
    return out


def sum_copies(x, copies):
    """(B, c, H copies, D) -> (B, c, H, D): each head's copies (adjacent, as
    `to_heads` repeats them) summed, in x's dtype (dK, dV: the accumulation dtype)."""
    if copies == 1:
        return x
    B, c, H, D = x.shape
    return x.reshape(B, c, H // copies, copies, D).sum(axis=3)


def _take(x, axis, index):
    cut = [slice(None)] * x.ndim
    cut[axis] = slice(int(index[0]), int(index[-1]) + 1)
    return array_module(x).ascontiguousarray(x[tuple(cut)])


# -- the all-gather ------------------------------------------------------------------

def gather_blocks(block, comm, log):
    """Every device's K, V block, gathered with N - 1 shifts round the ring and
    kept (a shift's arrays are valid only until the second shift after it, so
    each is copied): [block from device (j - t) mod N for t in 0..N-1]."""
    blocks = [block]
    for t in log.rounds(comm.size - 1):
        handle = comm.start_shift(blocks[-1], KV)
        with log.waiting(t):
            arrived = comm.finish_shift(handle)
        blocks.append(KVBlock(*(array_module(a).array(a, copy=True) for a in arrived)))
    return blocks


def gather_forward(q, k, v, q_pos, comm, *, scale, tile_size, step, mask):
    """The all-gather's forward on this device: (out, lse, RoundLog), round t
    attending to the block of device (j - t) mod N, all gathered first."""
    log = RoundLog.of(comm, step, blocks=KV)
    queries = Queries.prepare(q, k.shape[2], q_pos, scale)
    blocks = gather_blocks(own_block(k, v, q_pos, comm.rank), comm, log)
    acc = ForwardAcc.zeros(queries.q)
    for t, block in enumerate(blocks):
        with turn(comm), log.computing(t):
            counts = step.forward(acc, queries, as_dtype(block, queries.q.dtype, step), mask=mask,
                                  tile_size=tile_size, progress=comm.progress)
        log.record(t, counts, block, kept=blocks)
    return end_forward(acc, q, log)


def gather_backward(q, k, v, out, lse, dout, q_pos, comm, *, scale, tile_size, step, mask):
    """The all-gather's backward on this device: every block's dK, dV computed
    here, then summed over the devices by a reduce-scatter round the ring
    (N - 1 shifts: in shift t device j sends its running sum for the block of
    device j - 1 - t and adds its own share to the sum arriving, so that after
    the last shift it holds the whole sum for its own block). (dq, dk, dv, RoundLog)."""
    n = comm.size
    log = RoundLog.of(comm, step, blocks=KV)
    queries, rows, dq = begin_backward(q, k, out, lse, dout, q_pos, scale)
    blocks = gather_blocks(own_block(k, v, q_pos, comm.rank), comm, log)
    shares = []                                                   # (dK, dV) of each gathered block
    for t, block in enumerate(blocks):
        grads = Grads(dq, *new_kv_grads(block, dq.dtype))
        with turn(comm), log.computing(t):
            counts = step.backward(grads, queries, rows, as_dtype(block, dq.dtype, step), mask=mask,
                                   tile_size=tile_size, progress=comm.progress)
        log.record(t, counts, block, kept=blocks)
        shares.append((grads.dk, grads.dv))
    total = shares[1 % n]                                         # the sum for device j - 1's block
    for t in log.rounds(n - 1):
        handle = comm.start_shift(total, DKV)
        with log.waiting(t):
            arrived = comm.finish_shift(handle)
        mine = shares[(t + 2) % n]                                # device j - 2 - t's block, or at last j's own
        total = (arrived[0] + mine[0], arrived[1] + mine[1])      # new arrays: the ones sent stay untouched
    return end_backward(dq, *total, (q, k, v), scale, log)
