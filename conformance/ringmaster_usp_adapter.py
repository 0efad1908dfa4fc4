"""axolotl-ringmaster (pip `axolotl-ringmaster` 0.2.7): its Ulysses and USP
(Ulysses x ring), the attention functions its `setup()` registers with
transformers, called as transformers calls them (module, q, k, v, mask, ...):

    make_ulysses_attention("sdpa")                      strategies/ulysses.py lines 100-225: all-to-all
                                                        (sequence shard -> head shard, comm.seq_all_to_all),
                                                        transformers' `sdpa_attention_forward` on the whole
                                                        sequence, all-to-all back; with sliding_window, an
                                                        explicit mask (`_ulysses_varlen`, lines 58-77)
    make_usp_attention("math", "math", rotate_method)   strategies/usp.py lines 85-166: the all-to-all over
                                                        the Ulysses group, ring attention over the ring group
                                                        on `math_block`, the CPU block ringmaster ships for
                                                        gloo (kernels.py line 54; `setup()` would pick a
                                                        flash or aten block, both CUDA only), all-to-all back

with u x r = N Ulysses x ring ranks as ringmaster's `build_runtime` wires them
(mesh.py lines 99-139): `ringmaster/ulysses` is u = N (its Backend.ULYSSES);
`ringmaster/usp-allgather`, `ringmaster/usp-p2p` are the split of
conformance.yunchang_usp_adapter.usp_split (1 x 2, 1 x 3, 2 x 2), K/V all-gathered
or rotated one hop a round.

Its conventions, and what this adapter does about each:
- layout in: (B, H, c, D) (the adapter transposes); out: (B, c, Hq, D). The
  (ring, ulysses) mesh numbers ranks with the Ulysses groups innermost
  (mesh.py lines 131-138) and the all-to-all concatenates a group's shards in
  rank order (comm.py lines 17-52: on gloo an all_gather emulation), so rank g
  holds piece g % u of ring rank g // u's contiguous shard
  (`reference.layouts.ulysses_positions`, contiguous: the kit's contiguous
  layout); ringmaster shards Ulysses and USP contiguously (runtime.py lines
  62-73);
- a Ulysses group of one rank (u = 1): ringmaster itself routes that to its
  ring backend (usp.py lines 74-79); here the USP function gets a one-rank
  group (`dist.new_group([rank])`), on which the all-to-all is the identity
  (comm.py line 48), so at N = 2, 3 the USP rows run its ring through USP;
- heads: Hq and Hkv both multiples of u (ulysses.py lines 142-149 refuse
  others; the all-to-all chunks the head dimension, comm.py line 51:
  `head_multiple`); transformers' sdpa function reads the group size from
  `module.num_key_value_groups` (sdpa_attention.py line 118; set on the
  module handed in, as a model's attention layer has it) and `math_block`
  repeats K/V heads with `repeat_interleave` (kernels.py line 62): query head
  h reads key/value head h // (Hq // Hkv), as here;
- scale: `scaling`; no lse (both return `out, None`), so lse is not checked;
- precision: `math_block` computes in float32 (`.float()`) and returns the
  input dtype: float64 is declared to accumulate in float32 for USP, as the
  code does. Ulysses runs torch's CPU SDPA kernel in the input dtype, whose
  16-bit results are held to the 16-bit line, as in the torch context
  parallel rows (its C++ is not in the wheel; on float16 it is 1.2x over the
  float32 line already at S = 4, N = 2);
- packed documents: the global `cu_seqlens` of the step and their longest
  length in `runtime.varlen`, as its context manager sets them
  (runtime.py lines 33-36; one packed sequence, B = 1); Ulysses then masks
  the gathered sequence by document (ulysses.py lines 58-77), USP takes
  the gathered doc-masked path (`varlen_ring_attention`, usp.py lines
  126-148), whatever the rotation: the p2p rows take neither documents nor
  windows, which would run the all-gather rows' path;
- windows: ringmaster takes Hugging Face's `sliding_window` (W keys, causal,
  `window = (W - 1, 0)`, usp.py line 117), passed as `sliding_window=W`; it
  limits the left side only, so a non-causal window is the kit's to hold it to;
- torch's CPU SDPA returns NaN for a causal call with a negative scale (see
  the torch context parallel rows): the Ulysses rows skip those cases;
- the backward is theirs (autograd through the all-to-alls, whose backward
  is the inverse all-to-all, comm.py lines 80-84, through SDPA or the ring),
  taken by the harness's autograd.
"""

import numpy as np

from reference.layouts import ulysses_positions
from reference.testing import ALL_DTYPES
from reference.testing.harness.torch import TorchAdapter

from .torch_context_parallel_adapter import CPU_SDPA_NAN, cpu_sdpa_nan
from .yunchang_usp_adapter import usp_split

_RUNTIMES = {}                 # (u, r) -> ringmaster's CPRuntime, its groups made once per world


class RingmasterUSP(TorchAdapter):
    library = "axolotl-ringmaster"
    layouts = ("contiguous",)
    dtypes = ALL_DTYPES
    masks = ("causal", "full", "window", "cu_seqlens")
    outputs = ("out", "dq", "dk", "dv")
    world_sizes = (2, 3, 4)
    preload = ("conformance.preload",)
    conventions = __name__

    def __init__(self, entry):
        self.entry = entry                       # "ulysses", "usp-allgather", "usp-p2p"
        self.key = f"ringmaster/{entry}"
        self.name = {"ulysses": "axolotl-ringmaster Ulysses (sdpa)",
                     "usp-allgather": "axolotl-ringmaster USP (all-gather ring, math block)",
                     "usp-p2p": "axolotl-ringmaster USP (p2p ring, math block)"}[entry]
        if entry == "usp-p2p":
            self.masks = ("causal", "full")      # its windows and documents take the all-gather rows' path

    def split(self, n):
        return (n, 1) if self.entry == "ulysses" else usp_split(n)

    def head_multiple(self, n):
        return self.split(n)[0]

    def positions(self, case):
        u, r = self.split(case.n_devices)
        return ulysses_positions(case.S, r, u, "contiguous")

    def accumulate_dtype(self, dtype):
        if self.entry == "ulysses" and np.dtype(dtype).itemsize == 2:
            return np.dtype(dtype)              # torch's CPU SDPA, as in the torch context parallel rows
        if self.entry != "ulysses" and np.dtype(dtype) == np.float64:
            return np.dtype(np.float32)         # math_block's .float()
        return super().accumulate_dtype(dtype)

    def supports(self, case):
        if case.cu_seqlens is not None and case.B != 1:
            return "packed documents: one packed sequence (B = 1)"
        if self.entry == "ulysses" and cpu_sdpa_nan(case):       # (its blocks: torch's SDPA)
            return CPU_SDPA_NAN
        return super().supports(case)

    def compute(self, case, shard):
        import torch
        from ringmaster.config import RotateMethod
        from ringmaster.runtime import set_runtime
        from ringmaster.strategies.ulysses import make_ulysses_attention
        from ringmaster.strategies.usp import make_usp_attention
        runtime = _runtime(*self.split(case.n_devices), shard.rank)
        runtime.varlen = None if case.cu_seqlens is None else \
            (torch.tensor(case.cu_seqlens, dtype=torch.int32), max(np.diff(case.cu_seqlens)))
        set_runtime(runtime)
        if self.entry == "ulysses":
            forward = make_ulysses_attention("sdpa")
        else:
            rotate = RotateMethod.ALLTOALL if self.entry == "usp-p2p" else RotateMethod.ALLGATHER
            forward = make_usp_attention("math", "math", rotate)
        module = torch.nn.Module()
        module.num_key_value_groups = case.Hq // case.Hkv                           # as a model's attention layer
        q, k, v = (x.transpose(1, 2) for x in (shard.q, shard.k, shard.v))        # (B, H, c, D)
        out, _ = forward(module, q, k, v, None, scaling=case.scale_value, is_causal=case.causal,
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
