"""The messages of each scheme's pass, one row each, as `reference.scheme_cost` prices them.

`ring_moves` (the ring and the all-gather), `double_ring_moves` and
`all_to_all_moves` (Ulysses and USP) give (sent, received, src, dst, nbytes,
exposed[, departs, phase]) rows over the scheme's ranks 0..N-1; `Moves.of`
makes them arrays, `Moves.per_device` the (rounds, devices) bytes a trace
counts. `held_blocks_of`: the K/V blocks each device holds in each round.
"""

from typing import NamedTuple

import numpy as np

from .double_ring import held_blocks


class Moves(NamedTuple):
    """Every message of one pass, one entry each (arrays of one length): sent by
    device `src` in round `sent`, received by device `dst` in round `received`,
    `nbytes` long, `exposed` where no compute overlaps it (an all-to-all, the
    all-gather, the reduce-scatter). Devices are the scheme's ranks 0..N-1;
    which link a message crosses is the machine's to say (its placement of
    those ranks on nodes). `departs`: the first round it travels in, the
    round received for most; earlier for one posted at a round's start and
    received rounds later (the double ring's outer block), whose time on its
    link the rounds from `departs` to `received` share. `phase`: of exposed
    messages in one round, those of a later phase wait for the earlier ones
    (an all-to-all before the ring's rounds 0, the hop home 1, the all-to-all
    after the last round 2); those of one phase travel at once."""
    sent: np.ndarray
    received: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    exposed: np.ndarray
    departs: np.ndarray
    phase: np.ndarray

    @classmethod
    def of(cls, rows):
        """From (sent, received, src, dst, nbytes, exposed[, departs[, phase]])
        tuples (departs, left out: the round received; phase: 0)."""
        rows = [(tuple(row) + (row[1], 0)[len(row) - 6:]) for row in rows]
        cols = list(zip(*rows)) if rows else [()] * 8
        return cls(*(np.asarray(col, dtype=bool if i == 5 else np.int64) for i, col in enumerate(cols)))

    def per_device(self, shape, *, by="src", where=None):
        """(r, N) bytes: sent (by="src", counted in the round sent) or received
        (by="dst", in the round received), of the messages `where` selects (all)."""
        out = np.zeros(shape, dtype=np.int64)
        keep = np.ones(len(self.nbytes), bool) if where is None else where
        rounds = self.sent if by == "src" else self.received
        np.add.at(out, (rounds[keep], getattr(self, by)[keep]), self.nbytes[keep])
        return out


def held_blocks_of(scheme):
    """(r, N): K/V blocks each device holds in each round: the block attended
    to and the one arriving (the ring: one in the last round), all N (the
    all-gather), the double ring's `held_blocks`."""
    t = np.arange(scheme.r)[:, None]
    if scheme.name == "all_gather":
        held = np.full(t.shape, scheme.n)
    elif scheme.name == "double_ring":
        held = np.array([[held_blocks(x, scheme.w, scheme.m)] for x in range(scheme.r)])
    else:
        held = np.where(t == scheme.r - 1, 1, 2)
    return np.broadcast_to(held, (scheme.r, scheme.n)).astype(np.int64)


def ring_moves(scheme, block, dkv):
    """The ring group's messages: (sent, received, src, dst, nbytes, exposed) rows.
    The ring: a block to the next ring rank in every round but the last,
    overlapped; with `dkv` (the backward) dK, dV after every round, received
    in the next (the last round's, the hop home, in the same round, exposed:
    no compute is left to hide it). The
    all-gather: the same blocks, exposed; its reduce-scatter's dK, dV in the
    same rounds, each shift a message of its own (after all the compute)."""
    n, u, r = scheme.n, scheme.u, scheme.r
    rows = []
    for g in range(n):
        nxt = (g + u) % n                                              # the next rank of g's ring group
        for t in range(r - 1):
            if scheme.name == "all_gather":
                rows += [(t, t, g, nxt, nbytes, True) for nbytes in (block, dkv) if nbytes]
            else:
                rows.append((t, t, g, nxt, block, False))
        if dkv and r > 1 and scheme.name != "all_gather":
            rows += [(t, min(t + 1, r - 1), g, nxt, dkv, t == r - 1, min(t + 1, r - 1), 1)
                     for t in range(r)]                                        # home: after all compute
    return rows


def double_ring_moves(scheme, block, dkv):
    """The double ring's messages (`reference.double_ring`), rows as `ring_moves`:
    in round t = j w + s of device (o, i) a block to (o, i + 1) while s < w - 1,
    and at s = 0 of a step but the last one to (o + 1, i), received at the
    step's end (s = w - 1), travelling through the step's rounds, all overlapped; with `dkv`, dK, dV after every round
    to the device holding the block next, (o, i + 1), or (o + 1, i + 1) at a
    step's end, received in the next round (the hop home in the last, exposed)."""
    n, w, m = scheme.n, scheme.w, scheme.m
    rows = []
    for g in range(n):
        o, i = divmod(g, w)
        inner, outer, home = o * w + (i + 1) % w, (o + 1) % m * w + i, (o + 1) % m * w + (i + 1) % w
        for t in range(n - 1):
            j, s = divmod(t, w)
            if s < w - 1:
                rows.append((t, t, g, inner, block, False))
            if s == 0 and j < m - 1:
                rows.append((t, t + w - 1, g, outer, block, False, t))     # travels through the step
        if dkv and n > 1:
            rows += [(t, min(t + 1, n - 1), g, inner if t % w < w - 1 else home, dkv, t == n - 1, min(t + 1, n - 1), 1)
                     for t in range(n)]
    return rows


def all_to_all_moves(scheme, t, nbytes, phase):
    """An all-to-all of `nbytes` per device in round t: each device sends 1 / u
    of it to each other member of its Ulysses group, exposed."""
    piece = nbytes / scheme.u
    rows = []
    for g in range(scheme.n):
        others = [h for h in scheme.ulysses_group(g) if h != g]
        sizes = np.diff(np.round(np.arange(len(others) + 1) * piece)).astype(np.int64)   # adds up exactly
        rows += [(t, t, g, h, int(b), True, t, phase) for h, b in zip(others, sizes)]
    return rows
