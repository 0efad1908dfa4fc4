"""One device's part of the ring (paper, Algorithm 1), for every backend.

Each device keeps its queries Q_j and passes key/value blocks around the ring:
in round t it holds the block that started on device ``(j - t) mod N``, attends
its queries to it, and passes it on to device ``(j + 1) mod N``. The functions
here are written once and run unchanged on N virtual devices (threads, in
`reference.virtual`), on MPI ranks (`mpi_impl`) and on GPUs (`gpu_impl`): only
the communication object differs. It has two verbs and two attributes:

    comm.rank, comm.size
    handle = comm.start_shift(arrays, tag)   # send to rank+1, receive from rank-1
    arrays = comm.finish_shift(handle)       # wait for both; returns what arrived

A buffer passed to `start_shift` must not be written until `finish_shift`
returns; the loops below never write a block after sending it.

Shapes are the user layout (flash-attn): q (B, c, Hq, D), k, v (B, c, Hkv, D),
lse (B, Hq, c), with ``c`` this device's tokens and ``q_pos``, ``k_pos`` their
global positions (NumPy int64, shape (c,)).
"""

import time

import numpy as np

from . import step
from .layouts import array_module

KV, DKV = 1, 2            # tags of the two kinds of message in flight


class RoundLog:
    """Per-round record of one device: the trace row, plus timings."""

    FIELDS = ("source", "tiles_computed", "tiles_skipped", "pairs", "bytes_sent",
              "compute_s", "compute_cpu_s", "wait_s")

    def __init__(self, n_rounds):
        for name in self.FIELDS:
            setattr(self, name, np.zeros(n_rounds, dtype=float if name.endswith("_s") else np.int64))

    def record(self, t, source, counts):
        self.source[t] = source
        self.tiles_computed[t] = counts.tiles_computed
        self.tiles_skipped[t] = counts.tiles_skipped
        self.pairs[t] = counts.pairs

    def timed(self, t, field, fn, *args, **kwargs):
        """Run fn, adding its wall time to `field` (and CPU time for compute)."""
        wall, cpu = time.perf_counter(), time.thread_time()
        result = fn(*args, **kwargs)
        getattr(self, field)[t] += time.perf_counter() - wall
        if field == "compute_s":
            self.compute_cpu_s[t] += time.thread_time() - cpu
        return result

    def send(self, t, comm, arrays, tag):
        self.bytes_sent[t] += sum(a.nbytes for a in arrays)
        return comm.start_shift(arrays, tag)


def _prepare(q, k, v, scale):
    """Compute-layout copies: q pre-scaled in the accumulation dtype; k, v in
    their own dtype (blocks travel as they came)."""
    acc = step.accumulate_dtype(q.dtype)
    # Hazard: q_to_heads returns a view of the caller's q when no transpose or
    # cast is needed, so scale into a new array, never in place.
    q_h = step.q_to_heads(q, k.shape[2], dtype=acc) * acc(scale)   # (B, Hkv, c, G, D)
    return q_h, step.kv_to_heads(k), step.kv_to_heads(v)    # (B, Hkv, c, D)


def _as(x, dtype):
    return x.astype(dtype, copy=False)


def ring_forward(q, k, v, q_pos, k_pos, comm, *, causal, scale, tile_size, attend=None):
    """Forward on this device. Returns (out (B,c,Hq,D), lse (B,Hq,c), RoundLog).
    `attend` is the block step: `step.attend_block` (None), or a kernel with its
    contract (`gpu_impl.fused.attend_block`)."""
    attend = attend or step.attend_block
    xp, n = array_module(q), comm.size
    q_h, k_h, v_h = _prepare(q, k, v, scale)
    owner = np.array([comm.rank], dtype=np.int64)           # travels with the block
    block = (k_h, v_h, xp.asarray(k_pos), xp.asarray(owner))
    acc, log = step.ForwardAcc.zeros(q_h), RoundLog(n)
    for t in range(n):
        # Algorithm 1: send K_k, V_k on while attending to them; no send after the last round.
        pending = log.send(t, comm, block, KV) if t < n - 1 else None
        kb, vb, kpos, src = block
        counts = log.timed(t, "compute_s", attend, acc, q_h, _as(kb, q_h.dtype),
                           _as(vb, q_h.dtype), q_pos, _host(kpos), causal=causal, tile_size=tile_size)
        log.record(t, int(_host(src)[0]), counts)
        if pending is not None:
            block = log.timed(t, "wait_s", comm.finish_shift, pending)
    out_h, lse_h = step.finish_forward(acc)
    return _as(step.q_from_heads(out_h), q.dtype), step.rows_from_heads(lse_h), log


def ring_backward(q, k, v, out, lse, dout, q_pos, k_pos, comm, *, causal, scale, tile_size):
    """Backward on this device. K, V and their gradient accumulators dK, dV
    travel the ring; dQ stays home. After the last round one more hop brings
    every dK, dV back to the device that owns those keys.
    Returns (dq, dk, dv) in the user layout, and a RoundLog."""
    xp, n = array_module(q), comm.size
    q_h, k_h, v_h = _prepare(q, k, v, scale)
    acc = q_h.dtype.type
    hkv = k.shape[2]
    do_h = step.q_to_heads(dout, hkv, dtype=acc)                                 # (B,Hkv,c,G,D)
    delta = (do_h * step.q_to_heads(out, hkv, dtype=acc)).sum(axis=-1)          # (B,Hkv,c,G)
    lse_h = _as(step.rows_to_heads(lse, hkv), acc)
    dq = xp.zeros_like(q_h)
    block = (k_h, v_h, xp.asarray(k_pos), xp.asarray(np.array([comm.rank], dtype=np.int64)))
    log, grads_in_flight = RoundLog(n), None
    for t in range(n):
        pending = log.send(t, comm, block, KV) if t < n - 1 else None
        kb, vb, kpos, src = block
        dk, dv = xp.zeros(kb.shape, acc), xp.zeros(vb.shape, acc)
        counts = log.timed(t, "compute_s", step.attend_block_backward, dq, dk, dv, q_h, do_h,
                           lse_h, delta, _as(kb, acc), _as(vb, acc), q_pos, _host(kpos),
                           causal=causal, tile_size=tile_size)
        log.record(t, int(_host(src)[0]), counts)
        if grads_in_flight is not None:       # what the devices before us added to this block
            dk_in, dv_in = log.timed(t, "wait_s", comm.finish_shift, grads_in_flight)
            dk += dk_in
            dv += dv_in
        grads_in_flight = log.send(t, comm, (dk, dv), DKV)
        if pending is not None:
            block = log.timed(t, "wait_s", comm.finish_shift, pending)
    dk, dv = log.timed(n - 1, "wait_s", comm.finish_shift, grads_in_flight)   # home again
    dq *= acc(scale)
    return (_as(step.q_from_heads(dq), q.dtype), _as(step.kv_from_heads(dk), k.dtype),
            _as(step.kv_from_heads(dv), v.dtype), log)


def _host(x):
    """A small array (positions, the owner) as NumPy, wherever it lives."""
    return x.get() if hasattr(x, "get") else np.asarray(x)
