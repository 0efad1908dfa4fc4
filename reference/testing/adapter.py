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

from ..layouts import LAYOUTS, positions, shard_at, unshard_at
from ..schemes import Scheme
from ..virtual import ring_attention, ring_attention_backward
from .cases import ALL_DTYPES, DROPOUT, FORWARD, MASKS, NAMES, PLAIN, heads_fit
from .compare import BFLOAT16, attention_mismatch, used_fraction
from .oracle import accumulation, oracle, tolerances


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
    dtypes         the dtypes it takes (NumPy's, and ml_dtypes.bfloat16);
    masks          the masks it takes, names of `MASKS`: causal, full, window,
                   cu_seqlens, segment_ids, padding (default causal and full), and
                   of `DROPOUT`, where it draws `reference.masks`' keep mask;
    no_key_mask    None (it masks padding keys), or why it takes padding only with
                   the causal mask: it takes no key mask, so every query of a full
                   case would see the padding keys (causal, they come after every
                   real query and none sees them);
    backward       whether `run` returns dq, dk, dv;
    outputs        the names `run` returns (default all five; an entry point that
                   gives no lse: ("out", "dq", "dk", "dv"));
    replicated     names that every rank returns whole (natural order, S tokens, not
                   a shard): every rank's copy must be the same, bit for bit;
    world_sizes    the N the command line runs by default;
    positions(case)         (N, c) int array: the global positions rank r holds, in its
                            local order: any permutation of 0..P-1 (default
                            `reference.positions`; a varlen ring may deal each document
                            apart, zigzag within each, for example);
    accumulate_dtype(dtype) the dtype its sums run in (the error model's u_acc; default
                            float32, float64 for float64 inputs);
    flushes_subnormals  whether its arithmetic flushes subnormals to zero (XLA on a
                   CPU does): the line then adds what that drops (`oracle`);
    shape_pool     cases per world size drawn from this many shapes (B, S, heads,
                   D, tile, scale), masks, dtypes and inputs still varying (0, the
                   default: each case its own shape); for rings that compile per
                   shape (`cases(shapes=...)`);
    document_multiple(n)    what every document's length must be a multiple of (default 1);
    head_multiple(n)        what both head counts must be a multiple of (default 1; Ulysses
                            deals heads to ranks: u = N, or the degree in USP);
    replicates_kv_heads     whether it also takes fewer KV heads than head_multiple(n), a
                            divisor of it (MQA included), each replicated to the ranks whose
                            query heads read it and its dK, dV summed back (default False);
    supports(case)          None, or why it cannot run the case (skipped, not failed);
    run(case, shards)       one dict per rank with "out" (B, c, Hq, D) in the input dtype,
                            "lse" (B, Hq, c) natural log of the scaled scores' sum, and,
                            where `backward`, "dq", "dk", "dv" (gradients of
                            sum(out * dout), dk/dv on the rank that holds those keys),
                            query head h reading key/value head h // (Hq // Hkv).
                            Results at padding positions (>= S) are not checked.
    """
    name = "adapter"
    layouts = LAYOUTS
    dtypes = ALL_DTYPES
    masks = PLAIN
    backward = True
    outputs = NAMES
    replicated = ()
    world_sizes = (1, 2, 3, 4)
    flushes_subnormals = False
    replicates_kv_heads = False
    shape_pool = 0
    no_key_mask = None

    def positions(self, case):
        return positions(case.S, case.n_devices, case.layout)

    def accumulate_dtype(self, dtype):
        return accumulation(dtype)

    def document_multiple(self, n_devices):
        return 1

    def head_multiple(self, n_devices):
        return 1

    def supports(self, case):
        if self.no_key_mask and case.padded > case.S and not case.causal:
            return self.no_key_mask
        if case.layout not in self.layouts:
            return f"layout {case.layout!r} not in {self.layouts}"
        heads = self.head_multiple(case.n_devices)
        if not heads_fit(case.Hq, case.Hkv, heads, self.replicates_kv_heads):
            return (f"heads Hq={case.Hq}, Hkv={case.Hkv} not dealt to {heads} ranks (Hq a multiple of {heads}, "
                    f"Hkv a multiple" + (" or a divisor" if self.replicates_kv_heads else "") + ")")
        if np.dtype(case.dtype) not in [np.dtype(d) for d in self.dtypes]:
            return f"dtype {np.dtype(case.dtype).name} not supported"
        missing = [m for m in case.masks if m not in self.masks]
        if missing:
            return f"mask {', '.join(missing)} not supported (takes {', '.join(self.masks)})"
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
    """The case's inputs (padded to P) cut into ranks' shards along the positions `pos` (N, c)."""
    q, k, v, dout = case.inputs(padded=True)
    return Shards(*([np.ascontiguousarray(np.take(x, p, axis=1)) for p in pos] for x in (q, k, v, dout)),
                  positions=pos)


def _check_positions(pos, case):
    pos = np.asarray(pos)
    if pos.shape != (case.n_devices, case.c) or not np.array_equal(np.sort(pos.ravel()), np.arange(case.padded)):
        raise AssertionError(f"positions must be a permutation of 0..{case.padded - 1} as "
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
    results = _results(adapter, adapter.run(case, make_shards(case, pos)), case)
    names = [name for name in names or (NAMES if adapter.backward else FORWARD) if name in adapter.outputs]
    want = oracle(case)
    tol = tolerances(case, accumulate=adapter.accumulate_dtype(case.dtype), model=model,
                     flush=getattr(adapter, "flushes_subnormals", False))
    for name in names:
        check = _check_replicated if name in adapter.replicated else _check_sharded
        problem, used = check(name, results, want[name], tol[name], pos, case)
        if problem:
            raise AssertionError(f"{adapter.name} differs from the float64 oracle on\n  {case!r}\n  {problem}")
        if usage is not None:
            usage[name] = max(usage.get(name, 0.0), used)
    return results


def _results(adapter, results, case):
    """`run`'s results, or an AssertionError naming the adapter and what `run` must return."""
    want = (f"{adapter.name}: run must return a list of {case.n_devices} dicts, one per rank, "
            f"mapping {', '.join(repr(n) for n in adapter.outputs)} to that rank's arrays")
    if not isinstance(results, (list, tuple)):
        raise AssertionError(f"{want}; it returned {type(results).__name__}")
    if len(results) != case.n_devices:
        raise AssertionError(f"{want}; it returned {len(results)} ranks' results")
    odd = [r for r, got in enumerate(results) if not isinstance(got, dict)]
    if odd:
        raise AssertionError(f"{want}; rank {odd[0]}'s is a {type(results[odd[0]]).__name__}")
    return results


def _returned(name, results, case, shape):
    """Each rank's `name` as a NumPy array of `shape` and the right dtype, or the problem in words."""
    arrays = []
    for r, got in enumerate(results):
        if name not in got:
            return None, f"{name}: rank {r} returned no {name!r}"
        x = np.asarray(got[name])
        if name != "lse" and np.dtype(x.dtype) != np.dtype(case.dtype):
            return None, (f"{name}: rank {r} returned {np.dtype(x.dtype).name}, expected the input dtype "
                          f"{np.dtype(case.dtype).name}")
        if x.dtype.kind != "f" and x.dtype != BFLOAT16:          # (ml_dtypes' kind is "V")
            return None, f"{name}: rank {r} returned {x.dtype} values, expected floats"
        if x.shape != shape:
            return None, f"{name}: rank {r} returned shape {x.shape}, expected {shape}"
        arrays.append(x)
    return arrays, None


def _shape(name, case, tokens):
    heads = case.Hkv if name in ("dk", "dv") else case.Hq
    return (case.B, heads, tokens) if name == "lse" else (case.B, tokens, heads, case.D)


def _check_sharded(name, results, want, tol, pos, case):
    """(the first rank's mismatch or None, the largest error / tolerance) of a
    sharded output, over each rank's real tokens (padding is the ring's own)."""
    arrays, problem = _returned(name, results, case, _shape(name, case, case.c))
    if problem:
        return problem, None
    axis = 2 if name == "lse" else 1
    used = 0.0
    for r, (x, p) in enumerate(zip(arrays, pos)):
        real = np.flatnonzero(p < case.S)                  # local indices of real tokens
        got, expected, t = np.take(x, real, axis=axis), np.take(want, p[real], axis=axis), np.take(tol, p[real], axis=axis)
        problem = attention_mismatch(got, expected, t, name=name, positions=p[real], rank=r, local=real)
        if problem:
            return problem, None
        used = max(used, used_fraction(got, expected, t))
    return None, used


def _check_replicated(name, results, want, tol, pos, case):
    """The same for an output every rank returns whole, in natural order: the
    copies must be identical, bit for bit."""
    arrays, problem = _returned(name, results, case, _shape(name, case, case.S))
    if problem:
        return problem, None
    for r, x in enumerate(arrays[1:], start=1):
        if not np.array_equal(x, arrays[0], equal_nan=True):
            return f"{name}: rank {r}'s copy differs from rank 0's (replicated outputs must be identical)", None
    problem = attention_mismatch(arrays[0], want, tol, name=name, rank=0)
    return problem, None if problem else used_fraction(arrays[0], want, tol)


class VirtualRingAdapter(Adapter):
    """`reference.ring_attention` (N virtual devices) as an adapter: the kit's example.
    It takes every mask: the shards are put back in natural order (padding
    dropped), and the results dealt out again (padding tokens' results zero);
    its positions are the layout's (the default), or the scheme's.

    `scheme`, `ulysses_degree`, `ring_inner`: one of `reference.schemes.SCHEMES`
    (the ring by default), as `ring_attention` takes them; Ulysses deals query
    heads over its u devices, and K/V heads a multiple of u or a divisor of it
    (each then replicated: `replicates_kv_heads`), so the kit draws both;
    USP runs on the world sizes u divides, the double ring on those w divides."""
    name = "reference.ring_attention"
    masks = MASKS + DROPOUT
    scheme, ulysses_degree, ring_inner = "ring", None, None

    def __init__(self, scheme="ring", ulysses_degree=None, ring_inner=None):
        if scheme != "ring":
            self.scheme, self.ulysses_degree, self.ring_inner = scheme, ulysses_degree, ring_inner
            given = [f"{name}={value}" for name, value in (("ulysses_degree", ulysses_degree),
                                                           ("ring_inner", ring_inner)) if value]
            self.name += f"(scheme={scheme!r}" + "".join(f", {x}" for x in given) + ")"
        self.replicates_kv_heads = scheme in ("ulysses", "usp")
        if scheme == "usp" or scheme == "double_ring":
            multiple = ulysses_degree if scheme == "usp" else ring_inner
            self.world_sizes = tuple(n for n in Adapter.world_sizes if n % multiple == 0)

    def degree(self, n_devices):
        """u on N devices: N for Ulysses, the given degree for USP, 1 otherwise."""
        return n_devices if self.scheme == "ulysses" else self.ulysses_degree or 1

    def head_multiple(self, n_devices):
        return self.degree(n_devices)

    def plan(self, case):
        return Scheme(self.scheme, case.n_devices, self.degree(case.n_devices), self.ring_inner)

    def positions(self, case):
        return self.plan(case).positions(case.S, case.layout)

    def supports(self, case):
        u, w = self.degree(case.n_devices), self.ring_inner or 1
        if case.n_devices % u:
            return f"scheme {self.scheme!r} with ulysses_degree {u} needs N a multiple of {u}"
        if case.n_devices % w:
            return f"scheme {self.scheme!r} with ring_inner {w} needs N a multiple of {w}"
        return super().supports(case)

    def options(self, case):
        """The scheme's keyword arguments of `ring_attention` for `case`."""
        u = None if self.scheme in ("ring", "all_gather", "double_ring") else self.degree(case.n_devices)
        return dict(scheme=self.scheme, ulysses_degree=u, ring_inner=self.ring_inner)

    def run(self, case, shards):
        pos = shards.positions
        q, k, v, dout = (unshard_at(x, pos, case.S) for x in (shards.q, shards.k, shards.v, shards.dout))
        options = dict(case.options(), **self.options(case))
        out, lse = ring_attention(q, k, v, **options)
        grads = ring_attention_backward(q, k, v, out, lse, dout, **options)
        full = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
        dealt = {name: shard_at(x, pos, axis=2 if name == "lse" else 1) for name, x in full.items()}
        return [{name: x[r] for name, x in dealt.items()} for r in range(case.n_devices)]
