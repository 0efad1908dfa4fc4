"""The adapter protocol and `check_ring_attention`: anyone's ring, held against the oracle.

An implementation is wrapped in an `Adapter`: it says which problems it takes
(layouts, dtypes, `supports`), where each rank's tokens sit (`positions`), the
precision its sums run in (`accumulate_dtype`), and runs a case on every rank's
shard (`run`). `check_ring_attention(adapter, case)` cuts the case's inputs
into shards, runs it, and holds every rank's out, lse, dq, dk, dv against the
float64 oracle with the error model's per-element tolerance (the package's
docstring has the whole example):

    check_ring_attention(Mine(), case)     # AssertionError naming the case and the first bad element

`VirtualRingAdapter` (this project's virtual ring) is the worked example.
"""

from dataclasses import dataclass

import numpy as np

from ..layouts import LAYOUTS, positions, unshard
from ..virtual import ring_attention, ring_attention_backward
from .cases import DTYPES, FORWARD, NAMES
from .compare import attention_mismatch
from .oracle import oracle, tolerances


@dataclass(frozen=True)
class Shards:
    """Each rank's inputs in its local order: q[r] (B, c, Hq, D), k[r], v[r]
    (B, c, Hkv, D), dout[r] like q[r]; positions[r] (c,) their global positions."""
    q: list
    k: list
    v: list
    dout: list
    positions: np.ndarray


class Unsupported(Exception):
    """An adapter cannot run this case (outside hypothesis, where it is skipped)."""


class Adapter:
    """What `check_ring_attention` needs to know about an implementation.

    Override `run`; the rest has defaults that describe this project's conventions:

    name           how messages name it;
    layouts        the layouts it runs (`positions` maps each to ranks' tokens);
    dtypes         the NumPy dtypes it takes;
    backward       whether `run` returns dq, dk, dv;
    replicated     names that every rank returns whole (natural order, not a shard):
                   every rank's copy must be the same, bit for bit;
    positions(case)         (N, c) int array: the global positions rank r holds, in its
                            local order (default `reference.positions`);
    accumulate_dtype(dtype) the dtype its sums run in (the error model's u_acc);
    supports(case)          None, or why it cannot run the case (skipped, not failed);
    run(case, shards)       one dict per rank with "out" (B, c, Hq, D) in the input dtype,
                            "lse" (B, Hq, c) natural log of the scaled scores' sum, and,
                            where `backward`, "dq", "dk", "dv" (gradients of
                            sum(out * dout), dk/dv on the rank that holds those keys),
                            query head h reading key/value head h // (Hq // Hkv).
    """
    name = "adapter"
    layouts = LAYOUTS
    dtypes = DTYPES
    backward = True
    replicated = ()

    def positions(self, case):
        return positions(case.S, case.n_devices, case.layout)

    def accumulate_dtype(self, dtype):
        return np.float64 if np.dtype(dtype) == np.float64 else np.float32

    def supports(self, case):
        if case.layout not in self.layouts:
            return f"layout {case.layout!r} not in {self.layouts}"
        if np.dtype(case.dtype) not in [np.dtype(d) for d in self.dtypes]:
            return f"dtype {np.dtype(case.dtype).name} not supported"
        return None

    def run(self, case, shards):
        raise NotImplementedError


def _skip(reason):
    """Reject the example under hypothesis (it draws another), raise Unsupported elsewhere."""
    try:
        from hypothesis import assume
        from hypothesis.control import currently_in_test_context
    except ImportError:
        raise Unsupported(reason) from None
    if currently_in_test_context():
        assume(False)
    raise Unsupported(reason)


def make_shards(case, pos):
    """The case's inputs cut into ranks' shards along the positions `pos` (N, c)."""
    q, k, v, dout = case.inputs()
    return Shards(*([np.ascontiguousarray(np.take(x, p, axis=1)) for p in pos] for x in (q, k, v, dout)),
                  positions=pos)


def _check_positions(pos, case):
    pos = np.asarray(pos)
    if pos.shape != (case.n_devices, case.c) or not np.array_equal(np.sort(pos.ravel()), np.arange(case.S)):
        raise AssertionError(f"positions must be a permutation of 0..{case.S - 1} as "
                             f"({case.n_devices}, {case.c}), got shape {pos.shape}")
    return pos


def check_ring_attention(adapter, case, *, model=None, names=None, usage=None):
    """Run `adapter` on `case` and hold each rank's out, lse, dq, dk, dv against
    the float64 oracle with the error model's per-element tolerance; replicated
    outputs must also agree between ranks. Raises AssertionError naming the
    adapter, the case and the first bad element. Returns the adapter's results.
    `usage`, a dict, collects per name the largest error / tolerance seen (how
    close to the line an implementation that agrees comes)."""
    reason = adapter.supports(case)
    if reason:
        _skip(reason)
    pos = _check_positions(adapter.positions(case), case)
    results = adapter.run(case, make_shards(case, pos))
    if len(results) != case.n_devices:
        raise AssertionError(f"{adapter.name}: run returned {len(results)} ranks' results, expected {case.n_devices}")
    names = names or (NAMES if adapter.backward else FORWARD)
    want = oracle(case)
    tol = tolerances(case, accumulate=adapter.accumulate_dtype(case.dtype), model=model)
    for name in names:
        problem = (_check_replicated(name, results, want, tol) if name in adapter.replicated
                   else _check_sharded(name, results, want, tol, pos, case))
        if usage is not None and not problem:
            usage[name] = max(usage.get(name, 0.0), _usage(name, results, want, tol, pos, adapter))
        if problem:
            raise AssertionError(f"{adapter.name} differs from the float64 oracle on\n  {case!r}\n  {problem}")
    return results


def _check_sharded(name, results, want, tol, pos, case):
    axis = 2 if name == "lse" else 1
    for r, got in enumerate(results):
        if name not in got:
            return f"{name}: rank {r} returned no {name!r}"
        x = got[name]
        if name != "lse" and np.dtype(x.dtype) != np.dtype(case.dtype):
            return f"{name}: rank {r} returned {np.dtype(x.dtype).name}, expected the input dtype {np.dtype(case.dtype).name}"
        msg = attention_mismatch(x, np.take(want[name], pos[r], axis=axis), np.take(tol[name], pos[r], axis=axis),
                                 name=name, positions=pos[r], rank=r)
        if msg:
            return msg
    return None


def _usage(name, results, want, tol, pos, adapter):
    """The largest error / tolerance over the finite expected elements of `name`."""
    axis = 2 if name == "lse" else 1
    pairs = ([(results[0][name], want[name], tol[name])] if name in adapter.replicated else
             [(got[name], np.take(want[name], p, axis=axis), np.take(tol[name], p, axis=axis))
              for got, p in zip(results, pos)])
    worst = 0.0
    for got, expected, t in pairs:
        finite = np.isfinite(expected)
        err = np.abs(np.asarray(got, np.float64) - expected)[finite]
        worst = max(worst, float((err / t[finite]).max(initial=0.0)))
    return worst


def _check_replicated(name, results, want, tol):
    first = np.asarray(results[0][name])
    for r, got in enumerate(results[1:], start=1):
        if not np.array_equal(np.asarray(got[name]), first, equal_nan=True):
            return f"{name}: rank {r}'s copy differs from rank 0's (replicated outputs must be identical)"
    return attention_mismatch(first, want[name], tol[name], name=name, rank=0)


class VirtualRingAdapter(Adapter):
    """`reference.ring_attention` (N virtual devices) as an adapter: the kit's example."""
    name = "reference.ring_attention"

    def run(self, case, shards):
        q, k, v, dout = (unshard(x, case.layout) for x in (shards.q, shards.k, shards.v, shards.dout))
        out, lse = ring_attention(q, k, v, **case.options())
        grads = ring_attention_backward(q, k, v, out, lse, dout, **case.options())
        full = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
        return [{name: np.take(x, shards.positions[r], axis=2 if name == "lse" else 1) for name, x in full.items()}
                for r in range(case.n_devices)]
