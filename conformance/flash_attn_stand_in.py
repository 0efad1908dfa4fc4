"""A CPU stand-in for the flash-attn block kernels that ring-flash-attn and yunchang call.

ring-flash-attn (pip `ring-flash-attn`) and yunchang's forks of its rings
write the ring in PyTorch and call
`flash_attn.flash_attn_interface._flash_attn_forward` / `_flash_attn_backward`
(dense) and `_flash_attn_varlen_forward` / `_flash_attn_varlen_backward`
(packed documents) for each block; yunchang's Ulysses calls the public
`flash_attn.flash_attn_func` (those two kernels in an autograd Function, as
flash-attn's `FlashAttnFunc`); flash-attn itself needs a CUDA GPU.
`install()` puts a module of that name in `sys.modules` whose functions
compute the same block results with plain torch ops on the CPU, in
flash-attn's (2.6+) conventions:

- dense: q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D); varlen: q (Tq, Hq, D), k, v
  (Tk, Hkv, D) with documents cu_seqlens_q, cu_seqlens_k (document i's
  queries see document i's keys only); query head h reads key/value head
  h // (Hq // Hkv); dk, dv are written summed over each group;
- causal is aligned bottom-right (per document): key j visible to query i
  iff j <= i + Sk - Sq; a window (left, right) keeps keys with
  i + Sk - Sq - left <= j <= i + Sk - Sq + right (-1: unbounded);
- out in the input dtype, softmax_lse float32 (float64 for float64 inputs,
  which flash-attn does not take), natural log: (B, Hq, Sq) dense,
  (Hq, Tq) varlen; arithmetic in float32;
- the backward reads delta = rowsum(dout * out) from the `out` it is given and
  writes dq, dk, dv into the buffers it is given, in their dtype.

No dropout, softcap or alibi (ring-flash-attn's rings pass none here).
"""

import sys
import types

import torch


def _acc(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check(dropout_p, softcap, alibi_slopes):
    if dropout_p or softcap or alibi_slopes is not None:
        raise NotImplementedError("the flash-attn stand-in does no dropout, softcap or alibi")


def _visible(sq, sk, causal, left, right, cu_q=None, cu_k=None):
    """(Sq, Sk) bool: which keys each query sees, document by document (bottom-right aligned)."""
    doc_q = _documents(cu_q, sq)
    doc_k = _documents(cu_k, sk)
    i = torch.arange(sq) - _starts(cu_q, sq)[doc_q]                       # index within its document
    j = torch.arange(sk) - _starts(cu_k, sk)[doc_k]
    lq, lk = _lengths(cu_q, sq)[doc_q], _lengths(cu_k, sk)[doc_q]           # the query's document's lengths
    diag = (i + lk - lq)[:, None]                                         # its own key, bottom-right aligned
    seen = doc_q[:, None] == doc_k[None, :]
    if causal:
        right = 0
    if left >= 0:
        seen &= j[None, :] >= diag - left
    if right >= 0:
        seen &= j[None, :] <= diag + right
    return seen


def _documents(cu, n):
    return torch.zeros(n, dtype=torch.long) if cu is None else torch.bucketize(torch.arange(n), cu[1:].cpu(), right=True)


def _starts(cu, n):
    return torch.zeros(1, dtype=torch.long) if cu is None else cu[:-1].cpu().long()


def _lengths(cu, n):
    return torch.full((1,), n, dtype=torch.long) if cu is None else (cu[1:] - cu[:-1]).cpu().long()


def _forward(q, k, v, scale, visible):
    """out (B, Sq, Hq, D) in q's dtype and lse (B, Hq, Sq) of one block, `visible` (Sq, Sk)."""
    acc, group = _acc(q), q.shape[2] // k.shape[2]
    s = torch.einsum("bihd,bjhd->bhij", q.to(acc), k.to(acc).repeat_interleave(group, dim=2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                      # (B, Hq, Sq)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)                     # a row with no visible key: 0
    out = torch.einsum("bhij,bjhd->bihd", p, v.to(acc).repeat_interleave(group, dim=2))
    return out.to(q.dtype), lse.to(acc)


def _backward(dout, q, k, v, out, lse, scale, visible):
    """(dq, dk, dv, delta) of one block, in the accumulation dtype."""
    acc, group = _acc(q), q.shape[2] // k.shape[2]
    kh = k.to(acc).repeat_interleave(group, dim=2)
    vh = v.to(acc).repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.to(acc), kh) * scale
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.exp(s - lse.to(acc)[..., None]).nan_to_num(0.0)            # (B, Hq, Sq, Sk)
    do = dout.to(acc)
    delta = (do * out.to(acc)).sum(-1).transpose(1, 2)                    # (B, Hq, Sq)
    ds = p * (torch.einsum("bihd,bjhd->bhij", do, vh) - delta[..., None])
    B, Sk, Hkv, D = k.shape
    dq = torch.einsum("bhij,bjhd->bihd", ds, kh) * scale
    dk = (torch.einsum("bhij,bihd->bjhd", ds, q.to(acc)) * scale).reshape(B, Sk, Hkv, group, D).sum(3)
    dv = torch.einsum("bhij,bihd->bjhd", p, do).reshape(B, Sk, Hkv, group, D).sum(3)
    return dq, dk, dv, delta


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                        softcap=0.0, alibi_slopes=None, return_softmax=False):
    """(out, softmax_lse, S_dmask, rng_state), as flash-attn 2.6+."""
    _check(dropout_p, softcap, alibi_slopes)
    visible = _visible(q.shape[1], k.shape[1], causal, window_size_left, window_size_right)
    out, lse = _forward(q, k, v, softmax_scale, visible)
    return out, lse, None, None


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         deterministic=False, rng_state=None):
    """Writes dq, dk, dv (the buffers given); returns softmax_d, as flash-attn."""
    _check(dropout_p, softcap, alibi_slopes)
    visible = _visible(q.shape[1], k.shape[1], causal, window_size_left, window_size_right)
    grads = _backward(dout, q, k, v, out, softmax_lse, softmax_scale, visible)
    for buffer, g in zip((dq, dk, dv), grads):
        buffer.copy_(g)
    return grads[3]


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None):
    """(out (Tq, Hq, D), softmax_lse (Hq, Tq), S_dmask, rng_state), as flash-attn 2.6+."""
    _check(dropout_p, softcap, alibi_slopes)
    visible = _visible(q.shape[0], k.shape[0], causal, window_size_left, window_size_right, cu_seqlens_q, cu_seqlens_k)
    out, lse = _forward(q[None], k[None], v[None], softmax_scale, visible)
    return out[0], lse[0], None, None


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left=-1,
                                window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
                                rng_state=None):
    """Writes dq, dk, dv (Tq / Tk, H, D buffers); returns softmax_d (Hq, Tq)."""
    _check(dropout_p, softcap, alibi_slopes)
    visible = _visible(q.shape[0], k.shape[0], causal, window_size_left, window_size_right, cu_seqlens_q, cu_seqlens_k)
    grads = _backward(dout[None], q[None], k[None], v[None], out[None], softmax_lse[None], softmax_scale, visible)
    for buffer, g in zip((dq, dk, dv), grads):
        buffer.copy_(g[0])
    return grads[3][0]


class _FlashAttnFunc(torch.autograd.Function):
    """flash-attn's FlashAttnFunc: saves q, k, v, out, lse; the backward writes
    dq, dk, dv (in the input dtype) with the block kernel."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, window_size):
        out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, softmax_scale, causal, *window_size)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale, ctx.causal, ctx.window_size = softmax_scale, causal, window_size
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, ctx.softmax_scale, ctx.causal, *ctx.window_size)
        return dq, dk, dv, None, None, None


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """out (B, S, Hq, D), or (out, softmax_lse, None) with return_attn_probs, as flash-attn 2.6+."""
    _check(dropout_p, softcap, alibi_slopes)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = _FlashAttnFunc.apply(q, k, v, scale, causal, tuple(window_size))
    return (out, lse, None) if return_attn_probs else out


def install():
    """Make `import flash_attn.flash_attn_interface` find the stand-in."""
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    for f in (_flash_attn_forward, _flash_attn_backward, _flash_attn_varlen_forward, _flash_attn_varlen_backward):
        setattr(interface, f.__name__, f)
    package = types.ModuleType("flash_attn")
    package.__path__ = []
    package.flash_attn_interface = interface
    package.flash_attn_func = interface.flash_attn_func = flash_attn_func
    package.__version__ = "stand-in"
    sys.modules.setdefault("flash_attn", package)
    sys.modules.setdefault("flash_attn.flash_attn_interface", interface)
