"""axolotl-ringmaster (pip `axolotl-ringmaster` 0.2.7): its Ulysses all-to-all and
USP (Ulysses x ring), on the CPU block kernel it ships for gloo:

    make_usp_attention("math", "math", rotate_method)   strategies/usp.py lines 319-398: Ulysses all-to-all
                                                        over the Ulysses group (comm.seq_all_to_all), ring
                                                        attention over the ring group (ring/loop.py, `math_block`),
                                                        all-to-all back; with sliding_window, the gathered
                                                        doc-masked path (`varlen_ring_attention`)

run with u x r = N Ulysses x ring ranks as ringmaster's `build_runtime` wires them
(mesh.py lines 99-139): `ringmaster/ulysses` is u = N, r = 1 (the ring group is
None and the block runs once on the whole sequence, loop.py lines 35-47: the
Ulysses leg); `ringmaster/usp-allgather`, `ringmaster/usp-p2p` are the split of
peers.yunchang_usp_adapter.usp_split (1 x 2, 1 x 3, 2 x 2), K/V all-gathered
or rotated.

Its conventions, and what this adapter does about each:
- layout in: (B, H, c, D) (the adapter transposes); out: (B, c, Hq, D). The
  (ring, ulysses) mesh numbers ranks with the Ulysses groups innermost
  (mesh.py lines 131-138) and the all-to-all concatenates a group's shards in
  rank order (comm.py lines 17-52: on gloo an all_gather emulation), so rank g
  holds piece g % u of ring rank g // u's contiguous shard
  (`reference.layouts.ulysses_positions`, contiguous: the kit's contiguous
  layout); ringmaster shards USP contiguously (runtime.py lines 152-163);
- a Ulysses group of one rank (u = 1): ringmaster itself routes that to its
  ring backend (usp.py lines 308-313); here the USP function gets a one-rank
  group (`dist.new_group([rank])`), on which the all-to-all is the identity
  (comm.py line 48), so at N = 2, 3 the USP rows run its ring;
- heads: Hq and Hkv both multiples of u (the all-to-all chunks the head
  dimension, comm.py line 51; `head_multiple`); the block repeats K/V heads
  with `repeat_interleave` (kernels.py line 62): query head h reads key/value
  head h // (Hq // Hkv), as here;
- scale: `scaling`; no lse (the function returns out; `return out, None`), so
  lse is not checked;
- precision: `math_block` computes in float32 (`.float()`) and returns the
  input dtype: float64 is declared to accumulate in float32, as the code
  does; the windowed path calls `scaled_dot_product_attention` on the input
  dtype (loop.py line 189);
- windows: ringmaster takes Hugging Face's `sliding_window` (W keys, causal:
  `window = (W - 1, 0)`, usp.py line 351), passed as `sliding_window=W`; it
  limits the left side only, so non-causal windows are the kit's to hold it to;
- the backward is theirs (autograd through the all-to-alls, whose backward
  is the inverse all-to-all, comm.py lines 80-84, and through the ring),
  taken by the harness's autograd.
"""

import numpy as np

from reference.layouts import ulysses_positions
from reference.testing import ALL_DTYPES
from reference.testing.harness.torch import TorchAdapter

from .yunchang_usp_adapter import usp_split

_RUNTIMES = {}                 # (u, r) -> ringmaster's CPRuntime, its groups made once per world


class RingmasterUSP(TorchAdapter):
    library = "axolotl-ringmaster"
    layouts = ("contiguous",)
    dtypes = ALL_DTYPES
    masks = ("causal", "full", "window")
    outputs = ("out", "dq", "dk", "dv")
    world_sizes = (2, 3, 4)
    preload = ("peers.preload",)
    conventions = __name__

    def __init__(self, entry):
        self.entry = entry                       # "ulysses", "usp-allgather", "usp-p2p"
        self.key = f"ringmaster/{entry}"
        self.name = {"ulysses": "axolotl-ringmaster Ulysses (USP function, ring_size 1)",
                     "usp-allgather": "axolotl-ringmaster USP (all-gather ring)",
                     "usp-p2p": "axolotl-ringmaster USP (p2p ring)"}[entry]
        if entry == "usp-p2p":
            self.masks = ("causal", "full")      # the p2p ring refuses windows (loop.py lines 52-57)

    def split(self, n):
        return (n, 1) if self.entry == "ulysses" else usp_split(n)

    def head_multiple(self, n):
        return self.split(n)[0]

    def positions(self, case):
        u, r = self.split(case.n_devices)
        return ulysses_positions(case.S, r, u, "contiguous")

    def accumulate_dtype(self, dtype):
        return np.dtype(np.float32) if np.dtype(dtype) == np.float64 else super().accumulate_dtype(dtype)

    def compute(self, case, shard):
        import torch
        from ringmaster.config import RotateMethod
        from ringmaster.runtime import set_runtime
        from ringmaster.strategies.usp import make_usp_attention
        set_runtime(_runtime(*self.split(case.n_devices), shard.rank))
        rotate = RotateMethod.ALLTOALL if self.entry == "usp-p2p" else RotateMethod.ALLGATHER
        forward = make_usp_attention("math", "math", rotate)
        q, k, v = (x.transpose(1, 2) for x in (shard.q, shard.k, shard.v))        # (B, H, c, D)
        out, _ = forward(torch.nn.Module(), q, k, v, None, scaling=case.scale_value, is_causal=case.causal,
                         sliding_window=case.window)
        return dict(out=out)                                                       # (B, c, Hq, D)


def _runtime(u, r, rank):
    """ringmaster's runtime for u x r, its groups made by `build_runtime` (every rank
    makes every group, in one order) the first time; a one-rank Ulysses group for u = 1."""
    if (u, r) not in _RUNTIMES:
        import torch.distributed as dist
        from ringmaster.config import RingmasterConfig
        from ringmaster.mesh import build_runtime
        runtime = build_runtime(RingmasterConfig(size=u * r, ulysses_size=u, ring_size=r), device_type="cpu")
        if u == 1:
            singles = [dist.new_group([g]) for g in range(r)]
            runtime.ulysses_group = singles[rank]
        _RUNTIMES[(u, r)] = runtime
    return _RUNTIMES[(u, r)]
