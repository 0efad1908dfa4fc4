"""One device's part of the ring (paper, Algorithm 1), for every backend.

Each device keeps its queries Q_j and passes key/value blocks around the ring:
in round t it holds the block that started on device ``(j - t) mod N``, attends
its queries to it, and passes it on to device ``(j + 1) mod N``. The functions
here are written once and run unchanged on N virtual devices (threads, in
`reference.virtual`), on MPI ranks (`mpi_impl`) and on GPUs (`gpu_impl`): only
the communication object differs. It has three verbs and two attributes:

    comm.rank, comm.size
    handle = comm.start_shift(arrays, tag)   # send to rank+1, receive from rank-1
    arrays = comm.finish_shift(handle)       # wait for the receive; returns what arrived
    comm.progress()                          # let the transfers in flight move

The step calls `progress` between its tiles: MPI moves a large message only
inside MPI calls. The object counts the bytes it moves (``comm.traffic``); the
loops only tell it the round (`RoundLog.rounds`). A buffer passed to `start_shift` must not be written until `finish_shift`
returns; the loops never write a block after sending it (`reference.lockstep`:
the same algorithm with all devices in one loop).

On a GPU the step only queues kernels, and nothing here reads device memory
on the host, so the next transfer starts without waiting for them (paper,
section 1): a block's positions and owner stay on the host beside its device
K, V, and a ``clock`` of the communication object times the step on the device.

Shapes are the user layout (flash-attn): q (B, c, Hq, D), k, v (B, c, Hkv, D),
lse (B, Hq, c), with ``c`` this device's tokens and ``q_pos``, ``k_pos`` their
global positions (NumPy int64, (c,)). The `mask` (from positions alone, the same
on every device) and the `step` come checked from `reference.call`.
"""

from contextlib import nullcontext

import numpy as np

from .heads import kv_from_heads, kv_to_heads, q_from_heads, rows_from_heads
from .layouts import array_module
from .nonfinite import all_finite, converted
from .step import BackwardRows, ForwardAcc, Grads, KVBlock, Queries, finish_forward
from .trace import RoundLog

KV, DKV = 1, 2            # tags of the two kinds of message in flight


def ring_forward(q, k, v, q_pos, k_pos, comm, *, scale, tile_size, step, mask, heads=None):
    """Forward on this device. Returns (out (B,c,Hq,D), lse (B,Hq,c), RoundLog).
    `step` (a `reference.step.Step`) and `mask` (a `reference.masks.Mask`) as
    the entry point checked them (`reference.call.check_call`); `heads`: the
    global numbers of q's query heads (`reference.step.Queries`; None: all)."""
    n = comm.size
    log = RoundLog.of(comm, step, blocks=KV)                           # comm counts the bytes it moves
    queries = Queries.prepare(q, k.shape[2], q_pos, scale, heads)       # Q_j, pre-scaled
    block = own_block(k, v, k_pos, comm.rank)                          # K_j, V_j
    acc = ForwardAcc.zeros(queries.q)                                  # Out_j
    for t in log.rounds():                     # "for i = 0 to N-1", this device being j
        # "send K_k, V_k to device (j + 1) mod N": started first, so that it
        # overlaps the compute; nothing is sent after the last round
        in_flight = comm.start_shift(block, KV) if t < n - 1 else None
        # "Out_j <- AccumulateAttentionFragment(Out_j, Q_j, K_k, V_k, Mask)",
        # the mask made from the positions that travel with the block
        with turn(comm), log.computing(t):
            counts = step.forward(acc, queries, as_dtype(block, queries.q.dtype, step),
                                  mask=mask, tile_size=tile_size, progress=comm.progress)
        log.record(t, counts, block)
        # "receive K_(k-1), V_(k-1) from device (j - 1) mod N"
        if in_flight is not None:
            with log.waiting(t):
                block = KVBlock(*comm.finish_shift(in_flight))
    return end_forward(acc, q, log)    # "normalize(Out_j)"


def ring_backward(q, k, v, out, lse, dout, q_pos, k_pos, comm, *, scale, tile_size, step, mask, heads=None,
                  kv_grads_dtype=None):
    """Backward on this device. K, V and their gradients dK, dV travel the ring;
    dQ stays home. After the last round one more hop brings every dK, dV back
    to the device that owns those keys. Returns (dq, dk, dv) in the user
    layout, and a RoundLog. `step` (with a backward) and `mask` as for
    `ring_forward`; `kv_grads_dtype`: dK, dV's dtype (None: k's; a Ulysses
    that replicates K/V heads sums their copies first, unrounded)."""
    n = comm.size
    log = RoundLog.of(comm, step, blocks=KV)
    queries, rows, dq = begin_backward(q, k, out, lse, dout, q_pos, scale, heads)   # Q_j, dO_j, dQ_j
    acc_dtype = queries.q.dtype
    block, grads_in_flight = own_block(k, v, k_pos, comm.rank), None
    for t in log.rounds():
        # send K_k, V_k on while computing (nothing after the last round)
        in_flight = comm.start_shift(block, KV) if t < n - 1 else None
        # this round's share of the block's gradients
        grads = Grads(dq, *new_kv_grads(block, acc_dtype))
        with turn(comm), log.computing(t):
            counts = step.backward(grads, queries, rows, as_dtype(block, acc_dtype, step),
                                   mask=mask, tile_size=tile_size, progress=comm.progress)
        log.record(t, counts, block)
        # receive the next K, V first, while the step's kernels run: on a GPU the
        # dK, dV sent below leave only once the step that writes them has run (the
        # communication object posts that send later, without the host waiting)
        if in_flight is not None:
            with log.waiting(t):
                block = KVBlock(*comm.finish_shift(in_flight))
        # add what the devices before us added to this block, and send it on (home, after the last round)
        if grads_in_flight is not None:
            with log.waiting(t):
                dk_in, dv_in = comm.finish_shift(grads_in_flight)
            grads.dk += dk_in
            grads.dv += dv_in
        grads_in_flight = comm.start_shift((grads.dk, grads.dv), DKV)
    with log.waiting(n - 1):
        dk, dv = comm.finish_shift(grads_in_flight)                    # home again
    return end_backward(dq, dk, dv, (q, k, v), scale, log, kv_dtype=kv_grads_dtype)


# -- the set-up and the finish, shared with the other schemes (`reference.schemes`) --

def begin_backward(q, k, out, lse, dout, q_pos, scale, heads=None):
    """(Queries, BackwardRows, zeroed dQ) of this device's query rows: Q_j
    pre-scaled, dO_j, lse_j, delta_j (`reference.step`), whether they are all
    finite found once here (no step reads device memory to know it)."""
    queries = Queries.prepare(q, k.shape[2], q_pos, scale, heads)
    rows = BackwardRows.prepare(out, lse, dout, k.shape[2], queries.q.dtype)
    xp = array_module(q)
    rows.finite = all_finite(xp, queries.q, rows.do, rows.delta)
    return queries, rows, xp.zeros_like(queries.q)


def end_forward(acc, q, log):
    """(out in q's layout and dtype, lse (B, Hq, c), log closed) from the accumulator Out_j."""
    out, lse = finish_forward(acc)             # O / l, m + log(l)
    log.close()                                # a device clock is read now
    return q_from_heads(out).astype(q.dtype, copy=False), rows_from_heads(lse), log


def end_backward(dq, dk, dv, like, scale, log, kv_dtype=None):
    """(dq, dk, dv, log closed): dQ scaled (Q was pre-scaled), each gradient in
    the user layout and the dtype of its input (`like`: q, k, v; dK, dV in
    `kv_dtype` if given)."""
    q, k, v = like
    dq *= dq.dtype.type(scale)
    log.close()                                # a device clock is read now
    return (q_from_heads(dq).astype(q.dtype, copy=False), kv_from_heads(dk).astype(kv_dtype or k.dtype, copy=False),
            kv_from_heads(dv).astype(kv_dtype or v.dtype, copy=False), log)


# -- pieces of the loops ---------------------------------------------------

def turn(comm):
    """A `with` block for one round's step: virtual devices take turns at the
    cores (`VirtualRing.turn`); a rank or a GPU has its own and computes at once."""
    return comm.turn() if hasattr(comm, "turn") else nullcontext()


def own_block(k, v, k_pos, rank):
    """This device's own K, V (compute layout, as they came: blocks travel in
    the input dtype), with their positions and owner, as the block that travels.
    Positions and owner are NumPy wherever K, V live: the host reads them
    (tile plans, the trace) without waiting for a device. The owner also says
    whether K and V are finite, found here once (one wait for the device,
    before the rounds), so that no step needs to look (`nonfinite.block_finite`)."""
    k, v = kv_to_heads(k), kv_to_heads(v)
    finite = all_finite(array_module(k), k, v)
    return KVBlock(k, v, np.asarray(k_pos, dtype=np.int64), np.array([rank, finite], dtype=np.int32))


def as_dtype(block, dtype, step=None):
    """The block with K, V in the accumulation dtype (float16 blocks travel as
    float16); left as it is for a step that reads float16 itself
    (``step.reads_float16``, the fused kernel)."""
    if step is not None and step.reads_float16 and block.k.dtype == np.float16:
        return block
    widened = block.k.dtype.kind == "f" or block.k.dtype.name == "bfloat16"     # not bits (uint16)
    widened = widened and np.dtype(dtype).itemsize >= block.k.dtype.itemsize
    return converted(block, block.k.astype(dtype, copy=False), block.v.astype(dtype, copy=False), widened=widened)


def new_kv_grads(block, dtype):
    """Zeroed dK, dV for the block held: new arrays every round, since the last
    round's are still being sent."""
    xp = array_module(block.k)
    return xp.zeros(block.k.shape, dtype), xp.zeros(block.v.shape, dtype)
