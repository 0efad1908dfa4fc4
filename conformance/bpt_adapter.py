"""The paper authors' JAX ring (exists-forall/striped_attention, commit 0c3ef0f, bpt.py), on the kit's JAX harness.

    git clone https://github.com/exists-forall/striped_attention && git -C striped_attention checkout 0c3ef0f
    BPT=striped_attention/bpt.py .venv-jax/bin/python -m reference.testing check \\
        conformance/bpt_adapter.py:BptStriped --world-sizes 2,3,4 --examples 40
    make conformance BPT=striped_attention/bpt.py

bpt.py is not on the package index: the adapter imports the file named by the
BPT environment variable (it needs flax and einops beside jax). Its entry point
is `ring_attention(q, k, v, attn_bias, axis_name, float32_logits,
blockwise_kwargs)` (line 111), a `jax.custom_vjp` (lines 110-115) that the
caller puts under `shard_map` (llamabpt/llama.py lines 570-598 do); the
adapter calls it as llama.py does. Its conventions, read from bpt.py at 0c3ef0f:

- Layout: the caller permutes tokens; `permute_tokens` (lines 8-12) deals
  token i to device i mod N, the kit's striped layout; "normal" is the
  contiguous one. `causal_layout` ("striped", "normal", or None: no causal
  mask) only says how the causal mask is drawn from chunk numbers
  (`_chunk_attention_bias`, lines 431-452; the skip of whole chunks, lines
  168-188 and 263-285). Adapters: BptStriped (striped), BptContiguous
  (normal); the full mask (causal=False) runs with `causal_layout=None`.
- Heads: q, k, v are (B, c, H, D) with the same H (einsum 'bqhd,bkhd',
  line 155): no grouped heads; cases with Hq != Hkv are skipped (a repeat
  of K, V in the adapter would sum the group's 16-bit dK, dV in 16 bits,
  the adapter's rounding, not bpt.py's).
- Scale: fixed, scores divided by `sqrt(D)` (lines 136, 155, 229): cases
  with another scale are skipped.
- Masks: causal from `causal_layout`; anything else only through
  `attn_bias`, added to the scores (line 157), which must be given (it is
  sliced unconditionally, lines 52-54) and is cut per key block along the
  last axis (B, 1, 1, N*c) in the devices' order. Masked scores get
  `finfo(dtype).min`, not -inf (lines 436, 451). The adapter passes a bias
  of 0 and finfo(dtype).min on padding keys (positions >= S), the padding
  mask llama.py builds (lines 556-560); windows and documents are not
  offered (a (B, H, Q, K) bias is read at global chunk offsets, line 425,
  and would need per-device rows). Padding queries still attend (their
  rows are not masked), so their outputs would carry gradients to real
  keys; the adapter zeroes the padding rows of out, as a loss that ignores
  padding does, so that no gradient flows from them.
- Chunks: each device's block of c tokens is cut into query and key
  chunks of `query_chunk_size`, `key_chunk_size`, which must divide c
  (lines 122-123, 440-441). The *chunk = c* adapters use one chunk per
  block; the *chunked* ones use c's largest proper divisor (1 for prime c).
  Each key chunk's bias is cut from the block's bias slice at the chunk's
  global offset (lines 421-428, `k_chunk_idx_start`, line 58), which
  `lax.dynamic_slice` clamps: with several chunks a block, the padding bias
  of any block but device 0's lands on the wrong keys (the chunked rows'
  padding cells).
- dtypes: with `float32_logits=True` (what llama.py passes, line 574) q and
  k are cast to float32 (lines 28-29), so numerator, denominator and max
  are float32 (lines 32-33, 62) and out is cast back to v's dtype (line 66);
  `dtype` in blockwise_kwargs is the dtype of the bias and of the masking
  value (line 467): the adapter passes the input dtype. The backward
  accumulates dQ, dK, dV in float32 (lines 74-76) and casts them to the
  inputs' dtypes (line 107); but q and k there are the residuals of line
  66, already cast to float32 (line 29), so dQ and dK of 16-bit inputs come
  back in float32 (dV in v's dtype), which JAX lets through the custom VJP.
  The adapters cast them to the input dtype (`gradient_in_dtype`), so that
  their values are checked (BptStripedAsIs does not: the kit then reports
  the dtype). Each block's dP = dO V^T is an einsum of two 16-bit arrays
  (`ds`, line 256: the cotangent g in v's dtype, and v), so it is rounded
  to 16 bits before the float32 sums read it. float64 raises: with
  float32_logits=True the numerator carry is float32 (lines 29, 32) and the
  block's `exp_values` float64 (v, line 162), so the two branches of the
  chunk skip's `lax.cond` differ (line 182); with float32_logits=False the
  forward runs and the backward raises the same way (float32 dQ, line 74,
  against float64 blocks, line 277). The adapters
  hold every dtype to the float32 line (`accumulate_dtype`); float64 is
  declared (the harness turns jax_enable_x64 on) to show it raising.
- lse: `ring_attention` returns out only; its forward keeps the row max
  and the row sum (natural base, of the scaled scores) for the backward
  (line 66). The adapter puts bpt.py's `_ring_attention_fwd` and
  `_ring_attention_bwd` together again as `ring_attention` does (lines
  110-115), its forward also returning lse = max + log(sum) from those
  residuals (`with_lse`): one forward gives out and lse.
- Backward: its own (`_ring_attention_bwd`, lines 68-108): recomputes each
  block's probabilities from the saved max and sum, sends dK, dV round the
  ring with K and V (lines 103-104); the harness takes it by `jax.vjp`.
"""

import importlib.util
import os
import sys

import numpy as np

from reference.testing import ALL_DTYPES
from reference.testing.harness.jax import JaxAdapter

COMMIT = "0c3ef0f"


def load_bpt(path=None):
    """bpt.py as a module, from `path` or the BPT environment variable."""
    path = path or os.environ.get("BPT")
    if not path:
        raise RuntimeError("set BPT to the path of bpt.py (exists-forall/striped_attention at "
                           f"{COMMIT}; see conformance/bpt_adapter.py)")
    if "bpt" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bpt", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["bpt"] = module
    return sys.modules["bpt"]


def chunk_size(c, chunked):
    """The chunk bpt.py cuts a device's block into: c, or c's largest proper divisor."""
    if not chunked:
        return c
    return max([d for d in range(1, c) if c % d == 0], default=c)


def gradient_in_dtype(x):
    """x, whose cotangent is cast to x's dtype (bpt.py's backward returns dQ, dK in float32)."""
    import jax
    same = jax.custom_vjp(lambda x: x)
    same.defvjp(lambda x: (x, None), lambda _, g: (g.astype(x.dtype),))
    return same(x)


def with_lse(bpt, axis, float32_logits, kwargs):
    """bpt.py's `ring_attention` made of its own forward and backward (lines
    110-115), returning (out, lse) too: lse = max + log(sum) from the forward's
    residuals, the ones its backward reads; no gradient flows from lse."""
    import jax
    import jax.numpy as jnp

    def forward(q, k, v, bias):
        out, saved = bpt._ring_attention_fwd(q, k, v, bias, axis, float32_logits, kwargs)
        denominator, max_score = saved[-2:]
        return (out, max_score + jnp.log(denominator)), saved

    def backward(saved, cotangents):
        return bpt._ring_attention_bwd(axis, float32_logits, kwargs, saved, cotangents[0])

    ring = jax.custom_vjp(lambda q, k, v, bias: forward(q, k, v, bias)[0])
    ring.defvjp(forward, backward)
    return ring


class Bpt(JaxAdapter):
    library = "exists-forall/striped_attention bpt.py"
    version = f"commit {COMMIT}"
    repro_env = "BPT=path/to/bpt.py "
    conventions = __name__
    causal_layout = None
    chunked = False
    float32_logits = True
    cast_gradients = True
    dtypes = ALL_DTYPES
    masks = ("causal", "full", "padding")
    world_sizes = (2, 3, 4)

    def __init__(self, path=None):
        self.path = path

    @property
    def key(self):
        return f"bpt/{self.causal_layout}" + ("/chunked" if self.chunked else "")

    def accumulate_dtype(self, dtype):
        return np.dtype(np.float32)

    def supports(self, case):
        if case.scale is not None and case.scale != case.D ** -0.5:
            return "scale: bpt.py divides scores by sqrt(D) (lines 136, 229)"
        if case.Hq != case.Hkv:
            return "grouped heads: bpt.py takes q, k, v with the same heads (line 155)"
        return super().supports(case)

    def compute(self, case, shard):
        import jax.numpy as jnp
        bpt = load_bpt(self.path)
        dtype = shard.q.dtype
        q, k, v = shard.q, shard.k, shard.v
        if self.cast_gradients:
            q, k, v = (gradient_in_dtype(x) for x in (q, k, v))
        everywhere = self.positions(case).reshape(-1)             # the key axis in the devices' order
        bias = np.where(everywhere < case.S, 0, jnp.finfo(dtype).min)[None, None, None, :]
        bias = jnp.asarray(np.broadcast_to(bias, (case.B, 1, 1, bias.shape[-1])), dtype)
        size = chunk_size(case.c, self.chunked)
        kwargs = dict(causal_layout=self.causal_layout if case.causal else None,
                      query_chunk_size=size, key_chunk_size=size, block_size=case.c, deterministic=True,
                      dropout_rng=None, attn_pdrop=0.0, dtype=dtype, policy=None,
                      precision=None, prevent_cse=True)
        out, lse = with_lse(bpt, shard.axis, self.float32_logits, kwargs)(q, k, v, bias)
        out = jnp.where((shard.positions < case.S)[None, :, None, None], out, 0)   # a loss's padding mask
        return dict(out=out, lse=lse.astype(jnp.float64 if dtype == jnp.float64 else jnp.float32))


class BptStriped(Bpt):
    """bpt.py with causal_layout="striped", one chunk per device block."""
    name = "bpt.py ring_attention, striped"
    layouts = ("striped",)
    causal_layout = "striped"


class BptContiguous(Bpt):
    """bpt.py with causal_layout="normal", one chunk per device block."""
    name = "bpt.py ring_attention, normal"
    layouts = ("contiguous",)
    causal_layout = "normal"


class BptStripedAsIs(BptStriped):
    """Striped, dQ and dK returned in the dtype bpt.py gives them (16-bit: the rest is BptStriped's)."""
    name = "bpt.py ring_attention, striped, gradients as returned"
    cast_gradients = False
    dtypes = ALL_DTYPES[2:]

    @property
    def key(self):
        return "bpt/striped/gradients-as-returned"


class BptStripedExactLogits(BptStriped):
    """Striped with float32_logits=False (q, k in the input dtype)."""
    name = "bpt.py ring_attention, striped, float32_logits=False"
    float32_logits = False


class BptStripedChunked(BptStriped):
    """Striped, each block cut into chunks of c's largest proper divisor."""
    name = "bpt.py ring_attention, striped, chunked"
    chunked = True


class BptContiguousChunked(BptContiguous):
    """Normal, each block cut into chunks of c's largest proper divisor."""
    name = "bpt.py ring_attention, normal, chunked"
    chunked = True
