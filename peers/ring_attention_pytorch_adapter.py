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
- float16: out and the products accumulate in float16 (`o = torch.zeros_like(q)`),
  so the adapter declares float16 as its accumulation dtype for float16 inputs.
"""

import numpy as np

from .adapter import PeerAdapter, to_numpy, to_torch


def lib_head_order(Hq, Hkv):
    """perm[i] = the query head of this project that its head i is: its head
    i = g * Hkv + j reads kv head j, as this project's head j * G + g does."""
    G = Hq // Hkv
    return np.array([(i % Hkv) * G + i // Hkv for i in range(Hq)])


class RingAttentionPytorch(PeerAdapter):
    library = "ring-attention-pytorch"
    dtypes = (np.float64, np.float32, np.float16)

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
        return np.dtype(dtype) if np.dtype(dtype) == np.float16 else super().accumulate_dtype(dtype)

    def supports(self, case):
        if case.scale is not None:
            return "no scale argument (always D ** -0.5)"
        if isinstance(case.tile_size, tuple):
            return "bucket_size is one int"
        if self.whole_buckets and case.tile_size is not None:
            return "whole buckets only"
        return super().supports(case)

    def compute(self, case, mine, rank):
        from ring_attention_pytorch import ring_flash_attn
        perm = lib_head_order(case.Hq, case.Hkv)
        back = np.argsort(perm)
        q = to_torch(mine["q"][:, :, perm], requires_grad=True)              # (B, c, Hq, D), its head order
        k, v = (to_torch(mine[name], requires_grad=True) for name in ("k", "v"))
        bucket = case.tile_size if case.tile_size is not None else 1024
        out = ring_flash_attn(q, k, v, causal=case.causal, bucket_size=bucket, ring_reduce_col=True,
                              striped_ring_attn=self.layout == "striped")
        lse = out.grad_fn.saved_tensors[4][..., 0]                           # (B, Hq, c)
        out.backward(to_torch(mine["dout"][:, :, perm]))
        return dict(out=to_numpy(out)[:, :, back], lse=to_numpy(lse)[:, back], dq=to_numpy(q.grad)[:, :, back],
                    dk=to_numpy(k.grad), dv=to_numpy(v.grad))
