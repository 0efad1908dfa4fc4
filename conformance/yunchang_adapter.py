"""yunchang (pip `yunchang`, feifeibear/long-context-attention): its ring with
the torch block kernel, `ring_pytorch_attn_func` (ring/ring_pytorch_attn.py,
"adapted from picotron"), the one ring of the package that needs no
flash-attn (its other rings are ring-flash-attn's, on flash-attn kernels).

Its conventions, and what this adapter does about them:
- contiguous shards, (B, c, H, D); the caller shards;
- the block kernel is `pytorch_attn_forward` (kernels/attention.py), which calls
  `torch.ops.aten._scaled_dot_product_flash_attention`: that op has no CPU
  kernel, so the adapter points the module's name at the CPU one,
  `aten._scaled_dot_product_flash_attention_for_cpu` (same arguments, out and
  lse first), what SDPA runs on a CPU;
- heads: the kernel takes as many K/V heads as query heads; the adapter
  expands K, V (h reads h // (Hq // Hkv)) and autograd sums dK, dV back;
- `softmax_scale` (default D ** -0.5); the function returns out only (its
  `return_attn_probs` is ignored), so lse is not checked (`outputs`);
- each block's lse is cast to the input dtype (`lse = lse.to(q.dtype)`,
  kernels/attention.py line 135) and its out comes back in it before the
  float32 merge (ring/utils.py), so 16-bit inputs are declared to
  accumulate in their own dtype;
- `window_size` is a parameter of `ring_pytorch_attn_func`
  (ring/ring_pytorch_attn.py line 19) and of the block kernel
  (kernels/attention.py line 51); the adapter passes the kit's window as
  flash-attn's (W - 1, 0) causal, (W - 1, W - 1) not;
- padding (S not a multiple of N): causal, the padding keys come after every
  real query and are never seen; full attention would see them: the function
  takes no mask (its parameters, ring_pytorch_attn.py lines 12-27), so its
  full rows take no padding. Padding queries attend like real ones: the
  harness's `loss_ignores_padding`;
- causal cases with a negative scale are skipped: the CPU kernel put in
  for the CUDA one returns NaN for them (CONFORMANCE.md, the torch context
  parallel row "causal, scale < 0"), which says nothing of yunchang;
- the backward raises: `pytorch_attn_backward` is `raise RuntimeError("Not
  implemented backward for PyTorch attention types")` (kernels/attention.py
  line 159), so the backward rows say so.
"""

import numpy as np

from reference.testing import ALL_DTYPES
from reference.testing.harness.torch import TorchAdapter

from .ring_flash_attn_adapter import window_size
from .torch_context_parallel_adapter import CPU_SDPA_NAN, cpu_sdpa_nan


class Yunchang(TorchAdapter):
    library = "yunchang"
    name = "yunchang ring_pytorch_attn_func"
    key = "yunchang/ring-pytorch"
    layouts = ("contiguous",)
    dtypes = ALL_DTYPES
    outputs = ("out", "dq", "dk", "dv")
    world_sizes = (2, 3, 4)
    preload = ("conformance.preload",)
    masks = ("causal", "full", "window", "padding")
    loss_ignores_padding = True
    no_key_mask = ("no key mask: ring_pytorch_attn_func takes q, k, v, dropout_p, softmax_scale, causal, "
                   "window_size, softcap, alibi_slopes, ... (ring_pytorch_attn.py lines 12-27), so padding keys "
                   "are seen by every query")

    def accumulate_dtype(self, dtype):
        return np.dtype(dtype) if np.dtype(dtype).itemsize == 2 else super().accumulate_dtype(dtype)

    def supports(self, case):
        if cpu_sdpa_nan(case):
            return CPU_SDPA_NAN
        return super().supports(case)

    def compute(self, case, shard):
        import torch
        import yunchang.kernels.attention as kernels
        from yunchang.ring.ring_pytorch_attn import ring_pytorch_attn_func
        kernels._scaled_dot_product_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        g = case.Hq // case.Hkv
        k, v = (x.repeat_interleave(g, dim=2) for x in (shard.k, shard.v))
        out = ring_pytorch_attn_func(shard.q, k, v, softmax_scale=case.scale_value, causal=case.causal,
                                     window_size=window_size(case), group=torch.distributed.group.WORLD)
        return dict(out=out)                                                   # (B, c, Hq, D)
