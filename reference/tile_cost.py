"""What a tile costs on this machine, measured: the compute side of the scheme cost model.

`reference.scheme_cost` counts each device's tiles per round; flops (4 D an
entry forward, 10 D backward) charge every tile alike and the backward 2.5
times the forward. On a CPU neither holds, so `TileCosts.measure` times the
step the ranks run (one BLAS thread) at each `StepShape` (the heads a device
holds, its block of u c tokens, the tile; both passes) and keeps per pass
(`PassCost`):

- ``full``: seconds per tile of a block whose keys are all visible;
- ``masked``: seconds per tile a mask crosses, from a striped (triangular)
  block, less its full tiles at ``full``;
- ``first``: what the own block (round 0) costs beyond its tiles: each row's
  first tile (no running max yet), what a step works out once and keeps.

A round on a device costs ``full x its full tiles + masked x its masked tiles
(+ first on its own block)``: `TileCosts.seconds`, (r, N) as `SchemeCost`
counts them. Ranks that share a machine's cores pay more (`Sharing`,
measured by `bench.sharing`). The blocks: device 1 of two on S = 2 u c
tokens, its own block then device 0's, each its least CPU time over the
repeats, taking turns. Figures and how they were found:
docs/notes/tile-cost-model.md.

    tiles = TileCosts.measure([cost.step_shape for cost in scheme_costs])
    tiles.seconds(cost)                     # (r, N) compute seconds per round and device
    tiles.save("bench/results/tile_costs.json"); TileCosts.load(...)
"""

import datetime
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from . import steps
from .cores import blas_description, blas_limit
from .heads import accumulate_dtype
from .layouts import positions
from .ring import own_block
from .scheme_cost import StepShape
from .step import BackwardRows, ForwardAcc, Grads, Queries, finish_forward
from .tiles import FULL, MASKED, Tile, classify

KINDS = ("own", "full", "striped")      # the calibration blocks: round 0's, a full one, a triangular one


class PassCost(NamedTuple):
    """CPU seconds of one pass at one StepShape (module docstring)."""
    full: float         # per full tile
    masked: float       # per tile a mask crosses
    first: float        # the own block's extra, once per round 0


@dataclass
class Sharing:
    """What ranks sharing one machine's cores add to each rank's CPU time in
    the step (measured by `bench.sharing` in one launch of `ranks` ranks):
    ``factor[busy, backward]``, the step's CPU time while `busy` ranks compute
    at once over its time alone (caches, the scheduler, idle ranks waking to
    test for their block; the busiest rank's, as a critical path takes it),
    and the CPU seconds each byte of a ring transfer in flight adds to the
    step that moves it (MPI moves a message only inside its calls: the
    step's `progress` tests it and copies it)."""
    cores: int
    ranks: int
    factor: dict                # (busy ranks, backward) -> factor
    copy_s_per_byte: float

    def seconds(self, alone, cost):
        """(r, N) CPU seconds of `cost`'s rounds on ranks sharing the cores,
        from `alone` (r, N), each rank's seconds with a core of its own."""
        busy = (cost.work.tiles_computed > 0).sum(axis=1)                   # (r,) ranks computing
        if busy.max() > self.ranks:
            raise ValueError(f"sharing measured with up to {self.ranks} ranks busy, not {busy.max()}")
        backward = cost.step_shape.backward
        factor = np.array([self.factor[max(int(b), 1), backward] for b in busy])     # (r,)
        moves, shape = cost.moves, alone.shape
        moved = (moves.per_device(shape, by="src", where=~moves.exposed)
                 + moves.per_device(shape, by="dst", where=~moves.exposed))     # (r, N): overlapped, both ways
        return alone * factor[:, None] + moved * self.copy_s_per_byte

    def as_dict(self):
        return dict(cores=self.cores, ranks=self.ranks, copy_s_per_byte=self.copy_s_per_byte,
                    factor=[[busy, backward, f] for (busy, backward), f in sorted(self.factor.items())])

    @classmethod
    def of_dict(cls, doc):
        factor = {(int(busy), bool(backward)): f for busy, backward, f in doc["factor"]}
        return cls(doc["cores"], doc["ranks"], factor, doc["copy_s_per_byte"])


@dataclass
class TileCosts:
    """Measured `PassCost`s by StepShape (its `backward` says the pass), what
    they were measured on, and optionally the `Sharing` of ranks on one machine."""
    costs: dict                             # StepShape -> PassCost
    machine: dict = field(default_factory=dict)     # step, blas, repeats, date
    sharing: Sharing = None                 # None: a core per rank

    def seconds(self, cost):
        """(r, N) compute seconds per round and device of `cost` (a
        `reference.scheme_cost.SchemeCost`), from its full and masked tiles
        (and, with `sharing`, as ranks sharing the cores measure them)."""
        per = self.pass_cost(cost.step_shape)
        work = cost.work
        masked = work.tiles_masked
        full = work.tiles_computed - masked
        home = np.arange(work.source.shape[1]) // cost.scheme.u     # device g is ring rank g // u
        own = (work.source == home[None, :]) & (work.tiles_computed > 0)
        alone = full * per.full + masked * per.masked + own * per.first
        return alone if self.sharing is None else self.sharing.seconds(alone, cost)

    def critical_path(self, cost):
        """Sum over rounds of the busiest device's predicted seconds."""
        return float(self.seconds(cost).max(axis=1).sum())

    def pass_cost(self, shape):
        """The PassCost of a StepShape, or a ValueError naming it."""
        if shape is None:
            raise ValueError("the SchemeCost records no step_shape: predict it with reference.scheme_cost.predict_scheme")
        try:
            return self.costs[shape]
        except KeyError:
            raise ValueError(f"no tile costs measured for {shape}: TileCosts.measure([...that shape...]) first; "
                             f"measured: {sorted(set(self.costs), key=str)}") from None

    def backward_ratio(self, shape):
        """A full tile's backward over its forward, at `shape` (either pass)."""
        fwd, bwd = (self.pass_cost(shape._replace(backward=b)).full for b in (False, True))
        return bwd / fwd

    @classmethod
    def measure(cls, shapes, *, step="auto", repeats=5, seed=0):
        """TileCosts of both passes at each StepShape of `shapes` (its pass
        ignored), with `step` (the ranks' default: "auto") on one BLAS thread,
        the least CPU time of each block over `repeats`."""
        shapes = sorted({s._replace(backward=False) for s in shapes}, key=str)
        if not shapes:
            raise ValueError("measure needs at least one StepShape")
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        step = steps.get(step, xp=np)
        rng = np.random.default_rng(seed)
        with blas_limit(1):
            blocks = {s: Calibration.of(s, rng) for s in shapes}
            best = {}
            for _ in range(repeats):
                for s, blocks_of in blocks.items():
                    for key, seconds in blocks_of.timed(step).items():
                        best[s, key] = min(best.get((s, key), np.inf), seconds)
            machine = dict(step=step.label, blas=blas_description(), repeats=repeats,
                           date=datetime.date.today().isoformat())
        costs = {}
        for s in shapes:
            for backward in (False, True):
                times = {kind: best[s, (kind, backward)] for kind in KINDS}
                costs[s._replace(backward=backward)] = blocks[s].fit(times)
        return cls(costs, machine)

    def save(self, path):
        rows = [dict(shape._asdict(), tile=list(shape.tile), **per._asdict()) for shape, per in self.costs.items()]
        doc = dict(machine=self.machine, costs=rows, sharing=self.sharing and self.sharing.as_dict())
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")

    @classmethod
    def load(cls, path):
        doc = json.loads(Path(path).read_text())
        costs = {}
        for row in doc["costs"]:
            per = PassCost(*(row.pop(name) for name in PassCost._fields))
            costs[StepShape(**dict(row, tile=Tile(*row["tile"])))] = per
        sharing = doc.get("sharing")
        return cls(costs, doc.get("machine", {}), sharing and Sharing.of_dict(sharing))


@dataclass
class Calibration:
    """The blocks of one StepShape: device 1 of two, its queries against its
    own block (round 0) and device 0's, contiguous and striped."""
    shape: StepShape
    q: np.ndarray               # (B, c, H, D)
    k: np.ndarray               # (B, c, Hkv, D), device 1's; device 0's in k0, v0
    v: np.ndarray
    k0: np.ndarray
    v0: np.ndarray
    do: np.ndarray              # (B, Hkv, c, G, D): dO in the step's layout
    counts: dict                # kind -> (full tiles, masked tiles)

    @classmethod
    def of(cls, shape, rng):
        s = shape
        dtype = np.dtype(s.dtype)

        def draw(heads):
            return rng.standard_normal((s.B, s.block, heads, s.D)).astype(dtype)

        q, k, v, k0, v0 = draw(s.heads), draw(s.kv_heads), draw(s.kv_heads), draw(s.kv_heads), draw(s.kv_heads)
        acc = accumulate_dtype(dtype)
        do = rng.standard_normal((s.B, s.kv_heads, s.block, s.heads // s.kv_heads, s.D)).astype(acc)
        counts = {}
        for kind, (q_pos, k_pos) in cls.pairs(s.block).items():
            kinds = classify(q_pos, k_pos, s.tile)
            counts[kind] = (int((kinds == FULL).sum()), int((kinds == MASKED).sum()))
        return cls(shape, q, k, v, k0, v0, do, counts)

    @staticmethod
    def pairs(block):
        """{kind: (query positions, key positions)} of device 1 of two."""
        contiguous, striped = (positions(2 * block, 2, name) for name in ("contiguous", "striped"))
        return {"own": (contiguous[1], contiguous[1]), "full": (contiguous[1], contiguous[0]),
                "striped": (striped[1], striped[0])}

    def blocks(self, layout):
        """(Queries, own block, the other block) of device 1 under `layout`:
        contiguous (the other block full) or striped (triangular)."""
        q_pos, k_pos = self.pairs(self.shape.block)["full" if layout == "contiguous" else "striped"]
        queries = Queries.prepare(self.q, self.shape.kv_heads, q_pos, self.shape.D ** -0.5)
        return queries, own_block(self.k, self.v, q_pos, 1), own_block(self.k0, self.v0, k_pos, 0)

    def timed(self, step):
        """{(kind, backward): CPU seconds} of one run of every block, both passes."""
        out, tile = {}, self.shape.tile
        for layout, other in (("contiguous", "full"), ("striped", "striped")):
            queries, own, block = self.blocks(layout)
            acc = ForwardAcc.zeros(queries.q)
            seconds = [_cpu(step.forward, acc, queries, b, tile_size=tile, causal=True) for b in (own, block)]
            out[other, False] = seconds[1]
            rows, dq = self.rows(acc, queries), np.zeros_like(queries.q)
            for kind, b in (("own", own), (other, block)):
                grads = Grads(dq, np.zeros_like(b.k, dtype=dq.dtype), np.zeros_like(b.v, dtype=dq.dtype))
                seconds_b = _cpu(step.backward, grads, queries, rows, b, tile_size=tile, causal=True)
                if kind == other or layout == "contiguous":
                    out[kind, True] = seconds_b
            if layout == "contiguous":
                out["own", False] = seconds[0]
        return out

    def rows(self, acc, queries):
        """BackwardRows from the forward just run: the lse and delta a real backward sees."""
        out, lse = finish_forward(acc)                          # (B, Hkv, c, G, D), (B, Hkv, c, G)
        rows = BackwardRows(do=self.do, lse=np.where(np.isneginf(lse), 0.0, lse).astype(queries.q.dtype),
                            delta=(self.do * out).sum(axis=-1))
        rows.finite = True
        return rows

    def fit(self, times):
        """The PassCost from {kind: seconds} of the three blocks."""
        (nf, _), (sf, sm), (of, om) = (self.counts[kind] for kind in ("full", "striped", "own"))
        full = times["full"] / nf
        masked = (times["striped"] - sf * full) / sm
        return PassCost(full, masked, times["own"] - of * full - om * masked)


def _cpu(fn, *args, **kwargs):
    start = time.thread_time()
    fn(*args, **kwargs)
    return time.thread_time() - start
