"""ring-flash-attn (pip `ring-flash-attn`): its three rings, written in
PyTorch around flash-attn's block kernels, with `conformance.flash_attn_stand_in`
computing those kernels on the CPU:

    ring_flash_attn_func          contiguous shards (ring_flash_attn.py)
    zigzag_ring_flash_attn_func   zigzag: rank r holds chunks r and 2N-1-r of 2N (zigzag_ring_flash_attn.py)
    stripe_flash_attn_func        striped: rank r holds r, r+N, ... (stripe_flash_attn.py)

The zigzag and stripe rings are causal only (they assert it); the contiguous
ring takes both.

Its conventions, and what this adapter does about them:
- shards are the caller's, in the layouts of `reference.positions`; it does not permute;
- flash-attn's heads: query head h reads key/value head h // (Hq // Hkv), as here;
- lse is returned with `return_attn_probs=True`, (B, Hq, c), natural log;
- flash-attn takes float16 and bfloat16 only, and returns each block's out
  in that dtype before the ring merges blocks in float32 (utils.py
  `update_out_and_lse`), so 16-bit inputs are declared to accumulate in
  their own dtype (held to the float32 line instead, `python -m
  conformance --peer ring-flash-attn/zigzag --dtype float16
  --accumulate float32`, every ring fails it);
- float32 runs here because the stand-in takes it (flash-attn itself
  refuses it): what the rings do with it is what a block kernel that takes
  it would get; float64 is not run (the rings merge in float32 whatever the
  input, and under the stand-in their float64 backward ended in a gloo abort,
  "Received data size doesn't match expected size. 8 vs 4": a float64
  tensor where a float32 one was expected). The rings start their float32 accumulators with
  `block_dq_buffer.to(torch.float32)` (ring_flash_attn.py lines 134-136,
  zigzag_ring_flash_attn.py 164-166, stripe_flash_attn.py 202-204), which for
  float32 inputs is the buffer itself, not a copy, so the next block's kernel
  overwrites the sum;
- `ring_flash_attn_backward` returns `dq.to(torch.bfloat16)` whatever the
  input dtype (ring_flash_attn.py line 154; the zigzag and stripe rings
  return `dq.to(q.dtype)`); autograd casts it back, so the contiguous ring's
  dq carries bfloat16 rounding (2**-9 relative): inside the float16 line,
  outside the float32 one;
- no tile size (flash-attn chooses its own): the case's tile size is ignored;
- a sliding window is passed on as flash-attn's `window_size=(W - 1, 0)`
  causal, `(W - 1, W - 1)` not (the kit's W keys, the query's own
  included): each ring hands it to every block's kernel;
- padding (S not a multiple of the layout's unit): causal, the padding keys
  come after every real query and are never seen; full attention would see
  them: the functions take no mask (`ring_flash_attn_func(q, k, v,
  dropout_p, softmax_scale, causal, window_size, alibi_slopes, ...)`,
  ring_flash_attn.py lines 276-288), so the contiguous ring's full rows take
  no padding. The padding queries attend like real ones: the harness's
  `loss_ignores_padding`;
- the backward is theirs (each function's autograd.Function saves q, k, v,
  out and lse), taken by the harness's autograd.
"""

import numpy as np

from reference.testing import ALL_DTYPES
from reference.testing.harness.torch import TorchAdapter

FUNCTIONS = {"contiguous": "ring_flash_attn_func", "zigzag": "zigzag_ring_flash_attn_func",
             "striped": "stripe_flash_attn_func"}


class RingFlashAttn(TorchAdapter):
    library = "ring-flash-attn"
    dtypes = tuple(d for d in ALL_DTYPES if np.dtype(d) != np.float64)
    unsupported = {"float64": "flash-attn's kernels take float16 and bfloat16 only, and the rings merge "
                              "blocks in float32 (utils.py lines 40, 63)"}
    world_sizes = (2, 3, 4)
    preload = ("conformance.preload",)
    loss_ignores_padding = True
    no_key_mask = ("no key mask: ring_flash_attn_func takes q, k, v, dropout_p, softmax_scale, causal, "
                   "window_size, alibi_slopes (ring_flash_attn.py lines 276-288), so padding keys are seen "
                   "by every query")

    def __init__(self, layout):
        self.layout = layout
        self.layouts = (layout,)
        # zigzag and stripe assert causal; every ring takes a window argument
        self.masks = ("causal", "full", "window", "padding") if layout == "contiguous" else \
            ("causal", "window", "padding")
        self.key = f"ring-flash-attn/{layout}"
        self.name = f"ring-flash-attn {FUNCTIONS[layout]}"

    @classmethod
    def ring(cls):
        return cls("contiguous")

    @classmethod
    def zigzag(cls):
        return cls("zigzag")

    @classmethod
    def stripe(cls):
        return cls("striped")

    def accumulate_dtype(self, dtype):
        return np.dtype(dtype) if np.dtype(dtype).itemsize == 2 else super().accumulate_dtype(dtype)

    def compute(self, case, shard):
        fn = getattr(load_rings(), FUNCTIONS[self.layout])
        out, lse, _ = fn(shard.q, shard.k, shard.v, softmax_scale=case.scale_value, causal=case.causal,
                         window_size=window_size(case), return_attn_probs=True)   # out (B, c, Hq, D), lse (B, Hq, c)
        return dict(out=out, lse=lse)


def load_rings():
    """ring_flash_attn's three ring modules, without its package __init__, which
    also imports its Hugging Face adapter and so `transformers` (not needed
    here); the flash-attn stand-in installed first."""
    import importlib
    import importlib.util
    import sys
    import types
    from . import flash_attn_stand_in
    flash_attn_stand_in.install()
    if "ring_flash_attn" not in sys.modules:
        spec = importlib.util.find_spec("ring_flash_attn")
        package = types.ModuleType("ring_flash_attn")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["ring_flash_attn"] = package
    rings = types.SimpleNamespace()
    for module in ("ring_flash_attn", "zigzag_ring_flash_attn", "stripe_flash_attn", "ring_flash_attn_varlen",
                   "zigzag_ring_flash_attn_varlen", "llama3_flash_attn_varlen"):
        m = importlib.import_module(f"ring_flash_attn.{module}")
        for name in dir(m):
            if name.endswith("_func") or name.endswith("prepare_cu_seqlens"):
                setattr(rings, name, getattr(m, name))
    return rings


def window_size(case):
    """The kit's window W (keys a query sees, itself included) as flash-attn's (left, right)."""
    if case.window is None:
        return (-1, -1)
    return (case.window - 1, 0 if case.causal else case.window - 1)
