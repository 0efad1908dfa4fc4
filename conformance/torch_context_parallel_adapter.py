"""PyTorch's own context parallelism (torch 2.13): the ring core under
`torch.distributed.tensor.experimental.context_parallel()`, run on gloo with
the CPU SDPA kernels.

Its public `context_parallel()` needs a DeviceMesh over CUDA and swaps SDPA
for the ring inside a module; the ring itself is
`_context_parallel._attention._templated_ring_attention(group, seq_dim, op,
q, k, v, is_causal, **kwargs)` and `_templated_ring_attention_backward(...)`,
generic over the SDPA op. This adapter calls them with
`aten._scaled_dot_product_flash_attention_for_cpu` and its backward (what
SDPA runs on a CPU), inside an autograd Function (the public path's
autograd node does the same through SDPA's derivative).

Its conventions, and what this adapter does about them:
- options are module globals (`_cp_options`): `enable_load_balance` (the
  head-tail balancer, on by default) and `rotate_method` (all-gather, the
  default, or all-to-all; the backward always sends dK, dV all-to-all). The
  adapter sets both for each call, one adapter per combination;
- with the balancer on, rank r holds chunks r and 2N-1-r of 2N
  (`_load_balancer._HeadTailLoadBalancer`): the kit's zigzag layout; off,
  contiguous blocks. The caller shards; the ring does not permute;
- the balancer requires is_causal (`RuntimeError("Load balancing requires
  is_causal=True")`): causal only with it on, causal and full without;
- SDPA's layout (B, H, S, D): the adapter transposes from and back to (B, S, H, D);
- heads: the CPU kernel takes as many K/V heads as query heads; the adapter
  expands K, V (query head h reads h // (Hq // Hkv), as SDPA's enable_gqa)
  and autograd sums dK, dV back over each group;
- scale: SDPA's `scale` keyword (default D ** -0.5); lse from the kernel,
  (B, H, c), natural log;
- merging: blocks merged in float32 (`convert_to_f32=True`), out returned in
  the input dtype, so 16-bit inputs are declared to accumulate in their own
  dtype, as each block's out comes back in it; the backward accumulates dQ,
  dK, dV in float32 and sends dK, dV round the ring in float32;
- what it saves for the backward: q, k, v, out and lse (the adapter's autograd Function);
- padding (S not a multiple of N, or 2N): causal, the padding keys come
  after every real query and are never seen; full attention (no balancer)
  would see them: the ring hands the same keyword arguments to every block's
  op whatever keys came round (`op(q, k, v, is_causal=..., **kwargs)`,
  _context_parallel/_attention.py lines 475-481), so an `attn_mask` of this
  rank's keys cannot mask them: its full rows take no padding. Padding
  queries attend like real ones: the harness's `loss_ignores_padding`;
- causal with a negative scale: the CPU SDPA kernel itself returns NaN for
  every row (`torch.nn.functional.scaled_dot_product_attention(q, k, v,
  is_causal=True, scale=-0.7)` on the CPU, no ring involved); those cases
  run in a row of their own ("causal, scale < 0", float32) and are skipped
  by the others, so that the ring's own behaviour shows.
"""

import functools

import numpy as np

from reference.testing import ALL_DTYPES
from reference.testing.harness.torch import TorchAdapter

# torch's CPU SDPA kernel returns NaN for a causal call with a negative scale, no ring involved (conformance/findings.py):
# one row here shows it; every other peer whose blocks run that kernel skips those cases
CPU_SDPA_NAN = ("causal with a negative scale: torch's CPU SDPA kernel returns NaN (the torch context parallel "
                "row 'causal, scale < 0')")


def cpu_sdpa_nan(case):
    """Whether torch's CPU SDPA kernel returns NaN for the case (`CPU_SDPA_NAN`)."""
    return case.causal and case.scale is not None and case.scale < 0


@functools.cache
def ring_function():
    """An autograd Function around the context-parallel ring core with the CPU flash kernel."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    aten = torch.ops.aten

    class ContextParallelRing(torch.autograd.Function):

        @staticmethod
        def forward(ctx, q, k, v, causal, scale):                         # (B, H, c, D) each
            group = torch.distributed.group.WORLD
            out, lse, *_ = cp._templated_ring_attention(group, 2, aten._scaled_dot_product_flash_attention_for_cpu,
                                                        q, k, v, is_causal=causal, dropout_p=0.0, scale=scale)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.causal, ctx.scale = causal, scale
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv, *_ = cp._templated_ring_attention_backward(
                torch.distributed.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward,
                dout.contiguous(), "grad_out", q, k, v, out, lse, ctx.causal, dropout_p=0.0, scale=ctx.scale)
            return dq, dk, dv, None, None

    return ContextParallelRing


class TorchContextParallel(TorchAdapter):
    library = "torch"
    dtypes = ALL_DTYPES
    world_sizes = (2, 3, 4)
    preload = ("conformance.preload",)
    loss_ignores_padding = True
    no_key_mask = ("no key mask: every block's op gets the same keyword arguments whatever keys came round "
                   "(_context_parallel/_attention.py lines 475-481), so padding keys are seen by every query")

    def __init__(self, load_balance, rotate, negative_scales=False):
        self.load_balance, self.rotate, self.negative_scales = load_balance, rotate, negative_scales
        self.layouts = ("zigzag",) if load_balance else ("contiguous",)
        self.masks = ("causal", "padding") if load_balance else ("causal", "full", "padding")
        self.key = f"torch-cp/{'head-tail' if load_balance else 'no-balance'}/{rotate}" + \
            ("/negative-scale" if negative_scales else "")
        self.name = (f"torch context parallel ring ({'head-tail balancer' if load_balance else 'no balancer'}, "
                     f"{rotate.replace('_', '-').lower()}" + (", causal, scale < 0)" if negative_scales else ")"))
        if negative_scales:                                   # the one run that shows the CPU kernel's NaN
            self.dtypes, self.masks = (np.float32,), ("causal", "full")

    def supports(self, case):
        negative = cpu_sdpa_nan(case)
        if negative != self.negative_scales:
            return CPU_SDPA_NAN if negative else "only causal cases with a negative scale"
        return super().supports(case)

    def accumulate_dtype(self, dtype):
        return np.dtype(dtype) if np.dtype(dtype).itemsize == 2 else super().accumulate_dtype(dtype)

    def compute(self, case, shard):
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
        cp._cp_options.enable_load_balance = self.load_balance
        cp._cp_options.rotate_method = cp._RotateMethod[self.rotate]
        g = case.Hq // case.Hkv
        q = shard.q.transpose(1, 2)                                           # (B, Hq, c, D)
        k, v = (x.repeat_interleave(g, dim=2).transpose(1, 2) for x in (shard.k, shard.v))
        out, lse = ring_function().apply(q, k, v, case.causal, case.scale_value)
        return dict(out=out.transpose(1, 2), lse=lse)                         # (B, c, Hq, D), (B, Hq, c)
