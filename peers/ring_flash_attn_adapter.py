"""ring-flash-attn (pip `ring-flash-attn`): its three rings, written in
PyTorch around flash-attn's block kernels, with `peers.flash_attn_stand_in`
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
- flash-attn takes float16 and bfloat16 only (NumPy has no bfloat16, so
  float16 runs here), and returns each block's out in that dtype before the
  ring merges blocks in float32 (utils.py `update_out_and_lse`), so float16
  inputs are declared to accumulate in float16 (held to the float32 line
  instead, `python -m peers.conformance --peer ring-flash-attn/zigzag
  --accumulate float32`, every ring fails it, the shrunk cases' first bad
  elements 1.1 to 9 times over it; against the
  float16 line they use less than a tenth of it: see "line used" in the
  table). float32 is not run: the rings
  start their float32 accumulators with `block_dq_buffer.to(torch.float32)`
  (ring_flash_attn.py lines 134-136, zigzag_ring_flash_attn.py 164-166,
  stripe_flash_attn.py 202-204), which for float32 inputs is the buffer
  itself, not a copy, so the next block's kernel overwrites the sum;
- no tile size (flash-attn chooses its own): the case's tile size is ignored;
- read in the code, not measured: `ring_flash_attn_backward` returns
  `dq.to(torch.bfloat16)` whatever the input dtype (ring_flash_attn.py line
  154; the zigzag and stripe rings return `dq.to(q.dtype)`); autograd casts it
  back to float16, so the contiguous ring's dq carries bfloat16 rounding
  (2**-9 relative), which lies inside the float16 line (compare the dq "line
  used" of the contiguous ring with the zigzag and stripe rings' in the table).
"""

import numpy as np

from .adapter import PeerAdapter, to_numpy, to_torch

FUNCTIONS = {"contiguous": "ring_flash_attn_func", "zigzag": "zigzag_ring_flash_attn_func",
             "striped": "stripe_flash_attn_func"}


class RingFlashAttn(PeerAdapter):
    library = "ring-flash-attn"
    dtypes = (np.float16,)

    def __init__(self, layout):
        self.layout = layout
        self.layouts = (layout,)
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
        return np.dtype(dtype) if np.dtype(dtype) == np.float16 else super().accumulate_dtype(dtype)

    def supports(self, case):
        if self.layout != "contiguous" and not case.causal:
            return f"{FUNCTIONS[self.layout]} is causal only (it asserts causal)"
        return super().supports(case)

    def compute(self, case, mine, rank):
        fn = getattr(load_rings(), FUNCTIONS[self.layout])
        q, k, v = (to_torch(mine[name], requires_grad=True) for name in ("q", "k", "v"))
        scale = case.scale if case.scale is not None else case.D ** -0.5
        out, lse, _ = fn(q, k, v, softmax_scale=scale, causal=case.causal, return_attn_probs=True)
        out.backward(to_torch(mine["dout"]))
        return dict(out=to_numpy(out), lse=to_numpy(lse), dq=to_numpy(q.grad), dk=to_numpy(k.grad),
                    dv=to_numpy(v.grad))


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
    for module in ("ring_flash_attn", "zigzag_ring_flash_attn", "stripe_flash_attn"):
        m = importlib.import_module(f"ring_flash_attn.{module}")
        for name in FUNCTIONS.values():
            if hasattr(m, name):
                setattr(rings, name, getattr(m, name))
    return rings
