"""One step timed on one block: the measurements of `bench.kernel`.

A problem of S tokens held by one device as one block (q_pos = k_pos = 0 .. S-1),
the step's forward and backward timed as a ring round calls them, checked
against float64 dense attention on a sample of rows first; the peak memory of
both passes; what one tile's operations cost on one thread.
"""

import time
import tracemalloc
from dataclasses import dataclass

import numpy as np

from reference import attention, attention_backward
from reference.heads import q_from_heads, rows_from_heads
from reference.cores import blas_limit
from reference.ring import own_block
from reference.step import BackwardRows, ForwardAcc, Grads, Queries, finish_forward
from reference.tiles import count_visible_pairs
from reference.tms import attention_flops

from .machine import best_time

HEADS, TARGET_S, TARGET_D = 8, 8192, 64


@dataclass
class Problem:
    """One device holding all S tokens as one block (q_pos = k_pos = 0 .. S-1),
    in the step's own types, and the user-layout inputs for the float64 check."""
    queries: object
    block: object
    user: tuple          # q, k, v, dout (1, S, H, D) float32

    @property
    def pos(self):
        return self.queries.pos


def problem(S, D, heads=HEADS, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((1, S, heads, D), dtype=np.float32) for _ in range(4))
    pos = np.arange(S)
    return Problem(Queries.prepare(q, heads, pos, D ** -0.5), own_block(k, v, pos, 0), (q, k, v, do))


def forward(step, pb, tile):
    """One single-device forward: (out, lse, seconds spent in the step)."""
    acc = ForwardAcc.zeros(pb.queries.q)
    t = time.perf_counter()
    step.forward(acc, pb.queries, pb.block, causal=True, tile_size=tile)
    seconds = time.perf_counter() - t
    return (*finish_forward(acc), seconds)


def backward(step, pb, out, lse, tile):
    """One single-device backward: (dq, dk, dv, seconds spent in the step)."""
    q, k, v, do = pb.user
    rows = BackwardRows.prepare(q_from_heads(out), rows_from_heads(lse), do, k.shape[2], np.float32)
    grads = Grads(np.zeros_like(pb.queries.q), np.zeros_like(pb.block.k), np.zeros_like(pb.block.v))
    t = time.perf_counter()
    step.backward(grads, pb.queries, rows, pb.block, causal=True, tile_size=tile)
    return grads.dq, grads.dk, grads.dv, time.perf_counter() - t


CHECK_ROWS = 32     # query rows checked against float64 dense attention (dense on those rows only)


def check_error(pb, out, lse, dq, D):
    """Largest error of out and of dQ on a sample of query rows against float64
    dense attention, relative to the largest reference value."""
    q, k, v, do = (x.astype(np.float64) for x in pb.user)
    S = q.shape[1]
    rows = np.unique(np.linspace(0, S - 1, CHECK_ROWS).astype(int))
    ref_out, ref_lse = attention(q[:, rows], k, v, q_pos=rows, k_pos=np.arange(S))
    ref_dq = attention_backward(q[:, rows], k, v, ref_out, ref_lse, do[:, rows],
                                q_pos=rows, k_pos=np.arange(S))[0]
    got_out, got_dq = q_from_heads(out)[:, rows], q_from_heads(dq)[:, rows] * np.float32(D ** -0.5)
    errors = [np.abs(got_out - ref_out).max() / np.abs(ref_out).max(),
              np.abs(got_dq - ref_dq).max() / np.abs(ref_dq).max()]
    return max(float(e) if np.isfinite(e) else np.inf for e in errors)      # NaN counts as infinite


def kernel_point(S, D, tile, repeats, rate, step):
    """One row: seconds in the step (the O(S D) set-up and finish outside it),
    fraction of the matmul rate, and the error against float64 on sampled rows."""
    pb = problem(S, D)
    out, lse, _ = forward(step, pb, tile)                            # also warms up
    error = check_error(pb, out, lse, backward(step, pb, out, lse, tile)[0], D)
    t_f = min(forward(step, pb, tile)[-1] for _ in range(repeats))
    t_b = min(backward(step, pb, out, lse, tile)[-1] for _ in range(repeats))
    pairs = count_visible_pairs(pb.pos, pb.pos) * HEADS
    flops_f, flops_b = attention_flops(pairs, D), attention_flops(pairs, D, backward=True)
    return dict(S=S, D=D, tile=tile, step=f"step {step.label}", fwd_s=t_f, bwd_s=t_b, error=error,
                fwd=flops_f / t_f / rate, bwd=flops_b / t_b / rate,
                fwd_gflops=flops_f / t_f / 1e9, bwd_gflops=flops_b / t_b / 1e9)


def peak_memory(S, step, D=TARGET_D, tile=None):
    """Peak bytes NumPy allocates during one single-device forward, and backward,
    beyond their inputs (tracemalloc sees NumPy's array buffers): the whole
    pass, accumulators and outputs included."""
    pb = problem(S, D)
    peaks = []
    for run in ("forward", "backward"):
        if run == "backward":
            out, lse, _ = forward(step, pb, tile)
        tracemalloc.start()
        if run == "forward":
            forward(step, pb, tile)
        else:
            backward(step, pb, out, lse, tile)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    return peaks


def tile_costs(T=256, D=TARGET_D, repeats=20):
    """Seconds per visible pair of each operation of one T x T tile on one thread:
    what the NumPy step does (first rows) and the passes it avoids (last rows)."""
    rng = np.random.default_rng(0)
    q1 = rng.standard_normal((T, D + 1), dtype=np.float32) * 0.1
    k1 = rng.standard_normal((T, D + 1), dtype=np.float32) * 0.1
    s, s0 = np.empty((T, T), np.float32), rng.random((T, T), dtype=np.float32)
    inc, col = np.empty((T, D + 1), np.float32), rng.random((T, 1), dtype=np.float32)
    hidden = ~(np.arange(T)[:, None] >= np.arange(T)[None, :])
    ops = [("S - m = [Q, -m] [K, 1]^T (matmul)", lambda: np.matmul(q1, k1.T, out=s)),
           ("P = exp2(S - m)", lambda: np.exp2(s0, out=s)),
           ("[P V, rowsum P] = P [V, 1] (matmul)", lambda: np.matmul(s0, k1, out=inc)),
           ("mask (diagonal tiles only)", lambda: np.copyto(s, -np.inf, where=hidden)),
           ("avoided: rowmax(S)", lambda: s0.max(axis=1)),
           ("avoided: S - m (a pass)", lambda: np.subtract(s0, col, out=s)),
           ("avoided: exp instead of exp2", lambda: np.exp(s0, out=s)),
           ("avoided: rowsum(P) (a pass)", lambda: s0.sum(axis=1))]
    with blas_limit(1):
        return [(name, best_time(fn, repeats) / (T * T)) for name, fn in ops]


