"""yunchang (pip `yunchang` 0.6.4, feifeibear/long-context-attention) beyond its
torch ring: its own copies of ring-flash-attn's three rings, its Ulysses
attention and USP (Ulysses x ring), with `conformance.flash_attn_stand_in` computing
flash-attn's kernels on the CPU (`conformance.preload` installs it before yunchang is
imported: yunchang decides at import whether flash-attn is there,
`HAS_FLASH_ATTN`, globals.py lines 84-87):

    ring_flash_attn_func, zigzag_ring_flash_attn_func,    ring/ring_flash_attn.py, zigzag_ring_flash_attn.py,
    stripe_flash_attn_func (attn_type=AttnType.FA)        stripe_flash_attn.py: ring-flash-attn 0.1.x's rings,
                                                          the kernel chosen by `select_flash_attn_impl`
    UlyssesAttention(attn_type=AttnType.FA)               ulysses/attn_layer.py: all-to-all (sequence shard ->
                                                          head shard), `flash_attn_func` on the whole sequence,
                                                          all-to-all back
    LongContextAttention(ring_impl_type=...)              hybrid/attn_layer.py: USP, the all-to-all over the
                                                          Ulysses group, then the ring over the ring group
    UlyssesAttention(attn_type=AttnType.TORCH_FLASH)      the same Ulysses with a PyTorch kernel, and USP's
    LongContextAttention("basic", AttnType.TORCH_MATH)    basic ring with PyTorch's math kernel
    LongContextAttention("basic", use_pack_qkv=True)      q, k, v in one all-to-all (hybrid/attn_layer.py lines 86-109)
    ring_flash_attn_varlen_func,                          ring/ring_flash_attn_varlen.py,
    zigzag_ring_flash_attn_varlen_func                    zigzag_ring_flash_attn_varlen.py: ring-flash-attn's varlen
                                                          rings, run as conformance.ring_flash_attn_varlen_adapter runs
                                                          those (its conventions)

Its conventions, and what this adapter does about each:
- layout (B, c, H, D), the caller shards. The rings take the kit's contiguous,
  zigzag and striped layouts as they are. USP's ranks are numbered with the
  Ulysses groups innermost (`set_seq_parallel_pg(u, r, rank, N)`, default
  `use_ulysses_low=True`, globals.py lines 39-57: Ulysses group i is ranks
  i*u .. i*u+u-1, ring group j is ranks j, j+u, ...), and the all-to-all
  concatenates a Ulysses group's shards in rank order (comm/all_to_all.py
  lines 37-67), so rank g holds piece g % u of ring rank g // u's tokens:
  `reference.layouts.ulysses_positions`, which is what yunchang's own
  `basic_extract_local`, `zigzag_extract_local` and `stripe_extract_local`
  deal (comm/extract_local.py);
- the `use_ulysses_low=False` rows (ring groups consecutive instead,
  globals.py lines 59-78, rank g is ring rank g % r and Ulysses rank g // r:
  `ulysses_positions(..., ulysses_inner=False)` is what the ring then needs)
  deal the tokens as yunchang's own extract functions do: `basic_extract_local`
  and `stripe_extract_local` cut by the global rank (comm/extract_local.py
  lines 19, 26), whatever the groups; `zigzag_extract_local` by the ring and
  Ulysses group ranks (lines 38-45);
- the split: USP runs u x r = N with the ring at least as long as the
  Ulysses group (u the largest divisor of N with u * u <= N: 1 x 2, 1 x 3,
  2 x 2), because a ring of one rank sends its dK, dV to itself in the
  backward (ring_flash_attn.py line 141), which gloo refuses; Ulysses alone
  is UlyssesAttention (u = N);
- heads: the all-to-all reshapes (B, c, u, H / u, D) (all_to_all.py line
  46), so Hq and Hkv must both be multiples of u (`head_multiple`); after it
  rank g holds query heads (g % u) * Hq / u ... and the matching key/value
  heads, and flash-attn's rule (query head h reads key/value head
  h // (Hq // Hkv)) holds within a rank as across the whole: as here;
- scale: `softmax_scale`, default D ** -0.5; passed;
- lse: the rings return it with `return_attn_probs=True`, (B, Hq, c),
  natural log, float32; UlyssesAttention and LongContextAttention return out
  only (hybrid/attn_layer.py line 146 drops it), so lse is not checked there;
- precision: each block's out comes back from flash-attn in the input dtype
  before the float32 merge (ring/utils.py lines 17, 40), so the rings' and
  USP's 16-bit inputs are declared to accumulate in their own dtype; Ulysses
  is one kernel call (float32 arithmetic, one rounding at the end): float32.
  flash-attn takes float16 and bfloat16 only; float32 runs because the
  stand-in takes it (as for ring-flash-attn); float64 is not run (the rings
  merge in float32 whatever the input);
- windows: `window_size=(W - 1, 0)` causal, `(W - 1, W - 1)` not, handed to
  every block's kernel by the rings (ring_flash_attn.py line 44) and to the
  one kernel call by Ulysses; zigzag and stripe assert causal
  (zigzag_ring_flash_attn.py line 19, stripe_flash_attn.py line 20); the
  PyTorch kernels drop `window_size` (kernels/attention.py lines 44-136), so
  their rows take none;
- the backward is theirs: the rings' autograd Functions save q, k, v, out and
  lse and run their reverse rings (dq returned `.to(torch.bfloat16)` by the
  basic ring whatever the input, ring_flash_attn.py line 147); Ulysses'
  all-to-all is its own inverse in the backward (all_to_all.py lines
  124-134); the PyTorch kernels' backward raises (kernels/attention.py
  line 159);
- not run: `AsyncLongContextAttention` makes a CUDA stream in its constructor
  (`torch.cuda.Stream()`, hybrid/async_attn_layer.py line 34); the
  qkv-packed entry points; the flashinfer, NPU and sage attention types;
- `AttnType.TORCH_FLASH` runs `aten._scaled_dot_product_flash_attention`, which
  has no CPU kernel: the module's name for it is pointed at the CPU op (as in
  conformance/yunchang_adapter.py), and causal cases with a negative scale are
  skipped there (the CPU kernel's NaN, see the torch context parallel rows).
"""

import numpy as np

from reference.layouts import ulysses_positions
from reference.testing import ALL_DTYPES
from reference.testing.harness.torch import TorchAdapter

from .ring_flash_attn_adapter import window_size
from .ring_flash_attn_varlen_adapter import FUNCTIONS as VARLEN_FUNCTIONS
from .ring_flash_attn_varlen_adapter import RingFlashAttnVarlen
from .torch_context_parallel_adapter import CPU_SDPA_NAN, cpu_sdpa_nan

FLASH_DTYPES = tuple(d for d in ALL_DTYPES if np.dtype(d) != np.float64)
NO_FLOAT64 = {"float64": "flash-attn's kernels take float16 and bfloat16 only, and the rings merge blocks in "
                         "float32 whatever the input (ring/utils.py lines 17, 40)"}
ULYSSES_NO_FLOAT64 = {"float64": "flash-attn's `flash_attn_func` takes float16 and bfloat16 only (float32 runs "
                                 "on the stand-in, as for the rings; in float64 the stand-in alone would be tested)"}
TORCH_NO_FLOAT64 = {"float64": "not run: the ring merges blocks in float32 whatever the input (ring/utils.py lines "
                               "17, 40; the ring_pytorch_attn_func rows show it)"}
# yunchang's ring_impl_type, the kit's layout it deals, the function it names (hybrid/utils.py RING_IMPL_DICT)
RINGS = {"basic": ("contiguous", "ring_flash_attn_func"), "zigzag": ("zigzag", "zigzag_ring_flash_attn_func"),
         "strip": ("striped", "stripe_flash_attn_func")}
_GROUPS = {}                   # (u, r, low) -> yunchang's (Ulysses, ring) process groups, made once per world


def usp_split(n):
    """(u, r): the Ulysses degree u, the largest divisor of n with u * u <= n, and the ring degree r = n // u."""
    u = max(d for d in range(1, n + 1) if n % d == 0 and d * d <= n)
    return u, n // u


class _Yunchang(TorchAdapter):
    library = "yunchang"
    world_sizes = (2, 3, 4)
    preload = ("conformance.preload",)
    conventions = __name__                  # the module whose docstring CONFORMANCE.md quotes
    dtypes = FLASH_DTYPES
    unsupported = NO_FLOAT64

    def accumulate_dtype(self, dtype):
        return np.dtype(dtype) if np.dtype(dtype).itemsize == 2 else super().accumulate_dtype(dtype)


class YunchangRing(_Yunchang):
    """One of yunchang's flash-attn rings, called directly (out and lse)."""

    def __init__(self, ring):
        self.ring = ring
        self.layouts = (RINGS[ring][0],)
        self.masks = ("causal", "full", "window") if ring == "basic" else ("causal", "window")
        self.key = f"yunchang/ring-{ring}"
        self.name = f"yunchang {RINGS[ring][1]}"

    def compute(self, case, shard):
        import torch.distributed as dist
        import yunchang.ring as rings
        _require_stand_in()
        out, lse, _ = getattr(rings, RINGS[self.ring][1])(
            shard.q, shard.k, shard.v, softmax_scale=case.scale_value, causal=case.causal,
            window_size=window_size(case), return_attn_probs=True, group=dist.group.WORLD)
        return dict(out=out, lse=lse)            # (B, c, Hq, D), (B, Hq, c)


class YunchangUlysses(_Yunchang):
    """UlyssesAttention over the whole world (u = N), flash-attn's kernel or a PyTorch one."""
    layouts = ("contiguous",)
    outputs = ("out", "dq", "dk", "dv")

    def __init__(self, torch_kernel=False):
        self.torch_kernel = torch_kernel
        self.masks = ("causal", "full") if torch_kernel else ("causal", "full", "window")
        self.key = "yunchang/ulysses-torch-flash" if torch_kernel else "yunchang/ulysses"
        self.name = f"yunchang UlyssesAttention ({'AttnType.TORCH_FLASH' if torch_kernel else 'AttnType.FA'})"

    def accumulate_dtype(self, dtype):
        return super().accumulate_dtype(dtype) if self.torch_kernel else TorchAdapter.accumulate_dtype(self, dtype)

    @property
    def unsupported(self):
        return TORCH_NO_FLOAT64 if self.torch_kernel else ULYSSES_NO_FLOAT64

    def head_multiple(self, n):
        return n

    def supports(self, case):
        if self.torch_kernel and cpu_sdpa_nan(case):
            return CPU_SDPA_NAN
        return super().supports(case)

    def compute(self, case, shard):
        import torch.distributed as dist
        from yunchang import UlyssesAttention
        from yunchang.kernels import AttnType
        attn_type = AttnType.TORCH_FLASH if self.torch_kernel else AttnType.FA
        if self.torch_kernel:
            _cpu_flash_kernel()
        else:
            _require_stand_in()
        attn = UlyssesAttention(sequence_process_group=dist.group.WORLD, attn_type=attn_type)
        out = attn(shard.q, shard.k, shard.v, softmax_scale=case.scale_value, causal=case.causal,
                   window_size=window_size(case))
        return dict(out=out)                     # (B, c, Hq, D)


class YunchangUSP(_Yunchang):
    """LongContextAttention: Ulysses over u ranks, a ring over r = N / u (`usp_split`)."""
    outputs = ("out", "dq", "dk", "dv")

    def __init__(self, ring, torch_math=False, ulysses_low=True, pack_qkv=False):
        self.ring, self.torch_math, self.ulysses_low, self.pack_qkv = ring, torch_math, ulysses_low, pack_qkv
        self.layouts = (RINGS[ring][0],)
        self.masks = ("causal", "full") if torch_math else \
            ("causal", "full", "window") if ring == "basic" else ("causal", "window")
        self.key = "yunchang/usp-" + ("" if ulysses_low else "ring-groups-inner-") + ring + \
            ("-torch-math" if torch_math else "") + ("-pack-qkv" if pack_qkv else "")
        self.unsupported = TORCH_NO_FLOAT64 if torch_math else NO_FLOAT64
        self.name = f"yunchang LongContextAttention (USP, ring_impl_type={ring!r}" + \
            (", AttnType.TORCH_MATH" if torch_math else "") + ("" if ulysses_low else ", use_ulysses_low=False") + \
            (", use_pack_qkv=True" if pack_qkv else "") + ")"
        if pack_qkv:                            # it raises before any arithmetic: one dtype, no mask options
            self.dtypes, self.masks = (np.float16,), ("causal", "full")
            self.unsupported = {**NO_FLOAT64, **{name: "not run: `use_pack_qkv=True` raises before any arithmetic, "
                                                       "in every dtype (the float16 rows)"
                                                 for name in ("float32", "bfloat16")}}

    def head_multiple(self, n):
        return usp_split(n)[0]

    def positions(self, case):
        """Where yunchang's extract function for this ring puts the tokens (comm/extract_local.py)."""
        u, r = usp_split(case.n_devices)
        by_group_ranks = self.ring == "zigzag"           # the others cut by the global rank
        return ulysses_positions(case.S, r, u, case.layout, ulysses_inner=self.ulysses_low or not by_group_ranks)

    def compute(self, case, shard):
        from yunchang import LongContextAttention
        from yunchang.kernels import AttnType
        if not self.torch_math:
            _require_stand_in()
        u, r = usp_split(case.n_devices)
        _seq_parallel_groups(u, r, shard.rank, case.n_devices, self.ulysses_low)
        attn = LongContextAttention(ring_impl_type=self.ring, use_pack_qkv=self.pack_qkv,
                                    attn_type=AttnType.TORCH_MATH if self.torch_math else AttnType.FA)
        out = attn(shard.q, shard.k, shard.v, softmax_scale=case.scale_value, causal=case.causal,
                   window_size=window_size(case))
        return dict(out=out)                     # (B, c, Hq, D)


class YunchangVarlen(RingFlashAttnVarlen):
    """yunchang's copies of ring-flash-attn's varlen rings, on the same sharding and call. They
    call flash-attn's varlen kernels as flash-attn before 2.6.3 took them (`window_size=`, eight
    results: ring_flash_attn_varlen.py lines 56-67), not as the stand-in (2.6+) does."""
    library = "yunchang"
    conventions = __name__
    dtypes = (np.float16,)
    unsupported = {**NO_FLOAT64, **{name: "not run: the varlen kernel call raises before any arithmetic, in every "
                                          "dtype (the float16 rows)" for name in ("float32", "bfloat16")}}

    def __init__(self, function):
        super().__init__(function)
        self.key = f"yunchang/{function}-varlen"
        self.name = f"yunchang {VARLEN_FUNCTIONS[function]}"

    def rings(self):
        import yunchang.ring as rings
        _require_stand_in()
        return rings


def _seq_parallel_groups(u, r, rank, n, ulysses_low=True):
    """yunchang's process groups for u x r, made by `set_seq_parallel_pg` (every
    rank makes every group, in one order) the first time, then set again."""
    from yunchang import set_seq_parallel_pg
    from yunchang.globals import PROCESS_GROUP
    if (u, r, ulysses_low) not in _GROUPS:
        set_seq_parallel_pg(u, r, rank, n, use_ulysses_low=ulysses_low)
        _GROUPS[(u, r, ulysses_low)] = (PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG)
    PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = _GROUPS[(u, r, ulysses_low)]


def _require_stand_in():
    import yunchang.globals
    if not yunchang.globals.HAS_FLASH_ATTN:
        raise RuntimeError("yunchang was imported before the flash-attn stand-in was installed "
                           "(import conformance.preload first): its flash-attn paths are off")


def _cpu_flash_kernel():
    """Point yunchang's name for aten's CUDA flash SDPA op at the CPU one (same arguments, out and lse first)."""
    import torch
    import yunchang.kernels.attention as kernels
    kernels._scaled_dot_product_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
