"""axolotl-ringmaster (pip `axolotl-ringmaster`): its ring attention on gloo,
with the CPU block kernels it ships for that (`ringmaster/ring/`):

    ring_attention(rotate_method=ALLGATHER)   loop.py `_allgather_ring`: K, V all-gathered
                                              (`_AllGatherKV`, whose backward all-reduces on gloo),
                                              one call of the `math` block kernel
    ring_attention(rotate_method=ALLTOALL)    p2p_attn.py `RingP2PAttention`: K, V rotated one hop a
                                              round, online softmax; its explicit-softmax fallback
                                              (the flash path is CUDA only), a reverse-ring backward
    zigzag_ring_attention(cu_seqlens=...)     zigzag.py: the packed (varlen) path, doc-masked explicit
                                              blocks, the one zigzag path that runs off CUDA

Its conventions, and what this adapter does about them:
- layout in: (B, H, c, D) (the adapter transposes); out: (B, c, H, D);
- contiguous shards for ring_attention ("causal uses contiguous sharding");
  zigzag: rank r holds chunks r and 2N-1-r of the packed sequence
  (`_zigzag_gidx`), the kit's zigzag layout, with the global cu_seqlens;
- no lse: ring_attention returns out only (the all-gather path detaches it),
  so lse is not checked (`outputs`);
- heads: K, V expanded with `repeat_interleave` (h reads h // (Hq // Hkv)), as here;
- `scaling` is the scale; `math_block` and the p2p fallback compute in float32
  (`.float()`) and return the input dtype: float64 inputs are declared to
  accumulate in float32, as the code does. The zigzag path's blocks return
  their out in the input dtype before a float32 merge (varlen_blocks.py line
  83, zigzag.py line 51), so its 16-bit inputs are declared to accumulate in
  their own dtype, as flash-attn's;
- a window is `window=(W - 1, ...)` for the all-gather path (`math_block` reads
  the left size only, aligned bottom-right); the p2p path refuses windows
  (`ValueError`), so its rows take none; zigzag is causal only;
- padding (S not a multiple of N, or 2N): the packed zigzag path takes the
  padding as a document of its own (cu_seqlens ending ..., S, P), which no
  real query sees; for ring_attention, causal, the padding keys come after
  every real query and are never seen, and full attention would see them:
  it takes no mask (`ring_attention(q, k, v, *, group, causal, scaling,
  dropout, provider, rotate_method, attn_implementation, window)`, loop.py
  lines 20-33), so its full rows take no padding. Padding queries that
  attend: the harness's `loss_ignores_padding`;
- the backward is theirs (autograd through `_AllGatherKV` and the block, or
  the autograd Functions), taken by the harness's autograd.
"""

import numpy as np

from reference.testing import ALL_DTYPES
from reference.testing.harness.torch import TorchAdapter

ENTRIES = {"allgather": "ring_attention (all-gather)", "p2p": "ring_attention (p2p rotation)",
           "zigzag-packed": "zigzag_ring_attention (packed documents)"}


class Ringmaster(TorchAdapter):
    library = "axolotl-ringmaster"
    dtypes = ALL_DTYPES
    outputs = ("out", "dq", "dk", "dv")
    world_sizes = (2, 3, 4)
    preload = ("conformance.preload",)
    loss_ignores_padding = True
    no_key_mask = ("no key mask: ring_attention takes q, k, v, group, causal, scaling, dropout, provider, "
                   "rotate_method, attn_implementation, window (loop.py lines 20-33), so padding keys are seen "
                   "by every query")

    def __init__(self, entry):
        self.entry = entry
        self.key = f"ringmaster/{entry}"
        self.name = f"axolotl-ringmaster {ENTRIES[entry]}"
        self.layouts = ("zigzag",) if entry == "zigzag-packed" else ("contiguous",)
        self.masks = {"allgather": ("causal", "full", "window"), "p2p": ("causal", "full"),
                      "zigzag-packed": ("causal", "cu_seqlens")}[entry] + ("padding",)
        if entry == "zigzag-packed":
            self.max_batch = 1

    def accumulate_dtype(self, dtype):
        if np.dtype(dtype) == np.float64:
            return np.dtype(np.float32)
        if self.entry == "zigzag-packed" and np.dtype(dtype).itemsize == 2:
            return np.dtype(dtype)              # each block's out comes back in the input dtype
        return super().accumulate_dtype(dtype)

    def compute(self, case, shard):
        import torch.distributed as dist
        group = dist.group.WORLD
        q, k, v = (x.transpose(1, 2) for x in (shard.q, shard.k, shard.v))        # (B, H, c, D)
        if self.entry == "zigzag-packed":
            import torch
            from ringmaster.ring.zigzag import zigzag_ring_attention
            cu = (case.cu_seqlens or (0, case.S)) + ((case.padded,) if case.padded > case.S else ())
            cu = torch.tensor(cu, dtype=torch.int32)                              # the padding: a document of its own
            g = case.Hq // case.Hkv                                                # heads expanded here
            k, v = (x.repeat_interleave(g, dim=1) for x in (k, v))
            return dict(out=zigzag_ring_attention(q, k, v, group=group, scaling=case.scale_value, cu_seqlens=cu))
        from ringmaster.config import RotateMethod
        from ringmaster.ring.loop import ring_attention
        window = None if case.window is None else (case.window - 1, 0 if case.causal else case.window - 1)
        out = ring_attention(q, k, v, group=group, causal=case.causal, scaling=case.scale_value, dropout=0.0,
                             provider="math", attn_implementation="math", window=window,
                             rotate_method=RotateMethod.ALLGATHER if self.entry == "allgather" else RotateMethod.ALLTOALL)
        return dict(out=out)                                                       # (B, c, Hq, D)
