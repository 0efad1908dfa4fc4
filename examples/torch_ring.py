"""A ring attention in PyTorch (torch.distributed, any layout), and its adapter for the kit.

    python -m reference.testing check examples.torch_ring:TorchRing --world-sizes 1,2,3,4

Each rank holds c tokens of q, k, v and their global positions; in N rounds
the K/V blocks travel round the ring (rank r sends to r + 1), each rank
attends to the block it holds and merges it into its running out and lse
(the online softmax). The backward runs the same ring again with dK/dV
accumulators travelling with their block, one more shift taking them home.
Masks come from positions (`q_pos >= k_pos`), so the same code runs every
layout. Legend: N ranks, c tokens per rank, Hq / Hkv heads, D head dim.
"""

import numpy as np
import torch
import torch.distributed as dist

from reference.testing.harness.torch import TorchAdapter


def shift(*tensors):
    """Send these to rank r + 1, return rank r - 1's (one tag per tensor)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), (rank + 1) % n, tag=i) for i, t in enumerate(tensors)]
    ops += [dist.P2POp(dist.irecv, t, (rank - 1) % n, tag=i) for i, t in enumerate(received)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def block_scores(q, k, q_pos, k_pos, causal, scale):
    """(B, Hq, c, c) scores of q against one K block, -inf where masked; K's heads expanded (GQA)."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        s = s.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
    return s


class RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, causal, scale):
        acc = torch.promote_types(q.dtype, torch.float32)              # sums in float32 at least
        qa, kb, vb, kpos = q.to(acc), k.to(acc), v.to(acc), k_pos
        out, lse = None, None
        for step in range(dist.get_world_size()):
            s = block_scores(qa, kb, q_pos, kpos, causal, scale)             # (B, Hq, c, c)
            lse_b = torch.logsumexp(s, dim=-1)                             # (B, Hq, c)
            out_b = torch.einsum("bhij,bjhd->bihd", torch.exp(s - lse_b[..., None]).nan_to_num(0.0),
                                 vb.repeat_interleave(q.shape[2] // k.shape[2], dim=2))
            if out is None:
                out, lse = out_b, lse_b
            else:                                                          # merge: the online softmax
                new = torch.logaddexp(lse, lse_b)
                w_old, w_b = torch.exp(lse - new).nan_to_num(0.0), torch.exp(lse_b - new).nan_to_num(0.0)
                out = out * w_old.transpose(1, 2)[..., None] + out_b * w_b.transpose(1, 2)[..., None]
                lse = new
            if step < dist.get_world_size() - 1:
                kb, vb, kpos = shift(kb, vb, kpos)
        ctx.save_for_backward(q, k, v, q_pos, k_pos, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, q_pos, k_pos, out, lse = ctx.saved_tensors
        acc, n, g = out.dtype, dist.get_world_size(), q.shape[2] // k.shape[2]
        qa, do = q.to(acc), dout.to(acc)
        delta = (do * out).sum(-1).transpose(1, 2)                          # (B, Hq, c)
        kb, vb, kpos = k.to(acc), v.to(acc), k_pos
        dq, dkb, dvb = torch.zeros_like(qa), torch.zeros_like(kb), torch.zeros_like(vb)
        for step in range(n):
            p = torch.exp(block_scores(qa, kb, q_pos, kpos, ctx.causal, ctx.scale) - lse[..., None]).nan_to_num(0.0)
            dp = torch.einsum("bihd,bjhd->bhij", do, vb.repeat_interleave(g, dim=2))
            ds = p * (dp - delta[..., None]) * ctx.scale
            dq += torch.einsum("bhij,bjhd->bihd", ds, kb.repeat_interleave(g, dim=2))
            B, c, Hkv, D = kb.shape
            dkb += torch.einsum("bhij,bihd->bjhd", ds, qa).reshape(B, c, Hkv, g, D).sum(3)
            dvb += torch.einsum("bhij,bihd->bjhd", p, do).reshape(B, c, Hkv, g, D).sum(3)
            if step < n - 1:
                kb, vb, kpos, dkb, dvb = shift(kb, vb, kpos, dkb, dvb)
        if n > 1:                                                          # rank r holds rank r + 1's block
            dkb, dvb = shift(dkb, dvb)
        return dq.to(q.dtype), dkb.to(k.dtype), dvb.to(v.dtype), None, None, None, None


class TorchRing(TorchAdapter):
    """The adapter: what one rank computes from its shard (gradients by the harness's autograd)."""
    name = "examples.torch_ring"
    masks = ("causal", "full")

    def compute(self, case, shard):
        pos = shard.positions                          # (c,) the global positions of this rank's tokens
        out, lse = RingAttention.apply(shard.q, shard.k, shard.v, pos, pos, case.causal, case.scale_value)
        return dict(out=out, lse=lse)

