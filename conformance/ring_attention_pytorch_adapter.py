"""ring-attention-pytorch (pip `ring-attention-pytorch`): its `ring_flash_attn`
function, the ring written in PyTorch (`ring_attention_pytorch/ring_flash_attention.py`),
contiguous (`striped_ring_attn=False`) and striped (`striped_ring_attn=True`).

Its conventions, and what this adapter does about them:
- the ring turns only with `ring_reduce_col=True` (default False: each rank
  attends to its own keys only); the adapter passes True;
- shards are the caller's: rank r holds positions r*c .. (r+1)*c - 1
  (contiguous), or r, r+N, r+2N, ... (striped, the paper's and
  `reference.positions`'); the function does not permute;
- grouped-query heads: K, V are expanded with `repeat(t, '... h d -> ... (g h) d')`
  (ring_flash_attention.py, in the forward and the backward), so query head i
  reads key/value head i % Hkv, where flash-attn's (and this project's)
  convention is i // (Hq // Hkv). The adapter permutes q's heads into its
  order and out's, lse's and dq's back (a convention, not a defect);
- no scale argument: the scale is always D ** -0.5 (cases with another scale are skipped);
- `bucket_size` is its tile size (an int; the case's tile size, or its
  default 1024 when the case has none; rectangular tiles are skipped). The
  variants "whole buckets" run only cases without a tile size, where the
  bucket is the rank's whole block (min(c, 1024)), the one shape for which
  its bucket-index masks are right (see CONFORMANCE.md);
- the forward returns out only; lse is read from what it saves for the
  backward (`out.grad_fn.saved_tensors[4]`, (B, H, c, 1));
- float16 and bfloat16: out and the products accumulate in the input dtype
  (`o = torch.zeros_like(q)`), so the adapter declares it as the accumulation
  dtype of 16-bit inputs;
- padding (S not a multiple of N): its `mask` argument, (B, c) bool of this
  rank's keys, travels round the ring with them (ring_flash_attention.py line
  136) and is ignored when causal (lines 105-108: padding keys come after
  every real query anyway); the adapter passes positions < S for full
  attention. Its padding queries attend like real ones: the harness's
  `loss_ignores_padding`;
- the backward is its own (`RingFlashAttentionFunction.backward`), taken by the
  harness's autograd of sum(out * dout) through the head permutation.
"""

import numpy as np

from reference.testing import ALL_DTYPES
from reference.testing.harness.torch import TorchAdapter


def lib_head_order(Hq, Hkv):
    """perm[i] = the query head of this project that its head i is: its head
    i = g * Hkv + j reads kv head j, as this project's head j * G + g does."""
    G = Hq // Hkv
    return np.array([(i % Hkv) * G + i // Hkv for i in range(Hq)])


class RingAttentionPytorch(TorchAdapter):
    library = "ring-attention-pytorch"
    dtypes = ALL_DTYPES
    world_sizes = (2, 3, 4)
    preload = ("conformance.preload",)
    masks = ("causal", "full", "padding")
    loss_ignores_padding = True

    def __init__(self, layout, whole_buckets=False):
        self.layout, self.whole_buckets = layout, whole_buckets
        self.layouts = (layout,)
        self.key = f"ring-attention-pytorch/{layout}" + ("/whole-buckets" if whole_buckets else "")
        self.name = f"ring-attention-pytorch ring_flash_attn (striped_ring_attn={layout == 'striped'}" + \
            (", bucket = c)" if whole_buckets else ")")

    @classmethod
    def contiguous(cls, whole_buckets=False):
        return cls("contiguous", whole_buckets)

    @classmethod
    def striped(cls, whole_buckets=False):
        return cls("striped", whole_buckets)

    def accumulate_dtype(self, dtype):
        return np.dtype(dtype) if np.dtype(dtype).itemsize == 2 else super().accumulate_dtype(dtype)

    def supports(self, case):
        if case.scale is not None:
            return "no scale argument (always D ** -0.5)"
        if isinstance(case.tile_size, tuple):
            return "bucket_size is one int"
        if self.whole_buckets and case.tile_size is not None:
            return "whole buckets only"
        return super().supports(case)

    def compute(self, case, shard):
        import torch
        from ring_attention_pytorch import ring_flash_attn
        perm = torch.from_numpy(lib_head_order(case.Hq, case.Hkv))
        back = torch.argsort(perm)
        q = shard.q if shard.q.requires_grad else shard.q.requires_grad_()      # lse is read from its autograd node
        bucket = case.tile_size if case.tile_size is not None else 1024
        padded = case.padded > case.S and not case.causal
        mask = (shard.positions < case.S).expand(case.B, -1) if padded else None      # (B, c) real keys
        out = ring_flash_attn(q[:, :, perm], shard.k, shard.v, mask, causal=case.causal, bucket_size=bucket,
                              ring_reduce_col=True, striped_ring_attn=self.layout == "striped")   # (B, c, Hq, D), its heads
        lse = out.grad_fn.saved_tensors[4][..., 0]                                # (B, Hq, c), its heads
        return dict(out=out[:, :, back], lse=lse[:, back])
