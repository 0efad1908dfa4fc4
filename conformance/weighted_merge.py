"""ring-flash-attn's and yunchang's rings with their float32 merge written as the
weighted sum: checks that the merge formula, not the ring, puts their float32
out over the kit's line (`python -m conformance --explain-merge`).

Both merge each block into the running out as (ring_flash_attn/utils.py line
47, yunchang/ring/utils.py line 24)

    out = out - sigmoid(block_lse - lse) * (out - block_out)

where the textbook merge (the paper's, this project's) is the weighted sum

    new = logaddexp(lse, block_lse)
    out = exp(lse - new) * out + exp(block_lse - new) * block_out

The adapters below put the second in place of the first (`_update_out_and_lse`,
in each rank) and are otherwise the peers'. The patch stays in the ranks for
the life of their world: run the peers as shipped first.
"""

from .ring_flash_attn_adapter import RingFlashAttn, load_rings
from .ring_flash_attn_varlen_adapter import RingFlashAttnVarlen
from .yunchang_adapter import Yunchang


def weighted_merge(out, lse, block_out, block_lse):
    """`_update_out_and_lse` as the weighted sum: out (B, c, H, D) float32, lse (B, c, H, 1)."""
    import torch
    block_out = block_out.to(torch.float32)
    block_lse = block_lse.transpose(-2, -1).unsqueeze(dim=-1)
    new = torch.logaddexp(lse, block_lse)
    return torch.exp(lse - new) * out + torch.exp(block_lse - new) * block_out, new


class WeightedRing(RingFlashAttn):
    def compute(self, case, shard):
        load_rings()
        import ring_flash_attn.utils
        ring_flash_attn.utils._update_out_and_lse = weighted_merge
        return super().compute(case, shard)


class WeightedVarlen(RingFlashAttnVarlen):
    def compute(self, case, shard):
        load_rings()
        import ring_flash_attn.utils
        ring_flash_attn.utils._update_out_and_lse = weighted_merge
        return super().compute(case, shard)


class WeightedYunchang(Yunchang):
    def compute(self, case, shard):
        import yunchang.ring.utils
        yunchang.ring.utils._update_out_and_lse = weighted_merge
        return super().compute(case, shard)


# the smallest float32 cases the conformance runs found over the line: (peer key, the peer with the weighted sum, case)
CASES = [
    ("ring-flash-attn/contiguous", WeightedRing("contiguous"),
     "Case(layout='contiguous', n_devices=3, B=2, S=45, Hq=2, Hkv=2, D=6, tile_size=None, causal=True, "
     "scale=-0.7, dtype=np.float32, kind='large_logits', seed=846793294)"),
    ("ring-flash-attn/contiguous", WeightedRing("contiguous"),
     "Case(layout='contiguous', n_devices=2, B=2, S=25, Hq=3, Hkv=1, D=6, tile_size=None, causal=True, "
     "scale=1.0, dtype=np.float32, kind='exact', seed=29811)"),
    ("ring-flash-attn/zigzag-varlen", WeightedVarlen("zigzag"),
     "Case(layout='zigzag', n_devices=2, B=1, S=8, Hq=2, Hkv=1, D=7, tile_size=None, causal=True, scale=1.0, "
     "dtype=np.float32, kind='exact', seed=1, cu_seqlens=(0, 4, 8))"),
    ("ring-flash-attn/contiguous", WeightedRing("contiguous"),
     "Case(layout='contiguous', n_devices=2, B=2, S=14, Hq=4, Hkv=2, D=7, tile_size=1, causal=True, scale=1.0, "
     "dtype=np.float32, kind='gaussian', seed=2)"),
    ("yunchang/ring-pytorch", WeightedYunchang(),
     "Case(layout='contiguous', n_devices=3, B=2, S=47, Hq=2, Hkv=1, D=2, tile_size=None, causal=True, "
     "scale=None, dtype=np.float32, kind='large_logits', seed=1125734)"),
    ("yunchang/ring-pytorch", WeightedYunchang(),
     "Case(layout='contiguous', n_devices=2, B=2, S=25, Hq=3, Hkv=1, D=6, tile_size=None, causal=True, "
     "scale=1.0, dtype=np.float32, kind='exact', seed=29811)"),
]
