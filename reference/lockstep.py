"""Algorithm 1 in lockstep: every device in one loop per round, no threads.

The same algorithm as `reference.ring` (which runs each device on its own
thread, as MPI ranks and GPUs do), written for stepping through in a
debugger: in round t device j holds the block that started on device
``src = (j - t) mod N``, so indexing the blocks by `src` is the transfer.
The step, the accumulators and the finishing are the ring's own, so the
results are bit for bit those of `reference.ring_attention` (tests/steps/test_ring.py).

    out, lse = lockstep.ring_attention(q, k, v, n_devices=4, layout="striped")

Shapes: q (B, S, Hq, D), k, v (B, S, Hkv, D), lse (B, Hq, S); per device the
compute layout of `reference.heads`, c = S // N tokens.
"""


from . import steps
from .heads import kv_from_heads, q_from_heads, rows_from_heads
from .call import check_call
from .layouts import shard, unshard
from .ring import as_dtype, begin_backward, new_kv_grads, own_block
from .step import ForwardAcc, Grads, Queries, finish_forward


def ring_only(options):
    """The lockstep ring is the ring alone: any other scheme is refused, not run as the ring."""
    if options.get("scheme", "ring") != "ring" or options.get("ulysses_degree") not in (None, 1) \
            or options.get("ring_inner") is not None:
        raise ValueError(f"reference.lockstep runs the ring only, not scheme={options.get('scheme')!r} "
                         f"(ulysses_degree={options.get('ulysses_degree')}, ring_inner={options.get('ring_inner')}): "
                         "use reference.ring_attention")


def ring_attention(q, k, v, *, n_devices, layout="striped", causal=True, scale=None,
                   tile_size=None, step=steps.DEFAULT, **mask_options):
    """Exact attention over N devices in lockstep. Returns (out, lse).
    `mask_options`: those of `reference.ring_attention` (window, documents, dropout)."""
    ring_only(mask_options)
    call = check_call(q, k, v, n_devices=n_devices, layout=layout, causal=causal, scale=scale, tile_size=tile_size,
                      step=step, **mask_options)
    n, Hkv, pos, scale, step, mask = n_devices, k.shape[2], call.positions, call.scale, call.step, call.mask
    qs, ks, vs = (shard(x, n, layout) for x in (q, k, v))
    queries = [Queries.prepare(qs[j], Hkv, pos[j], scale) for j in range(n)]     # Q_j
    blocks = [own_block(ks[j], vs[j], pos[j], j) for j in range(n)]              # K_j, V_j
    accs = [ForwardAcc.zeros(queries[j].q) for j in range(n)]                     # Out_j
    for t in range(n):                          # rounds
        for j in range(n):                      # devices, "in parallel"
            src = (j - t) % n                   # the block device j holds in round t
            step.forward(accs[j], queries[j], as_dtype(blocks[src], queries[j].q.dtype, step),
                         mask=mask, tile_size=call.tile)
    outs, lses = zip(*(finish_forward(acc) for acc in accs))
    out = [q_from_heads(o).astype(q.dtype, copy=False) for o in outs]
    S = q.shape[1]
    return (unshard(out, layout, axis=1, seq_len=S),
            unshard([rows_from_heads(x) for x in lses], layout, axis=2, seq_len=S))


def ring_attention_backward(q, k, v, out, lse, dout, *, n_devices, layout="striped", causal=True,
                            scale=None, tile_size=None, step=steps.DEFAULT, **mask_options):
    """Gradients (dq, dk, dv) over N devices in lockstep: dQ_j stays with
    device j; block src's dK, dV collect every device's share as the block
    passes, and are home after the last round."""
    ring_only(mask_options)
    call = check_call(q, k, v, n_devices=n_devices, layout=layout, causal=causal, scale=scale, tile_size=tile_size,
                      step=step, grads=(out, lse, dout), **mask_options)
    n, pos, scale, step, mask = n_devices, call.positions, call.scale, call.step, call.mask
    qs, ks, vs, outs, douts = (shard(x, n, layout) for x in (q, k, v, out, dout))
    lses = shard(lse, n, layout, axis=2)
    # Q_j, dO_j, lse_j, delta_j and dQ_j of each device
    queries, rows, dq = zip(*(begin_backward(qs[j], ks[j], outs[j], lses[j], douts[j], pos[j], scale)
                              for j in range(n)))
    acc_dtype = queries[0].q.dtype
    blocks = [own_block(ks[j], vs[j], pos[j], j) for j in range(n)]
    dkv = [None] * n                            # block src's dK, dV so far
    for t in range(n):
        for j in range(n):
            src = (j - t) % n
            grads = Grads(dq[j], *new_kv_grads(blocks[src], acc_dtype))
            step.backward(grads, queries[j], rows[j], as_dtype(blocks[src], acc_dtype, step),
                          mask=mask, tile_size=call.tile)
            if dkv[src] is not None:            # what the devices before j added (the ring's order)
                grads.dk += dkv[src][0]
                grads.dv += dkv[src][1]
            dkv[src] = (grads.dk, grads.dv)
    dq = [q_from_heads(x * acc_dtype.type(scale)).astype(q.dtype, copy=False) for x in dq]
    dk = [kv_from_heads(x[0]).astype(k.dtype, copy=False) for x in dkv]
    dv = [kv_from_heads(x[1]).astype(v.dtype, copy=False) for x in dkv]
    return tuple(unshard(g, layout, axis=1, seq_len=q.shape[1]) for g in (dq, dk, dv))
