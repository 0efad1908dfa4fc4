"""A CPU stand-in for the two flash-attn block kernels that ring-flash-attn calls.

ring-flash-attn (pip `ring-flash-attn`) writes the ring in PyTorch and calls
`flash_attn.flash_attn_interface._flash_attn_forward` / `_flash_attn_backward`
for each block; flash-attn itself needs a CUDA GPU. `install()` puts a module
of that name in `sys.modules` whose two functions compute the same block
results with plain torch ops on the CPU, in flash-attn's conventions:

- q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D); query head h reads key/value head
  h // (Hq // Hkv); dk, dv are written summed over each group;
- causal with Sq == Sk is the lower triangle (key j visible to query i iff j <= i);
- out in the input dtype, softmax_lse (B, Hq, Sq) float32, natural log;
  arithmetic in float32 (float64 for float64 inputs, which flash-attn does not take);
- the backward reads delta = rowsum(dout * out) from the `out` it is given and
  writes dq, dk, dv into the buffers it is given, in their dtype.

Only what ring-flash-attn's three rings pass is supported: no dropout, no
window, no softcap, no alibi.
"""

import sys
import types

import torch


def _acc(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _scores(q, k, softmax_scale, causal):
    """(B, Hq, Sq, Sk) scaled scores in the accumulation dtype, -inf where masked."""
    group = q.shape[2] // k.shape[2]
    kh = k.to(_acc(q)).repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.to(_acc(q)), kh) * softmax_scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        visible = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)      # bottom-right aligned, as flash-attn
        s = s.masked_fill(~visible, float("-inf"))
    return s


def _check(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes):
    if dropout_p or softcap or alibi_slopes is not None or (window_size_left, window_size_right) != (-1, -1):
        raise NotImplementedError("the flash-attn stand-in does no dropout, window, softcap or alibi")


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                        softcap=0.0, alibi_slopes=None, return_softmax=False):
    """(out, softmax_lse, S_dmask, rng_state), as flash-attn 2.6+."""
    _check(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    s = _scores(q, k, softmax_scale, causal)
    lse = torch.logsumexp(s, dim=-1)                                      # (B, Hq, Sq)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)                     # a row with no visible key: 0
    group = q.shape[2] // k.shape[2]
    out = torch.einsum("bhij,bjhd->bihd", p, v.to(_acc(q)).repeat_interleave(group, dim=2))
    return out.to(q.dtype), lse.to(torch.float32 if q.dtype != torch.float64 else torch.float64), None, None


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         deterministic=False, rng_state=None):
    """Writes dq, dk, dv (the buffers given); returns softmax_d, as flash-attn."""
    _check(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    acc, group = _acc(q), q.shape[2] // k.shape[2]
    s = _scores(q, k, softmax_scale, causal)
    p = torch.exp(s - softmax_lse.to(acc)[..., None]).nan_to_num(0.0)    # (B, Hq, Sq, Sk)
    do, o = dout.to(acc), out.to(acc)
    vh = v.to(acc).repeat_interleave(group, dim=2)
    kh = k.to(acc).repeat_interleave(group, dim=2)
    delta = (do * o).sum(-1).transpose(1, 2)                              # (B, Hq, Sq)
    dp = torch.einsum("bihd,bjhd->bhij", do, vh)
    ds = p * (dp - delta[..., None])
    dq.copy_(torch.einsum("bhij,bjhd->bihd", ds, kh) * softmax_scale)
    B, Sk, Hkv, D = k.shape
    dk_h = torch.einsum("bhij,bihd->bjhd", ds, q.to(acc)) * softmax_scale
    dv_h = torch.einsum("bhij,bihd->bjhd", p, do)
    dk.copy_(dk_h.reshape(B, Sk, Hkv, group, D).sum(3))
    dv.copy_(dv_h.reshape(B, Sk, Hkv, group, D).sum(3))
    return delta


def _varlen_not_here(*args, **kwargs):
    raise NotImplementedError("the flash-attn stand-in has no varlen kernels")


def install():
    """Make `import flash_attn.flash_attn_interface` find the stand-in."""
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_forward = _flash_attn_forward
    interface._flash_attn_backward = _flash_attn_backward
    interface._flash_attn_varlen_forward = _varlen_not_here        # imported by its varlen rings, not run
    interface._flash_attn_varlen_backward = _varlen_not_here
    package = types.ModuleType("flash_attn")
    package.__path__ = []
    package.flash_attn_interface = interface
    package.__version__ = "stand-in"
    sys.modules.setdefault("flash_attn", package)
    sys.modules.setdefault("flash_attn.flash_attn_interface", interface)
